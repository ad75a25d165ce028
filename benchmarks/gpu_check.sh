#!/usr/bin/env bash
# Every script's CUDA path once, on one GPU, in about 9 minutes. Evidence: a JSON line per step in
# OUT/gpu_check.jsonl (name, exit status, seconds, ok; for a run its steady steps/s, raw envpool's for the same envs
# and their ratio), each step's console in OUT/<step>.log, its run folder under OUT/runs/<step>.
#
#     bash benchmarks/gpu_check.sh OUT            # on the GPU machine
#     bash benchmarks/gpu_check.sh OUT --cpu      # the same steps where no GPU is seen, seconds each (CI's smoke)
#
# Each run is stopped with SIGINT once its time is up and it has printed a progress line (it checkpoints and exits with
# 130; SIGKILL 60 s later if not). A step is ok when its command ended (0) or stopped and saved, leaving a checkpoint. The steps: every script's
# `--env-id` run; torchrun with two learners on the one GPU; a run started where no GPU is seen, resumed on the GPU;
# each GPU model.pt loaded by a plain torch.load and evaluated where no GPU is seen; IMPALA's deep agent at the
# default thread split and with four learner threads; the actors on the CPU (--no-cuda-actors); P3S with --bf16.
set -u
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT [--cpu]}
cd "$(dirname "$0")/.."
mkdir -p "$OUT/runs"
: >"$OUT/gpu_check.jsonl"
if [ "${2:-}" = "--cpu" ]; then
    export CUDA_VISIBLE_DEVICES="" S=2 LONG=2 RAW=0 # seconds of a run, of the deep agent's, of raw envpool's (0: none)
else
    S=30 LONG=45 RAW=5
fi
NOGPU="env CUDA_VISIBLE_DEVICES=" # a process that sees no GPU, as on a CPU-only machine
P3S="--t-initial 250 --learning-starts 1000"  # P3S's updates from its first seconds (default: from 10,000 rows)

step() { # step NAME SECONDS COMMAND...: the command; SIGINT once its time is up and it has shown progress
    local name=$1 seconds=$2 start pid rc killer= ok=false
    shift 2
    start=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1 & # SIGINT ignored until the script sets its handler (bash's background jobs)
    pid=$!
    # SIGINT to the command alone (not its process group: a script reads a second one as "now"), after SECONDS and
    # its first progress line, so that it has started and saves (120 s later without one); SIGKILL 60 s after it
    while kill -0 $pid 2>/dev/null; do
        if [ $(($(date +%s) - start)) -ge $((seconds + 120)) ] ||
            { [ $(($(date +%s) - start)) -ge "$seconds" ] && grep -q "^step " "$OUT/$name.log"; }; then
            kill -INT $pid
            (sleep 60 && kill -KILL $pid) 2>/dev/null &
            killer=$!
            break
        fi
        sleep 1
    done
    wait $pid
    rc=$?
    kill "${killer:-}" 2>/dev/null
    # stopped and saved: 130, or torchrun's 1 after rank 0's line that its learners saved
    if { [ $rc = 0 ] || [ $rc = 130 ] || grep -q "^checkpoint at step" "$OUT/$name.log"; } &&
        { [ ! -d "$OUT/runs/$name" ] || ls "$OUT/runs/$name"/*/checkpoint.pt >/dev/null 2>&1; }; then
        ok=true
    fi
    printf '{"name": "%s", "exit_status": %d, "seconds": %d, "ok": %s}\n' "$name" $rc $(($(date +%s) - start)) $ok |
        tee -a "$OUT/gpu_check.jsonl"
}

train() { # train NAME SECONDS LAUNCHER... SCRIPT ARGS...: a run in OUT/runs/NAME, a console line a second
    local name=$1
    step "$@" --log-interval 1 --run-dir "$OUT/runs/$name"
}

last_run() { ls -d "$OUT/runs/$1"/*/ | tail -n 1; }

# 1. every script's `--env-id` run (a3c and acer on the CPU: their workers share CPU memory)
train impala_vtrace $S python impala_vtrace.py --env-id Breakout-v5 --save-model
train vmpo_atari $S python vmpo_atari.py --env-id Breakout-v5 --save-model
train vmpo_mujoco $S python vmpo_mujoco.py --env-id HalfCheetah-v4 --save-model
train p3s_td3 $S python p3s_td3.py --env-id Hopper-v4 $P3S --save-model
train a3c $S python a3c.py --env-id Breakout-v5
train acer $S python acer.py --env-id Breakout-v5

# 2. torchrun with two learners on the one GPU (gloo: NCCL refuses two ranks on one GPU), a minibatch per learner
TORCHRUN="python -m torch.distributed.run --standalone --nproc_per_node 2"
train torchrun_impala_vtrace $S $TORCHRUN impala_vtrace.py --env-id Breakout-v5
train torchrun_vmpo_atari $S $TORCHRUN vmpo_atari.py --env-id Breakout-v5 --num-minibatches 2
train torchrun_vmpo_mujoco $S $TORCHRUN vmpo_mujoco.py --env-id HalfCheetah-v4 --num-minibatches 2

# 3. a run started where no GPU is seen, resumed on the GPU (P3S's checkpoint holds a CUDA generator's state there);
# each GPU model.pt read by a plain torch.load and evaluated where no GPU is seen
train resume_p3s_td3 $S $NOGPU python p3s_td3.py --env-id Hopper-v4 $P3S
step resumed_p3s_td3 $S python p3s_td3.py --resume "$(last_run resume_p3s_td3)" --log-interval 1
train resume_vmpo_mujoco $S $NOGPU python vmpo_mujoco.py --env-id Hopper-v4
step resumed_vmpo_mujoco $S python vmpo_mujoco.py --resume "$(last_run resume_vmpo_mujoco)" --log-interval 1
LOAD="import runpy, sys, torch; sys.argv.pop(0); torch.load(sys.argv[1], weights_only=False); runpy.run_path(sys.argv[0], run_name='__main__')"
for s in impala_vtrace vmpo_atari vmpo_mujoco p3s_td3; do
    step "model_on_cpu_$s" 120 $NOGPU python -c "$LOAD" evaluate.py "$(last_run $s)model.pt" --episodes 1
done

# 4. IMPALA's deep agent: the default thread split (one learner thread with a GPU), and four learner threads
train impala_deep $LONG python impala_vtrace.py --env-id Breakout-v5 --network deep
train impala_deep_4_threads $LONG python impala_vtrace.py --env-id Breakout-v5 --network deep --learner-threads 4

# 5. the actors' inference on the CPU: one CUDA context, the learner's
train impala_vtrace_cpu_actors $S python impala_vtrace.py --env-id Breakout-v5 --no-cuda-actors
train vmpo_mujoco_cpu_actors $S python vmpo_mujoco.py --env-id HalfCheetah-v4 --no-cuda-actors

# 6. P3S's population in bfloat16
train p3s_td3_bf16 $S python p3s_td3.py --env-id Hopper-v4 $P3S --bf16

# each run's steady steps/s (its SPS curve after the start-up) beside raw envpool stepping its envs; the verdict
python - "$OUT" "$RAW" <<'EOF'
import glob, json, os, sys
from benchmarks.throughput import raw_envpool_sps, steady_sps

out, raw_seconds, raw = sys.argv[1], float(sys.argv[2]), {}
lines = [json.loads(x) for x in open(os.path.join(out, "gpu_check.jsonl"))]
for line in lines:
    for run in sorted(glob.glob(os.path.join(out, "runs", line["name"], "*", "args.json")))[-1:]:
        try:
            line["steps_per_s"] = round(steady_sps(os.path.dirname(run)))
        except (KeyError, IndexError, ZeroDivisionError):  # too short a run for two points of its SPS curve
            continue
        a = json.load(open(run))
        if raw_seconds == 0:
            continue
        n = a["num_envs"] * a.get("num_learners", 1) * (a.get("num_workers", 1) or os.cpu_count())
        key = (a["env_id"], n, (a.get("env_batch_size") or max(1, n // 2)) if "env_batch_size" in a else n)
        raw[key] = raw.get(key) or raw_envpool_sps(*key, raw_seconds)
        line.update(raw_envpool_steps_per_s=round(raw[key]), over_raw=round(line["steps_per_s"] / raw[key], 3))
with open(os.path.join(out, "gpu_check.jsonl"), "w") as f:
    f.writelines(json.dumps(x) + "\n" for x in lines)
bad = [x["name"] for x in lines if not x["ok"]]
print(f"{len(lines) - len(bad)}/{len(lines)} steps ok" + (f"; failed: {bad}" if bad else ""))
sys.exit(1 if bad else 0)
EOF
