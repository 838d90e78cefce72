#!/usr/bin/env bash
# On a CUDA machine: what a GPU user cares about, within about 7 minutes, with only what is on the machine
# (no network): train_backends on BERT-base- and GPT-2-small-sized models, eager fp32 / bf16 / fused AdamW /
# torch.compile / ORT / auto, MFU against the bf16 and fp32 matmul peaks measured in the same run. Where
# onnxruntime-training is missing (it has wheels for Python 3.11 and CUDA 11.8 only) the ORT rows say so.
# JSON and markdown go to the folder in $1.
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUTPUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
timeout "${GPU_BENCH_S:-420}" python3 -m bench.train_backends --device cuda --models bert-base,gpt2-small --batch 32 \
  --max-len 256 --steps 10 --warmup 3 --rounds 3 --job-steps 20000 --out "$out"
