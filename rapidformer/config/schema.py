"""Typed schemas: one dataclass per config group, one field per key.

The YAML files under the repository's `conf/` and `recipes/` are the option values; these
classes are the contract.
`typed.py` walks a composed config against them, so a key that is not a field here is an error
(with the closest valid name), and so is a value of the wrong type; the valid range of every
number is bounds.BOUNDS, and the keys only some options read are read_keys.USED_ONLY_WITH.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union, Literal, Optional


# the tasks a PreTrainer runs (iterations over Megatron mmap data); the others fine-tune
PRETRAINING_TASKS = ("bert_pretraining", "causal_lm")


@dataclass
class TaskConfig:
    # sequence_classification: Finetuner (epochs); bert_pretraining (MLM + next-sentence
    # prediction) and causal_lm (GPT): PreTrainer (iterations) on Megatron mmap data
    name: Literal["sequence_classification", "token_classification", "question_answering",
                  "masked_lm", "seq2seq_lm", "bert_pretraining", "causal_lm", "sft"] = \
        "sequence_classification"
    # null: the number of distinct labels in the training split
    num_labels: Optional[int] = None
    # token_classification: every sub-token of a word gets its label (else the first only)
    label_all_tokens: bool = False
    # question_answering: a context over data.max_seq_length is read in windows overlapping by
    # doc_stride tokens; answers of at most max_answer_length, from the n_best_size best ends
    doc_stride: int = 32
    max_answer_length: int = 30
    n_best_size: int = 20
    # masked_lm: mask whole words (all their sub-tokens together) instead of single tokens;
    # data.mask_prob is the share of tokens masked, drawn anew every time a batch is made
    whole_word_masking: bool = False
    # masked_lm, bert_pretraining: BERT's MLM head on the masked positions only (masked; the same
    # loss, as NVIDIA's and MLPerf's BERT) or on every position (all); Hugging Face BERT models
    mlm_head: Literal["masked", "all"] = "masked"
    # bert_pretraining: next-sentence prediction beside masked LM (Megatron's binary head), on
    # sentence-level data (preprocessed with --split-sentences); false trains masked LM alone,
    # which document-level data (one sequence per document) needs (the seed's
    # --bert-no-binary-head)
    binary_head: bool = True
    # seq2seq_lm: target length (labels longer are cut), beams and new tokens at evaluation, and
    # a text put before every source (T5's "summarize: ")
    max_target_length: int = 64
    num_beams: int = 1
    source_prefix: str = ""
    # sft (supervised fine-tuning of a causal LM on chat or prompt/response rows): the tokens
    # the loss is on, the assistant's (response) or every token of the conversation (all)
    loss_on: Literal["response", "all"] = "response"
    # sft: the output layer at the labelled positions only, in chunks (the same loss, no logits
    # kept; transforms/labelled_head.py) or on every position by the model's forward (all)
    lm_head: Literal["labelled", "all"] = "labelled"
    # sft: at each evaluation, answers generated (greedy) for the first N validation prompts,
    # written to RUN_DIR/generations.jsonl; 0 turns it off
    sample_generations: int = 4
    max_new_tokens: int = 64

    @property
    def is_pretraining(self) -> bool:
        return self.name in PRETRAINING_TASKS


# the architectures of encoder-decoder models (task=seq2seq_lm)
ENCODER_DECODER_ARCHS = ("t5",)


@dataclass
class ModelConfig:
    name: str = "bert_tiny"
    # pretrained: weights from a hub name or a local directory; config: random init from the
    # architecture fields below (no download, what the tests and the quickstart use)
    source: Literal["pretrained", "config"] = "config"
    name_or_path: Optional[str] = None
    arch: str = "bert"
    # the shape of a config-built model. With source=pretrained the model's own config.json
    # decides: null there, and a value that differs from the model's is refused (the seed's
    # scripts pass --num-layers etc. beside a pretrained name; an equal value is accepted)
    hidden_size: Optional[int] = 64
    num_layers: Optional[int] = 2
    num_attention_heads: Optional[int] = 2
    intermediate_size: Optional[int] = 256
    max_position_embeddings: Optional[int] = 128
    # decoders with grouped-query attention (arch llama): key/value heads; null: one per
    # attention head (multi-head attention)
    num_key_value_heads: Optional[int] = None
    # rotary position embeddings' base (arch llama)
    rope_theta: float = 10000.0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # a config-built model's random weights: their std, and their values (bf16: rounded as a
    # bf16 checkpoint's, which peft.base_dtype=auto holds in bf16; fp32 masters train either way)
    initializer_range: float = 0.02
    init_dtype: Literal["fp32", "bf16"] = "fp32"
    # config-built models: the vocabulary size of the WordPiece tokenizer trained on the data
    vocab_size: Optional[int] = 2000
    # config-built models: the embeddings' and output layer's rows; null: one per token; more
    # keeps rows no token uses, as Llama 3's 128256 beside a smaller tokenizer
    embedding_rows: Optional[int] = None
    # null: the pretrained model's own tokenizer, or one trained on the training split for a
    # config-built model; else a tokenizer directory or a WordPiece vocab.txt
    tokenizer: Optional[str] = None
    lowercase: bool = True
    # pretraining: the tokenizer the Megatron data was made with (preprocess_data's
    # --tokenizer-type); model.tokenizer its vocab file (or dir), merge_file GPT-2's merges
    tokenizer_type: Optional[Literal["BertWordPieceLowerCase", "BertWordPieceCase",
                                     "GPT2BPETokenizer", "HuggingFaceTokenizer"]] = None
    merge_file: Optional[str] = None
    # sdpa (torch's scaled_dot_product_attention) or eager: transformers' attention for Hugging
    # Face models; for megatron_* the local layers' core attention (eager: megatron-core's own)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # megatron_gpt / megatron_llama: start from a Hugging Face checkpoint directory of the
    # matching architecture (GPT-2; Llama, Mistral, Qwen2) instead of random weights, cut to
    # this rank's tensor/pipeline shard
    init_from_hf: Optional[str] = None

    @property
    def is_megatron(self) -> bool:
        """A megatron-core model (model=megatron_*): its own layers, optimizer and schedules,
        trained by the Megatron strategy; every other arch is a Hugging Face (or own) model."""
        return self.arch.startswith("megatron")


@dataclass
class DataConfig:
    name: str = "synthetic_pairs"
    # hub: datasets.load_dataset(path, subset); local: files under `path`; synthetic: the
    # project's generated paraphrase pairs, written to `path` (or <run dir>/data); megatron:
    # .bin/.idx files of rapidformer-preprocess-data, `path` their prefix (or Megatron's
    # weighted blend "0.7 prefix_a 0.3 prefix_b")
    source: Literal["hub", "local", "synthetic", "megatron"] = "synthetic"
    path: Optional[str] = None
    subset: Optional[str] = None
    format: Literal["auto", "csv", "tsv", "json", "jsonl", "parquet"] = "auto"
    # quotes in csv and tsv files: auto (a tsv has none: `"` is text and every line is a row, as
    # in GLUE and MSR files; a csv quotes as RFC 4180 does), csv (a field in "..." may hold the
    # delimiter and line breaks, "" inside it is a quote: tsv files written by pandas or Python's
    # csv module) or none (`"` is text in csv files too); docs/data.md, "Fine-tuning files"
    quoting: Literal["auto", "csv", "none"] = "auto"
    # file names relative to `path`; null: found by name (train.*, validation.*/dev.*, test.*)
    train_file: Optional[str] = None
    validation_file: Optional[str] = None
    test_file: Optional[str] = None
    text_a_column: str = "sentence1"
    # null for single-sentence classification
    text_b_column: Optional[str] = "sentence2"
    label_column: str = "label"
    # token_classification: a list of words and a list of their tags (names or ids) per row
    tokens_column: str = "tokens"
    tags_column: str = "ner_tags"
    # question_answering (SQuAD's layout: answers = {"text": [...], "answer_start": [...]})
    question_column: str = "question"
    context_column: str = "context"
    answers_column: str = "answers"
    # masked_lm: one text per row
    text_column: str = "text"
    # seq2seq_lm: source and target texts
    document_column: str = "document"
    summary_column: str = "summary"
    # sft: a conversation per row (a list of {role, content}), or a prompt and a response
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    response_column: str = "response"
    # sft: the Jinja chat template (its text, or a file holding it) for a tokenizer that has
    # none; null: the tokenizer's own (prompt/response rows without any template are joined)
    chat_template: Optional[str] = None
    # sft: several examples per row up to max_seq_length, each with its own positions and no
    # attention across examples (the loss equals the unpacked run's)
    packing: bool = False
    # at least 8 (the special tokens of a sample and some text of each part; bounds.py's
    # MIN_SEQ_LENGTH), at most model.max_position_embeddings for a config-built model
    max_seq_length: int = 128
    # fine-tuning: each micro-batch takes examples of similar length (within windows of 16
    # global batches), so less compute goes to padding. Off by default: on the quickstart it cut
    # padding from 20 % to 2 % but final accuracy from 0.985 to 0.875 (length and label are
    # correlated there, and a step of one micro-batch then sees one length; docs/benchmarks.md)
    group_by_length: bool = False
    # the length a fine-tuning batch is padded to: longest (its longest row), max
    # (max_seq_length), N (the next multiple of N), or a list of bucket lengths (the smallest that
    # fits; max_seq_length is the last). auto: longest in eager mode; with graph=compile the next
    # multiple of 16, so that a compiled model meets few shapes (rapidformer/data/lengths.py);
    # with trainer.unpad the packed row's tokens are rounded up to a multiple instead
    pad_to: Union[int, Literal["auto", "longest", "max"], list[int]] = "auto"
    num_workers: int = 0
    # --- Megatron pretraining data (data.source=megatron) ---
    # the seed's --data-impl; megatron-core reads mmap only ("infer" is accepted as mmap)
    impl: str = "mmap"
    # train,valid,test weights over documents, Megatron's --split (e.g. 980,20 or 969,30,1)
    split: str = "969,30,1"
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    # read the .bin files once at start so their pages are cached (the seed's --mmap-warmup)
    mmap_warmup: bool = False
    # GPT: no loss on the token after an end of document; positions restart at each document
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    # synthetic data only
    synthetic_train_size: int = 4000
    synthetic_eval_size: int = 400
    synthetic_seed: int = 1234
    # task=sft's generated chats: short (a few dozen words, for tests and quick runs) or
    # instruction (the lengths of real instruction data: log-normal, mean about 250 words, up to
    # 4,096; data/synthetic_tasks.py says where the distribution comes from)
    synthetic_lengths: Literal["short", "instruction"] = "short"


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # fp16 dynamic loss scaling (torch.amp.GradScaler)
    initial_scale: float = 65536.0
    growth_interval: int = 2000
    # precision=fp8: torchao's float8 matmuls in the linear layers, bf16 autocast for the rest
    # (dtype bf16). How each float8 tensor is scaled: tensorwise (one scale a tensor: the
    # fastest), rowwise (one a row: more accurate), rowwise_with_gw_hp (rowwise, the weight
    # gradient's matmul in bf16)
    fp8_scaling: Optional[Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]] = None
    # leave in bf16 the linear layers too small to gain from float8 (torchao's measured sizes);
    # the output head is never converted
    fp8_skip_small: bool = True
    # memory=fsdp with tensorwise scaling: all-gather the sharded weights in float8 (half the
    # bytes of bf16)
    fp8_all_gather: bool = False
    # float8 matmuls emulated in higher precision: for checking the numerics on a CPU or a GPU
    # without float8; never faster
    fp8_emulate: bool = False


@dataclass
class MemoryConfig:
    # auto: the fastest of the others whose estimated memory fits the GPU (rapidformer plan)
    name: Literal["none", "zero1", "zero2", "zero3", "fsdp", "auto"] = "none"
    offload_optimizer: bool = False
    offload_params: bool = False
    # the GPU memory that memory=auto and the dry-run plan fit into; null: the detected GPU's
    device_memory_gb: Optional[float] = None


@dataclass
class ParallelismConfig:
    name: str = "dp"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Megatron's --sequence-parallel: with TP > 1, layer norms and dropout work on 1/TP of the
    # sequence on each rank (less activation memory; the same losses)
    sequence_parallel: bool = False
    # torch DDP (Hugging Face models): gradient bucket size, and an optional communication hook
    # that all-reduces gradients in bf16 (half the bytes; gradients are rounded to bf16 before
    # averaging, as with Megatron's grad_reduce_in_fp32=false)
    ddp_bucket_cap_mb: int = 25
    ddp_comm_hook: Literal["none", "bf16_compress"] = "none"


@dataclass
class GraphConfig:
    name: Literal["eager", "compile", "ort"] = "eager"
    # compile: the whole model (DDP only; fuses embeddings, head and loss too) or each
    # transformer block (regional: compile time independent of depth; works with FSDP2 and
    # ZeRO); auto = model unless FSDP2/ZeRO shard it
    scope: Literal["auto", "blocks", "model"] = "auto"
    mode: Optional[str] = None
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    # inductor options passed to torch.compile (instead of a mode; torch takes one or the
    # other), e.g. {coordinate_descent_tuning: true}
    options: dict = field(default_factory=dict)


@dataclass
class OptimConfig:
    name: Literal["adamw"] = "adamw"
    # AdamW's decay rates, each in [0, 1), and its eps (above 0)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # auto: torch's fused AdamW kernel where the device has one
    fused: Literal["auto", "on", "off"] = "auto"


@dataclass
class SchedulerConfig:
    name: Literal["constant", "linear", "cosine"] = "linear"
    warmup_iters: int = 0
    # a fraction of the total iterations; overrides warmup_iters when set
    warmup_fraction: Optional[float] = None
    min_lr: float = 0.0
    # null: decay until the last iteration
    decay_iters: Optional[int] = None


@dataclass
class TrainerConfig:
    # exactly one of epochs / train_iters decides the length; train_iters wins when both are set
    epochs: Optional[int] = 3
    train_iters: Optional[int] = None
    micro_batch_size: int = 16
    # samples per optimizer step over all ranks; a multiple of micro batch x data-parallel size
    # (the rest is gradient accumulation). null: micro batch x data-parallel size
    global_batch_size: Optional[int] = None
    eval_micro_batch_size: Optional[int] = None  # fine-tuning's evaluation; null: micro_batch_size
    lr: float = 2e-5
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still computed and logged)
    seed: int = 42
    deterministic: bool = False
    # TF32 tensor cores for fp32 matmuls on GPUs. null: on with bf16/fp16 (the few fp32
    # matmuls outside autocast lose nothing that matters), off with fp32 (which then means fp32)
    tf32: Optional[bool] = None
    # recompute each layer in the backward (--checkpoint-activations): less memory, +1/3 compute
    checkpoint_activations: bool = False
    # with checkpoint_activations on a GPU: the inputs it keeps in pinned host memory
    offload_activations: bool = False
    # Megatron models: full (every layer) or selective (attention's scores and softmax only)
    recompute_granularity: Literal["full", "selective"] = "full"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # train HF BERT encoders on the real tokens only: a batch's sequences packed into one row,
    # attention per sequence (flash variable-length on GPUs; no attention dropout there), the
    # padded path's loss (rapidformer/models/unpadded.py). Evaluation stays padded
    unpad: bool = False
    log_interval: int = 10
    # [first, last]: record these training steps with torch.profiler: a Chrome/Perfetto trace
    # and the device's time by kernel kind, with its share of the steps' wall time, in
    # <run dir>/profile/ (observability/step_profiler.py). null: no profile
    profile_steps: Optional[list[int]] = None
    # null: evaluate at the end of every epoch (PreTrainer: at the end of training)
    eval_interval: Optional[int] = None
    # PreTrainer: iterations (global batches) per evaluation, Megatron's --eval-iters
    eval_iters: int = 10
    # null: save at the end of every epoch (PreTrainer: at the end of training)
    save_interval: Optional[int] = None
    # stop (after saving a checkpoint) once the iteration is a multiple of this (Megatron's name)
    exit_interval: Optional[int] = None
    # complete checkpoints kept (older ones are removed); 0 keeps every one
    keep_last: int = 2
    # compare every evaluation by this metric (a key the evaluation logs, e.g.
    # validation/accuracy, validation/f1, validation/loss; the PreTrainer's validation/loss or
    # validation/ppl): the best one's checkpoint is kept beside the keep_last ones (named by
    # checkpoints/best.json) and trainer.export_hf exports it. null: the last is exported
    best_metric: Optional[str] = None
    # max or min: whether higher or lower best_metric is better. null: min for metric names
    # ending in loss, perplexity or ppl, max for every other (accuracy, f1, exact_match, rougeL)
    best_mode: Optional[Literal["max", "min"]] = None
    # stop (normally: last checkpoint, export of the best) after this many evaluations in a row
    # that do not improve best_metric by more than early_stopping_min_delta (null: never)
    early_stopping_patience: Optional[int] = None
    # the least change of best_metric that counts as an improvement for early stopping
    early_stopping_min_delta: float = 0.0
    # stop once the loss is NaN/Inf for this many steps in a row (null: never); no checkpoint
    # is written from a step whose loss is not finite
    max_nonfinite_steps: Optional[int] = 5
    # warn (and count grad_norm_spikes in the logs) when a log window's largest gradient norm is
    # this many times the median of the previous windows' (null: never)
    grad_norm_spike_factor: Optional[float] = 10.0
    # false: no checkpoint when training ends (benchmarks: a 1B model with its optimizer state
    # writes about 17 GB); interval and exit checkpoints are still written
    save_last: bool = True
    output_dir: str = "outputs/run"
    # null: start fresh; auto: newest complete checkpoint in output_dir; else a checkpoint dir
    resume: Optional[str] = None
    # a fresh run (resume null) into the directory of an earlier run that has checkpoints:
    # false refuses it; true removes that run's checkpoints, metrics and export first
    overwrite: bool = False
    export_hf: bool = True
    progress_bar: bool = True
    tensorboard: bool = True
    # build the model on the meta device, print its parameters and the memory plan of every
    # memory mode, and stop (no run directory, no data read)
    dry_run: bool = False


@dataclass
class LauncherConfig:
    name: str = "local"
    # processes on this node. auto: one per visible GPU (CUDA_VISIBLE_DEVICES honoured), one
    # on a CPU or with trainer.device=cpu; a number also starts that many CPU processes (gloo)
    nproc_per_node: Union[int, Literal["auto"]] = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "localhost"
    master_port: int = 6010
    # seconds to wait for every node at start, and for any collective (a dead or hung rank
    # ends the job after this long instead of hanging)
    rendezvous_timeout: int = 300
    collective_timeout: int = 600
    # elastic restarts: after a worker fails, start all workers again (up to this many times);
    # they resume from the newest complete checkpoint of the run
    max_restarts: int = 0


@dataclass
class KernelsConfig:
    # liger: liger-kernel's Triton kernels (Llama, Mistral, Qwen, ...) on CUDA GPUs; none: the
    # model's own layers; auto: liger where it measured faster (transforms/liger.py), else none
    name: Literal["none", "liger", "auto"] = "auto"
    # causal LM training: the output head's matmul and the cross-entropy in one kernel, no logits
    fused_linear_cross_entropy: bool = True
    rms_norm: bool = True
    swiglu: bool = True
    rope: bool = True
    fused_projections: bool = False  # one matmul for q|k|v, one for gate|up (any name)


@dataclass
class PeftConfig:
    # lora: low-rank adapters on the target modules, the base weights frozen (peft); qlora: the
    # same over 4-bit base weights (bitsandbytes, CUDA GPUs); none: every weight trains
    name: Literal["none", "lora", "qlora"] = "none"
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    # the Linear layers that get adapters (module-name suffixes); null: the attention and MLP
    # projections of the model's architecture
    target_modules: Optional[list[str]] = None
    # modules trained in full beside the adapters (e.g. a new classifier head); null: the task
    # head of a model peft knows the task of
    modules_to_save: Optional[list[str]] = None
    # qlora: the 4-bit data type of the base weights, and a second quantization of their scales
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    # the dtype the frozen base is held in under precision=bf16: auto is bf16 where no value
    # changes (a bf16 checkpoint's weights; qlora's base) and fp32 otherwise; bf16 also rounds
    # an fp32 base (the export then holds the rounded base); fp32 always
    base_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # each adapted layer as one function saving its input once (transforms/lora_fused.py)
    fused: bool = False


@dataclass
class LoggerConfig:
    # where metrics go besides metrics.jsonl and TensorBoard (trainer.tensorboard)
    name: Literal["tensorboard", "wandb", "mlflow"] = "tensorboard"
    # W&B project / MLflow experiment
    project: str = "rapidformer"
    # null: the run directory's name
    run_name: Optional[str] = None
    # W&B: online, or offline (files under the run directory; `wandb sync` uploads them);
    # null: W&B's own choice (the WANDB_MODE environment variable, else online)
    mode: Optional[Literal["online", "offline"]] = None
    # MLflow: null writes a local SQLite store, <run dir>/mlflow.db
    tracking_uri: Optional[str] = None


# what accelerate=auto may vary (rapidformer/tuning/space.py)
TUNING_AXES = ("precision", "graph", "sequences", "kernels", "micro_batch_size",
               "checkpoint_activations", "adapters")


@dataclass
class AccelerateConfig:
    # auto: a measured search (docs/tuning.md) picks the fastest settings that train alike
    name: Literal["none", "auto"] = "none"
    # the search's limit (s), and its most share of the run's estimated length (may pass 1)
    budget_s: float = 300.0
    max_fraction: float = 0.1
    # candidates measured besides the reference (the config as given), steps each, warmup_steps
    # (compile, graph capture) timed apart; a child past the timeout is stopped
    max_candidates: int = 6
    steps: int = 8
    warmup_steps: int = 3
    candidate_timeout_s: float = 180.0
    # a candidate's mean loss over its steps may differ from the reference's by this share;
    # the config's two measurements' rates, beyond their spreads, before the load is unsteady
    loss_tolerance: float = 0.1
    load_tolerance: float = 0.2
    # the axes searched; the others keep the config's values
    axes: list[str] = field(default_factory=lambda: list(TUNING_AXES))
    # results by model, data, hardware, versions (null: $RAPIDFORMER_TUNING_CACHE, ~/.cache/..)
    cache_dir: Optional[str] = None
    cache: bool = True
    # hand-picked candidates, each a string of overrides
    extra_candidates: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
    user_script: Optional[str] = None  # a white-box script subclassing a template (--user-script)
    recipe: Optional[str] = None  # the recipe's own name, for the record


GROUPS = ("task", "model", "data", "precision", "memory", "parallelism", "graph", "kernels",
          "peft", "optim", "scheduler", "trainer", "launcher", "logger", "accelerate")
