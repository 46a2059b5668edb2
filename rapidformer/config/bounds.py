"""The range of every number in the config (`BOUNDS`), the keys' defaults and values by dotted
name, and the shortest sequence each task's samples fit in."""
from __future__ import annotations

import dataclasses
import typing

from rapidformer.config.schema import RunConfig


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a number in the config may take: from `low` to `high` (an end left out is
    open-ended; each given end is included unless it is `*_open`), and null where `null` says
    what null does. `example` is the value the message suggests; `note` says what the ends mean."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: str | None = None
    example: str = ""
    note: str = ""

    def holds(self, value) -> bool:
        if value is None:
            return self.null is not None
        if isinstance(value, (str, list)):  # a key's named or listed values: checked by name
            return True
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value < self.high or (value == self.high and not self.high_open)

    def phrase(self, integer: bool) -> str:
        """What the value must be, as in `... must be in [0, 1)`."""
        low, high = (_number(v) for v in (self.low, self.high))
        if self.high is not None and self.low is not None:
            return (f"be in {'(' if self.low_open else '['}{low}, {high}"
                    f"{')' if self.high_open else ']'}")
        if self.high is not None:
            return f"be below {high}" if self.high_open else f"be at most {high}"
        if self.low == 0:
            return "be positive" if self.low_open else "not be negative"
        if self.low == 1 and integer and not self.low_open:
            return "be a positive integer"
        return f"be above {low}" if self.low_open else f"be at least {low}"


def _number(value) -> str:
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else str(value)


PRETRAINED_OWN = "a pretrained model's own (model.source=pretrained)"
# the architecture keys a config-built model is made from (null only with a pretrained model)
SHAPE_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "intermediate_size",
              "max_position_embeddings", "vocab_size")

# every number of the schema that has a valid range, checked before anything runs (the ones
# checked against other keys are data.max_seq_length, launcher.node_rank and, for
# question_answering, task.doc_stride; data.synthetic_seed takes any integer)
BOUNDS: dict[str, Bound] = {
    "task.num_labels": Bound(2, null="inferred from the training labels", example="2"),
    "task.doc_stride": Bound(1, example="32"),
    "task.max_answer_length": Bound(1, example="30"),
    "task.n_best_size": Bound(1, example="20"),
    "task.max_target_length": Bound(1, example="64"),
    "task.num_beams": Bound(1, example="4"),
    "task.sample_generations": Bound(0, example="4", note="0: no sample generations"),
    "task.max_new_tokens": Bound(1, example="64"),
    "peft.r": Bound(1, example="8", note="the adapters' rank"),
    "peft.alpha": Bound(0, low_open=True, example="16", note="the adapters' scale is alpha / r"),
    "peft.dropout": Bound(0, 1, high_open=True, example="0.05",
                          note="a probability; 0 turns it off"),
    "model.hidden_size": Bound(1, null=PRETRAINED_OWN, example="768"),
    "model.num_layers": Bound(1, null=PRETRAINED_OWN, example="12"),
    "model.num_attention_heads": Bound(1, null=PRETRAINED_OWN, example="12"),
    "model.num_key_value_heads": Bound(1, null="one per attention head", example="8"),
    "model.rope_theta": Bound(0, low_open=True, example="500000"),
    "model.intermediate_size": Bound(1, null=PRETRAINED_OWN, example="3072"),
    "model.max_position_embeddings": Bound(1, null=PRETRAINED_OWN, example="512"),
    "model.vocab_size": Bound(1, null=PRETRAINED_OWN, example="30522"),
    "model.embedding_rows": Bound(1, null="one per token of the tokenizer", example="128256"),
    "model.hidden_dropout": Bound(0, 1, high_open=True, example="0.1",
                                  note="a probability; 0 turns dropout off"),
    "model.attention_dropout": Bound(0, 1, high_open=True, example="0.1",
                                     note="a probability; 0 turns dropout off"),
    "model.initializer_range": Bound(0, low_open=True, example="0.02",
                                     note="the standard deviation of the initial weights"),
    "data.num_workers": Bound(0, example="2", note="0 loads batches in the training process"),
    "data.mask_prob": Bound(0, 1, low_open=True, high_open=True, example="0.15",
                            note="the share of tokens masked"),
    "data.short_seq_prob": Bound(0, 1, example="0.1",
                                 note="a probability: how often a sample is made shorter"),
    "data.synthetic_train_size": Bound(1, example="4000"),
    "data.synthetic_eval_size": Bound(1, example="400"),
    "precision.initial_scale": Bound(0, low_open=True, example="65536",
                                     note="fp16's first loss scale"),
    "precision.growth_interval": Bound(1, example="2000"),
    "memory.device_memory_gb": Bound(0, low_open=True, null="the detected GPU's memory",
                                     example="80"),
    "parallelism.tensor_model_parallel_size": Bound(1, example="1"),
    "parallelism.pipeline_model_parallel_size": Bound(1, example="1"),
    "parallelism.ddp_bucket_cap_mb": Bound(1, example="25"),
    "optim.beta1": Bound(0, 1, high_open=True, example="0.9",
                         note="AdamW's decay rate of the gradient average"),
    "optim.beta2": Bound(0, 1, high_open=True, example="0.999",
                         note="AdamW's decay rate of the squared-gradient average"),
    "optim.eps": Bound(0, low_open=True, example="1e-8",
                       note="added to AdamW's denominator"),
    "scheduler.warmup_iters": Bound(0, example="100"),
    "scheduler.warmup_fraction": Bound(0, 1, high_open=True, null="scheduler.warmup_iters decides",
                                       example="0.06", note="a share of the iterations"),
    "scheduler.min_lr": Bound(0, example="0.0"),
    "scheduler.decay_iters": Bound(1, null="decay until the last iteration", example="2000"),
    "trainer.epochs": Bound(1, null="trainer.train_iters decides", example="3"),
    "trainer.train_iters": Bound(1, null="trainer.epochs decides", example="1000"),
    "trainer.micro_batch_size": Bound(1, example="16"),
    "trainer.eval_micro_batch_size": Bound(1, example="64", null="trainer.micro_batch_size"),
    "trainer.global_batch_size": Bound(1, null="trainer.micro_batch_size x data-parallel size",
                                       example="64"),
    "trainer.lr": Bound(0, example="2e-5", note="a typical fine-tuning lr is 2e-5"),
    "trainer.weight_decay": Bound(0, example="0.01"),
    "trainer.clip_grad": Bound(0, example="1.0", note="0 disables clipping"),
    "trainer.seed": Bound(0, 2**32 - 1, example="42", note="numpy's seed range"),
    "trainer.log_interval": Bound(1, example="10"),
    "accelerate.budget_s": Bound(0, low_open=True, example="300"),
    "accelerate.max_fraction": Bound(0, low_open=True, example="0.1",
                                     note="a share of the run's estimated length"),
    "accelerate.max_candidates": Bound(0, example="6", note="0 measures the reference alone"),
    "accelerate.steps": Bound(2, example="8", note="warm-up steps included"),
    "accelerate.warmup_steps": Bound(1, example="3"),
    "accelerate.candidate_timeout_s": Bound(0, low_open=True, example="180"),
    "accelerate.loss_tolerance": Bound(0, low_open=True, example="0.1",
                                       note="a share of the reference's mean loss"),
    "accelerate.load_tolerance": Bound(0, example="0.2",
                                       note="a share of the faster of the config's two rates"),
    "trainer.eval_interval": Bound(1, null="evaluate at the end of every epoch", example="100"),
    "trainer.eval_iters": Bound(0, example="10", note="0: no evaluation"),
    "trainer.save_interval": Bound(1, null="save at the end of every epoch", example="1000"),
    "trainer.exit_interval": Bound(1, null="never stop early", example="1000"),
    "trainer.keep_last": Bound(0, example="2", note="0 keeps every checkpoint"),
    "trainer.early_stopping_patience": Bound(1, null="train to the end", example="3",
                                             note="evaluations without improvement"),
    "trainer.early_stopping_min_delta": Bound(0, example="0.001",
                                              note="the least change that is an improvement"),
    "trainer.max_nonfinite_steps": Bound(1, null="never stop on a non-finite loss", example="5"),
    "trainer.grad_norm_spike_factor": Bound(1, low_open=True, null="no spike warnings",
                                            example="10",
                                            note="a window max this many times the recent median"),
    "launcher.nproc_per_node": Bound(1, example="1"),
    "data.pad_to": Bound(1, example="16"),
    "launcher.nnodes": Bound(1, example="1"),
    "launcher.master_port": Bound(1, 65535, example="6010", note="a TCP port"),
    "launcher.rendezvous_timeout": Bound(1, example="300", note="seconds"),
    "launcher.collective_timeout": Bound(1, example="600", note="seconds"),
    "launcher.max_restarts": Bound(0, example="3", note="0: a failed worker ends the job"),
}

# the shortest data.max_seq_length: the special tokens of the longest framing below (3) and at
# least a token of each text, with room left (question answering also needs the question and
# task.doc_stride tokens of overlap); below it a tokenizer cannot cut a text to fit and leaves
# it whole, so samples come out longer than the limit (and than the position embeddings)
MIN_SEQ_LENGTH = 8
SAMPLE_LAYOUTS = {
    "sequence_classification": "[CLS] text [SEP]",
    "token_classification": "[CLS] words [SEP]",
    "question_answering": "[CLS] question [SEP] context [SEP]",
    "masked_lm": "[CLS] text [SEP]",
    "seq2seq_lm": "task.source_prefix + document + </s>",
    "bert_pretraining": "[CLS] segment A [SEP] segment B [SEP]",
    "causal_lm": "a window of tokens, each predicting the next",
    "sft": "the chat template's turns, the assistant's tokens carrying the loss",
}
# a question-answering window: [CLS] question [SEP] context [SEP] holds 3 special tokens, at least
# one token of question and task.doc_stride tokens of overlap plus one new token of context
QA_WINDOW_EXTRA = 4


def _field_type(path: str):
    cls = RunConfig
    for part in path.split("."):
        cls = typing.get_type_hints(cls)[part]
    return cls


def value_at(cfg: RunConfig, path: str):
    """The value of a dotted key ("optim.beta1") of a typed config."""
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def schema_default(path: str):
    """The schema's default of a dotted key ("memory.offload_optimizer")."""
    cls, spec = RunConfig, None
    for part in path.split("."):
        spec = {f.name: f for f in dataclasses.fields(cls)}[part]
        cls = typing.get_type_hints(cls)[part]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def bound_problem(key: str, value, bound: Bound) -> str | None:
    """The message for a value outside its bound (None when it is inside)."""
    if bound.holds(value):
        return None
    integer = int in (_field_type(key), *typing.get_args(_field_type(key)))
    text = f"{key}={value} must {bound.phrase(integer)}"
    if bound.note:
        text += f" ({bound.note})"
    if bound.null is not None:
        text += f" or null ({bound.null})"
    return text + f"; set e.g. {key}={bound.example}"


def range_problems(cfg: RunConfig) -> list[str]:
    """Every number outside its valid range, and data.max_seq_length too short for its task."""
    p = [problem for key, bound in BOUNDS.items()
         if (problem := bound_problem(key, value_at(cfg, key), bound))]
    d, m, task = cfg.data, cfg.model, cfg.task.name
    if d.max_seq_length < MIN_SEQ_LENGTH:
        layout = SAMPLE_LAYOUTS[task]
        if task == "sequence_classification" and d.text_b_column:
            layout = "[CLS] text_a [SEP] text_b [SEP]"
        example = 128 if m.source != "config" or m.max_position_embeddings < MIN_SEQ_LENGTH \
            else min(128, m.max_position_embeddings)
        p.append(f"data.max_seq_length={d.max_seq_length} must be at least {MIN_SEQ_LENGTH}: a "
                 f"task={task} sample is {layout}, and a limit with no room for its special "
                 f"tokens and some text of each part is not applied (the tokenizer leaves the "
                 f"text whole, longer than the limit); set e.g. data.max_seq_length={example}")
    return p


