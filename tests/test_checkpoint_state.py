"""The checkpoint package's decisions, as tables: what a checkpoint records (format 1, and the
flat format 0 of the releases before it), where a resumed Finetuner continues and where it
ends after a change, which changes a resume refuses (all named at once), the run directory's
marker and what trainer.overwrite removes. And checkpoints written by release 0.1 (in
tests/data/checkpoints_0_1, made by the command in its README) still resume and export."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint.resume import (EpochPosition, ThisRun, epoch_position, last_step,
                                           resume_plan)
from rapidformer.checkpoint.state import (FORMAT_VERSION, CheckpointState, ModelRecord,
                                          read_state)
from rapidformer.errors import InputError
from tests.conftest import FAST, read_metrics
from tests.test_bad_input import call

RELEASE_0_1 = Path(__file__).parent / "data" / "checkpoints_0_1"
# the commands that wrote them (their README), shortened to the keys that decide the model
DDP_RUN = ["trainer.epochs=null", "model.hidden_size=16", "model.num_layers=1",
           "model.num_attention_heads=2", "model.intermediate_size=32", "model.vocab_size=120",
           "data.synthetic_train_size=64", "data.synthetic_eval_size=16",
           "trainer.micro_batch_size=8", "trainer.global_batch_size=8",
           "trainer.export_hf=false", "trainer.progress_bar=false"]
LORA_RUN = ["+recipe=llama_lora", "trainer.epochs=null", "model.hidden_size=16",
            "model.num_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=1",
            "model.intermediate_size=32", "model.vocab_size=120",
            "data.synthetic_train_size=32", "data.synthetic_eval_size=8",
            "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "peft.r=2",
            "peft.alpha=4", "trainer.export_hf=false", "trainer.progress_bar=false",
            "task.sample_generations=0"]


# --- what a checkpoint records ------------------------------------------------------------------

def test_format_0_of_the_release_before_is_read_into_the_typed_state():
    ddp = read_state(RELEASE_0_1 / "ddp" / "checkpoints" / "step_00000002")
    assert (ddp.version, ddp.step, ddp.strategy, ddp.memory, ddp.world_size) == \
        (0, 2, "ddp", "none", 1)
    assert ddp.train_state["steps_per_epoch"] == 8 and ddp.layout == {} and ddp.transforms == {}
    assert ddp.model.settings["hidden_size"] == 16 and ddp.model.num_parameters > 0
    lora = read_state(RELEASE_0_1 / "lora" / "checkpoints" / "step_00000002")
    assert set(lora.transforms) == {"lora"}  # format 0 kept it at the top level as "peft"
    assert (lora.transforms["lora"]["method"], lora.transforms["lora"]["r"]) == ("lora", 2)


@pytest.mark.parametrize("flat,layout,world", [
    ({"tensor_parallel": 2, "pipeline_parallel": 1, "precision": "bf16", "world_size": 4},
     {"tensor_parallel": 2, "pipeline_parallel": 1, "precision": "bf16", "world_size": 4}, 4),
    ({"memory": "zero2", "world_size": 2}, {}, 2),
    ({}, {}, 1),
])
def test_format_0_layouts_and_sizes(flat, layout, world):
    state = CheckpointState.from_json({"step": 5, "train_state": {"step": 5}, **flat})
    assert (state.layout, state.world_size, state.strategy) == (layout, world, None)


def test_format_1_round_trips_and_keeps_an_own_loops_keys():
    state = CheckpointState(step=7, train_state={"step": 7, "epoch": 1}, world_size=2,
                            strategy="fsdp2", memory="fsdp", layout={},
                            model=ModelRecord(123, {"arch": "bert"}),
                            transforms={"lora": {"method": "lora", "r": 8}},
                            extra={"my_key": [1, 2]})
    data = json.loads(json.dumps(state.to_json()))
    assert data["format_version"] == FORMAT_VERSION
    assert CheckpointState.from_json(data) == state
    assert state.user_view() == {"my_key": [1, 2], "step": 7, "train_state": {"step": 7,
                                                                            "epoch": 1}}


@pytest.mark.parametrize("data,message", [
    ({"format_version": 99, "step": 1}, "checkpoint format 99, newer than this version reads"),
    ({"format_version": 1}, "is not a checkpoint state this version can read"),
    ({"format_version": 1, "step": "two"}, "is not a checkpoint state this version can read"),
    ({"format_version": 1, "step": 1, "model": {"settings": {}}},
     "is not a checkpoint state this version can read"),
])
def test_a_state_this_version_cannot_read_is_named(data, message):
    with pytest.raises(InputError, match=message):
        CheckpointState.from_json(data, "x/state.json")


def test_an_unreadable_state_file_names_the_file_and_the_way_out(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(InputError, match=r"state.json cannot be read .*rapidformer verify"):
        read_state(tmp_path)
    (tmp_path / "state.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="holds no checkpoint state"):
        read_state(tmp_path)


# --- a Finetuner's position after a change ------------------------------------------------------

def _saved(step, epoch, in_epoch, steps_per_epoch=0, batch=0):
    return {"step": step, "epoch": epoch, "step_in_epoch": in_epoch,
            "steps_per_epoch": steps_per_epoch, "global_batch_size": batch}


# (saved train_state, this run's steps per epoch, global batch, epochs, train_iters) ->
# (epoch, step in it, last step); None: refused
POSITIONS = [
    # unchanged: the same position, the same end
    (_saved(10, 0, 10, 20, 32), 20, 32, 2, None, (0, 10, 40)),
    # a larger batch (96 rows, micro 16 / global 32, stopped at step 2, resumed with 64): epoch
    # 0 is complete in the new terms, epoch 1 still has its one step
    (_saved(2, 0, 2, 3, 32), 1, 64, 2, None, (1, 0, 3)),
    # the same: 4 x 32 samples taken = 2 steps of 64, rounded up where it is a step and a half
    (_saved(4, 0, 4, 20, 32), 10, 64, 1, None, (0, 2, 12)),
    (_saved(3, 0, 3, 20, 32), 10, 64, 1, None, (0, 2, 11)),
    # a smaller training set: the epoch is over; iterations count as asked
    (_saved(10, 1, 10, 20, 32), 10, 32, None, 16, (2, 0, 16)),
    (_saved(10, 0, 10, 20, 32), 10, 32, 3, None, (1, 0, 30)),
    # a checkpoint from before the layout was recorded
    (_saved(12, 0, 12), 10, 32, 2, None, (1, 0, 22)),
    # a finished run resumed as it was: nothing left, finished again (its final evaluation)
    (_saved(40, 2, 0, 20, 32), 20, 32, 2, None, (2, 0, 40)),
    (_saved(16, 1, 6, 10, 32), 10, 32, None, 16, (1, 6, 16)),
    # past what is asked now: refused
    (_saved(40, 2, 0, 20, 32), 20, 32, 1, None, None),
    (_saved(20, 1, 0, 20, 32), 20, 32, None, 10, None),
    (_saved(6, 1, 2, 4, 32), 4, 32, 1, None, None),
]


@pytest.mark.parametrize("saved,steps,batch,epochs,iters,expected", POSITIONS)
def test_the_resumed_position_and_the_steps_left_in_this_runs_terms(saved, steps, batch,
                                                                      epochs, iters, expected):
    position = epoch_position(saved, steps, batch)
    end, problem = last_step(saved["step"], position, steps, epochs, iters)
    if expected is None:  # refused, and the run would end where the checkpoint is
        assert "past what this run asks" in problem and "nothing is left" in problem
        assert end == saved["step"]
        return
    assert problem is None
    assert (position.epoch, position.step_in_epoch, end) == expected
    changed = (saved["steps_per_epoch"], saved["global_batch_size"]) != (steps, batch)
    assert bool(position.notes) == changed


def test_the_steps_left_count_every_epoch_asked_for():
    """Whatever the change, the run trains to the end of trainer.epochs in the new terms:
    the steps it takes after the resume cover the epochs not yet complete."""
    for saved, steps, batch, epochs, _, expected in POSITIONS:
        if epochs is None or expected is None:
            continue
        position = epoch_position(saved, steps, batch)
        left = last_step(saved["step"], position, steps, epochs, None)[0] - saved["step"]
        assert left == (epochs - position.epoch) * steps - position.step_in_epoch
        assert isinstance(position, EpochPosition)


# --- which changes a resume refuses -------------------------------------------------------------

def _run(*overrides: str):
    from rapidformer.accelerators.ddp import DDPStrategy
    from rapidformer.config.compose import compose
    from rapidformer.planning.run_plan import RunPlan
    from rapidformer.preflight import settle
    from rapidformer.transforms import Transforms

    cfg = settle(compose(["trainer.device=cpu", *overrides]), "out")[1]
    return cfg, DDPStrategy(cfg, RunPlan.for_process(cfg), 0, 1), Transforms(cfg)


LORA_RECORD = {"method": "lora", "r": 8, "alpha": 16, "target_modules": ["query"],
               "modules_trained_in_full": [], "quant_type": None, "base_class": "X",
               "base_fingerprint": "0" * 64}
CHANGES = [
    ({}, [], True),
    ({"world_size": 2}, [], False),  # loads, but the random streams restart from the seed
    ({"memory": "zero2"}, ["was written with memory=zero2, this run has memory=none"], True),
    ({"model": ModelRecord(99, {"hidden_size": 32})},
     ["holds a model of 99 parameters", "changed: model.hidden_size=64 (was 32)"], True),
    ({"transforms": {"lora": LORA_RECORD}},
     ["holds peft=lora adapters only, and this run trains the whole model"], True),
    ({"memory": "fsdp", "transforms": {"lora": LORA_RECORD}},
     ["(2 problems)", "it was written with memory=fsdp", "it holds peft=lora adapters only"],
     True),
    ({"transforms": {"prune": {}}}, ["records a model transform 'prune' that this version "
                                     "does not know"], True),
    # a transform's change changes the parameters that train: its own problem alone
    ({"transforms": {"lora": LORA_RECORD}, "model": ModelRecord(99, {"hidden_size": 64})},
     ["holds peft=lora adapters only"], True),
]


@pytest.mark.parametrize("changed,messages,rng", CHANGES)
def test_a_resume_is_planned_or_refused_naming_every_change(changed, messages, rng):
    from dataclasses import replace

    cfg, strategy, transforms = _run()
    saved = replace(CheckpointState(step=3, world_size=1, strategy="ddp", memory="none",
                                    model=ModelRecord(1000, {"hidden_size": 64})), **changed)
    run = ThisRun(strategy, transforms, cfg.model, 1000, 1)
    if not messages:
        assert resume_plan(saved, run, Path("ckpt")).restores_rng is rng
        return
    with pytest.raises(InputError) as info:
        resume_plan(saved, run, Path("ckpt"))
    for message in messages:
        assert message in str(info.value)
    assert ("problems)" in str(info.value)) == any("problems)" in m for m in messages)


# --- the run directory --------------------------------------------------------------------------

def test_another_tools_run_directory_is_not_taken_for_ours(tmp_path, capsys):
    """A Hydra application's output folder (its .hydra/ and its own checkpoints): not an
    earlier run of ours, so neither resumable nor removable by trainer.overwrite=true."""
    foreign = tmp_path / "hydra_app"
    (foreign / ".hydra").mkdir(parents=True)
    (foreign / ".hydra" / "config.yaml").write_text("lr: 1\n")
    (foreign / "checkpoints").mkdir()
    (foreign / "checkpoints" / "my_model.pt").write_bytes(b"mine")
    before = sorted(str(p.relative_to(foreign)) for p in foreign.rglob("*"))
    for extra in ([], ["trainer.overwrite=true"]):
        code, err = call("rapidformer", [*FAST, "trainer.train_iters=1",
                                         f"trainer.output_dir={foreign}", *extra], capsys)
        assert code == 2 and "holds files that no rapidformer run wrote" in err, err[-1500:]
        assert sorted(str(p.relative_to(foreign)) for p in foreign.rglob("*")) == before
    assert (foreign / "checkpoints" / "my_model.pt").read_bytes() == b"mine"


def test_overwrite_removes_what_rapidformer_wrote_and_nothing_else(tmp_path, capsys):
    run = tmp_path / "run"
    base = [*FAST, "trainer.train_iters=2", "trainer.epochs=null", "trainer.export_hf=false",
            f"trainer.output_dir={run}"]
    code, err = call("rapidformer", base, capsys)
    assert code == 0, err[-2000:]
    marker = json.loads((run / ".rapidformer-run").read_text())
    assert marker == {"rapidformer_run": 1}
    (run / "checkpoints" / "notes.txt").write_text("mine")  # the user's, beside ours
    (run / "my_analysis.ipynb").write_text("{}")
    code, err = call("rapidformer", [*base, "trainer.overwrite=true"], capsys)
    assert code == 0, err[-2000:]
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine"
    assert (run / "my_analysis.ipynb").read_text() == "{}"
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]  # one history


# --- checkpoints of release 0.1 -----------------------------------------------------------------

@pytest.mark.parametrize("name,command", [("ddp", DDP_RUN), ("lora", LORA_RUN)])
def test_a_release_0_1_checkpoint_resumes_and_exports(name, command, tmp_path, capsys):
    from rapidformer.cli.verbs.export import export

    run = tmp_path / name
    shutil.copytree(RELEASE_0_1 / name, run)
    code, err = call("rapidformer", [*command, "trainer.train_iters=4", "trainer.log_interval=1",
                                     f"trainer.output_dir={run}", "trainer.resume=auto"], capsys)
    assert code == 0, err[-2000:]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [3, 4]  # resumed at 2
    assert read_state(run / "checkpoints" / "step_00000004").version == FORMAT_VERSION
    old = export(run, tmp_path / "old_export", step=2)  # the release's own checkpoint
    new = export(run, tmp_path / "new_export", step=4)
    from safetensors.torch import load_file

    before, after = load_file(old / "model.safetensors"), load_file(new / "model.safetensors")
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # two more steps trained


# --- found by review: each failed on the first version of the package --------------------------

def test_overwrite_removes_a_linked_step_directory_as_a_link(tmp_path, capsys):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    base = [*FAST, "trainer.train_iters=2", "trainer.epochs=null", "trainer.export_hf=false",
            f"trainer.output_dir={run}"]
    code, err = call("rapidformer", base, capsys)
    assert code == 0, err[-2000:]
    step = run / "checkpoints" / "step_00000002"
    elsewhere.mkdir()
    shutil.move(str(step), elsewhere / step.name)
    step.symlink_to(elsewhere / step.name)
    code, err = call("rapidformer", [*base, "trainer.overwrite=true"], capsys)
    assert code == 0, err[-2000:]
    assert (elsewhere / step.name / "state.json").is_file()  # what the link pointed to stays


def test_validate_refuses_the_run_directories_the_run_refuses(tmp_path, capsys):
    mine, run = tmp_path / "project", tmp_path / "run"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / ".rapidformer-run").write_text("not ours")
    (stray / "x").write_text("")
    code, err = call("rapidformer", [*FAST, "trainer.train_iters=1", "trainer.epochs=null",
                                     "trainer.export_hf=false", f"trainer.output_dir={run}"],
                     capsys)
    assert code == 0, err[-2000:]
    for folder, extra, message in [
            (mine, [], "holds files that no rapidformer run wrote (notes.txt)"),
            (stray, [], "holds files that no rapidformer run wrote (.rapidformer-run, x)"),
            (run, [], "holds an earlier run"),
            (run, ["trainer.resume=auto"], None), (run, ["trainer.overwrite=true"], None)]:
        code, err = call("cli", ["validate", f"trainer.output_dir={folder}", *extra], capsys)
        run_code, run_err = call("rapidformer", [*FAST, "trainer.train_iters=1",
                                                 "trainer.epochs=null", "trainer.export_hf=false",
                                                 f"trainer.output_dir={folder}", *extra], capsys)
        if message is None:
            assert code == 0 == run_code, (err[-1500:], run_err[-1500:])
        else:
            assert code == 2 == run_code and message in err and message in run_err, err


def test_a_sweep_runs_again_where_a_job_was_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    common = ["-m", *FAST, "trainer.train_iters=1", "trainer.epochs=null",
              "trainer.export_hf=false", f"hydra.sweep.dir={sweep}"]
    call("rapidformer", [*common, "trainer.micro_batch_size=16,3"], capsys)
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "failed"
    call("rapidformer", [*common, "trainer.micro_batch_size=16,8", "trainer.resume=auto"],
         capsys)
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "ok"


def test_hydra_run_dir_of_its_own_runs(tmp_path, capsys):
    code, err = call("rapidformer", [*FAST, "trainer.train_iters=1", "trainer.epochs=null",
                                     "trainer.export_hf=false", f"trainer.output_dir={tmp_path}/a",
                                     f"hydra.run.dir={tmp_path}/b"], capsys)
    assert code == 0, err[-2000:]


def test_a_pretraining_checkpoint_past_train_iters_is_refused(tmp_path, pretraining_data):
    from rapidformer.config.compose import compose
    from rapidformer.engine import RapidformerEngine
    from rapidformer.preflight import settle
    from rapidformer.tasks import task_class
    from tests.test_decoders import llama_args

    def pretrain(*overrides):
        _, cfg = settle(compose([*llama_args(pretraining_data), "trainer.save_interval=3",
                                 f"trainer.output_dir={tmp_path}", *overrides]), str(tmp_path))
        return task_class(cfg.task.name)(engine=RapidformerEngine(cfg, tmp_path)).train()

    pretrain("trainer.train_iters=3")
    with pytest.raises(InputError, match=r"has trained 3 steps, past what this run asks "
                                         r"\(trainer.train_iters=2\)"):
        pretrain("trainer.train_iters=2", "trainer.resume=auto")
