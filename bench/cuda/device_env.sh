# Sourced from the repository root by the bench/cuda scripts that run on the GPU machine: unpacks
# the binaries bench/cuda/pack_for_device.sh packed into .cuda-run (every call starts from the
# archive) and sets what those scripts need: R (the unpacked folder), the library path, the packed
# cluster binaries for the tests that start them, the peer's FLA (.peer) for its scripts, and
# NVLink multicast off (shared machines) unless the caller chose otherwise.
R=$PWD/.cuda-run
if [ -f "$R/run.tar.xz" ]; then tar -C "$R" -xJf "$R/run.tar.xz"; fi
export LD_LIBRARY_PATH=$R/lib:/usr/local/cuda/lib64
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export SPINDLE_TRAIN_BINARY=$R/spindle-train SPINDLE_COORDINATOR_BINARY=$R/spindle-coordinator
export SPINDLE_WORKER_BINARY=$R/spindle-worker
export PYTHONPATH=$PWD/.peer/fla-src:${PYTHONPATH:-}
