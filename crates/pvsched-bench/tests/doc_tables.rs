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
