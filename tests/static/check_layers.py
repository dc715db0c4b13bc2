#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Fails when a header under include/meshlib/ includes a layer above its own (docs/design.md,
"Layers"): the layers depend only downward, core < comm < runtime < tensor < collectives <
debug < exec < nn, and the thread backend (comm/thread/) is the runners' transport, not a
utility of the layers between: tensor, collectives and debug do not include it (the timeout
default is comm/timeout.hpp; the device threads and pinning belong to exec). The layers in
NO_FOREIGN_DETAIL (nn) name nothing of another layer's internal namespace: no `meshlib::detail::`
name, whichever it is, in their code (their own `meshlib::nn::detail` is theirs); they use the
public faces below them (tensor/kernel.hpp: `meshlib::launch`, `meshlib::allocate`, block views;
`meshlib::diagnostic`). Each violation is printed as `file:line: message`.

Usage: check_layers.py INCLUDE_DIR   (the directory that holds meshlib/)
       check_layers.py --self-test   (the checker against small trees with and without violations)
"""
import os
import re
import sys
import tempfile

# Bottom to top; a header may include its own layer and those before it.
LAYERS = ["core", "comm", "runtime", "tensor", "collectives", "debug", "exec", "nn"]
# Top-level headers every layer may include (configuration, not a layer).
ANYWHERE = {"meshlib/config.hpp", "meshlib/version.hpp"}
# (layers, forbidden include prefix, why) beyond the order.
EXTRA = [
    (("tensor", "collectives", "debug"), "meshlib/comm/thread/",
     "the thread backend is the runners' transport: the timeout default is meshlib/comm/timeout.hpp, "
     "the device threads and pinning are exec's"),
]
# Layers whose code names no `meshlib::detail::` entity (another layer's internals).
NO_FOREIGN_DETAIL = ("nn",)
FOREIGN_DETAIL = re.compile(r"(?<![\w:])(?:::)?meshlib::detail::(\w+)|using\s+namespace\s+(?:::)?meshlib::detail\b")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](meshlib/[^">]+)[">]')


def violations(include_dir):
    """Every (path, line, message) in include_dir/meshlib/<layer>/."""
    found = []
    root = os.path.join(include_dir, "meshlib")
    for layer in LAYERS:
        top = os.path.join(root, layer)
        for dirpath, _, files in sorted(os.walk(top)):
            for name in sorted(files):
                if not name.endswith((".hpp", ".h")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, include_dir)
                with open(path, encoding="utf-8") as f:
                    for number, text in enumerate(f, 1):
                        if layer in NO_FOREIGN_DETAIL:
                            code = text.split("//", 1)[0]  # a comment may name what it explains
                            for d in FOREIGN_DETAIL.finditer(code):
                                name = d.group(1) or "(using namespace)"
                                found.append((rel, number, f"layer '{layer}' names meshlib::detail::{name}, another "
                                              "layer's internal name; use the public face (meshlib::launch, "
                                              "meshlib::allocate, meshlib::block_view: meshlib/tensor/kernel.hpp; "
                                              "meshlib::diagnostic) or make the name public in its layer"))
                        m = INCLUDE.match(text)
                        if not m or m.group(1) in ANYWHERE:
                            continue
                        target = m.group(1)
                        parts = target.split("/")
                        other = parts[1] if len(parts) > 2 else None
                        if other not in LAYERS:
                            found.append((rel, number, f"includes {target}, which is in no layer "
                                          "(only the umbrella headers include those)"))
                            continue
                        if LAYERS.index(other) > LAYERS.index(layer):
                            found.append((rel, number, f"layer '{layer}' includes {target} of layer '{other}' "
                                          f"above it (order: {' < '.join(LAYERS)})"))
                            continue
                        for layers, prefix, why in EXTRA:
                            if layer in layers and target.startswith(prefix):
                                found.append((rel, number, f"layer '{layer}' includes {target}: {why}"))
    return found


def check(include_dir):
    found = violations(include_dir)
    for rel, number, message in found:
        print(f"{rel}:{number}: meshlib: {message}")
    if found:
        print(f"meshlib: {len(found)} include(s) or name(s) against the layer order; move the code to the layer "
              "that owns it, or use the public face of the layer below (docs/design.md, 'Layers')")
        return 1
    print("meshlib: every header includes only its own layer and those below it; nn names no other layer's detail")
    return 0


def self_test():
    """The checker finds each kind of violation, names file and line, and passes a clean tree."""
    def tree(files):
        d = tempfile.mkdtemp(prefix="meshlib_layers_")
        for rel, text in files.items():
            p = os.path.join(d, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
        return d

    clean = {
        "meshlib/core/mesh.hpp": "#pragma once\n#include <vector>\n#include \"meshlib/config.hpp\"\n",
        "meshlib/comm/timeout.hpp": "#include \"meshlib/core/mesh.hpp\"\n",
        "meshlib/tensor/view.hpp": "#include \"meshlib/comm/timeout.hpp\"\n",
        "meshlib/exec/pool.hpp": "#include \"meshlib/comm/thread/run_on_threads.hpp\"\n#include \"meshlib/debug/observe.hpp\"\n",
        "meshlib/nn/k.hpp": "// uses meshlib::detail::launch no more\nmeshlib::launch<S>(n, f);\nnn::detail::fill(p);\n"
                            "detail::fill(p);  // meshlib::detail::x in a comment\n",
    }
    bad = dict(clean)
    bad["meshlib/core/mesh.hpp"] = "#pragma once\n#include <vector>\n#include \"meshlib/tensor/view.hpp\"\n"
    bad["meshlib/collectives/device_context.hpp"] = "// x\n#include \"meshlib/debug/observe.hpp\"\n"
    bad["meshlib/tensor/pool.hpp"] = "#include \"meshlib/core/mesh.hpp\"\n  #  include <meshlib/comm/thread/options.hpp>\n"
    bad["meshlib/debug/observe.hpp"] = "#include \"meshlib/comm/thread/options.hpp\"\n"
    bad["meshlib/comm/x.hpp"] = "#include \"meshlib/debug/trace.hpp\"\n"
    bad["meshlib/nn/k.hpp"] = "// x\n  meshlib::detail::launch<S>(n, f);\nusing namespace meshlib::detail;\nx = ::meshlib::detail::y;\n"
    failures = []
    got = violations(tree(clean))
    if got:
        failures.append(f"a clean tree reported {got}")
    got = {(rel, line) for rel, line, _ in violations(tree(bad))}
    want = {("meshlib/core/mesh.hpp", 3), ("meshlib/collectives/device_context.hpp", 2),
            ("meshlib/tensor/pool.hpp", 2), ("meshlib/debug/observe.hpp", 1), ("meshlib/comm/x.hpp", 1),
            ("meshlib/nn/k.hpp", 2), ("meshlib/nn/k.hpp", 3), ("meshlib/nn/k.hpp", 4)}
    if got != want:
        failures.append(f"the bad tree reported {sorted(got)}, expected {sorted(want)}")
    if check(tree(bad)) != 1:
        failures.append("check() passed a bad tree")
    for f in failures:
        print("self-test FAILED: " + f)
    if not failures:
        print("self-test passed: every kind of violation is found at its file and line; a clean tree passes")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        sys.exit(self_test())
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(check(sys.argv[1]))
