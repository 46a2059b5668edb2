"""Units with hand-computed answers: lr schedule, sampler, checkpoints, metrics, seed args."""
from __future__ import annotations

import json

import pytest
import torch

from rapidformer.checkpoint import store as checkpoint
from rapidformer.config.args import Args
from rapidformer.config.compose import compose
from rapidformer.preflight import settle
from rapidformer.config.schema import SchedulerConfig
from rapidformer.data.sampler import ResumableSampler
from rapidformer.optim import lr_multiplier, parameter_groups
from rapidformer.errors import ConfigError
from rapidformer.tasks.sequence_classification import classification_metrics


def test_linear_schedule_warms_up_then_decays_to_min_lr():
    s = SchedulerConfig(name="linear", warmup_iters=10, min_lr=1e-5)
    lr = 1e-4
    assert lr_multiplier(0, s, 110, lr) == pytest.approx(0.1)
    assert lr_multiplier(9, s, 110, lr) == pytest.approx(1.0)
    assert lr_multiplier(10, s, 110, lr) == pytest.approx(1.0)
    assert lr_multiplier(60, s, 110, lr) * lr == pytest.approx(1e-5 + 0.5 * 9e-5)
    assert lr_multiplier(110, s, 110, lr) * lr == pytest.approx(1e-5)
    assert lr_multiplier(500, s, 110, lr) * lr == pytest.approx(1e-5)


def test_cosine_and_constant_schedules():
    cosine = SchedulerConfig(name="cosine", warmup_fraction=0.1)
    assert lr_multiplier(10, cosine, 100, 1.0) == pytest.approx(1.0)
    assert lr_multiplier(55, cosine, 100, 1.0) == pytest.approx(0.5)
    assert lr_multiplier(100, cosine, 100, 1.0) == pytest.approx(0.0)
    constant = SchedulerConfig(name="constant", warmup_iters=4)
    assert [lr_multiplier(i, constant, 100, 1.0) for i in (0, 3, 50)] == [0.25, 1.0, 1.0]


def test_decay_iters_ends_decay_early():
    s = SchedulerConfig(name="linear", decay_iters=50)
    assert lr_multiplier(25, s, 100, 1.0) == pytest.approx(0.5)
    assert lr_multiplier(80, s, 100, 1.0) == 0.0


def test_no_weight_decay_on_biases_and_norms():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32))
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("bias" not in names[id(p)] and "LayerNorm" not in names[id(p)]
               for p in decay["params"])
    assert any("LayerNorm.weight" in names[id(p)] for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.01
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_sampler_drops_the_partial_global_batch_and_resumes_mid_epoch():
    full = ResumableSampler(num_samples=70, global_batch_size=16, shuffle=True, seed=3)
    full.set_epoch(2)
    order = list(full)
    assert len(order) == 64 and len(set(order)) == 64
    resumed = ResumableSampler(num_samples=70, global_batch_size=16, shuffle=True, seed=3)
    resumed.set_epoch(2, start_step=3)
    assert list(resumed) == order[48:]
    full.set_epoch(3)
    assert list(full) != order  # a new shuffle every epoch


def test_sampler_ranks_split_each_global_batch():
    ranks = [ResumableSampler(40, 8, rank=r, world_size=2, seed=1) for r in (0, 1)]
    single = ResumableSampler(40, 8, seed=1)
    a, b, s = list(ranks[0]), list(ranks[1]), list(single)
    assert [a[i * 4:(i + 1) * 4] + b[i * 4:(i + 1) * 4] for i in range(5)] == \
        [s[i * 8:(i + 1) * 8] for i in range(5)]


def test_checkpoint_is_atomic_and_an_interrupted_one_is_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 5, {"w.pt": {"w": torch.ones(3)}}, {"step": 5}, keep_last=2)
    # a directory whose file no longer matches its manifest is not complete ...
    bad = checkpoint.save(root, 7, {"w.pt": {"w": torch.zeros(3)}}, {"step": 7}, keep_last=5)
    (bad / "w.pt").write_bytes(b"corrupt")
    # ... and a crash mid-save leaves a hidden temporary directory
    (root / ".tmp-step_00000009").mkdir()
    (root / ".tmp-step_00000009" / "w.pt").write_bytes(b"half")
    assert checkpoint.latest(root).name == "step_00000005"
    complete, broken = checkpoint.scan(root)
    assert [p.name for p in complete] == ["step_00000005"]
    assert sorted(p.name for p in broken) == [".tmp-step_00000009", "step_00000007"]
    assert torch.equal(checkpoint.load(root / "step_00000005", "w.pt")["w"], torch.ones(3))
    manifest = json.loads((root / "step_00000005" / checkpoint.MANIFEST).read_text())
    assert manifest["step"] == 5 and manifest["files"]["w.pt"]["bytes"] > 0
    # the next sealed save clears what interrupted saves left (a partial 17 GB checkpoint must
    # not stay on the disk) and keeps the complete ones; a damaged step directory goes only
    # where an intact one would (pruning by age), so step 7 stays for `rapidformer verify`
    checkpoint.save(root, 10, {"w.pt": {"w": torch.ones(3)}}, {"step": 10}, keep_last=5)
    complete, broken = checkpoint.scan(root)
    assert [p.name for p in complete] == ["step_00000005", "step_00000010"]
    assert [p.name for p in broken] == ["step_00000007"]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, {"x.pt": torch.ones(1)}, {"step": step}, keep_last=2)
    assert [p.name for p in checkpoint.scan(tmp_path)[0]] == ["step_00000003", "step_00000004"]


def test_classification_metrics_by_hand():
    predictions = torch.tensor([1, 1, 0, 0, 1])
    labels = torch.tensor([1, 0, 0, 1, 1])
    metrics = classification_metrics(predictions, labels, 2)
    # tp=2, fp=1, fn=1 -> precision 2/3, recall 2/3, f1 2/3; 3 of 5 right
    assert metrics["accuracy"] == pytest.approx(0.6)
    assert metrics["f1"] == pytest.approx(2 / 3)


def test_get_args_uses_the_seed_names():
    _, cfg = settle(compose(["+recipe=bert_mrpc", "precision=fp16"]), output_dir="run")
    args = Args(cfg, "run")
    assert args.pretrained_model_name_or_path == "bert-base-cased"
    assert (args.data_path, args.dataset_path, args.data_name, args.dataset_name) == \
        ("glue", "glue", "mrpc", "mrpc")
    assert (args.micro_batch_size, args.global_batch_size, args.epochs) == (16, 64, 3)
    assert args.lr == 2e-5 and args.lr_warmup_iters == 100 and args.lr_decay_style == "linear"
    assert args.fp16 and args.mixed_precision and not args.bf16
    assert args.seq_length == 128 and args.save == "run"
    with pytest.raises(AttributeError, match="micro_batch_size"):
        args.micro_bach_size


def test_seed_imports():
    from rapidformer import (Finetuner, PreTrainer, RapidformerEngine,
                             build_train_valid_test_datasets,
                             build_train_valid_test_datasets_for_huggingface, get_args,
                             get_logger, get_timers, get_tokenizer, mpu)

    assert callable(get_args) and get_logger().name == "rapidformer"
    timers = get_timers()
    timers("step").start()
    timers("step").stop()
    assert "step:" in timers.log(["step"])
    assert issubclass(Finetuner, object) and RapidformerEngine and PreTrainer
    assert callable(build_train_valid_test_datasets_for_huggingface)
    assert callable(build_train_valid_test_datasets) and callable(get_tokenizer)
    assert callable(mpu.broadcast_data)


def test_trained_vocabulary_is_reproducible(tmp_path):
    from rapidformer.data.synthetic import make_split
    from rapidformer.data.tokenizers import SPECIAL_TOKENS, train_wordpiece

    texts = [r[k] for r in make_split(200, 1) for k in ("sentence1", "sentence2")]
    a = train_wordpiece(texts, tmp_path / "a", vocab_size=500, lowercase=True, max_length=64)
    b = train_wordpiece(texts, tmp_path / "b", vocab_size=500, lowercase=True, max_length=64)
    assert (tmp_path / "a" / "vocab.txt").read_bytes() == (tmp_path / "b" / "vocab.txt").read_bytes()
    assert a.convert_ids_to_tokens(list(range(5))) == SPECIAL_TOKENS
    # every character is in the vocabulary, so an unseen word is spelled, not unknown
    assert "[UNK]" not in a.tokenize("zebra")
    assert a("the doctor")["input_ids"] == b("the doctor")["input_ids"]


def test_precision_needs_a_device_with_autocast():
    from rapidformer.accelerators.precision import MixedPrecision
    from rapidformer.config.schema import PrecisionConfig

    with pytest.raises(ConfigError, match="autocast is not available on device 'meta'"):
        MixedPrecision(PrecisionConfig(name="fp16", dtype="fp16"), torch.device("meta"))
    assert MixedPrecision(PrecisionConfig(), torch.device("meta")).scaler is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_device_without_a_gpu_is_refused():
    from rapidformer.planning.run_plan import pick_device

    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA GPU is visible"):
        pick_device("cuda")
    assert pick_device("auto").type == "cpu"


def test_activation_recompute_hooks_hugging_face_layers_and_refuses_others():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.accelerators.recompute import enable_recompute

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50))
    enable_recompute(model)
    on = model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") \
        else model.is_gradient_checkpointing
    assert on
    with pytest.raises(ConfigError, match="Linear does not support activation recompute"):
        enable_recompute(torch.nn.Linear(2, 2))


def test_model_flops_follow_the_palm_formula():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    from rapidformer.observability.flops import ModelFlops, flops_per_token, model_shape

    # GPT-2 124M at seq 1024, by hand: 6 x 124,439,808 + 12 x 12 layers x 768 x 1024
    assert flops_per_token(124_439_808, 12, 768, 1024) == 746_638_848 + 113_246_208
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=50))
    assert model_shape(gpt2, 99, 99) == (3, 32)
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32, vocab_size=50))
    assert model_shape(bert, 99, 99) == (2, 16)
    assert model_shape(torch.nn.Linear(2, 2), 5, 7) == (5, 7)  # no config: the run's settings
    # 2 devices share the window's 1000 tokens/s at mean length 16; a CPU has no peak: no MFU
    record = ModelFlops(100, 2, 8, torch.device("cpu"), 2).record(1000.0, 16.0)
    assert record == {"tflops_per_device": 1000 * (600 + 12 * 2 * 8 * 16) / 2 / 1e12}


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12),
                                       ("NVIDIA L4", 121e12), ("Tesla V100-SXM2-32GB", None)])
def test_mfu_peak_comes_from_the_gpu_name(monkeypatch, name, peak):
    from rapidformer.observability import flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.peak_flops(torch.device("cuda", 0)) == peak
    assert flops.peak_flops(torch.device("cpu")) is None
    if peak:
        mfu = flops.ModelFlops(10**9, 24, 2048, torch.device("cuda", 0), 1).record(1e4, 2048)["mfu"]
        assert mfu == pytest.approx(1e4 * (6e9 + 12 * 24 * 2048 * 2048) / peak)


def test_length_grouped_sampler_pads_less_and_resumes():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 120, (1000,), generator=generator).tolist()
    kwargs = dict(num_samples=1000, global_batch_size=64, world_size=2, shuffle=True, seed=3)

    def micro_batches(sampler):
        order = list(sampler)
        return [order[i:i + 8] for i in range(0, len(order), 8)]

    def padding(batches):
        slots = sum(8 * max(lengths[i] for i in b) for b in batches)
        return 1 - sum(lengths[i] for b in batches for i in b) / slots

    plain = [ResumableSampler(rank=r, **kwargs) for r in (0, 1)]
    grouped = [ResumableSampler(rank=r, lengths=lengths, micro_batch_size=8, **kwargs)
               for r in (0, 1)]
    both = [i for s in grouped for i in s]
    assert len(both) == len(set(both)) == sum(len(s) for s in plain) == 15 * 64
    assert padding([b for s in grouped for b in micro_batches(s)]) < 0.1 < \
        padding([b for s in plain for b in micro_batches(s)])
    # the order is a function of (seed, epoch): a resumed sampler continues it exactly
    resumed = ResumableSampler(rank=1, lengths=lengths, micro_batch_size=8, **kwargs)
    resumed.set_epoch(0, start_step=5)
    assert list(resumed) == list(grouped[1])[5 * 32:]


@pytest.mark.parametrize("overrides,expected", [
    ([], {"tf32": False, "cudnn_benchmark": True}),                      # fp32 means fp32
    (["precision=bf16"], {"tf32": True, "cudnn_benchmark": True}),
    (["precision=fp16", "trainer.tf32=false"], {"tf32": False, "cudnn_benchmark": True}),
    (["trainer.tf32=true", "trainer.deterministic=true"], {"tf32": True, "cudnn_benchmark": False}),
])
def test_gpu_math_settings_follow_precision_and_determinism(overrides, expected):
    from rapidformer.runtime.gpu_math import gpu_math_settings

    _, cfg = settle(compose(overrides), "out")
    assert gpu_math_settings(cfg) == expected


def test_training_runs_without_the_kv_cache_and_the_export_keeps_it(tmp_path):
    """A decoder's KV cache is built in every forward unless turned off: memory for nothing in
    training, and per-layer recompiles under regional compile. The exported config keeps it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.engine import RapidformerEngine

    _, cfg = settle(compose(["model=bert_tiny", "trainer.train_iters=2", "trainer.device=cpu",
                              "trainer.export_hf=true"]), str(tmp_path))
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50))
    ids = torch.randint(0, 50, (2, 8))
    assert model(input_ids=ids).past_key_values is not None  # transformers' default
    engine = RapidformerEngine(cfg=cfg, run_dir=tmp_path)
    model, _, _ = engine.compose(model)
    out = model(input_ids=ids, labels=ids)
    assert out.past_key_values is None and model.config.use_cache is False
    engine.backward(out.loss)
    engine.step()
    exported = engine.export_hf()
    assert json.loads((exported / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False  # still training


def test_gradient_norm_spikes_are_logged_against_the_recent_median(caplog):
    from rapidformer.observability.grad_spikes import GradNormSpikes

    spikes = GradNormSpikes(factor=10.0, warmup=3)
    norms = [1.0, 1.2, 0.9, 1.1, 30.0, 1.0, float("nan"), 8.0, 12.0]
    with caplog.at_level("WARNING", logger="rapidformer"):
        flagged = [spikes.check(step, n) for step, n in enumerate(norms, 1)]
    # the median stays near 1 (a spike or a NaN does not move it): 30 and 12 are spikes, 8 not
    assert flagged == [False, False, False, False, True, False, False, False, True]
    assert spikes.count == 2
    assert "gradient-norm spike by step 5: 30, 28.6x the median of the last 4 log windows " \
        "(1.05); spike 1 of this run" in caplog.text
    assert not any(GradNormSpikes(None).check(s, 1e9) for s in range(10))


def test_the_log_window_keeps_the_largest_gradient_norm_on_the_device():
    from rapidformer.accelerators.base import StepResult
    from rapidformer.templates.loop import _Window

    window = _Window()
    for norm in (1.0, float("nan"), 3.0, 2.0):
        window.add_step(StepResult(stepped=True, grad_norm=torch.tensor(norm)))
    assert float(window.grad_norm_max) == 3.0 and float(window.grad_norm) == 2.0


def test_a_torn_last_metrics_record_is_cut_before_appending(tmp_path):
    from rapidformer.observability.metrics import MetricsSink

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.write(2, {"loss": 1.5})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == \
        '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def test_fp16_overflow_steps_are_skipped_and_counted():
    from rapidformer.accelerators.precision import MixedPrecision
    from rapidformer.config.schema import PrecisionConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # 2^20 x a loss gradient of 100 overflows fp16 (max 65504) until the scale has halved
    precision = MixedPrecision(PrecisionConfig(name="fp16", dtype="fp16",
                                               initial_scale=2.0 ** 20), torch.device("cpu"))
    start = model.weight.detach().clone()
    stepped = []
    for _ in range(16):
        optimizer.zero_grad()
        with precision.autocast():
            loss = model(torch.ones(2, 4)).float().sum() * 100
        precision.scale(loss).backward()
        precision.unscale_(optimizer)
        stepped.append(precision.step(optimizer))
        if not stepped[-1]:
            assert torch.equal(model.weight, start)  # a skipped step changes nothing
    skipped = stepped.index(True)
    assert skipped >= 10 and all(stepped[skipped:])  # 2^20 -> 2^9 or lower, then it trains
    assert not torch.equal(model.weight, start)
    assert precision.skipped_steps == skipped and precision.loss_scale == 2.0 ** (20 - skipped)
    assert precision.state_dict()["skipped_steps"] == skipped


def test_deepspeed_on_a_cpu_does_not_compile_its_inference_all_reduce():
    import importlib

    import torch

    from rapidformer.accelerators.zero import import_deepspeed

    import_deepspeed(torch.device("cpu"))
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_clipping_folded_into_the_fused_optimizer_matches_clip_grad_norm(tmp_path, clip):
    """With a fused AdamW the engine clips inside the optimizer's kernel (no pass of its own
    over the gradients): the weights must follow clip_grad_norm_ + step, clipping or not.
    Adam is nearly blind to a gradient's scale; a large eps makes the clip show in the weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rapidformer.engine import RapidformerEngine
    from rapidformer.optim import build_optimizer

    _, cfg = settle(compose(["model=bert_tiny", "trainer.train_iters=4", "trainer.device=cpu",
                              f"trainer.clip_grad={clip}", "trainer.lr=1e-2",
                              "scheduler=constant", "optim.eps=1e-3"]), str(tmp_path))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50,
                                       resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    reference = GPT2LMHeadModel(model.config)
    reference.load_state_dict(model.state_dict())
    engine = RapidformerEngine(cfg=cfg, run_dir=tmp_path)
    model, optimizer, _ = engine.compose(model)
    assert engine.strategy.clips_in_optimizer()
    ref_optimizer = build_optimizer(reference, cfg.optim, cfg.trainer.lr,
                                    cfg.trainer.weight_decay, torch.device("cpu"))
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        engine.backward(model(input_ids=ids, labels=ids).loss)
        norm = engine.step().grad_norm
        reference(input_ids=ids, labels=ids).loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                  clip if clip > 0 else float("inf"))
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5)
        if clip:
            assert float(ref_norm) > 4 * clip  # the clip is active, not a no-op
    assert not hasattr(optimizer, "grad_scale")  # GradScaler's hook is left as found
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_inductor_options_reach_torch_compile_and_a_misspelt_one_is_refused(tmp_path):
    from rapidformer.accelerators.graph import _compile_kwargs
    from rapidformer.engine import RapidformerEngine

    _, cfg = settle(compose(["graph=compile", "graph.options.coordinate_descent_tuning=true",
                              "trainer.device=cpu"]), str(tmp_path))
    assert _compile_kwargs(cfg.graph)["options"] == {"coordinate_descent_tuning": True}
    _, cfg = settle(compose(["graph=compile", "graph.options.coordinate_descent_tunin=true",
                              "trainer.device=cpu", "trainer.train_iters=1"]), str(tmp_path))
    engine = RapidformerEngine(cfg=cfg, run_dir=tmp_path)
    with pytest.raises(ConfigError) as info:  # at compose, not at the first compiled step
        engine.compose(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert "graph.options.coordinate_descent_tunin: not an inductor option; did you mean " \
           "'coordinate_descent_tuning'?" in str(info.value)


def test_the_heap_is_frozen_after_every_other_exit_handler(tmp_path):
    """The interpreter's shutdown skips its garbage collections (0.6-1.5 s with torch and
    megatron-core imported) only if the freeze runs after the handlers libraries add later."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, gc\n"
        "atexit.register(lambda: print('first registered, runs last:', gc.isenabled(),\n"
        "                              gc.get_freeze_count() > 0))\n"
        "from rapidformer.runtime.fast_exit import install\n"
        "install()\n"
        "atexit.register(lambda: print('a library handler still runs:', gc.isenabled()))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["a library handler still runs: True",
                                          "first registered, runs last: False True"]
