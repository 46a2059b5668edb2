"""Shared helpers: tiny generated data, and running the real CLI in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# No test may touch the network: the hub libraries fail at once instead of retrying.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HYDRA_FULL_ERROR": "0"}
os.environ.update(OFFLINE_ENV)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes share CI's 2 cores: one compute thread each (two OpenMP teams on the
    # same cores spin against each other); the runs they start inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

# the longest files first (by their summed durations on 2 cores): under `--dist loadfile` a
# worker takes a whole file, and a long one that starts last keeps its worker busy while the
# other has nothing left (CI's parallel lane)
LONGEST_FIRST = ("test_doc_commands.py", "test_tuning.py", "test_strategies.py",
                 "test_distributed.py", "test_train.py", "test_tasks.py", "test_parallel.py",
                 "test_megatron_llama.py", "test_pretraining.py", "test_quiet_console.py",
                 "test_uneven_eval.py", "test_everyday_round3.py", "test_loader_exit.py",
                 "test_trust_runs.py")


def pytest_collection_modifyitems(items):
    """Files in LONGEST_FIRST order, then the rest as collected; a file's tests stay together
    and in their order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# short runs: a small model on small data, a handful of steps
FAST = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=1",
        "data.synthetic_train_size=256", "data.synthetic_eval_size=64",
        "trainer.micro_batch_size=16", "trainer.global_batch_size=32", "trainer.epochs=1"]


@pytest.fixture(autouse=True, scope="module")
def _megatron_cpu_stays_in_its_module():
    """A module that ran megatron-core on the CPU in this process leaves no CUDA-to-CPU modes
    behind for the next one (they would stay under torch.compile and every factory)."""
    yield
    from rapidformer.accelerators import megatron_cpu

    megatron_cpu.disable()


def run_cli(args: list[str], cwd: Path, timeout: int = 600, module: str = "rapidformer",
            env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    full_env.pop("RAPIDFORMER_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_here(argv: list[str], capsys, monkeypatch, tmp_path) -> tuple[int, str]:
    """`python -m rapidformer argv` in this process, from tmp_path: (exit code, what it printed:
    stdout, then stderr). For tests whose subject is not the CLI's process (a subprocess pays
    the imports again)."""
    from rapidformer import __main__ as module_main

    monkeypatch.chdir(tmp_path)
    try:
        module_main.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def run_in_process(argv: list[str], cwd: Path) -> None:
    """`python -m rapidformer argv` in this process, from cwd, for a run that must succeed and
    whose console is not checked: a fixture's reference run (run_here needs a test's capsys)."""
    from rapidformer import __main__ as module_main

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        try:
            module_main.main(argv)
        except SystemExit as exc:
            assert exc.code in (0, None), f"{argv}: exit code {exc.code}"


def assert_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="session")
def pairs_dir(tmp_path_factory) -> Path:
    from rapidformer.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("pairs"), train_size=256, eval_size=64, seed=7)


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory, pairs_dir):
    """A 'pretrained' model directory made locally: a trained vocab and a config-built BERT."""
    from transformers import BertConfig, BertForSequenceClassification

    from rapidformer.data.synthetic import make_split
    from rapidformer.data.tokenizers import train_wordpiece

    out = tmp_path_factory.mktemp("tiny_bert")
    texts = [r[k] for r in make_split(500, 1) for k in ("sentence1", "sentence2")]
    tokenizer = train_wordpiece(texts, out, vocab_size=300, lowercase=True, max_length=64)
    BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128)).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def pretraining_data(tmp_path_factory) -> dict:
    """A generated corpus, its WordPiece and GPT-2 BPE vocabularies, and both preprocessed:
    sentence-level data for BERT and document-level data (with EOD) for GPT."""
    from rapidformer.data.corpus import write_pretraining_sample

    return write_pretraining_sample(tmp_path_factory.mktemp("pretraining_data"))


def free_port() -> int:
    """A TCP port free on this machine now (for a test's own rendezvous of several processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
