#!/usr/bin/env python3
"""Gives a fresh clone's files back the modification times CI's cache knows them by.

    scripts/ci_mtimes.py RECORD

Cargo decides that a workspace crate is up to date when none of its source files is newer than
what it built from them; every file of a fresh clone is new, so without this each CI run compiles
all of the workspace's crates again, though its target folder (CI's cache) holds them. RECORD
lists, for every tracked file, the SHA-256 of its content and a time: the start of the first run
that saw that content there. A file whose content is the recorded one gets that time back; any
other file keeps the clone's time (now) and is recorded with it. So what the cache built from a
file's current content is older than nothing it was built from, and whatever depends on a
changed file is newer than every artifact: cargo rebuilds what changed and only that, as its
mtime rule means it to.

Why the first run's time and not the commit's: an artifact built from other content (an earlier
run, or one that failed before it rebuilt everything) always predates the run that first saw
the current content, whatever the commits' dates say. This holds when runs do not overlap:
.ci/run holds a lock for that. Nothing else may build into CI's target folder (a working tree's
build there would be taken for the content recorded).

Cargo does not rebuild a workspace crate because the workspace moved, and each CI run is a
clone in a folder of its own: a path compiled in (`env!("CARGO_MANIFEST_DIR")`) would name an
earlier clone's folder, gone by then. So the script refuses a tracked source of a library, test
or example that has one; such code reads the variable when it runs (cargo and cargo-nextest set
it for the tests and programs they run).

RECORD is rewritten before the run builds anything (lines `<sha256> <mtime_ns> <path>`).
"""

import hashlib
import os
import subprocess
import sys
import time


def tracked():
    out = subprocess.run(
        ["git", "ls-files", "-z"], check=True, capture_output=True
    ).stdout
    return [p.decode() for p in out.split(b"\0") if p]


def load(record):
    known = {}
    try:
        with open(record, encoding="utf-8") as f:
            for line in f:
                digest, ns, path = line.rstrip("\n").split(" ", 2)
                known[path] = (digest, int(ns))
    except FileNotFoundError:
        pass
    return known


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/ci_mtimes.py RECORD (run in the clone's root)")
    record = sys.argv[1]
    known = load(record)
    now = time.time_ns()
    kept = changed = 0
    lines = []
    compiled_in = []
    for path in tracked():
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            content = f.read()
        if (
            path.endswith(".rs")
            and "/benches/" not in f"/{path}"
            and b'env!("CARGO_MANIFEST_DIR")' in content
        ):
            compiled_in.append(path)
        digest = hashlib.sha256(content).hexdigest()
        old = known.get(path)
        if old is not None and old[0] == digest:
            ns = old[1]
            kept += 1
        else:
            ns = now
            changed += 1
        os.utime(path, ns=(ns, ns))
        lines.append(f"{digest} {ns} {path}\n")
    if compiled_in:
        sys.exit(
            "ci_mtimes: these sources compile in the folder of the clone they were built in, "
            "which CI's cached build would keep after the clone is gone: "
            + ", ".join(compiled_in)
            + '; read it when the code runs, std::env::var_os("CARGO_MANIFEST_DIR"), instead '
            'of env!("CARGO_MANIFEST_DIR")'
        )
    tmp = f"{record}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(tmp, record)
    print(
        f"ci_mtimes: {kept} files as the cache knows them, {changed} new or changed "
        f"(their time now)"
    )


if __name__ == "__main__":
    main()
