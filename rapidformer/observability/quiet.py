"""Third-party lines that say nothing to a rapidformer user, silenced where they arise.

Every filter of the project's console is here. A warning filter matches one message (a regular
expression, from its start), its category and the module that warns; a log filter one message,
its level and the logger that logs it. A library's other warnings, and the same words from
anywhere else, still show; a real warning is never silenced. Each filter says why its line tells
the user nothing.

`install()` runs when rapidformer is imported, in every process (the CLI and its verbs, a
launched worker, a user's own script); megatron-core's CPU-only line is silenced when a run puts
it on the CPU (`megatron_on_cpu`, from accelerators/megatron_cpu.py). With `RAPIDFORMER_DEBUG=1`
neither does anything: every line is shown, as the libraries print it.

(Scoped silences stay where their scope is: data/local_files.py while a file is read, the
Megatron optimizer's INFO lines while it is built.)
"""
from __future__ import annotations

import logging
import re
import warnings

from rapidformer.errors import debug_enabled

# (message, category, module): Python warnings
WARNINGS: list[tuple[str, type[Warning], str]] = [
    # transformers 5 deprecated the property; peft's PeftModel still reads it of every model it
    # wraps (a LoRA run, an adapter export, eval and predict of a LoRA run): neither the user's
    # config nor their code asks it, and nothing they change makes it go
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    # peft saves the embeddings when the base model's vocabulary was resized, and finds out by
    # reading the base's config.json from its folder or the hub. rapidformer's adapter export
    # builds that base from the checkpoint's own base_config.json (the vocabulary is the
    # trained one by construction), a path that is neither; offline the hub cannot answer
    (r"Could not find a config file in .* - will assume that the vocabulary was not modified",
     UserWarning, r"peft\.utils\.save_and_load"),
    # megatron-core's import names each fallback it takes without NVIDIA's Transformer Engine
    # or apex (about 7 lines a run): rapidformer builds Megatron models on megatron-core's local
    # layers and torch's optimizers when those are absent, on purpose (apex is not on PyPI), and
    # its own model line says which layers the run has
    (r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning,
     r"megatron\.core\."),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.core\."),
    # megatron-core's TransformerConfig deprecates its own default (cuda_graph_scope="full")
    # on every model built; rapidformer captures no CUDA graphs
    (r"full scope is deprecated\. Use empty cuda_graph_scope", UserWarning,
     r"megatron\.core\.transformer\.transformer_config"),
]

# (message, category, module): warnings silenced only while megatron-core runs on the CPU
CPU_MEGATRON_WARNINGS: list[tuple[str, type[Warning], str]] = [
    # a tensor-parallel layer's advice to limit CUDA's device connections: a CPU run has no
    # CUDA device (on a GPU the advice stands, and is shown)
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", UserWarning,
     r"megatron\.core\.tensor_parallel\.layers"),
]

# (logger, level, message): log records (a logger's filters see the records logged at it)
RECORDS: list[tuple[str, int, str]] = [
    # transformers imports DeepSpeed where it is installed, whatever the run's memory option,
    # and DeepSpeed's first use probes for a GPU and says it settled on the CPU: the run names
    # its device itself (planning/run_plan.py also tells DeepSpeed so on a run's CPU; a verb
    # such as export does not go through it)
    ("DeepSpeed", logging.WARNING,
     r"Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to "
     r"detect it"),
    # peft imports bitsandbytes, which looks for its CPU 4-bit matmul kernel: rapidformer's
    # 4-bit base (peft=qlora) is for CUDA GPUs only (refused on a CPU), so that kernel is
    # never used
    ("bitsandbytes.backends.cpu.ops", logging.WARNING,
     r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # and where transformers' `kernels` package is installed (a dependency of transformers'
    # newer releases), bitsandbytes' CPU probe goes through the hub's kernel loader, which says
    # offline that it skips a trust check of a kernel that is never used (the same probe)
    ("kernels._internals.hf_hub", logging.WARNING,
     r"Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"),
    # torch elastic's agent logs the stop signal the launcher received; the launcher has said
    # so itself (runtime/launch.py: "received SIGINT: passed on to N worker(s) ...") and ends
    # with the run's stop message. Other signals (SIGHUP, SIGQUIT) are still logged
    ("torch.distributed.elastic.agent.server.api", logging.WARNING,
     r"Received (Signals\.)?(2|15|SIGINT|SIGTERM) death signal, shutting down workers"),
]

# (logger, level): libraries that log their routine at a level the console shows
LEVELS: list[tuple[str, int]] = [
    # transformers imports torchao when it is installed (the fp8 extra), whatever the run's
    # precision; torchao then reports each of its CUDA extensions that cannot load here (a
    # CPU, another GPU architecture) and torch reports torchao's pytree registrations as
    # deprecated: only their errors are shown
    ("torchao", logging.ERROR),
    ("torch.utils._pytree", logging.ERROR),
    # megatron-core's import and dataset builder log every step at INFO (which FSDP flavour it
    # found, each index it builds): its warnings and errors only (data/megatron.py logs a
    # summary of the datasets instead)
    ("megatron", logging.WARNING),
]


class DropRecord(logging.Filter):
    """Drops a logger's records of one level whose message matches `pattern` from its start."""

    def __init__(self, level: int, pattern: str):
        super().__init__()
        self.level, self.pattern = level, re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == self.level and self.pattern.match(record.getMessage()))


def _ignore(entries: list[tuple[str, type[Warning], str]]) -> None:
    # filterwarnings puts each filter first and removes an equal one already there: calling
    # again adds nothing (a test framework's catch_warnings may have dropped them meanwhile)
    for message, category, module in entries:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def install() -> None:
    """The filters above (none under RAPIDFORMER_DEBUG=1); calling it again changes nothing."""
    if debug_enabled():
        return
    _ignore(WARNINGS)
    for name, level, message in RECORDS:
        logger = logging.getLogger(name)  # the library's own logger, made now or later
        if not any(isinstance(f, DropRecord) and f.pattern.pattern == message
                   for f in logger.filters):
            logger.addFilter(DropRecord(level, message))
    for name, level in LEVELS:
        logger = logging.getLogger(name)
        if logger.level < level:
            logger.setLevel(level)


def library_bars(show: bool) -> None:
    """The libraries' own progress bars (datasets' Map and its file reads, transformers'
    'Loading weights' and 'Writing model shards'), off where the run shows none of its own
    (trainer.progress_bar=false, a rank other than 0, a verb that prints its result): a bar
    of a step that takes milliseconds tells the user nothing. Shown under RAPIDFORMER_DEBUG=1."""
    if show or debug_enabled():
        return
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()


def megatron_on_cpu() -> None:
    """megatron-core runs on the CPU in this process (accelerators/megatron_cpu.py)."""
    if not debug_enabled():
        _ignore(CPU_MEGATRON_WARNINGS)
