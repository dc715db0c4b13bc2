#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Writes every ```cpp block of the given Markdown files that is a whole program (has `int main`)
to OUT_DIR/<file-stem>_<n>.cpp, and prints the written paths, one a line. Used by the doc tests:
an example in the docs that no longer compiles or runs fails the build."""

import re
import sys
from pathlib import Path

BLOCK_RE = re.compile(r"^```(?:cpp|c\+\+)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def main(argv):
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    written = set()
    for md in map(Path, argv[1:]):
        stem = re.sub(r"[^A-Za-z0-9]+", "_", md.stem).lower()
        n = 0
        for match in BLOCK_RE.finditer(md.read_text(encoding="utf-8")):
            code = match.group(1)
            if not re.search(r"\bint\s+main\s*\(", code):
                continue
            n += 1
            path = out_dir / f"{stem}_{n}.cpp"
            text = f"// Extracted from {md.name}, code block {n}; edit the Markdown, not this.\n{code}"
            # Rewritten only when changed: a new modification time would rebuild every snippet on
            # every configure (a warm test command rebuilt all 28 of them).
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")
            written.add(path)
            print(path)
    for old in out_dir.glob("*.cpp"):
        if old not in written:
            old.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
