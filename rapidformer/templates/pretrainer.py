"""PreTrainer: the seed's pretraining template. Subclasses implement three methods; `train()` is
an iteration-based loop in Megatron's manner, written to read top to bottom.

The loop asks the provider for Megatron's sample counts, reads the data through an iterator
that `run_forward_step(data_iterator, model)` pulls micro-batches from, and keeps the data
position (consumed samples) in every checkpoint, so a resumed run sees the same next samples.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DataLoader

from rapidformer.data.sampler import PretrainingBatchSampler
from rapidformer.errors import ConfigError, InputError, RapidformerError
from rapidformer.observability import MetricsSink
from rapidformer.preemption import StopSignals
from rapidformer.templates.contract import check_overrides
from rapidformer.templates.finetuner import _progress, _Window, end_preempted, save_if_finite

log = logging.getLogger("rapidformer")


@dataclass
class PretrainState:
    step: int = 0                    # iterations (optimizer steps) taken
    consumed_train_samples: int = 0  # the data position: global batches x their size
    consumed_valid_samples: int = 0


def megatron_num_samples(train_iters: int, eval_interval: int | None, eval_iters: int,
                         global_batch_size: int) -> list[int]:
    """[train, valid, test] samples, as Megatron asks its dataset provider for them: one global
    batch per iteration; eval_iters batches per evaluation, evaluating every eval_interval
    iterations and once more at the end; eval_iters batches of test."""
    interval = eval_interval or train_iters
    evaluations = train_iters // interval + 1
    return [train_iters * global_batch_size, evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size]


class PreTrainer:
    """Subclass and implement:

    - `train_valid_test_datasets_provider(train_val_test_num_samples)` -> (train, valid, test)
      (valid and test may be None)
    - `model_optimizer_lr_scheduler_provider()` -> (model, optimizer or None, lr_scheduler or None)
    - `run_forward_step(data_iterator, model)` -> loss (pull one micro-batch with
      `next(data_iterator)`, e.g. through `mpu.broadcast_data`)

    Optionally set `self.collate_fn` (default: torch's default collate of dict samples) and
    `self.tokenizer` (saved with checkpoints and the Hugging Face export).
    """

    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        self.tokenizer = None
        self.collate_fn = None

    # --- the three methods of the seed's template -----------------------------------------------
    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        raise self._missing("train_valid_test_datasets_provider(self, train_val_test_num_samples)",
                            "(train_dataset, valid_dataset or None, test_dataset or None)")

    def model_optimizer_lr_scheduler_provider(self):
        raise self._missing("model_optimizer_lr_scheduler_provider(self)",
                            "(model, optimizer or None, lr_scheduler or None)")

    def run_forward_step(self, data_iterator, model):
        raise self._missing("run_forward_step(self, data_iterator, model)", "the loss tensor")

    def _missing(self, signature: str, returns: str) -> RapidformerError:
        return RapidformerError(f"{type(self).__name__} must implement {signature}, returning "
                                f"{returns}: it is one of the PreTrainer template's three methods")

    # --- the loop ----------------------------------------------------------------------------------
    def train(self):
        check_overrides(self, PreTrainer, ("train_valid_test_datasets_provider",
                                           "model_optimizer_lr_scheduler_provider",
                                           "run_forward_step"))
        engine, t = self.engine, self.cfg.trainer
        if not t.train_iters:
            raise ConfigError(["the PreTrainer counts iterations, not epochs: set "
                               "trainer.train_iters (the seed's --train-iters)"])
        total_iters = t.train_iters
        _, dp_size = engine.data_parallel
        accumulation = t.global_batch_size // (t.micro_batch_size * dp_size)
        num_samples = megatron_num_samples(total_iters, t.eval_interval, t.eval_iters,
                                           t.global_batch_size)
        log.info("asking the dataset provider for %s train/valid/test samples", num_samples)
        train_ds, valid_ds, test_ds = self.train_valid_test_datasets_provider(num_samples)
        if train_ds is None or len(train_ds) < t.micro_batch_size * dp_size:
            raise InputError(f"the training dataset has {0 if train_ds is None else len(train_ds)} "
                             f"samples, fewer than one micro-batch per process; add data or "
                             f"give training a larger share of data.split")
        model, optimizer, lr_scheduler = self.model_optimizer_lr_scheduler_provider()
        model, optimizer, lr_scheduler = engine.compose(model, optimizer, lr_scheduler,
                                                        total_iters=total_iters)

        state = PretrainState()
        resume_from = engine.resume_checkpoint
        if resume_from is not None:
            state = PretrainState(**engine.load_checkpoint(resume_from)["train_state"])
        train_iter = self.build_data_iterator(train_ds, state.consumed_train_samples)
        valid_iter = self.build_data_iterator(valid_ds, state.consumed_valid_samples)
        sink = MetricsSink(engine.run_dir, t.tensorboard, enabled=engine.is_main_process,
                           logger=self.cfg.logger, config=asdict(self.cfg))
        progress = _progress(total_iters, state.step, t.progress_bar and engine.is_main_process)
        log.info("pretraining %d iterations from iteration %d (%d micro-batches of %d per "
                 "process per iteration), precision=%s, device=%s", total_iters, state.step,
                 accumulation, t.micro_batch_size, self.cfg.precision.dtype, engine.device)

        window = _Window(t.grad_norm_spike_factor)
        train_iter.window = window if engine.parallel is None or engine.parallel.counts_input \
            else None
        last_eval_step = -1
        stop = StopSignals().install(engine.world_size)
        while state.step < total_iters:
            model.train()
            if engine.parallel is not None:  # megatron-core's schedule runs the micro-batches
                with engine.autocast():
                    for loss in self._megatron_steps(train_iter, model, accumulation):
                        window.add_micro(loss)
            else:
                for micro in range(accumulation):
                    with engine.accumulating(last_micro_batch=micro == accumulation - 1):
                        with engine.autocast():
                            loss = self.run_forward_step(train_iter, model)
                        engine.rank_progress.tick()
                        engine.backward(loss, accumulation_steps=accumulation)
                    window.add_micro(loss.detach())
            result = engine.step()
            state.step += 1
            state.consumed_train_samples += t.global_batch_size
            window.add_step(result)
            progress.update(1)

            if state.step % t.log_interval == 0 or state.step == total_iters:
                record = window.flush(optimizer, engine, state.step)
                sink.write(state.step, {"consumed_samples": state.consumed_train_samples, **record})
                progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")
                log.info("iteration %d/%d loss %.4f lr %.3e grad_norm %.3f %.1f samples/s "
                         "(%.1f%% waiting for data)", state.step, total_iters, record["loss"],
                         record["lr"], record["grad_norm"], record["samples_per_s"],
                         100 * record["data_wait_frac"])
            if t.eval_interval and state.step % t.eval_interval == 0:
                self._evaluate("validation", model, valid_iter, state, sink)
                last_eval_step = state.step
            exiting = bool(t.exit_interval and state.step % t.exit_interval == 0
                           and state.step < total_iters)
            preempted = stop.requested()
            if (t.save_interval and state.step % t.save_interval == 0) or exiting or preempted:
                save_if_finite(self._save, state, window, engine)
            if preempted:
                end_preempted(stop, engine, state.step, progress, sink)
            if exiting:
                log.info("trainer.exit_interval=%d reached at iteration %d: checkpoint saved, "
                         "stopping (resume with trainer.resume=auto)", t.exit_interval, state.step)
                progress.close()
                sink.close()
                stop.restore()
                return state

        progress.close()
        stop.restore()
        if last_eval_step != state.step:
            self._evaluate("validation", model, valid_iter, state, sink)
        self._evaluate("test", model, self.build_data_iterator(test_ds, 0), state, sink)
        if t.save_last and not (engine.checkpoint_root / f"step_{state.step:08d}").is_dir():
            save_if_finite(self._save, state, window, engine)
        if t.export_hf:
            engine.export_hf(self.tokenizer, step=state.step)
        sink.close()
        return state

    # --- data --------------------------------------------------------------------------------------
    def build_data_iterator(self, dataset, consumed_samples: int = 0):
        """An endless iterator of this process's micro-batches, from `consumed_samples` on (None
        for no dataset). It counts samples, tokens and the time spent waiting for a batch."""
        if dataset is None or len(dataset) == 0:
            return None
        engine, t = self.engine, self.cfg.trainer
        dp_rank, dp_size = engine.data_parallel
        if len(dataset) < t.micro_batch_size * dp_size:
            log.warning("a dataset of %d samples is smaller than one micro-batch per "
                        "data-parallel rank: skipped", len(dataset))
            return None
        sampler = PretrainingBatchSampler(len(dataset), consumed_samples, t.micro_batch_size,
                                          dp_rank, dp_size)
        workers = self.cfg.data.num_workers
        # the loader's own generator: iter() would otherwise draw worker seeds from the global
        # RNG, and a resumed run would then see other dropout masks than an uninterrupted one
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                            generator=torch.Generator().manual_seed(t.seed),
                            num_workers=workers, pin_memory=engine.device.type == "cuda",
                            persistent_workers=workers > 0,
                            prefetch_factor=4 if workers > 0 else None)
        return _CountingIterator(iter(loader))

    # --- the verbs the loop uses -------------------------------------------------------------------
    def _evaluate(self, name: str, model, data_iterator, state: PretrainState,
                  sink: MetricsSink) -> dict:
        """Mean loss over eval_iters iterations' worth of micro-batches, and its perplexity."""
        engine, t = self.engine, self.cfg.trainer
        if data_iterator is None or t.eval_iters == 0:
            return {}
        micro_batches = t.eval_iters * t.global_batch_size // (t.micro_batch_size
                                                               * engine.data_parallel[1])
        model.eval()
        # (sum of micro-batch losses, their count): with pipeline stages only the last has them
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        with torch.no_grad(), engine.autocast():
            if engine.parallel is not None:
                for loss in self._megatron_steps(data_iterator, model, micro_batches,
                                                 forward_only=True):
                    total += torch.stack([loss.double(), torch.ones_like(loss, dtype=torch.float64)])
            else:
                for _ in range(micro_batches):
                    loss = self.run_forward_step(data_iterator, model).detach().double()
                    total += torch.stack([loss, torch.ones_like(loss)])
        model.train()
        if name == "validation":
            state.consumed_valid_samples += t.eval_iters * t.global_batch_size
        loss_sum, count = engine.all_reduce_sum(total).tolist()
        loss = loss_sum / count
        results = {f"{name}/loss": loss, f"{name}/ppl": math.exp(min(loss, 50.0))}
        sink.write(state.step, results)
        log.info("%s at iteration %d: loss %.4f, perplexity %.2f", name, state.step, loss,
                 results[f"{name}/ppl"])
        return results

    def _megatron_steps(self, data_iterator, model, num_microbatches: int,
                        forward_only: bool = False) -> list:
        """One step's micro-batches through megatron-core's schedule (1F1B over pipeline
        stages); the micro-batch losses on the last stage, none elsewhere."""
        from rapidformer.accelerators.parallel import forward_backward

        t = self.cfg.trainer

        def forward_step(iterator, chunk):
            result = self.run_forward_step(iterator, chunk)
            if not forward_only:  # every pipeline stage runs this once per micro-batch
                self.engine.rank_progress.tick()
            if isinstance(result, tuple):  # megatron-core's (output, loss_func)
                return result
            if self.engine.parallel.pp > 1:
                raise RapidformerError(
                    "with pipeline parallelism run_forward_step must return megatron-core's "
                    "(output_tensor, loss_func) pair: each stage passes its output on, and only "
                    "the last computes the loss")
            return result, lambda loss: (loss, {"loss": loss.detach().clone()})

        losses = forward_backward(forward_step, data_iterator, model, num_microbatches,
                                  self.cfg.data.max_seq_length, t.micro_batch_size, forward_only)
        return [entry["loss"].detach().float() for entry in losses]

    def _save(self, state: PretrainState) -> None:
        tokenizer = self.tokenizer
        extra = (lambda d: tokenizer.save_pretrained(str(d / "tokenizer"))) if tokenizer else None
        self.engine.save_checkpoint(state.step, {"step": state.step,
                                                 "train_state": asdict(state)}, extra)


class _CountingIterator:
    """Wraps the loader's iterator: the samples, tokens and seconds spent waiting for each
    batch go into `window` (the loop's log window) when one is attached."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.window = None

    def __iter__(self):
        return self

    def __next__(self):
        started = time.perf_counter()
        batch = next(self.iterator)
        if self.window is not None:
            self.window.data_wait += time.perf_counter() - started
            self.window.add_input(batch)
        return batch


def build_train_valid_test_datasets_for_huggingface(
        data_prefix, data_impl, splits_string, train_valid_test_num_samples, max_seq_length,
        masked_lm_prob, short_seq_prob, seed, skip_warmup, binary_head=True):
    """The seed's BERT pretraining datasets: megatron-core's masked word-piece dataset over
    sentence-level mmap data, with samples under Hugging Face's keys (input_ids, attention_mask,
    token_type_ids, labels (-100 where not masked), next_sentence_label). The tokenizer is the
    run's (model.tokenizer_type, model.tokenizer)."""
    from rapidformer.data.megatron import build_bert_datasets, check_data_impl
    from rapidformer.tokenizer import get_tokenizer

    check_data_impl(data_impl)
    return build_bert_datasets(data_prefix, get_tokenizer(), splits_string,
                               list(train_valid_test_num_samples), max_seq_length,
                               masked_lm_prob, short_seq_prob, seed, binary_head=binary_head,
                               skip_warmup=skip_warmup)


def build_train_valid_test_datasets(data_prefix, data_impl, splits_string,
                                    train_valid_test_num_samples, seq_length, seed, skip_warmup):
    """The seed's GPT pretraining datasets (Megatron's signature): megatron-core's GPTDataset
    over document-level mmap data; each sample's `text` holds seq_length + 1 tokens, and
    `input_ids`, `labels` (shifted, -100 where masked) and `position_ids` are ready to use."""
    from rapidformer.config.args import get_args
    from rapidformer.data.megatron import build_gpt_datasets, check_data_impl
    from rapidformer.tokenizer import get_tokenizer

    check_data_impl(data_impl)
    d = get_args().cfg.data
    return build_gpt_datasets(data_prefix, get_tokenizer(), splits_string,
                              list(train_valid_test_num_samples), seq_length, seed,
                              eod_mask_loss=d.eod_mask_loss,
                              reset_position_ids=d.reset_position_ids, skip_warmup=skip_warmup)
