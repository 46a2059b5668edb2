"""Keys that only some options read: "group.key" -> (the key whose value decides, the values
under which the key is read). An override of one of these that changes it while the options
picked ignore it is refused (compose.ignored_override_problems): a setting that would be
silently dropped. Every key not here is read whichever options are picked. A user_script may
read any key, so nothing is refused with one. Model shape keys stay out: the seed's command
lines give them with a pretrained model, which keeps its checkpoint's shape
(docs/seed_flags.md)."""
from __future__ import annotations

from rapidformer.config.schema import PRETRAINING_TASKS

FINE_TUNING_TASKS = ("sequence_classification", "token_classification", "question_answering",
                     "masked_lm", "seq2seq_lm")
USED_ONLY_WITH: dict[str, tuple[str, tuple[str, ...]]] = {
    # the planner and the export read num_labels for token classification too
    "task.num_labels": ("task.name", ("sequence_classification", "token_classification")),
    "task.label_all_tokens": ("task.name", ("token_classification",)),
    "task.doc_stride": ("task.name", ("question_answering",)),
    "task.max_answer_length": ("task.name", ("question_answering",)),
    "task.n_best_size": ("task.name", ("question_answering",)),
    "task.whole_word_masking": ("task.name", ("masked_lm",)),
    "task.max_target_length": ("task.name", ("seq2seq_lm",)),
    "task.num_beams": ("task.name", ("seq2seq_lm",)),
    "task.source_prefix": ("task.name", ("seq2seq_lm",)),
    "task.binary_head": ("task.name", ("bert_pretraining",)),
    "model.name_or_path": ("model.source", ("pretrained",)),
    "model.embedding_rows": ("model.source", ("config",)),
    "model.init_dtype": ("model.source", ("config",)),
    "data.subset": ("data.source", ("hub",)),
    "data.format": ("data.source", ("local", "synthetic")),
    "data.quoting": ("data.source", ("local", "synthetic")),
    "data.train_file": ("data.source", ("local", "synthetic")),
    "data.validation_file": ("data.source", ("local", "synthetic")),
    "data.test_file": ("data.source", ("local", "synthetic")),
    "data.synthetic_train_size": ("data.source", ("synthetic",)),
    "data.synthetic_eval_size": ("data.source", ("synthetic",)),
    "data.synthetic_seed": ("data.source", ("synthetic",)),
    "data.synthetic_lengths": ("task.name", ("sft",)),
    "data.impl": ("data.source", ("megatron",)),
    "data.split": ("data.source", ("megatron",)),
    "data.mmap_warmup": ("data.source", ("megatron",)),
    "data.text_a_column": ("task.name", ("sequence_classification",)),
    "data.text_b_column": ("task.name", ("sequence_classification",)),
    "data.label_column": ("task.name", ("sequence_classification",)),
    "data.tokens_column": ("task.name", ("token_classification",)),
    "data.tags_column": ("task.name", ("token_classification",)),
    "data.question_column": ("task.name", ("question_answering",)),
    "data.context_column": ("task.name", ("question_answering",)),
    "data.answers_column": ("task.name", ("question_answering",)),
    "data.text_column": ("task.name", ("masked_lm",)),
    "data.document_column": ("task.name", ("seq2seq_lm",)),
    "data.summary_column": ("task.name", ("seq2seq_lm",)),
    "data.group_by_length": ("task.name", FINE_TUNING_TASKS),
    "data.mask_prob": ("task.name", ("masked_lm", "bert_pretraining")),
    "data.short_seq_prob": ("task.name", ("bert_pretraining",)),
    "data.eod_mask_loss": ("task.name", ("causal_lm",)),
    "data.reset_position_ids": ("task.name", ("causal_lm",)),
    "precision.initial_scale": ("precision.dtype", ("fp16",)),
    "precision.growth_interval": ("precision.dtype", ("fp16",)),
    "precision.fp8_scaling": ("precision.dtype", ("bf16",)),
    "kernels.fused_linear_cross_entropy": ("kernels.name", ("liger", "auto")),
    "kernels.rms_norm": ("kernels.name", ("liger", "auto")),
    "kernels.swiglu": ("kernels.name", ("liger", "auto")),
    "kernels.rope": ("kernels.name", ("liger", "auto")),
    # peft=none reads none of them, whatever value an override gives (the default's included)
    "peft.r": ("peft.name", ("lora", "qlora")),
    "peft.alpha": ("peft.name", ("lora", "qlora")),
    "peft.dropout": ("peft.name", ("lora", "qlora")),
    "peft.target_modules": ("peft.name", ("lora", "qlora")),
    "peft.modules_to_save": ("peft.name", ("lora", "qlora")),
    "peft.quant_type": ("peft.name", ("qlora",)),
    "peft.double_quant": ("peft.name", ("qlora",)),
    "peft.base_dtype": ("peft.name", ("lora", "qlora")),
    "peft.fused": ("peft.name", ("lora", "qlora")),
    # memory=auto sets both from the mode it picks
    "memory.offload_optimizer": ("memory.name", ("zero1", "zero2", "zero3", "fsdp")),
    "memory.offload_params": ("memory.name", ("zero3", "fsdp")),
    "graph.scope": ("graph.name", ("compile",)),
    "graph.mode": ("graph.name", ("compile",)),
    "graph.fullgraph": ("graph.name", ("compile",)),
    "graph.dynamic": ("graph.name", ("compile",)),
    "graph.options": ("graph.name", ("compile",)),
    "scheduler.min_lr": ("scheduler.name", ("linear", "cosine")),
    "scheduler.decay_iters": ("scheduler.name", ("linear", "cosine")),
    "trainer.eval_iters": ("task.name", PRETRAINING_TASKS),
    # a PreTrainer evaluates trainer.eval_iters global batches in training micro-batches
    "trainer.eval_micro_batch_size": ("task.name", (*FINE_TUNING_TASKS, "sft")),
    "logger.project": ("logger.name", ("wandb", "mlflow")),
    "logger.run_name": ("logger.name", ("wandb", "mlflow")),
    "logger.mode": ("logger.name", ("wandb",)),
    "logger.tracking_uri": ("logger.name", ("mlflow",)),
    "accelerate.budget_s": ("accelerate.name", ("auto",)),
    "accelerate.max_fraction": ("accelerate.name", ("auto",)),
    "accelerate.max_candidates": ("accelerate.name", ("auto",)),
    "accelerate.steps": ("accelerate.name", ("auto",)),
    "accelerate.warmup_steps": ("accelerate.name", ("auto",)),
    "accelerate.candidate_timeout_s": ("accelerate.name", ("auto",)),
    "accelerate.loss_tolerance": ("accelerate.name", ("auto",)),
    "accelerate.load_tolerance": ("accelerate.name", ("auto",)),
    "accelerate.axes": ("accelerate.name", ("auto",)),
    "accelerate.cache_dir": ("accelerate.name", ("auto",)),
    "accelerate.cache": ("accelerate.name", ("auto",)),
    "accelerate.extra_candidates": ("accelerate.name", ("auto",)),
}


# torch.compile's modes in every torch this project supports; another name is looked up in the
