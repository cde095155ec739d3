#!/usr/bin/env bash
# One device call: Spindle's training step (bench_model_cuda, preset 1b) and the peer's
# (ref_model.py: PyTorch + FLA) side by side on the same GPU, at 8K and 32K tokens (the peer eager
# and with torch.compile at 32K) and at 128K with recompute (ours with every layer recomputing and
# with "auto"). Run from the repository root on the GPU
# machine with .cuda-run (bench/cuda/pack_for_device.sh build-gpu) and .peer carried. Writes the
# outputs under $OUT when set.
# fp8: the FP8 comparison instead (train.precision fp8 against bf16, ours at 32K without recompute
# and at 128K with every layer recomputing, twice each; the peer compiled, with and without --fp8,
# at 32K).
# moe: the mixture-of-experts preset (moe: 64 experts of 256, top 8, a shared expert of 1024) in
# bf16 and fp8, at 16K without recompute and at 32K with "auto" recompute, against the peer's
# --moe 64,8,256,1024 compiled (with --ckpt, without which it runs out of memory at 16K on an H100),
# and bf16 again with the experts' GEMMs on the persistent grouped kernel (--expert_gemm).
# Usage: bench/cuda/model_vs_peer.sh [what: all | ours | peer | fp8 | moe]
set -uo pipefail
out=${OUT:-/tmp}
what=${1:-all}
source bench/cuda/device_env.sh
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
if [ "$what" = fp8 ]; then
  echo "== spindle"
  for p in bf16 fp8; do
    timeout 120 .cuda-run/bench_model_cuda --preset 1b --T 32768 --recompute 0 --precision $p 2>&1 | tee -a "$out/spindle_step.txt"
  done
  # 128K twice each, alternating: the two precisions' ratio within the call, with its spread.
  for p in bf16 fp8 bf16 fp8; do
    timeout 120 .cuda-run/bench_model_cuda --preset 1b --T 131072 --recompute all --steps 4 --forward 0 --precision $p 2>&1 | tee -a "$out/spindle_step.txt"
  done
  echo "== peer"
  for args in "--T 32768 --compile" "--T 32768 --fp8 --compile"; do
    echo "ref_model.py $args"
    timeout 240 python3 .peer/ref_model.py $args 2>&1 | tail -1 | tee -a "$out/peer_step.txt"
  done
  exit 0
fi
if [ "$what" = moe ]; then
  echo "== spindle"
  for p in bf16 fp8; do
    timeout 100 .cuda-run/bench_model_cuda --preset moe --T 16384 --recompute 0 --steps 4 --precision $p 2>&1 | tee -a "$out/spindle_step.txt"
    timeout 120 .cuda-run/bench_model_cuda --preset moe --T 32768 --recompute auto --steps 4 --forward 0 --precision $p 2>&1 | tee -a "$out/spindle_step.txt"
  done
  # bf16 with the experts' GEMMs on our persistent grouped kernel (CudaModel::SetExpertGemm).
  timeout 100 .cuda-run/bench_model_cuda --preset moe --T 16384 --recompute 0 --steps 4 --expert_gemm persistent 2>&1 | tee -a "$out/spindle_step.txt"
  timeout 120 .cuda-run/bench_model_cuda --preset moe --T 32768 --recompute auto --steps 4 --forward 0 --expert_gemm persistent 2>&1 | tee -a "$out/spindle_step.txt"
  echo "== peer"
  for args in "--T 16384 --compile --ckpt" "--T 32768 --compile --ckpt"; do
    echo "ref_model.py --moe 64,8,256,1024 $args"
    timeout 240 python3 .peer/ref_model.py --moe 64,8,256,1024 $args 2>&1 | tail -1 | tee -a "$out/peer_step.txt"
  done
  exit 0
fi
if [ "$what" != peer ]; then
  echo "== spindle"
  timeout 240 .cuda-run/bench_model_cuda --preset 1b --T 8192,32768 --recompute 0 2>&1 | tee "$out/spindle_step.txt"
  timeout 300 .cuda-run/bench_model_cuda --preset 1b --T 131072 --recompute all,auto --steps 4 2>&1 | tee -a "$out/spindle_step.txt"
fi
if [ "$what" != ours ]; then
  echo "== peer"
  for args in "--T 8192" "--T 32768" "--T 32768 --compile" "--T 131072 --ckpt"; do
    echo "ref_model.py $args"
    timeout 300 python3 .peer/ref_model.py $args 2>&1 | tail -1 | tee -a "$out/peer_step.txt"
  done
fi
