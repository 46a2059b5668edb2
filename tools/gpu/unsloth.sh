#!/usr/bin/env bash
# one GPU call: `bash tools/gpu/unsloth.sh [ROWS...]` from the repository root, carry [".whl-unsloth"].
# Needs /tmp/site from an earlier tools/gpu/lora.sh call on the same warm machine (datasets, dill,
# multiprocess, hydra, omegaconf, bitsandbytes...). Installs unsloth (+ the trl/datasets it pins)
# into /tmp/site-unsloth, writes `import unsloth`'s outcome to $OUT/unsloth_import.txt, then, if
# ROWS are given, runs benchmarks/lora_sft.py on them (the unsloth child puts /tmp/site-unsloth
# first on its own sys.path through BENCH_UNSLOTH_SITE; the other rows keep /tmp/site's trl 1.16).
set -u
if [ -d .whl-unsloth ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-unsloth .whl-unsloth/*.whl > $OUT/pip_unsloth.log 2>&1 \
    || { tail $OUT/pip_unsloth.log; exit 1; }
elif [ ! -d /tmp/site-unsloth ]; then echo "no .whl-unsloth carried and no /tmp/site-unsloth"; exit 1; fi
[ -d /tmp/site ] || echo "WARNING: no /tmp/site (run tools/gpu/lora.sh first on this machine)" | tee $OUT/unsloth_import.txt
export PYTHONUNBUFFERED=1
( cd /tmp && export HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 \
    UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache && \
  PYTHONPATH=/tmp/site-unsloth:/tmp/site:$OLDPWD timeout 120 python3 -c "
import time; t = time.perf_counter()
import unsloth
print('import unsloth OK in %.1f s' % (time.perf_counter() - t))
import importlib.metadata as md, sys
for name in ('unsloth', 'unsloth_zoo', 'torch', 'transformers', 'peft', 'accelerate', 'trl',
             'datasets', 'triton', 'bitsandbytes', 'torchvision', 'xformers', 'flash_attn',
             'torchao', 'cut_cross_entropy'):
    try: print(name, md.version(name))
    except md.PackageNotFoundError: print(name, '-')
print('cpu backend', unsloth._IS_CPU_BACKEND)
try:
    from unsloth.models import _utils as u
    print('HAS_FLASH_ATTENTION', u.HAS_FLASH_ATTENTION, 'xformers', u.xformers_version,
          'SUPPORTS_BFLOAT16', u.SUPPORTS_BFLOAT16)
except Exception as e: print('unsloth.models._utils:', type(e).__name__, e)
print('trl from', sys.modules['trl'].__file__, '| datasets from', sys.modules['datasets'].__file__)
" ) >> $OUT/unsloth_import.txt 2>&1
echo "import rc=$?" >> $OUT/unsloth_import.txt
tail -c 4000 $OUT/unsloth_import.txt
[ $# -gt 0 ] || exit 0
export PYTHONPATH=/tmp/site:$PWD BENCH_LOG=$OUT/bench.log BENCH_UNSLOTH_SITE=/tmp/site-unsloth
ln -sfn ../conf rapidformer/conf; ln -sfn ../recipes rapidformer/recipes
cd benchmarks
timeout ${LIMIT:-540} python3 lora_sft.py --iters ${ITERS:-30} --examples 4000 --rows "$@" \
  --out $OUT/lora_sft_${TAG:-u}.json > $OUT/lora_${TAG:-u}.log 2>&1
echo "lora rc=$?"; tail -c 3000 $OUT/lora_${TAG:-u}.log
