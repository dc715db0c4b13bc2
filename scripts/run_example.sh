#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Installs what is missing, builds the flagship example in build/ and runs it (train_fashion_mnist:
# an MLP trained on Fashion-MNIST on thread devices; without --mesh, on a mesh that fits the
# machine's cores, its first line saying which: examples/common/flagship_options.hpp).
# EXAMPLE: the example target to build and run (any target in examples/, e.g. quickstart, flagship or
# train_resnet_fashion_mnist, the convolutional flagship, or train_gpt_chars, the character-level GPT);
# arguments go to it.
set -euo pipefail
EXAMPLE="${EXAMPLE:-train_fashion_mnist}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SECONDS=0

"$repo_root/scripts/install_deps.sh"
configure
cmake --build "$BUILD_DIR" -j "$JOBS" --target "$EXAMPLE"
elapsed "built $EXAMPLE"

exe="$(find "$BUILD_DIR/examples" -type f -name "$EXAMPLE" -perm -u+x | head -n 1)"
if [ -z "$exe" ]; then
  echo "run_example: built target $EXAMPLE but found no executable of that name under $BUILD_DIR/examples" >&2
  exit 1
fi
echo "== $exe $*"
exec "$exe" "$@"
