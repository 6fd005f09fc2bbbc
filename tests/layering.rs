//! The layering rule of `docs/architecture.md`, checked: which module of the
//! library may name which. A `crate::<module>` path in a module's code (not
//! in comments, and not in its test-only code) must be one its layer allows.
//!
//! The layers, bottom up: the pure core (`envelope`, `endpoint`, `signing`,
//! `routing`, `policy`); `store` (every Redis key and script); the data plane
//! (`producer`, `worker`, `ingest`) and `telemetry`; the API types (`crd`);
//! the operator (`controller`); the capacity simulator (`simulate`). The
//! binary (`src/main.rs`, `src/cli/`) may use anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CORE: &[&str] = &["envelope", "endpoint", "signing", "routing", "policy"];

/// What each module may name besides itself.
fn allowed(module: &str) -> BTreeSet<&'static str> {
    let core = CORE.iter().copied();
    let with_core = |extra: &[&'static str]| core.clone().chain(extra.iter().copied()).collect();
    match module {
        "envelope" | "signing" | "routing" => BTreeSet::new(),
        "endpoint" => ["signing", "envelope"].into(),
        "policy" => ["routing"].into(),
        "store" => with_core(&[]),
        "telemetry" => BTreeSet::new(),
        "producer" => with_core(&["store"]),
        "worker" => with_core(&["store", "telemetry"]),
        "ingest" => with_core(&["store", "producer", "telemetry"]),
        "crd" => ["policy", "routing"].into(),
        // `worker` only for its environment contract (`worker::env`), checked below.
        "controller" => with_core(&["crd", "store", "telemetry", "worker"]),
        "simulate" => with_core(&["crd", "store"]),
        other => panic!("module {other} has no layer: add it to the rule and the docs"),
    }
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

/// The code of a file without its comments and its trailing test module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `crate::<name>` path in `code`, with what follows the name.
fn crate_paths(code: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let tail: String = after[name.len()..].chars().take(40).collect();
        out.push((name, tail));
        rest = after;
    }
    out
}

#[test]
fn every_module_names_only_what_its_layer_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for file in files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .to_string();
        let module = rel.split(['/', '.']).next().unwrap().to_string();
        // The binary, the crate root, and test-only files.
        if matches!(module.as_str(), "main" | "cli" | "lib") || rel.ends_with("tests.rs") {
            continue;
        }
        seen.insert(module.clone());
        let ok = allowed(&module);
        for (name, tail) in crate_paths(&code(&std::fs::read_to_string(&file).unwrap())) {
            let fine = name == module
                || ok.contains(name.as_str())
                    && (module != "controller" || name != "worker" || tail.starts_with("::env"));
            if !fine {
                broken
                    .entry(format!("{module} -> {name}"))
                    .or_default()
                    .insert(rel.clone());
            }
        }
    }
    assert!(broken.is_empty(), "layering broken: {broken:#?}");
    // The rule covers every module there is.
    for m in &seen {
        allowed(m);
    }
}

#[test]
fn the_checker_sees_a_path_and_ignores_comments_and_tests() {
    let text = "//! crate::controller in a doc\nuse crate::store::Store;\nfn f() { crate::policy::retry_delay(); }\n#[cfg(test)]\nmod tests {\n    use crate::controller;\n}\n";
    let names: Vec<String> = crate_paths(&code(text))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["store", "policy"]);
}
