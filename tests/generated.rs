//! Generated files are committed; these tests fail when they drift from the code.

use std::path::Path;

#[test]
fn committed_crds_match_the_code() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    let mut expected: Vec<String> = Vec::new();
    for crd in lanekeeper::crd::all() {
        let name = lanekeeper::crd::file_name(&crd);
        let want = lanekeeper::crd::to_yaml(&crd).unwrap();
        let path = dir.join(&name);
        let have = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{} is missing ({e}); run `cargo run -- crds --out crds/`",
                path.display()
            )
        });
        assert!(
            have == want,
            "{} drifted from the Rust types; run `cargo run -- crds --out crds/` and commit",
            path.display()
        );
        expected.push(name);
    }
    let mut present: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    present.sort();
    expected.sort();
    assert_eq!(
        present, expected,
        "crds/ holds files the code does not generate"
    );
}

#[test]
fn crds_subcommand_prints_both_crds() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lanekeeper"))
        .arg("crds")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, lanekeeper::crd::all_yaml().unwrap());
    assert!(text.contains("name: shardsets.lanekeeper.io"));
    assert!(text.contains("name: dedicatedlanes.lanekeeper.io"));
}
