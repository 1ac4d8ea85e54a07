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

cmd=(torchrun --nnodes="$NNODES" --nproc_per_node="$GPUS_PER_NODE" --max_restarts="$MAX_RESTARTS")
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
# torchrun must outlive Slurm's warning signal (its default action would kill it and
# orphan the workers); ignoring it here is inherited, and the training processes install
# their own SIGUSR1 handler (finish the step, checkpoint, exit 0, requeue).
trap '' USR1
exec "${cmd[@]}"
