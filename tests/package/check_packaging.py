#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Checks that meshlib's packaging files agree with each other.

  --versions [--cmake-version V] [--pc FILE]
        VERSION is the one source; CMake's project version, include/meshlib/version.hpp, the single
        header, conanfile.py (reads VERSION), the vcpkg port, the Spack package, the generated
        pkg-config file, CHANGELOG.md and docs/install.md must all say the same.
  --variants
        The Conan options, the Spack variants, the vcpkg features (plus kokkos_kernels, which vcpkg
        has no port for) and the CMake components are the same set of names.
  --vcpkg-schema DIR
        ports/meshlib/vcpkg.json is valid against the official schema in DIR (and a broken copy is
        not, so the check can fail). Exits 77 (skipped) when python3-jsonschema or DIR is missing.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP = 77


def read(rel: str) -> str:
    return (REPO / rel).read_text(encoding="utf-8")


def check_versions(cmake_version: str | None, pc: Path | None) -> list[str]:
    version = read("VERSION").strip()
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        return [f"VERSION holds '{version}', not major.minor.patch"]
    major, minor, patch = version.split(".")
    found: dict[str, str | None] = {}

    if not re.search(r'file\(STRINGS "\$\{CMAKE_CURRENT_SOURCE_DIR\}/VERSION" _meshlib_version', read("CMakeLists.txt")) \
            or "project(meshlib VERSION ${_meshlib_version}" not in read("CMakeLists.txt"):
        found["CMakeLists.txt (must read VERSION)"] = "a version of its own"
    if cmake_version is not None:
        found["CMake's PROJECT_VERSION"] = cmake_version

    header = read("include/meshlib/version.hpp")
    macros = {m: re.search(rf"#define MESHLIB_VERSION_{m} (\d+)", header) for m in ("MAJOR", "MINOR", "PATCH")}
    found["include/meshlib/version.hpp MESHLIB_VERSION_MAJOR/MINOR/PATCH"] = ".".join(
        m.group(1) if m else "?" for m in macros.values())
    string = re.search(r'#define MESHLIB_VERSION_STRING "([^"]*)"', header)
    found["include/meshlib/version.hpp MESHLIB_VERSION_STRING"] = string.group(1) if string else None

    single = read("single_include/meshlib.hpp")
    string = re.search(r'#define MESHLIB_VERSION_STRING "([^"]*)"', single)
    found["single_include/meshlib.hpp MESHLIB_VERSION_STRING"] = string.group(1) if string else None

    conan = ast.parse(read("conanfile.py"))
    for node in ast.walk(conan):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "version" for t in item.targets):
                    found["conanfile.py (must not hard-code version)"] = ast.unparse(item.value)
    if not re.search(r'def set_version\(self\):\s+self\.version = load\(self, os\.path\.join\(self\.recipe_folder, "VERSION"\)\)',
                     read("conanfile.py")):
        found["conanfile.py set_version (must load VERSION)"] = "missing"

    found["ports/meshlib/vcpkg.json"] = json.loads(read("ports/meshlib/vcpkg.json")).get("version")

    spack = read("packaging/spack/package.py")
    releases = re.findall(r'version\("(\d+\.\d+\.\d+)"', spack)
    found["packaging/spack/package.py newest version()"] = max(releases, key=lambda v: tuple(map(int, v.split("."))), default=None)
    url = re.search(r'url = "[^"]*/v(\d+\.\d+\.\d+)\.tar\.gz"', spack)
    found["packaging/spack/package.py url"] = url.group(1) if url else None

    if pc is not None:
        text = pc.read_text(encoding="utf-8") if pc.is_file() else ""
        match = re.search(r"^Version: (\S+)$", text, re.M)
        found[f"{pc.name} (pkg-config) Version"] = match.group(1) if match else None

    match = re.search(r"^## \[(\d+\.\d+\.\d+)\]", read("CHANGELOG.md"), re.M)
    found["CHANGELOG.md newest release heading"] = match.group(1) if match else None
    match = re.search(r"meshlib/archive/refs/tags/v(\d+\.\d+\.\d+)\.tar\.gz", read("docs/install.md"))
    found["docs/install.md FetchContent URL"] = match.group(1) if match else None
    # Every release tag the user-facing pages name (archive URLs, GIT_TAG, conan references).
    for page in ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]:
        text = read(page)
        for n, tag in enumerate(re.findall(r"refs/tags/v(\d+\.\d+\.\d+)|GIT_TAG v(\d+\.\d+\.\d+)|meshlib/(\d+\.\d+\.\d+)", text)):
            found[f"{page}: release named #{n + 1}"] = next(v for v in tag if v)

    errors = [f"{where} says {value!r}, but VERSION says '{version}'"
              for where, value in found.items() if value != version]
    if not errors:
        print(f"versions agree: {version} in {len(found)} places")
    del major, minor, patch
    return errors


def conan_options() -> set[str]:
    for node in ast.walk(ast.parse(read("conanfile.py"))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "options" for t in node.targets):
            return {k.value for k in node.value.keys}
    return set()


def spack_variants() -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(read("packaging/spack/package.py"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "variant":
            names.add(node.args[0].value)
    return names


def cmake_components() -> set[str]:
    match = re.search(r"set\(MESHLIB_KNOWN_COMPONENTS ([^)]*)\)", read("cmake/meshlib_install.cmake"))
    return set(match.group(1).split()) if match else set()


def check_variants() -> list[str]:
    # vcpkg has no kokkos-kernels port (the portfile says so), so its features lack that one.
    vcpkg = set(json.loads(read("ports/meshlib/vcpkg.json")).get("features", {})) | {"kokkos_kernels"}
    sets = {"conanfile.py options": conan_options(), "packaging/spack/package.py variants": spack_variants(),
            "ports/meshlib/vcpkg.json features (+ kokkos_kernels)": vcpkg,
            "CMake components (MESHLIB_KNOWN_COMPONENTS)": cmake_components()}
    reference = sets["conanfile.py options"]
    errors = [f"{where}: {sorted(names)} differs from the Conan options {sorted(reference)}"
              for where, names in sets.items() if names != reference]
    if not reference:
        errors.append("conanfile.py declares no options")
    if not errors:
        print(f"the same optional parts everywhere: {', '.join(sorted(reference))}")
    return errors


def check_vcpkg_schema(schema_dir: Path) -> list[str] | int:
    try:
        import jsonschema
    except ImportError:
        print("SKIPPED: python3-jsonschema is not installed (apt-get install python3-jsonschema)")
        return SKIP
    main_file = schema_dir / "vcpkg.schema.json"
    definitions_file = schema_dir / "vcpkg-schema-definitions.schema.json"
    if not main_file.is_file() or not definitions_file.is_file():
        print(f"SKIPPED: the vcpkg schema is not in {schema_dir} (a copy of microsoft/vcpkg-tool's docs/*.schema.json)")
        return SKIP
    main = json.loads(main_file.read_text(encoding="utf-8"))
    definitions = json.loads(definitions_file.read_text(encoding="utf-8"))
    store = {main["$id"]: main, definitions["$id"]: definitions}
    resolver = jsonschema.RefResolver.from_schema(main, store=store)
    validator = jsonschema.Draft7Validator(main, resolver=resolver)
    manifest = json.loads(read("ports/meshlib/vcpkg.json"))
    errors = [f"ports/meshlib/vcpkg.json: {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
              for e in validator.iter_errors(manifest)]
    # The validator must be able to say no: an upper-case name is not a vcpkg identifier, and a
    # dependency must be a string or an object.
    for broken in (dict(manifest, name="Not_An_Identifier"), dict(manifest, dependencies=[42])):
        if not list(validator.iter_errors(broken)):
            errors.append(f"the schema check accepted a broken manifest ({broken['name']}, "
                          f"{broken['dependencies']}): it checks nothing")
    if not errors:
        print(f"ports/meshlib/vcpkg.json is valid against {main_file}")
    return errors


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", action="store_true")
    parser.add_argument("--cmake-version")
    parser.add_argument("--pc", type=Path)
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--vcpkg-schema", type=Path)
    args = parser.parse_args(argv)
    errors: list[str] = []
    if args.versions:
        errors += check_versions(args.cmake_version, args.pc)
    if args.variants:
        errors += check_variants()
    if args.vcpkg_schema:
        result = check_vcpkg_schema(args.vcpkg_schema)
        if result == SKIP:
            return SKIP
        errors += result
    for error in errors:
        print(f"meshlib: {error}")
    if errors and args.versions:
        print("Fix: the version's one source is the file VERSION; make the files above say the same "
              "(python3 scripts/amalgamate.py regenerates the single header).")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
