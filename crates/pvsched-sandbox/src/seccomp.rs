//! The seccomp allowlists: reviewed data in `seccomp/` (seccompiler's JSON
//! format, a `comment` with the reason beside every rule):
//! `device-common.json` holds what every device process needs and
//! `device-additions.json` what each transport adds (today nothing: BAR2
//! accesses over the vfio-user socket go through the device's mapping, not
//! `pread64`/`pwrite64`). A profile is the common filter, named
//! after the profile, plus its additions; it is compiled at runtime with
//! `seccompiler::compile_from_json` and installed with default action
//! `kill_process`, so a forbidden syscall ends the process with SIGSYS.

use std::collections::HashMap;
use std::os::fd::RawFd;

use seccompiler::{BpfProgram, TargetArch};

use crate::error::{Error, Result};

const DEVICE_COMMON: &str = include_str!("../seccomp/device-common.json");
const DEVICE_ADDITIONS: &str = include_str!("../seccomp/device-additions.json");

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

    /// The profile's JSON text: for the device profiles, the common
    /// filter renamed after the profile with the transport's additions
    /// appended.
    pub fn json(&self) -> Result<String> {
        match self {
            SeccompProfile::Json { json, .. } => Ok(json.clone()),
            _ => serde_json::to_string(&self.device_value()?).map_err(|e| self.json_err(e)),
        }
    }

    fn json_err(&self, source: serde_json::Error) -> Error {
        Error::SeccompJson {
            profile: self.name().to_string(),
            source,
        }
    }

    /// The profile as a JSON value (a caller's profile is parsed).
    fn value(&self) -> Result<serde_json::Value> {
        match self {
            SeccompProfile::Json { json, .. } => {
                serde_json::from_str(json).map_err(|e| self.json_err(e))
            }
            _ => self.device_value(),
        }
    }

    fn device_value(&self) -> Result<serde_json::Value> {
        let json_err = |e| self.json_err(e);
        let mut common: serde_json::Value =
            serde_json::from_str(DEVICE_COMMON).map_err(json_err)?;
        let mut filter = common
            .get_mut("device-common")
            .map(serde_json::Value::take)
            .ok_or_else(|| Error::SeccompMissingFilter("device-common".into()))?;
        let additions: serde_json::Value =
            serde_json::from_str(DEVICE_ADDITIONS).map_err(json_err)?;
        let extra = additions
            .get(self.name())
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| Error::SeccompMissingFilter(self.name().to_string()))?;
        filter
            .get_mut("filter")
            .and_then(serde_json::Value::as_array_mut)
            .ok_or_else(|| Error::SeccompMissingFilter("device-common".into()))?
            .extend(extra.iter().cloned());
        Ok(serde_json::json!({ self.name(): filter }))
    }

    /// Compiles the profile for the running architecture.
    pub fn compile(&self) -> Result<BpfProgram> {
        self.compile_with_accept(None)
    }

    /// Compiles the profile plus, when `accept_fd` is given, one rule that
    /// allows `accept4` on that fd only (argument 0 equal to it). The rule
    /// is added here rather than in the JSON because the fd number is only
    /// known at runtime; see [`crate::SandboxConfig::accept_fd`].
    pub fn compile_with_accept(&self, accept_fd: Option<RawFd>) -> Result<BpfProgram> {
        let arch = TargetArch::try_from(std::env::consts::ARCH)
            .map_err(|_| Error::SeccompArch(std::env::consts::ARCH))?;
        let json = match accept_fd {
            None => self.json()?,
            Some(fd) => self.json_with_accept(fd)?,
        };
        let mut map: HashMap<String, BpfProgram> =
            seccompiler::compile_from_json(json.as_bytes(), arch).map_err(|source| {
                Error::SeccompCompile {
                    profile: self.name().to_string(),
                    source,
                }
            })?;
        map.remove(self.name())
            .ok_or_else(|| Error::SeccompMissingFilter(self.name().to_string()))
    }
}

impl SeccompProfile {
    /// The profile's JSON with the `accept4`-on-`fd` rule appended.
    fn json_with_accept(&self, fd: RawFd) -> Result<String> {
        let mut v = self.value()?;
        let filter = v
            .get_mut(self.name())
            .and_then(|f| f.get_mut("filter"))
            .and_then(serde_json::Value::as_array_mut)
            .ok_or_else(|| Error::SeccompMissingFilter(self.name().to_string()))?;
        filter.push(serde_json::json!({
            "syscall": "accept4",
            "comment": "the library accepts the one pending client on the listener (path already unlinked)",
            "args": [{
                "index": 0,
                "type": "dword",
                "op": "eq",
                "val": fd,
                "comment": "only the listening socket kept for this purpose",
            }],
        }));
        serde_json::to_string(&v).map_err(|e| self.json_err(e))
    }
}

/// Size in bytes of the file behind `fd`, with the `fstat` system call
/// itself. The allowlists allow no `stat` that takes a path; glibc's
/// `fstat()` (and so `nix::sys::stat::fstat`) is `newfstatat(fd, "",
/// AT_EMPTY_PATH)` and std's `File::metadata` is `statx`, both of which the
/// sandbox refuses. Use this for every fd the device sizes after entering
/// the sandbox.
pub fn fd_size(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero `struct stat` is a valid value for the kernel to
    // overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat(2) writes one `struct stat` into `st`, which is live
    // and of the right type; `fd` is a borrowed open descriptor.
    let r = unsafe { libc::syscall(libc::SYS_fstat, fd.as_raw_fd(), &mut st as *mut libc::stat) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    u64::try_from(st.st_size).map_err(|_| std::io::Error::other("negative file size"))
}

/// The seals of `fd` (`F_GET_SEALS`: `F_SEAL_*` bits), through the one
/// `fcntl` command the allowlists permit for it. A file that cannot be
/// sealed (not a memfd or tmpfs/hugetlbfs file) is an error (`EINVAL`).
pub fn fd_seals(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GET_SEALS takes no argument and touches no memory of ours;
    // `fd` is a borrowed open descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// The type of the filesystem the file behind `fd` lives on
/// (`statfs.f_type`: a `*_MAGIC` number such as [`libc::TMPFS_MAGIC`]),
/// with the `fstatfs` system call itself on the fd: the allowlists allow no
/// `statfs` that takes a path. The device maps guest RAM only from shmem
/// (see `pvsched_transport::guest_ram`).
pub fn fd_fs_type(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<libc::__fsword_t> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero `struct statfs` is a valid value for the kernel
    // to overwrite.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs(2) writes one `struct statfs` into `st`, which is live
    // and of the right type; `fd` is a borrowed open descriptor.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fstatfs,
            fd.as_raw_fd(),
            &mut st as *mut libc::statfs,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type)
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
        let v: serde_json::Value =
            serde_json::from_str(&profile.json().expect("json")).expect("valid JSON");
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
            let v: serde_json::Value =
                serde_json::from_str(&p.json().expect("json")).expect("valid JSON");
            assert_eq!(v[p.name()]["mismatch_action"], "kill_process");
            assert_eq!(v[p.name()]["match_action"], "allow");
        }
    }

    #[test]
    fn dangerous_syscalls_are_absent() {
        let forbidden = [
            "open",
            "openat",
            "openat2",
            "socket",
            "connect",
            "bind",
            "listen",
            "accept",
            "accept4",
            "execve",
            "execveat",
            "fork",
            "vfork",
            "clone",
            "clone3",
            "ptrace",
            "unshare",
            "setns",
            "mount",
            "kill",
            "tgkill",
            "prctl",
            "seccomp",
            "bpf",
            // Path lookups: AT_EMPTY_PATH in the flags does not stop a
            // non-empty path from being resolved; the device uses fstat.
            "newfstatat",
            "statx",
            "stat",
            "lstat",
            "statfs",
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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn accept_rule_is_added_for_one_fd_only() {
        for p in &PROFILES {
            let json = p.json_with_accept(7).expect("json");
            let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
            let rules = v[p.name()]["filter"].as_array().expect("filter");
            let accept: Vec<_> = rules
                .iter()
                .filter(|r| r["syscall"].as_str().unwrap_or("").starts_with("accept"))
                .collect();
            assert_eq!(accept.len(), 1, "{}", p.name());
            assert_eq!(accept[0]["syscall"], "accept4");
            assert_eq!(accept[0]["args"][0]["val"], 7);
            assert_eq!(accept[0]["args"][0]["op"], "eq");
            assert!(p.compile_with_accept(Some(7)).expect("compile").len() > 1);
        }
    }

    #[test]
    fn profiles_are_the_common_part_plus_their_additions() {
        let common = rules(&SeccompProfile::Json {
            name: "device-common".into(),
            json: DEVICE_COMMON.into(),
        });
        let mp = rules(&SeccompProfile::DeviceMpqemu);
        let vu = rules(&SeccompProfile::DeviceVfioUser);
        assert_eq!(mp, common, "mpqemu adds nothing");
        assert_eq!(&vu[..common.len()], &common[..]);
        assert_eq!(vu, common, "vfio-user adds nothing since BAR2 is mapped");
    }

    #[test]
    fn fd_size_is_the_file_size() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("pvsched-fd-size-{}", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&[0u8; 12345]).unwrap();
        assert_eq!(fd_size(std::os::fd::AsFd::as_fd(&f)).unwrap(), 12345);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn fd_seals_reads_memfd_seals_and_refuses_plain_files() {
        use std::os::fd::{AsFd, FromRawFd};
        // SAFETY: memfd_create with a valid C string; the fd is owned below.
        let fd = unsafe { libc::memfd_create(c"seals".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nobody else.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        assert_eq!(fd_seals(f.as_fd()).unwrap(), 0);
        // SAFETY: fcntl on an fd this test owns.
        let rc = unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(rc, 0);
        assert_eq!(fd_seals(f.as_fd()).unwrap(), libc::F_SEAL_SHRINK);
        let path = std::env::temp_dir().join(format!("pvsched-fd-seals-{}", std::process::id()));
        let plain = std::fs::File::create(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        // /tmp may be tmpfs, which supports seals; either answer is fine
        // as long as it does not panic.
        let _ = fd_seals(plain.as_fd());
    }

    #[test]
    fn fd_fs_type_tells_shmem_from_other_filesystems() {
        use std::os::fd::{AsFd, FromRawFd};
        // SAFETY: memfd_create with a valid C string; the fd is owned below.
        let fd = unsafe { libc::memfd_create(c"fstype".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nobody else.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        assert_eq!(fd_fs_type(f.as_fd()).unwrap(), libc::TMPFS_MAGIC);
        let proc = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(fd_fs_type(proc.as_fd()).unwrap(), libc::PROC_SUPER_MAGIC);
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
