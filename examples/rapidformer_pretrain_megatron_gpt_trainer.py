"""The seed's white-box Megatron GPT pretraining script, as its docs print it. What differs:
`mpu`, `get_tokenizer` and `get_ltor_masks_and_position_ids` come from rapidformer (the seed
imported them from Megatron-LM's old `megatron` package), and `GPTModel()` — the seed's "your
model" — is megatron-core's GPT built from the run's model settings.

    rapidformer --user-script examples/rapidformer_pretrain_megatron_gpt_trainer.py \
        --tensor-model-parallel-size 2 --num-layers 12 --hidden-size 768 \
        --num-attention-heads 12 --micro-batch-size 16 --global-batch-size 128 --seq-length 512 \
        --tokenizer-type GPT2BPETokenizer --max-position-embeddings 512 --train-iters 100 \
        --data-path PREFIX_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --data-impl mmap --split 980,20 --lr 1e-3 --lr-decay-style linear --weight-decay 1e-2 \
        --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1 \
        model=megatron_gpt launcher.nproc_per_node=2

`run_forward_step` returns the loss, as the seed's does; with pipeline parallelism it must
return megatron-core's (output_tensor, loss_func) pair instead (docs/parallelism.md).
"""
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

        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()

        return loss


engine = RapidformerEngine()
trainer = MegatronGPTPreTrainer(engine=engine)
trainer.train()
