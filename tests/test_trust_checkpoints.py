"""Trust, round 3: a checkpoint that cannot be read is named, file by file, and never loaded,
pruned or replaced because of it; preprocessing never writes over its own input.

Checkpoints: every kind of damage (a changed byte, a truncated file, a deleted file, a missing
manifest, a manifest listing a file that is gone, an empty step directory, a file where a step
directory belongs, an unreadable manifest) x where it is (every checkpoint, the newest with an
older intact one, an older one with the newest intact) x how the run asks for it
(trainer.resume=auto, trainer.resume=PATH, a fresh run with trainer.overwrite=true), first on
the store and the resume protocol directly, then through the real entry points for each kind.
Preprocessing: every way an output can be an input (the same path, a relative or `..` path, a
linked folder, a link either way, a hard link, another --json-keys key, the sentence level, the
tokenizer files, a temporary file's name): exit 2 before any work, nothing written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from rapidformer.checkpoint import store
from rapidformer.checkpoint.protocol import CheckpointProtocol
from rapidformer.cli.verbs.verify import verify_command
from rapidformer.errors import InputError
from tests.conftest import FAST, read_metrics, train_losses
from tests.test_bad_input import call

QUICK = [*FAST, "trainer.export_hf=false", "trainer.epochs=null", "trainer.save_interval=1"]


# --- damage, kind by kind -----------------------------------------------------------------------

def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def listed(step: Path, rel: str) -> int:
    return json.loads((step / store.MANIFEST).read_text())["files"][rel]["bytes"]


def changed_byte(step: Path) -> str:
    flip_a_byte(step / "optimizer.pt")
    return "optimizer.pt: its bytes changed since it was written (sha256 differs)"


def truncated(step: Path) -> str:
    size = listed(step, "optimizer.pt")
    with open(step / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    return f"optimizer.pt: truncated to 100 of {size} bytes"


def deleted_file(step: Path) -> str:
    size = listed(step, "optimizer.pt")
    (step / "optimizer.pt").unlink()
    return f"optimizer.pt: deleted ({store.MANIFEST} lists it, {size} bytes; it is not there)"


def appended(step: Path) -> str:
    size = listed(step, "optimizer.pt")
    with open(step / "optimizer.pt", "ab") as f:
        f.write(b"\0" * 19)
    return f"optimizer.pt: {size + 19} bytes, 19 more than the {size} written"


def missing_manifest(step: Path) -> str:
    (step / store.MANIFEST).unlink()
    return f"{store.MANIFEST} is missing: deleted since the checkpoint was written"


def listed_file_gone(step: Path) -> str:
    """A folder of the checkpoint (the tokenizer's) gone: the manifest lists its files."""
    gone = sorted(p.relative_to(step).as_posix() for p in (step / "tokenizer").rglob("*")
                  if p.is_file())[0]
    shutil.rmtree(step / "tokenizer")
    return f"{gone}: deleted ({store.MANIFEST} lists it"


def empty_directory(step: Path) -> str:
    shutil.rmtree(step)
    step.mkdir()
    return f"empty: it holds no files, not even its manifest {store.MANIFEST}"


def file_instead(step: Path) -> str:
    shutil.rmtree(step)
    step.write_text("not a checkpoint\n")
    return "a file, not a checkpoint directory"


def unreadable_manifest(step: Path) -> str:
    seal = step / store.MANIFEST
    seal.write_bytes(seal.read_bytes()[:40])
    return f"{store.MANIFEST}: not valid JSON"


DAMAGE = {f.__name__: f for f in (changed_byte, truncated, appended, deleted_file,
                                  missing_manifest,
                                  listed_file_gone, empty_directory, file_instead,
                                  unreadable_manifest)}


def write_checkpoint(root: Path, step: int, keep_last: int = 10) -> Path:
    """A checkpoint shaped like a run's: model, an optimizer over 64 KiB, its tokenizer folder."""
    torch.manual_seed(step)

    def tokenizer(d: Path) -> None:
        (d / "tokenizer").mkdir()
        (d / "tokenizer" / "vocab.txt").write_text("[PAD]\n[UNK]\nthe\n")
        (d / "tokenizer" / "tokenizer_config.json").write_text("{}\n")

    return store.save(root, step, {"model.pt": {"w": torch.randn(64)},
                                   "optimizer.pt": {"m": torch.randn(64, 256)}},
                      {"step": step}, tokenizer, keep_last=keep_last)


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` with its bytes' digest: what must not change."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        found[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def protocol(root: Path) -> CheckpointProtocol:
    return CheckpointProtocol(root, rank=0, world_size=1, strategy=None, keep_last=2)


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory with intact checkpoints at steps 2 and 3."""
    for step in (2, 3):
        write_checkpoint(tmp_path / "run" / "checkpoints", step)
    return tmp_path / "run"


# --- the store and the resume protocol, the whole table -------------------------------------------

@pytest.mark.parametrize("kind", DAMAGE)
def test_each_damage_is_named_with_its_file(run, kind):
    step = run / "checkpoints" / "step_00000003"
    expected = DAMAGE[kind](step)
    problems = store.verify(step)
    assert problems and expected in problems[0], problems
    assert "interrupted" not in problems[0]  # only a .tmp- directory is an interrupted save


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_checkpoint_damaged_is_refused_and_left_as_it_is(run, kind, caplog):
    root = run / "checkpoints"
    expected = [DAMAGE[kind](root / f"step_0000000{s}") for s in (2, 3)]
    (root / ".tmp-step_00000004").mkdir()  # an interrupted save beside them
    before = tree(run)
    for choice in ("auto", str(run), str(root)):
        with caplog.at_level(logging.INFO, "rapidformer"), pytest.raises(InputError) as refused:
            protocol(root).locate(choice)
        message = str(refused.value)
        for s, fragment in zip((2, 3), expected):
            assert f"{root / f'step_0000000{s}'}: {fragment}" in message, message
        assert "2 damaged" in message and ".tmp-step_00000004" in message
        for way_out in ("rapidformer verify", "trainer.resume=PATH", "trainer.overwrite=true"):
            assert way_out in message
        assert "starting fresh" not in caplog.text
    assert tree(run) == before


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_newest_damaged_resumes_the_older_one_and_names_it(run, kind, caplog):
    root = run / "checkpoints"
    newest = root / "step_00000003"
    expected = DAMAGE[kind](newest)
    before = tree(run)
    for choice in ("auto", str(run)):
        with caplog.at_level(logging.WARNING, "rapidformer"):
            assert protocol(root).locate(choice) == root / "step_00000002"
        assert f"ignoring damaged checkpoint {newest}: {expected}" in caplog.text
        caplog.clear()
    with pytest.raises(InputError) as refused:
        protocol(root).locate(str(newest))
    assert f"checkpoint {newest} is damaged: {expected}" in str(refused.value)
    assert tree(run) == before


@pytest.mark.parametrize("kind", DAMAGE)
def test_the_newest_intact_is_resumed_whatever_is_older(run, kind):
    root = run / "checkpoints"
    DAMAGE[kind](root / "step_00000002")
    before = tree(run)
    for choice in ("auto", str(run), str(root / "step_00000003")):
        assert protocol(root).locate(choice) == root / "step_00000003"
    assert tree(run) == before


def test_what_is_not_a_checkpoint_starts_fresh_and_stays(tmp_path, caplog):
    """Interrupted saves and directories that are not rapidformer's are no checkpoints: a fresh
    start, and they are left alone (the next save removes only the interrupted ones)."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    (root / "my_backup").mkdir(parents=True)
    (root / "my_backup" / "model.pt").write_bytes(b"the user's own")
    (root / ".tmp-step_00000002").mkdir()
    with caplog.at_level(logging.INFO, "rapidformer"):
        assert protocol(root).locate("auto") is None
    assert "starting fresh" in caplog.text
    assert f"leaving {root / 'my_backup'} alone: not a checkpoint" in caplog.text
    assert f"ignoring {root / '.tmp-step_00000002'}: an interrupted save" in caplog.text
    for choice in (str(root / "my_backup"), str(root / ".tmp-step_00000002"), str(run)):
        with pytest.raises(InputError) as refused:
            protocol(root).locate(choice)
        assert "not a checkpoint" in str(refused.value) or "no checkpoint" in str(refused.value)
    assert "interrupted save" in str(pytest.raises(
        InputError, protocol(root).locate, str(root / ".tmp-step_00000002")).value)
    write_checkpoint(root, 1, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["my_backup", "step_00000001"]


# --- saving and pruning: by age alone ---------------------------------------------------------

@pytest.mark.parametrize("kind", DAMAGE)
def test_a_save_sets_a_damaged_step_aside_and_prunes_by_age_only(run, kind, caplog):
    root = run / "checkpoints"
    newest = root / "step_00000003"
    expected = DAMAGE[kind](newest)
    damaged = tree(root / "step_00000003") if newest.is_dir() else newest.read_bytes()
    write_checkpoint(root, 4, keep_last=5)  # damaged 3 is within keep_last: it stays
    assert newest.exists() and not store.verify(root / "step_00000004")
    with caplog.at_level(logging.WARNING, "rapidformer"):
        write_checkpoint(root, 3, keep_last=5)  # a run resumed from 2 reaches step 3 again
    assert not store.verify(newest)
    aside = root / "step_00000003.damaged"
    if kind == "empty_directory":  # nothing to keep: replaced, and said so
        assert not aside.exists() and f"replaces {newest}: an empty directory" in caplog.text
    else:
        assert (tree(aside) if aside.is_dir() else aside.read_bytes()) == damaged
        assert f"checkpoint {newest} could not be read ({expected}" in caplog.text
        assert f"keeps the damaged one as {aside}" in caplog.text
    for step in (5, 6, 7):
        write_checkpoint(root, step, keep_last=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ([] if kind == "empty_directory" else ["step_00000003.damaged"]) + \
        ["step_00000006", "step_00000007"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_step_goes_only_where_an_intact_one_would(tmp_path, kind):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        write_checkpoint(root, step, keep_last=3)
    DAMAGE[kind](root / "step_00000002")
    (root / ".tmp-step_00000009").mkdir()
    (root / "notes").mkdir()
    write_checkpoint(root, 3, keep_last=3)  # 1 and 3 intact, 2 damaged: all within keep_last
    assert sorted(p.name for p in root.iterdir()) == \
        ["notes", "step_00000001", "step_00000002", "step_00000003"]
    write_checkpoint(root, 4, keep_last=3)
    # 1, 3 and 4 are the 3 newest complete ones: a damaged one counts for none (a changed byte
    # is not seen without reading: by its size, 2 is one of them, and 1 goes)
    assert sorted(p.name for p in root.iterdir()) == ["notes", *(
        ["step_00000002", "step_00000003", "step_00000004"] if kind == "changed_byte" else
        ["step_00000001", "step_00000002", "step_00000003", "step_00000004"])]
    write_checkpoint(root, 5, keep_last=3)  # 3 intact checkpoints newer than 1 and 2: by age
    assert sorted(p.name for p in root.iterdir()) == \
        ["notes", "step_00000003", "step_00000004", "step_00000005"]


def test_the_best_checkpoint_is_kept_damaged_or_not(tmp_path):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 1)
    store.write_best(root, {"step": 1, "metric": "validation/loss", "value": 0.5})
    truncated(root / "step_00000001")
    for step in (2, 3, 4):
        write_checkpoint(root, step, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == \
        ["best.json", "step_00000001", "step_00000004"]


def test_the_same_step_saved_again_replaces_its_own_checkpoint(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 5)
    with caplog.at_level(logging.WARNING, "rapidformer"):
        write_checkpoint(root, 5)  # this process wrote it: unread, unreported
    assert caplog.text == "" and os.listdir(root) == ["step_00000005"]
    store._sealed.clear()  # as if another process had written it, intact
    with caplog.at_level(logging.WARNING, "rapidformer"):
        write_checkpoint(root, 5)
    assert "replaces" in caplog.text and "an intact checkpoint that this run did not write" in \
        caplog.text and os.listdir(root) == ["step_00000005"]


@pytest.mark.parametrize("left, says", [
    (".tmp-replaced-step_00000007", "an interrupted replacement: .tmp-replaced-step_00000007 is "
                                    "a checkpoint that a newer save of its step replaced"),
    (".tmp-pruned-step_00000001", "an interrupted removal: .tmp-pruned-step_00000001 is a "
                                  "checkpoint that trainer.keep_last was removing")])
def test_a_crash_while_replacing_or_pruning_leaves_no_half_step(tmp_path, monkeypatch, left,
                                                                says):
    """A checkpoint being replaced or pruned is renamed to a `.tmp-` name first: a crash while
    it is deleted leaves what the next save removes, never a step directory missing files."""
    root = tmp_path / "checkpoints"
    write_checkpoint(root, 1)
    (root / left).mkdir()  # what a crash while it was deleted leaves
    (root / left / "model.pt").write_bytes(b"old")
    assert store.verify(root / left)[0].startswith(says)
    write_checkpoint(root, 2)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    removed = []
    monkeypatch.setattr(store, "_remove", lambda p: removed.append(p.name))
    write_checkpoint(root, 3, keep_last=2)
    assert removed[-1] == ".tmp-pruned-step_00000001"  # renamed, then removed
    assert ".tmp-pruned-step_00000001" in os.listdir(root) and "step_00000001" not in \
        os.listdir(root)


# --- verify -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_names_each_file_and_what_is_wrong(run, kind, capsys):
    root = run / "checkpoints"
    expected = DAMAGE[kind](root / "step_00000003")
    (root / ".tmp-step_00000004").mkdir()
    (root / "copied_by_hand").mkdir()
    assert verify_command([str(run)]) == 2
    captured = capsys.readouterr()
    assert f"DAMAGED  {root / 'step_00000003'}\n         {expected}" in captured.out
    assert f"ok       {root / 'step_00000002'}" in captured.out
    assert f"skipped  {root / '.tmp-step_00000004'} (an interrupted save: .tmp-step_00000004 " \
           f"is the temporary directory" in captured.out
    assert f"skipped  {root / 'copied_by_hand'} (not a checkpoint" in captured.out
    assert "1 of 2 checkpoints are damaged; resume skips them (trainer.resume=auto takes the " \
           "newest intact one, step_00000002)" in captured.err
    assert verify_command([str(root / "step_00000003")]) == 2
    assert expected in capsys.readouterr().out
    DAMAGE[kind](root / "step_00000002")
    assert verify_command([str(run)]) == 2
    assert "none can be resumed: trainer.resume=auto refuses this run" in capsys.readouterr().err


def test_verify_of_an_interrupted_save_says_so(tmp_path, capsys):
    tmp = tmp_path / "run" / "checkpoints" / ".tmp-step_00000004"
    tmp.mkdir(parents=True)
    code, err = call("cli", ["verify", str(tmp)], capsys)
    assert code == 2 and "an interrupted save: .tmp-step_00000004" in err, err
    code, err = call("cli", ["verify", str(tmp_path / "run")], capsys)
    assert code == 2 and "no checkpoint found" in err and ".tmp-step_00000004: an interrupted " \
        "save" in err, err


# --- through the real entry points --------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 3 (trainer.keep_last=2), trained in this
    process: the entry points that read it are the subject."""
    from tests.conftest import run_in_process

    run = tmp_path_factory.mktemp("saved") / "run"
    run_in_process([*QUICK, "trainer.train_iters=3", f"trainer.output_dir={run}"],
                   cwd=run.parent)
    return run


def copy_of(saved_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run


def test_the_issue_every_optimizer_changed_is_refused_not_restarted(saved_run, tmp_path,
                                                                      capsys):
    """One changed byte in optimizer.pt of each checkpoint (model.pt intact), resume=auto: it
    used to log `starting fresh`, train from step 1, replace one damaged step and prune the
    other, with two histories in metrics.jsonl, and exit 0."""
    run = copy_of(saved_run, tmp_path)
    root = run / "checkpoints"
    for step in ("step_00000002", "step_00000003"):
        flip_a_byte(root / step / "optimizer.pt")
    checkpoints, metrics = tree(root), (run / "metrics.jsonl").read_bytes()
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=5", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    message = next(line for line in err.splitlines() if line.startswith("rapidformer: error:"))
    for step in ("step_00000003", "step_00000002"):
        assert f"{root / step}: optimizer.pt: its bytes changed since it was written" in message
    assert f"rapidformer verify {run}" in message and "trainer.resume=PATH" in message
    assert "trainer.overwrite=true" in message
    assert tree(root) == checkpoints and (run / "metrics.jsonl").read_bytes() == metrics
    assert "starting fresh" not in (run / "rapidformer.log").read_text()


def test_resume_path_names_the_truncated_file(saved_run, tmp_path, capsys):
    run = copy_of(saved_run, tmp_path)
    newest = run / "checkpoints" / "step_00000003"
    expected = truncated(newest)
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=5", f"trainer.resume={newest}",
                                     f"trainer.output_dir={tmp_path / 'other'}"], capsys)
    assert code == 2 and f"checkpoint {newest} is damaged: {expected}" in err, err[-3000:]


@pytest.mark.parametrize("kind", ["deleted_file", "missing_manifest", "truncated"])
def test_a_damaged_newest_is_named_resumed_past_and_set_aside(saved_run, tmp_path, capsys,
                                                              kind):
    """A deleted file used to be blamed on `a save was interrupted`. The run resumes from the
    older checkpoint, and its save of the damaged step keeps the damaged one aside."""
    run = copy_of(saved_run, tmp_path)
    root = run / "checkpoints"
    expected = DAMAGE[kind](root / "step_00000003")
    damaged = tree(root / "step_00000003")
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=4", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-3000:]
    log = (run / "rapidformer.log").read_text()
    assert f"ignoring damaged checkpoint {root / 'step_00000003'}: {expected}" in log
    assert "a save was interrupted" not in log
    assert f"resumed from {root / 'step_00000002'} (step 2)" in log
    assert tree(root / "step_00000003.damaged") == damaged
    assert sorted(p.name for p in root.iterdir()) == \
        ["step_00000003", "step_00000003.damaged", "step_00000004"]
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == [1, 2, 3, 3, 4]  # the first run's 1-3, then 3-4 resumed from step 2


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_auto_refuses_each_kind_and_overwrite_starts_fresh(saved_run, tmp_path, capsys,
                                                                  kind):
    run = copy_of(saved_run, tmp_path)
    root = run / "checkpoints"
    expected = [DAMAGE[kind](root / step) for step in ("step_00000002", "step_00000003")]
    checkpoints, metrics = tree(root), (run / "metrics.jsonl").read_bytes()
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=2", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 2 and all(e in err for e in expected), err[-3000:]
    assert tree(root) == checkpoints and (run / "metrics.jsonl").read_bytes() == metrics
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=2", "trainer.overwrite=true",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert sorted(train_losses(run)) == [1, 2]


def test_a_directory_that_is_not_a_checkpoint_is_left_alone(saved_run, tmp_path, capsys):
    run = copy_of(saved_run, tmp_path)
    root = run / "checkpoints"
    stray = root / "my_backup"
    shutil.copytree(root / "step_00000002", stray)
    mine = tree(stray)
    for step in ("step_00000002", "step_00000003"):
        deleted_file(root / step)
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=2", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 2 and "2 damaged" in err, err[-3000:]  # a stray is no way around them
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=2", "trainer.overwrite=true",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["my_backup", "step_00000001",
                                                      "step_00000002"]
    for step in ("step_00000001", "step_00000002"):  # only the stray left: a fresh start
        shutil.rmtree(root / step)
    code, err = call("rapidformer", [*QUICK, "trainer.train_iters=3", "trainer.resume=auto",
                                     f"trainer.output_dir={run}"], capsys)
    assert code == 0, err[-3000:]
    log = (run / "rapidformer.log").read_text()
    assert f"leaving {stray} alone: not a checkpoint" in log and "starting fresh" in log
    assert sorted(p.name for p in root.iterdir()) == ["my_backup", "step_00000002",
                                                      "step_00000003"]
    assert tree(stray) == mine


def test_export_names_the_changed_file(saved_run, tmp_path, capsys):
    run = copy_of(saved_run, tmp_path)
    newest = run / "checkpoints" / "step_00000003"
    expected = changed_byte(newest)
    code, err = call("cli", ["export", str(newest), "--to", str(tmp_path / "out")], capsys)
    assert code == 2 and f"is damaged: {expected}" in err, err[-3000:]


def test_export_names_the_truncated_file(saved_run, tmp_path, capsys):
    run = copy_of(saved_run, tmp_path)
    newest = run / "checkpoints" / "step_00000003"
    expected = truncated(newest)
    code, err = call("cli", ["export", str(newest), "--to", str(tmp_path / "out")], capsys)
    assert code == 2 and expected in err, err[-3000:]


# --- preprocessing never writes over its input ------------------------------------------------

TEXTS = ["The doctor bought a car. It was red!", "A teacher found the boat near the river."]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 3, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out))
    return out / "vocab.json", out / "merges.txt"


def corpus_text() -> str:
    return "".join(json.dumps({"text": t, "title": t[:9]}) + "\n" for t in TEXTS)


def _same_path(d: Path, files):
    (d / "out_text_document.bin").write_text(corpus_text())
    return ["--input", str(d / "out_text_document.bin"), "--output-prefix", str(d / "out")]


def _the_idx(d: Path, files):
    (d / "out_text_document.idx").write_text(corpus_text())
    return ["--input", str(d / "out_text_document.idx"), "--output-prefix", str(d / "out")]


def _relative_input(d: Path, files):
    (d / "out_text_document.bin").write_text(corpus_text())
    return ["--input", "out_text_document.bin", "--output-prefix", str(d / "out")]


def _relative_prefix(d: Path, files):
    (d / "out_text_document.bin").write_text(corpus_text())
    return ["--input", str(d / "out_text_document.bin"), "--output-prefix", "out"]


def _dot_dot(d: Path, files):
    (d / "sub").mkdir()
    (d / "out_text_document.bin").write_text(corpus_text())
    return ["--input", str(d / "out_text_document.bin"), "--output-prefix",
            str(d / "sub" / ".." / "out")]


def _linked_folder(d: Path, files):
    (d / "data").mkdir()
    (d / "data" / "out_text_document.bin").write_text(corpus_text())
    (d / "link").symlink_to(d / "data")
    return ["--input", str(d / "data" / "out_text_document.bin"), "--output-prefix",
            str(d / "link" / "out")]


def _input_links_to_output(d: Path, files):
    (d / "out_text_document.bin").write_text(corpus_text())
    (d / "corpus.json").symlink_to(d / "out_text_document.bin")
    return ["--input", str(d / "corpus.json"), "--output-prefix", str(d / "out")]


def _output_links_to_input(d: Path, files):
    (d / "corpus.json").write_text(corpus_text())
    (d / "out_text_document.bin").symlink_to(d / "corpus.json")
    return ["--input", str(d / "corpus.json"), "--output-prefix", str(d / "out")]


def _hard_link(d: Path, files):
    (d / "corpus.json").write_text(corpus_text())
    os.link(d / "corpus.json", d / "out_text_document.idx")
    return ["--input", str(d / "corpus.json"), "--output-prefix", str(d / "out")]


def _second_json_key(d: Path, files):
    (d / "out_title_document.idx").write_text(corpus_text())
    return ["--input", str(d / "out_title_document.idx"), "--output-prefix", str(d / "out"),
            "--json-keys", "text", "title"]


def _sentence_level(d: Path, files):
    (d / "out_text_sentence.bin").write_text(corpus_text())
    return ["--input", str(d / "out_text_sentence.bin"), "--output-prefix", str(d / "out"),
            "--split-sentences"]


def _vocab_file(d: Path, files):
    (d / "corpus.json").write_text(corpus_text())
    shutil.copy(files[0], d / "out_text_document.idx")
    return ["--input", str(d / "corpus.json"), "--output-prefix", str(d / "out"),
            "--vocab-file", str(d / "out_text_document.idx")]


def _merge_file(d: Path, files):
    (d / "corpus.json").write_text(corpus_text())
    shutil.copy(files[1], d / "out_text_document.bin")
    return ["--input", str(d / "corpus.json"), "--output-prefix", str(d / "out"),
            "--merge-file", str(d / "out_text_document.bin")]


def _temporary_name(d: Path, files):
    (d / ".tmp-out_text_document-999999999.bin").write_text(corpus_text())
    return ["--input", str(d / ".tmp-out_text_document-999999999.bin"), "--output-prefix",
            str(d / "out")]


OVER_INPUT = {
    "the same path": (_same_path, "(the same path)"),
    "the .idx": (_the_idx, "(the same path)"),
    "a relative input": (_relative_input, "(the same file, by another path"),
    "a relative prefix": (_relative_prefix, "(the same file, by another path"),
    "a '..' in the prefix": (_dot_dot, "(the same file, by another path"),
    "a linked folder": (_linked_folder, "(the same file, by another path"),
    "the input a link to the output": (_input_links_to_output, "through a symbolic link"),
    "the output a link to the input": (_output_links_to_input, "through a symbolic link"),
    "a hard link": (_hard_link, "through a hard link"),
    "another --json-keys key": (_second_json_key, "writes " + "{d}/out_title_document.idx"),
    "--split-sentences": (_sentence_level, "writes {d}/out_text_sentence.bin"),
    "the vocab file": (_vocab_file, "--vocab-file"),
    "the merges file": (_merge_file, "--merge-file"),
    "a temporary file's name": (_temporary_name, "the name of a temporary file"),
}


@pytest.mark.parametrize("case", OVER_INPUT)
def test_preprocessing_refuses_to_write_over_its_input(tmp_path, gpt2_files, monkeypatch,
                                                       capsys, case):
    make, fragment = OVER_INPUT[case]
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.chdir(d)
    argv = make(d, gpt2_files)
    if "--vocab-file" not in argv:
        argv += ["--vocab-file", str(gpt2_files[0])]
    if "--merge-file" not in argv:
        argv += ["--merge-file", str(gpt2_files[1])]
    before = {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None)
              for p in sorted(tmp_path.rglob("*"))}
    code, err = call("preprocess", [*argv, "--tokenizer-type", "GPT2BPETokenizer",
                                    "--append-eod", "--workers", "2"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert "is also an output of this run" in err or "temporary file" in err, err
    assert fragment.format(d=d) in err and "nothing was written" in err, err
    after = {p: (p.is_symlink(), p.read_bytes() if p.is_file() else None)
             for p in sorted(tmp_path.rglob("*"))}
    assert after == before  # nothing written, nothing removed
