#!/usr/bin/env bash
# rebuilds .whl-lora (47 MiB: lora.sh, mcore.sh) and .whl-unsloth (56 MiB: unsloth.sh) from the
# registry; a fresh checkout has neither (ignored folders are not kept between sessions)
set -euo pipefail
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { out=$1; shift; mkdir -p "$out"; python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" "$@"; }
dl .whl-lora hydra-core==1.3.8 omegaconf==2.3.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  trl==1.16.0 bitsandbytes==0.50.2 liger-kernel==0.8.5 megatron-core==0.16.1
python3 -m pip wheel -q --no-deps -w .whl-lora antlr4-python3-runtime==4.9.3
dl .whl-unsloth unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 \
  cut_cross_entropy==25.1.1 diffusers==0.42.1 docstring_parser==0.18.0 fsspec==2026.2.0 \
  hf_transfer==0.1.9 importlib_metadata==8.7.1 json5==0.17.3 msgspec==0.23.0 nest_asyncio==1.6.0 \
  pydantic==2.12.5 pydantic_core==2.41.5 annotated_types==0.7.0 typing_inspection==0.4.2 \
  sentencepiece==0.2.3 structlog==26.1.0 torchao==0.17.0 torchvision==0.26.0 typeguard==4.6.1 tyro==1.0.17
du -sh .whl-lora .whl-unsloth
