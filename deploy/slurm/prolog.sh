#!/bin/bash
# Slurm prolog: tell the node's zeus_async agent that a job now holds its GPUs, so their energy
# is the job's from the first joule, before any of its processes touches a GPU.
#
# slurm.conf:  Prolog=/etc/slurm/zeus-async-prolog.sh   PrologFlags=Alloc
# Runs as root on every node of the allocation (PrologFlags=Alloc: at allocation time).
#
# It never fails the job: a prolog that exits non-zero drains the node and requeues the job,
# and no energy figure is worth that. Whatever goes wrong is logged (syslog, tag
# zeus-async-slurm) and the script exits 0.
#
# Settings, from the environment or /etc/default/zeus-async (ZEUS_ASYNC_SLURM_ENV):
#   ZEUS_ASYNC_SOCKET   the agent's socket (default /run/zeus-async/agent.sock)
#   ZEUS_ASYNC_BIN      the zeus-async command (default: zeus-async on PATH, /usr/local/bin)
#   ZEUS_ASYNC_TIMEOUT  seconds to wait for the agent (default 10)

trap 'exit 0' EXIT

log() {
    logger -t zeus-async-slurm -p daemon.warning -- "$*" 2>/dev/null || printf '%s\n' "zeus-async-slurm: $*" >&2
}

settings="${ZEUS_ASYNC_SLURM_ENV:-/etc/default/zeus-async}"
if [ -r "$settings" ]; then
    set -a
    # shellcheck disable=SC1090
    . "$settings"
    set +a
fi
PATH="$PATH:/usr/local/sbin:/usr/local/bin"
socket="${ZEUS_ASYNC_SOCKET:-${ZEUS_ASYNC_SYSTEM_AGENT:-/run/zeus-async/agent.sock}}"
export ZEUS_ASYNC_SOCKET="$socket" ZEUS_ASYNC_SYSTEM_AGENT="$socket"
zeus="${ZEUS_ASYNC_BIN:-zeus-async}"
wait_s="${ZEUS_ASYNC_TIMEOUT:-10}"

main() {
    local job="${SLURM_JOB_ID:-}" gpus
    if [ -z "$job" ]; then
        log "prolog: no SLURM_JOB_ID in the environment; nothing registered"
        return 0
    fi
    # The GPUs of this node allocated to the job, as the agent's (NVML's) indices.
    gpus="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
    if [ -z "$gpus" ]; then
        return 0 # no GPU of this node is the job's: nothing to attribute
    fi
    local args=(job start --job "$job" --gpus "$gpus")
    [ -n "${SLURM_JOB_USER:-}" ] && args+=(--user "$SLURM_JOB_USER")
    [ -n "${SLURM_JOB_UID:-}" ] && args+=(--uid "$SLURM_JOB_UID")
    [ -n "${SLURM_JOB_PARTITION:-}" ] && args+=(--partition "$SLURM_JOB_PARTITION")
    local out
    if ! out=$(timeout "$wait_s" "$zeus" "${args[@]}" 2>&1); then
        log "prolog: job $job: zeus-async job start failed: ${out:-no output (timed out after ${wait_s} s?)}"
    fi
    return 0
}

main "$@"
exit 0
