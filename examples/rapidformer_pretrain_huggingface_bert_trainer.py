"""The seed's white-box BERT pretraining script, as its docs print it; one line differs: `mpu`
comes from rapidformer (`from megatron import mpu` names Megatron-LM's old package).

    rapidformer --user-script examples/rapidformer_pretrain_huggingface_bert_trainer.py \
        --pretrained-model-name-or-path MODEL_DIR --micro-batch-size 16 --global-batch-size 64 \
        --seq-length 512 --tokenizer-type BertWordPieceLowerCase --train-iters 100 \
        --data-path PREFIX_text_sentence --vocab-file vocab.txt --data-impl mmap --split 980,20 \
        --lr 1e-3 --lr-decay-style linear --weight-decay 1e-2 --clip-grad 1.0 \
        --lr-warmup-fraction .01 --mixed-precision
"""
import torch
from transformers import AutoModelForPreTraining

from rapidformer import (PreTrainer, RapidformerEngine,
                         build_train_valid_test_datasets_for_huggingface, get_args, mpu)


class MyBertPreTrainer(PreTrainer):

    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets_for_huggingface(
            data_prefix=args.data_path,
            data_impl=args.data_impl,
            splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples,
            max_seq_length=args.seq_length,
            masked_lm_prob=args.mask_prob,
            short_seq_prob=args.short_seq_prob,
            seed=args.seed,
            skip_warmup=(not args.mmap_warmup),
            binary_head=True)
        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = AutoModelForPreTraining.from_pretrained(args.pretrained_model_name_or_path)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        # Items and their type.
        keys = ['input_ids', 'attention_mask', 'token_type_ids', 'labels', 'next_sentence_label']
        datatype = torch.int64

        # Broadcast data.
        if data_iterator is not None:
            data = next(data_iterator)
        else:
            data = None
        data_b = mpu.broadcast_data(keys, data, datatype)

        input_ids = data_b['input_ids'].long()
        attention_mask = data_b['attention_mask'].long()
        token_type_ids = data_b['token_type_ids'].long()
        labels = data_b['labels'].long()
        next_sentence_label = data_b['next_sentence_label'].long()

        output_tensor = model(input_ids=input_ids,
                              attention_mask=attention_mask,
                              token_type_ids=token_type_ids,
                              labels=labels,
                              next_sentence_label=next_sentence_label)

        return output_tensor['loss']


engine = RapidformerEngine()
trainer = MyBertPreTrainer(engine=engine)
trainer.train()
