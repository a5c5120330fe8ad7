//! C ↔ Rust layout checks, written once for every header pvsched defines in
//! C and mirrors in Rust (`include/pvsched_abi.h` ↔ `pvsched-abi`,
//! `bpf-policy/intf.h` ↔ `pvsched-agent::intf`).
//!
//! A test lists each struct's fields with [`layout_struct!`](crate::layout_struct)
//! and each shared constant with [`layout_consts!`](crate::layout_consts);
//! that one list generates both the C program (which prints what the C
//! compiler sees) and the Rust expectations, so nothing can be checked on
//! one side only. [`check_coverage`] catches a field missing from the list
//! (the listed fields' sizes must add up to the struct's size, so the
//! struct also has no padding); [`compare_with_c`] compiles the program
//! against the header and names every mismatch.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// One checked item: what C prints for `c_expr`, under `name`, must equal
/// `rust`.
pub struct Expect {
    /// Unique name of the item (`sizeof:s`, `offsetof:s.f`, `const:C`...).
    pub name: String,
    /// C expression whose value is printed.
    pub c_expr: String,
    /// The Rust side's value.
    pub rust: i128,
}

/// A struct's listed fields: how many bytes they cover of its size.
pub struct Coverage {
    /// The C struct name.
    pub name: &'static str,
    /// Sum of the listed fields' sizes.
    pub covered: usize,
    /// The Rust struct's size.
    pub size: usize,
}

/// Size of the pointee of `_p` (used by [`layout_struct!`](crate::layout_struct)
/// to size a field without a value).
pub fn size_of_pointee<T>(_p: *const T) -> usize {
    std::mem::size_of::<T>()
}

/// Pushes the size of struct `$cname` (Rust type `$t`), and the offset and
/// size of each listed field, onto `$out` (a `Vec<Expect>`), and records
/// the listed fields' coverage in `$cov` (a `Vec<Coverage>`).
#[macro_export]
macro_rules! layout_struct {
    ($out:ident, $cov:ident, $cname:literal, $t:ty, [$($f:ident),* $(,)?]) => {{
        $out.push($crate::layout::Expect {
            name: format!("sizeof:{}", $cname),
            c_expr: format!("sizeof(struct {})", $cname),
            rust: ::std::mem::size_of::<$t>() as i128,
        });
        let mut covered = 0usize;
        $(
            let size = {
                let u = ::std::mem::MaybeUninit::<$t>::uninit();
                let p = u.as_ptr();
                // SAFETY: addr_of! on a field of a MaybeUninit pointer
                // creates no reference and reads nothing; only the
                // pointee type's size is used.
                let fp = unsafe { ::std::ptr::addr_of!((*p).$f) };
                $crate::layout::size_of_pointee(fp)
            };
            $out.push($crate::layout::Expect {
                name: format!("offsetof:{}.{}", $cname, stringify!($f)),
                c_expr: format!("offsetof(struct {}, {})", $cname, stringify!($f)),
                rust: ::std::mem::offset_of!($t, $f) as i128,
            });
            $out.push($crate::layout::Expect {
                name: format!("sizeof:{}.{}", $cname, stringify!($f)),
                c_expr: format!("sizeof(((struct {} *)0)->{})", $cname, stringify!($f)),
                rust: size as i128,
            });
            covered += size;
        )*
        $cov.push($crate::layout::Coverage {
            name: $cname,
            covered,
            size: ::std::mem::size_of::<$t>(),
        });
    }};
}

/// Pushes each `C_NAME => rust value` onto `$out` (a `Vec<Expect>`).
#[macro_export]
macro_rules! layout_consts {
    ($out:ident, [$($c:ident => $r:expr),* $(,)?]) => {{
        $(
            $out.push($crate::layout::Expect {
                name: format!("const:{}", stringify!($c)),
                c_expr: format!("(long long)({})", stringify!($c)),
                rust: ($r) as i128,
            });
        )*
    }};
}

/// Panics naming every struct whose listed fields do not cover it: a field
/// is missing from the list, or the struct has padding.
pub fn check_coverage(cov: &[Coverage]) {
    let bad: Vec<String> = cov
        .iter()
        .filter(|c| c.covered != c.size)
        .map(|c| {
            format!(
                "struct {}: listed fields cover {} of {} bytes; a field is missing from the \
                 layout list or the struct has padding",
                c.name, c.covered, c.size
            )
        })
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Compiles a C program that includes `headers` (searched in
/// `include_dirs`, with `cflags`) and prints every item of `items`, runs it
/// in `work_dir` and panics listing every item whose C value differs from
/// the Rust one (or that C did not print).
pub fn compare_with_c(
    items: &[Expect],
    headers: &[&str],
    include_dirs: &[&Path],
    cflags: &[&str],
    work_dir: &Path,
) {
    let mut src = String::from("#include <stdio.h>\n#include <stddef.h>\n");
    for h in headers {
        src.push_str(&format!("#include \"{h}\"\n"));
    }
    src.push_str("int main(void)\n{\n");
    for e in items {
        src.push_str(&format!(
            "\tprintf(\"%s %lld\\n\", \"{}\", (long long)({}));\n",
            e.name, e.c_expr
        ));
    }
    src.push_str("\treturn 0;\n}\n");
    std::fs::create_dir_all(work_dir).expect("create the layout work dir");
    let c_file = work_dir.join("layout.c");
    let bin = work_dir.join("layout");
    std::fs::write(&c_file, src).expect("write the C layout program");

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let mut cmd = Command::new(&cc);
    cmd.args(cflags);
    for d in include_dirs {
        cmd.arg("-I").arg(d);
    }
    let status = cmd
        .arg(&c_file)
        .arg("-o")
        .arg(&bin)
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run the C compiler `{cc}`: {e}; scripts/setup installs build-essential")
        });
    assert!(status.success(), "the C layout program failed to compile");
    let out = Command::new(&bin)
        .output()
        .expect("run the C layout program");
    assert!(out.status.success(), "the C layout program failed");
    let text = String::from_utf8(out.stdout).expect("utf8");
    let c: BTreeMap<&str, i128> = text
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("`name value` line");
            (k, v.parse().expect("integer"))
        })
        .collect();
    let mut mismatches = Vec::new();
    for e in items {
        match c.get(e.name.as_str()) {
            Some(&v) if v == e.rust => {}
            Some(&v) => mismatches.push(format!("{}: C {} != Rust {}", e.name, v, e.rust)),
            None => mismatches.push(format!("{}: missing from C output", e.name)),
        }
    }
    assert!(
        mismatches.is_empty(),
        "layout mismatches:\n{}",
        mismatches.join("\n")
    );
    assert_eq!(c.len(), items.len(), "duplicate names in the layout list");
}

/// What a generated Python module says about itself.
pub struct PythonHeader<'a> {
    /// The docstring's first line, e.g. "The pvsched ABI
    /// (include/pvsched_abi.h) for Python harnesses."
    pub title: &'a str,
    /// The constants' prefix in C, dropped in Python (`PVSCHED_`).
    pub prefix: &'a str,
    /// The test that generates and checks the module.
    pub generated_by: &'a str,
}

/// The Python module restating `items` for the harnesses (`python/`): every
/// constant (`PVSCHED_X` becomes `X`), every struct's size in `SIZEOF` and
/// every field's offset in `OFFSETOF`, with the Rust values, which
/// [`compare_with_c`] checks against C from the same list.
pub fn python_module(items: &[Expect], header: &PythonHeader) -> String {
    let mut consts = String::new();
    let mut sizes = BTreeMap::new();
    let mut offsets: BTreeMap<&str, Vec<(&str, i128)>> = BTreeMap::new();
    for e in items {
        if let Some(c) = e.name.strip_prefix("const:") {
            let name = c.strip_prefix(header.prefix).unwrap_or(c);
            consts.push_str(&format!("{name} = {}\n", e.rust));
        } else if let Some(s) = e.name.strip_prefix("sizeof:") {
            if !s.contains('.') {
                sizes.insert(s, e.rust);
            }
        } else if let Some((s, f)) = e
            .name
            .strip_prefix("offsetof:")
            .and_then(|x| x.split_once('.'))
        {
            offsets.entry(s).or_default().push((f, e.rust));
        }
    }
    let PythonHeader {
        title,
        generated_by,
        ..
    } = header;
    let mut out = format!(
        "\"\"\"{title}\n\n\
         Generated from the list that checks the C header against its Rust\n\
         mirror, by\n    {generated_by}\n\
         Do not edit: that test fails when this file is stale, and\n\
         PVSCHED_BLESS=1 rewrites it.\n\"\"\"\n\n"
    );
    out.push_str(&consts);
    out.push_str("\nSIZEOF = {\n");
    for (s, n) in &sizes {
        out.push_str(&format!("    \"{s}\": {n},\n"));
    }
    out.push_str("}\n\nOFFSETOF = {\n");
    for (s, fields) in &offsets {
        out.push_str(&format!("    \"{s}\": {{\n"));
        for (f, n) in fields {
            out.push_str(&format!("        \"{f}\": {n},\n"));
        }
        out.push_str("    },\n");
    }
    out.push_str("}\n");
    out
}

/// Checks that `path` holds `text` (a file generated from a layout list);
/// with `PVSCHED_BLESS=1` writes it instead. Panics saying how to
/// regenerate it.
pub fn check_generated(path: &Path, text: &str) {
    if std::env::var_os("PVSCHED_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        have == text,
        "{} is stale (or missing): it must be regenerated from the layout list; \
         run the test again with PVSCHED_BLESS=1 and commit the file",
        path.display()
    );
}
