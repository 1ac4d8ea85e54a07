#!/usr/bin/env bash
# Issue 27 on a GPU machine, in one call: the Gluon kernels checked, then timed against the
# Triton ones inside the loss, then the duplicates' cost. Each part has its own timeout; results
# in $OUT (env.txt strip.txt tests.txt bench_<mode>.txt dup.txt band.txt fixed.txt ncu.txt).
#
#   bash scripts/gpu_gluon_checks.sh <commit>                       # all parts: ~15 min at the defaults
#   PARTS=setup,strip,tests bash scripts/gpu_gluon_checks.sh <commit>   # so, two calls of < 10 min:
#   PARTS=bench,dup,band bash scripts/gpu_gluon_checks.sh <commit>      # (the second on the warm machine)
#
# Parts:
#   setup  - install the carried wheels (.whl/*.whl) and this checkout (as gpu_real_data.sh)
#   strip  - scripts/check_gluon_strip.py: the Gluon strip fill against the Triton one (P in bf16
#            ulps, ds), both timed; must pass before ops.STRIP_KERNEL_DEFAULT changes
#   tests  - the exactness tests with both Gluon kernels forced wherever they apply
#            (INFCLIP_TRITON_TUNE=0: the first candidate, i.e. the Gluon config), then the graphs'
#            and the one-pass backward's tests (memory rule included) in the default modes
#   bench  - scripts/bench_loss.py, CLIP loss forward + backward, bf16: INFCLIP_STRIP_KERNEL=triton
#            and =auto (the tuner times the Gluon fill too), one process each (MODES to choose)
#   dup    - scripts/bench_loss.py --duplicates --breakdown (mask / positive against off)
#   band   - duplicates "mask" in the Gluon kernels (forced only until this passes: ops.GLUON_BAND_AUTO):
#            check_gluon_fwd.py --band and check_gluon_strip.py --band against the Triton band
#            kernels, then bench_loss.py --duplicates --breakdown with both Gluon kernels forced
#   fixed  - the Gluon forward's two epilogues timed (scripts/check_gluon_fwd.py, b = 32k and 64k):
#            at s = 1/0.07 (the fixed reference's flag on) and at s = 100 with one anti-aligned
#            pair (flag off: the running max inside the variant that holds both); not in the
#            default PARTS
#   anchors - scripts/bench_loss.py, ours beside every anchor (vanilla bf16, open_clip local,
#            inf-cl 1.2.1, memeff 0.3.1: their wheels in .whl/, installed by setup) at
#            ANCHOR_BATCHES (8k..1M) x DIMS, one process; not in the default PARTS
#   ncu    - Nsight Compute on the Gluon forward, plain vs band (scripts/profile_gluon_fwd.py):
#            the L2 hypothesis for the band's 7-10 % (the sections SpeedOfLight, MemoryWorkload-,
#            ComputeWorkloadAnalysis, LaunchStats, Occupancy); not in the default PARTS
# Knobs: STRIP_S TESTS_S TESTS2_S BENCH_S DUP_S BAND_S FIXED_S ANCHORS_S NCU_S (seconds per part),
#        BATCHES DIMS MODES ANCHOR_BATCHES,
#        NCU_DIMS NCU_B (the ncu part's c list and b); CALL_S (default 585): the seconds this
#        invocation may take in all: every part's limit is cut to what is left of it, so a
#        device call of 600 s returns its results instead of being killed with them.
set -o pipefail
START=$(date +%s)
CALL_S="${CALL_S:-585}"
# lim N: N seconds, or what is left of CALL_S (less 5 s to pack the results) if that is less
lim() { local left=$(( CALL_S - ($(date +%s) - START) - 5 )); (( left < 1 )) && left=1; echo $(( $1 < left ? $1 : left )); }
PARTS="${PARTS:-setup,strip,tests,bench,dup,band}"
COMMIT="${1:-unknown}"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1
if has setup; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
fi
{ echo "commit $COMMIT"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} | tee -a $OUT/env.txt
if has strip; then
  timeout "$(lim ${STRIP_S:-150})" $PY -u scripts/check_gluon_strip.py > $OUT/strip.txt 2>&1
  echo "rc=$? (124: cut by STRIP_S)" >> $OUT/strip.txt
  tail -5 $OUT/strip.txt
fi
if has tests; then
  INFCLIP_TRITON_TUNE=0 INFCLIP_FORWARD_KERNEL=gluon INFCLIP_STRIP_KERNEL=gluon timeout "$(lim ${TESTS_S:-200})" \
      $PY -m pytest -q -p no:cacheprovider -rf tests/kernels/test_gluon_fwd_cpu.py tests/kernels/test_gluon_strip_cpu.py \
      tests/loss/test_exact_positives.py tests/kernels/test_clip_kernels.py tests/loss/test_duplicates.py \
      tests/loss/test_duplicates_band.py \
      > $OUT/tests.txt 2>&1
  echo "forced Gluon: pytest rc=$? (124: cut by TESTS_S)" >> $OUT/tests.txt
  timeout "$(lim ${TESTS2_S:-150})" $PY -m pytest -q -p no:cacheprovider -rf tests/kernels/test_clip_graphs.py tests/kernels/test_clip_onepass.py \
      >> $OUT/tests.txt 2>&1
  echo "graphs and one-pass memory, default modes: pytest rc=$?" >> $OUT/tests.txt
  grep -E "rc=|passed|failed" $OUT/tests.txt
fi
if has bench; then
  for mode in ${MODES:-triton auto}; do
    INFCLIP_STRIP_KERNEL=$mode timeout "$(lim ${BENCH_S:-100})" $PY -u scripts/bench_loss.py \
        --batches "${BATCHES:-32768,65536,131072}" --dims "${DIMS:-512,768,1024}" --impls triton_bf16 --reps 3 \
        --commit "$COMMIT" --out /tmp/bench_$mode > $OUT/bench_$mode.txt 2>&1
    echo "rc=$?" >> $OUT/bench_$mode.txt
    grep -E "peak|rc=" $OUT/bench_$mode.txt
  done
fi
if has dup; then
  timeout "$(lim ${DUP_S:-120})" $PY -u scripts/bench_loss.py --duplicates --breakdown --commit "$COMMIT" --out /tmp/dup \
      > $OUT/dup.txt 2>&1
  echo "rc=$?" >> $OUT/dup.txt
  tail -12 $OUT/dup.txt
fi
if has band; then
  { timeout "$(lim ${BAND_S:-120})" $PY -u scripts/check_gluon_fwd.py --band; echo "forward rc=$?"
    timeout "$(lim ${BAND_S:-120})" $PY -u scripts/check_gluon_strip.py --band; echo "strip rc=$?"
    INFCLIP_FORWARD_KERNEL=gluon INFCLIP_STRIP_KERNEL=gluon timeout "$(lim ${BAND_S:-120})" $PY -u scripts/bench_loss.py \
        --duplicates --breakdown --commit "$COMMIT" --out /tmp/dup_gluon; echo "bench rc=$?"
  } > $OUT/band.txt 2>&1
  grep -E "rc=|mask|FAIL" $OUT/band.txt | tail -20
fi
if has fixed; then
  { timeout "$(lim ${FIXED_S:-120})" $PY -u scripts/check_gluon_fwd.py --sizes 32768,65536; echo "s=1/0.07 rc=$?"
    timeout "$(lim ${FIXED_S:-120})" $PY -u scripts/check_gluon_fwd.py --sizes 32768,65536 --scale 100 --flip 1
    echo "s=100 flip rc=$?"; } > $OUT/fixed.txt 2>&1
  grep -E "rc=|fixed=.*ms" $OUT/fixed.txt | tail -30
fi
if has anchors; then
  timeout "$(lim ${ANCHORS_S:-400})" $PY -u scripts/bench_loss.py \
      --batches "${ANCHOR_BATCHES:-8192,16384,32768,65536,131072,262144,1048576}" --dims "${DIMS:-512,768,1024}" \
      --impls triton_bf16,vanilla_bf16,local_bf16,inf_cl,memeff --reps 3 --max-s 30 \
      --commit "$COMMIT" --out /tmp/anchors > $OUT/anchors.txt 2>&1
  echo "rc=$? (124: cut by ANCHORS_S)" >> $OUT/anchors.txt
  cp /tmp/anchors/bench_loss.csv $OUT/anchors.csv 2>/dev/null
  grep -E "peak|skipped|not installed|rc=" $OUT/anchors.txt | tail -40
fi
if has ncu; then
  # Nsight Compute on the Gluon forward, plain then band, one launch each per c (the NVTX range
  # "prof" of scripts/profile_gluon_fwd.py): speed of light, memory workload (L2 traffic),
  # compute workload. Clocks left alone (--clock-control none: the device README's rule).
  if command -v ncu > /dev/null; then
    { timeout "$(lim ${NCU_S:-240})" ncu --clock-control none --nvtx --nvtx-include "prof/" -k regex:_lse_fwd_ws_kernel \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section LaunchStats --section Occupancy \
        $PY -u scripts/profile_gluon_fwd.py --dims "${NCU_DIMS:-512,1024}" --batch "${NCU_B:-32768}"
      echo "ncu rc=$? (124: cut by NCU_S)"; } > $OUT/ncu.txt 2>&1
  else
    echo "ncu is not on the PATH here: no hardware counters" > $OUT/ncu.txt
  fi
  grep -E "rc=|plain|band |L2 Hit|Memory Throughput|Compute \(SM\)|Registers" $OUT/ncu.txt | head -40
fi
