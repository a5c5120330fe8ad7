//! The results page says what its JSON says: `pvsched-bench doc --check`
//! redraws every generated table and inline figure of docs/benchmarks.md
//! from the committed JSON it cites and fails on any difference. A figure
//! typed by hand, or a JSON replaced without redrawing the page, fails
//! here. No root, KVM or BPF needed: it reads files.

use std::path::Path;
use std::process::Command;

#[test]
fn benchmarks_page_matches_its_json() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let page = root.join("docs/benchmarks.md");
    let out = Command::new(env!("CARGO_BIN_EXE_pvsched-bench"))
        .args(["doc", "--check"])
        .arg(&page)
        .output()
        .expect("run pvsched-bench doc --check");
    assert!(
        out.status.success(),
        "docs/benchmarks.md differs from its JSON (run `pvsched-bench doc` to redraw):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// docs/bench holds only what the results page cites: a report the page
/// no longer names (a superseded run, an experiment's scratch JSON) is
/// weight every clone carries and evidence nobody reads. A file counts as
/// cited when the page names it by its path from the repository root
/// (`docs/bench/NAME`) or from the page (`bench/NAME`, a link).
#[test]
fn every_file_in_docs_bench_is_cited_by_the_page() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let page =
        std::fs::read_to_string(root.join("docs/benchmarks.md")).expect("read docs/benchmarks.md");
    let mut uncited: Vec<String> = std::fs::read_dir(root.join("docs/bench"))
        .expect("list docs/bench")
        .map(|e| e.expect("read docs/bench").file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|name| !page.contains(&format!("bench/{name}")))
        .collect();
    uncited.sort();
    assert!(
        uncited.is_empty(),
        "docs/bench holds files docs/benchmarks.md does not cite (cite them or git rm them): \
         {uncited:?}"
    );
}
