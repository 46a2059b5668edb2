"""Black-box pretraining on Megatron mmap data: the seed's `--task pretraining` (BERT, masked LM
+ next-sentence prediction) and `task=causal_lm` (GPT).

The same three PreTrainer methods a white-box user writes, filled in from the config: the
run's tokenizer (the one the data was made with), megatron-core datasets, a Hugging Face model
(`AutoModelForPreTraining`, or `AutoModelForMaskedLM` with task.binary_head=false / a GPT-2- or
Llama-shaped causal LM), and the seed's forward steps.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch.utils.data import default_collate

from rapidformer.compat import mpu
from rapidformer.config.splits import parse_split
from rapidformer.data.megatron import (build_bert_datasets, build_gpt_datasets, documents_of,
                                       no_whole_document, open_indexed)
from rapidformer.models.hf import build_pretraining_model
from rapidformer.transforms.liger import applied_fused_loss
from rapidformer.models.megatron import build_megatron_bert, build_megatron_decoder
from rapidformer.tasks.batching import Batching
from rapidformer.observability.records import NO_EVALUATION
from rapidformer.templates.pretrainer import PreTrainer
from rapidformer.data.pretraining_tokenizer import (check_pretrained_vocabulary,
                                                    load_pretraining_tokenizer)
from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
BERT_KEYS = ["input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label"]
GPT_KEYS = ["input_ids", "labels", "position_ids"]


class _MegatronDataPretrainer(PreTrainer):
    # why this run trains without evaluation (None: it evaluates); recorded once in metrics.jsonl
    without_evaluation: str | None = None
    _noted = False

    def _tokenizer(self):
        # the data decides a BERT vocabulary's end-of-document entries (Megatron's [BOS]/[EOS])
        tokenizer = load_pretraining_tokenizer(self.cfg.model, self.cfg.data.path)
        self.tokenizer = tokenizer.hf  # saved with checkpoints and the export
        return tokenizer

    build_megatron_model = None  # the megatron-core builder for model=megatron_*

    @property
    def megatron_model(self) -> bool:
        """model=megatron_*: a megatron-core model (its own forward and loss), else Hugging
        Face's."""
        return self.cfg.model.is_megatron

    def model_optimizer_lr_scheduler_provider(self):
        tokenizer = load_pretraining_tokenizer(self.cfg.model, self.cfg.data.path)
        if self.cfg.model.source == "pretrained":
            check_pretrained_vocabulary(self.cfg.model, tokenizer)
        if self.megatron_model:
            return type(self).build_megatron_model(self.cfg, tokenizer.vocab_size), None, None
        return build_pretraining_model(self.cfg.model, self.cfg.task.name, tokenizer,
                                       self.cfg.task.binary_head), None, None

    def _evaluated(self, datasets: tuple) -> tuple:
        """The rule of the evaluated splits (rapidformer/tasks/base.py) for Megatron's: a
        validation or test share of data.split that holds no whole document, evaluated
        (trainer.eval_iters > 0), is an error; a share of 0 or trainer.eval_iters=0 trains
        without evaluation, said now and recorded at the first evaluation point."""
        d, t = self.cfg.data, self.cfg.trainer
        shares = parse_split(d.split)
        for index, name in ((1, "validation"), (2, "test")):
            if datasets[index] is None and shares[index] > 0 and t.eval_iters > 0:
                raise InputError(no_whole_document(
                    d.split, name, shares[index],
                    _documents(d.path, self.cfg.task.name == "bert_pretraining")))
        if datasets[1] is None:
            why = ("trainer.eval_iters=0" if t.eval_iters == 0 else
                   f"data.split={d.split} gives validation no share")
            self.without_evaluation = (f"training without evaluation: {why}; give validation a "
                                       f"share of data.split and trainer.eval_iters >= 1 to "
                                       f"evaluate")
            log.warning("%s", self.without_evaluation)
        return datasets

    def _evaluate(self, name, model, data_iterator, state, sink):
        if name == "validation" and self.without_evaluation and not self._noted:
            sink.write(state.step, {NO_EVALUATION: self.without_evaluation})  # the summary's
            self._noted = True
        return super()._evaluate(name, model, data_iterator, state, sink)


class BertPretrainer(_MegatronDataPretrainer):
    build_megatron_model = build_megatron_bert
    batching = None  # a Hugging Face BERT's batch shapes (tasks/batching.py)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        d = self.cfg.data  # data.impl is checked with the config
        tokenizer = self._tokenizer()
        if not self.megatron_model:
            self.batching = Batching(self.cfg, tokenizer.hf, self.engine.transforms,
                                     masked_lm=True)
            self.collate_fn = self.batching.pretraining_collate(default_collate)
        return self._evaluated(build_bert_datasets(
            d.path, tokenizer, d.split, train_val_test_num_samples, d.max_seq_length,
            d.mask_prob, d.short_seq_prob, self.cfg.trainer.seed,
            binary_head=self.cfg.task.binary_head,
            skip_warmup=not d.mmap_warmup,
            path_to_cache=self.engine.run_dir / "data_index_cache"))

    def model_optimizer_lr_scheduler_provider(self):
        model, optimizer, scheduler = super().model_optimizer_lr_scheduler_provider()
        return (self.batching.drive(model) if self.batching else model), optimizer, scheduler

    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        keys = BERT_KEYS if self.megatron_model else list(batch)
        data = mpu.broadcast_data(keys, batch, torch.int64)
        if self.megatron_model:
            return megatron_bert_forward(model, data)
        if not self.cfg.task.binary_head:  # a masked-LM model: no next-sentence label to take
            data.pop("next_sentence_label", None)
        return model(**data).loss


class CausalLMPretrainer(_MegatronDataPretrainer):
    build_megatron_model = build_megatron_decoder  # megatron_gpt or megatron_llama

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        d = self.cfg.data  # data.impl is checked with the config
        return self._evaluated(build_gpt_datasets(
            d.path, self._tokenizer(), d.split, train_val_test_num_samples, d.max_seq_length,
            self.cfg.trainer.seed, eod_mask_loss=d.eod_mask_loss,
            reset_position_ids=d.reset_position_ids, skip_warmup=not d.mmap_warmup,
            path_to_cache=self.engine.run_dir / "data_index_cache"))

    @functools.cached_property
    def fused_loss(self) -> bool:
        """Whether liger's fused loss computes the model's training loss: asked of the model,
        which the liger transform marks (kernels=auto decides there, and an output layer that
        peft adapts keeps its own loss), not of the config."""
        return applied_fused_loss(self.engine.unwrapped_model())

    def run_forward_step(self, data_iterator, model):
        data = mpu.broadcast_data(GPT_KEYS, next(data_iterator), torch.int64)
        if self.megatron_model:
            return megatron_gpt_forward(model, data)
        # position ids that restart at each document are the model's input; plain ones
        # (0..s-1) are its default, and passing them would make transformers look for packed
        # documents in every batch and build a full attention mask for them
        positions = ({"position_ids": data["position_ids"]} if self.cfg.data.reset_position_ids
                     else {})
        if model.training and self.fused_loss:
            # the labels are shifted already: the fused loss takes them as they are
            return model(input_ids=data["input_ids"], shift_labels=data["labels"],
                         **positions).loss
        logits = model(input_ids=data["input_ids"], **positions).logits
        # the labels are shifted already (Megatron's samples), so no second shift as in
        # Hugging Face's own LM loss; -100 marks the masked positions (EOD, padding)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 data["labels"].flatten(), ignore_index=-100)


def _documents(data_path, bert: bool) -> int | None:
    """The documents data.split divides (a blend's smallest prefix's, as megatron-core counts
    them), or None where the files cannot say."""
    parts = data_path.split() if isinstance(data_path, str) else [str(p) for p in data_path]
    try:
        return documents_of([open_indexed(prefix) for prefix in (parts[1::2] if len(parts) > 1
                                                                 else parts)], bert)
    except Exception:  # the data's own errors were raised while the datasets were built
        return None


def megatron_gpt_forward(model, data: dict):
    """megatron-core's (output, loss_func) for a GPTModel: the last pipeline stage returns the
    per-token loss (vocabulary-parallel cross entropy), earlier stages their hidden states."""
    labels = data["labels"]
    mask = (labels != -100).float()
    output = model(data["input_ids"], data["position_ids"], None, labels=labels.clamp(min=0))

    def loss_func(per_token_loss):
        return _reported(_masked_mean(per_token_loss, mask))

    return output, loss_func


def megatron_bert_forward(model, data: dict):
    """megatron-core's (output, loss_func) for a BertModel: masked-LM loss over the masked
    positions plus next-sentence cross entropy where the model has its binary head
    (Megatron-LM's pretrain_bert; the sum is what Hugging Face's BertForPreTraining reports as
    its loss)."""
    labels = data["labels"]
    mask = (labels != -100).float()
    output = model(data["input_ids"], data["attention_mask"],
                   tokentype_ids=data["token_type_ids"], lm_labels=labels.clamp(min=0))

    def loss_func(output):
        per_token_loss, binary_logits = output
        loss = _masked_mean(per_token_loss, mask)
        if binary_logits is not None:  # task.binary_head=false builds the model without one
            loss = loss + torch.nn.functional.cross_entropy(
                binary_logits.float().view(-1, 2), data["next_sentence_label"].view(-1),
                ignore_index=-1)
        return _reported(loss)

    return output, loss_func


def _masked_mean(per_token_loss, mask):
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1.0)


def _reported(loss):
    """megatron-core's loss_func result; the logged value is a copy because the schedule divides
    the returned loss in place by the micro-batch count."""
    return loss, {"loss": loss.detach().clone()}
