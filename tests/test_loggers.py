"""The logger group: W&B (offline mode) and MLflow (its local SQLite store) receive the run's
config and every metrics record, with no network."""
from __future__ import annotations

import json

import pytest

from tests.conftest import FAST, read_metrics


def train(run_dir, *overrides):
    from rapidformer import __main__ as module_main

    module_main.main([*FAST, f"trainer.output_dir={run_dir}", *overrides])


def wandb_history(path):
    """The history rows of an offline W&B run file (LevelDB's log format: 32 KiB blocks of
    records with a 7-byte header; W&B's own 7-byte file header first), as {key: json}."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(pending)
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            yield {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}


def test_wandb_offline_writes_a_run_with_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # followed: logger.mode is null by default
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tmp_path, "logger=wandb", "logger.project=tests")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = list(runs[0].glob("run-*.wandb"))
    assert records and records[0].stat().st_size > 1000
    losses = [json.loads(items["loss"]) for items in wandb_history(records[0]) if "loss" in items]
    expected = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert losses == pytest.approx(expected)


def test_wandb_online_without_a_key_is_one_clear_error(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # logger.mode, when set, wins
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(SystemExit) as exit_info:
        train(tmp_path, "logger=wandb", "logger.mode=online")
    assert exit_info.value.code == 3
    err = capsys.readouterr().err
    assert "logger=wandb: Weights & Biases could not start a run" in err
    assert "wandb login" in err and "logger.mode=offline" in err
    assert "Traceback" not in err


def test_mlflow_logs_params_and_metric_history_to_a_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    train(tmp_path, "logger=mlflow", "logger.project=tests", "trainer.lr=0.0007")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.data.params["trainer.lr"] == "0.0007"
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    history = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                       key=lambda m: m.step)]
    expected = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert history == pytest.approx(expected)
    assert "validation/accuracy" in run.data.metrics


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                    capsys):
    import importlib.util

    from rapidformer import __main__ as module_main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        module_main.main(["logger=wandb", f"trainer.output_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 3
    assert "logger=wandb needs Weights & Biases: pip install 'rapidformer[wandb]'" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_metrics_csv_holds_every_scalar_of_metrics_jsonl(tmp_path):
    import csv

    train(tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value"]
    from_csv = {(int(s), n): float(v) for s, n, v in rows[1:]}
    from_jsonl = {(r["step"], k): float(v) for r in read_metrics(tmp_path) for k, v in r.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert from_csv == pytest.approx(from_jsonl)
    assert any(name == "loss" for _, name in from_csv)
    assert any(name.startswith("validation/") for _, name in from_csv)
