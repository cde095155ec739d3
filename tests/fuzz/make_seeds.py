#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/corpus/ that are not copied from examples/ or written by
a target itself (fuzz_checkpoint: see its opening comment): small job spec variations, safetensors
files, token and text files, call sequences for fuzz_coordinator (protos encoded with protoc,
the record format of fuzz_coordinator.cc) and operation sequences for fuzz_session (the byte
format of fuzz_session.cc). Run from anywhere; rewrites the files it owns."""
import json
import os
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    os.makedirs(os.path.join(CORPUS, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(CORPUS, target, name), "wb") as f:
        f.write(data)


SPEC = {"name": "t", "model": {"preset": "tiny"}, "data": {"source": "synthetic:recall"},
        "seq_len": 256, "parallel": {"cp": 1, "dp": 1}, "train": {"steps": 10},
        "checkpoint": {"dir": "/tmp/ck", "every": 5}, "resources": "cpu", "max_restarts": 3,
        "priority": 0}


def job_spec():
    write("fuzz_job_spec", "explicit-model.json", json.dumps({
        "name": "m", "model": {"vocab": 300, "d_model": 64, "n_layers": 2, "n_heads": 2,
                               "ffn_dim": 128, "layer_pattern": "LM",
                               "mla": {"q_lora_rank": 0, "kv_lora_rank": 32, "qk_nope_dim": 16,
                                       "qk_rope_dim": 16, "v_head_dim": 32}},
        "data": {"source": "tokens:/d/t.bin", "token_bytes": 4, "eos_id": 0}, "seq_len": 64,
        "train": {"steps": 2, "lr": 1e-3, "schedule": "constant", "optimizer": "sgd",
                  "momentum": 0.5, "recompute": 1, "seed": 18446744073709551615},
        "checkpoint": {"dir": "/c", "every": 1, "keep": 3}}))
    write("fuzz_job_spec", "text-cuda.json", json.dumps({
        "name": "x", "model": {"preset": "small"}, "data": {"source": "text:/d/a.txt"},
        "seq_len": 128, "resources": "cuda", "train": {"offload": True, "recompute": "auto"},
        "parallel": {"cp": 2, "dp": 2, "lightning_mode": "all2all", "mla_mode": "allgather"}}))
    write("fuzz_job_spec", "duplicate-key.json", '{"name": "a", "name": "b"}')
    write("fuzz_job_spec", "nested.json", '{"name": [[[{"a": [1, "\\"[", {}]}]]]}')


def safetensors_file(tensors, metadata=None, pad=True):
    header, offset, data = {}, 0, b""
    for name, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}
        data += struct.pack("<%df" % n, *([0.5] * n))
        offset += 4 * n
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    while pad and (len(h) + 8) % 8:
        h += b" "
    return struct.pack("<Q", len(h)) + h + data


def safetensors():
    write("fuzz_safetensors", "two-tensors", safetensors_file([("b", [4]), ("w", [2, 3])]))
    write("fuzz_safetensors", "metadata",
          safetensors_file([("exp_avg.w", [2, 3])], {"optimizer": "adamw"}))
    write("fuzz_safetensors", "scalar-and-empty", safetensors_file([("s", []), ("z", [0, 5])]))
    write("fuzz_safetensors", "truncated", safetensors_file([("w", [8])])[:-5])


def data():
    # 4 header bytes: source (0 uint16, 1 uint32, 2 text), seq_len, vocab index, eos.
    write("fuzz_data", "tokens16", bytes([0, 14, 0, 0]) + struct.pack("<10H", *range(10)))
    write("fuzz_data", "tokens32", bytes([1, 6, 2, 1]) + struct.pack("<6I", 1, 2, 3, 999, 0, 5))
    write("fuzz_data", "tokens32-outside", bytes([1, 6, 0, 1]) + struct.pack("<3I", 1, 300, 2))
    write("fuzz_data", "text", bytes([2, 30, 0, 0]) +
          "First paragraph.\nStill first.\n\n\nSecond, é ü.\n".encode())
    write("fuzz_data", "text-newlines", bytes([2, 2, 1, 0]) + b"\n\n\n\na\n")


def encode(message, text):
    proto_dir = os.path.join(ROOT, "proto")
    files = ["spindle/v1/job.proto", "spindle/v1/cluster.proto", "spindle/v1/rendezvous.proto"]
    return subprocess.run(["protoc", "-I", proto_dir, "--encode=spindle.v1." + message] + files,
                          input=text.encode(), stdout=subprocess.PIPE, check=True).stdout


def record(op, payload=b""):
    if isinstance(payload, str):
        payload = payload.encode()
    return bytes([op]) + struct.pack("<H", len(payload)) + payload


def coordinator():
    spec = json.dumps(SPEC)
    submit = record(0, encode("SubmitJobRequest", "spec_json: %s" % json.dumps(spec)))
    write("fuzz_coordinator", "submit-get-list-cancel",
          submit + record(3, encode("GetJobRequest", 'job_id: "j-000001"')) +
          record(4, encode("ListJobsRequest", "states: 1 limit: 5")) +
          record(5, encode("CancelJobRequest", 'job_id: "j-000001" reason: "x"')) +
          record(6, encode("WatchJobRequest", 'job_id: "j-000001" min_interval_ms: 1')))
    write("fuzz_coordinator", "submit-text-plan",
          record(1, spec) + record(2, encode("PlanJobRequest", "spec_json: %s" % json.dumps(spec))) +
          record(13, struct.pack("<I", 100)))
    progress = encode("WorkerMessage", """rank_progress { ref { job_id: "j-000001" attempt: 1 rank: 0 }
        step: 5 total_steps: 10 loss: 2.5 tokens_per_s: 100 }""")
    started = encode("WorkerMessage", 'rank_started { ref { job_id: "j-000001" attempt: 1 rank: 0 } }')
    ckpt = encode("WorkerMessage", """checkpoint_done { ref { job_id: "j-000001" attempt: 1 rank: 0 }
        step: 5 path: "/tmp/ck/step_00000005" }""")
    exit_ = encode("WorkerMessage", 'rank_exit { ref { job_id: "j-000001" attempt: 1 rank: 0 } exit_code: 1 stderr_tail: "boom" }')
    heartbeat = encode("WorkerMessage", "heartbeat { }")
    write("fuzz_coordinator", "job-runs-and-fails",
          submit + record(13, struct.pack("<I", 10)) + record(9, b"\x00" + started) +
          record(9, b"\x00" + progress) + record(9, b"\x00" + ckpt) + record(9, b"\x00" + exit_) +
          record(13, struct.pack("<I", 10)) + record(9, b"\x00" + heartbeat) + record(15))
    reg = encode("RegisterRequest", """worker_id: "w1" hostname: "h1" instance_id: "i1"
        devices { kind: "cpu" count: 2 memory_bytes: 8589934592 }""")
    hello = encode("SessionHello", 'worker_id: "w1"')
    write("fuzz_coordinator", "register-session-leave",
          record(7, reg) + record(8, hello) + record(14) +
          record(9, b"\x01" + encode("WorkerMessage", "leaving { }")) + record(10, b"\x01") +
          record(13, struct.pack("<I", 5000)) + record(14))
    write("fuzz_coordinator", "rendezvous",
          submit + record(13, struct.pack("<I", 1)) +
          record(11, encode("SetRequest", 'scope { job_id: "j-000001" attempt: 1 token: "t" } key: "k" value: "v"')) +
          record(12, encode("GetRequest", 'scope { job_id: "j-000001" attempt: 1 token: "t" } key: "k" wait_timeout_ms: 1')))


# fuzz_session: one byte per choice, in the order fuzz_session.cc reads them.
REGISTER, OPEN, HEARTBEAT, STARTED, PROGRESS, EXIT, CHECKPOINT, NOTE, LEAVING, RAW, SYNC, PAUSE, \
    RESUME, HALF_CLOSE, CANCEL, SUBMIT, TICK, CANCEL_JOB = range(18)
# Session openings ((variant >> 3) % 10) and tokens (variant & 7: 0 own, 5 the cluster's, 6 another
# worker's, 7 a user's or none); the top bit synchronises (a heartbeat, then its ack or the end).
NO_HELLO, NOTHING, WRONG_INSTANCE, LONG_ID, EMPTY_ID, HELLO = 0, 1, 2, 3, 4, 5
OWN, CLUSTER, OTHERS, NONE = 0, 5, 6, 7
REF = 0  # the oldest assignment kept, as assigned; 4: the next one
TICK_MS = {0: 0, 100: 1, 600: 2, 2100: 3, 3100: 4, 5100: 5, 9000: 6, 60000: 7}


def variant(opening=HELLO, token=OWN, sync=True):
    return (128 + (((opening - 6) % 10) << 3) if sync else opening << 3) | token


def running(ref=REF, pulse=0, silent=9):
    # A RunningRank: reference, step (the real one), pid 0, the pulse byte (odd: pulsing; from 128
    # on a silence follows: 9 is 2.5 s), loss 0.
    return [ref, 9, 0, pulse] + ([silent] if pulse >= 128 else []) + [0]


def open_(slot, worker, v=None, ranks=()):
    v = variant() if v is None else v
    hello = [len(ranks)] + [b for r in ranks for b in r] if (v >> 3) % 10 != NO_HELLO else []
    return [OPEN, slot, worker, v] + hello


def session():
    def tick(ms):
        return [TICK, TICK_MS[ms]]

    def ops(*records):
        return b"".join(bytes(r) for r in records)

    register = lambda worker, slots, v=0: [REGISTER, worker, v, slots]
    submit = [SUBMIT, 0, 0, 1, 2]  # cp 1, dp 1, 2 steps, 2 restarts
    heartbeat = lambda slot, ranks=(): [HEARTBEAT, slot, 0, 0, len(ranks)] + [
        b for r in ranks for b in r]
    progress = [PROGRESS, 0, REF, 9, 9] + [0] * 7 + [0]  # the real step, 7 numbers, no MoE
    write("fuzz_session", "job-runs-to-success",
          ops(register(0, 4), open_(0, 0), submit, tick(0), [SYNC, 0], [STARTED, 0, REF, 0],
              progress, [CHECKPOINT, 0, REF, 9, 2], [NOTE, 0, REF, 8],
              [EXIT, 0, REF, 0, 0, 0, 0], [SYNC, 0]))
    write("fuzz_session", "gang-of-two-rank-fails",
          ops(register(0, 1), register(1, 1), open_(0, 0), open_(1, 1), [SUBMIT, 1, 0, 3, 1],
              tick(0), [SYNC, 0], [SYNC, 1], [STARTED, 0, REF, 0], [STARTED, 1, 4, 0],
              [EXIT, 1, 4, 1, 0, 2, 3, 5], tick(2100), [SYNC, 0], [SYNC, 1]))
    write("fuzz_session", "silent-rank-lost-worker",
          ops(register(0, 2), open_(0, 0), submit, tick(0), [SYNC, 0],
              heartbeat(0, [running(REF, 201)]), tick(5100), heartbeat(0, [running()]),
              tick(9000), [SYNC, 0]))
    write("fuzz_session", "hostile-openings",
          ops(register(0, 2), register(1, 2, 3), open_(0, 0, variant(NO_HELLO)),
              open_(1, 0, variant(NOTHING)), open_(2, 0, variant(WRONG_INSTANCE)),
              open_(3, 0, variant(LONG_ID)), open_(4, 0, variant(EMPTY_ID)),
              open_(5, 1, variant(token=NONE)), open_(0, 3), open_(1, 1, variant(token=OTHERS)),
              [SYNC, 0]))
    write("fuzz_session", "replaced-session-leaves",
          ops(register(2, 3), open_(0, 2), submit, tick(0),
              open_(1, 2, variant(token=CLUSTER), [running()]), [SYNC, 0], [LEAVING, 1, 3],
              [SYNC, 1], [HALF_CLOSE, 1], tick(600), open_(2, 2), [CANCEL, 2],
              open_(3, 2, variant(sync=False))))
    write("fuzz_session", "reader-paused",
          ops(register(1, 1), open_(0, 1), [PAUSE, 0], *[heartbeat(0)] * 20, [RESUME, 0],
              [SYNC, 0]))
    write("fuzz_session", "cancel-job-and-extremes",
          ops(register(0, 2), open_(0, 0), submit, tick(0), [SYNC, 0], [CANCEL_JOB, 0, 3],
              [PROGRESS, 0, REF, 3, 4, 1, 2, 3, 4, 5, 6, 7, 0], [CHECKPOINT, 0, REF, 4, 6],
              [EXIT, 0, REF, 128, 3, 0, 2, 24, 10, 255], [SYNC, 0]))


if __name__ == "__main__":
    job_spec()
    safetensors()
    data()
    coordinator()
    session()
