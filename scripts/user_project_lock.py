#!/usr/bin/env python3
"""Reads the lock file of a user project for scripts/user-project-check.sh.

    user_project_lock.py version LOCK CRATE LIKE   the version of CRATE in LOCK that is
                                                   semver-compatible with LIKE (a lock may hold
                                                   several: systemstat 0.1 and 0.2)
    user_project_lock.py suspects LOCK LOG         "CRATE VERSION FLOOR" for each registry crate
                                                   of LOCK that LOG's errors name, most named first
    user_project_lock.py newer LOCK OURS           the registry packages of LOCK at a version that
                                                   the lock file OURS does not hold
"""

import re
import sys
import tomllib


def registry_packages(path):
    with open(path, "rb") as f:
        lock = tomllib.load(f)
    return [
        (p["name"], p["version"])
        for p in lock.get("package", [])
        if p.get("source", "").startswith("registry+")
    ]


def numbers(version):
    """The first three numbers of a version (pre-release and build parts dropped)."""
    core = version.split("+")[0].split("-")[0].split(".")
    return [int(x) if x.isdigit() else 0 for x in (core + ["0", "0"])[:3]]


def series(version):
    """The semver series: 0.2 for 0.2.8, 1 for 1.4.2."""
    major, minor, _ = numbers(version)
    return (major, minor) if major == 0 else (major,)


def floor(version):
    """The first release of the series: a hold `>=FLOOR, <VERSION` stays in it."""
    major, minor, _ = numbers(version)
    return f"0.{minor}.0" if major == 0 else f"{major}.0.0"


def version(lock, crate, like):
    for name, v in registry_packages(lock):
        if name == crate and series(v) == series(like):
            print(v)
            return


def suspects(lock, log):
    """A crate counts where the errors name one of its files (`CRATE-VERSION/`) or a path of it
    (`crate::`, given to the newest version the lock holds). The crates that failed to compile
    are left out: their own errors name them anyway."""
    text = open(log, encoding="utf-8", errors="replace").read()
    failed = set(re.findall(r"could not compile `([^`]+)`", text))
    packages = [(n, v) for n, v in registry_packages(lock) if n not in failed]
    newest = {}
    for name, v in packages:
        if name not in newest or numbers(v) > numbers(newest[name]):
            newest[name] = v
    counts = {}
    for name, v in packages:
        n = len(re.findall(r"\b" + re.escape(f"{name}-{v}") + r"/", text))
        if n:
            counts[(name, v)] = counts.get((name, v), 0) + n
    for name, v in newest.items():
        n = len(re.findall(r"\b" + re.escape(name.replace("-", "_")) + r"::", text))
        if n:
            counts[(name, v)] = counts.get((name, v), 0) + n
    for (name, v), _ in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(name, v, floor(v))


def newer(lock, ours):
    ours = set(registry_packages(ours))
    names = {n for n, _ in ours}
    for name, v in sorted(set(registry_packages(lock)) - ours):
        print(f"  {name} {v}" + ("" if name in names else " (not in the workspace's lock)"))


if __name__ == "__main__":
    commands = {"version": (version, 3), "suspects": (suspects, 2), "newer": (newer, 2)}
    if len(sys.argv) < 2 or sys.argv[1] not in commands or len(sys.argv) != 2 + commands[sys.argv[1]][1]:
        sys.exit(__doc__)
    command, _ = commands[sys.argv[1]]
    command(*sys.argv[2:])
