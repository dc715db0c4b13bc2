#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Fails when a header under include/meshlib/ includes a layer above its own, or names another layer's
internals (docs/design.md, "Layers"): the layers depend only downward, core < comm < runtime < tensor <
collectives < debug < exec < nn, and the thread backend (comm/thread/) is the runners' transport, not a
utility of the layers between: tensor, collectives and debug do not include it (the timeout default is
comm/timeout.hpp; the device threads and pinning belong to exec).

Names: each layer keeps its internals in its own namespace, `meshlib::<layer>::detail`; a backend's
public sub-namespace may keep its own (`meshlib::distributed::detail`, `meshlib::mpi::detail`), which
belongs to the layer whose headers declare it. A header of layer L names no other layer's detail
(`meshlib::M::detail::x`, `M::detail::x`, `using namespace M::detail`, a backend detail declared in
another layer) and nothing of the old flat `meshlib::detail`, which no longer exists. What one layer
offers another is a public or `meshlib::experimental` name (tensor/kernel.hpp: `meshlib::launch`,
`meshlib::allocate`, block views; `meshlib::diagnostic`). Comments may name what they explain. Each
violation is printed as `file:line: message`.

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
# The old flat internal namespace: no layer declares or names it.
FLAT_DETAIL = re.compile(r"(?<![\w:])(?:::)?meshlib::detail\b|(?<![\w:])namespace\s+detail\s*=|using\s+namespace\s+(?:::)?meshlib::detail\b")
# `[meshlib::]X::detail` for a layer or backend name X.
NAMED_DETAIL = re.compile(r"(?<![\w:])(?:(?:::)?meshlib::)?(\w+)::detail\b")
# Where a header declares a backend's detail: `namespace meshlib::X::detail {`, or `namespace detail {`
# after `namespace meshlib::X {`.
DECLARES_SUB = re.compile(r"^\s*namespace\s+meshlib::(\w+)::detail\s*\{")
OPENS_SUB = re.compile(r"^\s*namespace\s+meshlib::(\w+)\s*\{")
OPENS_DETAIL = re.compile(r"^\s*namespace\s+detail\s*\{")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](meshlib/[^">]+)[">]')


STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def code_of(text):
    """The line without its strings and comment, so that a message or comment may name what it explains."""
    return STRING.sub('""', text).split("//", 1)[0]


def headers(root):
    """(layer, path) of every header under root/<layer>/, in a fixed order."""
    for layer in LAYERS:
        for dirpath, _, files in sorted(os.walk(os.path.join(root, layer))):
            for name in sorted(files):
                if name.endswith((".hpp", ".h")):
                    yield layer, os.path.join(dirpath, name)


def detail_owners(root):
    """{X: layers} for every `meshlib::X::detail` declared: X a layer (its own) or a backend's
    public sub-namespace (the layers whose headers declare its detail)."""
    owners = {layer: {layer} for layer in LAYERS}
    for layer, path in headers(root):
        sub = None
        with open(path, encoding="utf-8") as f:
            for text in f:
                code = code_of(text)
                m = DECLARES_SUB.match(code)
                if m and m.group(1) not in LAYERS:
                    owners.setdefault(m.group(1), set()).add(layer)
                m = OPENS_SUB.match(code)
                if m:
                    sub = m.group(1)
                if OPENS_DETAIL.match(code) and sub and sub not in LAYERS and sub != "experimental":
                    owners.setdefault(sub, set()).add(layer)
    return owners


def violations(include_dir):
    """Every (path, line, message) in include_dir/meshlib/<layer>/."""
    found = []
    root = os.path.join(include_dir, "meshlib")
    owners = detail_owners(root)
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
                        code = code_of(text)
                        if FLAT_DETAIL.search(code):
                            found.append((rel, number, f"layer '{layer}' names the flat meshlib::detail, which no longer "
                                          f"exists; its internals are meshlib::{layer}::detail, another layer's are "
                                          "reached through their public or meshlib::experimental names"))
                        for d in NAMED_DETAIL.finditer(code):
                            other = d.group(1)
                            if other in owners and layer not in owners[other]:
                                whose = "/".join(sorted(owners[other], key=LAYERS.index))
                                found.append((rel, number, f"layer '{layer}' names {other}::detail, the internals of "
                                              f"layer '{whose}'; use its public face (meshlib::launch, meshlib::allocate, "
                                              "meshlib::block_view: meshlib/tensor/kernel.hpp; meshlib::diagnostic; "
                                              "meshlib::experimental) or make the name public in its layer"))
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
    print("meshlib: every header includes only its own layer and those below it, and names no other layer's detail")
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
        # a layer's own detail, its public and experimental faces, and a backend's detail in its layer
        "meshlib/core/hash.hpp": "namespace meshlib::core::detail {\nstruct fnv1a {};\n}  // namespace meshlib::core::detail\n"
                                 "namespace meshlib::experimental {\nusing core::detail::fnv1a;\n}\n",
        "meshlib/comm/op.hpp": "namespace meshlib {\nnamespace comm::detail {\nint f();\n}\nint g() { return comm::detail::f() + "
                               "experimental::fnv1a{}.x; }\n}  // was meshlib::detail, now core::detail::fnv1a\n",
        "meshlib/runtime/launcher.hpp": "namespace meshlib::distributed {\nnamespace detail {\nint parse();\n}\n"
                                        "int n() { return detail::parse(); }\n}\n",
        "meshlib/runtime/nccl_runtime.hpp": "int p = meshlib::distributed::detail::parse() + runtime::detail::q();\n",
        "meshlib/collectives/rules.hpp": "static_assert(diagnostic::always_false<T>, \"meshlib: core::detail::x\");\n",
    }
    bad = dict(clean)
    bad["meshlib/core/mesh.hpp"] = "#pragma once\n#include <vector>\n#include \"meshlib/tensor/view.hpp\"\n"
    bad["meshlib/collectives/device_context.hpp"] = "// x\n#include \"meshlib/debug/observe.hpp\"\n"
    bad["meshlib/tensor/pool.hpp"] = "#include \"meshlib/core/mesh.hpp\"\n  #  include <meshlib/comm/thread/options.hpp>\n"
    bad["meshlib/debug/observe.hpp"] = "#include \"meshlib/comm/thread/options.hpp\"\n"
    bad["meshlib/comm/x.hpp"] = "#include \"meshlib/debug/trace.hpp\"\n"
    bad["meshlib/nn/k.hpp"] = "// x\n  meshlib::detail::launch<S>(n, f);\nusing namespace meshlib::detail;\nx = ::meshlib::detail::y;\n"
    # the old flat namespace, declared or named; another layer's detail, qualified either way or opened;
    # a backend's detail named outside the layer that declares it
    bad["meshlib/core/hash.hpp"] = "namespace meshlib::detail {\nstruct fnv1a {};\n}\n"
    bad["meshlib/comm/op.hpp"] = "int g() { return core::detail::fnv1a{}.x; }\nint h = meshlib::comm::detail::f();\n"
    bad["meshlib/tensor/launch.hpp"] = "// x\nauto v = ::meshlib::collectives::detail::current_device();\n"
    bad["meshlib/debug/trace.hpp"] = "using namespace meshlib::collectives::detail;\nint x = detail::y;\n"
    bad["meshlib/exec/default_runner.hpp"] = "if (!distributed::detail::parse()) {}\nmeshlib::detail::z();\n"
    bad["meshlib/nn/m.hpp"] = "tensor::detail::launch<S>(n, f);\nnn::detail::fill(p);\n"
    failures = []
    got = violations(tree(clean))
    if got:
        failures.append(f"a clean tree reported {got}")
    got = {(rel, line) for rel, line, _ in violations(tree(bad))}
    want = {("meshlib/core/mesh.hpp", 3), ("meshlib/collectives/device_context.hpp", 2),
            ("meshlib/tensor/pool.hpp", 2), ("meshlib/debug/observe.hpp", 1), ("meshlib/comm/x.hpp", 1),
            ("meshlib/nn/k.hpp", 2), ("meshlib/nn/k.hpp", 3), ("meshlib/nn/k.hpp", 4),
            ("meshlib/core/hash.hpp", 1), ("meshlib/comm/op.hpp", 1), ("meshlib/tensor/launch.hpp", 2),
            ("meshlib/debug/trace.hpp", 1), ("meshlib/exec/default_runner.hpp", 1),
            ("meshlib/exec/default_runner.hpp", 2), ("meshlib/nn/m.hpp", 1)}
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
