"""The SDPA core attention of the Megatron models (rapidformer/models/megatron_attention.py)
against megatron-core's local DotProductAttention: the same outputs and gradients for GPT's
causal attention (no mask, the plain causal mask, a mask reset at document boundaries),
grouped-query attention and BERT's padding mask; dropout in training only; what it does not
support refused; the choice by model.attn_implementation; the layers under torch.compile. On
2 gloo ranks: tensor-parallel GPT and BERT (and GPT with sequence parallelism) give the same
outputs and gradients with either attention."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import OFFLINE_ENV, free_port

VOCAB, SEQ, BATCH = 300, 32, 3


def _cfg(kind: str, overrides: list[str]):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    base = (["+recipe=gpt_pretrain", "model=megatron_gpt_tiny", "model.merge_file=m"]
            if kind == "gpt" else ["+recipe=bert_pretrain", "model=megatron_bert_tiny"])
    return settle(compose([*base, "data.path=x", "model.tokenizer=v", "data.max_seq_length=64",
                            *overrides]), "unused")[1]


@pytest.fixture(scope="module")
def one_rank():
    """megatron-core's groups for one CPU process (TP=1), as the CPU runs set them up."""
    from megatron.core import parallel_state

    from rapidformer.accelerators.parallel import initialize

    # an earlier test in this process may have left groups of a process group since destroyed
    parallel_state.destroy_model_parallel()
    initialize(_cfg("gpt", []), torch.device("cpu"))
    yield
    parallel_state.destroy_model_parallel()


def _attention_pair(heads=4, groups=None, dropout=0.0, mask_type="causal", **config):
    """(megatron-core's DotProductAttention, SDPAttention) of one layer's config."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from rapidformer.models.megatron_attention import SDPAttention

    config = TransformerConfig(num_layers=2, hidden_size=16 * heads, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=dropout,
                               use_cpu_initialization=True, **config)
    kwargs = dict(config=config, layer_number=2, attn_mask_type=AttnMaskType[mask_type],
                  attention_type="self")
    return DotProductAttention(**kwargs), SDPAttention(**kwargs)


def _qkv(heads=4, groups=None, seq=SEQ, batch=BATCH):
    """query [s, b, heads, 16], key and value [s, b, groups, 16], leaves that keep grads."""
    g = torch.Generator().manual_seed(0)
    shapes = [(seq, batch, heads, 16)] + [(seq, batch, groups or heads, 16)] * 2
    return [torch.randn(shape, generator=g).requires_grad_() for shape in shapes]


def _run(module, qkv, mask, rows=None):
    """The module's output, and the gradients of q, k, v of a loss over `rows` (a [s, b]
    bool of the query positions read; all by default)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv)
    out = module(q, k, v, mask)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)  # every output element counts
    if rows is not None:
        weights = weights * rows[..., None]
    (out * weights).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def _assert_same(local, sdpa, rows=None):
    (out_local, grads_local), (out_sdpa, grads_sdpa) = local, sdpa
    if rows is not None:  # the query rows anything reads
        out_local, out_sdpa = out_local[rows], out_sdpa[rows]
    torch.testing.assert_close(out_sdpa, out_local, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(grads_sdpa, grads_local):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def _document_mask(seq: int, batch: int) -> torch.Tensor:
    """GPT's mask with reset_attention_mask: causal, and no attention across an end of
    document (get_ltor_masks_and_position_ids)."""
    from rapidformer import get_ltor_masks_and_position_ids

    tokens = torch.randint(1, 50, (batch, seq), generator=torch.Generator().manual_seed(3))
    tokens[0, 9], tokens[1, 20], tokens[2, 4] = 0, 0, 0
    return get_ltor_masks_and_position_ids(tokens, 0, True, True, False)[0]


@pytest.mark.parametrize("mask", ["none", "plain_causal", "causal_per_sequence", "documents"])
def test_causal_attention_matches_the_local_module(one_rank, mask):
    from rapidformer.models import megatron_attention

    local, sdpa = _attention_pair()
    qkv = _qkv()
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    given = {"none": None, "plain_causal": causal,
             "causal_per_sequence": causal.expand(BATCH, 1, SEQ, SEQ).clone(),
             "documents": _document_mask(SEQ, BATCH)}[mask]
    _assert_same(_run(local, qkv, given), _run(sdpa, qkv, given))
    if given is not None:  # a plain causal mask runs SDPA's causal kernel, no mask built
        assert megatron_attention._is_plain_causal(given, SEQ, SEQ) == (mask != "documents")


def test_grouped_query_attention_and_layer_scaling_match(one_rank):
    local, sdpa = _attention_pair(heads=4, groups=2, apply_query_key_layer_scaling=True,
                                  softmax_scale=0.3)
    qkv = _qkv(heads=4, groups=2)
    _assert_same(_run(local, qkv, None), _run(sdpa, qkv, None))


def test_bert_padding_mask_matches_the_local_module_on_every_token(one_rank):
    """megatron-core gives its local attention the [b, 1, s, s] padding mask, and SDPAttention
    the [b, 1, 1, s] one (SDPABertModel): every real token's output and every gradient of a
    loss over the real tokens are the same (padded query rows are read by nothing)."""
    local, sdpa = _attention_pair(mask_type="padding")
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keep[0, 20:], keep[1, 5:] = False, False
    square = ~(keep[:, None, :, None] & keep[:, None, None, :])  # True: may not attend
    keys_only = ~keep[:, None, None, :]
    rows = keep.t()  # [s, b]
    qkv = _qkv()
    reference = _run(local, qkv, square, rows)
    _assert_same(reference, _run(sdpa, qkv, keys_only, rows), rows)
    _assert_same(reference, _run(sdpa, qkv, square, rows), rows)


def test_attention_dropout_in_training_only(one_rank):
    from megatron.core import tensor_parallel

    _, sdpa = _attention_pair(dropout=0.5)
    _, plain = _attention_pair(dropout=0.0)
    q, k, v = _qkv()
    with torch.no_grad():
        reference = plain(q, k, v, None)
        torch.testing.assert_close(sdpa.eval()(q, k, v, None), reference)
        sdpa.train()
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        first = sdpa(q, k, v, None)
        tensor_parallel.model_parallel_cuda_manual_seed(7)  # the tensor-parallel stream
        again = sdpa(q, k, v, None)
    assert not torch.allclose(first, reference)
    torch.testing.assert_close(first, again)


def test_what_sdpa_attention_does_not_support_is_refused(one_rank):
    from megatron.core.packed_seq_params import PackedSeqParams

    from rapidformer.errors import NotAvailableError

    _, sdpa = _attention_pair()
    q, k, v = _qkv()
    with pytest.raises(NotAvailableError, match="packed sequences"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(NotAvailableError, match="attention bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(NotAvailableError, match="attn_mask_type=padding_causal"):
        _attention_pair(mask_type="padding_causal")
    with pytest.raises(NotAvailableError, match="softmax_type='off-by-one'"):
        _attention_pair(softmax_type="off-by-one")


def test_attn_implementation_picks_the_core_attention(one_rank):
    from rapidformer.models.megatron import build_megatron_bert, build_megatron_gpt

    for kind, build in (("gpt", build_megatron_gpt), ("bert", build_megatron_bert)):
        for implementation, name, dims in (("sdpa", "SDPAttention", "b11s"),
                                           ("eager", "DotProductAttention", "b1ss")):
            cfg = _cfg(kind, [f"model.attn_implementation={implementation}"])
            model = build(cfg, VOCAB)
            layers = (model.decoder if kind == "gpt" else model.encoder).layers
            assert {type(layer.self_attention.core_attention).__name__
                    for layer in layers} == {name}
            if kind == "bert":
                assert model.attn_mask_dimensions == dims
    assert _cfg("gpt", []).model.attn_implementation == "sdpa"  # the default


def test_megatron_layers_compile(one_rank):
    """torch.compile over each megatron-core TransformerLayer (what graph=compile does on a
    GPU): one graph for the identical layers, none broken (with dropout too), and the same
    logits and gradients as eager. Run with megatron_cpu's modes off for the steps
    (torch.compile does not trace under its dispatch mode) and the aot_eager backend (the graph
    capture and autograd of a GPU compile, without generating CPU kernels)."""
    import torch._dynamo

    from rapidformer.accelerators import megatron_cpu
    from rapidformer.models.megatron import build_megatron_gpt, prepare_for_compile

    cfg = _cfg("gpt", [])
    dropout = _cfg("gpt", ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"])
    models = [build_megatron_gpt(c, VOCAB) for c in (cfg, cfg, dropout)]
    prepare_for_compile()
    for model in models[1:]:
        for layer in model.decoder.layers:
            layer.compile(backend="aot_eager")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(2, SEQ)
    results, graphs = [], []
    megatron_cpu.disable()
    try:
        for model in models:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            loss = model(tokens, positions, None, labels=tokens).float().mean()
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
            graphs.append((torch._dynamo.utils.counters["stats"]["unique_graphs"],
                           dict(torch._dynamo.utils.counters["graph_break"])))
    finally:
        megatron_cpu.enable()
    assert graphs == [(0, {}), (1, {}), (1, {})], graphs
    (loss_eager, grads_eager), (loss_compiled, grads_compiled), (loss_dropout, _) = results
    torch.testing.assert_close(loss_compiled, loss_eager, atol=1e-6, rtol=1e-6)
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert loss_dropout != loss_eager  # the dropout ran inside the graph


# --- tensor parallelism: 2 gloo ranks ----------------------------------------------------------
TP_CASES = {"gpt_tp2": ("gpt", ["parallelism=tp2"]),
            "gpt_tp2_sequence_parallel": ("gpt", ["parallelism=tp2",
                                                  "parallelism.sequence_parallel=true"]),
            "bert_tp2": ("bert", ["parallelism=tp2"])}


def _step(kind: str, model):
    """One forward and backward on fixed tokens (BERT's padded): the logits of the real
    tokens and this rank's parameter gradients."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if kind == "gpt":
        logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
        keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    else:
        keep = torch.ones(BATCH, SEQ, dtype=torch.long)
        keep[0, 20:], keep[1, 5:] = 0, 0
        logits, binary = model(tokens, keep, tokentype_ids=torch.zeros_like(tokens))
        keep = keep.bool()
    weights = torch.randn(logits.shape, generator=g) * keep[..., None]
    loss = (logits.float() * weights).sum()
    if kind == "bert":
        loss = loss + binary.float().sum()
    loss.backward()
    return logits.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()}


def _tp_worker(rank: int, port: int, out: str):
    import torch.distributed as dist

    from rapidformer.accelerators.parallel import initialize
    from rapidformer.models.megatron import build_megatron_bert, build_megatron_gpt

    os.environ.update(OFFLINE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for case, (kind, overrides) in TP_CASES.items():
        from megatron.core import parallel_state

        runs = {}
        for implementation in ("eager", "sdpa"):
            cfg = _cfg(kind, [*overrides, "launcher.nproc_per_node=2",
                              f"model.attn_implementation={implementation}"])
            initialize(cfg, torch.device("cpu"))
            build = build_megatron_gpt if kind == "gpt" else build_megatron_bert
            model = build(cfg, VOCAB)
            with torch.no_grad():  # biases and norms away from 0 and 1, the same per build
                g = torch.Generator().manual_seed(11)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            runs[implementation] = _step(kind, model)
        (logits_eager, grads_eager), (logits_sdpa, grads_sdpa) = runs["eager"], runs["sdpa"]
        results[case] = {
            "logits": float((logits_eager - logits_sdpa).abs().max()),
            "logits_scale": float(logits_eager.abs().max()),
            "grads": max(float((grads_eager[n] - grads_sdpa[n]).abs().max()
                               / grads_eager[n].abs().max().clamp(min=1e-12))
                         for n in grads_eager),
            "heads_per_rank": model.config.num_attention_heads // 2}
        parallel_state.destroy_model_parallel()
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow  # 10-19 s measured: 2 spawned processes import megatron-core
def test_tensor_parallel_models_give_the_same_outputs_and_gradients(tmp_path):
    """TP=2 (2 heads of 4 on each rank): GPT, GPT with sequence parallelism and padded BERT,
    built with megatron-core's local attention and with SDPAttention, give the same logits
    for every real token and the same gradients on each rank's shard."""
    port = free_port()
    out = tmp_path / "results.json"
    mp.start_processes(_tp_worker, args=(port, str(out)), nprocs=2, start_method="spawn")
    for rank in (0, 1):
        results = json.loads(Path(f"{out}.{rank}").read_text())
        assert sorted(results) == sorted(TP_CASES)
        for case, r in results.items():
            assert r["logits"] <= 1e-5 * max(1.0, r["logits_scale"]), (rank, case, r)
            assert r["grads"] <= 1e-5, (rank, case, r)
