#!/usr/bin/env bash
# one GPU call (carry [".whl"]): why `+recipe=llama_pretrain kernels=liger graph=compile` did not
# finish 60 steps in 4.5 minutes twice (issue 36): the decoder benchmark's data, then the run
# with torch's recompile and graph-break log and a stack dump of every thread at its time limit
# (SIGABRT into Python's faulthandler): hang, recompiles or slow, the log says which.
#   bash tools/gpu/liger_decoder.sh                       # GPU: llama_1b, kernels=liger, 60 steps
#   MODEL=llama_tiny KERNELS=none SEQ=64 MB=1 EXTRA="trainer.device=cpu graph=eager precision=fp32" \
#     SKIP_INSTALL=1 OUT=/tmp/out bash tools/gpu/liger_decoder.sh   # CPU: the plumbing
set -u
if [ -d .whl ] && [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
ln -sfn ../conf rapidformer/conf; ln -sfn ../recipes rapidformer/recipes
WORK=$(mktemp -d)
DATA=$(cd benchmarks && python3 -c "
import json, sys; from pathlib import Path
from _data import gpt_mmap_data
print(json.dumps(gpt_mmap_data(Path(sys.argv[1]), float(sys.argv[2]), vocab_size=50257)))
" "$WORK" "${MB:-40}" 2>$OUT/liger_data.log | tail -1) || { tail $OUT/liger_data.log; exit 1; }
field() { python3 -c "import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$DATA" "$1"; }
TORCH_LOGS=recompiles,graph_breaks PYTHONFAULTHANDLER=1 timeout -s ABRT ${HLIMIT:-240} \
  python3 -m rapidformer +recipe=llama_pretrain model=${MODEL:-llama_1b} \
  data.path=$(field prefix) model.tokenizer=$(field vocab) model.merge_file=$(field merges) \
  data.max_seq_length=${SEQ:-2048} trainer.train_iters=${ITERS:-60} trainer.micro_batch_size=${MICRO:-8} \
  trainer.global_batch_size=${MICRO:-8} trainer.log_interval=5 trainer.eval_iters=1 \
  trainer.export_hf=false trainer.save_last=false trainer.progress_bar=false \
  kernels=${KERNELS:-liger} ${EXTRA:-} trainer.output_dir=$WORK/run > $OUT/liger_decoder.log 2>&1
echo "liger-decoder rc=$?" | tee -a $OUT/env.txt
grep -c "Recompiling\|recompil" $OUT/liger_decoder.log | sed 's/^/recompile lines: /'
tail -c 4000 $OUT/liger_decoder.log
rm -rf "$WORK"
