"""A process whose DataLoader workers are still running when it ends exits: normally, on an
exception, on sys.exit, with persistent or spawned workers and with a worker stuck in the
dataset. The workers ignore SIGTERM (runtime/loader_workers.py), which is how Python's exit
stops daemon children: without the loader's exit hook such a process waited for them forever (a
run that failed mid-epoch never ended)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import FAST
from tests.test_signals import _communicate_or_fail, start_in_own_group

REPO = Path(__file__).parents[1]
LIMIT = 90  # seconds; each exits in a few (a stuck worker: torch's 5 s join, then SIGKILL)

SCRIPT = '''
import sys, time
import torch
from rapidformer.runtime.loader_workers import DataLoader


class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        if i >= 2:
            time.sleep(600)  # a worker busy in the dataset when the process ends
        return i


class FailsAtSecond(torch.utils.data.Sampler):
    def __len__(self):
        return 10

    def __iter__(self):
        yield 0
        raise RuntimeError("the run failed here")  # while the iterator starts, workers started


def main(how):
    import os
    kwargs = {{"num_workers": 2, "batch_size": 1}}
    if how == "sampler fails":
        print("[0]", flush=True)
        iter(DataLoader(list(range(10)), sampler=FailsAtSecond(), **kwargs))
    if how == "dropped stuck":  # left while a worker hangs: torch's SIGTERM is ignored
        for batch in DataLoader(Stuck(), **kwargs):
            print(batch.tolist(), flush=True)
            break
        return
    if how == "forked child":  # a child's exit hook leaves its parent's workers alone (the
        # child runs ours alone: multiprocessing's own hook in a raw fork's child is no business
        # of this module's)
        from rapidformer.runtime.loader_workers import _stop_workers_at_exit
        batches = iter(DataLoader(list(range(1000)), **kwargs))
        print(next(batches).tolist(), flush=True)
        child = os.fork()
        if child == 0:
            _stop_workers_at_exit()
            os._exit(0)
        os.waitpid(child, 0)
        assert sum(1 for _ in batches) == 999
        return
    data = list(range(100))
    if how == "persistent":
        kwargs["persistent_workers"] = True
    if how == "spawn":
        kwargs["multiprocessing_context"] = "spawn"
    if how == "stuck":
        data = Stuck()
    global iterator  # referenced at exit, as a failed run's traceback holds its iterator
    iterator = iter(DataLoader(data, **kwargs))
    print(next(iterator).tolist(), flush=True)
    if how == "normal":
        return
    if how == "sys.exit":
        sys.exit(3)
    raise RuntimeError("the run failed here")


if __name__ == "__main__":
    main(sys.argv[1])
'''

def _start(args: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    # a group of its own: one that does not exit is killed whole (its workers hold the pipes)
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ended(child: subprocess.Popen, limit: float) -> tuple[int | str, str, str]:
    try:
        out, err = child.communicate(timeout=limit)
        return child.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
        return "did not exit", out, err[-800:]


EXPECTED = {"normal": 0, "raise": 1, "sys.exit": 3, "persistent": 1, "spawn": 1, "stuck": 1,
            "sampler fails": 1, "dropped stuck": 0, "forked child": 0}


def test_a_process_ends_with_its_loader_workers_running(tmp_path):
    script = tmp_path / "loader_exit.py"
    script.write_text(SCRIPT.format())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    children = {how: _start([sys.executable, str(script), how], tmp_path, env)
                for how in EXPECTED}  # at once: the waits overlap
    outcomes = {}
    for how, child in children.items():
        code, out, err = _ended(child, max(1.0, LIMIT - (time.monotonic() - started)))
        outcomes[how] = (code, out.strip(), "the run failed here" in err)
    assert outcomes == {how: (code, "[0]", code == 1) for how, code in EXPECTED.items()}


FAILS_AT_THIRD_STEP = '''
from rapidformer import RapidformerEngine
from rapidformer.tasks.sequence_classification import SequenceClassificationFinetuner


class FailsAtThirdStep(SequenceClassificationFinetuner):
    steps = 0

    def run_forward_step(self, batch, model):
        FailsAtThirdStep.steps += 1
        if FailsAtThirdStep.steps == 3:
            raise RuntimeError("a model error at the third step")
        return super().run_forward_step(batch, model)


FailsAtThirdStep(engine=RapidformerEngine()).train()
'''


def test_a_run_that_fails_mid_epoch_with_loader_workers_exits_non_zero(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(FAILS_AT_THIRD_STEP))
    child = start_in_own_group([f"user_script={script}", *FAST, "data.num_workers=2",
                                f"trainer.output_dir={tmp_path / 'run'}"], tmp_path)
    out, err = _communicate_or_fail(child, 180)
    assert child.returncode != 0, err
    assert "a model error at the third step" in out + err
