"""megatron-core tensor and pipeline parallelism through the CLI on 2 gloo processes: the CLI's
resume keeps the losses and refuses another layout's optimizer state, BERT's layouts give the
losses of one process, the seed's white-box Megatron script runs, the export gives GPT-2's
logits, and what is not built for Megatron models is refused before work. The layouts'
contract itself (losses, resume, export, half precision, recompute) is in-process:
tests/test_strategies.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.errors import ConfigError
from tests.conftest import assert_ok, run_cli, train_losses

REPO = Path(__file__).resolve().parents[1]


def megatron_args(data: dict) -> list[str]:
    return ["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", f"data.path={data['gpt']}",
            f"model.tokenizer={data['gpt2_vocab']}", f"model.merge_file={data['merges']}",
            "data.max_seq_length=64", "data.num_workers=0", "trainer.micro_batch_size=4",
            "trainer.global_batch_size=16", "trainer.lr=3e-3", "trainer.train_iters=6",
            "trainer.log_interval=1", "trainer.eval_iters=1", "trainer.export_hf=false",
            "trainer.progress_bar=false", "trainer.tensorboard=false"]


def assert_same_losses(a: dict, b: dict, rel: float = 1e-4) -> None:
    assert sorted(a) == sorted(b) and a
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel), (step, a, b)


# every layout (TP, PP, sequence parallel, DP, the distributed optimizer) against one
# process, its resume and its export, loading at another layout, bf16/fp16 and recompute:
# tests/test_strategies.py, on 2 ranks started in-process


@pytest.mark.slow  # 27-44 s measured (its own process imports megatron-core)
def test_megatron_gpt_exports_to_gpt2_with_the_same_logits(tmp_path):
    """The conversion itself: megatron-core's logits and GPT-2's on the same tokens (run in its
    own process: the CPU compatibility layer is process-wide)."""
    script = tmp_path / "check.py"
    script.write_text(EXPORT_CHECK)
    result = assert_ok(subprocess.run([sys.executable, str(script)], capture_output=True,
                                      text=True, timeout=300))
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-4


EXPORT_CHECK = """
import torch, torch.distributed as dist
from rapidformer.accelerators import megatron_cpu
from rapidformer.accelerators.parallel import initialize
from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.models.megatron import build_megatron_gpt
from rapidformer.models.megatron_export import gather_full_state, to_hf_gpt2

_, cfg = settle(compose(["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "data.path=x",
                          "model.tokenizer=v", "model.merge_file=m", "data.max_seq_length=64"]), "o")
initialize(cfg, torch.device("cpu"))
model = build_megatron_gpt(cfg, 300).eval()
with torch.no_grad():
    for p in model.parameters():  # biases and norms away from 0 and 1
        p.add_(torch.randn_like(p) * 0.05)
gpt2 = to_hf_gpt2(gather_full_state(model, 4), cfg, 384, 0).eval()
tokens = torch.randint(0, 300, (2, 16))
with torch.no_grad():
    ours = model(tokens, torch.arange(16).expand(2, 16), None)
    theirs = gpt2(input_ids=tokens).logits
print(float((ours - theirs).abs().max()))
"""


LAYOUT = {"tensor_parallel": 1, "pipeline_parallel": 2, "precision": "fp32"}


@pytest.mark.parametrize("current,distributed_optimizer,problem", [
    ({}, True, None),
    ({}, False, None),
    ({"tensor_parallel": 2, "pipeline_parallel": 1}, False, None),  # memory=none: any layout
    ({"tensor_parallel": 2, "pipeline_parallel": 1}, True,
     "was written at tensor 1 x pipeline 2 and loads only at that layout"),
    ({"pipeline_parallel": 1}, True, "was written at tensor 1 x pipeline 2"),
    ({"precision": "bf16"}, False, "it was written with precision=fp32"),
    ({"precision": "bf16"}, True, "resume with precision=fp32"),
])
def test_which_megatron_checkpoints_load_at_another_layout(current, distributed_optimizer,
                                                           problem):
    """The resume check every rank runs before loading (the strategy's resume_problem): a run
    that cannot load the checkpoint stops with this sentence before anything is written (the
    data-parallel size is free: tests/test_strategies.py resumes 2 replicas' state on 1)."""
    from rapidformer.accelerators.megatron_checkpoint import reshard_problem

    got = reshard_problem(LAYOUT, {**LAYOUT, **current}, distributed_optimizer)
    assert got is None if problem is None else problem in got, got


@pytest.mark.slow
def test_seed_white_box_megatron_gpt_script(tmp_path, pretraining_data):
    run = tmp_path / "run"
    script = REPO / "examples" / "rapidformer_pretrain_megatron_gpt_trainer.py"
    d = pretraining_data
    assert_ok(run_cli([
        "--user-script", str(script), "--tensor-model-parallel-size", "2", "--num-layers", "4",
        "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--seq-length", "64", "--tokenizer-type", "GPT2BPETokenizer",
        "--max-position-embeddings", "64", "--train-iters", "4", "--data-path", d["gpt"],
        "--vocab-file", str(d["gpt2_vocab"]), "--merge-file", str(d["merges"]),
        "--data-impl", "mmap", "--split", "980,20", "--lr", "1e-3", "--lr-decay-style", "linear",
        "--lr-warmup-fraction", ".01", "--log-interval", "1", "--eod-mask-loss", "--save", str(run),
        "model=megatron_gpt", "trainer.export_hf=false", "launcher.nproc_per_node=2",
        "trainer.eval_iters=1", "data.num_workers=0", "trainer.progress_bar=false"],
        cwd=tmp_path, module="rapidformer.cli.console"))
    assert sorted(train_losses(run)) == [1, 2, 3, 4]


@pytest.mark.parametrize("overrides,message", [
    (["parallelism=tp2", "model.num_attention_heads=3", "model.hidden_size=63"],
     "model.num_attention_heads=3 does not divide by parallelism.tensor_model_parallel_size=2"),
    (["parallelism=pp2", "model.num_layers=3"],
     "model.num_layers=3 does not divide by parallelism.pipeline_model_parallel_size=2"),
    (["memory=zero3"], "memory=zero3 with a Megatron model is not supported"),
    (["memory=fsdp"], "memory=fsdp with a Megatron model is not supported"),
    (["memory=zero1", "memory.offload_optimizer=true"], "offload_optimizer/offload_params with a "
                                                        "Megatron model is not built yet"),
    (["model=gpt2_tiny", "parallelism=tp2"], "needs a Megatron model"),
    (["parallelism.sequence_parallel=true"], "it needs a Megatron model with "
                                             "parallelism.tensor_model_parallel_size >= 2"),
    (["model=gpt2_tiny", "trainer.checkpoint_activations=true",
      "trainer.recompute_granularity=selective"], "trainer.recompute_granularity=selective is "
                                                  "megatron-core's"),
])
def test_megatron_settings_refused_before_work(overrides, message):
    base = ["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "data.path=corpus_text_document",
            "model.tokenizer=vocab.json", "model.merge_file=merges.txt", "trainer.export_hf=false",
            "launcher.nproc_per_node=2"]
    with pytest.raises(ConfigError) as info:
        settle(compose([*base, *overrides]), "out")
    assert message in str(info.value)


def test_ltor_masks_match_megatron_core():
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from rapidformer import get_ltor_masks_and_position_ids

    data = torch.tensor([[5, 0, 7, 8, 0, 9], [1, 2, 3, 0, 4, 5]])
    for reset_pos, reset_att, eod_mask in [(False, False, True), (True, True, True),
                                           (True, False, False)]:
        attention, loss_mask, positions = get_ltor_masks_and_position_ids(
            data, 0, reset_pos, reset_att, eod_mask)
        for b in range(2):
            theirs = _get_ltor_masks_and_position_ids(data[b], 0, reset_pos, reset_att,
                                                      eod_mask, True)
            assert torch.equal(loss_mask[b], theirs[1].float())
            assert torch.equal(positions[b], theirs[2])
            assert torch.equal(attention[b if reset_att else 0, 0], theirs[0][0])


def test_padded_vocabulary_does_not_depend_on_the_layout():
    from rapidformer.models.megatron import padded_vocab_size

    assert padded_vocab_size(50257, 1) == padded_vocab_size(50257, 8) == 50304
    assert padded_vocab_size(328, 2) == 384 and padded_vocab_size(384, 4) == 384


# loading at another layout (TP=2 on one process, the distributed optimizer of 2 replicas on 1)
# and bf16/fp16 with fp32 main weights: tests/test_strategies.py, in-process


@pytest.mark.slow
def test_megatron_bert_layouts_give_the_losses_of_one_process(tmp_path, pretraining_data):
    """model=megatron_bert (masked LM + next sentence) with the seed's BERT recipe: TP=2 and
    PP=2 follow one process."""
    d = pretraining_data
    args = ["+recipe=bert_pretrain", "model=megatron_bert_tiny", f"data.path={d['bert']}",
            f"model.tokenizer={d['vocab']}", "data.max_seq_length=64", "data.num_workers=0",
            "trainer.micro_batch_size=8", "trainer.global_batch_size=16", "trainer.lr=2e-3",
            "trainer.train_iters=6", "trainer.log_interval=1", "trainer.eval_iters=1",
            "trainer.progress_bar=false", "trainer.tensorboard=false"]
    runs = {}
    for name, extra in {"one": [], "tp2": ["parallelism=tp2", "launcher.nproc_per_node=2"],
                        "pp2": ["parallelism=pp2", "launcher.nproc_per_node=2"]}.items():
        result = assert_ok(run_cli([*args, *extra, f"trainer.output_dir={tmp_path / name}"],
                                   cwd=tmp_path))
        runs[name] = train_losses(tmp_path / name)
    assert "megatron-core BERT: 4 layers" in result.stderr + result.stdout
    assert "converting model.arch=megatron_bert to a Hugging Face model is not built" in \
        result.stderr + result.stdout
    assert runs["one"][6] < runs["one"][1] - 0.3  # masked LM + NSP learn
    for name in ("tp2", "pp2"):
        assert_same_losses(runs["one"], runs[name])
