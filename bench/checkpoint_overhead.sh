#!/usr/bin/env bash
# Step-time overhead of checkpoints through spindle-train, for any job and engine (the CPU one, or
# a GPU with a CUDA build): JOB.json runs three times, with no checkpoints, with synchronous ones
# (checkpoint.async false) and with background ones (true), every EVERY steps for STEPS steps into
# DIR. The time per step is the wall time from the first step's event to the last one's, so the
# checkpoints inside the run (all but the final one) are in it. Prints a table like
# bench_checkpoint's (bench/NOTES.md, Checkpoints).
# Usage: bench/checkpoint_overhead.sh JOB.json [STEPS, default 151] [EVERY, default 50]
#        [DIR, default /var/tmp]; $SPINDLE_TRAIN_BINARY picks the trainer (default
#        build/worker/spindle-train). On the GPU machine, after bench/cuda/pack_for_device.sh:
#          source bench/cuda/device_env.sh && bench/checkpoint_overhead.sh \
#              examples/1b-128k-one-gpu.json 151 50 /tmp
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:?usage: bench/checkpoint_overhead.sh JOB.json [STEPS] [EVERY] [DIR]}
exec python3 - "$job" "${2:-151}" "${3:-50}" "${4:-/var/tmp}" \
    "${SPINDLE_TRAIN_BINARY:-build/worker/spindle-train}" <<'PY'
import json, os, shutil, subprocess, sys, tempfile, time

job, steps, every, root, train = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
spec = json.load(open(job))
rows = []
for mode in ("none", "sync", "async"):
    s = json.loads(json.dumps(spec))
    s["train"]["steps"] = steps
    ckpt = os.path.join(root, "checkpoint-overhead-%d" % os.getpid())
    shutil.rmtree(ckpt, ignore_errors=True)
    s["checkpoint"] = {} if mode == "none" else {"dir": ckpt, "every": every, "async": mode == "async"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(s, f)
    p = subprocess.Popen([train, "--job", f.name], stdout=subprocess.PIPE, text=True)
    at, blocking, writes = {}, [], []
    for line in p.stdout:
        now = time.monotonic()
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step":
            at[e["step"]] = now
        if e.get("event") == "checkpoint" and e["step"] < steps:
            if mode == "sync":
                blocking.append(now - at[e["step"]])
            else:
                blocking.append(e.get("snapshot_s", 0) + e.get("blocked_s", 0))
                writes.append(e.get("write_s", 0))
    if p.wait() != 0:
        sys.exit("checkpoint_overhead: spindle-train failed (%s)" % mode)
    os.unlink(f.name)
    shutil.rmtree(ckpt, ignore_errors=True)
    rows.append((mode, (at[steps] - at[1]) / (steps - 1), blocking, writes))
base = rows[0][1]
med = lambda v: sorted(v)[len(v) // 2] if v else None
print("%s: %d steps, checkpoint every %d, on %s\n" % (job, steps, every, root))
print("| checkpoints | step s | overhead | step's time per checkpoint s | background write s |")
print("|---|---|---|---|---|")
for mode, step, blocking, writes in rows:
    print("| %s | %.4f | %+.2f%% | %s | %s |" % (mode, step, (step / base - 1) * 100,
          "-" if med(blocking) is None else "%.3f" % med(blocking),
          "-" if med(writes) is None else "%.3f" % med(writes)))
PY
