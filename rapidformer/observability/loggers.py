"""Experiment trackers besides metrics.jsonl and TensorBoard: Weights & Biases and MLflow,
chosen with the `logger` group (optional extras: `pip install 'rapidformer[wandb]'` or
`'rapidformer[mlflow]'`).

    python -m rapidformer logger=wandb logger.project=my-project            # online
    python -m rapidformer logger=wandb logger.mode=offline                  # files only; `wandb sync` later
    WANDB_MODE=offline python -m rapidformer logger=wandb                   # W&B's own variable, too
    python -m rapidformer logger=mlflow                                     # <run dir>/mlflow.db
    python -m rapidformer logger=mlflow logger.tracking_uri=http://host:5000

Each receives the resolved config once and every scalar of every metrics record; only the
main process logs.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from rapidformer.config.schema import LoggerConfig
from rapidformer.errors import NotAvailableError
from rapidformer.observability.records import scalars

# logger option -> what it needs installed (its module has the option's name)
TRACKER_PACKAGES = {"wandb": "Weights & Biases", "mlflow": "MLflow"}


def check_tracker_installed(name: str) -> None:
    """Refuse, before any work, a tracker whose package is not installed."""
    if name in TRACKER_PACKAGES and importlib.util.find_spec(name) is None:
        raise NotAvailableError(f"logger={name} needs {TRACKER_PACKAGES[name]}: pip install "
                                f"'rapidformer[{name}]' (or choose logger=tensorboard)")


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict):
        import wandb

        try:
            self._run = wandb.init(project=cfg.project, name=cfg.run_name or run_dir.name,
                                   dir=str(run_dir), mode=cfg.mode, config=config,
                                   settings=wandb.Settings(console="off", silent=True))
        except (wandb.errors.UsageError, wandb.errors.CommError) as exc:
            raise NotAvailableError(
                f"logger=wandb: Weights & Biases could not start a run ({exc}). Log in with "
                f"`wandb login` or set WANDB_API_KEY, or write the run to files only with "
                f"logger.mode=offline (`wandb sync` uploads it later)") from exc

    def log(self, step: int, record: dict) -> None:
        self._run.log(scalars(record), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        # finish() can return before W&B's service has written the run file (seen on a loaded
        # 2-core machine: the offline file held only its header); teardown waits for it, unless
        # the user's own script still has a run open
        if wandb.run is None:
            wandb.teardown()


class MlflowLogger:
    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict):
        import mlflow

        self._mlflow = mlflow
        # the local default: a SQLite store in the run directory (MLflow retired its file store)
        uri = cfg.tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(cfg.project)
        self._run = mlflow.start_run(run_name=cfg.run_name or run_dir.name)
        mlflow.log_params(_flatten(config))

    def log(self, step: int, record: dict) -> None:
        # MLflow keys allow only letters, digits and _-. /
        self._mlflow.log_metrics({k.replace(":", "_"): float(v)
                                  for k, v in scalars(record).items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = "null" if value is None else str(value)[:500]  # MLflow's value limit
    return flat


def make_loggers(cfg: LoggerConfig | None, run_dir: Path, config: dict) -> list:
    if cfg is None or cfg.name == "tensorboard":
        return []
    check_tracker_installed(cfg.name)
    return [{"wandb": WandbLogger, "mlflow": MlflowLogger}[cfg.name](cfg, run_dir, config)]
