#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Fails when docs/getting-started.md stops starting with how to use meshlib in a project, or holds
a table of test-command timings again (issue 41, item 5: ~100 lines of CI timings once stood between
"build" and "use meshlib in your project"; they belong in docs/benchmarks.md, "Test command time").

Checked outside fenced code blocks:
- the page's first `## ` heading is `## Using meshlib in your project`;
- no Markdown table holds a duration (`12 s`, `44 min`, `1406 s (23.4 min)`, `8.9 minutes`) or has a
  `time` column, and no heading is about the test command's time.
Each violation is printed as `file:line: message`.

Usage: check_getting_started.py FILE   (docs/getting-started.md)
       check_getting_started.py --self-test   (the checker against pages with and without violations)
"""
import re
import sys

FIRST_SECTION = "Using meshlib in your project"
# A duration in a table cell: a number and a unit of time.
DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s*(?:s|sec|secs|seconds?|min|mins|minutes?|h|hours?)(?![\w])")
TIME_COLUMN = re.compile(r"^\s*(?:\*\*)?(?:cpu |wall |build |run )?time(?:s)?(?: \(.*\))?(?:\*\*)?\s*$", re.IGNORECASE)
TIMING_HEADING = re.compile(r"^#+\s.*\b(?:test command|ci)\b.*\btimes?\b|^#+\s.*\btimings?\b", re.IGNORECASE)


def violations(text):
    """(line number, message) for each violation in the page `text`."""
    out = []
    first_section = None
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#") and TIMING_HEADING.match(line):
            out.append((n, "a heading about test timings (%r): the timings belong in docs/benchmarks.md, "
                           "\"Test command time\"" % line.strip()))
        if line.startswith("## ") and first_section is None:
            first_section = (n, line[3:].strip())
        if line.lstrip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for c in cells:
                if DURATION.search(c) or TIME_COLUMN.match(c):
                    out.append((n, "a table of timings (cell %r): the test command's timings belong in "
                                   "docs/benchmarks.md, \"Test command time\"" % c))
                    break
    if first_section is None:
        out.append((1, "no '## ' heading; the page must start with '## %s'" % FIRST_SECTION))
    elif first_section[1] != FIRST_SECTION:
        out.append((first_section[0], "the first '## ' heading is %r; the page must start with how to use "
                                      "meshlib in a project: '## %s'" % (first_section[1], FIRST_SECTION)))
    return out


def check(path):
    with open(path, encoding="utf-8") as f:
        found = violations(f.read())
    for n, message in found:
        print("%s:%d: %s" % (path, n, message))
    if not found:
        print("%s: starts with '## %s' and holds no timing table" % (path, FIRST_SECTION))
    return 1 if found else 0


def self_test():
    """The checker passes a good page and finds each kind of violation at its line."""
    good = ("# Getting started\n\nIntro.\n\n## Using meshlib in your project\n\n```sh\n## not a heading\n"
            "| 12 s | in a code block |\n```\n\n## Build\n\n| option | default |\n| --- | --- |\n"
            "| `MESHLIB_UNITY_TESTS_BATCH` | 10 |\n")
    cases = [
        ("good page", good, []),
        ("build section first", good.replace("## Using meshlib in your project", "## Build first"), [5]),
        ("timing table", good + "\n| run | what ran | time |\n| --- | --- | --- |\n| cold | all | 1406 s (23.4 min) |\n",
         [18, 20]),
        ("minutes in a cell", good + "\n| leg | took |\n| --- | --- |\n| Kokkos 4 | 4.4 min |\n", [20]),
        ("timing heading", good + "\n### Test command time\n", [18]),
        ("no sections", "# Getting started\n", [1]),
    ]
    failures = []
    for name, text, lines in cases:
        got = [n for n, _ in violations(text)]
        if got != lines:
            failures.append("%s: violations at lines %s, expected %s" % (name, got, lines))
    for f in failures:
        print("self-test FAILED: " + f)
    if not failures:
        print("self-test passed: a good page passes; a wrong first section, a timing table and a timing "
              "heading are found at their lines")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        sys.exit(self_test())
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[1]))
