"""Black-box supervised fine-tuning of a causal LM on chat or prompt/response rows
(`task=sft`): the loss on the assistant's tokens (task.loss_on=response) or on all; optionally
several examples packed per row (data.packing); every evaluation reports the loss and perplexity
over the validation split's labelled tokens, and greedy answers to its first prompts
(RUN_DIR/generations.jsonl, and how many equal the reference)."""
from __future__ import annotations

import json
import logging
import math

from rapidformer.data.chat import (EncodeCounts, Renderer, chat_template_text, encode_rows,
                                   generation_prompts, packing_hint, stop_token_ids,
                                   text_ids)
from rapidformer.data.lengths import IGNORE
from rapidformer.data.tokenizers import training_texts
from rapidformer.errors import InputError
from rapidformer.models.hf import build_task_model
from rapidformer.models.pretrained_shape import new_token_room
from rapidformer.tasks.base import TaskFinetuner, mean

log = logging.getLogger("rapidformer")
GENERATIONS_FILE = "generations.jsonl"


class SFTFinetuner(TaskFinetuner):
    def train_valid_test_datasets_provider(self):
        from transformers import DataCollatorForSeq2Seq

        d, t = self.cfg.data, self.cfg.task
        splits = self.load_splits()
        tokenizer = self.make_tokenizer(lambda: training_texts("sft", d, splits["train"]))
        ready_for_chat(tokenizer, chat_template_text(d.chat_template))
        encoded = {}
        for name, ds in splits.items():
            counts = EncodeCounts()
            encoded[name] = encode_rows(ds, tokenizer, d, t.loss_on, name, counts)
            # examples dropped: a warning that counts them; all of a split's: an error
            (log.warning if counts.dropped else log.info)(
                "task=sft, %s split: %d examples, %d cut to data.max_seq_length=%d, %d dropped "
                "(no %s token left to learn from)", name, counts.examples, counts.truncated,
                d.max_seq_length, counts.dropped,
                "assistant" if t.loss_on == "response" else "second")
            if counts.empty_answers:
                log.warning("task=sft, %s split: %d rows have an assistant turn with no text: "
                            "the model learns to answer them with nothing", name,
                            counts.empty_answers)
            if not len(encoded[name]):
                raise self.empty_split(name, counts.examples, dropped_why(counts, d, t),
                                       dropped_fix(counts, d, t))
        self.prompts = (generation_prompts(splits["validation"], tokenizer, d, t.sample_generations)
                        if "validation" in splits else [])
        self.bos_id = Renderer(tokenizer).bos_id  # the prompts begin as the training rows do
        collate = self.shape_batches(DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE,
                                                            return_tensors="pt"))
        if not d.packing and self.engine.rank == 0:  # accelerate=auto reads it (the log's)
            log.info("%s", packing_hint(encoded["train"], d.max_seq_length))
        # data.packing: several examples a row (the packed transform's rows and collate)
        train = self.engine.transforms.training_rows(encoded["train"])
        return train, encoded.get("validation"), encoded.get("test"), collate

    def model_optimizer_lr_scheduler_provider(self):
        return build_task_model(self.cfg.model, "sft", self.tokenizer), None, None

    loss_unit = "next_labels"

    def run_forward_step(self, batch, model):
        # packed rows have no attention_mask: the model reads the examples from position_ids,
        # which transformers does only without a KV cache
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                     position_ids=batch.get("position_ids"), labels=batch["labels"],
                     use_cache=False).loss

    def _evaluate(self, model, loaders, sink, state):
        self.evaluation_step = state.step  # the generations' record names it
        return super()._evaluate(model, loaders, sink, state)

    def run_compute_metrics(self, model, eval_dataloader):
        wrapped = model[0]
        loss_sum = targets = 0.0
        for batch in eval_dataloader:
            # the model's loss is the mean over its shifted labels: weighted by their count, the
            # mean over every labelled token however they fall into batches and ranks
            count = int((batch["labels"][:, 1:] != IGNORE).sum())
            # every rank's forward, padding too: it may be a collective (sharded weights, DDP)
            loss = float(self.run_forward_step(batch, wrapped))
            if count and not self.padding_batch:
                loss_sum += loss * count
                targets += count
        loss_sum, targets = self.sum_over_ranks(loss_sum, targets)
        loss = mean(loss_sum, targets)
        metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        if self.prompts:
            metrics["answer_match"] = self._sample_generations()
        return metrics

    def _sample_generations(self) -> float:
        """Greedy answers to the validation prompts, written to RUN_DIR/generations.jsonl; the
        share that equals the reference (both read back through the tokenizer, so that its
        normalization does not count as a difference)."""
        import torch

        tokenizer, t = self.tokenizer, self.cfg.task
        generator = self.engine.unwrapped_model()
        device = self.engine.device
        # sharded weights are gathered by every rank's forward: ranks generate in step
        synced = self.engine.strategy.forward_is_collective
        records, matched = [], 0
        stops = stop_token_ids(tokenizer, getattr(generator, "generation_config", None))
        for item in self.prompts:
            ids = torch.tensor([text_ids(tokenizer, item["prompt"], self.bos_id)], device=device)
            with torch.no_grad():
                out = generator.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=new_token_room(generator.config, ids.shape[1],
                                                  t.max_new_tokens),
                    eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, use_cache=True,
                    synced_gpus=synced)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            reference = tokenizer.decode(tokenizer(item["reference"], add_special_tokens=False)
                                         ["input_ids"], skip_special_tokens=True).strip()
            matched += answer == reference
            records.append({"step": getattr(self, "evaluation_step", None),
                            "prompt": item["prompt"], "reference": item["reference"],
                            "generated": answer})
        if self.engine.rank == 0:
            with open(self.engine.run_dir / GENERATIONS_FILE, "a", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
        return matched / len(self.prompts)


def dropped_why(counts: EncodeCounts, d, t) -> str:
    """Why every example of a split was dropped (each had no token to learn from)."""
    learnt = "an assistant token" if t.loss_on == "response" else "a token past the first"
    cut = counts.truncated
    parts = [f"{cut} cut to data.max_seq_length={d.max_seq_length} tokens before {learnt}"
             if cut else "",
             (f"{counts.examples - cut} with no assistant turn" if t.loss_on == "response"
              else f"{counts.examples - cut} of one token") if counts.examples - cut else ""]
    return "; ".join(p for p in parts if p)


def dropped_fix(counts: EncodeCounts, d, t) -> str:
    fixes = [f"raise data.max_seq_length (now {d.max_seq_length})" if counts.truncated else "",
             "give the rows an assistant turn (a prompt/response or messages row with the "
             "assistant's answer)" if counts.examples > counts.truncated else ""]
    return " or ".join(f for f in fixes if f)


def ready_for_chat(tokenizer, template: str | None) -> None:
    """The tokenizer with what chat fine-tuning needs: an end of sequence (a trained WordPiece
    vocabulary's [SEP]), a padding token (the end of sequence, for decoders that have none),
    and data.chat_template when one is given."""
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.eos_token is None:
        raise InputError(f"task=sft: the tokenizer ({type(tokenizer).__name__}) has no end-of-"
                         f"sequence token to end the answers with; use a tokenizer that has one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if template is not None:
        if getattr(tokenizer, "chat_template", None):
            log.info("data.chat_template replaces the tokenizer's own chat template")
        tokenizer.chat_template = template
