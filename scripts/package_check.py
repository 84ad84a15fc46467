"""The dep-info half of scripts/package-check.sh: every file a published package's library
compiles (rustc's dep-info of its builds under the target folder) is inside the package.

    python3 scripts/package_check.py METADATA_JSON TARGET_DIR "PACKAGES" "REACHING"

Cargo runs rustc on a workspace member from the workspace's root with relative paths, so the
dep-info names the member's files relative to that root (the same in every clone); files a
build script generated are absolute, under the target folder. Manifests (`Cargo.toml`, read for
the workspace's lints) are not sources.
"""

import glob
import json
import os
import sys

metadata, target, packages, reaching = sys.argv[1], sys.argv[2], sys.argv[3].split(), set(sys.argv[4].split())
meta = json.load(open(metadata))
root = meta["workspace_root"]
target = os.path.abspath(target)
failed = False
for pkg in (p for p in meta["packages"] if p["name"] in packages):
    name = pkg["name"]
    pkg_rel = os.path.relpath(os.path.dirname(pkg["manifest_path"]), root)
    lib = next(t for t in pkg["targets"] if {"lib", "proc-macro"} & set(t["kind"]))
    crate_root = os.path.relpath(lib["src_path"], root)
    outside, builds = set(), 0
    for info in glob.glob(os.path.join(target, "debug", "deps", lib["name"].replace("-", "_") + "-*.d")):
        files = []
        for line in open(info):
            head, sep, deps = line.partition(": ")
            if sep and head.endswith(".d"):
                files = deps.split()
                break
        # Another target of the same file name (burn-ddp-comm's `burn-ddp` binary).
        if not files or os.path.normpath(files[0]) != crate_root:
            continue
        builds += 1
        for f in files:
            if os.path.basename(f) == "Cargo.toml" or f.startswith(target + "/"):
                continue
            path = os.path.normpath(f if os.path.isabs(f) else os.path.join(root, f))
            if not path.startswith(os.path.join(root, pkg_rel) + "/"):
                outside.add(os.path.relpath(path, root))
    if builds == 0:
        print(f"package-check: no dep-info of {name}'s library under {target}/debug/deps: "
              "build the workspace first (cargo test --workspace --no-run)", file=sys.stderr)
        failed = True
    elif outside and name not in reaching:
        print(f"package-check: {name} compiles {len(outside)} file(s) outside its package "
              f"(its publish would fail): {', '.join(sorted(outside))}", file=sys.stderr)
        failed = True
    elif outside:
        print(f"package-check: {name} compiles {len(outside)} file(s) of another package, as "
              f"scripts/package-check.sh lists: {', '.join(sorted(outside)[:3])}, ...")
    elif name in reaching:
        print(f"package-check: {name} no longer compiles files outside its package: remove it "
              "from `reaching` in scripts/package-check.sh", file=sys.stderr)
        failed = True
    else:
        print(f"package-check: {name}: every file its library compiles is in its package "
              f"({builds} build(s) read)")
sys.exit(1 if failed else 0)
