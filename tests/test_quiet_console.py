"""A quiet console: what the libraries under rapidformer print that says nothing to the user is
silenced where it arises (rapidformer/observability/quiet.py), and shown with
RAPIDFORMER_DEBUG=1; their real warnings still show; a requested stop reads as a stop; log lines
go to stdout and rapidformer's own messages to stderr, in a single run, a multi-process run and
a sweep.

The runs go through the real CLI in a subprocess: its console is what is checked, and most of
the noise is printed once per process, when a library is first imported. Each filter's reach
(its line, and not a neighbour's) is checked in-process."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from rapidformer.errors import EXIT_PREEMPTED
from rapidformer.observability import quiet
from tests.conftest import FAST, OFFLINE_ENV, assert_ok, run_cli

# what the libraries printed before (one line each), on any run or verb
NOISE = {
    "transformers, asked by peft": "`is_gradient_checkpointing` is deprecated",
    "peft's adapter export": "will assume that the vocabulary was not modified",
    "megatron-core without Transformer Engine": "Transformer Engine and Apex are not installed",
    "megatron-core without apex": "Apex is not installed",
    "megatron-core's own default": "full scope is deprecated",
    "megatron-core on a CPU": "CUDA_DEVICE_MAX_CONNECTIONS",
    "DeepSpeed's accelerator probe": "Setting accelerator to CPU",
    "bitsandbytes' CPU kernel": "gemm_4bit_forward",
    "torch elastic's agent": "death signal",
    "matplotlib, on a sweep's plots": "Tight layout not applied",
}
PYTHON_WARNING = re.compile(r"\b\w*Warning: ")  # any warning Python prints, not a log level
LOG_LINE = re.compile(r"^(\[default_role\d\]:)?\[[0-9-]+ [0-9:,]+\]\[[\w. ]+\]\[(INFO|WARNING)\]",
                      re.M)

LORA_RUN = ["+recipe=llama_lora", "trainer.epochs=null", "trainer.train_iters=2",
            "model.hidden_size=16", "model.num_layers=1", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=32",
            "data.synthetic_train_size=32", "data.synthetic_eval_size=8",
            "trainer.micro_batch_size=8", "trainer.global_batch_size=8", "peft.r=2",
            "peft.alpha=4", "trainer.export_hf=false", "trainer.progress_bar=false",
            "task.sample_generations=0"]


def assert_quiet(result: subprocess.CompletedProcess) -> None:
    console = result.stdout + result.stderr
    heard = {source: text for source, text in NOISE.items() if text in console}
    assert not heard, f"{heard}\n{console[-4000:]}"
    assert not PYTHON_WARNING.search(console), console[-4000:]


def assert_streams(result: subprocess.CompletedProcess, summary: str) -> None:
    """Log lines on stdout only; rapidformer's own summary on stderr only."""
    assert LOG_LINE.search(result.stdout), result.stdout[-3000:]
    assert not LOG_LINE.search(result.stderr), result.stderr[-3000:]
    assert summary in result.stderr and summary not in result.stdout, result.stderr[-3000:]


def debug_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "RAPIDFORMER_DEBUG": "1"}
    return subprocess.run([sys.executable, "-m", "rapidformer.cli.console", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


# --- the filters' reach, in-process ------------------------------------------------------------

# (message, category, module) a filter silences, and neighbours it must leave alone
SILENCED = [
    ("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
     "`is_activation_checkpointing` instead.", FutureWarning, "transformers.modeling_utils"),
    ("Could not find a config file in /x/peft/base_config.json - will assume that the vocabulary "
     "was not modified.", UserWarning, "peft.utils.save_and_load"),
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
     UserWarning, "megatron.core.optimizer"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning,
     "megatron.core.models.gpt.gpt_layer_specs"),
    ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
     UserWarning, "megatron.core.transformer.transformer_config"),
]
SHOWN = [
    # the same words from the user's own code, or another library
    ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning,
     "__main__"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "my_model"),
    # another warning of the same module, or of the same words and another category
    ("`foo` is deprecated and will be removed in v6.", FutureWarning,
     "transformers.modeling_utils"),
    ("Setting `save_embedding_layers` to `True` as the embedding layer has been resized during "
     "finetuning.", UserWarning, "peft.utils.save_and_load"),
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
     RuntimeWarning, "megatron.core.optimizer"),
    # the CPU-only line, while no megatron-core runs on the CPU in this process
    ("When using async grad allreduce it is recommended to set the environment variable "
     "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning,
     "megatron.core.tensor_parallel.layers"),
]


CPU_ONLY = SHOWN[-1]


@pytest.fixture(autouse=True)
def _not_debugging(monkeypatch):
    monkeypatch.delenv("RAPIDFORMER_DEBUG", raising=False)


def shown(message: str, category: type[Warning], module: str, megatron_on_cpu=False) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        # again: pytest's catch_warnings around collection dropped those of the import
        quiet.install()
        if megatron_on_cpu:
            quiet.megatron_on_cpu()
        warnings.simplefilter("always", append=True)  # behind the filters: no "once" here
        warnings.warn_explicit(message, category, "library.py", 1, module=module, registry={})
    return bool(caught)


@pytest.mark.parametrize("warning", SILENCED, ids=[w[2] for w in SILENCED])
def test_a_library_line_that_says_nothing_is_silenced(warning):
    assert not shown(*warning)
    assert not shown(*warning, megatron_on_cpu=True)


def test_megatron_core_s_cuda_advice_is_silenced_on_a_cpu_only():
    assert not shown(*CPU_ONLY, megatron_on_cpu=True)
    assert shown(*CPU_ONLY)


@pytest.mark.parametrize("warning", SHOWN, ids=[f"{w[2]}: {w[0][:30]}" for w in SHOWN])
def test_the_same_words_elsewhere_and_the_library_s_other_warnings_still_show(warning):
    assert shown(*warning)


def test_log_records_dropped_are_the_one_line_at_its_level():
    quiet.install()

    def kept(logger: str, level: int, msg: str, *args) -> bool:
        record = logging.LogRecord(logger, level, "lib.py", 1, msg, args, None)
        return bool(logging.getLogger(logger).filter(record))

    elastic = "torch.distributed.elastic.agent.server.api"
    death = "Received %s death signal, shutting down workers"
    assert not kept(elastic, logging.WARNING, death, signal.SIGINT)
    assert not kept(elastic, logging.WARNING, death, signal.SIGTERM)
    assert kept(elastic, logging.WARNING, death, signal.SIGHUP)  # not a stop rapidformer handles
    assert kept(elastic, logging.WARNING, "Rendezvous timed out")
    cpu = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to " \
          "detect it."
    assert not kept("DeepSpeed", logging.WARNING, cpu)
    assert kept("DeepSpeed", logging.WARNING, "ZeRO-3 partitioning: something real")
    assert kept("DeepSpeed", logging.ERROR, cpu)
    kernel = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure"
    assert not kept("bitsandbytes.backends.cpu.ops", logging.WARNING, kernel, "No module")
    assert kept("bitsandbytes.backends.cpu.ops", logging.WARNING, "another failure")


# --- the runs' consoles -------------------------------------------------------------------------

def test_a_lora_run_and_its_adapter_export_print_no_library_noise(tmp_path):
    """LoRA training (peft wraps the model: transformers' deprecation, bitsandbytes' CPU
    kernel, DeepSpeed's accelerator probe) and `export --adapter-only` (peft's vocabulary
    check); with RAPIDFORMER_DEBUG=1 the export shows the libraries' lines again."""
    run = tmp_path / "lora"
    trained = assert_ok(run_cli([*LORA_RUN, f"trainer.output_dir={run}"], cwd=tmp_path))
    assert_quiet(trained)
    assert_streams(trained, "rapidformer: run finished")

    exported = assert_ok(run_cli(["export", str(run), "--to", str(tmp_path / "adapter"),
                                  "--adapter-only"], cwd=tmp_path,
                                 module="rapidformer.cli.console"))
    assert_quiet(exported)
    assert exported.stderr == "", exported.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    debug = debug_cli(["export", str(run), "--to", str(tmp_path / "adapter_debug"),
                       "--adapter-only"], cwd=tmp_path)
    assert debug.returncode == 0, debug.stderr[-3000:]
    for source in ("transformers, asked by peft", "peft's adapter export"):
        assert NOISE[source] in debug.stderr, (source, debug.stderr[-3000:])


@pytest.mark.slow
def test_a_tensor_parallel_megatron_run_prints_no_megatron_core_warnings(tmp_path,
                                                                          pretraining_data):
    d = pretraining_data
    result = assert_ok(run_cli([
        "+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "parallelism=tp2",
        "launcher.nproc_per_node=2", f"data.path={d['gpt']}", f"model.tokenizer={d['gpt2_vocab']}",
        f"model.merge_file={d['merges']}", "data.max_seq_length=64", "data.num_workers=0",
        "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.train_iters=2",
        "trainer.eval_iters=1", "trainer.export_hf=false", "trainer.progress_bar=false",
        "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'tp2'}"], cwd=tmp_path))
    assert_quiet(result)
    assert "[rank 0][INFO]" in result.stdout  # the worker's log lines, as a single run's
    assert_streams(result, "rapidformer: run finished")


@pytest.mark.serial
def test_ctrl_c_to_a_two_process_run_reads_as_a_stop(tmp_path):
    """SIGINT to the launcher's process group (a terminal's Ctrl-C): exit 75, every line says
    stopped, none says error, torch elastic adds nothing."""
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "rapidformer", *FAST, "trainer.train_iters=100000",
         "trainer.export_hf=false", "data.num_workers=0", "launcher.nproc_per_node=2",
         f"trainer.output_dir={run}"],
        cwd=tmp_path, env={k: v for k, v in {**os.environ, **OFFLINE_ENV}.items()
                           if k != "RAPIDFORMER_DEBUG"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").is_file()
                   and '"loss"' in (run / "metrics.jsonl").read_text()):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:  # nothing of the group left behind, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert_quiet(result)
    assert "rapidformer: stopped (rank 0): stopped by SIGINT at step" in stderr, stderr[-3000:]
    assert "rapidformer: stopped: stopped by SIGINT" in stderr
    assert "rapidformer: error" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert "[rank 0][INFO]" in stdout and "[rank 0]" not in stderr


def test_a_sweep_prints_to_the_streams_a_single_run_does(tmp_path):
    sweep = tmp_path / "sweep"
    result = assert_ok(run_cli(["-m", *FAST, "trainer.train_iters=1", "trainer.export_hf=false",
                                "trainer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"],
                               cwd=tmp_path))
    assert_quiet(result)  # its plots too
    assert_streams(result, "sweep summary (2 jobs, 0 failed)")
    assert "| 1 | " in result.stderr
    assert "![loss](plots/loss.png)" in (sweep / "summary.md").read_text()
