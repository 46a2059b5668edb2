"""The strategy contract, strategy by strategy, on 2 gloo ranks started in-process
(torch.multiprocessing): the same per-step losses as one plain process on the same global
batches, an exact resume from a mid-run checkpoint, and an export whose weights equal those
`rapidformer export` reads offline from the same checkpoint. megatron-core besides: its
checkpoints resume at another layout, bf16/fp16 follow fp32, and activation recompute keeps the
losses with dropout. The CLI's own multi-process tests (launcher, torchrun, failures) are in
test_distributed.py and test_parallel.py."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, free_port

pytestmark = pytest.mark.slow  # each fixture trains every case: 20 s to minutes

STEPS, SAVED_AT, VOCAB, SEQ = 4, 2, 64, 17  # Megatron reads SEQ - 1: a multiple of TP
BASE = ["model=gpt2_tiny", "trainer.device=cpu", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", f"trainer.train_iters={STEPS}", "trainer.lr=5e-3",
        "trainer.export_hf=true", "trainer.progress_bar=false", "scheduler=linear"]


def _model(cfg):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if cfg.model.arch == "megatron_gpt":
        from rapidformer.models.megatron import build_megatron_gpt

        return build_megatron_gpt(cfg, VOCAB)
    if cfg.model.arch == "llama":  # every linear layer a multiple of 16 wide: float8 takes all
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                      n_positions=SEQ, bos_token_id=0, eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def _global_batches() -> list[torch.Tensor]:
    """The same 8 sequences every step: a loss that must fall (they are learnt by heart)."""
    batch = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    return [batch] * STEPS


def _forward(iterator, model):
    ids = next(iterator)
    return model(input_ids=ids, labels=ids).loss


def _megatron_forward(iterator, model):
    """megatron-core's (output, loss_func): next-token prediction on the same sequences."""
    from rapidformer.tasks.pretraining import megatron_gpt_forward

    ids = next(iterator)
    positions = torch.arange(SEQ - 1).expand(ids.shape[0], -1)
    return megatron_gpt_forward(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:],
                                        "position_ids": positions})


def _train(engine, model, first_step: int) -> dict[int, float]:
    """Steps first_step..STEPS on this rank's micro-batches; the global-batch mean losses
    (with pipeline stages only the last has them: summed and counted over every rank)."""
    rank, size = engine.data_parallel
    forward = _megatron_forward if engine.strategy.name == "megatron" else _forward
    losses, scales = {}, {}
    for step in range(first_step, STEPS + 1):
        batch = _global_batches()[step - 1].to(engine.device)
        mine = iter(batch[rank::size].split(engine.cfg.trainer.micro_batch_size))
        micro = engine.forward_backward(forward, mine, model, engine.accumulation)
        result = engine.step()
        assert result.stepped
        scales[step] = result.loss_scale
        total = torch.tensor([float(sum(micro)), float(len(micro))], dtype=torch.float64)
        loss_sum, count = engine.all_reduce_sum(total).tolist()
        losses[step] = loss_sum / count
        if step in (SAVED_AT, STEPS):
            engine.save_checkpoint(step, {"step": step, "train_state": {}})
    return losses, scales


def _engine(overrides: list[str], run_dir: str):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.engine import RapidformerEngine

    _, cfg = settle(compose([*BASE, *overrides]), run_dir)
    return RapidformerEngine(cfg=cfg, run_dir=run_dir)


def resume_from(overrides: list[str], checkpoint: str, run_dir: str) -> dict[int, float]:
    """A fresh engine (its own layout: overrides) loads checkpoint and trains to the end."""
    resumed = _engine([*overrides, f"trainer.resume={checkpoint}"], run_dir)
    fresh = _model(resumed.cfg)
    # other weights than the checkpoint's: the load must replace them (with peft only the
    # adapters, new in compose, are in the checkpoint; its base must be the one it trained on)
    with torch.no_grad():
        for p in fresh.parameters() if resumed.cfg.peft.name == "none" else ():
            p.add_(1.0)
    model, _, _ = resumed.compose(fresh)
    state = resumed.load_checkpoint(resumed.resume_checkpoint)
    return _train(resumed, model, state["step"] + 1)[0]


def run_contract(overrides: list[str], run_dir: str) -> dict:
    """Train, resume in a fresh engine from the mid-run checkpoint, export; what rank 0 saw."""
    engine = _engine(overrides, run_dir)
    model, _, _ = engine.compose(_model(engine.cfg))
    losses, scales = _train(engine, model, 1)
    exported = engine.export_hf(step=STEPS)
    after = resume_from(overrides, f"{run_dir}/checkpoints/step_{SAVED_AT:08d}", run_dir)
    return {"losses": losses, "resumed": after, "strategy": engine.strategy.name,
            "loss_scales": scales, "parameters": engine.num_parameters,
            "exported": str(exported) if exported else None}


def _by_step(losses: dict) -> dict[int, float]:
    return {int(step): loss for step, loss in losses.items()}  # JSON keys are strings


def _worker(rank: int, world: int, port: int, cases: dict, run_dir: str, out: str):
    """One rank: every case in turn, in the same process group (the imports and the group
    paid for once); rank 0 writes what it saw."""
    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    results = {}
    for name, overrides in cases.items():
        results[name] = run_contract([f"launcher.nproc_per_node={world}", *overrides],
                                     f"{run_dir}/{name}")
        if "megatron.core" in sys.modules:  # the next layout builds its own groups
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


def on_two_ranks(cases: dict, run_dir: Path) -> dict:
    """run_contract for each case on 2 gloo ranks, processes started here; rank 0's results."""
    port = free_port()
    out = run_dir / "results.json"
    mp.start_processes(_worker, args=(2, port, cases, str(run_dir), str(out)), nprocs=2,
                       start_method="spawn")
    return {name: {**result, "losses": _by_step(result["losses"]),
                   "resumed": _by_step(result["resumed"]),
                   "loss_scales": _by_step(result["loss_scales"])}
            for name, result in json.loads(out.read_text()).items()}


OFFLOAD_ALL = ["memory.offload_optimizer=true", "memory.offload_params=true"]
# float8 emulated on the CPU (the numerics of float8 without its tensor cores), every layer
FP8 = ["model=llama_tiny", "precision=fp8", "precision.fp8_emulate=true",
       "precision.fp8_skip_small=false"]
# the one-process references: name -> overrides
# LoRA without its dropout: each layout draws other masks for its micro-batches
LORA = ["model=llama_tiny", "peft=lora", "peft.dropout=0"]
REFERENCES = {"fp32": ["precision=fp32"], "bf16": ["precision=bf16"],
              "llama": ["model=llama_tiny"], "lora": LORA}
# name: (overrides, strategy, the one-process reference)
CASES = {
    "ddp": ([], "ddp", "fp32"),
    "ddp_compile": (["graph=compile"], "ddp", "fp32"),
    "ddp_bf16": (["precision=bf16"], "ddp", "bf16"),
    "fsdp2": (["memory=fsdp"], "fsdp2", "fp32"),
    "fsdp2_compile": (["memory=fsdp", "graph=compile"], "fsdp2", "fp32"),
    "fsdp2_bf16": (["memory=fsdp", "precision=bf16"], "fsdp2", "bf16"),
    "fsdp2_offload": (["memory=fsdp", *OFFLOAD_ALL], "fsdp2", "fp32"),
    "zero1": (["memory=zero1"], "deepspeed", "fp32"),
    "zero2_offload": (["memory=zero2", "memory.offload_optimizer=true"], "deepspeed", "fp32"),
    "zero2_bf16": (["memory=zero2", "precision=bf16"], "deepspeed", "bf16"),
    "zero3": (["memory=zero3"], "deepspeed", "fp32"),
    "zero3_bf16": (["memory=zero3", "precision=bf16"], "deepspeed", "bf16"),
    "zero3_offload": (["memory=zero3", *OFFLOAD_ALL], "deepspeed", "fp32"),
    "llama_fsdp2": (["model=llama_tiny", "memory=fsdp"], "fsdp2", "llama"),
    "llama_zero3": (["model=llama_tiny", "memory=zero3"], "deepspeed", "llama"),
    "lora_ddp": (LORA, "ddp", "lora"),
    "lora_fsdp2": ([*LORA, "memory=fsdp"], "fsdp2", "lora"),
    "lora_zero2": ([*LORA, "memory=zero2"], "deepspeed", "lora"),
    "lora_zero3": ([*LORA, "memory=zero3"], "deepspeed", "lora"),
    "llama_ddp_fp8": (FP8, "ddp", "llama"),
    "llama_fsdp2_fp8_all_gather": ([*FP8, "memory=fsdp", "precision.fp8_all_gather=true"],
                                   "fsdp2", "llama"),
}
# bf16 rounds each layout's reductions differently; fp32 agrees to the last digits. The fp8
# cases are held to the fp32 reference within 5e-3: float8's rounding of the
# inputs, weights and gradients of every linear layer shows in the third decimal
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "llama": 1e-4, "lora": 1e-4}
CASE_TOLERANCE = {"llama_ddp_fp8": 5e-3, "llama_fsdp2_fp8_all_gather": 5e-3}
# Adam turns rounding noise in near-zero gradients into whole lr-sized steps, which differ
# between layouts (their reductions add in other orders); a large eps keeps such steps small
MEGATRON = ["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "data.path=unused",
            "model.tokenizer=unused", "model.merge_file=unused", f"data.max_seq_length={SEQ - 1}",
            "optim.eps=1e-3"]
MEGATRON_CASES = {"tp2": ["parallelism=tp2"], "pp2": ["parallelism=pp2"],
                  "tp2_sequence_parallel": ["parallelism=tp2", "parallelism.sequence_parallel=true"],
                  "dp2": [], "dp2_distributed_optimizer": ["memory=zero1"]}
# bf16 and fp16 weights with fp32 main weights in megatron-core's optimizer (fp16 with its
# dynamic loss scale, here with the distributed optimizer over 2 replicas): name: (overrides,
# tolerance against the fp32 process)
MEGATRON_HALF = {"pp2_bf16": (["parallelism=pp2", "precision=bf16"], 2e-2),
                 "dp2_fp16_distributed_optimizer": (["precision=fp16", "memory=zero2"], 5e-3)}
# activation recompute replays each layer in the backward pass, its dropout masks included
# (megatron-core's RNG tracker): the losses of keeping the activations, at the same layout
DROPOUT = ["parallelism=pp2", "memory=zero1", "model.hidden_dropout=0.1",
           "model.attention_dropout=0.1"]
RECOMPUTE = {"pp2_dropout": DROPOUT,
             **{f"pp2_dropout_recompute_{granularity}": [
                 *DROPOUT, "trainer.checkpoint_activations=true",
                 f"trainer.recompute_granularity={granularity}"]
                for granularity in ("full", "selective")}}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The references: the plain strategy in this process, 4 micro-batches per step."""
    return {name: run_contract(overrides, str(tmp_path_factory.mktemp(f"one_process_{name}")))
            for name, overrides in REFERENCES.items()}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return on_two_ranks({name: overrides for name, (overrides, _, _) in CASES.items()},
                        tmp_path_factory.mktemp("two_ranks"))


@pytest.fixture(scope="module")
def megatron_one_process(tmp_path_factory):
    """megatron-core's reference: one process, this one."""
    return run_contract(MEGATRON, str(tmp_path_factory.mktemp("megatron_one")))


@pytest.fixture(scope="module")
def megatron_two_ranks(tmp_path_factory):
    cases = {**MEGATRON_CASES, **{name: extra for name, (extra, _) in MEGATRON_HALF.items()},
             **RECOMPUTE}
    return on_two_ranks({name: [*MEGATRON, *extra] for name, extra in cases.items()},
                        tmp_path_factory.mktemp("megatron_two_ranks"))


@pytest.mark.parametrize("name", list(REFERENCES))
def test_one_process_resumes_exactly_and_exports_its_weights(one_process, name):
    reference = one_process[name]
    assert reference["strategy"] == "ddp"
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    assert sorted(reference["resumed"]) == list(range(SAVED_AT + 1, STEPS + 1))
    for step, loss in reference["resumed"].items():
        assert loss == reference["losses"][step], step
    _assert_export_matches_offline(Path(reference["exported"]))


@pytest.mark.parametrize("case", list(CASES))
def test_strategy_on_two_ranks_keeps_the_contract(one_process, two_ranks, case):
    got, (_, strategy, precision) = two_ranks[case], CASES[case]
    assert got["strategy"] == strategy
    reference, losses = one_process[precision], got["losses"]
    assert got["parameters"] == reference["parameters"]
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert sorted(got["resumed"]) == list(range(SAVED_AT + 1, STEPS + 1))
    tolerance = CASE_TOLERANCE.get(case, TOLERANCE[precision])
    for step, loss in reference["losses"].items():
        assert losses[step] == pytest.approx(loss, abs=tolerance), (case, step)
    assert losses[STEPS] < losses[1]  # it trains
    for step, loss in got["resumed"].items():  # resume is exact: the same steps again
        assert loss == pytest.approx(got["losses"][step], abs=1e-6), (case, step)
    _assert_export_matches_offline(Path(got["exported"]))


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_megatron_layouts_on_two_ranks_keep_the_contract(megatron_one_process,
                                                         megatron_two_ranks, case):
    """Every layout: the losses of one process, an exact resume, and shards that gather into
    the same exported GPT-2."""
    from safetensors.torch import load_file

    got, reference = megatron_two_ranks[case], megatron_one_process
    assert got["strategy"] == reference["strategy"] == "megatron"
    assert got["parameters"] == reference["parameters"]  # the whole model, from any shards
    assert reference["losses"][STEPS] < reference["losses"][1]
    for step, loss in reference["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, rel=1e-4), (case, step)
    for step, loss in got["resumed"].items():
        assert loss == pytest.approx(got["losses"][step], abs=1e-6), (case, step)
    mine = load_file(Path(got["exported"]) / "model.safetensors")
    theirs = load_file(Path(reference["exported"]) / "model.safetensors")
    assert set(mine) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("case,extra", [("tp2", []),
                                        ("dp2_distributed_optimizer", ["memory=zero1"])])
def test_megatron_checkpoints_resume_on_one_process(megatron_one_process, megatron_two_ranks,
                                                    case, extra, tmp_path):
    """megatron-core's distributed checkpoints: TP=2 resumes on one process, and the
    distributed optimizer's state of 2 replicas resumes on 1; the losses go on as those of
    the one process that was never interrupted."""
    saved = Path(megatron_two_ranks[case]["exported"]).parent / "checkpoints" / \
        f"step_{SAVED_AT:08d}"
    files = {p.name for p in (saved / "megatron").iterdir()}
    assert {"metadata.json", "common.pt", ".metadata"} <= files, files
    assert len([f for f in files if f.endswith(".distcp")]) >= 2, files  # one set per rank
    resumed = resume_from([*MEGATRON, *extra], str(saved), str(tmp_path))
    assert sorted(resumed) == list(range(SAVED_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(megatron_one_process["losses"][step], rel=1e-4), step


@pytest.mark.parametrize("case", list(MEGATRON_HALF))
def test_megatron_half_precision_follows_fp32(megatron_one_process, megatron_two_ranks, case):
    got, (_, tolerance) = megatron_two_ranks[case], MEGATRON_HALF[case]
    reference = megatron_one_process["losses"]
    assert sorted(got["losses"]) == sorted(reference)
    for step, loss in reference.items():
        assert got["losses"][step] == pytest.approx(loss, rel=tolerance), (case, step)
    for step, loss in got["resumed"].items():
        assert loss == pytest.approx(got["losses"][step], abs=1e-6), (case, step)
    scales = got["loss_scales"]
    if "fp16" in case:  # megatron-core's dynamic scale, from its initial value
        assert scales[1] == 65536.0, scales
    else:
        assert set(scales.values()) == {None}, scales


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_recompute_keeps_the_losses_with_dropout(megatron_two_ranks, granularity):
    plain = megatron_two_ranks["pp2_dropout"]
    recompute = megatron_two_ranks[f"pp2_dropout_recompute_{granularity}"]
    no_dropout = megatron_two_ranks["pp2"]["losses"]
    assert plain["losses"][1] != pytest.approx(no_dropout[1], rel=1e-4)  # dropout is on
    assert sorted(recompute["losses"]) == sorted(plain["losses"])
    for step, loss in plain["losses"].items():
        assert recompute["losses"][step] == pytest.approx(loss, rel=1e-5), step
    for run in (plain, recompute):  # the dropout masks resume too (and zero1's shards)
        assert sorted(run["resumed"]) == list(range(SAVED_AT + 1, STEPS + 1))
        for step, loss in run["resumed"].items():
            assert loss == pytest.approx(run["losses"][step], abs=1e-6), step


def _assert_export_matches_offline(exported: Path) -> None:
    """The run's own export and `rapidformer export`'s reading of the last checkpoint agree,
    tensor for tensor, and name the strategy in the manifest."""
    from safetensors.torch import load_file

    from rapidformer.checkpoint import store as checkpoint
    from rapidformer.checkpoint.state import read_state
    from rapidformer.cli.verbs.export import weights

    ckpt = exported.parent / "checkpoints" / f"step_{STEPS:08d}"
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    state = read_state(ckpt)
    assert manifest["strategy"] == state.strategy
    live = load_file(exported / "model.safetensors")
    offline = weights(ckpt, state)
    assert set(live) <= set(offline)
    for name, tensor in live.items():
        torch.testing.assert_close(tensor, offline[name], rtol=0, atol=0, msg=name)
