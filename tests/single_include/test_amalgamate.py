#!/usr/bin/env python3
"""Checks the rules of scripts/amalgamate.py on small made-up include trees."""

import importlib.util
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "amalgamate.py"
spec = importlib.util.spec_from_file_location("amalgamate", SCRIPT)
amalgamate = importlib.util.module_from_spec(spec)
sys.modules["amalgamate"] = amalgamate
spec.loader.exec_module(amalgamate)

failures = []


def check(name, condition, detail=""):
    if not condition:
        failures.append(f"{name}: {detail}")


def tree(files):
    root = Path(tempfile.mkdtemp())
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


# Inline once, in include order, with markers; #pragma once dropped; other includes kept.
root = tree({
    "meshlib.hpp": '#pragma once\n#include "meshlib/a.hpp"\n#include <meshlib/b.hpp>\n#include "meshlib/a.hpp"\n',
    "meshlib/a.hpp": '#pragma once\n#include <vector>\n#include "meshlib/c.hpp"\nint a;\n',
    "meshlib/b.hpp": '  #  pragma   once\n#include "meshlib/c.hpp"\nint b;\n',
    "meshlib/c.hpp": "#pragma once\nint c;\n",
})
out = amalgamate.amalgamate(root)
lines = out.splitlines()
check("guard", lines[3] == f"#ifndef {amalgamate.GUARD}" and lines[4] == f"#define {amalgamate.GUARD}"
      and lines[-1].startswith(f"#endif  // {amalgamate.GUARD}"), out)
check("no pragma once", "pragma" not in out, out)
check("kept foreign include", "#include <vector>" in lines, out)
check("no meshlib include left", not any("#include" in l and "meshlib/" in l for l in lines), out)
for name in ["meshlib/a.hpp", "meshlib/b.hpp", "meshlib/c.hpp"]:
    check(f"{name} once", lines.count(f"// begin {name}") == 1 and lines.count(f"// end {name}") == 1, out)
order = [l for l in lines if l.startswith("int ")]
check("include order", order == ["int c;", "int a;", "int b;"], order)
# c is nested inside a's frame: begin a, begin c, end c, end a.
idx = {m: lines.index(m) for m in ["// begin meshlib/a.hpp", "// begin meshlib/c.hpp",
                                   "// end meshlib/c.hpp", "// end meshlib/a.hpp"]}
check("nesting", idx["// begin meshlib/a.hpp"] < idx["// begin meshlib/c.hpp"] < idx["// end meshlib/c.hpp"]
      < idx["// end meshlib/a.hpp"], idx)
check("deterministic", out == amalgamate.amalgamate(root))

# A missing header is an error that names it.
root = tree({"meshlib.hpp": '#include "meshlib/missing.hpp"\n'})
try:
    amalgamate.amalgamate(root)
    check("missing header", False, "no error")
except amalgamate.AmalgamationError as e:
    check("missing header message", "meshlib/missing.hpp" in str(e), str(e))

# First included under #if, later unconditionally: an error (the single copy would be conditional).
root = tree({
    "meshlib.hpp": '#if X\n#include "meshlib/a.hpp"\n#endif\n#include "meshlib/a.hpp"\n',
    "meshlib/a.hpp": "int a;\n",
})
try:
    amalgamate.amalgamate(root)
    check("conditional then unconditional", False, "no error")
except amalgamate.AmalgamationError as e:
    check("conditional message", "meshlib/a.hpp" in str(e) and "condition" in str(e), str(e))

# Conditional everywhere, or unconditional first: fine.
root = tree({
    "meshlib.hpp": '#include "meshlib/a.hpp"\n#ifdef X\n#include "meshlib/a.hpp"\n#endif\n',
    "meshlib/a.hpp": "int a;\n",
})
check("unconditional first", amalgamate.amalgamate(root).count("int a;") == 1)

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("amalgamate rules OK")
