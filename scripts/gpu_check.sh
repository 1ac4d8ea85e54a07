#!/usr/bin/env bash
# One pass over what needs a GPU machine, logging to $OUT (default ./gpu_check_out):
#   1. the CUDA-only tests (real Triton kernels, bf16 eval),
#   2. the data pipeline throughput with 8 and 16 workers at 224 px (issue: data),
#   3. a short ViT-B/32 training run from img2dataset shards on the GPU with the gradient
#      cache, data offload, bf16 and the Triton loss (issue: trainer on GPU).
# Usage on a fresh GPU host with the repo installed:  OUT=/tmp/out bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
py=${PYTHON:-python3}

$py -m pytest -q -x tests/kernels tests/loss/test_clip_loss.py tests/eval tests/train/test_offload.py \
    -k "cuda or triton or gpu or offload" 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.txt"

shards=${SHARDS:-/tmp/infclip_bench_shards}
$py scripts/bench_data.py --root "$shards" --images 16384 --workers 8,16 --batches 40 2>&1 | tee "$OUT/bench_data.txt"

n=$(ls "$shards"/*.tar | wc -l)
spec="$shards/{00000..$(printf %05d $((n - 1)))}.tar"
$py train.py experiment=vit_b32_laion "data.shards='$spec'" data.resampled=true data.workers=14 \
    batch.global_size=8192 batch.micro_size=1024 memory.offload=true steps=30 \
    schedule.warmup_fraction=0.1 logging.every_n_steps=5 logging.wandb_mode=disabled \
    checkpoint.every_n_steps=0 eval.tasks=[] run_dir=/tmp/run_vit_b32 2>&1 | tee "$OUT/train_vit_b32.txt"
cp /tmp/run_vit_b32/metrics.jsonl "$OUT/train_vit_b32_metrics.jsonl"
