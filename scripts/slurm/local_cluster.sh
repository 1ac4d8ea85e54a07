#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests: Debian's slurmctld, slurmd and munge
# (installed with apt when missing; root only), a partition `debug` with this host's CPUs and
# NGPU placeholder GPUs (a GRES whose device files are empty files), so that sbatch
# --gpus-per-node=N resolves on a CPU host.
#
#   eval "$(scripts/slurm/local_cluster.sh start)"    # prints SLURM_CONF=...; export it for the clients
#   scripts/slurm/local_cluster.sh stop
#
# State, logs and the config live in DIR (default /tmp/infclip-slurm). Exit status 3: the
# cluster cannot start here (not root, no apt, daemons failing); the reason is on stderr.
set -euo pipefail
CMD="${1:-start}"
DIR="${2:-${INFCLIP_SLURM_DIR:-/tmp/infclip-slurm}}"
NGPU="${NGPU:-2}"
HOST="$(hostname -s)"
fail() { echo "local_cluster: $*" >&2; exit 3; }

if [[ "$CMD" == "stop" ]]; then
  for daemon in slurmd slurmctld; do
    [[ -f "$DIR/$daemon.pid" ]] && kill "$(cat "$DIR/$daemon.pid")" 2>/dev/null || true
  done
  exit 0
fi
[[ "$CMD" == "start" ]] || fail "usage: $0 start|stop [DIR]"
[[ "$(id -u)" == 0 ]] || fail "needs root (it starts slurmctld, slurmd and munged)"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
  command -v apt-get >/dev/null || fail "slurmctld/slurmd/munge are not installed and there is no apt-get"
  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q slurmd slurmctld slurm-client munge \
    >"/tmp/infclip-slurm-apt.log" 2>&1 || fail "apt-get install failed (see /tmp/infclip-slurm-apt.log)"
fi
mkdir -p "$DIR"/{state,spool,log,dev}
for ((i = 0; i < NGPU; i++)); do : >"$DIR/dev/gpu$i"; done

# munge: the authentication Slurm's daemons and clients share
if ! munge -n </dev/null >/dev/null 2>&1; then
  if [[ ! -s /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  su -s /bin/sh munge -c munged 2>/dev/null || munged --force || fail "munged does not start"
  for _ in $(seq 20); do munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.5; done
  munge -n </dev/null >/dev/null 2>&1 || fail "munge does not answer"
fi

CPUS="$(nproc)"
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat >"$DIR/slurm.conf" <<EOF
ClusterName=infclip
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6917}
SlurmdPort=${SLURMD_PORT:-6918}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
JobRequeue=1
ReturnToService=2
MpiDefault=none
KillWait=30
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM Gres=gpu:$NGPU State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
echo "NodeName=$HOST Name=gpu File=$DIR/dev/gpu[0-$((NGPU - 1))]" >"$DIR/gres.conf"
export SLURM_CONF="$DIR/slurm.conf"
"$0" stop "$DIR"
slurmctld -f "$SLURM_CONF" || fail "slurmctld does not start (see $DIR/log/slurmctld.log)"
slurmd -f "$SLURM_CONF" || fail "slurmd does not start (see $DIR/log/slurmd.log)"
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
  sleep 1
done
fail "the node did not come up: $(sinfo -h -o '%T %E' 2>&1 | head -1) (see $DIR/log/)"
