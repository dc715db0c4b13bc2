#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Builds meshlib's HTML API reference with Doxygen (the repository's Doxyfile) and fails when a
public name lacks a /// comment.

Enforced: every name at namespace scope outside `detail` (classes, structs, concepts, functions,
operators, deduction guides, variables, aliases), every public member of a public class (functions,
constructors, operators, friends, data members, aliases, nested types), every public macro, and
Doxygen's comment errors (unknown commands, @param naming no parameter). The Doxyfile sets
WARN_AS_ERROR = FAIL_ON_WARNINGS, so a plain `doxygen` run fails the same way; the warnings are
read from the log and listed, each with its file:line.

  build_reference.py <doxygen> <output dir> <version>
Exit 77 (skipped) when doxygen is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEMBER_OF_CLASS = re.compile(r"(?:error|warning): Member .* of (class|struct|union) .+ is not documented\.")


def main(argv: list[str]) -> int:
    doxygen, out_dir, version = argv[1], Path(argv[2]), argv[3]
    if not shutil.which(doxygen):
        print(f"SKIPPED: doxygen not found ('{doxygen}'); apt-get install doxygen")
        return 77
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    log = out_dir / "warnings.log"
    config = (REPO / "Doxyfile").read_text(encoding="utf-8")
    config += f"\nOUTPUT_DIRECTORY = {out_dir}\nWARN_LOGFILE = {log}\n"
    run = subprocess.run([doxygen, "-"], input=config, text=True, cwd=REPO, capture_output=True,
                         env=dict(os.environ, MESHLIB_VERSION=version))
    sys.stdout.write(run.stdout + run.stderr)
    warnings = []
    if log.is_file():
        warnings = [l for l in log.read_text(encoding="utf-8").splitlines() if "error:" in l or "warning:" in l]
    members = [l for l in warnings if MEMBER_OF_CLASS.search(l)]
    others = [l for l in warnings if l not in members]
    if members:
        print(f"meshlib: {len(members)} public members of public classes lack a /// comment of their own:")
        for line in members:
            print("  " + line.replace(str(REPO) + "/", ""))
    if others:
        print(f"meshlib: {len(others)} public names lack a /// comment, or a comment is malformed:")
        for line in others:
            print("  " + line.replace(str(REPO) + "/", ""))
    if warnings:
        print("Fix: document each name above with a /// comment (a member: say what it is and why; "
              "@param/@returns where it helps; several names declared in one statement: a `/// @var name` "
              "block for each after the first). Implementation goes in meshlib::detail or a detail/ "
              f"folder, which the reference leaves out. The full log is {log}.")
        return 1
    if run.returncode != 0:
        print(f"meshlib: doxygen failed with exit status {run.returncode}")
        return 1
    index = out_dir / "html" / "index.html"
    mesh_page = out_dir / "html" / "classmeshlib_1_1mesh.html"
    if not index.is_file() or not mesh_page.is_file():
        print(f"meshlib: doxygen wrote no reference ({index} or {mesh_page} is missing)")
        return 1
    print(f"API reference: {index}")
    print("every public name at namespace scope, every public member of a public class, and every "
          "public macro is documented")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
