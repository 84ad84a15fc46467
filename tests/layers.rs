//! The layers of `docs/design.md`, checked on the sources of the library crates:
//!
//! - every `crate::<module>` a file names (in code, not comments) is its own module or one in a
//!   lower layer, so the modules form no cycle;
//! - burn-ddp-comm names no Burn crate;
//! - only `config/env.rs` of burn-ddp-comm reads environment variables (binaries aside).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// burn-ddp-comm's top-level modules, bottom to top.
const CORE: &[(&str, u8)] = &[
    ("wire", 0),
    ("types", 1),
    ("error", 2),
    ("config", 3),
    ("checkpoint", 3),
    ("store", 4),
    ("comm", 5),
    ("group", 6),
    ("grad", 7),
    ("data", 7),
    ("cuda", 7),
    ("train", 7),
    ("pipeline", 7),
    ("launch", 8),
    ("fuzzing", 9),
];

/// burn-ddp's top-level modules, bottom to top (everything of burn-ddp-comm is below them).
const BURN: &[(&str, u8)] = &[
    ("checkpoint", 1),
    ("data", 1),
    ("ddp", 2),
    ("backend", 3),
    ("nn", 3),
    ("pipeline", 3),
    ("cuda", 4),
    ("train", 4),
    ("fuzzing", 5),
];

/// burn-ddp-burn022's top-level modules (Burn 0.22.1; the core crate is below them).
const BURN022: &[(&str, u8)] = &[
    ("data", 1),
    ("grads", 1),
    ("cuda", 2),
    ("sync", 3),
    ("buffers", 4),
    ("pipeline", 4),
    ("train", 4),
];

/// The layer of the core crate's modules as burn-ddp sees them (re-exported, below its own).
const BELOW: u8 = 0;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments (line comments and doc comments; the sources use no
/// block comments).
fn code(text: &str) -> String {
    text.lines()
        .map(|line| {
            let t = line.trim_start();
            if t.starts_with("//") {
                ""
            } else {
                match line.find(" // ") {
                    Some(i) => &line[..i],
                    None => line,
                }
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first path segment after each `crate::` (for `crate::{a::X, B}`, `a` and `B`).
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `burn_ddp_comm::` or similar, not this crate
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group);
            for item in split_top_level(&group[..end]) {
                out.push(first_segment(item.trim()));
            }
        } else {
            out.push(first_segment(rest));
        }
    }
    out.retain(|s| !s.is_empty() && s != "self");
    out
}

fn matching_brace(s: &str) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

fn split_top_level(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn first_segment(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// What each name re-exported at a crate's root (`pub use module::{A, B}` in `lib.rs`) comes
/// from: one of its modules, or `None` for another crate.
fn root_exports(lib: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let code = code(lib);
    let mut rest = code.as_str();
    while let Some(i) = rest.find("pub use ") {
        rest = &rest[i + "pub use ".len()..];
        let stmt = &rest[..rest.find(';').unwrap()];
        let (module, names) = match stmt.find("::") {
            Some(j) => (first_segment(stmt), &stmt[j + 2..]),
            None => continue,
        };
        let local = (module != "burn_ddp_comm" && module != "burn_ddp_macros").then_some(module);
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in split_top_level(names) {
            let name = name.trim();
            let last = name.rsplit("::").next().unwrap_or(name);
            let last = last.split(" as ").last().unwrap_or(last).trim();
            out.insert(first_segment(last), local.clone());
        }
    }
    out
}

struct Crate {
    dir: &'static str,
    layers: &'static [(&'static str, u8)],
    /// Modules of another crate that this one re-exports as its own (their layer: `BELOW`).
    foreign_modules: &'static [&'static str],
}

fn check(krate: &Crate) -> Vec<String> {
    let src = root().join(krate.dir).join("src");
    let layer_of: BTreeMap<&str, u8> = krate.layers.iter().copied().collect();
    let exports = root_exports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut problems = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "bin" {
            continue;
        }
        let Some(&mine) = layer_of.get(top.as_str()) else {
            problems.push(format!(
                "{}/src/{}: module `{top}` has no layer in tests/layers.rs (and docs/design.md)",
                krate.dir,
                rel.display()
            ));
            continue;
        };
        let code = code(&std::fs::read_to_string(&file).unwrap());
        for seg in crate_paths(&code) {
            let target = if let Some(&l) = layer_of.get(seg.as_str()) {
                Some((seg.clone(), l))
            } else if krate.foreign_modules.contains(&seg.as_str()) {
                Some((seg.clone(), BELOW))
            } else {
                match exports.get(&seg) {
                    Some(Some(module)) => {
                        layer_of.get(module.as_str()).map(|&l| (module.clone(), l))
                    }
                    Some(None) => Some((seg.clone(), BELOW)),
                    None => {
                        problems.push(format!(
                            "{}/src/{}: `crate::{seg}` is neither a module nor a root re-export",
                            krate.dir,
                            rel.display()
                        ));
                        None
                    }
                }
            };
            if let Some((module, layer)) = target {
                if module != top && layer >= mine {
                    problems.push(format!(
                        "{}/src/{}: module `{top}` (layer {mine}) uses `crate::{seg}` of module \
                         `{module}` (layer {layer}), which is not below it",
                        krate.dir,
                        rel.display()
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn modules_only_use_lower_layers() {
    let mut problems = check(&Crate {
        dir: "burn-ddp-comm",
        layers: CORE,
        foreign_modules: &[],
    });
    problems.extend(check(&Crate {
        dir: "burn-ddp",
        layers: BURN,
        foreign_modules: &["group", "comm", "config", "grad", "launch", "types"],
    }));
    problems.extend(check(&Crate {
        dir: "burn-ddp-burn022",
        layers: BURN022,
        foreign_modules: &["comm", "config", "grad", "group", "launch", "types"],
    }));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_core_crate_names_no_burn_crate() {
    let mut files = Vec::new();
    rust_files(&root().join("burn-ddp-comm/src"), &mut files);
    let manifest = std::fs::read_to_string(root().join("burn-ddp-comm/Cargo.toml")).unwrap();
    let mut problems: Vec<String> = manifest
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("burn") && !l.starts_with("burn-ddp-comm")
        })
        .map(|l| format!("burn-ddp-comm/Cargo.toml: {l}"))
        .collect();
    for file in files {
        let code = code(&std::fs::read_to_string(&file).unwrap());
        for name in [
            "burn::",
            "burn_backend::",
            "burn_tensor::",
            "burn_cubecl::",
            "cubecl::",
        ] {
            if code
                .match_indices(name)
                .any(|(i, _)| !code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
            {
                problems.push(format!("{}: uses `{name}`", file.display()));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn only_the_env_module_reads_the_environment() {
    let mut problems = Vec::new();
    for dir in ["burn-ddp-comm/src", "burn-ddp/src", "burn-ddp-burn022/src"] {
        let mut files = Vec::new();
        rust_files(&root().join(dir), &mut files);
        for file in files {
            let rel = file
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel == "burn-ddp-comm/src/config/env.rs" || rel.contains("/src/bin/") {
                continue;
            }
            let code = code(&std::fs::read_to_string(&file).unwrap());
            for call in ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("] {
                if code.contains(call) {
                    problems.push(format!("{rel}: calls `{call}`; read it in config/env.rs"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checker_sees_paths_in_braces_and_skips_comments() {
    assert_eq!(
        crate_paths(&code(
            "use crate::{error::X, Rank};\n// crate::launch\nlet x = crate::comm::f(); // crate::cuda"
        )),
        ["error", "Rank", "comm"]
    );
    assert_eq!(crate_paths("burn_ddp_comm::group::X"), Vec::<String>::new());
    let exports =
        root_exports("pub use ddp::{Ddp, DdpConfig};\npub use burn_ddp_comm::{Rank, group};");
    assert_eq!(exports["Ddp"], Some("ddp".to_string()));
    assert_eq!(exports["Rank"], None);
}
