"""The batch-shape options end to end, in-process on tiny models: trainer.unpad trains to the
padded run's losses, data.pad_to's buckets and their validation, the packed forward compiles as
one graph, the recompile warning names its cause, and trainer.profile_steps writes its table
and trace."""
from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.data.lengths import PadTo, bucket_lengths, expected_recompiles, target_length
from rapidformer.data.lengths import token_multiple
from rapidformer.errors import ConfigError
from rapidformer.observability.compile_log import CompileLog
from rapidformer.observability.step_profiler import kernel_summary, kind_of

# the quickstart's BERT made tinier: 64 generated pairs, 4 steps of 16, no dropout (the packed
# and padded runs then compute the same function), a log record per step
TINY = ["+recipe=quickstart", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "trainer.log_interval=1", "trainer.device=cpu", "data.synthetic_train_size=64",
        "data.synthetic_eval_size=16", "trainer.micro_batch_size=16",
        "trainer.global_batch_size=16", "trainer.epochs=1", "trainer.export_hf=false",
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2",
        "model.vocab_size=200", "data.max_seq_length=32", "model.hidden_dropout=0",
        "model.attention_dropout=0"]


def train(run: Path, *overrides: str) -> list[dict]:
    from rapidformer.engine import RapidformerEngine
    from rapidformer.tasks import task_class

    _, cfg = settle(compose([*TINY, f"trainer.output_dir={run}", *overrides]), str(run))
    task_class(cfg.task.name)(engine=RapidformerEngine(cfg, run)).train()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "samples_per_s" in r]


def test_unpadded_training_follows_the_padded_runs_losses(tmp_path):
    padded = train(tmp_path / "padded")
    packed = train(tmp_path / "packed", "trainer.unpad=true")
    assert len(padded) == len(packed) == 4
    for a, b in zip(padded, packed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
    for a, b in zip(padded, packed):  # the same real tokens in fewer slots
        assert b["padding_frac"] < a["padding_frac"]
        assert b["tokens_per_s"] / b["samples_per_s"] == pytest.approx(
            a["tokens_per_s"] / a["samples_per_s"])


def test_profile_steps_write_the_kernel_table_and_the_trace(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rapidformer"):
        train(tmp_path / "run", "trainer.profile_steps=[2,3]")
    table = json.loads((tmp_path / "run" / "profile" / "kernels_rank0.json").read_text())
    assert (table["first"], table["last"], table["steps"]) == (2, 3, 2)
    assert "matmul" in table["kinds"] and table["kernel_ms_per_step"] > 0
    assert 0 < table["busy_frac"] <= 1.0
    with gzip.open(tmp_path / "run" / "profile" / "trace_rank0.json.gz") as f:
        assert json.load(f)["traceEvents"]
    assert "profile of steps 2-3" in caplog.text


def test_a_profile_past_the_runs_end_writes_the_steps_recorded(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="rapidformer"):
        train(tmp_path / "run", "trainer.profile_steps=[3,10]")  # 4 steps in all
    table = json.loads((tmp_path / "run" / "profile" / "kernels_rank0.json").read_text())
    assert (table["first"], table["last"], table["steps"]) == (3, 4, 2)
    assert "the run ended at step 4" in caplog.text


def test_a_gpu_profile_counts_each_kernel_once():
    from torch.autograd import DeviceType

    def event(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, device_time_total=us,
                               self_cpu_time_total=0, is_user_annotation=annotation)

    # a compiled graph's host event carries its kernels' time again: a region, not a kernel;
    # so does the optimizer step's record_function, on the host and as its device-side twin
    prof = SimpleNamespace(key_averages=lambda: [
        event("CompiledFunctionBackward", DeviceType.CPU, 3000),
        event("Optimizer.step#AdamW.step", DeviceType.CPU, 500, annotation=True),
        event("Optimizer.step#AdamW.step", DeviceType.CUDA, 500, annotation=True),
        event("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", DeviceType.CUDA,
              500),
        event("nvjet_sm90_tst_gemm", DeviceType.CUDA, 2000),
        event("pytorch_flash::flash_bwd_kernel", DeviceType.CUDA, 1000)])
    summary = kernel_summary(prof, "cuda", steps=1, wall_s=0.004)
    assert summary["kernel_ms_per_step"] == 3.5 and summary["busy_frac"] == 0.875
    assert summary["kinds"]["matmul"]["ms_per_step"] == 2.0
    assert summary["kinds"]["attention"]["ms_per_step"] == 1.0
    assert summary["kinds"]["optimizer"]["ms_per_step"] == 0.5
    assert summary["regions"] == [
        {"name": "CompiledFunctionBackward", "device_ms_per_step": 3.0},
        {"name": "Optimizer.step#AdamW.step", "device_ms_per_step": 0.5}]


@pytest.mark.parametrize("name, kind", [
    # inductor's kernels are named by every op they fuse: a norm ending in a cast is compute
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", "fused elementwise"),
    ("triton_poi_fused__to_copy_clone_7", "fused elementwise"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_4", "fused elementwise"),
    ("triton_red_fused__log_softmax_backward_data_nll_loss_9", "loss"),
    ("void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig", "copy"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor",
     "other elementwise"),
])
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


def test_bucket_lengths_and_the_padding_collate():
    assert bucket_lengths("auto", 128, compiled=False) is None
    assert bucket_lengths("auto", 128, compiled=True) == 16
    assert bucket_lengths("max", 128, compiled=True) == [128]
    assert bucket_lengths([64, 32, 200], 128, compiled=False) == [32, 64, 128]
    assert [target_length(n, [32, 64, 128]) for n in (5, 32, 33, 128)] == [32, 32, 64, 128]
    assert target_length(17, 16) == 32 and target_length(17, None) == 17
    assert token_multiple("auto", compiled=True) == 256 and token_multiple(64, False) == 64
    assert expected_recompiles([32, 64]) == 2 and expected_recompiles("auto") == 2

    def collate(features):
        return {"input_ids": torch.ones(len(features), 20, dtype=torch.long),
                "attention_mask": torch.ones(len(features), 20, dtype=torch.long),
                "labels": torch.zeros(len(features), dtype=torch.long)}

    batch = PadTo(collate, [16, 32], pad_id=3)([{}] * 2)
    assert batch["input_ids"].shape == (2, 32) and batch["input_ids"][0, 20:].eq(3).all()
    assert batch["attention_mask"][:, 20:].eq(0).all() and batch["labels"].shape == (2,)
    left = PadTo(collate, 24, pad_id=3, left=True)([{}])
    assert left["input_ids"][0, :4].eq(3).all() and left["input_ids"][0, 4:].eq(1).all()


@pytest.mark.parametrize("overrides, message", [
    (["data.pad_to=[8,64]"], "data.pad_to=[8, 64]: bucket lengths are between"),
    (["data.pad_to=[16]", "trainer.unpad=true"], "trainer.unpad=true packs each batch"),
    (["data.pad_to=0"], "data.pad_to"),
    (["trainer.unpad=true", "task=question_answering"], "trainer.unpad=true with "
                                                         "task=question_answering: not yet"),
    (["trainer.unpad=true", "graph=ort"], "graph=ort: the exported ONNX graph"),
    (["trainer.profile_steps=[5,2]"], "1 <= first <= last"),
])
def test_bad_shape_options_are_refused_with_the_fix(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        settle(compose([*TINY, *overrides]), str(tmp_path))
    assert message in str(error.value)


def test_the_packed_forward_compiles_as_one_graph():
    transformers = pytest.importorskip("transformers")
    from rapidformer.models.attention import register
    from rapidformer.models.unpadded import masked_positions, unpad_batch, use_unpadded_forward

    register()
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
        attn_implementation="rapidformer_sdpa")).train()
    use_unpadded_forward(model, 64)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[:, 20:] = 0
    labels = torch.full((4, 32), -100)
    labels[:, 3] = 7
    batch = unpad_batch({"input_ids": torch.randint(5, 97, (4, 32)), "attention_mask": mask,
                         "token_type_ids": torch.zeros(4, 32, dtype=torch.long),
                         "labels": labels, "next_sentence_label": torch.zeros(4, dtype=torch.long)},
                        0, 64)
    batch["masked_positions"] = masked_positions(batch["labels"], 64)
    explained = torch._dynamo.explain(model)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_flash_path_compiles_as_one_graph():
    transformers = pytest.importorskip("transformers")
    from rapidformer.models.attention import register
    from rapidformer.models.unpadded import unpad_batch, use_unpadded_forward

    register()
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
        attn_implementation="rapidformer_sdpa")).cuda().train()
    use_unpadded_forward(model, 64)
    mask = torch.ones(4, 32, dtype=torch.long)
    mask[:, 20:] = 0
    batch = unpad_batch({"input_ids": torch.randint(5, 97, (4, 32)), "attention_mask": mask,
                         "labels": torch.zeros(4, dtype=torch.long)}, 0, 64)
    batch = {k: v.cuda() for k, v in batch.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(**batch)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_recompiles_beyond_the_buckets_are_named(caplog):
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    log = CompileLog.attach(compiled, enabled=True, expected=1)
    with caplog.at_level(logging.INFO, logger="rapidformer"):
        for rows in (2, 3, 5, 7):  # every new row count recompiles (no dynamic shapes)
            compiled(torch.ones(rows, 4)).sum().backward()
            log.step_done()
        log.finish()
    assert "more than the 1 the batch shapes explain" in caplog.text
    assert "size mismatch" in caplog.text
    log.detach()
