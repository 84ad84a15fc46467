#!/usr/bin/env python3
"""Generates burn-ddp-burn021/src/backend/forward.rs: `Ddp<B>` forwards every operation of Burn's backend
traits to `B`, provided methods included, so that `B`'s own kernels are kept.

The signatures are read from the burn-backend sources cargo fetched (located with `cargo metadata`),
so the forwards follow Burn exactly and a Burn upgrade is one re-run away:

    python3 scripts/gen_forward.py           # rewrite the file
    python3 scripts/gen_forward.py --check   # CI: fail if the file is stale

Each trait method becomes `fn <signature> { B::<name>(<arguments>) }`. The trait's generic `B` is
rewritten to `Self` in signatures; `Ddp<B>`'s associated types are `B`'s, so the types agree.
"""

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "burn-ddp-burn021" / "src" / "backend" / "forward.rs"

# (file under burn-backend/src/backend, trait, whether the trait is generic over `B`)
TRAITS = [
    ("ops/tensor.rs", "FloatTensorOps"),
    ("ops/int_tensor.rs", "IntTensorOps"),
    ("ops/bool_tensor.rs", "BoolTensorOps"),
    ("ops/qtensor.rs", "QTensorOps"),
    ("ops/modules/base.rs", "ModuleOps"),
    ("ops/activation.rs", "ActivationOps"),
    ("ops/transaction.rs", "TransactionOps"),
]

# Backend methods that only matter for the autodiff layer (Autodiff overrides them; an inner
# backend keeps the defaults), or that Ddp implements itself.
BACKEND_SKIP = {"set_distributed_params", "distributed_params", "is_distributed", "name"}


def burn_backend_dir() -> pathlib.Path:
    meta = json.loads(
        subprocess.check_output(
            ["cargo", "metadata", "--format-version", "1", "--locked"], cwd=ROOT
        )
    )
    for pkg in meta["packages"]:
        if pkg["name"] == "burn-backend":
            return pathlib.Path(pkg["manifest_path"]).parent / "src" / "backend"
    sys.exit("burn-backend is not in the dependency graph (cargo metadata)")


def trait_body(src: str, trait: str) -> tuple[str, str]:
    """Returns (generic parameter name or '', body text) of `pub trait <trait>`."""
    m = re.search(r"pub trait " + trait + r"\b(?:<(\w+)\s*:\s*Backend>)?[^{]*\{", src)
    if not m:
        sys.exit(f"trait {trait} not found")
    depth, i = 1, m.end()
    while depth:
        c = src[i]
        depth += {"{": 1, "}": -1}.get(c, 0)
        i += 1
    return m.group(1) or "", src[m.end() : i - 1]


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def methods(body: str):
    """Yields (attributes, signature) of each method at the top level of a trait body."""
    body = strip_comments(body)
    i, n = 0, len(body)
    attrs: list[str] = []
    while i < n:
        if body[i].isspace():
            i += 1
            continue
        if body.startswith("#[", i):
            depth, j = 0, i + 1
            while True:
                depth += {"[": 1, "]": -1}.get(body[j], 0)
                j += 1
                if depth == 0:
                    break
            attrs.append(body[i:j])
            i = j
            continue
        m = re.compile(r"(?:(?:async|unsafe|const)\s+)*fn\s+(\w+)").match(body, i)
        if not m:
            sys.exit(f"unexpected item in trait body: {body[i:i + 80]!r}")
        # The signature ends at the first `;` or `{` outside (), <> and [].
        depth, j = 0, m.end()
        while True:
            c = body[j]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == "<":
                depth += 1
            elif c == ">" and body[j - 1] != "-":
                depth -= 1
            elif depth == 0 and c in ";{":
                break
            j += 1
        sig = " ".join(body[i:j].split())
        if body[j] == "{":
            depth, j = 1, j + 1
            while depth:
                depth += {"{": 1, "}": -1}.get(body[j], 0)
                j += 1
        else:
            j += 1
        yield attrs, m.group(1), sig
        attrs = []
        i = j


def split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for k, c in enumerate(params):
        if c in "(<[":
            depth += 1
        elif c in ")]" or (c == ">" and params[k - 1] != "-"):
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out]


def arguments(sig: str) -> str:
    # The parameter list is the first (...) after the name and its optional <generics>.
    m = re.search(r"fn\s+\w+\s*", sig)
    start = m.end()
    if sig[start] == "<":
        depth = 0
        while True:
            c = sig[start]
            if c == "<":
                depth += 1
            elif c == ">" and sig[start - 1] != "-":
                depth -= 1
            start += 1
            if depth == 0:
                break
    start = sig.index("(", start)
    depth, j = 0, start
    while True:
        depth += {"(": 1, ")": -1}.get(sig[j], 0)
        j += 1
        if depth == 0:
            break
    names = []
    for p in split_params(sig[start + 1 : j - 1]):
        pat = p.split(":", 1)[0].strip()
        pat = re.sub(r"^mut\s+", "", pat)
        if not re.fullmatch(r"\w+", pat):
            sys.exit(f"unsupported parameter pattern {p!r} in {sig!r}")
        names.append((pat, p.split(":", 1)[1] if ":" in p else ""))
    return names


# Structs generic over the backend: `Ddp<B>`'s and `B`'s are distinct types with the same
# fields, moved across by the functions of backend/convert.rs.
CONVERT = {
    "TensorPrimitive": "tensor_primitive",
    "QuantizationParametersPrimitive": "qparams",
    "MaxPool1dBackward": "max_pool1d_backward",
    "MaxPool2dBackward": "max_pool2d_backward",
    "MaxPool1dWithIndices": "max_pool1d_with_indices",
    "MaxPool2dWithIndices": "max_pool2d_with_indices",
    "DeformConv2dBackward": "deform_conv2d_backward",
}

# Methods left to their trait defaults: `TransactionPrimitive` has private fields, so a
# transaction cannot be handed to `B`; the default reads each tensor through the forwards.
SKIP = {("TransactionOps", "tr_execute")}


def converter(ty: str):
    m = re.fullmatch(r"(\w+)<Self>", ty.strip())
    if m and m.group(1) in CONVERT:
        return "super::convert::" + CONVERT[m.group(1)]
    if ty.strip().split("<")[0] in CONVERT:
        sys.exit(f"unsupported use of a backend-generic struct: {ty}")
    return None


def forward(attrs, name, sig, generic: str) -> str:
    keep = [a for a in attrs if a.startswith("#[cfg")]
    if generic:
        sig = re.sub(r"\b" + generic + r"\b", "Self", sig)
    sig = sig.replace("crate::", "burn_backend::")
    args = []
    for arg_name, ty in arguments(sig):
        conv = converter(ty)
        args.append(f"{conv}({arg_name})" if conv else arg_name)
    call = f"B::{name}({', '.join(args)})"
    ret = sig.split(") ->")[-1].split(" where ")[0] if ") ->" in sig else ""
    conv = converter(ret) if ret else None
    if conv:
        call = f"{conv}({call})"
    if sig.startswith("async "):
        call += ".await"
    lines = [f"    {a}" for a in keep]
    lines.append("    #[inline(always)]")
    lines.append(f"    {sig} {{ {call} }}")
    return "\n".join(lines)


def generate() -> str:
    base = burn_backend_dir()
    out = [
        "// @generated by scripts/gen_forward.py from burn-backend's trait sources. Do not edit;",
        "// re-run the script after a Burn upgrade (CI checks that this file is current).",
        "#![allow(clippy::all, unused_variables, unused_imports, unused_mut)]",
        "",
        "use core::future::Future;",
        "use core::num::NonZeroUsize;",
        "use core::ops::Range;",
        "",
        "use burn_backend::ops::*;",
        "use burn_backend::quantization::*;",
        "use burn_backend::tensor::*;",
        "use burn_backend::*;",
        "// Names that two of the globs above export.",
        "use burn_backend::tensor::Device;",
        "",
        "extern crate alloc;",
        "",
        "use crate::ddp::Ddp;",
        "",
    ]
    count = 0
    for rel, trait in TRAITS:
        generic, body = trait_body((base / rel).read_text(), trait)
        out.append(f"impl<B: Backend> {trait}<Self> for Ddp<B> {{")
        for attrs, name, sig in methods(body):
            if (trait, name) in SKIP:
                continue
            out.append(forward(attrs, name, sig, generic))
            count += 1
        out.append("}")
        out.append("")
    # The Backend trait itself: everything but the associated types' bounds, which Ddp states.
    _, body = trait_body((base / "base.rs").read_text(), "Backend")
    out.append("impl<B: Backend> Backend for Ddp<B> {")
    out.append("    fn name(device: &Self::Device) -> alloc::string::String {")
    out.append('        alloc::format!("ddp<{}>", B::name(device))')
    out.append("    }")
    for attrs, name, sig in methods(body):
        if name in BACKEND_SKIP:
            continue
        out.append(forward(attrs, name, sig, ""))
        count += 1
    out.append("}")
    out.append("")
    out.append("/// Number of forwarded methods.")
    out.append(f"pub(super) const FORWARDED: usize = {count};")
    return "\n".join(out) + "\n"


def rustfmt(text: str) -> str:
    return subprocess.run(
        ["rustfmt", "--edition", "2021"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout


def main() -> None:
    text = rustfmt(generate())
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT.relative_to(ROOT)} is stale: run python3 scripts/gen_forward.py")
        print(f"{OUT.relative_to(ROOT)} is current")
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
