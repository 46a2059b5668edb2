"""Resolved config -> the run: the planning step (memory=auto decided), then the template that
runs it (a black-box task, or the user's script) with an engine built on the run's plan."""
from __future__ import annotations

import logging
import runpy
import traceback
from pathlib import Path

from rapidformer import engine as engine_module
from rapidformer.templates import loop as loop_module
from rapidformer.compat.args import activate
from rapidformer.config.schema import RunConfig
from rapidformer.config.validate import PRETRAINING_TASKS
from rapidformer.errors import InputError, NotAvailableError, debug_enabled
from rapidformer.observability.loggers import check_tracker_installed
from rapidformer.planning.memory_plan import resolve_auto

log = logging.getLogger("rapidformer")


def check_available(cfg: RunConfig) -> None:
    """Refuse, before any work, what is not built yet or cannot run on this machine."""
    import torch

    from rapidformer.accelerators.fsdp import check_fsdp_precision
    from rapidformer.accelerators.zero import check_zero_precision

    on_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto"
                                               and torch.cuda.is_available())
    if cfg.graph.name == "ort":
        from rapidformer.accelerators import ort

        ort.check_available()
        if on_gpu:
            raise NotAvailableError(
                "graph=ort on a GPU is not built: onnxruntime-training 1.19.2 was checked here "
                "on the CPU only (fp32); set trainer.device=cpu, or use graph=compile on the GPU")
    if cfg.graph.name == "compile" and cfg.graph.options:
        from rapidformer.accelerators.graph import check_inductor_options

        check_inductor_options(cfg.graph.options)  # before the run directory is made
    check_tracker_installed(cfg.logger.name)
    from rapidformer.models.pretrained_shape import check_local_shape

    check_local_shape(cfg.model)
    check_zero_precision(cfg, "cuda" if on_gpu else "cpu")
    check_fsdp_precision(cfg)
    from rapidformer.models.adapters import check_available as check_peft_available

    check_peft_available(cfg.peft, on_gpu)
    if cfg.task.name in PRETRAINING_TASKS and not cfg.user_script:
        from rapidformer.data.megatron import require_megatron_core

        require_megatron_core()


def settle(resolved: dict, cfg: RunConfig) -> tuple[dict, RunConfig]:
    """The planning step between the resolved config and the run: memory=auto becomes the
    memory mode (and recompute) the memory plan picks, so the recorded config.yaml says what
    ran."""
    return resolve_auto(resolved, cfg)


def run(cfg: RunConfig, run_dir: str, resolved: dict):
    check_available(cfg)
    from rapidformer.runtime.launch import launch_workers, needs_workers, shutdown_process_group

    if needs_workers(cfg):
        return launch_workers(cfg, Path(run_dir), Path(run_dir) / "config.yaml")
    activate(cfg, run_dir, resolved)
    if cfg.user_script:
        result = run_user_script(Path(cfg.user_script))
    else:
        from rapidformer.engine import RapidformerEngine
        from rapidformer.planning.run_plan import RunPlan
        from rapidformer.tasks import task_class

        engine = RapidformerEngine(cfg, run_dir, plan=RunPlan.for_process(cfg))
        result = task_class(cfg.task.name)(engine=engine).train()
    shutdown_process_group()
    return result


def run_user_script(path: Path):
    """Run a white-box script as `__main__`, as the seed's `--user-script` does."""
    if not path.is_file():
        raise InputError(f"user_script={path}: no such file; give the path to your Python "
                         f"script (relative to the directory you run from)")
    engines, calls, loops = (engine_module.ENGINES_CREATED, engine_module.TRAINING_CALLS,
                             loop_module.LOOPS_STARTED)
    log.info("running user script %s", path)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except (SyntaxError, ImportError) as exc:
        if debug_enabled():
            raise
        raise InputError(f"user_script={_where(path, exc)}: {type(exc).__name__}: "
                         f"{_first_line(exc)}; fix the script (RAPIDFORMER_DEBUG=1 shows the "
                         f"traceback)") from None
    ending = ("end it with: engine = RapidformerEngine(); trainer = MyFinetuner(engine=engine); "
              "trainer.train()")
    if engine_module.ENGINES_CREATED == engines:
        raise InputError(f"user_script={path} finished without creating a RapidformerEngine; "
                         f"{ending}")
    if engine_module.TRAINING_CALLS == calls and loop_module.LOOPS_STARTED == loops:
        raise InputError(f"user_script={path} created a RapidformerEngine but trained nothing "
                         f"(no trainer.train(), no engine.backward() or engine.step()); {ending}")


def _first_line(exc: BaseException) -> str:
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return (text or "").splitlines()[0] if text else ""


def _where(path: Path, exc: BaseException) -> str:
    """FILE:LINE of the error: the syntax error's own place, or the script's line that made
    the failing import."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{exc.filename or path}:{exc.lineno}"
    line = None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if Path(frame.f_code.co_filename).resolve() == path.resolve():
            line = lineno
    return f"{path}:{line}" if line else str(path)
