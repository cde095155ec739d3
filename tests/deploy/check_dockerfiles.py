#!/usr/bin/env python3
"""Checks deploy/docker/*.Dockerfile without a Docker engine (none runs on the build machines):

- each build stage installs exactly scripts/setup.sh's PACKAGES, less the test/developer-only
  ones (ccache, clang and libclang-rt-14-dev for the fuzzers, git, iproute2, openssl, prometheus,
  python3, python3-torch);
- each binary a build stage installs from /build/... is at that path in a real CMake build tree
  (so the build command and the install paths agree);
- deploy/docker/runtime-packages.sh, run on the real binaries, names the packages of their
  shared libraries (the list the runtime stages install);
- the final stage runs as a non-root numeric user, has a HEALTHCHECK through spindle-healthcheck
  and an ENTRYPOINT; the GPU worker builds on a cudnn-devel image and runs on a cudnn-runtime one.

Usage: check_dockerfiles.py REPO_ROOT BUILD_DIR
Prints one line per problem and exits 1 when there is any.
"""
import os
import re
import subprocess
import sys

# Developer and test tools: not needed to build the daemons.
NOT_IN_IMAGES = {"ccache", "clang", "git", "iproute2", "libclang-rt-14-dev", "openssl", "prometheus",
                 "python3", "python3-torch"}


def logical_lines(text):
    """Dockerfile instructions with continuations joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def stages(lines):
    """[(from_line, [instructions])] per FROM."""
    result = []
    for line in lines:
        if line.upper().startswith("FROM "):
            result.append((line, []))
        elif result:
            result[-1][1].append(line)
    return result


def main():
    root, build = sys.argv[1], sys.argv[2]
    problems = []
    setup = open(os.path.join(root, "scripts/setup.sh")).read()
    m = re.search(r"PACKAGES=\(([^)]*)\)", setup)
    want = set(m.group(1).split()) - NOT_IN_IMAGES
    docker_dir = os.path.join(root, "deploy/docker")
    files = sorted(f for f in os.listdir(docker_dir) if f.endswith(".Dockerfile"))
    if set(files) != {"coordinator.Dockerfile", "worker.Dockerfile", "worker-cpu.Dockerfile"}:
        problems.append(f"unexpected Dockerfiles: {files}")
    for name in files:
        text = open(os.path.join(docker_dir, name)).read()
        if not os.path.exists(os.path.join(docker_dir, name + ".dockerignore")):
            problems.append(f"{name}: no {name}.dockerignore (the build context would hold build trees)")
        st = stages(logical_lines(text))
        if len(st) < 2:
            problems.append(f"{name}: not multi-stage")
            continue
        (build_from, build_body), (final_from, final_body) = st[0], st[-1]
        installs = [l for l in build_body if "apt-get install" in l]
        if len(installs) != 1:
            problems.append(f"{name}: build stage has {len(installs)} apt-get install lines, want 1")
        else:
            after = installs[0].split("apt-get install", 1)[1].split("&&")[0].split()
            have = {w for w in after if not w.startswith("-")}
            if have != want:
                problems.append(f"{name}: build packages differ from scripts/setup.sh: "
                                f"missing {sorted(want - have)}, extra {sorted(have - want)}")
        binaries = []
        for l in build_body:
            binaries += re.findall(r"/build/(\S+/spindle[\w-]*)", l)
        if not binaries:
            problems.append(f"{name}: installs no /build/... binary")
        real = []
        for b in sorted(set(binaries)):
            path = os.path.join(build, b)
            if os.path.exists(path):
                real.append(path)
            elif b.endswith("spindle-train") and not os.path.exists(os.path.join(build, "worker")):
                pass
            else:
                problems.append(f"{name}: /build/{b} is not where CMake puts it ({path} missing)")
        if not any("runtime-packages.sh" in l for l in build_body):
            problems.append(f"{name}: build stage does not list the runtime packages")
        if real:
            r = subprocess.run(["sh", os.path.join(docker_dir, "runtime-packages.sh"), *real],
                               capture_output=True, text=True)
            pkgs = set(r.stdout.split())
            if r.returncode != 0 or not {"libgrpc++1.51", "libprotobuf32", "libabsl20220623"} <= pkgs:
                problems.append(f"{name}: runtime-packages.sh on {real}: rc {r.returncode}, "
                                f"{sorted(pkgs)} {r.stderr.strip()}")
        user = [l for l in final_body if l.upper().startswith("USER ")]
        if not user or not re.fullmatch(r"USER [1-9]\d*(:[1-9]\d*)?", user[-1]):
            problems.append(f"{name}: final stage does not run as a numeric non-root USER: {user}")
        if not any(l.upper().startswith("HEALTHCHECK ") and "spindle-healthcheck" in l for l in final_body):
            problems.append(f"{name}: final stage has no HEALTHCHECK through spindle-healthcheck")
        if not any(l.upper().startswith("ENTRYPOINT ") for l in final_body):
            problems.append(f"{name}: final stage has no ENTRYPOINT")
        if not any("xargs -a /tmp/runtime-packages.txt" in l for l in final_body):
            problems.append(f"{name}: final stage does not install the runtime package list")
        if name == "worker.Dockerfile":
            if "cudnn-devel" not in build_from or "nvidia/cuda" not in build_from:
                problems.append(f"{name}: build stage is not an nvidia/cuda cudnn-devel image")
            if "cudnn-runtime" not in final_from or "nvidia/cuda" not in final_from:
                problems.append(f"{name}: runtime is not an nvidia/cuda cudnn-runtime image")
            if "SPINDLE_CUDA=ON" not in text:
                problems.append(f"{name}: not built with SPINDLE_CUDA=ON")
        else:
            if "debian:bookworm" not in build_from or "debian:bookworm-slim" not in final_from:
                problems.append(f"{name}: want debian:bookworm build and bookworm-slim runtime")
    for p in problems:
        print(p)
    print(f"{len(files)} Dockerfiles, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
