#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# The flagship's checkpoints under mpirun: 2 processes x 2 thread devices train 10 steps and save;
# the checkpoint then resumes both under mpirun and in one process, and the two continuations
# must end with the same test accuracy (the hybrid run reduces in rank order: bitwise the thread
# run). usage: mpi_resume_check.sh BINARY WORKDIR LAUNCHER...
set -euo pipefail
bin="$1" work="$2"
shift 2
rm -rf "$work" && mkdir -p "$work"
args=(--mesh 2x2 --hidden 64 --batch 64 --epochs 1)
"$@" "$bin" "${args[@]}" --steps 10 --checkpoint-dir "$work/mpi" > "$work/first.log"
cp -r "$work/mpi" "$work/one"
"$@" "$bin" "${args[@]}" --steps 20 --checkpoint-dir "$work/mpi" --resume > "$work/mpi.log"
"$bin" "${args[@]}" --steps 20 --checkpoint-dir "$work/one" --resume > "$work/one.log"
cat "$work/first.log" "$work/mpi.log" "$work/one.log"
grep -q "resumed from $work/mpi at step 10" "$work/mpi.log"
grep -q "resumed from $work/one at step 10" "$work/one.log"
mpi=$(grep -o "done: 20 steps in [0-9.]* s, test accuracy [0-9.]*%" "$work/mpi.log" | sed 's/.*accuracy //')
one=$(grep -o "done: 20 steps in [0-9.]* s, test accuracy [0-9.]*%" "$work/one.log" | sed 's/.*accuracy //')
if [ -z "$mpi" ] || [ "$mpi" != "$one" ]; then
  echo "mpi_resume_check: resumed under mpirun: '${mpi}', in one process: '${one}'"
  exit 1
fi
echo "mpi_resume_check: both continuations end at test accuracy $mpi"
