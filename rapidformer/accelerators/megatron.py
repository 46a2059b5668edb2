"""megatron-core models: tensor and pipeline parallelism (its parallel state and schedules), its
gradient buffers and optimizer (memory=zero1/zero2: the distributed optimizer), its precision
(bf16/fp16 weights with fp32 main weights) and its distributed checkpoints.

The pieces are megatron-core's, each behind one module: `parallel` (groups, schedules, the
layout-independent initialisation), `megatron_optimizer` (wrappers, optimizer, precision),
`megatron_checkpoint` (sharded checkpoints that reshard across layouts); on a CPU,
`megatron_cpu` maps its CUDA calls. graph=compile compiles each transformer layer in place
(regional: the identical layers share one compiled graph) before megatron-core's wrappers.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from rapidformer.accelerators import megatron_checkpoint, megatron_optimizer, parallel
from rapidformer.accelerators.base import NOTHING, OPTIMIZER_STATE, StateBytes, StepResult, Strategy
from rapidformer.accelerators.graph import compile_blocks
from rapidformer.accelerators.precision import compute_bytes
from rapidformer.checkpoint import store
from rapidformer.config.sizes import launched_world_size
from rapidformer.transforms.base import WHOLE_MODEL
from rapidformer.runtime.packages import installed
from rapidformer.errors import (EXIT_NOT_AVAILABLE, ConfigError, NotAvailableError, Problem,
                                RapidformerError)

log = logging.getLogger("rapidformer")


def _compile_problems(cfg, device: torch.device) -> list[str]:
    if cfg.graph.name == "compile" and device.type == "cpu":
        # megatron_cpu's dispatch mode (CUDA factories made on the CPU) is one torch.compile
        # does not trace: the layers would run eager, whatever the config says
        return ["graph=compile with a Megatron model runs on GPUs; on a CPU megatron-core runs "
                "under rapidformer's CUDA-to-CPU mapping, which torch.compile does not trace: "
                "use graph=eager"]
    return []


class MegatronStrategy(Strategy):
    name = "megatron"
    hf_recompute = False  # activation recompute is in the model's own (megatron-core) config

    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        """megatron-core models: what their layout needs, and what is not built for them."""
        m, par, p = cfg.model, cfg.parallelism, []
        tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
        tasks = {"megatron_gpt": ("causal_lm", "a GPT", "gpt_pretrain"),
                 "megatron_llama": ("causal_lm", "a Llama-family decoder", "gpt_pretrain"),
                 "megatron_bert": ("bert_pretraining", "a BERT", "bert_pretrain")}
        if m.arch not in tasks:
            p.append(f"model.arch={m.arch}: the Megatron models are {', '.join(tasks)}")
        elif cfg.task.name != tasks[m.arch][0] and not cfg.user_script:
            task, what, recipe = tasks[m.arch]
            p.append(f"model={m.name} is {what}: use task={task} (or +recipe={recipe})")
        if m.arch == "megatron_bert" and par.sequence_parallel:
            p.append("parallelism.sequence_parallel=true is built for model=megatron_gpt; "
                     "megatron_bert runs without it")
        if par.sequence_parallel and tp < 2:
            p.append(f"parallelism.sequence_parallel=true splits the sequence over "
                     f"tensor-parallel ranks: it needs a Megatron model with "
                     f"parallelism.tensor_model_parallel_size >= 2 (this run: model={m.name}, "
                     f"{tp})")
        kv = m.num_key_value_heads
        if m.arch == "megatron_llama" and tp >= 1 and kv and kv % tp:
            p.append(f"model.num_key_value_heads={kv} does not divide by "
                     f"parallelism.tensor_model_parallel_size={tp}: each tensor-parallel rank "
                     f"holds whole key/value heads")
        if m.arch == "megatron_llama" and cfg.data.reset_position_ids:
            p.append("data.reset_position_ids=true with model=megatron_llama: megatron-core's "
                     "rotary embedding numbers the positions of a sequence 0..s-1 whatever the "
                     "position ids; set data.reset_position_ids=false")
        world = launched_world_size(cfg)
        if tp >= 1 and pp >= 1 and world % (tp * pp):
            p.append(f"the world size ({world}) is not divisible by tensor x pipeline parallel "
                     f"size ({tp * pp})")
        if tp >= 1 and m.num_attention_heads is not None and m.num_attention_heads % tp:
            p.append(f"model.num_attention_heads={m.num_attention_heads} does not divide by "
                     f"parallelism.tensor_model_parallel_size={tp}")
        if pp >= 1 and m.num_layers is not None and m.num_layers % pp:
            p.append(f"model.num_layers={m.num_layers} does not divide by "
                     f"parallelism.pipeline_model_parallel_size={pp}")
        if cfg.memory.name not in ("none", "zero1", "zero2", "auto"):
            p.append(f"memory={cfg.memory.name} with a Megatron model is not supported: tensor "
                     f"and pipeline parallelism shard the weights already, and megatron-core's "
                     f"own FSDP is not wired here; use memory=zero1 or zero2 (megatron-core's "
                     f"distributed optimizer) or memory=none")
        if cfg.memory.offload_optimizer or cfg.memory.offload_params:
            p.append("memory.offload_optimizer/offload_params with a Megatron model is not built "
                     "yet; set them to false")
        if cfg.graph.name == "ort" or (cfg.graph.name == "compile" and cfg.graph.scope == "model"):
            scope = " graph.scope=model" if cfg.graph.name == "compile" else ""
            p.append(f"graph={cfg.graph.name}{scope} with a Megatron model is not built; use "
                     f"graph=compile (each transformer layer compiled) or graph=eager")
        return p

    @classmethod
    def state_bytes(cls, cfg) -> StateBytes:
        # Float16Module: bf16/fp16 weights (and residual stream); megatron-core's DDP: fp32
        # gradient buffers, whole on every data-parallel rank (memory=zero2 too); its
        # optimizer: fp32 main weights and AdamW's two moments (12 bytes), the two moments
        # alone of fp32 weights (8). memory=zero1/zero2: the distributed optimizer shards that
        # state. Per parameter of this rank's tensor/pipeline shard; nothing offloads.
        width = compute_bytes(cfg.precision)
        sharded = frozenset({OPTIMIZER_STATE}) if megatron_optimizer.uses_distributed_optimizer(
            cfg) else NOTHING
        return StateBytes(weights=width, gradients=4, optimizer=12 if width == 2 else 8,
                          sharded=sharded, residual=width)

    # buffer_bytes: none beyond the gradient buffers counted as its gradients

    @classmethod
    def environment_problems(cls, cfg, device: torch.device) -> list[Problem]:
        if not installed("megatron") or not installed("megatron.core"):
            return [Problem(f"model={cfg.model.name} needs megatron-core, which is not "
                            f"installed: pip install -e '.[megatron]' (or "
                            f"'megatron-core>=0.16,<0.17')", EXIT_NOT_AVAILABLE)]
        return [*super().environment_problems(cfg, device),
                *(Problem(text, EXIT_NOT_AVAILABLE) for text in _compile_problems(cfg, device))]

    def __init__(self, cfg, plan, rank, world_size, state_filter=WHOLE_MODEL):
        super().__init__(cfg, plan, rank, world_size, state_filter)
        if problems := _compile_problems(cfg, self.device):  # an engine built by an own loop
            raise NotAvailableError(problems[0])
        self.parallel = parallel.initialize(cfg, self.device)
        # megatron-core's optimizer owns the loss scale, unscaling, inf check and clipping
        self.precision = megatron_optimizer.MegatronPrecision(cfg.precision.dtype)

    @property
    def data_parallel(self) -> tuple[int, int]:
        return self.parallel.dp_rank, self.parallel.dp

    @property
    def counts_input(self) -> bool:
        return self.parallel.counts_input

    # --- building ---------------------------------------------------------------------------
    def count_parameters(self, model) -> int:
        return parallel.count_parameters(model)

    def wrap(self, model, optimizer, build_scheduler):
        if optimizer is not None:
            raise ConfigError(["a Megatron model trains with megatron-core's optimizer, built "
                               "from optim.* and precision.*: return None for the optimizer from "
                               "model_optimizer_lr_scheduler_provider"])
        if self.cfg.graph.name == "compile":  # each transformer layer, in place
            from rapidformer.models.megatron import prepare_for_compile

            prepare_for_compile()
            model = compile_blocks(model, self.cfg.graph, sharded=True)
        model = megatron_optimizer.wrap_model(model, self.cfg)
        optimizer = self.precision.optimizer = megatron_optimizer.build_optimizer(model, self.cfg)
        self.model, self.optimizer = model, optimizer
        self.lr_scheduler = build_scheduler(optimizer)
        return model, optimizer, self.lr_scheduler

    # --- the step ---------------------------------------------------------------------------
    def backward(self, loss, accumulation_steps: int) -> None:
        raise RapidformerError("a Megatron model's backward runs inside megatron-core's "
                               "schedule: use engine.forward_backward(...)")

    def forward_backward(self, forward_step, data_iterator, model, num_microbatches: int,
                         forward_only: bool = False, tick=lambda: None) -> list:
        """megatron-core's schedule for this layout (1F1B across pipeline stages); the
        micro-batch losses on the last stage, none elsewhere. `forward_step` returns the loss,
        or megatron-core's (output_tensor, loss_func) pair (needed with pipeline stages)."""
        def step(iterator, chunk):
            result = forward_step(iterator, chunk)
            if not forward_only:  # every pipeline stage runs this once per micro-batch
                tick()
            if isinstance(result, tuple):
                return result
            if self.parallel.pp > 1:
                raise RapidformerError(
                    "with pipeline parallelism run_forward_step must return megatron-core's "
                    "(output_tensor, loss_func) pair: each stage passes its output on, and only "
                    "the last computes the loss")
            return result, lambda loss: (loss, {"loss": loss.detach().clone()})

        t = self.cfg.trainer
        losses = parallel.forward_backward(step, data_iterator, model, num_microbatches,
                                           self.cfg.data.max_seq_length, t.micro_batch_size,
                                           forward_only)
        return [entry["loss"].detach().float() for entry in losses]

    def step(self) -> StepResult:
        """Unscale, clip over every shard, step (megatron-core's optimizer)."""
        stepped, grad_norm = self.precision.step(self.optimizer)
        if stepped:
            self.lr_scheduler.step()
        megatron_optimizer.zero_grad(self.model, self.optimizer)
        return StepResult(stepped, torch.tensor(grad_norm), self.loss_scale, self.skipped_steps)

    # --- checkpoints ------------------------------------------------------------------------
    def layout(self) -> dict:
        return {"tensor_parallel": self.parallel.tp, "pipeline_parallel": self.parallel.pp,
                "world_size": self.world_size, "precision": self.cfg.precision.dtype}

    def save(self, directory: Path) -> dict:
        megatron_checkpoint.save(self.model, self.optimizer, directory)
        return {"scheduler.pt": self.lr_scheduler.state_dict(),
                "precision.pt": self.precision.state_dict()}

    def load(self, directory: Path) -> None:
        megatron_checkpoint.load(self.model, self.optimizer, directory)
        self.lr_scheduler.load_state_dict(store.load(directory, "scheduler.pt"))
        self.precision.load_state_dict(store.load(directory, "precision.pt"))

    def resume_problem(self, saved: dict) -> str | None:
        problem = super().resume_problem(saved)
        if problem:
            return problem
        problem = megatron_checkpoint.reshard_problem(
            saved.layout, self.layout(), megatron_optimizer.uses_distributed_optimizer(self.cfg))
        return f"cannot be resumed by this run: {problem}" if problem else None

    def rng_state(self) -> dict:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return {"megatron_tracker": get_cuda_rng_tracker().get_states()}  # dropout in TP regions

    def set_rng_state(self, state: dict) -> None:
        if "megatron_tracker" in state:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            get_cuda_rng_tracker().set_states(state["megatron_tracker"])

    # --- export -----------------------------------------------------------------------------
    def unwrap(self, model):
        return megatron_optimizer.unwrap(model)

    def export_model(self, model, tokenizer, checkpoint_dir):
        """megatron-core GPT -> Hugging Face GPT-2, megatron_llama -> its Llama-family class,
        gathered on rank 0 (collective)."""
        from rapidformer.models.megatron_export import EXPORTED_ARCHS, gather_full_state, to_hf

        if self.cfg.model.arch not in EXPORTED_ARCHS:
            log.warning("trainer.export_hf: converting model.arch=%s to a Hugging Face model is "
                        "not built (only %s); its weights are in the checkpoints",
                        self.cfg.model.arch, ", ".join(f"{arch} -> {hf}" for arch, hf
                                                        in EXPORTED_ARCHS.items()))
            return None
        full = gather_full_state(self.unwrap(model), self.cfg.model.num_layers)
        if full is None:
            return None
        eod = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        return to_hf(full, self.cfg, eod), None

    @classmethod
    def read_weights(cls, checkpoint_dir: Path) -> dict:
        raise NotAvailableError(
            f"export of a Megatron checkpoint ({checkpoint_dir}) is not built: it needs the "
            f"run's tensor/pipeline layout; the run itself writes "
            f"{Path(checkpoint_dir).parent.parent}/hf_model at its end (trainer.export_hf=true, "
            f"megatron_gpt -> GPT-2, megatron_llama -> its Llama-family class)")
