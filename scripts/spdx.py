#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Check or add the SPDX licence line in every source file of the repository.

Every source file names meshlib's licence in one line near its top:
    // SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception     (C++, CUDA)
    # SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception      (CMake, Python, shell)
It goes on the first line, or on the second after a `#!` line. Adding it is idempotent.

Files considered: those git tracks plus untracked ones it does not ignore (so a new file is
checked before it is committed). Source files: *.hpp *.h *.cpp *.cc *.cu *.cuh, *.cmake,
*.cmake.in, CMakeLists.txt, *.py, *.sh, and extensionless files whose `#!` line runs sh, bash or
python (such as .ci/run).

Exempt, by design:
  - single_include/meshlib.hpp: generated; scripts/amalgamate.py writes the line at its top
    (and drops the copies of the inlined headers);
  - documentation, data and metadata (*.md, *.png, *.json, *.txt other than CMakeLists.txt,
    *.pc.in, LICENSE, VERSION, Doxyfile, .gitignore): they are not code, and some formats (JSON)
    have no comments; the LICENSE file covers them.

Usage:
  python3 scripts/spdx.py --check   list the files without the line; exit 1 if there are any
  python3 scripts/spdx.py --fix     add the line where it is missing
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LICENSE_ID = "Apache-2.0 WITH LLVM-exception"
TAG = "SPDX-License-Identifier:"
FIX_COMMAND = "python3 scripts/spdx.py --fix"

SLASH_SUFFIXES = {".hpp", ".h", ".cpp", ".cc", ".cu", ".cuh"}
HASH_SUFFIXES = {".cmake", ".py", ".sh"}
EXEMPT = {"single_include/meshlib.hpp"}


def comment_for(rel: str, path: Path) -> str | None:
    """The comment leader of a source file, or None when the file is not a source file."""
    if rel in EXEMPT:
        return None
    name = path.name
    if name == "CMakeLists.txt" or name.endswith(".cmake.in"):
        return "#"
    if path.suffix in SLASH_SUFFIXES:
        return "//"
    if path.suffix in HASH_SUFFIXES:
        return "#"
    if path.suffix == "" and path.is_file():
        try:
            with open(path, "rb") as file:
                first = file.readline(200)
        except OSError:
            return None
        if first.startswith(b"#!") and any(w in first for w in (b"sh", b"python")):
            return "#"
    return None


def repository_files(root: Path) -> list[str] | None:
    """Tracked and untracked-but-not-ignored files; None outside a git checkout (a release tarball)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=root, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sorted({f for f in out.decode().split("\0") if f and (root / f).is_file()})


def has_line(text: str) -> bool:
    return any(TAG in line and LICENSE_ID in line for line in text.splitlines()[:3])


def add_line(text: str, leader: str) -> str:
    line = f"{leader} {TAG} {LICENSE_ID}\n"
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{line}{rest}"
    return line + text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list files without the line, exit 1 if any")
    mode.add_argument("--fix", action="store_true", help="add the line where it is missing")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository (default: this one)")
    args = parser.parse_args(argv)

    files = repository_files(args.root)
    if files is None:
        print(f"SKIPPED: {args.root} is not a git checkout (the check lists files with git ls-files)")
        return 77
    missing, checked = [], 0
    for rel in files:
        path = args.root / rel
        leader = comment_for(rel, path)
        if leader is None:
            continue
        checked += 1
        text = path.read_text(encoding="utf-8")
        if has_line(text):
            continue
        missing.append(rel)
        if args.fix:
            with open(path, "w", encoding="utf-8", newline="\n") as file:
                file.write(add_line(text, leader))

    if args.fix:
        print(f"spdx: added the licence line to {len(missing)} of {checked} source files")
        return 0
    if missing:
        print(f"meshlib: {len(missing)} of {checked} source files lack the line "
              f"'SPDX-License-Identifier: {LICENSE_ID}' in their first lines:")
        for rel in missing:
            print(f"  {rel}")
        print(f"Fix: run `{FIX_COMMAND}` in the repository root and commit the result.")
        return 1
    print(f"spdx: all {checked} source files carry 'SPDX-License-Identifier: {LICENSE_ID}'")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
