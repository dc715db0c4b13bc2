#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Runs the Conan section of docs/install.md exactly as written, in order, on a machine with no
Conan remote: the docs are the script, so they cannot drift from what is tested.

    conan_documented.py <meshlib source> <work dir> <vendor dir>

The section marks its blocks with HTML comments (invisible in the rendered page):
    <!-- conan-test: run in meshlib -->   the next ```sh block, run by bash in a copy of the checkout
    <!-- conan-test: file NAME -->        the next block is the consumer's file NAME (in WORK/app)
    <!-- conan-test: run in app -->       the next ```sh block, run by bash in the consumer's folder
The checkout copy is WORK/meshlib and the consumer WORK/app, next to each other as the docs say.
Conan runs with CONAN_HOME in WORK (nothing touches ~/.conan2) and with every HTTP(S) access sent
to a closed port, so a command that needed a remote would fail here.

Conan is a `conan` 2.x on PATH, or Conan 2.8.1 from <vendor dir>/conan-2.8.1.tar.gz run by this
Python (Debian's python3, which has Conan's modules from apt), through a `conan` wrapper put first
on PATH. Exits 77 (skipped), saying why, when there is no usable Conan or the system lacks what
the documented options need (MPI, Kokkos Kernels).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SKIP = 77
MARK_RE = re.compile(r"<!-- conan-test: (run in (\w+)|file (\S+)) -->\s*\n```[\w+]*\n(.*?)^```", re.M | re.S)
# What the two runs must print: test_package (run by `conan create`) and the consumer.
EXPECT = {
    "meshlib": r"test_package OK: psum over 4 thread devices = \{10, 100\}; matmul kernel: KokkosBlas::gemm, mpi: 1",
    "app": r"app: psum over 4 devices = 6, matmul: KokkosBlas::gemm, mpi: 1",
}
CHECKOUT_FILES = ["conanfile.py", "VERSION", "LICENSE", "CMakeLists.txt", "cmake", "include", "test_package", "packaging"]


def skip(why: str) -> int:
    print(f"SKIPPED: {why}")
    return SKIP


def conan_command(work: Path, vendor: Path) -> list[str] | str:
    """The command that runs Conan 2, or a reason why there is none."""
    found = shutil.which("conan")
    if found:
        out = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
        if "Conan version 2." in out:
            return [found]
    tarball = vendor / "conan-2.8.1.tar.gz"
    if not tarball.is_file():
        return f"no Conan 2 on PATH and no conan-2.8.1.tar.gz in '{vendor}'"
    missing = [m for m in ("fasteners", "jinja2", "requests", "colorama", "patch_ng", "yaml", "distro", "dateutil")
               if importlib.util.find_spec(m) is None]
    if missing:
        return (f"Conan's Python modules are missing from {sys.executable}: {' '.join(missing)} (scripts/install_deps.sh "
                "installs them: python3-fasteners python3-jinja2 python3-requests python3-colorama python3-patch-ng)")
    tree = work / "conan-2.8.1"
    if not (tree / "conans" / "conan.py").is_file():
        with tarfile.open(tarball) as archive:
            archive.extractall(work)
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); from conans.conan import run; run()"]


def main(argv: list[str]) -> int:
    src, work, vendor = Path(argv[0]).resolve(), Path(argv[1]).resolve(), Path(argv[2] if len(argv) > 2 else "")
    work.mkdir(parents=True, exist_ok=True)

    section = (src / "docs" / "install.md").read_text(encoding="utf-8")
    start = section.find("## Conan 2")
    if start < 0:
        print("meshlib: docs/install.md has no '## Conan 2' section")
        return 1
    end = section.find("\n## ", start + 1)
    section = section[start:end if end >= 0 else None]
    steps = [(m.group(2), m.group(3), m.group(4)) for m in MARK_RE.finditer(section)]
    runs = [s for s in steps if s[0]]
    if [s[0] for s in runs] != ["meshlib", "app"]:
        print(f"meshlib: docs/install.md's Conan section must mark one run in meshlib, then one in app; found {steps}")
        return 1

    if not shutil.which("mpicxx") and not Path("/usr/include/x86_64-linux-gnu/mpi.h").exists():
        return skip("the documented options need MPI (libopenmpi-dev), which is not installed")
    if not Path("/usr/include/trilinos/KokkosBlas3_gemm.hpp").exists():
        return skip("the documented options need Kokkos Kernels (libtrilinos-kokkos-kernels-dev), which is not installed")

    conan = conan_command(work, vendor)
    if isinstance(conan, str):
        return skip(conan)
    bindir = work / "bin"
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "conan"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in conan) + ' "$@"\n')
    wrapper.chmod(0o755)

    # A fresh checkout copy and consumer folder, and a fresh Conan home.
    for d in ("meshlib", "app", "home"):
        shutil.rmtree(work / d, ignore_errors=True)
    (work / "app").mkdir()
    (work / "meshlib").mkdir()
    for name in CHECKOUT_FILES:
        (shutil.copytree if (src / name).is_dir() else shutil.copy2)(src / name, work / "meshlib" / name)
    for junk in ("test_package/build", "test_package/CMakeUserPresets.json"):
        path = work / "meshlib" / junk
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    env = dict(os.environ, CONAN_HOME=str(work / "home"), PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[var] = "http://127.0.0.1:9"  # discard port: a remote access fails at once
    for var in ("NO_PROXY", "no_proxy"):
        env.pop(var, None)
    print(f"== {subprocess.run(['conan', '--version'], env=env, capture_output=True, text=True).stdout.strip()}")

    for run_in, file_name, text in steps:
        if file_name:
            (work / "app" / file_name).write_text(text, encoding="utf-8")
            print(f"== wrote app/{file_name} from docs/install.md")
            continue
        print(f"== in {run_in}/, from docs/install.md:\n{text}")
        log = work / f"{run_in}.log"
        with open(log, "w", encoding="utf-8") as out:
            status = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=work / run_in, env=env,
                                    stdout=out, stderr=subprocess.STDOUT).returncode
        output = log.read_text(encoding="utf-8", errors="replace")
        print("\n".join(output.splitlines()[-30:]))
        if status != 0:
            print(f"meshlib: the documented Conan commands in {run_in}/ failed with status {status} (full log: {log})")
            return 1
        if not re.search(EXPECT[run_in], output):
            print(f"meshlib: the documented Conan commands in {run_in}/ ran, but did not print '{EXPECT[run_in]}' (log: {log})")
            return 1
    print("== docs/install.md's Conan commands: create, install, build and run: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
