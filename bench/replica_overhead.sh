#!/usr/bin/env bash
# Step-time cost of in-memory replicas (checkpoint.replicas) through spindle-train: JOB.json (its
# world must be 2 or more) runs twice over a file store, its ranks as separate processes that say
# they are on different workers (--replica-host), with no replicas and with a replica every EVERY
# steps into DIR (a tmpfs, as the worker's default /dev/shm; no file checkpoints but the last).
# The time per step is the wall time from the first step's event to the last one's; rank 0's
# "replica" events give each replica's cost inside the step (the snapshot into host memory), its
# background work (serialise, send to the peer, keep rank 0's copy) and its size.
# Usage: bench/replica_overhead.sh JOB.json [STEPS, default 101] [EVERY, default 10]
#        [DIR, default /dev/shm]; $SPINDLE_TRAIN_BINARY picks the trainer (default
#        build/worker/spindle-train). Threads per rank: $THREADS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:?usage: bench/replica_overhead.sh JOB.json [STEPS] [EVERY] [DIR]}
exec python3 - "$job" "${2:-101}" "${3:-10}" "${4:-/dev/shm}" \
    "${SPINDLE_TRAIN_BINARY:-build/worker/spindle-train}" "${THREADS:-1}" <<'PY'
import json, os, shutil, subprocess, sys, tempfile, time

job, steps, every, root, train, threads = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                           sys.argv[4], sys.argv[5], sys.argv[6])
spec = json.load(open(job))
world = spec.get("parallel", {}).get("cp", 1) * spec.get("parallel", {}).get("dp", 1)
if world < 2:
    sys.exit("replica_overhead: the job's world (cp x dp) must be 2 or more")
rows = []
for mode in ("none", "replicas"):
    work = tempfile.mkdtemp(prefix="replica-overhead-", dir=root)
    s = json.loads(json.dumps(spec))
    s["train"]["steps"] = steps
    s["checkpoint"] = {"dir": os.path.join(work, "ckpt"), "every": 0}
    if mode == "replicas":
        s["checkpoint"]["replicas"] = {"every": every}
    path = os.path.join(work, "job.json")
    json.dump(s, open(path, "w"))
    store = os.path.join(work, "store")
    os.makedirs(store)
    procs = []
    for r in reversed(range(world)):
        argv = [train, "--job", path, "--rank", str(r), "--world", str(world), "--file-store", store,
                "--threads", threads, "--replica-dir", os.path.join(work, "replicas-%d" % r),
                "--replica-host", "host-%d" % r]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                      text=True))
    at, costs, writes, size = {}, [], [], 0
    for line in procs[-1].stdout:
        now = time.monotonic()
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "step":
            at[e["step"]] = now
        if e.get("event") == "replica":
            costs.append(e["snapshot_s"])
            writes.append(e["write_s"])
            size = e["bytes"]
    if any(p.wait() != 0 for p in procs):
        sys.exit("replica_overhead: spindle-train failed (%s)" % mode)
    shutil.rmtree(work, ignore_errors=True)
    rows.append((mode, (at[steps] - at[1]) / (steps - 1), costs, writes, size))
base = rows[0][1]
med = lambda v: sorted(v)[len(v) // 2] if v else None
print("%s: %d steps, a replica every %d, on %s, %s thread(s) a rank\n" % (job, steps, every, root,
                                                                         threads))
print("| replicas | step s | overhead | step's time per replica s | its share of %d steps "
      "| background s | MB |" % every)
print("|---|---|---|---|---|---|---|")
for mode, step, costs, writes, size in rows:
    c, w = med(costs), med(writes)
    print("| %s | %.4f | %+.2f%% | %s | %s | %s | %s |" % (
        mode, step, (step / base - 1) * 100, "-" if c is None else "%.4f" % c,
        "-" if c is None else "%.2f%%" % (100 * c / (every * base)),
        "-" if w is None else "%.3f" % w, "-" if not size else "%.1f" % (size / 1e6)))
PY
