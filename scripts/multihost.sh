#!/usr/bin/env bash
# The demo's train -> save -> resume-on-another-world-size path on two hosts, simulated on
# one machine: two network namespaces joined by a veth pair (10.203.0.1/24 and
# 10.203.0.2/24), one torchrun agent in each, rendezvous over c10d at 10.203.0.1:PORT, Gloo
# on the veth (GLOO_SOCKET_IFNAME). The namespaces share the filesystem, so the checkpoint
# folder is a local path both hosts see; each host gets a memory folder of its own
# (SHARDKIT_MEMORY_DIR, under /dev/shm) for CheckpointManager's memory tier. Needs root and
# iproute2 (`ip netns`, veth).
#
#   scripts/multihost.sh [--out DIR] [--steps N] [--port P] [--kill-host1 | --lose-host1]
#
# Stages (scripts/demo.py --phase ...):
#   reference  one process, unsharded: the losses and weights every stage is checked against
#   train      2 hosts x 2 ranks (world 4): shard, train, CheckpointManager saves
#   resume     2 hosts x 1 rank (world 2), another spec: load the latest step, train on, save
#   export     one process: consolidate and check against the reference
#
# --kill-host1 runs the failure case instead: during training, SIGKILL host 1's agent and
# its workers (every process in its namespace) and time how long host 0's job takes to
# fail; it must fail within the timeout (--fail-timeout, 120 s) with its error in its log.
#
# --lose-host1 runs the memory tier's case instead (scripts/multihost_memory.py, 2 hosts x 2
# ranks, every step in memory with a replica on the other host): during training, SIGKILL host
# 1's processes and delete its memory folder; once host 0's job has failed, start the job again
# on both hosts. It must resume from memory, host 1's ranks receiving their parts from host 0
# over the network and no rank reading storage, with the state saved at that step, bit for bit,
# and leave both memory folders empty when it finishes.
#
# Logs go to OUT/logs/<stage>-host<i>.log; the last line is a summary:
#   multihost: ok ...                      every stage passed
#   multihost: host 0 failed after S s ... (--kill-host1) the survivor's exit code and delay
#   multihost: ok: host 1 lost ...         (--lose-host1) the resume and where its bytes came from
# Exit code 0 when the run went as intended (all stages passed, or the survivor failed in time).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/out/multihost"
STEPS=
PORT=29500
KILL=0
LOSE=0
FAIL_TIMEOUT=120
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --steps) STEPS="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --kill-host1) KILL=1; shift ;;
        --lose-host1) LOSE=1; shift ;;
        --fail-timeout) FAIL_TIMEOUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "multihost: unknown argument '$1'; see --help" >&2; exit 2 ;;
    esac
done

# The failure case trains long enough that training is still running when host 1 goes away.
[ -n "$STEPS" ] || { [ "$KILL" = 1 ] && STEPS=100 || { [ "$LOSE" = 1 ] && STEPS=40; } || STEPS=2; }

if [ "$(id -u)" != 0 ]; then
    echo "multihost: needs root to create network namespaces (running as uid $(id -u)); run it with sudo" >&2
    exit 77
fi
if ! command -v ip >/dev/null 2>&1; then
    echo "multihost: needs the 'ip' command (iproute2) to create network namespaces" >&2
    exit 77
fi
if [ -z "${SHARDKIT_PYTHON:-}" ]; then
    source "$ROOT/scripts/setup_env.sh"
fi
PYTHON="$SHARDKIT_PYTHON"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"

# Names unique to this run, so runs in parallel do not collide (interface names: 15 chars at most).
ID="$$"
NS=("shardkit-h0-$ID" "shardkit-h1-$ID")
VETH=("skh0-$ID" "skh1-$ID")
ADDR=("10.203.0.1" "10.203.0.2")
MEMORY="/dev/shm/shardkit-multihost-$ID"  # host<i>/: host i's memory folder

cleanup() {
    local ns pid
    for ns in "${NS[@]}"; do
        if ip netns list 2>/dev/null | grep -qw "$ns"; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    ip link del "${VETH[0]}" 2>/dev/null || true
    rm -rf "$MEMORY"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! ip netns add "${NS[0]}" 2>/dev/null || ! ip netns add "${NS[1]}" 2>/dev/null \
        || ! ip link add "${VETH[0]}" type veth peer name "${VETH[1]}" 2>/dev/null; then
    echo "multihost: cannot create network namespaces joined by a veth pair here (ip netns add / ip link add ... type veth failed)" >&2
    exit 77
fi
for i in 0 1; do
    ip link set "${VETH[$i]}" netns "${NS[$i]}"
    ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${VETH[$i]}"
    ip -n "${NS[$i]}" link set "${VETH[$i]}" up
    ip -n "${NS[$i]}" link set lo up
done

demo=(scripts/demo.py --out "$OUT" --steps "$STEPS" --seed 0)
env_common=(env "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")

# Start one torchrun agent per host for a stage, running the demo's phase of that name or the
# command given after it; sets AGENT[0], AGENT[1].
start_agents() {
    local stage="$1" nproc="$2" command=("${@:3}") i
    [ "${#command[@]}" -gt 0 ] || command=("${demo[@]}" --phase "$stage")
    mkdir -p "$MEMORY/host0" "$MEMORY/host1"
    for i in 0 1; do
        ip netns exec "${NS[$i]}" "${env_common[@]}" "GLOO_SOCKET_IFNAME=${VETH[$i]}" \
            "SHARDKIT_MEMORY_DIR=$MEMORY/host$i" \
            "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node "$nproc" --max-restarts 0 \
            --rdzv-backend c10d --rdzv-endpoint "${ADDR[0]}:$PORT" --rdzv-id "shardkit-$ID-$stage" \
            --rdzv-conf "is_host=$((1 - i)),join_timeout=60" --local-addr "${ADDR[$i]}" \
            "${command[@]}" > "$OUT/logs/$stage-host$i.log" 2>&1 &
        AGENT[$i]=$!
    done
}

run_local() {
    local stage="$1"
    echo "multihost: $stage (one process)"
    (cd "$ROOT" && "${env_common[@]}" "$PYTHON" "${demo[@]}" --phase "$stage") > "$OUT/logs/$stage.log" 2>&1 || {
        cat "$OUT/logs/$stage.log"; echo "multihost: the $stage stage failed"; exit 1; }
    cat "$OUT/logs/$stage.log"
}

run_two_hosts() {
    local stage="$1" nproc="$2" rc0=0 rc1=0 start=$SECONDS
    echo "multihost: $stage on 2 hosts x $nproc ranks (${ADDR[0]}, ${ADDR[1]})"
    cd "$ROOT"
    start_agents "$stage" "$nproc"
    wait "${AGENT[0]}" || rc0=$?
    wait "${AGENT[1]}" || rc1=$?
    cat "$OUT/logs/$stage-host0.log" "$OUT/logs/$stage-host1.log" | grep -v '^\(W\|I\)[0-9]\{4\} ' || true
    echo "multihost: $stage: host 0 exit code $rc0, host 1 exit code $rc1 ($((SECONDS - start)) s)"
    if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
        echo "multihost: the $stage stage failed; logs in $OUT/logs"
        exit 1
    fi
}

rm -rf "$OUT/checkpoints" "$OUT/model" "$OUT/hf-model"

if [ "$LOSE" = 1 ]; then
    cd "$ROOT"
    rm -f "$OUT"/memory-r*.jsonl
    job=(scripts/multihost_memory.py --out "$OUT" --steps "$STEPS")
    start_agents lose-train 2 "${job[@]}"
    waited=0
    until grep -q "^step 20$" "$OUT/logs/lose-train-host0.log" 2>/dev/null; do
        sleep 0.2; waited=$((waited + 1))
        if [ "$waited" -ge $((5 * FAIL_TIMEOUT)) ] || ! kill -0 "${AGENT[0]}" 2>/dev/null; then
            echo "multihost: training did not reach step 20; logs in $OUT/logs"; cat "$OUT/logs/lose-train-host0.log"
            exit 1
        fi
    done
    for pid in $(ip netns pids "${NS[1]}"); do kill -9 "$pid" 2>/dev/null || true; done
    wait "${AGENT[1]}" 2>/dev/null || true
    killed_at=$(date +%s.%N)
    rm -rf "$MEMORY/host1"
    lost_at=$(grep -c "^step " "$OUT/logs/lose-train-host0.log")
    echo "multihost: host 1's processes killed (SIGKILL) after step $lost_at and its memory folder deleted"
    rc0=0
    deadline=$((SECONDS + FAIL_TIMEOUT))
    while kill -0 "${AGENT[0]}" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    kill -9 "${AGENT[0]}" 2>/dev/null || true  # still running at the deadline: it did not notice
    wait "${AGENT[0]}" 2>/dev/null || rc0=$?
    seconds=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc0" = 0 ] || [ "$rc0" = 137 ]; then
        echo "multihost: host 0's job did not fail within $FAIL_TIMEOUT s (exit code $rc0)"; exit 1
    fi
    echo "multihost: host 0 failed after $seconds s with exit code $rc0"
    rc0=0 rc1=0
    start_agents lose-resume 2 "${job[@]}"
    wait "${AGENT[0]}" || rc0=$?
    wait "${AGENT[1]}" || rc1=$?
    grep -h "resumed step\|done at step" "$OUT/logs/lose-resume-host0.log" "$OUT/logs/lose-resume-host1.log" || true
    if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
        echo "multihost: the restarted job failed (exit codes $rc0, $rc1); logs in $OUT/logs"; exit 1
    fi
    "$PYTHON" - "$OUT" <<'CHECK'
import json, re, sys
from pathlib import Path

out, problems, resumed = Path(sys.argv[1]), [], set()
for rank in range(4):
    records = [json.loads(line) for line in (out / f"memory-r{rank}.jsonl").read_text().splitlines() if line]
    (resume,) = [r for r in records if "resume" in r]
    saved = [r["digest"] for r in records[:records.index(resume)] if r.get("step") == resume["resume"]]
    resumed.add(resume["resume"])
    if resume["tier"] != "memory" or resume["storage"] != 0:
        problems.append(f"rank {rank} resumed from {resume['tier']}, {resume['storage']} bytes from storage")
    if not saved or saved[-1] != resume["digest"]:
        problems.append(f"rank {rank}'s state after resuming at step {resume['resume']} is not the one saved")
if len(resumed) != 1:
    problems.append(f"the ranks resumed at different steps: {sorted(resumed)}")
# Host 1 came back with an empty memory folder: its ranks (whatever their numbers now) got their parts from host 0.
host1 = re.findall(r"rank (\d+): resumed step \d+ from \w+: \d+ bytes from this host's memory, (\d+) from other",
                   (out / "logs" / "lose-resume-host1.log").read_text())
if len(host1) != 2 or not all(int(peer) > 0 for _, peer in host1):
    problems.append(f"host 1's ranks did not receive their parts from host 0: {host1}")
print("multihost: " + ("; ".join(problems) if problems else
      f"memory check: ok: every rank resumed step {resumed.pop()} from memory, bit for bit"))
sys.exit(1 if problems else 0)
CHECK
    left=$(grep -ho "[0-9]* entries left" "$OUT/logs/lose-resume-host0.log" "$OUT/logs/lose-resume-host1.log" | sort -u)
    if [ "$left" != "0 entries left" ]; then
        echo "multihost: the memory folders are not empty after the job finished ($left)"; exit 1
    fi
    echo "multihost: ok: host 1 lost with its memory after step $lost_at; the restarted job resumed from memory on both hosts (host 1's parts from host 0's replicas), read nothing from storage, and left the memory folders empty"
    exit 0
fi

run_local reference

if [ "$KILL" = 1 ]; then
    cd "$ROOT"
    start_agents train 2
    waited=0
    until grep -q "step 1:" "$OUT/logs/train-host0.log" "$OUT/logs/train-host1.log" 2>/dev/null; do
        sleep 0.2; waited=$((waited + 1))
        if [ "$waited" -ge $((5 * FAIL_TIMEOUT)) ]; then
            echo "multihost: training did not start within $FAIL_TIMEOUT s; logs in $OUT/logs"; exit 1
        fi
    done
    for pid in $(ip netns pids "${NS[1]}"); do kill -9 "$pid" 2>/dev/null || true; done
    wait "${AGENT[1]}" 2>/dev/null || true
    killed_at=$(date +%s.%N)
    echo "multihost: host 1's agent and workers killed (SIGKILL) during training"
    rc0=0
    deadline=$((SECONDS + FAIL_TIMEOUT))
    while kill -0 "${AGENT[0]}" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    kill -9 "${AGENT[0]}" 2>/dev/null || true  # still running at the deadline: it did not notice
    wait "${AGENT[0]}" 2>/dev/null || rc0=$?
    seconds=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "multihost: host 0's errors:"
    grep -E "Error|error|FAILED|exitcode" "$OUT/logs/train-host0.log" | grep -v '^W[0-9]\{4\} ' | head -20 || true
    if [ "$rc0" = 0 ]; then
        echo "multihost: host 0 finished with exit code 0 after $seconds s: host 1 was killed too late"
        exit 1
    fi
    if [ "$rc0" = 137 ]; then
        echo "multihost: host 0 did not fail within $FAIL_TIMEOUT s (stopped with SIGKILL)"
        exit 1
    fi
    echo "multihost: host 0 failed after $seconds s with exit code $rc0"
    exit 0
fi

run_two_hosts train 2
run_two_hosts resume 1
run_local export
echo "multihost: ok: trained on 4 ranks over 2 hosts, resumed on 2 ranks over 2 hosts, exported; output in $OUT"
