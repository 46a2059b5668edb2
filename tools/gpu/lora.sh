#!/usr/bin/env bash
# one GPU call: `bash tools/gpu/lora.sh ROWS...` from the repository root (carry .whl-lora)
# env: TAG, LIMIT (the call's seconds), ITERS, MODEL, ROWT (a row's seconds), TESTS (pytest args)
set -u
if [ -d .whl-lora ] && ls .whl-lora/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl-lora/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_LOG=$OUT/bench.log
ln -sfn ../conf rapidformer/conf; ln -sfn ../recipes rapidformer/recipes
nvidia-smi -L > $OUT/env.txt
python3 -c "import torch, transformers, peft, trl, bitsandbytes, accelerate, liger_kernel; print(torch.__version__, transformers.__version__, peft.__version__, trl.__version__, bitsandbytes.__version__, accelerate.__version__)" >> $OUT/env.txt 2>&1
( cd benchmarks
  timeout ${LIMIT:-540} python3 lora_sft.py --iters ${ITERS:-30} --examples 4000 --model ${MODEL:-llama_1b} \
    --row-timeout ${ROWT:-150} --rows "$@" --out $OUT/lora_sft_${TAG:-a}.json > $OUT/lora_${TAG:-a}.log 2>&1
  echo "lora rc=$?" >> $OUT/env.txt )
tail -c 2500 $OUT/lora_${TAG:-a}.log
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_LIMIT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > $OUT/gpu_tests.log 2>&1
  echo "tests rc=$?" >> $OUT/env.txt; tail -15 $OUT/gpu_tests.log
fi
cat $OUT/env.txt
