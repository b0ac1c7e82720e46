#!/bin/bash
# Slurm epilog: close the job's account with the node's zeus_async agent and leave its GPU
# energy where the user and the accounting will find it:
#
#   * AdminComment: zeus_energy_j=<joules> (zeus_energy_j.<node>=<joules> per node when the job
#     ran on several), kept beside what other tools wrote there: sacct -o JobID,AdminComment%60
#   * <the job's output directory>/zeus-energy-<jobid>.json (zeus-energy-<jobid>.<node>.json
#     per node when the job ran on several), written as the job's user: the directory of the
#     job's StdOut, else its WorkDir.
#
# slurm.conf:  Epilog=/etc/slurm/zeus-async-epilog.sh
# Runs as root on every node of the job. It never fails the job or drains the node: whatever
# goes wrong is logged (syslog, tag zeus-async-slurm) and the script exits 0.
#
# Settings, from the environment or /etc/default/zeus-async (ZEUS_ASYNC_SLURM_ENV):
#   ZEUS_ASYNC_SOCKET   the agent's socket (default /run/zeus-async/agent.sock)
#   ZEUS_ASYNC_BIN      the zeus-async command (default: zeus-async on PATH, /usr/local/bin)
#   ZEUS_ASYNC_TIMEOUT  seconds to wait for the agent and for scontrol (default 10)

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

# field LINE KEY: the value of KEY= in `scontrol show job -o`'s one line (values may hold
# spaces: a value ends where the next " Key=" begins; Slurm's keys start with a capital).
field() {
    printf '%s\n' "$1" | sed -n "s/^\(.* \)\{0,1\}$2=\(.*\)\$/\2/p" | sed 's/ [A-Z][A-Za-z_:]*=.*$//'
}

# write_as UID GID PATH: stdin to PATH as that user (root must not follow a link the user
# planted in their own directory, and may not even see the directory on a root-squashed NFS
# mount), by way of a temporary file renamed into place; cut off after $wait_s seconds (a hung
# file system).
write_as() {
    local uid="$1" gid="$2" path="$3"
    # shellcheck disable=SC2016 # expanded by the inner shell
    local script='umask 022; tmp="$1.tmp.$$"; cat > "$tmp" && mv -f -- "$tmp" "$1" || { rm -f -- "$tmp"; exit 1; }'
    if [ "$(id -u)" = 0 ] && [ "$uid" != 0 ]; then
        timeout -k 2 "$wait_s" setpriv --reuid="$uid" --regid="$gid" --init-groups -- \
            sh -c "$script" sh "$path"
    elif [ "$(id -u)" = "$uid" ]; then
        timeout -k 2 "$wait_s" sh -c "$script" sh "$path"
    else
        echo "cannot write as uid $uid while running as uid $(id -u)" >&2
        return 1
    fi
}

# AdminComment on the job's record in the accounting database (slurmdbd): 0 once written.
db_out=""
admin_comment_in_database() {
    local job="$1" comment="$2" try
    command -v sacctmgr >/dev/null 2>&1 || return 1
    for try in 1 2 3 4 5 6 7 8 9 10; do
        db_out=$(timeout "$wait_s" sacctmgr -i modify job where "jobid=$job" set "AdminComment=$comment" 2>&1)
        case "$db_out" in *"Modified jobs"*) return 0 ;; esac
        [ "$try" = 10 ] || sleep 0.5
    done
    return 1
}

main() {
    local job="${SLURM_JOB_ID:-}"
    if [ -z "$job" ]; then
        log "epilog: no SLURM_JOB_ID in the environment; nothing to report"
        return 0
    fi
    if [ -z "${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}" ]; then
        return 0 # the prolog registered nothing on this node
    fi
    local report errors
    errors=$(mktemp) || errors=/dev/null
    if ! report=$(timeout "$wait_s" "$zeus" job end --job "$job" --json 2>"$errors"); then
        log "epilog: job $job: zeus-async job end failed: $(head -c 2000 "$errors" 2>/dev/null)"
        [ "$errors" != /dev/null ] && rm -f -- "$errors"
        return 0
    fi
    [ "$errors" != /dev/null ] && rm -f -- "$errors"
    local total
    total=$(printf '%s\n' "$report" | grep -o '"energy_j"[[:space:]]*:[[:space:]]*[-+0-9.eE]*' | head -n 1 | sed 's/^.*:[[:space:]]*//')
    if [ -z "$total" ]; then
        log "epilog: job $job: no energy_j in zeus-async's report: $(printf '%s' "$report" | head -c 2000)"
        return 0
    fi

    local info
    if ! info=$(timeout "$wait_s" scontrol show job -o "$job" 2>&1); then
        log "epilog: job $job: scontrol show job failed: $info"
        info=""
    fi
    # One file and one AdminComment key per node when the job ran on several.
    local nodes node suffix="" key="zeus_energy_j"
    nodes=$(field "$info" NumNodes)
    node="${SLURMD_NODENAME:-$(hostname -s 2>/dev/null || hostname)}"
    if [ -n "$nodes" ] && [ "${nodes%%-*}" != 1 ]; then
        suffix=".$node"
        key="zeus_energy_j.$node"
    fi

    # AdminComment: our key replaced (an epilog run again), everything else kept.
    local comment kept
    comment=$(field "$info" AdminComment)
    [ "$comment" = "(null)" ] && comment=""
    kept=$(printf '%s\n' "$comment" | tr ' ' '\n' | grep -v -F -x -e "" | grep -v "^${key//./\\.}=" | tr '\n' ' ')
    kept="${kept% }"
    local out comment_new="${kept:+$kept }$key=$total"
    if ! out=$(timeout "$wait_s" scontrol update "JobId=$job" "AdminComment=$comment_new" 2>&1); then
        # The epilog runs once the job has finished, and slurmctld refuses to update a finished
        # job (Slurm 22.05: "Job has already finished"). With accounting (slurmdbd) the job's
        # record in the database can still be: sacctmgr, retried while slurmctld has not sent
        # the job's end to the database yet.
        if ! admin_comment_in_database "$job" "$comment_new"; then
            log "epilog: job $job: AdminComment not written: scontrol: $out; sacctmgr: ${db_out:-not available}"
        fi
    fi

    # The report beside the job's output, as the job's user.
    local dir stdout uid gid
    stdout=$(field "$info" StdOut)
    dir=""
    if [ -n "$stdout" ] && [ "${stdout#/}" != "$stdout" ]; then
        dir=$(dirname -- "$stdout")
        case "$dir" in *%*) dir="" ;; esac # an unexpanded pattern (%u): not a directory
    fi
    [ -z "$dir" ] && dir=$(field "$info" WorkDir)
    if [ -z "$dir" ]; then
        log "epilog: job $job: no output directory found (StdOut=$stdout); energy ${total} J not written to a file"
        return 0
    fi
    uid="${SLURM_JOB_UID:-}"
    [ -z "$uid" ] && uid=$(id -u "${SLURM_JOB_USER:-nobody}" 2>/dev/null)
    gid="${SLURM_JOB_GID:-}"
    [ -z "$gid" ] && gid=$(id -g "$uid" 2>/dev/null)
    if [ -z "$uid" ] || [ -z "$gid" ]; then
        log "epilog: job $job: the job's user is unknown; energy ${total} J not written to a file"
        return 0
    fi
    local path="$dir/zeus-energy-$job$suffix.json"
    if ! out=$(printf '%s\n' "$report" | write_as "$uid" "$gid" "$path" 2>&1); then
        log "epilog: job $job: cannot write $path as uid $uid: $out"
    fi
    return 0
}

main "$@"
exit 0
