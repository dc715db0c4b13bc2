#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Builds meshlib's HTML API reference with Doxygen (the repository's Doxyfile) and fails when a
public name lacks a /// comment.

Enforced: every name at namespace scope outside `detail` (classes, structs, concepts, functions,
operators, deduction guides, variables, aliases), every public macro, and Doxygen's comment errors
(unknown commands, @param naming no parameter). Reported but not enforced: members of documented
classes without a comment of their own (accessors such as `size()`), listed as a count.

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
    if run.returncode != 0:
        print(f"meshlib: doxygen failed with exit status {run.returncode}")
        return 1
    index = out_dir / "html" / "index.html"
    mesh_page = out_dir / "html" / "classmeshlib_1_1mesh.html"
    if not index.is_file() or not mesh_page.is_file():
        print(f"meshlib: doxygen wrote no reference ({index} or {mesh_page} is missing)")
        return 1

    warnings = [l for l in log.read_text(encoding="utf-8").splitlines() if "error:" in l or "warning:" in l]
    members = [l for l in warnings if MEMBER_OF_CLASS.search(l)]
    enforced = [l for l in warnings if l not in members]
    print(f"API reference: {index}")
    print(f"{len(members)} members of documented classes have no comment of their own (not enforced)")
    if enforced:
        print(f"meshlib: {len(enforced)} public names lack a /// comment, or a comment is malformed:")
        for line in enforced:
            print("  " + line.replace(str(REPO) + "/", ""))
        print("Fix: document each name above with a /// @brief line (implementation goes in "
              "meshlib::detail or a detail/ folder, which the reference leaves out); the full log is "
              f"{log}.")
        return 1
    print("every public name at namespace scope, and every public macro, is documented")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
