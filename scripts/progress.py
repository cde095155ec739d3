#!/usr/bin/env python3
"""Renders spindle-train's JSON progress lines as a live bar (step, loss, tokens/s, ETA)."""
import json, sys

first_loss = None
for line in sys.stdin:
    try:
        e = json.loads(line)
    except ValueError:
        print(line, end="")
        continue
    ev = e.get("event")
    if ev == "start":
        print(f"job {e['job']}: {e['params']/1e6:.2f}M parameters, seq_len {e['seq_len']}, "
              f"{e['total_steps']} steps (resumed at step {e['resumed_from_step']})", flush=True)
    elif ev == "step":
        if first_loss is None:
            first_loss = e["loss"]
        done, total = e["step"], e["total_steps"]
        rate = e["elapsed_s"] / max(done, 1)
        eta = rate * (total - done)
        width = 30
        fill = int(width * done / total)
        bar = "#" * fill + "-" * (width - fill)
        sys.stdout.write(f"\r[{bar}] step {done}/{total}  loss {e['loss']:.4f} "
                         f"(from {first_loss:.2f})  {e['tokens_per_s']:.0f} tok/s  "
                         f"lr {e['lr']:.2e}  ETA {eta:.0f}s ")
        if done % 10 == 0 or done == total:
            sys.stdout.write("\n")
        sys.stdout.flush()
    elif ev == "checkpoint":
        print(f"\ncheckpoint at step {e['step']}: {e['path']}", flush=True)
    elif ev == "done":
        print(f"\ndone: step {e['step']}, final loss {e['final_loss']:.4f}", flush=True)
