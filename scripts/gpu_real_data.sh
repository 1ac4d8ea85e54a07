#!/usr/bin/env bash
# The real-data benchmarks on a GPU machine, in one call: real-photo shards, the device JPEG
# decoders side by side, and the trainers (open_clip's and ours) on the same shards.
# Results go to $OUT (tables and logs; at most 8 files come back from the device tool).
#
#   PARTS=setup,shards,decode bash scripts/gpu_real_data.sh <commit>
#   PARTS=setup,shards,train RUNS='openclip_compile:32768,ours_compile:32768' SIDE=256 bash scripts/gpu_real_data.sh <commit>
#
# Parts:
#   setup  - install the carried wheels (.whl/*.whl, into the image's own site-packages: the
#            nvidia-* wheels share the `nvidia` package folder with torch's CUDA libraries)
#            and this checkout (no deps). Carry webdataset==0.2.86: open_clip_train 3.3's loader
#            fails on later versions' end-of-shard marker (scripts/bench_trainer.py checks)
#   shards - data/write_photo_shards.py: N256 samples at 256 px and N512 at 512 px from the
#            photos in PHOTOS (a folder exported with --export-photos; the GPU image has no
#            scikit-image photos bundled the same way), into /tmp/photos256 and /tmp/photos512
#   decode - scripts/bench_decode.py at both sides (hardware, cuda, nvjpeg)
#   loader - scripts/bench_data.py-style loader-alone rates for decode=cpu and device (14 workers)
#   partition - data.decode_reserved_sms: scripts/check_sm_partition.py (green-context stream:
#            same results, matmul / tower rates), then bench_decode.py with the matmuls on all
#            SMs and on all but RESERVE_SMS (default 0,4,12) beside the hardware decoder
#   probe  - scripts/probe_decode_formats.py on the SIDE-px shards (RGB / RGB without fancy
#            upsampling / planar YCbCr on the engines: kernels per image, rates beside matmuls)
#   train  - scripts/bench_trainer.py RUNS on the SIDE-px shards
# Knobs: N256 N512 SHARD_SIDES DECODE_SIDES SIDE RUNS STEPS WORKERS PHOTOS PHOTO_SCRIPT (a folder holding
#        data/write_photo_shards.py and its infclip, when not this checkout) TRAIN_S
#        CHECK_RESERVE RESERVE_SMS (the partition part: at most 150 + 240 s)
#        PROFILE_STEP (train: profile that step of our runs; summaries OUT/profile_*.md)
set -o pipefail
PARTS="${PARTS:-setup,shards,decode}"
COMMIT="${1:-unknown}"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NVIMGCODEC_LOG_LEVEL=1
if has setup; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | grep -v WARNING
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
fi
{ echo "commit $COMMIT"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  $PY -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'
} | tee -a $OUT/env.txt
if has shards; then
  ps="${PHOTO_SCRIPT:-.}"
  for side in ${SHARD_SIDES:-256 512}; do
    n=$([[ $side == 256 ]] && echo "${N256:-32768}" || echo "${N512:-16384}")
    [[ -f /tmp/photos$side/sizes.json ]] && continue
    (( n / 1024 < ${WORKERS:-14} )) && echo "warning: $((n / 1024)) shards of 1,024 for ${WORKERS:-14} loader workers: the loader may not keep up (use N$side >= $(( ${WORKERS:-14} * 1024 )))" | tee -a $OUT/shards.txt
    (cd "$ps" && PYTHONPATH=. timeout 300 $PY data/write_photo_shards.py --photos "${PHOTOS:-.gpu/photo_src}" \
        --out /tmp/photos$side --num-samples "$n" --shard-size 1024 --side $side --workers 16) 2>&1 | tail -6 | tee -a $OUT/shards.txt
  done
fi
spec() { n=$(ls /tmp/photos$1/*.tar | wc -l); printf '/tmp/photos%s/{00000..%05d}.tar' "$1" $((n - 1)); }
if has decode; then
  for side in ${DECODE_SIDES:-256 512}; do
    echo "== $side px" | tee -a $OUT/decode.txt
    timeout 200 $PY scripts/bench_decode.py --shards "$(spec $side)" --overlap-s 3 2>&1 \
        | grep -v "^\[\|WARNING" | tee -a $OUT/decode.txt
  done
fi
if has partition; then
  timeout 150 $PY scripts/check_sm_partition.py --reserve "${CHECK_RESERVE:-4,12}" 2>&1 | grep -v "Warning" | tee -a $OUT/partition.txt
  timeout 240 $PY scripts/bench_decode.py --shards "$(spec ${SIDE:-256})" --backends hardware --threads 2 \
      --reserve-sms "${RESERVE_SMS:-0,4,12}" --overlap-s 3 2>&1 | grep -v "^\[\|WARNING" | tee -a $OUT/partition.txt
fi
if has probe; then
  timeout 240 $PY scripts/probe_decode_formats.py --shards "$(spec ${SIDE:-256})" 2>&1 \
      | grep -v "^\[\|WARNING" | tee -a $OUT/probe.txt
fi
if has train; then
  # the runs' logs reach $OUT every 15 s too: a call cut off at its time limit keeps what ran
  rm -rf /tmp/bench_trainer_logs
  ( while sleep 15; do tail -n 60 /tmp/bench_trainer_logs/*.log > $OUT/.train_logs.tmp 2>/dev/null \
      && mv $OUT/.train_logs.tmp $OUT/train_logs.txt; done ) &
  live=$!
  timeout "${TRAIN_S:-560}" $PY scripts/bench_trainer.py --shards "$(spec ${SIDE:-256})" --workers "${WORKERS:-14}" \
      --runs "${RUNS:-openclip_compile:32768,ours_compile:32768}" --steps "${STEPS:-4}" --out $OUT \
      --timeout "${RUN_S:-300}" --profile-step "${PROFILE_STEP:-0}" 2>&1 | grep -v "^\[\|WARNING" | tee -a $OUT/train.txt
  kill $live 2>/dev/null; wait $live 2>/dev/null; rm -f $OUT/.train_logs.tmp
  tail -n 60 /tmp/bench_trainer_logs/*.log > $OUT/train_logs.txt 2>/dev/null
fi
