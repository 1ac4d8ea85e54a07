#!/usr/bin/env bash
# Where the threads of one of our training runs spend a steady step, on a GPU machine: py-spy
# (every thread, idle included, then only GIL holders), two py-spy dumps, `nvidia-smi dmon -s u`
# (SM and JPEG-engine utilisation) and `top -H`, all sampled after step 2 has logged.
#
#   SPY_EXP=lit_b16_cc12m SPY_BATCH=65536 bash scripts/gpu_spy_run.sh '/tmp/photos256/{00000..00031}.tar' [overrides...]
#
# Needs py-spy (carry its wheel in .whl; `pip download py-spy` gives a manylinux binary) and the
# shards (scripts/gpu_real_data.sh PARTS=setup,shards). Writes into $OUT: spy_train.txt (the
# run's log), spy_idle.txt / spy_gil.txt (py-spy raw collapsed stacks: "thread;frame;... count"),
# spy_dump.txt, spy_util.txt (dmon + top). Summarise a raw file per thread with:
#   python3 scripts/gpu_spy_run.py $OUT/spy_idle.txt
set -o pipefail
SPEC="$1"; shift
OUT="${OUT:-/tmp/spy_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NVIMGCODEC_LOG_LEVEL=1
SPY="$(dirname "$(command -v python3)")/py-spy"
[[ -x "$SPY" ]] || SPY="$(command -v py-spy)" || { echo "py-spy is not installed (carry its wheel)"; exit 2; }
run_dir=/tmp/spy_run; rm -rf "$run_dir"
python3 train.py experiment="${SPY_EXP:-lit_b16_cc12m}" "data.shards='$SPEC'" data.resampled=true data.workers=14 \
  data.loader_batch=256 batch.global_size="${SPY_BATCH:-65536}" batch.micro_size=1024 memory.offload=true \
  steps="${SPY_STEPS:-4}" schedule.warmup_fraction=0 logging.every_n_steps=1 logging.progress=false \
  logging.wandb_mode=disabled checkpoint.every_n_steps=0 'eval.tasks=[]' run_dir="$run_dir" model.compile=true \
  "$@" > "$OUT/spy_train.txt" 2>&1 &
pid=$!
for _ in $(seq 1 400); do grep -q "step      2/" "$OUT/spy_train.txt" && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
nvidia-smi dmon -s u -c 12 > "$OUT/spy_util.txt" 2>&1 &
dmon=$!
"$SPY" record --pid $pid --threads --idle --rate 100 --duration "${SPY_S:-14}" --format raw -o "$OUT/spy_idle.txt" --nonblocking > /dev/null 2>&1
top -b -n 1 -H -w 200 | head -40 >> "$OUT/spy_util.txt"
"$SPY" record --pid $pid --threads --gil --rate 100 --duration 8 --format raw -o "$OUT/spy_gil.txt" --nonblocking > /dev/null 2>&1
{ "$SPY" dump --pid $pid; sleep 2; "$SPY" dump --pid $pid; } > "$OUT/spy_dump.txt" 2>&1
wait $dmon; wait $pid
grep "step \|^data:" "$OUT/spy_train.txt" | cut -c1-250
for f in spy_idle spy_gil; do [[ -s "$OUT/$f.txt" ]] && python3 scripts/gpu_spy_run.py "$OUT/$f.txt"; done
