"""A settled config (rapidformer/preflight.py) -> the run: the template that runs it (a
black-box task, or the user's script) with an engine built on the run's plan, in this process
or in one worker per device."""
from __future__ import annotations

import logging
import runpy
import traceback
from pathlib import Path

from rapidformer import engine as engine_module
from rapidformer.templates import loop as loop_module
from rapidformer.compat.args import activate
from rapidformer.config.paths import user_script_problem
from rapidformer.config.schema import RunConfig
from rapidformer.errors import InputError, debug_enabled

log = logging.getLogger("rapidformer")


def run(cfg: RunConfig, run_dir: str, resolved: dict):
    """Run a settled config (rapidformer/preflight.py has refused what cannot run here): in
    this process, or in one worker per device."""
    from rapidformer.runtime.launch import launch_workers, needs_workers, shutdown_process_group

    if needs_workers(cfg):
        return launch_workers(cfg, Path(run_dir), resolved)
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
    if problem := user_script_problem(path):
        raise InputError(problem)
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
