# syntax=docker/dockerfile:1
# The coordinator image: spindle-coordinator, the `spindle` CLI and spindle-healthcheck on
# Debian bookworm-slim, running as uid 10001. From the repository root:
#   docker build -f deploy/docker/coordinator.Dockerfile -t spindle-coordinator:0.1.0 .
# Ports: 7070 gRPC (clients, workers, grpc.health.v1), 9400 /metrics. State: /var/lib/spindle.

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
 && cmake --build /build --target spindle-coordinator spindle spindle-healthcheck \
 && install -D -m 0755 -t /out/bin \
      /build/coordinator/spindle-coordinator /build/cli/spindle /build/cli/spindle-healthcheck \
 && sh deploy/docker/runtime-packages.sh /out/bin/* > /out/runtime-packages.txt

FROM debian:bookworm-slim AS coordinator
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive xargs -a /tmp/runtime-packages.txt \
      apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --system --gid 10001 spindle \
 && useradd --system --uid 10001 --gid spindle --home-dir /var/lib/spindle --no-create-home \
      --shell /usr/sbin/nologin spindle \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/spindle
COPY --from=build /out/bin/ /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/spindle
VOLUME /var/lib/spindle
EXPOSE 7070 9400
# TLS with the coordinator's CA, kept beside the database (given there, or made at the first start).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["spindle-healthcheck", "--grpc", "127.0.0.1:7070", "--tls_ca_file", "/var/lib/spindle/spindle.db.ca.pem", "--timeout", "3"]
ENTRYPOINT ["spindle-coordinator"]
CMD ["--listen=0.0.0.0:7070", "--db=/var/lib/spindle/spindle.db", "--metrics_port=9400", "--metrics_host=0.0.0.0", "--users_file=/etc/spindle/users"]
