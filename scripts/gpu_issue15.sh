#!/usr/bin/env bash
# Issue 15's one GPU call (device machine, run from a copy of the repo at .gpu15 beside ../.whl):
# GPU exactness tests (real kernels) and the CLIP bench table in one run; results in $OUT.
#   bash scripts/gpu_issue15.sh <commit>
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ../.whl/*.whl
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
(cd /tmp && python3 -c 'import infclip, infclip.kernels, triton, torch; print(infclip.kernels.__file__, triton.__version__, torch.__version__)')
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee $OUT/device.txt
INFCLIP_TRITON_TUNE=0 timeout "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/loss/test_exact_positives.py \
    tests/kernels/test_clip_kernels.py tests/kernels/test_nt_xent_kernels.py 2>&1 | tail -40 > $OUT/tests.txt
tail -5 $OUT/tests.txt
timeout "${BENCH_S:-200}" python3 scripts/bench_loss.py --batches 16384,32768,65536,131072 --dims 512,1024,768 \
    --impls triton_bf16,vanilla_bf16,local_bf16,inf_cl --reps 3 --max-s 12 --commit "$1" --out $OUT 2>&1 \
    | grep -v Warning > $OUT/bench.txt
grep -E "triton|vanilla|local|inf_cl|peak" $OUT/bench.txt | tail -60
