#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
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
    "meshlib/c.hpp": "// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception\n#pragma once\nint c;\n",
})
out = amalgamate.amalgamate(root)
lines = out.splitlines()
guard_at = lines.index(f"#ifndef {amalgamate.GUARD}")
check("guard", lines[guard_at + 1] == f"#define {amalgamate.GUARD}"
      and lines[-1].startswith(f"#endif  // {amalgamate.GUARD}"), out)
# One SPDX line, the first; the configuration block before the guard names every macro.
check("one SPDX line first", lines[0] == amalgamate.SPDX_LINE and out.count("SPDX-License-Identifier") == 1, out)
for macro, *_ in amalgamate.OPTIONAL_PARTS:
    check(f"config block names {macro}", any(macro in l for l in lines[:guard_at]), out)
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

# An optional part's umbrella, when it exists, is inlined after the root under #if of its macro,
# and the headers it shares with the root are not repeated.
root = tree({
    "meshlib.hpp": '#include "meshlib/a.hpp"\n',
    "meshlib/a.hpp": "int a;\n",
    "meshlib/mpi.hpp": '#include "meshlib/a.hpp"\n#include "meshlib/m.hpp"\n',
    "meshlib/m.hpp": "int m;\n",
})
lines = amalgamate.amalgamate(root).splitlines()
at = lines.index("#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI")
check("optional part guarded", lines.index("int m;") > at and lines.index("// end meshlib.hpp") < at
      and lines.count("int a;") == 1, lines)
check("absent optional part skipped", "MESHLIB_ENABLE_NCCL) &&" not in "\n".join(lines), lines)

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

# The training layer's file: includes the base single header, inlines only what the base lacks
# (in include order, once), has its own guard, and refuses a header the base holds only under a
# condition (it would be lost when the condition is false).
root = tree({
    "meshlib.hpp": '#include "meshlib/a.hpp"\n#ifdef X\n#include "meshlib/x.hpp"\n#endif\n',
    "meshlib/a.hpp": '#include "meshlib/c.hpp"\nint a;\n',
    "meshlib/c.hpp": "int c;\n",
    "meshlib/x.hpp": "int x;\n",
    "meshlib/nn.hpp": '#include "meshlib/a.hpp"\n#include "meshlib/n1.hpp"\n#include "meshlib/n2.hpp"\n',
    "meshlib/n1.hpp": '#include "meshlib/c.hpp"\n#include "meshlib/n2.hpp"\nint n1;\n',
    "meshlib/n2.hpp": "int n2;\n",
})
nn = amalgamate.amalgamate_nn(root)
nn_lines = nn.splitlines()
check("nn: one SPDX line first", nn_lines[0] == amalgamate.SPDX_LINE and nn.count("SPDX-License-Identifier") == 1, nn)
at = nn_lines.index(f"#ifndef {amalgamate.NN_GUARD}")
check("nn: guard, then the base header", nn_lines[at + 1] == f"#define {amalgamate.NN_GUARD}"
      and nn_lines[at + 2] == '#include "meshlib.hpp"' and nn_lines[-1] == f"#endif  // {amalgamate.NN_GUARD}", nn)
check("nn: nothing of the base inlined again", "int a;" not in nn and "int c;" not in nn
      and "begin meshlib/a.hpp" not in nn, nn)
check("nn: its own headers once, in include order",
      nn.count("int n1;") == 1 and nn.count("int n2;") == 1 and nn.index("begin meshlib/n2.hpp") < nn.index("int n1;"), nn)
check("nn: deterministic", nn == amalgamate.amalgamate_nn(root))
(root / "meshlib" / "n2.hpp").write_text('#include "meshlib/x.hpp"\nint n2;\n')
try:
    amalgamate.amalgamate_nn(root)
    check("nn: a header the base holds under a condition is refused", False, "no error")
except amalgamate.AmalgamationError as e:
    check("nn: a header the base holds under a condition is refused",
          "meshlib/x.hpp is first included under a preprocessor condition" in str(e), str(e))

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("amalgamate rules OK")
