#!/bin/sh
# Prints, one per line and sorted, the Debian/Ubuntu packages that own the shared libraries the
# given binaries load (ldd, then dpkg-query -S). The images' build stages run it on the built
# binaries and their runtime stages install exactly that list, so a runtime image carries the
# shared libraries its binaries need and nothing else, on any Debian-based base image.
# Fails when a library is missing or owned by no package (then the runtime image would break).
set -eu
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
libs=$(mktemp)
trap 'rm -f "$libs"' EXIT
for bin in "$@"; do
  out=$(ldd "$bin") || { echo "runtime-packages: ldd $bin failed" >&2; exit 1; }
  if printf '%s\n' "$out" | grep -q 'not found'; then
    printf '%s\n' "$out" | grep 'not found' >&2
    echo "runtime-packages: $bin has unresolved libraries" >&2
    exit 1
  fi
  printf '%s\n' "$out" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' >>"$libs"
done
sort -u "$libs" | while read -r lib; do
  # Merged /usr: dpkg may know the file under /lib or /usr/lib, by its link or its target.
  real=$(readlink -f "$lib")
  pkg=""
  for path in "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"; do
    pkg=$(dpkg-query -S "$path" 2>/dev/null | head -n1 | cut -d: -f1) && [ -n "$pkg" ] && break
  done
  if [ -z "$pkg" ]; then
    echo "runtime-packages: no package owns $lib" >&2
    exit 1
  fi
  echo "$pkg"
done | sort -u
