"""peft.fused=true: the fused LoRA function computes what peft's modules compute (outputs and every
gradient, with the same dropout mask), saves less for the backward, reproduces its mask under
activation checkpointing, falls back to peft's path where it does not apply, and trains a run
through the CLI's engine to the losses of peft.fused=false."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

peft = pytest.importorskip("peft")

from rapidformer.transforms import lora_fused  # noqa: E402
from rapidformer.transforms.lora_fused import (FusedLinear, LoRALinearFunction,  # noqa: E402
                                                fused_layers, register)


class Block(nn.Module):
    """q/k/v reading one input, like a decoder layer's attention projections."""

    def __init__(self, d=32, out=24, bias=False):
        super().__init__()
        self.q_proj = nn.Linear(d, out, bias=bias)
        self.k_proj = nn.Linear(d, out, bias=bias)
        self.v_proj = nn.Linear(d, out, bias=bias)

    def forward(self, x):
        return self.q_proj(x) * 0.5 + self.k_proj(x).sin() + self.v_proj(x) ** 2


def adapted(fused: bool, dropout: float, base_dtype=torch.float32, bias=False, seed=0):
    torch.manual_seed(seed)
    block = Block(bias=bias).to(base_dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                             target_modules=["q_proj", "k_proj", "v_proj"])
    if fused:
        register(config)
    model = peft.get_peft_model(block, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a nonzero B makes every gradient count
            nn.init.normal_(param, std=0.5)
    return model


class RecordMasks:
    """Replaces drop_mask to remember what it drew (the forward's draws, then the backward's)."""

    def __init__(self, monkeypatch):
        self.drawn = []
        original = lora_fused.drop_mask

        def recording(shape, device, p, seed):
            mask = original(shape, device, p, seed)
            self.drawn.append(mask.clone())
            return mask

        monkeypatch.setattr(lora_fused, "drop_mask", recording)


def reference(model, x, masks, p):
    """peft's arithmetic by hand with the given masks (one per adapter, q, k, v in order)."""
    out = {}
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        layer = getattr(model.base_model.model, name)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled() else x.dtype
        xc = x.to(dtype)
        # peft drops in its adapters' dtype (fp32) and autocast rounds the result to bf16
        dropped = (x.float() * (~masks[i]).float() / (1 - p)).to(dtype) if p else xc
        base = nn.functional.linear(xc, layer.base_layer.weight.to(dtype),
                                    None if layer.base_layer.bias is None
                                    else layer.base_layer.bias.to(dtype))
        out[name] = base + (dropped @ a.to(dtype).t() @ b.to(dtype).t()) * layer.scaling["default"]
    return out["q_proj"] * 0.5 + out["k_proj"].sin() + out["v_proj"] ** 2


def grads(model, x):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(model(x).float().sum(), [x, *params] if x.requires_grad else params)


CASES = [  # dropout, base dtype, autocast bf16, base bias, input needs a gradient
    (0.0, torch.float32, False, False, True),
    (0.0, torch.float32, False, True, False),
    (0.1, torch.float32, False, False, True),
    (0.3, torch.float32, False, True, True),
    (0.0, torch.bfloat16, True, False, True),
    (0.1, torch.bfloat16, True, True, True),
    (0.1, torch.float32, True, False, True),  # an fp32 base under bf16 autocast
]


@pytest.mark.parametrize("p,base_dtype,autocast,bias,x_grad", CASES)
def test_outputs_and_gradients_match_peft_arithmetic(monkeypatch, p, base_dtype, autocast, bias,
                                                      x_grad):
    record = RecordMasks(monkeypatch)
    model = adapted(True, p, base_dtype, bias)
    x = torch.randn(2, 5, 32, dtype=base_dtype, requires_grad=x_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused = grads(model, x)
        forward_masks = record.drawn[:3]
        if p:  # the backward drew each mask again: the same elements
            assert len(record.drawn) == 6
            again = [m.reshape(-1) for m in record.drawn[3:]]
            for early in forward_masks:
                assert sum(torch.equal(early.reshape(-1), m) for m in again) >= 1
            assert 0 < float(forward_masks[0].float().mean()) < 1
        params = [q for q in model.parameters() if q.requires_grad]
        wanted = torch.autograd.grad(reference(model, x, forward_masks, p).float().sum(),
                                     [x, *params] if x_grad else params)
    assert len(fused) == len(wanted)
    for got, want in zip(fused, wanted):
        assert got.dtype == want.dtype and got.shape == want.shape
        if autocast or base_dtype != torch.float32:  # bf16 rounding, in other places
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True])
def test_without_dropout_equals_peft_modules(autocast):
    """p=0: no random draw at all, so peft.fused=false and true give the same numbers."""
    plain, fused = adapted(False, 0.0), adapted(True, 0.0)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(3, 7, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got_all, want_all = grads(fused, x), grads(plain, x)
    if not autocast:
        for got, want in zip(got_all, want_all):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16 rounds in another order (one addmm_ against peft's separate sums): each
        # gradient is as close to the float64 truth as bf16's resolution (2**-8) or peft's is
        truth = adapted(False, 0.0)
        truth.load_state_dict(plain.state_dict())
        exact = grads(truth.double(), x.detach().double().requires_grad_())
        for got, want, true in zip(got_all, want_all, exact):
            error = lambda g: float((g.double() - true).norm() / true.norm())
            assert error(got) <= max(1.5 * error(want), 2**-8), (error(got), error(want))
    assert fused_layers(fused) == 3 and fused_layers(plain) == 0


def saved_bytes(model, x) -> int:
    """Bytes of the distinct storages the autograd graph keeps for the backward, parameters
    (which live anyway) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    # a layer's input is never a leaf in a model (autocast caches its casts of leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.clone()).sum()
    return sum(storages.values())


@pytest.mark.parametrize("p,base_dtype,autocast", [(0.05, torch.float32, False),
                                                    (0.05, torch.bfloat16, True),
                                                    (0.0, torch.bfloat16, True),
                                                    (0.0, torch.float32, True)])
def test_saves_the_shared_input_once(p, base_dtype, autocast):
    """peft's adapters each keep a copy of the input (dropped, or cast by autocast) and, with
    dropout, a mask; the fused layers keep the input once, shared by q, k and v."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, 32, dtype=base_dtype, requires_grad=True)
    input_bytes = x.numel() * x.element_size()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        peft_bytes = saved_bytes(adapted(False, p, base_dtype), x)
        fused_bytes = saved_bytes(adapted(True, p, base_dtype), x)
    copies = 2 if base_dtype == torch.bfloat16 or p else 1  # at least, beyond the shared one
    assert peft_bytes - fused_bytes >= copies * input_bytes * (0.5 if autocast and
                                                               base_dtype == torch.float32 else 1)


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made under it that were alive at once (storages counted once,
    views of the ops' inputs not at all; a storage counts until nothing refers to it)."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # a view of a tensor made before is not new
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr()
                    and t.untyped_storage().data_ptr() not in inputs):
                storage = t.untyped_storage()
                self.alive.setdefault(storage.data_ptr(), (StorageWeakRef(storage),
                                                          storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def _down_projection(device="cpu", x_dtype=torch.bfloat16, tokens=256, n_in=1024, n_out=128):
    torch.manual_seed(0)
    base = nn.Linear(n_in, n_out, bias=False).to(device, torch.bfloat16).requires_grad_(False)
    a = (torch.randn(8, n_in, device=device) * 0.02).requires_grad_()
    b = (torch.randn(n_out, 8, device=device) * 0.02).requires_grad_()
    x = torch.randn(tokens, n_in, dtype=x_dtype, device=device, requires_grad=True)
    return base, a, b, x


@pytest.mark.parametrize("p, x_dtype, forward_bytes, backward_bytes", [
    (0.0, torch.bfloat16, 2, 2),   # the output; the input gradient
    (0.1, torch.bfloat16, 3, 3),   # + the one-byte mask beside the dropped copy or the gradient
    (0.1, torch.float32, 5, 6),    # an fp32 input under bf16: its bf16 copy; the fp32 gradient
])
def test_the_passes_hold_few_input_sized_temporaries(p, x_dtype, forward_bytes, backward_bytes):
    """A down projection's shape (inputs 8x the outputs): the tensors the passes make, at
    their peak, in bytes an input element (the code before: forward 4, backward 10 with
    dropout; 6 without). Counted as tensors the ops return: what an op allocates inside itself
    is not seen here (the GPU test below reads the allocator)."""
    base, a, b, x = _down_projection(x_dtype=x_dtype)
    with LiveBytes() as forward:
        y = LoRALinearFunction.apply(x, a, b, base, 2.0, p, 1234, torch.bfloat16)
    dy = torch.randn_like(y)
    with LiveBytes() as backward:
        grads = torch.autograd.grad(y, [x, a, b], dy)
    element = x.numel()
    assert forward.peak <= forward_bytes * element + 64 * 1024, forward.peak / element
    assert backward.peak <= backward_bytes * element + 64 * 1024, backward.peak / element
    assert backward.peak >= x.element_size() * element  # the input gradient: the tracker sees
    assert grads[0].shape == x.shape and grads[0].dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_backward_peak_is_three_bytes_an_input_element():
    """What the allocator holds at the backward's peak beyond what was there before it, with
    dropout, at 8,192 tokens x 14,336 inputs (the 8B model's down projection)."""
    base, a, b, x = _down_projection("cuda", tokens=8192, n_in=14336, n_out=4096)
    dy = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    def forward():
        return LoRALinearFunction.apply(x, a, b, base, 2.0, 0.05, 1234, torch.bfloat16)

    torch.autograd.grad(forward(), [x, a, b], dy)  # makes its thread's cuBLAS workspace
    y = forward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(y, [x, a, b], dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 3 * x.numel() + 64 * 2**20, peak / x.numel()
    assert grads[0].shape == x.shape


def test_saves_no_more_than_peft_without_dropout_or_casts():
    x = torch.randn(4, 64, 32, requires_grad=True)
    assert saved_bytes(adapted(True, 0.0), x) <= saved_bytes(adapted(False, 0.0), x)


def test_checkpoint_recompute_draws_the_same_masks():
    model = adapted(True, 0.2)
    x = torch.randn(2, 6, 32, requires_grad=True)
    torch.manual_seed(5)
    direct = grads(model, x)
    torch.manual_seed(5)
    params = [p for p in model.parameters() if p.requires_grad]
    out = checkpoint(model, x, use_reentrant=False)
    recomputed = torch.autograd.grad(out.float().sum(), [x, *params])
    for got, want in zip(recomputed, direct):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_peft_path_where_the_function_does_not_apply():
    """Evaluation, no_grad, merged and disabled adapters, extra arguments: peft's own forward."""
    plain, fused = adapted(False, 0.1), adapted(True, 0.1)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 4, 32)
    for model in (plain, fused):
        model.eval()
    torch.testing.assert_close(fused(x), plain(x))
    with torch.no_grad():  # in training, the function (reentrant checkpointing's forward)
        fused.train()
        assert fused.base_model.model.q_proj._fused_forward(x) is not None
    with fused.disable_adapter():
        fused.train()
        assert fused.base_model.model.q_proj._fused_forward(x) is None
    fused.merge_adapter()
    assert fused.base_model.model.q_proj._fused_forward(x) is None
    fused.unmerge_adapter()
    assert fused.base_model.model.q_proj._fused_forward(x) is not None


def test_copies_and_pickles_as_its_own_class():
    model = adapted(True, 0.1)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert fused_layers(other) == 3
        assert type(other.base_model.model.q_proj) is FusedLinear
        assert set(other.state_dict()) == set(model.state_dict())
        x = torch.randn(2, 3, 32, requires_grad=True)
        grads(other, x)  # runs its own layers (no reference to the original's)


def test_state_dict_keys_are_peft_s():
    assert set(adapted(True, 0.1).state_dict()) == set(adapted(False, 0.1).state_dict())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_on_a_gpu_masks_and_gradients_match(monkeypatch, p):
    """CUDA: the masks come from a CUDA generator and are drawn again in the backward; the
    gradients are peft's arithmetic with those masks, under bf16 autocast on a bf16 base."""
    record = RecordMasks(monkeypatch)
    model = adapted(True, p, torch.bfloat16).cuda()
    x = torch.randn(4, 256, 32, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = grads(model, x)
        masks = record.drawn[:3]
        if p:
            again = [m.reshape(-1) for m in record.drawn[3:]]
            assert all(any(torch.equal(m.reshape(-1), a) for a in again) for m in masks)
        params = [q for q in model.parameters() if q.requires_grad]
        wanted = torch.autograd.grad(reference(model, x, masks, p).float().sum(), [x, *params])
    for got, want in zip(fused, wanted):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_four_bit_base_matches_bitsandbytes_backward():
    test_four_bit_base_matches_bitsandbytes_backward("cuda")


def test_four_bit_base_matches_bitsandbytes_backward(device="cpu"):
    """A bitsandbytes NF4 base (on the CPU, its reference kernels): the fused function's input
    gradient dequantizes the weight as bitsandbytes' own backward does."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit, Params4bit

    def four_bit_block(fused):
        torch.manual_seed(0)
        block = Block()
        for name in ("q_proj", "k_proj", "v_proj"):
            dense = getattr(block, name)
            layer = Linear4bit(32, 24, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            layer.weight = Params4bit(dense.weight.data.to(torch.bfloat16), requires_grad=False,
                                      quant_type="nf4")
            setattr(block, name, layer)
        block = block.to(device)  # the 4-bit layers quantize as they move
        block.is_loaded_in_4bit = True
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj"])
        if fused:
            register(config)
        model = peft.get_peft_model(block, config)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.5)
        return model

    plain, fused = four_bit_block(False), four_bit_block(True)
    assert fused_layers(fused) == 3
    assert bnb is not None and getattr(fused.base_model.model.q_proj.base_layer.weight,
                                       "quant_state", None) is not None
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        for got, want in zip(grads(fused, x), grads(plain, x)):
            # bf16 sums in another order than bitsandbytes' and peft's: close as a whole
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


def test_a_four_bit_base_s_forward_hooks_keep_its_output():
    """bitsandbytes' layer runs its forward hooks inside the fused forward: what a hook was given
    stays the base's output (the adapter is added out of place there)."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit, Params4bit

    torch.manual_seed(0)
    layer = Linear4bit(32, 24, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = Params4bit(torch.randn(24, 32).to(torch.bfloat16), requires_grad=False,
                              quant_type="nf4")
    layer = layer.to("cpu")
    seen = []
    layer.register_forward_hook(lambda module, inputs, output: seen.append(output))
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    a, b = torch.randn(4, 32, requires_grad=True), torch.randn(24, 4, requires_grad=True)
    y = LoRALinearFunction.apply(x, a, b, layer, 2.0, 0.0, 0, torch.bfloat16)
    base_only = layer(x.detach())
    assert torch.equal(seen[0], base_only)
    assert not torch.equal(y, base_only)


@pytest.mark.parametrize("overrides, message", [
    (["memory=zero3"], "peft.fused=true with memory=zero3: the fused function reads each base "
                       "layer's weight outside the layer's forward"),
    (["memory=fsdp"], "peft.fused=true with memory=fsdp"),
    (["model=gpt2_tiny"], "peft.fused=true with model=gpt2_tiny: GPT-2's Conv1D layers"),
    (["peft=none"], "peft.fused=true has no effect with peft=none"),
    (["graph=compile"], "peft.fused=true with graph=compile: a compiled graph traces peft's"),
])
def test_combinations_the_fused_function_does_not_take_are_refused(overrides, message):
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError
    from rapidformer.preflight import settle

    with pytest.raises(ConfigError, match=message):
        settle(compose(["peft=lora", "trainer.device=cpu", "peft.fused=true", *overrides]), "out")


def test_a_model_with_no_layer_it_covers_is_refused_at_attach():
    from rapidformer.config.compose import compose
    from rapidformer.errors import ConfigError
    from rapidformer.preflight import settle
    from rapidformer.transforms.lora import attach
    from tests.test_peft import _tiny_gpt2

    _, cfg = settle(compose(["peft=lora", "trainer.device=cpu", "peft.fused=true"]), "out")
    with pytest.raises(ConfigError, match="none of the adapted layers .* is a torch.nn.Linear"):
        attach(_tiny_gpt2(), cfg)


def count_calls(monkeypatch) -> list:
    """Counts the fused function's forwards in training."""
    calls = []
    original = LoRALinearFunction.forward

    def counted(ctx, *args):
        calls.append(args[5])  # p
        return original(ctx, *args)

    monkeypatch.setattr(LoRALinearFunction, "forward", staticmethod(counted))
    return calls


def test_a_fused_lora_run_learns_its_answers_and_exports(tmp_path, monkeypatch):
    """The recipe's dropout 0.05 through the fused function: the answers become right and the
    export is the merged model (the checkpoint holds peft's keys)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_decoders import pretrain
    from tests.test_peft import lora_args
    from tests.test_sft import answer

    run = tmp_path / "run"
    calls = count_calls(monkeypatch)
    records = pretrain(run, [*lora_args(tmp_path / "data"), "peft.fused=true"])
    # every adapted layer of every training step (llama_tiny: 2 layers x 7 projections)
    assert len(calls) == 80 * 14 and set(calls) == {0.05}
    matches = [r["validation/answer_match"] for r in records if "validation/answer_match" in r]
    assert matches[-1] >= 0.9 > matches[0], matches
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    merged = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert answer(merged, tokenizer, "where does anna live ?") == "paris"
    stored = torch.load(run / "checkpoints" / "step_00000080" / "model.pt", weights_only=True)
    assert stored and all("lora_" in k or "modules_to_save" in k for k in stored)


def test_without_dropout_a_run_trains_as_peft_s_modules_do(tmp_path, monkeypatch):
    from tests.test_decoders import pretrain
    from tests.test_peft import lora_args

    losses = {}
    calls = count_calls(monkeypatch)
    for fused in (False, True):
        records = pretrain(tmp_path / f"run{fused}", [
            *lora_args(tmp_path / "data"), "peft.dropout=0", f"peft.fused={fused}",
            "trainer.train_iters=20", "trainer.eval_interval=20", "task.sample_generations=0"])
        losses[fused] = [r["loss"] for r in records if "loss" in r]
    assert len(losses[True]) >= 2 and len(calls) == 20 * 14
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-4)


# --- cases an adversarial review found (fixed) ---

def test_a_permuted_input_draws_the_same_mask_in_the_backward(monkeypatch):
    """The mask is drawn into a contiguous tensor in the forward as in the backward (bernoulli_
    fills memory order: a permuted input's strides gave another mask, gradients 50 % off)."""
    record = RecordMasks(monkeypatch)
    model = adapted(True, 0.3)
    leaf = torch.randn(5, 2, 32, requires_grad=True)
    x = leaf.transpose(0, 1)  # [2, 5, 32], not contiguous (e.g. a permute before a Linear)
    fused = grads(model, x)
    masks = record.drawn[:3]
    params = [q for q in model.parameters() if q.requires_grad]
    wanted = torch.autograd.grad(reference(model, x, masks, 0.3).float().sum(), [x, *params])
    for got, want in zip(fused, wanted):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reentrant_checkpoint_gradients_are_the_losses():
    """use_reentrant=True runs the forward under no_grad and the recompute with gradients: both
    take the fused function, with the same seed (peft's mask in one and the fused one in the
    other gave gradients of another loss)."""
    model = adapted(True, 0.2)
    x = torch.randn(2, 6, 32, requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(5)
    loss = model(x).float().sum()
    direct = torch.autograd.grad(loss, [x, *params])
    torch.manual_seed(5)
    loss_ck = checkpoint(model, x, use_reentrant=True).float().sum()
    loss_ck.backward()
    torch.testing.assert_close(loss_ck, loss)
    for got, want in zip([x.grad, *[p.grad for p in params]], direct):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_linear_beside_conv1d_targets_merges():
    """A torch.nn.Linear adapted beside GPT-2 Conv1D targets (model=hf GPT-2 with
    peft.target_modules=[c_attn,lm_head]) gets fan_in_fan_out=False, as peft's own dispatch
    gives it, and trains fused; its merge equals its unmerged outputs."""
    from transformers.pytorch_utils import Conv1D

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.head = Conv1D(24, 16), nn.Linear(24, 10)

        def forward(self, x):
            return self.head(self.c_attn(x))

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "head"],
                             fan_in_fan_out=True)
    register(config)
    model = peft.get_peft_model(Model(), config)
    assert fused_layers(model) == 1  # the Linear; the Conv1D keeps peft's layer
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.5)
    model.eval()
    x = torch.randn(3, 16)
    unmerged = model(x)
    torch.testing.assert_close(model.merge_and_unload()(x), unmerged, rtol=1e-5, atol=1e-5)


def test_a_base_that_trains_or_is_hooked_takes_peft_s_path():
    """peft's bias="all" and a base weight unfrozen by hand get their gradients, and a plain
    base's forward hooks run: the function covers none of them, peft's modules do."""
    x = torch.randn(2, 4, 32)
    for config in ({"bias": "all"}, {"bias": "lora_only"}):
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **config)
        register(lora)
        model = peft.get_peft_model(Block(bias=True), lora).train()
        q = model.base_model.model.q_proj
        assert q._fused_forward(x) is None, config
        model(x).sum().backward()
        assert q.base_layer.bias.grad is not None and q.base_layer.bias.grad.abs().sum() > 0
    fused = adapted(True, 0.0)
    q = fused.base_model.model.q_proj
    assert q._fused_forward(x) is not None
    q.base_layer.weight.requires_grad_(True)
    assert q._fused_forward(x) is None
    fused(x).sum().backward()
    assert q.base_layer.weight.grad is not None
    q.base_layer.weight.requires_grad_(False)
    seen = []
    handle = q.base_layer.register_forward_pre_hook(lambda module, inputs: seen.append("pre"))
    fused(x)
    assert seen == ["pre"]
    handle.remove()
    assert q._fused_forward(x) is not None


def test_a_second_derivative_is_refused_not_wrong():
    fused = adapted(True, 0.0)
    b = fused.base_model.model.q_proj.lora_B["default"].weight
    x = torch.randn(2, 4, 32, requires_grad=True)
    grad_b, = torch.autograd.grad(fused(x).pow(2).sum(), [b], create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        grad_b.pow(2).sum().backward()
