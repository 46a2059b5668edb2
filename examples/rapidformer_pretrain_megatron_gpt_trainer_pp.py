"""The seed's white-box Megatron GPT script for pipeline parallelism: its 4-GPU example
(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2) runs with this.

One change from examples/rapidformer_pretrain_megatron_gpt_trainer.py (the seed's text): with
pipeline stages, only the last stage's output is a loss, so `run_forward_step` returns
megatron-core's (output_tensor, loss_func) pair, as Megatron-LM's own pretrain_gpt.py does, and
the seed's three loss lines move into `loss_func`. The seed's version computed the loss on
every stage, which works only without pipeline parallelism. Without pipeline stages both give
the same losses.

    rapidformer --user-script examples/rapidformer_pretrain_megatron_gpt_trainer_pp.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 12 \
        --hidden-size 768 --num-attention-heads 12 --micro-batch-size 16 \
        --global-batch-size 128 --seq-length 512 --max-position-embeddings 512 \
        --train-iters 100 --data-path PREFIX_text_document --data-impl mmap --split 980,20 \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --zero-2-memory-optimization --checkpoint-activations \
        --mixed-precision model=megatron_gpt launcher.nproc_per_node=4
"""
from functools import partial

import torch

from rapidformer import (PreTrainer, RapidformerEngine, build_train_valid_test_datasets, get_args,
                         get_ltor_masks_and_position_ids, get_tokenizer, mpu)
from rapidformer.models.megatron import build_megatron_gpt


def GPTModel():
    return build_megatron_gpt(get_args().cfg, get_tokenizer().vocab_size)


class MegatronGPTPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            seq_length=args.seq_length,
            seed=args.seed,
            skip_warmup=(not args.mmap_warmup))
        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        model = GPTModel()
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        """Forward step."""
        args = get_args()
        tokenizer = get_tokenizer()

        keys = ['text']
        datatype = torch.int64

        data = next(data_iterator) if data_iterator is not None else None
        data_b = mpu.broadcast_data(keys, data, datatype)

        tokens_ = data_b['text'].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()

        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens,
            tokenizer.eod,
            args.reset_position_ids,
            args.reset_attention_mask,
            args.eod_mask_loss)

        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
        # every pipeline stage passes its output on; the schedule calls loss_func on the last
        return output_tensor, partial(loss_func, loss_mask)


def loss_func(loss_mask, output_tensor):
    """The seed's loss lines, applied by megatron-core's schedule to the last stage's output."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
    return loss, {"loss": loss.detach().clone()}


engine = RapidformerEngine()
trainer = MegatronGPTPreTrainer(engine=engine)
trainer.train()
