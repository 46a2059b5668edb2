#!/usr/bin/env bash
# one GPU call: `bash tools/gpu/run.sh tests|decoder|decoder-profile|decoder-fused|bert|bert-long|bert-long-fp8|megatron|megatron-gb64|preprocess|tune-WORKLOAD[:base|:auto]` from the repository root
# (carry [".whl"]: `bash ../shared/tools/device-wheels.sh torchao==0.18.0 liger-kernel==0.8.5`)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
# BENCH_LOG: each benchmark row's last log lines (why a row failed or was slow)
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 BENCH_LOG=$OUT/bench.log
ln -sfn ../conf rapidformer/conf; ln -sfn ../recipes rapidformer/recipes
nvidia-smi -L > $OUT/env.txt
python3 -c "import torch, transformers, torchao; print(torch.__version__, transformers.__version__, torchao.__version__)" >> $OUT/env.txt 2>&1
for what in "$@"; do
  case $what in
    tests)
      timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 400 \
        tests/test_decoders.py tests/test_padding_options.py tests/test_unpadded.py \
        tests/test_tasks.py tests/test_train.py tests/test_peft.py tests/test_liger_lora.py tests/test_peft_base_dtype.py > $OUT/gpu_tests.log 2>&1
      echo "tests rc=$?" >> $OUT/env.txt; tail -5 $OUT/gpu_tests.log ;;
    bert)
      timeout 300 python3 benchmarks/run.py --suite h200 --workloads bert_mlm \
        --systems hf-compile rapidformer --out-dir $OUT/bert > $OUT/bert.log 2>&1
      echo "bert rc=$?" >> $OUT/env.txt; tail -12 $OUT/bert.log ;;
    decoder)
      timeout 560 python3 benchmarks/decoder_speed.py --rows hf-compile rf-bf16 rf-fp8 \
        --iters 80 --out $OUT/decoder_speed.json > $OUT/decoder.log 2>&1
      echo "decoder rc=$?" >> $OUT/env.txt; tail -12 $OUT/decoder.log ;;
    preprocess)  # the 16 cores: scaling, then Megatron-LM's own tool (carry .megatron-lm too:
      # mkdir .megatron-lm && git --git-dir=MEGATRON-LM.git archive core_v0.16.1 megatron tools
      #   | tar -x -C .megatron-lm; the image's triton is what its start imports)
      timeout 300 python3 benchmarks/preprocess_speed.py --mb 100 --workers 1 2 4 8 16 \
        --out $OUT/preprocess_scaling.json > $OUT/preprocess_scaling.log 2>&1
      echo "preprocess-scaling rc=$?" >> $OUT/env.txt; tail -22 $OUT/preprocess_scaling.log
      timeout 240 python3 benchmarks/preprocess_speed.py --mb 100 --workers 16 --megatron \
        --megatron-lm .megatron-lm --out $OUT/preprocess_megatron.json > $OUT/preprocess_megatron.log 2>&1
      echo "preprocess-megatron rc=$?" >> $OUT/env.txt; tail -12 $OUT/preprocess_megatron.log
      # the machine's own ceiling for 16 tokenizing processes (what the scaling is held to)
      timeout 120 python3 benchmarks/cpu_ceiling.py --work tokenize \
        --out $OUT/cpu_ceiling_tokenize.json > $OUT/cpu_ceiling.log 2>&1
      echo "cpu-ceiling rc=$?" >> $OUT/env.txt; cat $OUT/cpu_ceiling.log ;;
    decoder-profile)  # where the decoder step's time goes, plain HF + compile beside ours
      timeout 560 python3 benchmarks/decoder_speed.py --rows hf-compile rf-bf16 rf-fp8 \
        --iters 80 --profile 61 63 --out $OUT/decoder_profile.json > $OUT/decoder_profile.log 2>&1
      echo "decoder-profile rc=$?" >> $OUT/env.txt; tail -c 3000 $OUT/decoder_profile.log ;;
    bert-long)  # long-document BERT pretraining, both systems in one call (issue 37's 1.5x)
      timeout 540 python3 benchmarks/pretrain_padding.py --corpora long \
        --rows hf-compile rf-unpad-compile-cudagraphs --iters 200 \
        --out $OUT/pretrain_padding_long.json > $OUT/pretrain_padding_long.log 2>&1
      echo "bert-long rc=$?" >> $OUT/env.txt; grep '^{' $OUT/pretrain_padding_long.log | cut -c1-900 ;;
    bert-long-fp8)  # the long-document rapidformer row with float8 matmuls (the 768- and
      # 3072-wide layers), against bert-long's rows of the same call or the last one
      timeout 300 python3 benchmarks/pretrain_padding.py --corpora long \
        --rows rf-unpad-compile-cudagraphs --precision fp8 --iters 200 \
        --out $OUT/pretrain_padding_long_fp8.json > $OUT/pretrain_padding_long_fp8.log 2>&1
      echo "bert-long-fp8 rc=$?" >> $OUT/env.txt; grep '^{' $OUT/pretrain_padding_long_fp8.log | cut -c1-900 ;;
    megatron)  # megatron-core GPT 1.3B on one GPU (issue 37's 50 % MFU)
      timeout 540 python3 benchmarks/megatron_attention.py --variants sdpa sdpa_compile \
        --warmup 5 --iters 15 --profile 3 --run-timeout 240 --out $OUT/megatron_attention.json \
        > $OUT/megatron_attention.log 2>&1
      echo "megatron rc=$?" >> $OUT/env.txt; tail -8 $OUT/megatron_attention.log ;;
    megatron-gb64)  # the same at a pretraining run's global batch (64 sequences: 8 micro
      # batches a step), the optimizer step paid once per 131k tokens instead of once per 16k
      timeout 300 python3 benchmarks/megatron_attention.py --variants sdpa_compile \
        --global-batch 64 --warmup 3 --iters 6 --profile 2 --run-timeout 280 \
        --out $OUT/megatron_attention_gb64.json > $OUT/megatron_attention_gb64.log 2>&1
      echo "megatron-gb64 rc=$?" >> $OUT/env.txt; tail -4 $OUT/megatron_attention_gb64.log ;;
    decoder-fused)  # the rows issue 37 still owes: fused projections with and without FP8
      timeout 560 python3 benchmarks/decoder_speed.py --rows rf-bf16-fused rf-fp8 rf-fp8-fused \
        --iters 80 --out $OUT/decoder_fused.json > $OUT/decoder_fused.log 2>&1
      echo "decoder-fused rc=$?" >> $OUT/env.txt; tail -12 $OUT/decoder_fused.log ;;
    tune-*)  # accelerate=auto against the default and the hand-picked rows (issue 38), one
      # workload: tune-WORKLOAD all its rows; a longer one in two calls, tune-WORKLOAD:base (the
      # default and hand-picked rows), then tune-WORKLOAD:auto with the first's JSON committed
      # as docs/benchmarks/tune_search_WORKLOAD_base.json
      workload=${what#tune-}; workload=${workload%%:*}
      case $what in
        *:base) rows="--rows default hand-picked"; name=${workload}_base ;;
        *:auto) rows="--rows auto --earlier docs/benchmarks/tune_search_${workload}_base.json"
                name=$workload ;;
        *) rows=""; name=$workload ;;
      esac
      # the Llama default row (fp32, unpacked) takes about 5 minutes on an H200 and its search
      # is let spend 280 s of the 5 minutes; the others fit 260 s and 180 s
      case $workload in llama_sft) limits="--timeout 420 --budget 280" ;;
                        *) limits="--timeout 260" ;; esac
      timeout 570 python3 benchmarks/tune_search.py --workloads $workload $limits $rows \
        --out $OUT/tune_search_$name.json > $OUT/tune_$name.log 2>&1
      echo "tune-$name rc=$?" >> $OUT/env.txt; grep -v '^ ' $OUT/tune_$name.log | tail -c 4000 ;;
  esac
done
cat $OUT/env.txt
