#!/bin/sh
# Prints, one per line and sorted, the Debian/Ubuntu packages that own the shared libraries the
# given binaries load (ldd, then dpkg-query -S). The images' build stages run it on the built
# binaries and their runtime stages install exactly that list, so a runtime image carries the
# shared libraries its binaries need and nothing else, on any Debian-based base image.
# Fails when a library is missing or owned by no package (then the runtime image would break).
# Libraries of the CUDA toolkit in /usr/local/cuda are left to the CUDA base image.
set -eu
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
libs=$(mktemp)
owners=$(mktemp)
sorted=$(mktemp)
found=$(mktemp)
trap 'rm -f "$libs" "$owners" "$sorted" "$found"' EXIT
for bin in "$@"; do
  out=$(ldd "$bin") || { echo "runtime-packages: ldd $bin failed" >&2; exit 1; }
  if printf '%s\n' "$out" | grep -q 'not found'; then
    printf '%s\n' "$out" | grep 'not found' >&2
    echo "runtime-packages: $bin has unresolved libraries" >&2
    exit 1
  fi
  # CUDA toolkit libraries (cudart, NCCL, cuBLAS, cuDNN under /usr/local/cuda) come with the
  # CUDA base image, not from a package; a build without CUDA does not link them at all.
  printf '%s\n' "$out" | awk '$2 == "=>" && $3 ~ /^\// && $3 !~ /^\/usr\/local\/cuda/ { print $3 }' >>"$libs"
done
# Merged /usr: dpkg may know a file under /lib or /usr/lib, by its link or its target; ask about
# every spelling in one dpkg-query call (each call reads the whole package database).
candidates() {
  real=$(readlink -f "$1")
  printf '%s\n' "$1" "$real" "/usr$1" "/usr$real" "${1#/usr}" "${real#/usr}" | sort -u
}
sort -u "$libs" >"$sorted"
while read -r lib; do candidates "$lib"; done <"$sorted" | xargs dpkg-query -S \
  2>/dev/null | grep -v '^diversion ' >"$owners" || true
while read -r lib; do
  pkg=""
  for path in $(candidates "$lib"); do
    pkg=$(awk -v p="$path" '{ f = $0; sub(/^[^ ]* /, "", f) } f == p { sub(/[:,].*/, "", $1); print $1; exit }' "$owners")
    [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ]; then
    echo "runtime-packages: no package owns $lib" >&2
    exit 1
  fi
  echo "$pkg"
done <"$sorted" >"$found"
sort -u "$found"
