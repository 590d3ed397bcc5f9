#!/usr/bin/env bash
# Build csrc/cubin_load_floor (the driver-API load floor the bench compares warm hits against).
#
# Needs only cuda.h and a C++17 compiler: libcuda is dlopen'ed at run time, so no driver or
# stub library is needed to build. Where no cuda.h is found this prints why and exits 0:
# nothing else in the project depends on this program.
#
# Usage: scripts/build_csrc.sh [OUTPUT_DIR]   (default: build/csrc)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/build/csrc}
src=$here/csrc/cubin_load_floor.cpp

find_cuda_include() {
  local d
  for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$d" ] && [ -f "$d/include/cuda.h" ] && { echo "$d/include"; return 0; }
  done
  if command -v nvcc >/dev/null 2>&1; then
    d=$(dirname "$(dirname "$(command -v nvcc)")")
    [ -f "$d/include/cuda.h" ] && { echo "$d/include"; return 0; }
  fi
  [ -f /usr/include/cuda.h ] && grep -q cuModuleLoadData /usr/include/cuda.h && { echo /usr/include; return 0; }
  return 1
}

if ! inc=$(find_cuda_include); then
  echo "build_csrc: no cuda.h found (set CUDA_HOME); skipping cubin_load_floor (optional)"
  exit 0
fi
cxx=${CXX:-}
if [ -z "$cxx" ]; then
  for c in g++ c++ clang++; do command -v "$c" >/dev/null 2>&1 && { cxx=$c; break; }; done
fi
if [ -z "$cxx" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    cxx="nvcc -x cu"  # nvcc compiles host-only C++ just as well
  else
    echo "build_csrc: no C++ compiler found; skipping cubin_load_floor (optional)"
    exit 0
  fi
fi
mkdir -p "$out"
$cxx -O2 -std=c++17 -I"$inc" -o "$out/cubin_load_floor" "$src" -ldl
echo "build_csrc: built $out/cubin_load_floor ($cxx, cuda.h from $inc)"
