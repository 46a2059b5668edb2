"""A resolved config under the seed's argument names (`--micro-batch-size` -> micro_batch_size),
what `get_args()` returns."""
from __future__ import annotations

from rapidformer.config.schema import RunConfig
from rapidformer.config.sizes import data_parallel_size, launched_world_size


class Args:
    """Attribute access under the seed's flag names (`--micro-batch-size` -> micro_batch_size)."""

    def __init__(self, cfg: RunConfig, run_dir: str):
        t, d, m, s, p = cfg.trainer, cfg.data, cfg.model, cfg.scheduler, cfg.parallelism
        self.cfg = cfg
        self.task = cfg.task.name
        self.user_script = cfg.user_script
        self.pretrained_model_name_or_path = m.name_or_path
        self.load = m.name_or_path
        self.num_layers = m.num_layers
        self.hidden_size = m.hidden_size
        self.num_attention_heads = m.num_attention_heads
        self.max_position_embeddings = m.max_position_embeddings
        self.data_path = self.dataset_path = d.path
        self.data_impl = d.impl
        self.split = d.split
        self.mask_prob = d.mask_prob
        self.short_seq_prob = d.short_seq_prob
        self.mmap_warmup = d.mmap_warmup
        self.eod_mask_loss = d.eod_mask_loss
        self.reset_position_ids = d.reset_position_ids
        self.reset_attention_mask = False  # Hugging Face models build their own causal mask
        self.tokenizer_type = m.tokenizer_type
        self.vocab_file = m.tokenizer
        self.merge_file = m.merge_file
        self.eval_iters = t.eval_iters
        self.checkpoint_activations = t.checkpoint_activations
        self.data_name = self.dataset_name = d.subset
        self.seq_length = self.max_seq_length = d.max_seq_length
        self.num_labels = cfg.task.num_labels
        self.epochs = t.epochs
        self.train_iters = t.train_iters
        self.micro_batch_size = t.micro_batch_size
        self.global_batch_size = t.global_batch_size
        self.lr = t.lr
        self.weight_decay = t.weight_decay
        self.clip_grad = t.clip_grad
        self.seed = t.seed
        self.log_interval = t.log_interval
        self.eval_interval = t.eval_interval
        self.save_interval = t.save_interval
        self.exit_interval = t.exit_interval
        self.save = run_dir
        self.lr_decay_style = s.name
        self.lr_warmup_iters = s.warmup_iters
        self.lr_warmup_fraction = s.warmup_fraction
        self.min_lr = s.min_lr
        self.lr_decay_iters = s.decay_iters
        self.fp16 = cfg.precision.dtype == "fp16"
        self.bf16 = cfg.precision.dtype == "bf16"
        self.mixed_precision = cfg.precision.dtype != "fp32"
        self.zero_1_memory_optimization = cfg.memory.name == "zero1"
        self.zero_2_memory_optimization = cfg.memory.name == "zero2"
        self.zero_3_memory_optimization = cfg.memory.name == "zero3"
        self.fsdp_memory_optimization = cfg.memory.name == "fsdp"
        self.onnx_runtime_training = cfg.graph.name == "ort"
        self.tensor_model_parallel_size = p.tensor_model_parallel_size
        self.pipeline_model_parallel_size = p.pipeline_model_parallel_size
        self.world_size = launched_world_size(cfg)
        self.data_parallel_size = data_parallel_size(cfg)

    def __getattr__(self, name: str):
        # only called for names that are not set above
        raise AttributeError(
            f"get_args() has no '{name}'; the seed-named arguments available are: "
            f"{', '.join(sorted(k for k in vars(self) if k != 'cfg'))}; the whole typed config "
            f"is get_args().cfg")
