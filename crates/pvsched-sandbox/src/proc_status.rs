//! Reading a process's sandbox state back from `/proc/<pid>/status`.

use std::fs;

use crate::error::{Error, Result};

/// The sandbox-relevant fields of `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStatus {
    /// `CapEff`: effective capability mask.
    pub cap_eff: u64,
    /// `CapPrm`: permitted capability mask.
    pub cap_prm: u64,
    /// `CapBnd`: bounding set.
    pub cap_bnd: u64,
    /// `NoNewPrivs`.
    pub no_new_privs: bool,
    /// `Seccomp`: 0 off, 1 strict, 2 filter.
    pub seccomp_mode: u32,
}

/// Parses the text of a `/proc/<pid>/status` file.
pub fn parse_proc_status(text: &str) -> Result<ProcStatus> {
    let field = |name: &'static str| -> Result<&str> {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
            .map(str::trim)
            .ok_or(Error::ProcField(name))
    };
    let hex = |name: &'static str| -> Result<u64> {
        u64::from_str_radix(field(name)?, 16).map_err(|_| Error::ProcField(name))
    };
    let dec = |name: &'static str| -> Result<u32> {
        field(name)?.parse().map_err(|_| Error::ProcField(name))
    };
    Ok(ProcStatus {
        cap_eff: hex("CapEff")?,
        cap_prm: hex("CapPrm")?,
        cap_bnd: hex("CapBnd")?,
        no_new_privs: dec("NoNewPrivs")? != 0,
        seccomp_mode: dec("Seccomp")?,
    })
}

/// Reads and parses `/proc/<pid>/status`.
pub fn read_proc_status(pid: u32) -> Result<ProcStatus> {
    let path = format!("/proc/{pid}/status");
    let text = fs::read_to_string(&path).map_err(|source| Error::Proc { path, source })?;
    parse_proc_status(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields() {
        let text = "Name:\tx\nCapPrm:\t0000000000000000\nCapEff:\t000001ffffffffff\n\
                    CapBnd:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n";
        let s = parse_proc_status(text).expect("parse");
        assert_eq!(s.cap_eff, 0x1ff_ffff_ffff);
        assert!(s.no_new_privs);
        assert_eq!(s.seccomp_mode, 2);
    }

    #[test]
    fn missing_field_is_an_error() {
        assert!(matches!(
            parse_proc_status("CapEff:\t0\n"),
            Err(Error::ProcField(_))
        ));
    }

    #[test]
    fn reads_own_status() {
        let s = read_proc_status(std::process::id()).expect("own status");
        assert_eq!(s.seccomp_mode, 0);
    }
}
