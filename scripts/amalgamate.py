#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Generate single_include/meshlib.hpp from include/meshlib.hpp, and single_include/meshlib_nn.hpp
(the training layer) from include/meshlib/nn.hpp.

Every `#include "meshlib/..."` (or `<meshlib/...>`) is replaced, recursively and in include
order, by the text of that header the first time it is met and dropped after that, as
`#pragma once` would do. Each inlined header is framed by `// begin meshlib/<file>` and
`// end meshlib/<file>`; `#pragma once` and SPDX lines are dropped and one include guard wraps the whole.
Other includes (the standard library, Kokkos) are kept as they are.

The file starts with the SPDX licence line and a generated configuration block: meshlib's version
(from VERSION) and the macros that switch on the optional parts, with what each enables. After the
umbrella come the optional parts' own umbrellas (<meshlib/mpi.hpp>, <meshlib/nccl.hpp> when it
exists), each under `#if` of its macro, so one file serves every configuration.

A header first met under a preprocessor condition (`#if ...`) is inlined there; including it
again unconditionally later would then lose it when the condition is false, so that is an error.

single_include/meshlib_nn.hpp is the training layer for single-header users: it includes
"meshlib.hpp" (the file above, from the same folder) and inlines only the headers of <meshlib/nn.hpp>
that meshlib.hpp does not already hold, so both can be included in any order and a header is never
inlined twice. Its guard is its own.

Usage:
  python3 scripts/amalgamate.py            write single_include/meshlib.hpp and meshlib_nn.hpp
  python3 scripts/amalgamate.py --stdout   print meshlib.hpp instead (--stdout-nn: meshlib_nn.hpp)
  python3 scripts/amalgamate.py --check    exit 1 and print a diff when either file is stale
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INCLUDE_DIR = REPO / "include"
ROOT_HEADER = "meshlib.hpp"
OUTPUT = REPO / "single_include" / "meshlib.hpp"
GUARD = "MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP"
NN_ROOT_HEADER = "meshlib/nn.hpp"
NN_OUTPUT = REPO / "single_include" / "meshlib_nn.hpp"
NN_GUARD = "MESHLIB_SINGLE_INCLUDE_MESHLIB_NN_HPP"
FIX_COMMAND = "python3 scripts/amalgamate.py"
SPDX_LINE = "// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception"

# (macro, CMake target, umbrella inlined under the macro or None, what it enables).
OPTIONAL_PARTS = [
    ("MESHLIB_ENABLE_KOKKOS_KERNELS", "meshlib::kokkos_kernels", None,
     "matmul through KokkosBlas::gemm (BLAS speed; link Kokkos Kernels and a BLAS) instead of "
     "meshlib's own, much slower kernel"),
    ("MESHLIB_ENABLE_CUBLAS", "meshlib::meshlib with a Kokkos built with CUDA", None,
     "matmul_into's products of float and double in CUDA memory through cuBLAS on the device's "
     "stream (link cuBLAS) instead of meshlib's own kernel"),
    ("MESHLIB_ENABLE_MPI", "meshlib::mpi", "meshlib/mpi.hpp",
     "<meshlib/mpi.hpp>: the MPI and hybrid process x thread communicators, meshlib::mpi::initialize "
     "(link MPI)"),
    ("MESHLIB_ENABLE_NCCL", "meshlib::nccl", "meshlib/nccl.hpp",
     "the NCCL communicator for CUDA devices (link CUDA's runtime and NCCL)"),
    ("MESHLIB_ENABLE_TBB", "meshlib::tbb", None,
     "the oneTBB-backed parts, e.g. parallel data loading (link oneTBB)"),
    ("MESHLIB_ENABLE_ZLIB", "meshlib::zlib", None,
     "the IDX reader of the data pipeline reads .gz files (link zlib)"),
]

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*(?:"(meshlib/[^"]+)"|<(meshlib/[^>]+)>)')
PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")
SPDX_RE = re.compile(r"^\s*//\s*SPDX-License-Identifier:")
IF_RE = re.compile(r"^\s*#\s*if(?:n?def)?\b")
ENDIF_RE = re.compile(r"^\s*#\s*endif\b")


class AmalgamationError(Exception):
    pass


class Amalgamator:
    def __init__(self, include_dir: Path) -> None:
        self.include_dir = include_dir
        # header -> (where it was first included, whether under a condition)
        self.seen: dict[str, tuple[str, bool]] = {}
        self.out: list[str] = []

    def inline(self, name: str, conditional: bool) -> None:
        path = self.include_dir / name
        if not path.is_file():
            raise AmalgamationError(f"meshlib: amalgamate: {name} is included but {path} does not exist")
        text = path.read_text(encoding="utf-8")
        self.out.append(f"// begin {name}\n")
        depth = 0  # preprocessor conditional depth inside this file
        for number, line in enumerate(text.splitlines(), start=1):
            if PRAGMA_ONCE_RE.match(line) or SPDX_RE.match(line):
                continue  # the single header has one SPDX line, at its top
            match = INCLUDE_RE.match(line)
            if match:
                child = match.group(1) or match.group(2)
                child_conditional = conditional or depth > 0
                where = f"{name}:{number}"
                if child in self.seen:
                    first_where, first_conditional = self.seen[child]
                    if first_conditional and not child_conditional:
                        raise AmalgamationError(
                            f"meshlib: amalgamate: {child} is first included under a preprocessor "
                            f"condition ({first_where}) and later unconditionally ({where}); the single "
                            f"header inlines each file once, so include it unconditionally first")
                    continue
                self.seen[child] = (where, child_conditional)
                self.inline(child, child_conditional)
                continue
            if IF_RE.match(line):
                depth += 1
            elif ENDIF_RE.match(line):
                depth -= 1
            self.out.append(line + "\n")
        self.out.append(f"// end {name}\n")

    def config_block(self) -> list[str]:
        version = read_version(self.include_dir.parent / "VERSION")
        lines = [
            f"// meshlib {version}: JAX-style SPMD sharding for C++ -- single-header distribution.\n",
            "// Generated from include/ by scripts/amalgamate.py; do not edit by hand:\n",
            f"// change the headers in include/ and run `{FIX_COMMAND}`.\n",
            "//\n",
            "// Configuration. Needs C++20, Kokkos (its headers and library) and threads. Optional parts\n",
            "// are off unless their macro is defined to 1 before this file is included (or with -D); each\n",
            "// also needs its library at link time, so none is switched on by finding a header:\n",
        ]
        for macro, target, _, what in OPTIONAL_PARTS:
            lines.append(f"//   {macro}=1  ({target} in CMake)\n")
            lines.extend(f"//       {part}\n" for part in wrap(what, 88))
        lines += [
            "// To see what was chosen: meshlib::config (kokkos_kernels, cublas, mpi, nccl, tbb, matmul_kernel) at\n",
            "// run time or in `if constexpr`, or define MESHLIB_VERBOSE_CONFIG for a one-line compiler note.\n",
            "// Version: MESHLIB_VERSION_MAJOR/_MINOR/_PATCH, MESHLIB_VERSION_STRING, meshlib::version_string.\n",
        ]
        return lines

    def run(self, root: str) -> str:
        self.seen[root] = ("the root", False)
        self.out = [SPDX_LINE + "\n"] + self.config_block() + [
            f"#ifndef {GUARD}\n",
            f"#define {GUARD}\n",
        ]
        self.inline(root, False)
        for macro, _, umbrella, _ in OPTIONAL_PARTS:
            if umbrella and (self.include_dir / umbrella).is_file() and umbrella not in self.seen:
                self.seen[umbrella] = (f"the optional part {macro}", True)
                self.out.append(f"#if defined({macro}) && {macro}\n")
                self.inline(umbrella, True)
                self.out.append(f"#endif  // {macro}\n")
        self.out.append(f"#endif  // {GUARD}\n")
        return "".join(self.out)


    def run_addon(self, root: str, base: str, base_seen: dict[str, tuple[str, bool]]) -> str:
        """The single header of `root` on top of the single header `base` (its file name, which the
        result includes): the headers `base` already holds (`base_seen`) are not inlined again."""
        self.seen = dict(base_seen)
        self.seen[root] = ("the root", False)
        version = read_version(self.include_dir.parent / "VERSION")
        self.out = [SPDX_LINE + "\n",
                    f"// meshlib {version}: the training layer (<{root}>) -- single-header distribution.\n",
                    "// Generated from include/ by scripts/amalgamate.py; do not edit by hand:\n",
                    f"// change the headers in include/ and run `{FIX_COMMAND}`.\n",
                    "//\n",
                    f"// Needs {base} from the same folder (included below): the same requirements and the\n",
                    "// same optional-part macros (see its first lines). This file adds only the headers of the\n",
                    f"// training layer that {base} does not hold.\n",
                    f"#ifndef {NN_GUARD}\n",
                    f"#define {NN_GUARD}\n",
                    f'#include "{base}"\n']
        self.inline(root, False)
        self.out.append(f"#endif  // {NN_GUARD}\n")
        return "".join(self.out)


def wrap(text: str, width: int) -> list[str]:
    lines, current = [], ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return lines + [current] if current else lines


def read_version(path: Path) -> str:
    """The version from VERSION (major.minor.patch), or "(unversioned)" for a tree without one."""
    if not path.is_file():
        return "(unversioned)"
    return path.read_text(encoding="utf-8").strip()


def amalgamate(include_dir: Path = INCLUDE_DIR, root: str = ROOT_HEADER) -> str:
    return Amalgamator(include_dir).run(root)


def amalgamate_nn(include_dir: Path = INCLUDE_DIR, root: str = ROOT_HEADER, nn_root: str = NN_ROOT_HEADER) -> str:
    """single_include/meshlib_nn.hpp: `nn_root` on top of the single header of `root`."""
    base = Amalgamator(include_dir)
    base.run(root)
    return Amalgamator(include_dir).run_addon(nn_root, Path(root).name, base.seen)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stdout", action="store_true", help="print meshlib.hpp instead of writing the files")
    mode.add_argument("--stdout-nn", action="store_true", help="print meshlib_nn.hpp instead of writing the files")
    mode.add_argument("--check", action="store_true",
                      help="compare with the committed files; print a diff and exit 1 when one differs")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"meshlib.hpp to write or check (default: {OUTPUT})")
    parser.add_argument("--nn-output", type=Path, default=NN_OUTPUT,
                        help=f"meshlib_nn.hpp to write or check (default: {NN_OUTPUT})")
    args = parser.parse_args(argv)

    try:
        texts = [(args.output, amalgamate()), (args.nn_output, amalgamate_nn())]
    except AmalgamationError as error:
        print(error, file=sys.stderr)
        return 2

    if args.stdout or args.stdout_nn:
        sys.stdout.write(texts[0 if args.stdout else 1][1])
        return 0
    if args.check:
        status = 0
        for output, text in texts:
            shown = output.relative_to(REPO) if output.is_relative_to(REPO) else output
            current = output.read_text(encoding="utf-8") if output.is_file() else ""
            if current == text:
                print(f"{shown} is up to date")
                continue
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{shown} (committed)", tofile=f"{shown} (from include/)"))
            print(f"\nmeshlib: {shown} is stale: it differs from what include/ generates (diff above).\n"
                  f"Fix: run `{FIX_COMMAND}` in the repository root and commit the result.")
            status = 1
        return status
    for output, text in texts:
        output.parent.mkdir(parents=True, exist_ok=True)
        # newline="\n": the same bytes on every platform, so the check above compares like with like.
        with open(output, "w", encoding="utf-8", newline="\n") as file:
            file.write(text)
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
