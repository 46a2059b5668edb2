"""trainer.offload_activations: with activation recompute, the layer inputs it keeps are held in
host memory (transformers' offload: torch's save_on_cpu around each layer's checkpoint) and the
gradients are those of keeping them; refused where it does nothing or is not built."""
from __future__ import annotations

import pytest
import torch

from rapidformer.accelerators.recompute import enable_recompute
from rapidformer.config.compose import compose
from rapidformer.errors import ConfigError
from rapidformer.preflight import settle
from tests.test_decoders import tiny_llama


SAVE_ON_CPU_INIT = torch.autograd.graph.save_on_cpu.__init__


def _grads_and_saved(offload: bool | None, monkeypatch):
    """A tiny Llama's gradients, and the saved tensors that went through save_on_cpu's pack."""
    packed = []
    original = SAVE_ON_CPU_INIT

    def counting(self, *args, **kwargs):
        # on a CPU-only torch there is no pinned memory: the same hooks, unpinned
        original(self, *args, **{**kwargs, "pin_memory": torch.cuda.is_available()})
        pack = self.pack_hook

        def counted(tensor):
            packed.append(tuple(tensor.shape))
            return pack(tensor)

        self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph.save_on_cpu, "__init__", counting)
    torch.manual_seed(0)
    model = tiny_llama()
    if offload is not None:
        # the CPU refusal looks at the parameters' device: a GPU's, as far as it can tell
        monkeypatch.setattr("rapidformer.accelerators.recompute.on_the_cpu", lambda m: False)
        enable_recompute(model, offload=offload)
    model.train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, packed


def test_offloaded_recompute_gives_the_gradients_of_keeping_the_activations(monkeypatch):
    kept, none_packed = _grads_and_saved(None, monkeypatch)
    offloaded, packed = _grads_and_saved(True, monkeypatch)
    recomputed, recompute_packed = _grads_and_saved(False, monkeypatch)
    assert none_packed == [] and recompute_packed == []
    # each of the 2 layers' input [2, 16, hidden] went to host memory; parameters did not
    hidden = tiny_llama().config.hidden_size
    assert sum(shape == (2, 16, hidden) for shape in packed) == 2, packed
    assert not any(len(shape) == 2 and shape[0] == 96 for shape in packed)  # no weight
    for name in kept:
        torch.testing.assert_close(offloaded[name], kept[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(recomputed[name], kept[name], rtol=1e-5, atol=1e-6)


def test_a_transformers_without_offload_is_told_the_version(monkeypatch):
    model = tiny_llama()

    def old_enable(activation_checkpointing_kwargs=None, every_n_layers=1):
        raise AssertionError("not called")

    monkeypatch.setattr(model, "activation_checkpointing_enable", old_enable)
    monkeypatch.setattr("rapidformer.accelerators.recompute.on_the_cpu", lambda m: False)
    with pytest.raises(ConfigError, match=r"trainer.offload_activations=true needs a "
                                          r"transformers .* 5.17 has it.*pip install -U"):
        enable_recompute(model, offload=True)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.offload_activations=true"],
     "trainer.offload_activations=true moves the layer inputs that activation recompute keeps "
     "to host memory, and this run recomputes nothing; add trainer.checkpoint_activations=true"),
    (["model=megatron_gpt_tiny", "+recipe=gpt_pretrain", "data.path=x", "model.tokenizer=x",
      "model.merge_file=x", "trainer.checkpoint_activations=true",
      "trainer.offload_activations=true"],
     "trainer.offload_activations=true with model=megatron_gpt_tiny: megatron-core's recompute"),
])
def test_offload_where_it_does_nothing_or_is_not_built_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        settle(compose(["trainer.device=cpu", *overrides]), "out")


def test_a_cpu_run_is_told_its_activations_are_in_host_memory_already(tmp_path):
    from tests.test_decoders import pretrain
    from tests.test_peft import lora_args

    with pytest.raises(ConfigError, match="this run is on the CPU, where they are in host memory"):
        pretrain(tmp_path / "run", [*lora_args(tmp_path / "data"),
                                    "trainer.checkpoint_activations=true",
                                    "trainer.offload_activations=true"])
    model = tiny_llama()  # trainer.device=auto finding no GPU: at the model's preparation
    with pytest.raises(ConfigError, match="this run is on the CPU"):
        enable_recompute(model, offload=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_layer_inputs_leave_gpu_memory_and_the_gradients_stay():
    """Pinned host memory for real: after the forward, the GPU holds the layers' inputs less
    (layers x tokens x hidden x 4 bytes), and the gradients are recompute's own."""
    results = {}
    for offload in (False, True):
        torch.manual_seed(0)
        model = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           max_position_embeddings=512).cuda()
        enable_recompute(model, offload=offload)
        model.train()
        ids = torch.randint(0, 96, (4, 512), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        results[offload] = held, {n: p.grad for n, p in model.named_parameters()}
    layer_inputs = 4 * 4 * 512 * 256 * 4
    assert results[False][0] - results[True][0] >= 0.9 * layer_inputs, results
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=1e-4, atol=1e-5)


# found in review (fixed): accelerate=auto with memory=auto: tuning/admit.py sets checkpoint_activations from the
# candidate's own overrides (false unless it names it), and the memory plan's mode then says
# trainer.checkpoint_activations=false, so with trainer.offload_activations=true every candidate
# is refused as "recomputes nothing; add trainer.checkpoint_activations=true", which the run has
def test_a_search_under_memory_auto_keeps_candidates_with_offload(monkeypatch):
    from rapidformer.tuning import admit as admit_module
    from rapidformer.tuning.enumerate import candidates

    monkeypatch.setattr(admit_module, "machine_problems", lambda cfg, device: [])  # no GPU here
    _, cfg = settle(compose(["+recipe=llama_lora", "trainer.device=cuda", "memory=auto",
                             "memory.device_memory_gb=80", "precision=fp32", "accelerate=auto",
                             "trainer.checkpoint_activations=true",
                             "trainer.offload_activations=true"]), "out")
    admitted, left_out, _ = candidates(cfg, torch.device("cuda"), memory_auto=True)
    assert admitted, left_out


# found in review (fixed): the search's cache key (tuning/cache.py key_fields) holds checkpoint_activations but not
# offload_activations: a result searched without offload (whose choice may be ckpt=false) is
# reused for the same run with offload, which that choice then makes refused
def test_the_tuning_cache_key_follows_offload_activations():
    from rapidformer.tuning import cache

    keys = set()
    for offload in ("false", "true"):
        _, cfg = settle(compose(["+recipe=llama_lora", "trainer.device=cuda", "accelerate=auto",
                                     "trainer.checkpoint_activations=true",
                                     f"trainer.offload_activations={offload}"]), "out")
        keys.add(cache.key_of(cache.key_fields(cfg, "cpu")))
    assert len(keys) == 2


# found in review (fixed): `rapidformer eval` of a run trained on a GPU with recompute and offload, on a machine
# without one: restore.one_process_config keeps trainer.offload_activations=true, the engine's
# prepare calls enable_recompute(offload=True) on CPU parameters, and the evaluation (no_grad:
# nothing is recomputed or offloaded) is refused with "this run is on the CPU"
def test_eval_of_an_offloaded_run_on_a_cpu_is_not_refused(tmp_path):
    import yaml

    from rapidformer.cli.verbs.evaluate import evaluate
    from tests.conftest import run_in_process

    run = tmp_path / "run"  # trained in this process: the evaluation is the subject
    run_in_process(["+recipe=llama_lora", "trainer.train_iters=2", "trainer.device=cpu",
                    "trainer.checkpoint_activations=true", f"trainer.output_dir={run}",
                    "data.synthetic_train_size=64", "data.synthetic_eval_size=16"], tmp_path)
    config = yaml.safe_load((run / "config.yaml").read_text())
    # as the run on a GPU recorded it
    config["trainer"].update(device="auto", offload_activations=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert "validation/loss" in evaluate(run)["metrics"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_the_refusal_pass_finds_no_gpu_for_offload_under_device_auto():
    # what `rapidformer validate` runs: both problems at once, before any model is built
    with pytest.raises(ConfigError) as info:
        settle(compose(["trainer.device=auto", "trainer.offload_activations=true"]), "out",
               environment=True)
    text = str(info.value)
    assert "this run recomputes nothing" in text
    assert "where they are in host memory already" in text and "trainer.device=auto found no GPU" \
        in text
