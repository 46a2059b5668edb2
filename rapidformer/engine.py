"""RapidformerEngine: the device, the seed, the accelerators, and the small user contract
(`compose`, `backward`, `step`, `gather`) that templates and own-loop scripts share."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rapidformer import checkpoint
from rapidformer.accelerators import megatron_checkpoint, megatron_optimizer, ort, parallel
from rapidformer.accelerators.fsdp import (DCP_DIR, full_state_dict, load_shards, save_shards,
                                           shard_model, transformer_blocks)
from rapidformer.accelerators.graph import apply_graph, compile_blocks, unwrap
from rapidformer.accelerators.memory import (CHECKPOINT_TAG, ZERO_STAGES, consolidated_state_dict,
                                             deepspeed_config, import_deepspeed)
from rapidformer.accelerators.precision import MixedPrecision, check_device_supports
from rapidformer.accelerators.recompute import enable_recompute
from rapidformer.config.args import active
from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError, InputError
from rapidformer.flops import ModelFlops, model_shape
from rapidformer.models.attention import use_training_sdpa
from rapidformer.models.hf import kv_cache_as_configured, training_without_kv_cache
from rapidformer.optim import build_optimizer, build_scheduler
from rapidformer.rank_progress import RankProgress

log = logging.getLogger("rapidformer")
ENGINES_CREATED = 0  # the user-script runner checks that a script built one


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(["trainer.device=cuda but no CUDA GPU is visible; use "
                               "trainer.device=cpu or auto"])
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def gpu_math_settings(cfg: RunConfig) -> dict:
    """cuBLAS/cuDNN switches for this run: TF32 (trainer.tf32; null: with mixed precision only)
    and cuDNN autotuning (off when the run must be deterministic)."""
    t = cfg.trainer
    tf32 = t.tf32 if t.tf32 is not None else cfg.precision.dtype != "fp32"
    return {"tf32": tf32, "cudnn_benchmark": not t.deterministic}


def apply_gpu_math_settings(cfg: RunConfig) -> None:
    settings = gpu_math_settings(cfg)
    torch.backends.cuda.matmul.allow_tf32 = settings["tf32"]
    torch.backends.cudnn.allow_tf32 = settings["tf32"]
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
             "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(gauss)], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), None))
    has_gauss, gauss = state["numpy_gauss"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"],
                         int(has_gauss), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def init_distributed(device: torch.device, timeout_s: int) -> tuple[int, int]:
    """(rank, world size); joins the process group that the launcher (or torchrun) set up."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if not dist.is_initialized():
        from datetime import timedelta

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # the elastic agent's store outlives a restart, and with it the first attempt's
            # addresses: the restarted workers would connect to dead peers. Each attempt gets
            # its own key space in it.
            store = dist.PrefixStore(f"rapidformer/attempt_{attempt}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                is_master=False, timeout=timeout))
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def join_group_of_one(device: torch.device) -> None:
    """A one-process run still gives DeepSpeed, FSDP2 and megatron-core the process group they
    ask for (DeepSpeed would otherwise look for MPI to find its peers)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                                store=dist.HashStore(), rank=0, world_size=1)


class RapidformerEngine:
    """Built once per process, after the entrypoint has activated the resolved config."""

    def __init__(self, cfg: RunConfig | None = None, run_dir: str | os.PathLike | None = None):
        global ENGINES_CREATED
        if cfg is None:
            run = active()
            cfg, run_dir = run.cfg, run.run_dir
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.trainer.output_dir)
        self.device = pick_device(cfg.trainer.device)
        self.rank, self.world_size = init_distributed(self.device, cfg.launcher.collective_timeout)
        # forward passes counted per rank: names the rank that hung when a collective times out
        self.rank_progress = RankProgress(self.run_dir, self.rank, enabled=self.world_size > 1)
        seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
        if self.device.type == "cuda":
            apply_gpu_math_settings(cfg)
        # megatron-core models: tensor/pipeline groups; data parallelism takes the other ranks
        self.parallel = parallel.initialize(cfg, self.device) if parallel.is_megatron(cfg) else None
        if self.parallel is not None:  # megatron-core's optimizer owns the precision
            check_device_supports(cfg.precision, self.device)
            self.precision = megatron_optimizer.MegatronPrecision(cfg.precision.dtype)
        else:
            self.precision = MixedPrecision(cfg.precision, self.device)
        self.model = self.optimizer = self.lr_scheduler = None
        self._kv_cache_was_on = False  # set by compose
        ENGINES_CREATED += 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size): who reads which batch."""
        if self.parallel is not None:
            return self.parallel.dp_rank, self.parallel.dp
        return self.rank, self.world_size

    # --- building -------------------------------------------------------------------------
    def compose(self, model_obj: torch.nn.Module, optimizer=None, lr_scheduler=None,
                lr_scheduler_fn=None, total_iters: int | None = None):
        """Move the model to the device and wrap it; build what was not given.

        `lr_scheduler_fn` is called as `lr_scheduler_fn(optimizer=optimizer)` (the seed's
        `partial(get_linear_schedule_with_warmup, ...)`); without either, the configured
        scheduler is built for `total_iters` (default: trainer.train_iters).
        """
        t = self.cfg.trainer
        model = model_obj.to(self.device)
        self._kv_cache_was_on = training_without_kv_cache(model)
        if self.cfg.graph.name != "ort":  # ONNX export would bake the mask decision in
            use_training_sdpa(model)
        if t.checkpoint_activations and self.parallel is None:  # megatron-core: in its config
            enable_recompute(model)  # before any wrapper: it hooks the model's own layers
        self.num_parameters = (parallel.count_parameters(model) if self.parallel is not None
                               else sum(p.numel() for p in model.parameters() if p.requires_grad))
        log.info("model parameters: %d (%.1fM)", self.num_parameters, self.num_parameters / 1e6)
        layers, hidden = model_shape(model, self.cfg.model.num_layers, self.cfg.model.hidden_size)
        self.model_flops = ModelFlops(self.num_parameters, layers, hidden, self.device,
                                      self.world_size)
        model = compile_blocks(model, self.cfg.graph, self.cfg.memory.name)  # inside whatever wraps the model next
        if self.cfg.graph.name == "ort":  # inside DDP, like the compiled blocks
            model = ort.wrap(model)
        self.ddp = self.ds = self.fsdp = None
        if self.cfg.memory.name == "fsdp":
            if optimizer is not None:
                raise ConfigError(["memory=fsdp shards the parameters, so the optimizer must be "
                                   "built after sharding: return None for the optimizer from "
                                   "model_optimizer_lr_scheduler_provider"])
            join_group_of_one(self.device)
            model = self.fsdp = shard_model(model, self.cfg, self.device)
            log.info("memory=fsdp: FSDP2 over %d transformer blocks", len(transformer_blocks(model)))
        if self.parallel is not None:
            if optimizer is not None:
                raise ConfigError(["a Megatron model trains with megatron-core's optimizer, "
                                   "built from optim.* and precision.*: return None for the "
                                   "optimizer from model_optimizer_lr_scheduler_provider"])
            model = megatron_optimizer.wrap_model(model, self.cfg)
            optimizer = self.precision.optimizer = megatron_optimizer.build_optimizer(model,
                                                                                      self.cfg)
        if optimizer is None:
            optimizer = build_optimizer(model, self.cfg.optim, t.lr, t.weight_decay, self.device)
        if lr_scheduler is None:
            if lr_scheduler_fn is not None:
                lr_scheduler = lr_scheduler_fn(optimizer=optimizer)
            else:
                total = total_iters or t.train_iters
                if not total:
                    raise ConfigError(["engine.compose() needs total_iters (or trainer.train_iters) "
                                       "to build the lr schedule; pass total_iters=N or "
                                       "lr_scheduler_fn"])
                lr_scheduler = build_scheduler(optimizer, self.cfg.scheduler, total, t.lr)
        if self.cfg.memory.name in ZERO_STAGES and self.parallel is None:
            deepspeed = import_deepspeed(self.device)
            join_group_of_one(self.device)
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts on it, even for one
            accumulation = t.global_batch_size // (t.micro_batch_size * self.world_size)
            config = deepspeed_config(self.cfg, accumulation, self.device)
            self.ds, optimizer, _, lr_scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
            log.info("memory=%s: DeepSpeed ZeRO stage %d", self.cfg.memory.name,
                     ZERO_STAGES[self.cfg.memory.name])
            self._ds_skipped = 0  # DeepSpeed's count of overflow-skipped steps at the last step
            self.model, self.optimizer, self.lr_scheduler = self.ds, optimizer, lr_scheduler
            return self.ds, optimizer, lr_scheduler
        if self.world_size > 1 and self.fsdp is None and self.parallel is None:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            p = self.cfg.parallelism
            # gradients live in the reduction buckets: no copy in or out, one buffer less
            model = self.ddp = DistributedDataParallel(model, device_ids=ids,
                                                       bucket_cap_mb=p.ddp_bucket_cap_mb,
                                                       gradient_as_bucket_view=True)
            if p.ddp_comm_hook == "bf16_compress":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        model = apply_graph(model, self.cfg.graph, self.cfg.memory.name)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        return model, optimizer, lr_scheduler

    # --- the step ---------------------------------------------------------------------------
    def autocast(self):
        if self.ds is not None or self.fsdp is not None:  # they own the compute precision
            return contextlib.nullcontext()
        return self.precision.autocast()

    def accumulating(self, last_micro_batch: bool):
        """Skip DDP's gradient all-reduce on every micro-batch but the last of a step."""
        if self.fsdp is not None:
            self.fsdp.set_requires_gradient_sync(last_micro_batch)
        if self.ddp is None or last_micro_batch:  # DeepSpeed accumulates by itself
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    @contextlib.contextmanager
    def main_process_first(self):
        """Rank 0 runs the block first (downloads, generated files, caches), then the others."""
        if self.world_size > 1 and self.rank != 0:
            dist.barrier()
        yield
        if self.world_size > 1 and self.rank == 0:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def backward(self, loss: torch.Tensor, accumulation_steps: int = 1) -> None:
        """Gradients of `loss`, averaged over `accumulation_steps` micro-batches."""
        if self.ds is not None:
            # DeepSpeed divides by its own accumulation steps and steps at the boundary
            self.ds.backward(loss)
            self.ds.step()
            return
        self.precision.scale(loss / accumulation_steps).backward()

    def step(self) -> dict:
        """Unscale, clip, step (skipped on fp16 overflow), advance the lr, zero the grads.

        Returns the gradient norm as a tensor (read it only when logging: no host sync here).
        """
        if self.ds is not None:
            norm = self.ds.get_global_grad_norm()
            skipped = self.ds.skipped_steps
            stepped = skipped == self._ds_skipped
            self._ds_skipped = skipped
            self.precision.skipped_steps = skipped
            return {"grad_norm": torch.tensor(float(norm) if norm is not None else float("nan")),
                    "stepped": stepped}
        if self.parallel is not None:  # megatron-core: unscale, clip over every shard, step
            stepped, grad_norm = self.precision.step(self.optimizer)
            if stepped:
                self.lr_scheduler.step()
            megatron_optimizer.zero_grad(self.model, self.optimizer)
            return {"grad_norm": torch.tensor(grad_norm), "stepped": stepped}
        clip = self.cfg.trainer.clip_grad
        self.precision.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self._clips_in_optimizer():
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params
                                                       if p.grad is not None], foreach=True)
            if clip > 0:
                # the fused kernel divides each gradient by grad_scale as it reads it: clipping
                # without a pass of its own over the gradients (GradScaler's hook, unused here)
                self.optimizer.grad_scale = ((grad_norm + 1e-6) / clip).clamp(min=1.0)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor norm over all shards
                grad_norm = grad_norm.full_tensor()
        try:
            stepped = self.precision.step(self.optimizer)
        finally:
            self.optimizer.__dict__.pop("grad_scale", None)
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "stepped": stepped}

    def _clips_in_optimizer(self) -> bool:
        """Whether clipping folds into the optimizer step: a fused torch optimizer (it takes a
        gradient divisor, the hook GradScaler uses), no loss scaler of its own using that hook,
        and plain tensors (not FSDP's DTensors)."""
        o = self.optimizer
        return (isinstance(o, torch.optim.Optimizer) and bool(o.defaults.get("fused"))
                and getattr(o, "_step_supports_amp_scaling", False)
                and self.precision.scaler is None and self.fsdp is None)

    def to_device(self, batch):
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict) or hasattr(batch, "items"):
            return {k: self.to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate `tensor` from every rank along dim 0 (sizes may differ between ranks)."""
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return tensor
        size = torch.tensor([tensor.shape[0]], device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[: int(s.item())] for part, s in zip(parts, sizes)])

    # --- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self, step: int, state: dict, extra=None) -> Path:
        """Rank 0 writes the (replicated) states and every rank's RNG; the others wait."""
        rng = [self._rng_state()]
        if self.world_size > 1:
            rng = [None] * self.world_size
            dist.all_gather_object(rng, self._rng_state())
        path = self.checkpoint_root / f"step_{step:08d}"
        sharded = self.ds is not None or self.fsdp is not None or self.parallel is not None
        if sharded:
            # every rank writes its shards into the temporary directory first
            tmp = checkpoint.temp_dir(self.checkpoint_root, step)
            if self.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.barrier()
            if self.ds is not None:
                self.ds.save_checkpoint(str(tmp), tag=CHECKPOINT_TAG)
                tensors = {"rng.pt": {"ranks": rng}}
            elif self.parallel is not None:
                megatron_checkpoint.save(self.model, self.optimizer, tmp)
                tensors = {"scheduler.pt": self.lr_scheduler.state_dict(),
                           "precision.pt": self.precision.state_dict(),
                           "rng.pt": {"ranks": rng}}
            else:
                save_shards(self.fsdp, self.optimizer, tmp / DCP_DIR)
                tensors = {"scheduler.pt": self.lr_scheduler.state_dict() if self.lr_scheduler else {},
                           "precision.pt": self.precision.state_dict(),
                           "rng.pt": {"ranks": rng}}
            self.barrier()
        else:
            tensors = {"model.pt": unwrap(self.model).state_dict(),
                       "optimizer.pt": self.optimizer.state_dict(),
                       "scheduler.pt": self.lr_scheduler.state_dict() if self.lr_scheduler else {},
                       "precision.pt": self.precision.state_dict(),
                       "rng.pt": {"ranks": rng}}
        if self.is_main_process:
            path = checkpoint.save(self.checkpoint_root, step, tensors,
                                   {**state, "world_size": self.world_size,
                                    "memory": self.cfg.memory.name, **self._layout()}, extra,
                                   self.cfg.trainer.keep_last, prepared=sharded)
            log.info("saved checkpoint %s", path)
        self.barrier()
        return path

    def _rng_state(self) -> dict:
        state = rng_state()
        if self.parallel is not None:  # dropout inside tensor-parallel regions
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
        return state

    def _megatron_as_gpt2(self, model, tokenizer):
        from rapidformer.models.megatron_export import gather_full_state, to_hf_gpt2

        full = gather_full_state(model, self.cfg.model.num_layers)  # collective
        if full is None:
            return None
        vocab = full["embedding.word_embeddings.weight"].shape[0]
        eod = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        return to_hf_gpt2(full, self.cfg, vocab, eod)

    def _layout(self) -> dict:
        if self.parallel is None:
            return {}
        return {"tensor_parallel": self.parallel.tp, "pipeline_parallel": self.parallel.pp,
                "world_size": self.world_size, "precision": self.cfg.precision.dtype}

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @functools.cached_property
    def resume_checkpoint(self) -> Path | None:
        """The checkpoint trainer.resume names, located (and verified) once per run."""
        choice = self.cfg.trainer.resume
        if not choice:
            return None
        if choice == "auto":
            found = checkpoint.latest(self.checkpoint_root)
            if found is None:
                log.info("trainer.resume=auto: no complete checkpoint in %s; starting fresh",
                         self.checkpoint_root)
            return found
        path = Path(choice)
        if path.is_dir() and not checkpoint.NAME.match(path.name):
            found = checkpoint.latest(path / "checkpoints") or checkpoint.latest(path)
            if found is not None:
                return found
        if not path.exists():
            raise InputError(f"trainer.resume={choice}: no such checkpoint directory; use "
                             f"trainer.resume=auto or a path to a step_NNNNNNNN directory")
        if not checkpoint.is_complete(path):
            raise InputError(f"trainer.resume={choice} is not a complete checkpoint (its "
                             f"{checkpoint.MANIFEST} is missing or does not match its files)")
        return path

    def load_checkpoint(self, path: Path) -> dict:
        state = checkpoint.read_state(path)
        saved_memory = state.get("memory", "none")
        if saved_memory != self.cfg.memory.name:
            raise InputError(f"checkpoint {path} was written with memory={saved_memory}, this "
                             f"run has memory={self.cfg.memory.name}; resume with the same memory "
                             f"mode (export it with its own mode first to change modes)")
        same_layout = all(state.get(k) == v for k, v in self._layout().items())
        if self.parallel is not None:
            problem = megatron_checkpoint.reshard_problem(
                state, self._layout(), megatron_optimizer.uses_distributed_optimizer(self.cfg))
            if problem:
                raise InputError(f"checkpoint {path} cannot be resumed by this run: {problem}")
            megatron_checkpoint.load(self.model, self.optimizer, path)
            self.lr_scheduler.load_state_dict(checkpoint.load(path, "scheduler.pt"))
            self.precision.load_state_dict(checkpoint.load(path, "precision.pt"))
        elif self.ds is not None:
            self.ds.load_checkpoint(str(path), tag=CHECKPOINT_TAG)
        else:
            if self.fsdp is not None:
                load_shards(self.fsdp, self.optimizer, path / DCP_DIR)
            else:
                unwrap(self.model).load_state_dict(checkpoint.load(path, "model.pt"))
                self.optimizer.load_state_dict(checkpoint.load(path, "optimizer.pt"))
            if self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(checkpoint.load(path, "scheduler.pt"))
            self.precision.load_state_dict(checkpoint.load(path, "precision.pt"))
        ranks = checkpoint.load(path, "rng.pt")["ranks"]
        if len(ranks) == self.world_size and same_layout:
            set_rng_state(ranks[self.rank])
            if "megatron_tracker" in ranks[self.rank]:
                from megatron.core.tensor_parallel import get_cuda_rng_tracker

                get_cuda_rng_tracker().set_states(ranks[self.rank]["megatron_tracker"])
        else:
            log.warning("checkpoint %s was written by %d processes (%s), this run has %d (%s): "
                        "random streams (dropout) restart from the seed", path, len(ranks),
                        {k: state.get(k) for k in self._layout()}, self.world_size,
                        self._layout())
        log.info("resumed from %s (step %d)", path, state["step"])
        return state

    def unwrapped_model(self) -> torch.nn.Module:
        """The user's model under DeepSpeed's, DDP's, torch.compile's and ORTModule's wrappers
        (FSDP2 shards it in place and keeps its class)."""
        return self.ds.module if self.ds is not None else unwrap(self.model)

    def export_hf(self, tokenizer=None, step: int | None = None) -> Path | None:
        """One consolidated Hugging Face `save_pretrained` directory (fp32), written atomically
        at run_dir/hf_model by rank 0. Under ZeRO the weights come from checkpoint `step`."""
        model = self.unwrapped_model()
        if self.parallel is not None and self.cfg.model.arch != "megatron_gpt":
            log.warning("trainer.export_hf: converting model.arch=%s to a Hugging Face model is "
                        "not built (only megatron_gpt -> GPT-2); its weights are in the "
                        "checkpoints under %s", self.cfg.model.arch, self.checkpoint_root)
            return None
        if self.parallel is not None:  # megatron-core GPT -> GPT-2, gathered on rank 0
            model = self._megatron_as_gpt2(megatron_optimizer.unwrap(model), tokenizer)
            if model is None:
                return None
        if not hasattr(model, "save_pretrained"):
            log.info("the model is not a Hugging Face model: no hf_model export")
            return None
        state_dict = full_state_dict(self.fsdp) if self.fsdp is not None else None  # collective
        if not self.is_main_process:
            return None
        final = self.run_dir / "hf_model"
        tmp = self.run_dir / ".tmp-hf_model"
        shutil.rmtree(tmp, ignore_errors=True)
        if self.ds is not None:
            state_dict = consolidated_state_dict(str(self.checkpoint_root / f"step_{step:08d}"))
        with kv_cache_as_configured(model, self._kv_cache_was_on):
            model.save_pretrained(str(tmp), state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        log.info("exported Hugging Face model to %s", final)
        return final
