//! The layers of `docs/design.md`, checked on the sources of the library crates:
//!
//! - every `crate::<module>` a file names (in code, not comments) is its own module or one in a
//!   lower layer, so the modules form no cycle;
//! - burn-ddp-comm names no Burn crate, nor does burn-ddp-dev (its test harness);
//! - only `config/env/` of burn-ddp-comm reads environment variables (binaries aside).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// burn-ddp-comm's top-level modules, bottom to top.
const CORE: &[(&str, u8)] = &[
    ("wire", 0),
    ("periodic", 0),
    ("sys", 0),
    ("types", 1),
    ("error", 2),
    ("config", 3),
    ("checkpoint", 3),
    ("store", 4),
    ("comm", 5),
    ("group", 6),
    ("grad", 7),
    ("data", 7),
    ("nn", 7),
    ("cuda", 7),
    ("pipeline", 7),
    ("train", 8),
    ("launch", 8),
    ("contract", 9),
    ("fuzzing", 9),
];

/// burn-ddp's top-level modules, bottom to top (everything of burn-ddp-comm is below them).
const BURN: &[(&str, u8)] = &[
    ("checkpoint", 1),
    ("data", 1),
    ("ddp", 2),
    ("backend", 3),
    ("nn", 3),
    ("fsdp", 3),
    ("pipeline", 3),
    ("cuda", 4),
    ("train", 4),
];

/// burn-ddp-gradsync's top-level modules (Burn 0.22.1 and 0.23; the core crate is below them).
const BURN022: &[(&str, u8)] = &[
    ("autodiff", 0),
    ("data", 1),
    ("nn", 1),
    ("grads", 1),
    ("hook", 1),
    ("device", 2),
    ("cuda", 3),
    ("overlap", 4),
    ("sync", 5),
    ("buffers", 6),
    ("pipeline", 6),
    ("zero", 6),
    ("fsdp", 6),
    ("loop_state", 6),
    // The Learner strategy, over DDP's `sync` and FSDP's `fsdp`.
    ("train", 7),
    // What differs between Burn 0.22 and 0.23 (a file per release in each): the events and counts below
    // everything that uses them, the progress-logger impls above the renderers they are for.
    ("release", 0),
    ("progress", 8),
];

/// The layer of the core crate's modules as burn-ddp sees them (re-exported, below its own).
const BELOW: u8 = 0;

/// The repository (this test is burn-ddp-comm's: its package directory is one below), read
/// when the test runs, not when it is compiled: CI's cached test binary may have been built in
/// another clone.
fn root() -> PathBuf {
    burn_ddp_dev::package_dir()
        .parent()
        .expect("burn-ddp-comm/ is in the repository")
        .to_path_buf()
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
            let seg = first_segment(rest);
            // `$crate::name!`: a `#[macro_export]` macro, which lives at the root, not a module.
            if !rest[seg.len()..].starts_with('!') {
                out.push(seg);
            }
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
                "{}/src/{}: module `{top}` has no layer in tests/integration/layers.rs (and docs/design.md)",
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
        dir: "burn-ddp-burn021",
        layers: BURN,
        foreign_modules: &["group", "comm", "config", "grad", "launch", "types"],
    }));
    problems.extend(check(&Crate {
        dir: "burn-ddp-gradsync",
        layers: BURN022,
        foreign_modules: &["comm", "config", "grad", "group", "launch", "types"],
    }));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The core and the test harness it uses as a dev-dependency (both Burn-free).
#[test]
fn the_core_crate_names_no_burn_crate() {
    let mut files = Vec::new();
    let mut problems = Vec::new();
    for krate in ["burn-ddp-comm", "burn-ddp-dev"] {
        rust_files(&root().join(krate).join("src"), &mut files);
        let manifest = std::fs::read_to_string(root().join(krate).join("Cargo.toml")).unwrap();
        problems.extend(
            manifest
                .lines()
                .filter(|l| {
                    let l = l.trim_start();
                    l.starts_with("burn")
                        && !l.starts_with("burn-ddp-comm")
                        && !l.starts_with("burn-ddp-dev")
                })
                .map(|l| format!("{krate}/Cargo.toml: {l}")),
        );
    }
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
    for dir in [
        "burn-ddp-comm/src",
        "burn-ddp-burn021/src",
        "burn-ddp-gradsync/src",
    ] {
        let mut files = Vec::new();
        rust_files(&root().join(dir), &mut files);
        for file in files {
            let rel = file
                .strip_prefix(root())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if rel.starts_with("burn-ddp-comm/src/config/env/") || rel.contains("/src/bin/") {
                continue;
            }
            let code = code(&std::fs::read_to_string(&file).unwrap());
            for call in ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("] {
                if code.contains(call) {
                    problems.push(format!("{rel}: calls `{call}`; read it in config/env/"));
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
    assert_eq!(
        crate_paths("$crate::sampler!(@methods); $crate::data::ShardPlan::new(g)"),
        ["data"]
    );
    let exports =
        root_exports("pub use ddp::{Ddp, DdpConfig};\npub use burn_ddp_comm::{Rank, group};");
    assert_eq!(exports["Ddp"], Some("ddp".to_string()));
    assert_eq!(exports["Rank"], None);
}

/// The sibling modules (files of one directory, `mod.rs` aside) that each file of `dir` names:
/// `super::x`, `super::{x::A, y}` and `crate::<dir as a path>::x`, for a sibling `x`.
fn sibling_uses(crate_src: &Path, dir: &Path) -> BTreeMap<String, Vec<String>> {
    let mut stems = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let module = (path.is_file() && path.extension().is_some_and(|e| e == "rs"))
            || path.join("mod.rs").is_file();
        if module && stem != "mod" && stem != "lib" {
            stems.push(stem);
        }
    }
    let prefix = dir
        .strip_prefix(crate_src)
        .unwrap()
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("::");
    let mut out = BTreeMap::new();
    for stem in &stems {
        let file = match dir.join(format!("{stem}.rs")) {
            f if f.is_file() => f,
            _ => dir.join(stem).join("mod.rs"),
        };
        let code = code(&std::fs::read_to_string(&file).unwrap());
        let mut named = Vec::new();
        for marker in ["super::".to_string(), format!("crate::{prefix}::")] {
            if marker == "crate::::" {
                continue;
            }
            let mut rest = code.as_str();
            while let Some(i) = rest.find(&marker) {
                let before = rest[..i].chars().last();
                rest = &rest[i + marker.len()..];
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let items = match rest.strip_prefix('{') {
                    Some(group) => split_top_level(&group[..matching_brace(group)])
                        .into_iter()
                        .map(|s| first_segment(s.trim()))
                        .collect(),
                    None => vec![first_segment(rest)],
                };
                named.extend(items.into_iter().filter(|s| s != stem && stems.contains(s)));
            }
        }
        named.sort();
        named.dedup();
        out.insert(stem.clone(), named);
    }
    out
}

/// The circles among `uses` (module -> modules it names): each a sorted list of modules that
/// all reach one another.
fn circles(uses: &BTreeMap<String, Vec<String>>) -> Vec<Vec<String>> {
    let reach = |from: &String| {
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for next in uses.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, _> = uses.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for m in uses.keys() {
        if !reached[m].contains(m) || out.iter().any(|c| c.contains(m)) {
            continue;
        }
        let circle: Vec<String> = uses
            .keys()
            .filter(|o| reached[m].contains(*o) && reached[*o].contains(m))
            .cloned()
            .collect();
        out.push(circle);
    }
    out
}

#[test]
fn sibling_modules_form_no_circle() {
    let mut found = Vec::new();
    for krate in ["burn-ddp-comm", "burn-ddp-burn021", "burn-ddp-gradsync"] {
        let src = root().join(krate).join("src");
        let mut dirs = vec![src.clone()];
        let mut i = 0;
        while i < dirs.len() {
            for entry in std::fs::read_dir(&dirs[i]).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                }
            }
            i += 1;
        }
        for dir in dirs {
            for circle in circles(&sibling_uses(&src, &dir)) {
                let rel = dir.strip_prefix(root()).unwrap().display().to_string();
                found.push(format!("{rel}: {}", circle.join(", ")));
            }
        }
    }
    assert!(
        found.is_empty(),
        "modules that name one another (each circle: modules that all reach one another \
         through `super::` or `crate::` paths); move what they share below them: {found:?}"
    );
}

#[test]
fn the_circle_checker_sees_a_circle_through_three_modules_and_none_in_a_chain() {
    let uses = |edges: &[(&str, &str)]| {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (a, b) in edges {
            m.entry(a.to_string()).or_default().push(b.to_string());
            m.entry(b.to_string()).or_default();
        }
        m
    };
    assert_eq!(
        circles(&uses(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
        [["a", "b", "c"]]
    );
    assert!(circles(&uses(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
}
