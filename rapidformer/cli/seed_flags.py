"""The original Rapidformer's command-line flags, each with the Hydra override it stands for
(docs/seed_flags.md has the table): what the console script translates and what
`rapidformer --help` shows."""
from __future__ import annotations

# seed flag -> override key, for flags that take one value and map one to one
VALUE_FLAGS = {
    "--epochs": "trainer.epochs",
    "--train-iters": "trainer.train_iters",
    "--micro-batch-size": "trainer.micro_batch_size",
    "--global-batch-size": "trainer.global_batch_size",
    "--lr": "trainer.lr",
    "--weight-decay": "trainer.weight_decay",
    "--clip-grad": "trainer.clip_grad",
    "--seed": "trainer.seed",
    "--log-interval": "trainer.log_interval",
    "--eval-interval": "trainer.eval_interval",
    "--save-interval": "trainer.save_interval",
    "--exit-interval": "trainer.exit_interval",
    "--save": "trainer.output_dir",
    "--lr-warmup-iters": "scheduler.warmup_iters",
    "--lr-warmup-fraction": "scheduler.warmup_fraction",
    "--min-lr": "scheduler.min_lr",
    "--lr-decay-iters": "scheduler.decay_iters",
    "--seq-length": "data.max_seq_length",
    "--num-labels": "task.num_labels",
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--tensor-model-parallel-size": "parallelism.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallelism.pipeline_model_parallel_size",
    "--user-script": "user_script",
    "--eval-iters": "trainer.eval_iters",
    "--data-impl": "data.impl",
    "--split": "data.split",
    "--mask-prob": "data.mask_prob",
    "--short-seq-prob": "data.short_seq_prob",
    "--merge-file": "model.merge_file",
    # torchrun's names; the seed's scripts set these through the environment instead
    # (CUDA_VISIBLE_DEVICES, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), which works too
    "--nproc-per-node": "launcher.nproc_per_node",
    "--nnodes": "launcher.nnodes",
    "--node-rank": "launcher.node_rank",
    "--master-addr": "launcher.master_addr",
    "--master-port": "launcher.master_port",
}
# seed switch -> the override it stands for
SWITCHES = {
    "--mixed-precision": "precision=fp16",
    "--fp16": "precision=fp16",
    "--bf16": "precision=bf16",
    "--onnx-runtime-training": "graph=ort",
    "--zero-1-memory-optimization": "memory=zero1",
    "--zero-2-memory-optimization": "memory=zero2",
    "--zero-3-memory-optimization": "memory=zero3",
    "--fsdp-memory-optimization": "memory=fsdp",
    "--mmap-warmup": "data.mmap_warmup=true",
    "--eod-mask-loss": "data.eod_mask_loss=true",
    "--reset-position-ids": "data.reset_position_ids=true",
    "--checkpoint-activations": "trainer.checkpoint_activations=true",
    "--sequence-parallel": "parallelism.sequence_parallel=true",
    # Megatron-LM's name for its distributed optimizer (memory=zero1 on Megatron models)
    "--use-distributed-optimizer": "memory=zero1",
    # Megatron-LM's: BERT pretraining without next-sentence prediction (document-level data)
    "--bert-no-binary-head": "task.binary_head=false",
}
# seed flags whose feature arrives later: refused by name, with what it needs
NOT_YET: dict[str, str] = {}
# the seed's task names -> task options; `pretraining` is the seed's BERT pretraining, and its
# docs spell causal LM both ways
TASKS = {"sequence_classification": "sequence_classification",
         "token_classification": "token_classification",
         "question_answering": "question_answering", "masked_lm": "masked_lm",
         "seq2seq_lm": "seq2seq_lm",
         "pretraining": "bert_pretraining", "bert_pretraining": "bert_pretraining",
         "causal_lm": "causal_lm", "casual_lm": "causal_lm"}
# tokenizer type -> lowercasing (None: the tokenizer's own)
TOKENIZER_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False,
                   "GPT2BPETokenizer": None, "HuggingFaceTokenizer": None}
ALL_FLAGS = sorted({*VALUE_FLAGS, *SWITCHES, *NOT_YET, "--task", "--pretrained-model-name-or-path",
                    "--data-path", "--dataset-path", "--data-name", "--dataset-name",
                    "--lr-decay-style", "--tokenizer-type", "--vocab-file", "--vocab",
                    "--print-hydra"})
