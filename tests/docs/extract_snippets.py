#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Writes the ```cpp blocks of the given Markdown files that are whole programs (have `int main`)
as one program per Markdown file, OUT_DIR/<file-stem>.cpp, and prints one line per file:
`<path>,<block name>,<block name>...` (the names are <file-stem>_<n>, n counting the whole
programs of that file from 1). Used by the doc tests: an example in the docs that no longer
compiles or runs fails the build or its test.

One program per Markdown file rather than per block (issue 28: the cold test command within 30
minutes on 2 cores): the blocks of a file share the same meshlib templates, which a batch
instantiates and compiles once (the nine programs of training.md took 172 CPU s apart, 47 as one).
Each block keeps its text and its own test: its code goes into a namespace of its own
(`doc_<name>`), its `main` is renamed `doc_main` (with a `return 0;` added at its end, which
`main` has implicitly), and the program's own `main` runs the block named by its first argument
(`doc_training training_3`). A block's #include lines stay where they are, at global scope between
the namespaces. `#line` directives point the compiler's messages at the Markdown file.

What a block may not do in a batch: declare names outside its own namespace (an explicit
specialisation of a meshlib or std template, a global operator new), or leave out an #include that
an earlier block of the same file has (the batch would not notice). Neither is done by any block
today; the extraction refuses the first kind (a specialisation of a std, meshlib or Kokkos class
template, or a `namespace std/meshlib/Kokkos` block) with a message naming the block."""

import re
import sys
from pathlib import Path

BLOCK_RE = re.compile(r"^```(?:cpp|c\+\+)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
MAIN_RE = re.compile(r"\bint\s+main\s*\(")
# What would not compile (or would mean something else) inside a namespace of its own.
GLOBAL_ONLY_RE = re.compile(r"^\s*(template\s*<\s*>\s*(?:struct|class)\s+(?:::)?(?:std|meshlib|Kokkos)::"
                            r"|namespace\s+(?:std|meshlib|Kokkos)\b)", re.MULTILINE)


def body_end(code, start):
    """The index of the `}` closing the brace block that opens at or after `start`, skipping
    comments, string and character literals."""
    i = code.index("{", start)
    depth = 0
    n = len(code)
    while i < n:
        c = code[i]
        if code.startswith("//", i):
            i = code.find("\n", i)
            if i < 0:
                break
            continue
        if code.startswith("/*", i):
            i = code.index("*/", i) + 2
            continue
        if c == "'" and i > 0 and code[i - 1].isdigit():  # a digit separator (1'000)
            i += 1
            continue
        if c in "\"'":
            # A raw string literal R"d(...)d".
            if c == '"' and i > 0 and code[i - 1] == "R":
                delim = code[i + 1:code.index("(", i)]
                i = code.index(")" + delim + '"', i) + len(delim) + 2
                continue
            j = i + 1
            while code[j] != c:
                j += 2 if code[j] == "\\" else 1
            i = j + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError("unbalanced braces in main")


def wrap(md, name, code, first_line):
    """One block as a namespace of the batch: its #include lines at global scope, the rest inside
    `namespace doc_<name>`, `main` renamed `doc_main`."""
    m = MAIN_RE.search(code)
    end = body_end(code, m.end())
    code = code[:end] + "return 0; " + code[end:]
    code = code[:m.start()] + "int doc_main(" + code[m.end():]
    bad = GLOBAL_ONLY_RE.search(code)
    if bad:
        sys.exit(f"extract_snippets.py: {md}: code block {name} has `{bad.group(1).strip()}`, which cannot be "
                 "compiled inside the namespace the doc tests give each block; move it into the docs' prose "
                 "or teach tests/docs/extract_snippets.py to leave it at global scope")
    out = []
    inside = False
    synced = False  # whether the next line's number is what the compiler counts
    for k, line in enumerate(code.splitlines()):
        is_pp_include = line.lstrip().startswith("#include")
        if is_pp_include and inside:
            out.append("}  // namespace doc_" + name)
            inside = synced = False
        if not is_pp_include and not inside and line.strip():
            out.append(f"namespace doc_{name} {{")
            inside, synced = True, False
        if not synced:
            out.append(f'#line {first_line + k} "{md.as_posix()}"')
            synced = True
        out.append(line)
    if inside:
        out.append("}  // namespace doc_" + name)
    return "\n".join(out) + "\n"


def main(argv):
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    written = set()
    for md in map(Path, argv[1:]):
        stem = re.sub(r"[^A-Za-z0-9]+", "_", md.stem).lower()
        text = md.read_text(encoding="utf-8")
        parts = []
        names = []
        for match in BLOCK_RE.finditer(text):
            code = match.group(1)
            if not MAIN_RE.search(code):
                continue
            name = f"{stem}_{len(names) + 1}"
            names.append(name)
            first_line = text.count("\n", 0, match.start(1)) + 1
            parts.append(f"// ---- {md.name}, whole program {len(names)} (line {first_line})\n"
                         + wrap(md, name, code, first_line))
        if not names:
            continue
        calls = "\n".join(f'  if (name == "{n}") return meshlib_doc_run(doc_{n}::doc_main, argc, argv);' for n in names)
        path = out_dir / f"{stem}.cpp"
        head = (f"// The whole programs of {md.name}, one namespace each (tests/docs/extract_snippets.py says how);\n"
                f"// edit the Markdown, not this.\n" + "\n".join(parts) + "\n")
        program = (
            head + f'#line {head.count(chr(10)) + 2} "{path.as_posix()}"\n'
            "#include <cstdio>\n#include <string_view>\n#include <type_traits>\n\n"
            "template <class F>\n"
            "int meshlib_doc_run(F f, int argc, char** argv) {\n"
            "  argv[1] = argv[0];  // the block sees its program name first, then the arguments after its name\n"
            "  if constexpr (std::is_invocable_v<F, int, char**>) return f(argc - 1, argv + 1);\n"
            "  else return f();\n"
            "}\n\n"
            "int main(int argc, char** argv) {\n"
            "  const std::string_view name = argc > 1 ? argv[1] : \"\";\n"
            f"{calls}\n"
            f"  std::fprintf(stderr, \"usage: %s <block>, one of:{''.join(' ' + n for n in names)}\\n\", argv[0]);\n"
            "  return 2;\n"
            "}\n")
        # Rewritten only when changed: a new modification time would rebuild every program on
        # every configure (a warm test command rebuilt all of them).
        if not path.exists() or path.read_text(encoding="utf-8") != program:
            path.write_text(program, encoding="utf-8")
        written.add(path)
        print(",".join([str(path)] + names))
    for old in out_dir.glob("*.cpp"):
        if old not in written:
            old.unlink()


if __name__ == "__main__":
    main(sys.argv[1:])
