#!/usr/bin/env bash
# One device call on two GPUs of one host (the device tool's nvidia-h200-x2) that measures what
# bench/RESULTS_GPU.md's "latest call" table holds: on GPU 0 Spindle's kernel benchmark, then the
# peer's (FLA chunk_simple_gla, PyTorch cuDNN SDPA); at the same time on GPU 1 Spindle's 1b step
# at 32K, then the peer's compiled step, then both at 128K with recompute / checkpointing; then
# both GPUs: the NCCL context-parallel benchmark at 256K tokens (one document, then ~8K-token
# documents). Each pair of numbers comes from one GPU, ours first. Run from the repository root on
# the GPU machine with .cuda-run (bench/cuda/pack_for_device.sh build-gpu) and .peer (see
# /work/shared/peer/README.md) carried. Outputs go under $OUT. About 10 minutes (each CP run alone
# takes 2-3 minutes, mostly creating the 1B models): close to a 600 s per-call limit, so a CP run
# may need a call of its own.
# Usage: bench/cuda/two_gpu_run.sh [extra bench_cp_cuda flags, e.g. --lightning_mode allgather
#        --mla_mode allgather]
set -uo pipefail
out=${OUT:-/tmp}
source bench/cuda/device_env.sh
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 170 $R/bench_kernels_cuda > "$out/kern_spindle.txt" 2>&1
  timeout 230 python3 .peer/kernel_bench.py > "$out/kern_peer.txt" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 90 $R/bench_model_cuda --preset 1b --T 32768 --recompute 0 > "$out/step_spindle.txt" 2>&1
  timeout 200 python3 .peer/ref_model.py --T 32768 --compile 2>&1 | tail -1 > "$out/step_peer.txt"
  timeout 80 $R/bench_model_cuda --preset 1b --T 131072 --recompute 1 --steps 4 \
      >> "$out/step_spindle.txt" 2>&1
  timeout 120 python3 .peer/ref_model.py --T 131072 --ckpt 2>&1 | tail -1 >> "$out/step_peer.txt"
) &
wait
for doc in 0 8192; do
  timeout 300 $R/bench_cp_cuda --T 262144 --cp 2 --doc "$doc" --warmup 1 --steps 3 "$@" \
      > "$out/cp_doc$doc.txt" 2>&1
done
cat "$out/step_spindle.txt" "$out/step_peer.txt" "$out"/cp_doc*.txt
grep -iE "lightning T=32K .*cpb=auto st=1|sdpa cuDNN T=32K|vs FLA|vs PyTorch" "$out/kern_spindle.txt"
grep -A4 -E "fla_simple_gla_T32768|sdpa_cudnn_T32768_D192" "$out/kern_peer.txt"
date -u +%Y-%m-%dT%H:%MZ
