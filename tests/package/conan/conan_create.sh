#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# `conan create` of meshlib's recipe with its test_package, on a copy of the recipe's sources in
# WORK, with CONAN_HOME in WORK (nothing touches ~/.conan2) and no remote: the profile
# tests/package/conan/profile takes Kokkos, Kokkos Kernels, OpenMPI and oneTBB from the system.
#   conan_create.sh <meshlib source> <work dir> <vendor dir> <python> <options: a,b,c>
# Uses a `conan` 2.x on PATH, or runs Conan 2.8.1 from <vendor dir>/conan-2.8.1.tar.gz with
# Debian's Python modules. Exits 77 (skipped), saying why, when neither is usable.
set -euo pipefail
src="$1" work="$2" vendor="$3" python="$4" options="${5:-}"

skip() { echo "SKIPPED: $*"; exit 77; }

mkdir -p "$work"
conan=()
if command -v conan >/dev/null 2>&1 && conan --version 2>/dev/null | grep -q "Conan version 2\."; then
  conan=(conan)
elif [ -n "$vendor" ] && [ -f "$vendor/conan-2.8.1.tar.gz" ]; then
  if [ ! -f "$work/conan-2.8.1/conans/conan.py" ]; then
    tar xzf "$vendor/conan-2.8.1.tar.gz" -C "$work"
  fi
  missing=$("$python" - <<'PY'
import importlib
mods = ["fasteners", "jinja2", "requests", "colorama", "patch_ng", "yaml", "distro", "dateutil"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
  if [ -n "$missing" ]; then
    skip "Conan's Python modules are missing from $python: $missing (scripts/install_deps.sh installs them: python3-fasteners python3-jinja2 python3-requests python3-colorama python3-patch-ng)"
  fi
  conan=(env "PYTHONPATH=$work/conan-2.8.1" "$python" -c 'from conans.conan import run; run()')
else
  skip "no Conan 2 on PATH and no conan-2.8.1.tar.gz in '${vendor:-<no vendor dir>}'"
fi
echo "== $("${conan[@]}" --version)"

# A copy of what the recipe exports, plus test_package: `conan create` writes test_package's
# build folder next to it, and the source tree must stay clean.
rm -rf "$work/recipe" "$work/home"
mkdir -p "$work/recipe"
cp -r "$src/conanfile.py" "$src/VERSION" "$src/LICENSE" "$src/CMakeLists.txt" "$src/cmake" "$src/include" \
      "$src/test_package" "$work/recipe/"
rm -rf "$work/recipe/test_package/build" "$work/recipe/test_package/CMakeUserPresets.json"

export CONAN_HOME="$work/home"
args=(create "$work/recipe" -pr:a "$src/tests/package/conan/profile" --build=missing -nr)
expect_kernel="meshlib built-in"
IFS=',' read -r -a opts <<< "$options"
for o in "${opts[@]}"; do
  [ -n "$o" ] || continue
  args+=(-o "meshlib/*:$o=True")
  [ "$o" = kokkos_kernels ] && expect_kernel="KokkosBlas::gemm"
done
echo "== conan ${args[*]}"
log="$work/conan.log"
status=0
"${conan[@]}" "${args[@]}" >"$log" 2>&1 || status=$?
tail -n 40 "$log"
if [ "$status" -ne 0 ]; then
  echo "meshlib: conan create failed with status $status (full log: $log)"
  exit 1
fi
version=$(cat "$src/VERSION")
if ! grep -q "meshlib $version test_package OK: psum over 4 thread devices = {10, 100}; matmul kernel: $expect_kernel" "$log"; then
  echo "meshlib: conan create passed, but test_package did not report the psum and the '$expect_kernel' kernel (log: $log)"
  exit 1
fi
echo "== conan create meshlib/$version with test_package: OK (options: ${options:-none})"
