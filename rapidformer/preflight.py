"""The one refusal pass: every reason a config cannot run here, reported at once.

    composed config -> typed (unknown keys, wrong types: nothing else can be checked before)
                    -> the config's own checks (config/validate.py: ranges, batch sizes, ...)
                    -> memory=auto decided by the memory plan (planning/memory_plan.py)
                    -> the table's refusals and the selected strategy's (accelerators/)
                    -> every model transform's (transforms/)
                    -> with `environment`: what this machine lacks for the strategy and the
                       transforms (libraries, device kinds), the logger, the inductor options,
                       the hub models it loads (offline: in the cache), a local model's shape,
                       and the paths the run writes and resumes from; and what the run reads
                       (run_inputs.py: data files, tokenizer files, pretraining data against
                       its tokenizer and task)

`rapidformer validate`, `rapidformer plan`, `--cfg` and dry runs, and the run itself all go
through `settle`, so validate says ok exactly when the run would start; each problem keeps the
exit code it earns (bad input 2, not available here 3).
"""
from __future__ import annotations

import copy
import logging

import torch

from rapidformer import transforms
from rapidformer.accelerators.table import requested
from rapidformer.config.compose import resolve
from rapidformer.config.schema import RunConfig
from rapidformer.config.validate import build_run_config, check_values
from rapidformer.run_inputs import input_problems
from rapidformer.errors import ConfigError, Problem, caught, refusal
from rapidformer.refusals import config_problems

log = logging.getLogger("rapidformer")


def settle(composed, output_dir: str | None = None, *, environment: bool = False,
           writes_to: str | None = None, claims: bool = True) -> tuple[dict, RunConfig]:
    """(the plain config to record, the typed config) of a composed config, memory=auto
    decided, or one error listing every problem. `output_dir`: the run directory recorded as
    trainer.output_dir (None: the config's own). With `environment`, this machine's problems
    and those of the files the run reads too, `writes_to` (default: trainer.output_dir) the
    directory whose paths are checked, and with `claims` whether the run may take it
    (rapidformer/checkpoint/run_dir.py)."""
    plain, cfg = resolve(composed, output_dir, check=False)
    problems = [Problem(text) for text in [*check_values(cfg), *config_problems(cfg)]]
    if not problems:
        # the memory plan does arithmetic on the values and plans a config the backends and
        # transforms take; the mode it picks is then asked of them too
        try:
            plain, cfg = decide_memory(plain, cfg)
        except ConfigError as exc:
            problems += [Problem(text) for text in exc.problems]
        problems += [Problem(text) for text in config_problems(cfg)]
    if environment:
        problems += environment_problems(cfg, writes_to or cfg.trainer.output_dir, claims)
        problems += input_problems(cfg)
    if problems:
        raise refusal(problems)
    return plain, cfg


def run_device(cfg: RunConfig) -> tuple[torch.device, list[Problem]]:
    """The device kind the run's processes use (trainer.device), and the problem when it asks
    for a GPU this machine does not have."""
    choice = cfg.trainer.device
    if choice == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), [Problem("trainer.device=cuda but no CUDA GPU is visible; "
                                             "use trainer.device=cpu or auto")]
    on_gpu = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if on_gpu else "cpu"), []


def environment_problems(cfg: RunConfig, output_dir: str | None = None,
                         claims: bool = False) -> list[Problem]:
    """What this machine lacks for the config, and the paths it cannot use (with `claims`:
    whether the run may take `output_dir` as its run directory)."""
    from rapidformer.accelerators.graph import check_inductor_options
    from rapidformer.checkpoint.run_dir import claim_problems
    from rapidformer.config.paths import check_paths
    from rapidformer.models.pretrained_shape import check_local_shape
    from rapidformer.observability.loggers import check_tracker_installed
    from rapidformer.runtime import hub

    device, problems = run_device(cfg)
    if not problems:  # what a device lacks, asked of the device the run has
        problems += [problem for cls in requested(cfg)
                     for problem in cls.environment_problems(cfg, device)]
        problems += transforms.environment_problems(cfg, device)
        if cfg.trainer.offload_activations and device.type == "cpu" and \
                cfg.trainer.device != "cpu":  # trainer.device=cpu: the config's check says it
            from rapidformer.accelerators.recompute import CPU_OFFLOAD

            problems.append(Problem(f"{CPU_OFFLOAD} (trainer.device={cfg.trainer.device} "
                                    f"found no GPU)"))
    if cfg.graph.name == "compile" and cfg.graph.options:
        problems += caught(check_inductor_options, cfg.graph.options)
    problems += caught(check_tracker_installed, cfg.logger.name)
    # the hub, asked once: offline from here when it cannot be reached, and every hub model
    # the run loads then in the cache
    problems += caught(hub.prepare, cfg)
    problems += caught(check_local_shape, cfg.model,
                       None if cfg.task.is_pretraining else cfg.data.max_seq_length)
    if cfg.task.is_pretraining and not cfg.user_script:
        from rapidformer.data.megatron import require_megatron_core

        problems += caught(require_megatron_core)
    if output_dir is not None:
        problems += caught(check_paths, cfg, output_dir)
        if claims:
            t = cfg.trainer
            problems += [Problem(text) for text in claim_problems(output_dir, t.resume,
                                                                  t.overwrite)]
    return problems


def check_environment(cfg: RunConfig, output_dir: str | None = None) -> None:
    """Raise, listing them all, when this machine cannot run the (settled) config."""
    if problems := environment_problems(cfg, output_dir):
        raise refusal(problems)


def decide_memory(plain: dict, cfg: RunConfig) -> tuple[dict, RunConfig]:
    """memory=auto replaced by the mode the memory plan picks (so the recorded config.yaml
    says what ran); any other memory mode unchanged."""
    if plain["memory"]["name"] != "auto":
        return plain, cfg
    from rapidformer.planning.memory_plan import choose_mode
    from rapidformer.runtime import hub

    hub.prepare(cfg)  # the plan reads a pretrained model's config.json: local or cached

    mode = choose_mode(cfg)
    plain = copy.deepcopy(plain)
    plain["memory"].update(name=mode.memory, offload_optimizer=mode.offload_optimizer,
                           offload_params=mode.offload_params)
    plain["trainer"]["checkpoint_activations"] = mode.checkpoint_activations
    return plain, build_run_config(plain, check=False)
