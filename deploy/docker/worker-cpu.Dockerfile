# syntax=docker/dockerfile:1
# The CPU worker image: spindle-worker and spindle-train (CPU backend, Gloo collectives) on
# Debian bookworm-slim, running as uid 10001. For CPU-only clusters (deploy/k8s/overlays/cpu).
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t spindle-worker-cpu:0.1.0 .
# Port 9401: /metrics and /healthz. Scratch space: /var/lib/spindle-worker.

FROM debian:bookworm AS build
# scripts/setup.sh's packages, less the developer and test tools (ccache, git, iproute2,
# prometheus, openssl, python3, python3-torch); tests/deploy/check_dockerfiles.py keeps the lists in step.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev \
      libgloo-dev libsqlite3-dev libopenblas-dev nlohmann-json3-dev libcpp-httplib-dev \
      zlib1g-dev libssl-dev libgtest-dev libgmock-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPINDLE_CUDA=OFF \
 && cmake --build /build --target spindle-worker spindle-train spindle spindle-healthcheck \
 && install -D -m 0755 -t /out/bin /build/worker/spindle-worker /build/worker/spindle-train \
      /build/cli/spindle /build/cli/spindle-healthcheck \
 && sh deploy/docker/runtime-packages.sh /out/bin/* > /out/runtime-packages.txt

FROM debian:bookworm-slim AS worker-cpu
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive xargs -a /tmp/runtime-packages.txt \
      apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --system --gid 10001 spindle \
 && useradd --system --uid 10001 --gid spindle --home-dir /var/lib/spindle-worker \
      --no-create-home --shell /usr/sbin/nologin spindle \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/spindle-worker \
 && install -d -o 10001 -g 10001 -m 0770 /checkpoints
# spindle-worker starts the spindle-train next to it.
COPY --from=build /out/bin/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/spindle-worker
EXPOSE 9401
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["spindle-healthcheck", "--http", "127.0.0.1:9401", "--timeout", "3"]
ENTRYPOINT ["spindle-worker"]
CMD ["--coordinator=spindle-coordinator:7070", "--metrics_port=9401", "--metrics_host=0.0.0.0", "--work_dir=/var/lib/spindle-worker"]
