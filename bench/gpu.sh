#!/usr/bin/env bash
# On a CUDA machine: train_backends on the GPU within 8 minutes; JSON and markdown go to the folder in $1.
# The machine may lack onnxruntime-training: the report then says why ORT did not run.
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUTPUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
timeout 480 python -m bench.train_backends --device cuda --batch 64 --seq 128 --steps 20 --rounds 5 --out "$out"
