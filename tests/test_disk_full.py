"""A write the file system refuses outside a checkpoint's (a metrics line, the export, a verb's
output): one message and exit code 74, not a traceback; status.json is replaced whole."""
from __future__ import annotations

import errno
import json

import pytest

from rapidformer.errors import EXIT_WRITE_FAILED, refused_write
from tests.conftest import FAST, run_here


@pytest.mark.parametrize("code,refused", [(errno.ENOSPC, True), (errno.EDQUOT, True),
                                          (errno.EROFS, True), (errno.ENOENT, False),
                                          (errno.EACCES, False)])
def test_which_os_errors_are_a_refused_write(code, refused):
    error = refused_write(OSError(code, "the reason", "/the/file"))
    assert (error is not None) == refused
    if refused:
        assert error.exit_code == EXIT_WRITE_FAILED
        assert str(error).startswith("the reason writing /the/file; free space")
    assert refused_write(ValueError("no")) is None
    # safetensors' own error type, with the system's words
    said = refused_write(RuntimeError("Error while serializing: No space left on device (os "
                                      "error 28)"))
    assert said is not None and said.exit_code == EXIT_WRITE_FAILED


def test_a_failed_export_leaves_no_half_written_folder(tmp_path, capsys, monkeypatch):
    import transformers

    def full(self, *args, **kwargs):
        raise RuntimeError("Error while serializing: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    run = tmp_path / "run"
    code, printed = run_here([*FAST, f"trainer.output_dir={run}"], capsys, monkeypatch,
                             tmp_path)
    assert code == EXIT_WRITE_FAILED, printed[-3000:]
    assert "No space left on device" in printed and "Traceback" not in printed
    assert not (run / ".tmp-hf_model").exists() and not (run / "hf_model").exists()
    assert (run / "checkpoints").is_dir()  # the trained steps are kept


def test_a_full_disk_at_a_metrics_line_is_one_message(tmp_path, capsys, monkeypatch):
    from rapidformer.observability.metrics import MetricsSink

    written = MetricsSink.write

    def full_at_step_3(self, step, record):
        if step == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return written(self, step, record)

    monkeypatch.setattr(MetricsSink, "write", full_at_step_3)
    run = tmp_path / "run"
    code, printed = run_here([*FAST, "trainer.export_hf=false", f"trainer.output_dir={run}"],
                             capsys, monkeypatch, tmp_path)
    assert code == EXIT_WRITE_FAILED, printed[-3000:]
    assert "rapidformer: error: No space left on device writing" in printed
    assert "Traceback" not in printed
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    assert not list(run.glob(".tmp-*"))


def test_a_verb_whose_output_the_disk_refuses_is_one_message(monkeypatch, capsys):
    from rapidformer.cli import verbs

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/out/model.safetensors")

    module = __import__(verbs.VERBS["export"][0], fromlist=["export_command"])
    monkeypatch.setattr(module, "export_command", full)
    assert verbs.run_verb("export", ["RUN", "--to", "/out"]) == EXIT_WRITE_FAILED
    assert "No space left on device writing /out/model.safetensors" in capsys.readouterr().err



@pytest.mark.parametrize("writes_that_fit", [0, 3])  # the first event, or at a log line
# the thread's own traceback is what pytest reports as an unhandled thread exception
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_full_disk_under_tensorboard_is_one_message_without_its_threads_traceback(
        writes_that_fit, tmp_path, capsys, monkeypatch):
    import time

    from tensorboard.summary.writer import record_writer

    from rapidformer.errors import CheckpointWriteError
    from rapidformer.observability.metrics import MetricsSink

    written = record_writer.RecordWriter.write
    fitted = []

    def full(self, data):
        if len(fitted) == writes_that_fit:
            raise OSError(errno.ENOSPC, "No space left on device")
        fitted.append(data)
        return written(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    with pytest.raises(CheckpointWriteError, match=r"tensorboard: No space left on device"):
        sink = MetricsSink(tmp_path, tensorboard=True)
        for step in range(1, 200):  # the writing thread fails on its own time
            sink.write(step, {"loss": 1.0})
            time.sleep(0.01)
    if writes_that_fit:
        sink.close()  # returns: the failed writer is not waited on
    assert "Traceback" not in capsys.readouterr().err


def test_a_full_disk_as_tensorboard_closes_is_one_message(tmp_path, monkeypatch):
    from tensorboard.summary.writer import record_writer

    from rapidformer.errors import CheckpointWriteError
    from rapidformer.observability.metrics import MetricsSink

    flushed = record_writer.RecordWriter.flush
    full = []

    def flush(self):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return flushed(self)

    monkeypatch.setattr(record_writer.RecordWriter, "flush", flush)
    sink = MetricsSink(tmp_path, tensorboard=True)
    sink.write(1, {"loss": 1.0})
    full.append(True)  # the last events' flush finds the disk full
    with pytest.raises(CheckpointWriteError, match=r"tensorboard: No space left on device"):
        sink.close()
