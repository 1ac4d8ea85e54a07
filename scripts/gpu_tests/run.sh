#!/usr/bin/env bash
# The CUDA test tiers, on a GPU machine (CI's machines have no GPU, so nothing else runs these).
#
#   bash scripts/gpu_tests/run.sh OUT_DIR            # one GPU: the quick tier (pairwise cut), <= 8 min
#   bash scripts/gpu_tests/run.sh OUT_DIR --full     # one GPU: every parametrized case (about an hour)
#   bash scripts/gpu_tests/run.sh OUT_DIR --multi    # two or more GPUs: the NCCL tier, <= 8 min
#   bash scripts/gpu_tests/run.sh - --paths [--multi] # print the test paths of a tier, run nothing
#
# The quick tier keeps, of each parametrized test, the fewest cases in which every pair of
# parameter values has run (``pytest --pairwise``, tests/tests_pairwise.py); unparametrized
# tests all run. OUT_DIR receives junit.xml, log.txt and summary.txt (pytest's closing line
# and the wall time). Extra arguments after the mode go to pytest (e.g. -x, -k NAME).
# Exit status: pytest's. INFCLIP_COMMIT names the commit in the summary where the checkout has no git history.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bash scripts/gpu_tests/run.sh OUT_DIR [--full|--multi] [pytest args]}
shift
mode=quick list=0
if [[ "${1:-}" == --paths ]]; then list=1; shift; fi
if [[ "${1:-}" == --full || "${1:-}" == --multi ]]; then mode=${1#--}; shift; fi
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled INFCLIP_TRITON_TUNE=${INFCLIP_TRITON_TUNE:-0} NCCL_NVLS_ENABLE=0

# The one-GPU tier: the files whose tests run CUDA code on a GPU machine (kernels, the loss
# engine, graphs, memory rules, locked sides, decode, offload, the eval oracle).
ONE_GPU=(
    tests/kernels
    tests/loss/test_clip_loss.py tests/loss/test_exact_positives.py tests/loss/test_duplicates.py
    tests/loss/test_duplicates_band.py tests/loss/test_siglip.py tests/loss/test_nt_xent.py
    tests/loss/test_filtering.py tests/loss/test_build_loss.py
    tests/data/test_jpeg_backends.py tests/data/test_augmentations.py
    tests/train/test_offload.py tests/train/test_sm_partition.py tests/train/test_device_decode_train.py
    tests/eval/test_eval_oracle.py tests/test_patch_embed.py
)
# The NCCL tier: the ring against the one-GPU loss, the DDP engine against one process, and a
# killed rank's resume, each on every visible GPU.
MULTI_GPU=(tests/multigpu)

# Triton's compilation is most of the quick tier's time: with pytest-xdist installed the tests
# spread over processes that compile side by side on the host's cores (one GPU is enough for
# them all; no test times anything). GPU_TEST_WORKERS=0 runs them in one process.
workers=${GPU_TEST_WORKERS:-8}
par=()
if [[ $mode != multi ]] && (( workers > 0 )) && python -c "import xdist" 2>/dev/null; then par=(-n "$workers"); fi
# Left out of the one-GPU tiers: the rings over gloo (CPU ranks, their Triton tiles in Triton's
# interpreter: what CI runs; the GPU image's older Triton interpreter fails on them, no GPU path).
cpu_rings=(-k "not on_gloo")
case $mode in
    quick) paths=("${ONE_GPU[@]}"); extra=(--pairwise "${cpu_rings[@]}") ;;
    full) paths=("${ONE_GPU[@]}"); extra=("${cpu_rings[@]}") ;;
    multi) paths=("${MULTI_GPU[@]}"); extra=() ;;
esac
if (( list )); then printf '%s\n' "${paths[@]}"; exit 0; fi
mkdir -p "$out"
start=$(date +%s)
python -m pytest -q -ra -p no:cacheprovider "${par[@]}" "${extra[@]}" --junitxml="$out/junit.xml" --durations=25 \
    "${paths[@]}" "$@" 2>&1 | tee "$out/log.txt"
status=${PIPESTATUS[0]}
{
    echo "tier: $mode  commit: ${INFCLIP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  gpus: $(nvidia-smi -L 2>/dev/null | wc -l)"
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
    grep -E '^(=+ )?[0-9]+ (passed|failed)|error' "$out/log.txt" | tail -n 1
    echo "wall: $(( $(date +%s) - start )) s  exit: $status"
} | tee "$out/summary.txt"
exit "$status"
