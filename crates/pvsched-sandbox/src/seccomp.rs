//! The seccomp allowlists: reviewed data in `seccomp/<profile>.json`
//! (seccompiler's JSON format, one filter named after the profile, a
//! `comment` with the reason beside every rule), compiled at runtime with
//! `seccompiler::compile_from_json` and installed with default action
//! `kill_process`, so a forbidden syscall ends the process with SIGSYS.

use std::collections::HashMap;

use seccompiler::{BpfProgram, TargetArch};

use crate::error::{Error, Result};

const DEVICE_MPQEMU: &str = include_str!("../seccomp/device-mpqemu.json");
const DEVICE_VFIO_USER: &str = include_str!("../seccomp/device-vfio-user.json");

/// Which allowlist to install.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SeccompProfile {
    /// Device process serving QEMU's `x-pci-proxy-dev` (mpqemu).
    DeviceMpqemu,
    /// Device process serving a vfio-user client.
    DeviceVfioUser,
    /// A caller-supplied filter in seccompiler's JSON format; the top-level
    /// key must equal `name`.
    Json {
        /// Filter name (top-level key).
        name: String,
        /// The JSON text.
        json: String,
    },
}

impl SeccompProfile {
    /// The profile's name (the JSON file stem / top-level key).
    pub fn name(&self) -> &str {
        match self {
            SeccompProfile::DeviceMpqemu => "device-mpqemu",
            SeccompProfile::DeviceVfioUser => "device-vfio-user",
            SeccompProfile::Json { name, .. } => name,
        }
    }

    /// The profile's JSON text.
    pub fn json(&self) -> &str {
        match self {
            SeccompProfile::DeviceMpqemu => DEVICE_MPQEMU,
            SeccompProfile::DeviceVfioUser => DEVICE_VFIO_USER,
            SeccompProfile::Json { json, .. } => json,
        }
    }

    /// Compiles the profile for the running architecture.
    pub fn compile(&self) -> Result<BpfProgram> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)
            .map_err(|_| Error::SeccompArch(std::env::consts::ARCH))?;
        let mut map: HashMap<String, BpfProgram> =
            seccompiler::compile_from_json(self.json().as_bytes(), arch).map_err(|source| {
                Error::SeccompCompile {
                    profile: self.name().to_string(),
                    source,
                }
            })?;
        map.remove(self.name())
            .ok_or_else(|| Error::SeccompMissingFilter(self.name().to_string()))
    }
}

/// Installs a compiled filter on the calling thread (the device is
/// single-threaded; the allowlists forbid `clone`).
pub(crate) fn install(profile: &SeccompProfile, prog: &BpfProgram) -> Result<()> {
    seccompiler::apply_filter(prog).map_err(|source| Error::SeccompInstall {
        profile: profile.name().to_string(),
        source,
    })
}

/// Test-only trigger: tries to open `/etc/hostname`. Inside the sandbox this
/// never returns (seccomp kills the process with SIGSYS); outside it returns
/// whether the open succeeded.
pub fn attempt_forbidden_open() -> bool {
    std::fs::File::open("/etc/hostname").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(profile: &SeccompProfile) -> Vec<serde_json::Value> {
        let v: serde_json::Value = serde_json::from_str(profile.json()).expect("valid JSON");
        v[profile.name()]["filter"]
            .as_array()
            .expect("filter array")
            .clone()
    }

    const PROFILES: [SeccompProfile; 2] =
        [SeccompProfile::DeviceMpqemu, SeccompProfile::DeviceVfioUser];

    #[test]
    fn every_rule_has_a_reason() {
        for p in &PROFILES {
            for rule in rules(p) {
                let c = rule["comment"].as_str().unwrap_or("");
                assert!(
                    !c.trim().is_empty(),
                    "{}: rule without reason: {rule}",
                    p.name()
                );
            }
        }
    }

    #[test]
    fn default_action_kills_the_process() {
        for p in &PROFILES {
            let v: serde_json::Value = serde_json::from_str(p.json()).expect("valid JSON");
            assert_eq!(v[p.name()]["mismatch_action"], "kill_process");
            assert_eq!(v[p.name()]["match_action"], "allow");
        }
    }

    #[test]
    fn dangerous_syscalls_are_absent() {
        let forbidden = [
            "open", "openat", "openat2", "socket", "connect", "bind", "listen", "accept",
            "accept4", "execve", "execveat", "fork", "vfork", "clone", "clone3", "ptrace",
            "unshare", "setns", "mount", "kill", "tgkill", "prctl", "seccomp", "bpf",
        ];
        for p in &PROFILES {
            for rule in rules(p) {
                let s = rule["syscall"].as_str().expect("syscall name");
                assert!(!forbidden.contains(&s), "{}: allows {s}", p.name());
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn profiles_compile() {
        for p in &PROFILES {
            let prog = p.compile().expect("compile");
            assert!(!prog.is_empty());
        }
    }

    #[test]
    fn custom_profile_with_wrong_key_is_reported() {
        let p = SeccompProfile::Json {
            name: "mine".into(),
            json:
                r#"{"other":{"mismatch_action":"kill_process","match_action":"allow","filter":[]}}"#
                    .into(),
        };
        assert!(matches!(p.compile(), Err(Error::SeccompMissingFilter(_))));
    }
}
