#!/usr/bin/env bash
# one GPU call: `bash tools/gpu/mcore.sh megatron|tests ...` from the repository root
# (carry .whl-lora, which holds megatron-core, hydra, datasets and liger; or WHL=.whl-mcore)
set -u
W=${WHL:-.whl-lora}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $W/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
ln -sfn ../conf rapidformer/conf; ln -sfn ../recipes rapidformer/recipes
nvidia-smi -L >> $OUT/env.txt
for what in "$@"; do
  case $what in
    megatron)
      timeout ${MLIMIT:-330} python3 benchmarks/megatron_attention.py --model megatron_llama \
        --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --seq 2048 \
        --micro ${MICRO:-8} --variants ${VARIANTS:-sdpa sdpa_compile} --warmup 5 --iters 20 \
        --run-timeout ${RUNT:-160} --out $OUT/megatron_llama_1b.json --logs $OUT/mlogs > $OUT/megatron.log 2>&1
      echo "megatron rc=$?" >> $OUT/env.txt; tail -6 $OUT/megatron.log ;;
    tests)
      timeout ${TESTS_LIMIT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS} > $OUT/gpu_tests.log 2>&1
      echo "tests rc=$?" >> $OUT/env.txt; tail -15 $OUT/gpu_tests.log ;;
  esac
done
cat $OUT/env.txt
