"""What is known to pay, as a factor on the rate, to order the candidates before measuring.

Only the order comes from here: the measurement decides. Each factor is a rough rate ratio
against the config's own value, from the measurements in docs/benchmarks.md (one H200) or,
for a CPU, what autocast and compilation do there:

    setting                   GPU                                         CPU
    bf16                      1.5  tensor cores, half the bytes moved     0.7  (autocast costs)
    fp16                      1.45 as bf16, plus loss scaling's checks    0.5
    fp8                       1.15 with hidden >= 2048 (1.17x on a 1B     0.3  (emulated)
                                   decoder); 0.9 below (the casts cost
                                   more than small matmuls gain)
    compile                   1.3  fused elementwise work                 1.1
    compile(reduce-overhead)  1.6  below 200M parameters (launch-bound:   -    (no CUDA graphs:
                                   2x on a small encoder), 1.25 above           not tried)
    unpad / packing           1.4  padding skipped (2.8x on short-        1.3
                                   document pretraining, 1.09x on long)
    liger                     1.1  with a vocabulary >= 32k (the logits   -    (CUDA only)
                                   never exist); 1.0 below
    no kernels                0.8  where kernels=auto picks liger (1.23x  -    (auto is the
                                   on LoRA SFT at 1B)                          model's own there)
    mbs x2 / x4               1.1 / 1.15 below 200M parameters (fewer,    1.05 / 1.05
                                   larger kernels), 1.03 / 1.03 above
    mbs / 2                   0.9  (only pays when the larger one does    0.95
                                   not fit)
    checkpoint_activations    0.75 (a third more compute; pays only when  0.75
                                   it lets a larger micro batch fit)
    fused adapters            1.0  (2-4 % fewer tokens/s, a first step    1.0
                                   of 1.6 s against 8 s and 4.5 GB less
                                   at 1B: a wash until measured)

A candidate's prior is the product of its settings' factors (the reference's is 1), each
against the config's own value where the candidate replaces it (precision, graph: eager against
a compiled config is 1 / 1.3 on a GPU); settings not in the table (hand-picked ones) count 1.

What a setting costs once a run, before its rate pays (compilation of the training step and of
the evaluation, CUDA graph recording), in seconds: compile 40 on a GPU and 25 on a CPU,
reduce-overhead 60 (one H200: a small encoder's 3-epoch MRPC run took 68 s longer with CUDA
graphs than eager, a 1B decoder's first compiled step 27-50 s; a CPU's tiny BERT compiles its
step and evaluation in about 30 s). With the run's length known (the reference's rate times
its steps), the candidates are ordered by their expected time to result, their graph's
once-cost + the reference's training time / prior, so a short run measures what can pay on it
first; on a long run the order is the priors'. One expected no sooner than the config as given
(its own graph's once-cost + its training time) is not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from rapidformer.tuning.space import Setting

SMALL_MODEL = 200_000_000
LARGE_HIDDEN = 2048
LARGE_VOCAB = 32_000


@dataclass(frozen=True)
class Context:
    """What the factors depend on: the device kind and the model's and batch's size."""
    on_gpu: bool
    parameters: int
    hidden: int
    vocab: int
    micro_batch_size: int


def factor(setting: Setting, c: Context) -> float | None:
    """The prior rate factor of one setting (the table above); None: not tried here."""
    small = c.parameters < SMALL_MODEL
    gpu = c.on_gpu
    table = {
        "fp32": 1.0, "bf16": 1.5 if gpu else 0.7, "fp16": 1.45 if gpu else 0.5,
        "fp8": (1.15 if c.hidden >= LARGE_HIDDEN else 0.9) if gpu else 0.3,
        "eager": 1.0, "compile": 1.3 if gpu else 1.1,
        "compile(reduce-overhead)": (1.6 if small else 1.25) if gpu else None,
        "unpad": 1.4 if gpu else 1.3, "packing": 1.4 if gpu else 1.3,
        "liger": (1.1 if c.vocab >= LARGE_VOCAB else 1.0) if gpu else None,
        "no kernels": 0.8 if gpu else None,
        "fused adapters": 1.0, "peft's adapters": 1.0,
    }
    name = setting.label.split(" (")[0]  # "packing (4 rows a step)": its detail in brackets
    if name in table:
        return table[name]
    if setting.axis == "micro_batch_size":
        new = int(dict(setting.overrides)["trainer.micro_batch_size"])
        if new < c.micro_batch_size:
            return 0.9 if gpu else 0.95
        if not gpu:
            return 1.05
        return (1.1 if new == 2 * c.micro_batch_size else 1.15) if small else 1.03
    if setting.axis == "checkpoint_activations":
        return 0.75 if setting.label.endswith("true") else 1 / 0.75
    return 1.0


ONCE_S = {("compile", True): 40.0, ("compile", False): 25.0,
          ("compile(reduce-overhead)", True): 60.0}
REPLACED_AXES = ("precision", "graph")  # a candidate's value replaces the config's own


def own_label(cfg, axis: str) -> str | None:
    """The label of the config's own value on a replaced axis (as axis_settings names it)."""
    if axis == "precision":
        return cfg.precision.name
    if axis == "graph":
        if cfg.graph.name != "compile":
            return "eager"
        return "compile(reduce-overhead)" if cfg.graph.mode == "reduce-overhead" else "compile"
    return None


def relative_factor(setting: Setting, c: Context, cfg) -> float | None:
    """The setting's factor against the config's own value (bf16 on a bf16-config's axis of
    precision is 1; eager against a compiled config is 1 / compile's); None: not tried here."""
    mine = factor(setting, c)
    own = own_label(cfg, setting.axis) if setting.axis in REPLACED_AXES else None
    base = factor(Setting(setting.axis, own, ()), c) if own else None
    return mine if mine is None or not base else mine / base


def graph_label(settings: list[Setting], cfg) -> str:
    """What the candidate compiles with: its own graph setting, else the config's."""
    return next((s.label for s in settings if s.axis == "graph"), own_label(cfg, "graph"))


def once_cost(label: str, c: Context) -> float:
    """Seconds a graph setting pays once a run before its rate (compilation, graph capture)."""
    return ONCE_S.get((label, c.on_gpu), 0.0)


def expected_time(settings: list[Setting], prior: float, c: Context, cfg,
                  run_s: float | None) -> float:
    """The order key of a candidate: its expected time to result on a run whose training takes
    `run_s` seconds with the config as given; None (length unknown): by the prior alone."""
    if run_s is None:
        return -prior
    return once_cost(graph_label(settings, cfg), c) + run_s / prior


def reference_time(c: Context, cfg, run_s: float) -> float:
    """The config as given, expected the same way (its own compilation included)."""
    return expected_time([], 1.0, c, cfg, run_s)
