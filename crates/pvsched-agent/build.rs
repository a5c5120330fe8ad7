//! Builds the BPF policy object from `bpf-policy/` with clang (CO-RE): first
//! `vmlinux.h` from the running kernel's BTF (`bpf-policy/gen-vmlinux.sh`,
//! bpftool), then `clang -target bpf -O2 -g -mcpu=v3`. The object is embedded by
//! `src/object.rs` (`OBJECT`). Fails with a clear message when the toolchain is missing
//! (`scripts/setup` installs clang-19, llvm-19, libbpf-dev and bpftool).

use std::path::PathBuf;
use std::process::Command;

fn find_clang() -> Option<String> {
    if let Ok(c) = std::env::var("PVSCHED_CLANG") {
        return Some(c);
    }
    ["clang-19", "clang"].into_iter().find_map(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|_| c.to_string())
    })
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..");
    let src = root.join("bpf-policy");
    let include = root.join("include");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    for f in std::fs::read_dir(&src).expect("read bpf-policy/") {
        let p = f.expect("dir entry").path();
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        include.join("pvsched_abi.h").display()
    );
    println!("cargo:rerun-if-env-changed=PVSCHED_CLANG");
    println!("cargo:rerun-if-env-changed=PVSCHED_VMLINUX_BTF");

    let Some(clang) = find_clang() else {
        panic!(
            "pvsched-agent: clang not found (tried $PVSCHED_CLANG, clang-19, clang). \
             The BPF policy is compiled at build time: run scripts/setup as root \
             (installs clang-19 llvm-19 libbpf-dev bpftool), or set PVSCHED_CLANG."
        );
    };
    if !PathBuf::from("/usr/include/bpf/bpf_helpers.h").exists() {
        panic!(
            "pvsched-agent: /usr/include/bpf/bpf_helpers.h missing: install libbpf-dev \
             (scripts/setup does)."
        );
    }
    let vmlinux = out.join("vmlinux.h");
    let btf =
        std::env::var("PVSCHED_VMLINUX_BTF").unwrap_or_else(|_| "/sys/kernel/btf/vmlinux".into());
    let st = Command::new("sh")
        .arg(src.join("gen-vmlinux.sh"))
        .arg(&vmlinux)
        .arg(&btf)
        .status()
        .expect("run bpf-policy/gen-vmlinux.sh");
    if !st.success() {
        panic!(
            "pvsched-agent: generating vmlinux.h from {btf} with bpftool failed: install \
             bpftool (scripts/setup) and check that the kernel has BTF (CONFIG_DEBUG_INFO_BTF)."
        );
    }
    let obj = out.join("pvsched.bpf.o");
    let o = Command::new(&clang)
        .args([
            "-target",
            "bpf",
            "-O2",
            "-g",
            // v3: 32-bit atomics (the host half's seq claim and the pair
            // fence need compare-and-swap on __u32); kernels >= 5.12, below
            // the 5.17 bpf_loop already needs.
            "-mcpu=v3",
            "-D__TARGET_ARCH_x86",
            "-Wall",
            "-Wno-unused-function",
        ])
        .arg(format!("-I{}", out.display()))
        .arg(format!("-I{}", include.display()))
        .arg(format!("-I{}", src.display()))
        .arg("-c")
        .arg(src.join("pvsched.bpf.c"))
        .arg("-o")
        .arg(&obj)
        .output()
        .expect("run clang");
    if !o.status.success() {
        panic!(
            "pvsched-agent: {clang} failed to compile bpf-policy/pvsched.bpf.c:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
