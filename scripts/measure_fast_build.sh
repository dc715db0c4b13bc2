#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Times the edit-compile loop of two user programs (tests/package/fast_build: a 33-line shard_map
# Megatron pair, a one-block Transformer trained with train_step) with and without
# meshlib_enable_fast_build, one job (ninja -j1), and prints docs/fast-builds.md's table.
#   scripts/measure_fast_build.sh [WORK_DIR]      (default: a fresh temporary folder)
# BUILD_DIR: a configured meshlib build tree to install from (default: build/).
# CONFIGS: space-separated compiler:flags:fast[:runtime] (default below); fast is ON or OFF (-O1 with
# ON is what meshlib_enable_fast_build's ITERATE sets); runtime ON adds meshlib_enable_fast_build's
# RUNTIME (meshlib's runtime compiled once, in meshlib_runtime; needs fast ON).
# ROUNDS: how many times each rebuild is timed (default 1); the rounds go through the configurations
# in turn (interleaved), so that a change of load touches every configuration alike.
# A rebuild is what an edit costs: the program's source touched, then its target built (compile
# and link). Each is timed as CPU seconds (user + sys of the compiler and linker: what the wall
# time is on an idle core) and wall seconds (which a loaded machine stretches). The first build
# of a configuration (both programs, and with fast=ON their precompiled headers) is timed too.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/meshlib-fast-build.XXXXXX)}"
build_dir="${BUILD_DIR:-$repo_root/build}"
configs="${CONFIGS:-g++:-O2:OFF g++:-O2:ON g++:-O2:ON:ON g++:-O1:ON clang++:-O2:OFF clang++:-O2:ON}"
rounds="${ROUNDS:-1}"
src="$repo_root/tests/package/fast_build"

if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  echo "measure_fast_build: $build_dir is not a configured build tree; configure meshlib there first" >&2
  exit 2
fi
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null

# Runs a command and sets cpu (user + sys of it and the children it waited for) and wall, in
# seconds; a command that fails stops the script, naming it.
timed() {
  local f u s e
  f=$(mktemp)
  if ! /usr/bin/time -f "%U %S %e" -o "$f" "$@" >/dev/null; then
    echo "measure_fast_build: failed: $*" >&2
    exit 1
  fi
  read -r u s e <"$f"
  rm -f "$f"
  cpu=$(awk -v u="$u" -v s="$s" 'BEGIN { printf "%.1f", u + s }')
  wall=$(awk -v e="$e" 'BEGIN { printf "%.1f", e }')
}

declare -A first rows
for config in $configs; do
  IFS=: read -r cxx opt fast runtime <<<"$config"
  runtime="${runtime:-OFF}"
  dir="$work/build-$cxx${opt}-$fast-$runtime"
  cmake -S "$src" -B "$dir" -G Ninja "-DCMAKE_CXX_COMPILER=$cxx" -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_CXX_FLAGS_RELEASE=$opt" -DCMAKE_PREFIX_PATH="$work/prefix" "-DFAST_BUILD=$fast" \
    "-DRUNTIME=$runtime" -DRUNTIME_CHECK=OFF >/dev/null
  timed ninja -C "$dir" -j1
  first[$config]="$cpu ($wall)"
done
for ((round = 1; round <= rounds; ++round)); do
  for config in $configs; do
    IFS=: read -r cxx opt fast runtime <<<"$config"
    runtime="${runtime:-OFF}"
    dir="$work/build-$cxx${opt}-$fast-$runtime"
    cells=()
    for prog in megatron transformer; do
      touch "$src/$prog.cpp"
      timed ninja -C "$dir" -j1 "$prog"
      "$dir/$prog" >/dev/null  # the program still runs and checks its result
      cells+=("$cpu ($wall)")
    done
    rows[$config]+="| $($cxx --version | head -1 | sed 's/ (.*)//') | $opt | $fast | $runtime | $(cut -d' ' -f1 /proc/loadavg) | ${cells[0]} | ${cells[1]} | ${first[$config]} |"$'\n'
  done
done
echo "| compiler | flags | meshlib_enable_fast_build | RUNTIME | load average (1 min, at the end) | megatron rebuild: CPU s (wall s) | transformer rebuild: CPU s (wall s) | first build: CPU s (wall s) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
for config in $configs; do printf '%s' "${rows[$config]}"; done
echo
echo "(load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores)"
