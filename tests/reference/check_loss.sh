#!/usr/bin/env bash
# Trains a few steps with spindle-train on a token file, evaluates the checkpoint with
# spindle-train --eval in another process, and checks the loss against the independent PyTorch
# implementation (torch_reference.py) within a stated tolerance: |a - b| <= 1e-4 * |b|.
# Usage: check_loss.sh SPINDLE_TRAIN PRESET_JSON_MODEL
set -euo pipefail
TRAIN=$1
MODEL=$2
HERE=$(cd "$(dirname "$0")" && pwd)
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "python3-torch is missing: run scripts/setup.sh (it installs the Debian package python3-torch)"
  exit 1
fi
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
# A token stream of documents of random lengths 5..60 over ids 1..255, each ending with EOS 0.
/usr/bin/python3 - "$DIR/tokens.bin" <<'PY'
import random, struct, sys
r = random.Random()
out = []
while len(out) < 400:
    out += [r.randint(1, 255) for _ in range(r.randint(5, 60))] + [0]
open(sys.argv[1], 'wb').write(struct.pack('<%dH' % len(out), *out))
PY
cat > "$DIR/job.json" <<JSON
{"name": "reference", "model": $MODEL,
 "data": {"source": "tokens:$DIR/tokens.bin", "token_bytes": 2, "eos_id": 0},
 "seq_len": 96, "train": {"steps": 4, "lr": 0.01, "seed": $RANDOM},
 "checkpoint": {"dir": "$DIR/ckpt"}}
JSON
"$TRAIN" --job "$DIR/job.json" > "$DIR/train.log"
ours=$("$TRAIN" --eval --job "$DIR/job.json" --checkpoint "$DIR/ckpt" --eval-sequences 2)
ckpt=$(/usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1])["checkpoint"])' "$ours")
ref=$(/usr/bin/python3 "$HERE/torch_reference.py" "$ckpt" "$DIR/tokens.bin" 96 2 0)
/usr/bin/python3 - "$ours" "$ref" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"spindle {a['loss']:.8f} over {a['tokens']} tokens, reference {b['loss']:.8f} over {b['tokens']}")
assert a['tokens'] == b['tokens'], "different numbers of valid targets"
assert abs(a['loss'] - b['loss']) <= 1e-4 * abs(b['loss']), "losses differ beyond 1e-4 relative"
print("1 passed, 0 failed")
PY
