#!/bin/bash
# One torchrun per node, started on every node by `srun` in train.sbatch. torchrun spawns
# one training process per GPU and sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* for them
# (torch.distributed env:// rendezvous).
#
# Reads (exported by train.sbatch): NNODES GPUS_PER_NODE MASTER_ADDR MASTER_PORT RDZV_BACKEND
# MAX_RESTARTS INFCLIP_REPO, and Slurm's SLURM_NODEID / SLURM_JOB_ID. Arguments: train.py
# overrides. DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

: "${NNODES:?}" "${GPUS_PER_NODE:?}" "${MASTER_ADDR:?}" "${MASTER_PORT:?}"
NODE_RANK="${SLURM_NODEID:?SLURM_NODEID is not set: run this under srun (see train.sbatch)}"
RDZV_BACKEND="${RDZV_BACKEND:-static}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
REPO="${INFCLIP_REPO:-$(pwd)}"

# The launcher: infclip's torchrun (torchrun's arguments; a stop signal ends with every rank's
# checkpoint and status 0 instead of torchrun's SignalException traceback and status 1:
# docs/launch.md, "Stopping a torchrun run"). INFCLIP_LAUNCHER=torchrun runs plain torchrun.
read -r -a LAUNCHER <<< "${INFCLIP_LAUNCHER:-${PYTHON:-python} -m infclip.launch}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # infclip.launch from this checkout, installed or not
cmd=("${LAUNCHER[@]}" --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" --max_restarts="$MAX_RESTARTS")
if [[ "$RDZV_BACKEND" == "c10d" ]]; then
  # Elastic rendezvous: ranks are assigned at rendezvous; survives per-node restarts better.
  cmd+=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${SLURM_JOB_ID:-infclip}")
else
  # Static: node ranks follow Slurm's node order, the first node hosts the store.
  cmd+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
fi
cmd+=("$REPO/train.py" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
# The launcher must outlive Slurm's warning signal (USR1's default action would kill it and
# orphan the workers), so it starts with USR1 ignored. Its workers run in sessions of their
# own, so depending on Slurm's proctrack plugin a signal to the job step may not reach them:
# this shell forwards USR1 to them itself (they finish the step, checkpoint, exit 0, and
# rank 0 requeues), and SIGTERM to the launcher (which passes it on once and exits with the
# workers' status; plain torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT before SIGKILL). A
# worker handles USR1 more than once fine.
(trap '' USR1; exec "${cmd[@]}") &
TORCHRUN_PID=$!
trap 'pkill -USR1 -P "$TORCHRUN_PID" || true' USR1
trap 'kill -TERM "$TORCHRUN_PID" 2>/dev/null || true' TERM
rc=0
while true; do  # `wait` returns early when a trapped signal arrives
  wait "$TORCHRUN_PID" && rc=0 || rc=$?
  kill -0 "$TORCHRUN_PID" 2>/dev/null || break
done
exit "$rc"
