//! `pvsched qemu-attach`: registers a running QEMU with pvschedd, from
//! one of two sources of vCPU threads:
//!
//! - `--qmp SOCKET --name NAME --pid PID`: QMP `query-cpus-fast` on a QMP
//!   socket of QEMU's own; the socket's peer (SO_PEERCRED) must be QEMU
//!   process PID (whoever can bind the path cannot choose the process).
//! - `--libvirt DOMAIN`: a libvirt domain, through the monitor libvirt
//!   itself holds (`virsh qemu-monitor-command DOMAIN
//!   '{"execute":"query-cpus-fast"}'`), with the QEMU process libvirt
//!   recorded (`--pid`, else /run/libvirt/qemu/DOMAIN.pid) and the caps
//!   and region mode from the domain XML's `<metadata>` (`--domain-xml`,
//!   else `virsh dumpxml`):
//!
//!   ```xml
//!   <pvsched:vm xmlns:pvsched="https://pvsched.dev/xmlns/libvirt/1" region="device">
//!     <pvsched:caps max_rt_prio="3" halt_boost="nice"/>
//!   </pvsched:vm>
//!   ```
//!
//!   Each attribute of `<pvsched:caps>` is one cap, written as for
//!   `pvsched vm set` (`bpf-policy/caps.example.toml` lists them); caps
//!   not given keep their built-in defaults. The libvirt hook
//!   (dist/libvirt/qemu.d/pvsched) runs this in the background once
//!   libvirt has started the domain.
//!
//! Either way every vCPU thread must be a thread of that QEMU process
//! (checked here, and again by pvschedd), APIC IDs come from the CPU
//! topology properties QEMU reports (x86 encoding: each level takes the
//! bits its count needs), and QEMU's main-loop thread (its first thread,
//! tid = pid) is registered as the VM's emulator thread unless
//! `--no-emulator`. The registration is detached: it lasts until QEMU
//! exits (pvschedd watches its pidfd) or `pvsched vm unregister NAME`, so
//! a libvirt hook can run this and return. Root only (pvschedd lets only
//! root register another process's threads).
//!
//! Without a pvsched device in QEMU the VM is registered with no region:
//! it gets the halt and directed-yield boosts (kvm_vcpu_wakeup,
//! kvm_apic_ipi), not the guest's slot requests. With `--device-region`
//! (or `region="device"` in the metadata), QEMU's pvsched device
//! (`pvsched device --transport vfio-user --daemon-region NAME`, started
//! before QEMU) serves pvschedd's region for NAME as BAR2, and the VM is
//! registered with that region: the policy reads what the guest driver
//! writes there.

use crate::daemon_cli::SocketArg;
use crate::exit::Exit;
use crate::monitor::{Qmp, Virsh};
use clap::Args;
use pvsched_daemon::RegisterVm;
use pvsched_daemon::proto::{Region, Vcpu};
use pvsched_host::host::{HostError, PolicyHost, Registration};
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Which running QEMU a command is about, and the VM's name with
/// pvschedd: `qemu-attach`, `attach`, `detach` and `migrate`'s source.
#[derive(Args, Debug, Clone)]
pub struct VmTarget {
    /// QEMU's QMP socket (`-qmp unix:PATH,server=on,wait=off`), a socket
    /// of QEMU's own (for a libvirt domain use --libvirt).
    #[arg(long, required_unless_present = "libvirt", conflicts_with = "libvirt")]
    pub(crate) qmp: Option<PathBuf>,
    /// A running libvirt domain: its vCPU threads come from the monitor
    /// libvirt holds (`virsh qemu-monitor-command DOMAIN
    /// '{"execute":"query-cpus-fast"}'`), its caps and region mode from
    /// its XML's <metadata> (<pvsched:vm>, see docs/operating.md).
    #[arg(long, value_name = "DOMAIN")]
    pub(crate) libvirt: Option<String>,
    /// libvirt's URI for virsh.
    #[arg(long, value_name = "URI", default_value = "qemu:///system")]
    connect: String,
    /// The virsh program.
    #[arg(
        long,
        value_name = "PATH",
        env = "PVSCHED_VIRSH",
        default_value = "virsh"
    )]
    virsh: PathBuf,
    /// The VM's name with pvschedd (its caps file is
    /// /etc/pvsched/vms/NAME.toml); default with --libvirt: the domain's.
    #[arg(long, required_unless_present = "libvirt")]
    pub(crate) name: Option<String>,
    /// The QEMU process the VM runs as. With --qmp (required): the QMP
    /// socket's peer must be it, so a socket another process bound at that
    /// path (a shared directory, a stale path) is refused instead of its
    /// process registered under NAME. With --libvirt: the process libvirt
    /// started (default: the pid in /run/libvirt/qemu/DOMAIN.pid), whose
    /// threads the vCPU threads must be.
    #[arg(long, required_unless_present = "libvirt")]
    pub(crate) pid: Option<u32>,
    #[command(flatten)]
    pub(crate) socket: SocketArg,
}

impl VmTarget {
    pub(crate) fn virsh(&self) -> Virsh {
        Virsh {
            program: self.virsh.clone(),
            connect: self.connect.clone(),
        }
    }

    /// The VM's name with pvschedd: `--name`, else the domain's.
    pub(crate) fn vm_name(&self) -> Result<String, Failed> {
        let name = match (&self.name, &self.libvirt) {
            (Some(n), _) | (None, Some(n)) => n.clone(),
            (None, None) => return Err((Exit::Usage, "--name or --libvirt is needed".into())),
        };
        if !pvsched_daemon::proto::valid_name(&name) {
            return Err((Exit::Usage, format!("{name:?}: not a VM name")));
        }
        Ok(name)
    }
}

/// `pvsched qemu-attach`.
#[derive(Args, Debug, Clone)]
pub struct QemuAttachArgs {
    #[command(flatten)]
    pub(crate) target: VmTarget,
    /// The domain's XML, with its <metadata> (`-`: standard input, as the
    /// libvirt hook gets it); default: `virsh dumpxml DOMAIN`.
    #[arg(long, value_name = "FILE", requires = "libvirt")]
    domain_xml: Option<PathBuf>,
    /// Register the domain only if its <metadata> has a <pvsched:vm>, or
    /// Nova started it with a flavor that has a caps file in
    /// --flavor-dir (the libvirt hook's opt-in); otherwise say so and
    /// exit 0.
    #[arg(long, requires = "libvirt")]
    pub(crate) require_metadata: bool,
    /// Per-flavor caps for domains Nova started: a domain with no
    /// <pvsched:vm> whose <metadata> names Nova flavor F is registered
    /// with the caps of DIR/F.toml, if that file exists (configuration
    /// management puts the same files on every compute node).
    #[arg(long, value_name = "DIR", default_value = "/etc/pvsched/flavors")]
    pub flavor_dir: PathBuf,
    /// Caps to ask for when the VM has no caps file (TOML); with
    /// --libvirt, instead of the metadata's. (`--caps` is the same.)
    #[arg(long, alias = "caps")]
    pub(crate) policy_file: Option<PathBuf>,
    /// Do not register QEMU's main-loop thread as the emulator thread.
    #[arg(long)]
    pub(crate) no_emulator: bool,
    /// QEMU's pvsched device serves pvschedd's region for NAME as BAR2
    /// (`pvsched device --daemon-region NAME`): register the VM with it.
    #[arg(long)]
    pub(crate) device_region: bool,
}

/// Topology levels of an x86 APIC ID, outermost first.
const LEVELS: [&str; 5] = ["socket-id", "die-id", "module-id", "core-id", "thread-id"];

/// APIC ID of each CPU from its topology properties: each level gets the
/// bits its count (largest id + 1 over all possible CPUs) needs, as QEMU's
/// x86 APIC ID encoding does; without properties, the CPU index.
fn apic_ids(cpus: &[Value], possible: &[Value]) -> Vec<u32> {
    let prop = |c: &Value, k: &str| c["props"][k].as_u64();
    let bits: Vec<u32> = LEVELS
        .iter()
        .map(|k| {
            let n = possible
                .iter()
                .filter_map(|c| prop(c, k))
                .max()
                .map_or(1, |m| m + 1);
            u64::BITS - (n.max(1) - 1).leading_zeros()
        })
        .collect();
    cpus.iter()
        .map(|c| {
            if LEVELS.iter().all(|k| prop(c, k).is_none()) {
                return c["cpu-index"].as_u64().unwrap_or(0) as u32;
            }
            let mut id = 0u64;
            for (k, b) in LEVELS.iter().zip(&bits) {
                id = (id << b) | prop(c, k).unwrap_or(0);
            }
            id as u32
        })
        .collect()
}

/// Where the vCPU threads came from: the QEMU process, `query-cpus-fast`
/// and `query-hotpluggable-cpus` (if QEMU answered it).
struct Source {
    pid: u32,
    cpus: Vec<Value>,
    possible: Option<Vec<Value>>,
    /// What to call it in messages.
    what: String,
}

impl Source {
    /// QEMU `pid`'s CPUs, asked with `execute` (a QMP command to its
    /// answer): `query-cpus-fast`, and `query-hotpluggable-cpus` for the
    /// topology if QEMU has it.
    fn ask(
        pid: u32,
        what: String,
        mut execute: impl FnMut(&str) -> Result<Value, String>,
    ) -> Result<Source, String> {
        let cpus = execute("query-cpus-fast")?
            .as_array()
            .cloned()
            .unwrap_or_default();
        let possible = execute("query-hotpluggable-cpus")
            .ok()
            .and_then(|v| v.as_array().cloned());
        Ok(Source {
            pid,
            cpus,
            possible,
            what,
        })
    }
}

/// The threads from QEMU's own QMP socket; its peer is the QEMU process.
fn from_qmp(path: &Path, want: Option<u32>, name: &str) -> Result<Source, String> {
    let mut qmp = Qmp::open(path).map_err(|e| e.to_string())?;
    let pid = qmp.peer_pid().map_err(|e| e.to_string())?;
    if let Some(want) = want
        && want != pid
    {
        return Err(format!(
            "QMP {}: the socket is served by process {pid}, not QEMU {want} (--pid): \
             refusing to register another process as {name}",
            path.display(),
        ));
    }
    Source::ask(pid, format!("QMP {}", path.display()), |cmd| {
        qmp.execute(cmd).map_err(|e| e.to_string())
    })
}

/// libvirt's directory of running domains' pid files.
const LIBVIRT_RUN: &str = "/run/libvirt/qemu";
/// Longest domain XML read (libvirt's are a few KiB).
const MAX_DOMAIN_XML: u64 = 1 << 20;

/// A libvirt domain name that can name a file in [`LIBVIRT_RUN`]
/// (libvirt's own rule: no `/`; not empty; not `.`-led here).
fn domain_name_ok(d: &str) -> bool {
    !d.is_empty() && !d.contains('/') && !d.starts_with('.') && !d.contains('\0')
}

/// Reads at most [`MAX_DOMAIN_XML`] bytes of `path` (`-`: stdin).
fn read_domain_xml(path: &Path) -> Result<String, String> {
    let mut buf = Vec::new();
    let what = || format!("--domain-xml {}", path.display());
    let res = if path == Path::new("-") {
        std::io::stdin()
            .lock()
            .take(MAX_DOMAIN_XML + 1)
            .read_to_end(&mut buf)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(MAX_DOMAIN_XML + 1).read_to_end(&mut buf))
    };
    res.map_err(|e| format!("{}: {e}", what()))?;
    if buf.len() as u64 > MAX_DOMAIN_XML {
        return Err(format!("{}: longer than {MAX_DOMAIN_XML} bytes", what()));
    }
    String::from_utf8(buf).map_err(|_| format!("{}: not UTF-8", what()))
}

/// The domain's XML and what its <metadata> says for pvsched.
fn libvirt_metadata(a: &QemuAttachArgs, domain: &str) -> Result<domain_xml::Metadata, String> {
    let xml = match &a.domain_xml {
        Some(p) => read_domain_xml(p)?,
        None => {
            let out = a.target.virsh().run(&["dumpxml", domain])?;
            if out.len() as u64 > MAX_DOMAIN_XML {
                return Err(format!(
                    "virsh dumpxml {domain}: longer than {MAX_DOMAIN_XML} bytes"
                ));
            }
            String::from_utf8(out).map_err(|_| format!("virsh dumpxml {domain}: not UTF-8"))?
        }
    };
    let meta = domain_xml::parse(&xml).map_err(|e| format!("domain {domain}'s XML: {e}"))?;
    match &meta.name {
        Some(n) if n != domain => Err(format!(
            "the domain XML is domain {n}'s, not {domain}'s: refusing to register it"
        )),
        _ => Ok(meta),
    }
}

/// The threads of a libvirt domain, through libvirt's monitor, and the
/// QEMU process libvirt recorded.
fn from_libvirt(a: &QemuAttachArgs, domain: &str) -> Result<Source, String> {
    let pid = match a.target.pid {
        Some(p) => p,
        None => {
            let file = Path::new(LIBVIRT_RUN).join(format!("{domain}.pid"));
            let text = std::fs::read_to_string(&file)
                .map_err(|e| format!("{}: {e} (is domain {domain} running?)", file.display()))?;
            text.trim()
                .parse()
                .map_err(|_| format!("{}: not a pid: {:?}", file.display(), text.trim()))?
        }
    };
    Source::ask(
        pid,
        format!("libvirt domain {domain} (libvirt's monitor)"),
        |cmd| a.target.virsh().qmp(domain, cmd, None),
    )
}

/// What went wrong, with the exit code to leave with.
pub(crate) type Failed = (Exit, String);

/// The caps file of Nova flavor `flavor` in `dir`: `None` if the flavor
/// has none (or its name cannot be a file name), else the caps it holds or
/// what is wrong with them.
fn flavor_caps(dir: &Path, flavor: &str) -> Option<Result<pvsched_policy::Caps, String>> {
    // The flavor's name is whoever created the flavor's: only names that
    // are plainly a file in `dir`, by the rule VM names follow.
    let file = dir.join(format!("{flavor}.toml"));
    (pvsched_daemon::proto::valid_name(flavor) && file.is_file())
        .then(|| crate::run::read_policy_file(&file))
}

/// The registration `a` asks for, and the region mode the domain's
/// metadata names (`None`: not said): `None` when `--require-metadata`
/// finds the domain not opted in (said on standard output).
pub(crate) fn registration(
    a: &QemuAttachArgs,
) -> Result<Option<(RegisterVm, Option<bool>)>, Failed> {
    let fail = |e: String| (Exit::Failure, e);
    let mut said = None;
    let mut caps = None;
    let (name, src) = match (&a.target.libvirt, &a.target.qmp) {
        (Some(domain), _) => {
            if !domain_name_ok(domain) {
                return Err((
                    Exit::Usage,
                    format!("--libvirt {domain:?}: not a domain name"),
                ));
            }
            let mut meta = libvirt_metadata(a, domain).map_err(fail)?;
            let name = a.target.name.clone().unwrap_or_else(|| domain.clone());
            // The domain's own <pvsched:vm> wins over its flavor's extra
            // specs, which win over a caps file for the flavor.
            meta.vm = meta.vm.take().or(meta.nova_specs.take());
            let flavor = match (&meta.vm, &meta.nova_flavor) {
                (None, Some(f)) => flavor_caps(&a.flavor_dir, f),
                _ => None,
            };
            match &meta.vm {
                // Opted in by its Nova flavor's caps file (`--policy-file`
                // replaces those caps).
                None if flavor.is_some() && a.policy_file.is_none() => {
                    caps = flavor.transpose().map_err(|e| {
                        (Exit::PolicyFile, format!("domain {domain}'s flavor: {e}"))
                    })?;
                }
                None if flavor.is_some() => {}
                None if a.require_metadata => {
                    println!(
                        "{domain}: no <pvsched:vm xmlns:pvsched=\"{}\"> in its <metadata>{}; \
                         not registered",
                        domain_xml::NS,
                        meta.nova_flavor
                            .as_ref()
                            .map_or_else(String::new, |f| format!(
                                ", no {}* extra spec in its Nova flavor {f:?} and no caps file \
                                 for it in {}",
                                domain_xml::SPEC_PREFIX,
                                a.flavor_dir.display()
                            ))
                    );
                    return Ok(None);
                }
                None => {}
                Some(vm) => {
                    said = vm.region;
                    if a.policy_file.is_none() {
                        caps = vm
                            .caps
                            .as_ref()
                            .map(|settings| {
                                pvsched_policy::Caps::default()
                                    .with_settings(
                                        settings.iter().map(|(k, v)| (k.as_str(), v.as_str())),
                                    )
                                    .map_err(|e| {
                                        (
                                            Exit::PolicyFile,
                                            format!("domain {domain}'s {}: {e}", vm.source),
                                        )
                                    })
                            })
                            .transpose()?;
                    }
                }
            }
            (name, from_libvirt(a, domain).map_err(fail)?)
        }
        (None, Some(qmp)) => {
            let name = a.target.name.clone().unwrap_or_default();
            let src = from_qmp(qmp, a.target.pid, &name).map_err(fail)?;
            (name, src)
        }
        (None, None) => return Err((Exit::Usage, "--qmp or --libvirt is needed".into())),
    };
    if src.cpus.is_empty() {
        return Err(fail(format!("{}: query-cpus-fast listed no CPU", src.what)));
    }
    let possible = src.possible.clone().unwrap_or_else(|| src.cpus.clone());
    let apics = apic_ids(&src.cpus, &possible);
    let pid = src.pid;
    let mut vcpus = Vec::new();
    for (c, apic_id) in src.cpus.iter().zip(apics) {
        let tid = c["thread-id"]
            .as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| {
                fail(format!(
                    "{}: query-cpus-fast: CPU without a thread-id: {c}",
                    src.what
                ))
            })?;
        // QEMU answers for its threads: a thread that is not one of the
        // process's own is refused here (pvschedd checks it again).
        if !Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
            return Err(fail(format!(
                "{}: vCPU thread {tid} is not a thread of QEMU process {pid}: \
                 refusing to register {name}",
                src.what
            )));
        }
        vcpus.push(Vcpu { tid, apic_id });
    }
    if let Some(p) = &a.policy_file {
        caps = Some(crate::run::read_policy_file(p).map_err(|e| (Exit::PolicyFile, e))?);
    }
    let reg = RegisterVm {
        name,
        vcpus,
        emulator_tids: if a.no_emulator { vec![] } else { vec![pid] },
        region: if a.device_region || said == Some(true) {
            Region::Reserved
        } else {
            Region::None
        },
        caps,
        pid: Some(pid),
        detach: true,
    };
    Ok(Some((reg, said)))
}

/// Runs `pvsched qemu-attach`.
pub fn main(a: &QemuAttachArgs) -> Exit {
    let reg = match registration(a) {
        Ok(Some((r, _))) => r,
        Ok(None) => return Exit::Ok,
        Err((code, e)) => {
            eprintln!("pvsched qemu-attach: {e}");
            return code;
        }
    };
    match register(a, reg, "") {
        Ok(()) => Exit::Ok,
        Err((code, e)) => {
            eprintln!("pvsched qemu-attach: {e}");
            code
        }
    }
}

/// Registers `reg` with pvschedd, detached (the registration outlives this
/// process; pvschedd ends it when QEMU exits), and says so on standard
/// output, with `how` after the caps' source.
pub(crate) fn register(a: &QemuAttachArgs, reg: RegisterVm, how: &str) -> Result<(), Failed> {
    let (pid, n) = (reg.pid.unwrap_or(0), reg.vcpus.len());
    let tids: Vec<String> = reg.vcpus.iter().map(|v| v.tid.to_string()).collect();
    let name = reg.name.clone();
    let source = if a.target.libvirt.is_some() {
        "libvirt's monitor"
    } else {
        "QMP"
    };
    // The registration itself says whether pvschedd answers: no separate
    // status round trip.
    let result = PolicyHost::Daemon(a.target.socket.socket.clone()).register(reg);
    match result.as_ref().map(Registration::registered) {
        Ok(Some(r)) => {
            println!(
                "{name}: QEMU pid {pid}, {n} vCPU thread(s) {} (from {source}) registered with \
                 pvschedd as VM {} (caps from {}{how}); it stays registered until QEMU exits",
                tids.join(","),
                r.vm_id,
                r.caps_source
            );
            Ok(())
        }
        Ok(None) => Err((
            Exit::Failure,
            format!("{name}: pvschedd did not register it"),
        )),
        Err(e) => {
            let code = match &e {
                HostError::Daemon(e) => crate::daemon_cli::exit_for(e),
                _ => Exit::Failure,
            };
            Err((code, format!("{name}: {e}")))
        }
    }
}

/// The part of a libvirt domain XML pvsched reads: the domain's name and
/// its `<metadata><pvsched:vm>`. The XML is whoever defined the domain's,
/// so it is parsed by `roxmltree` (no DTD, bounded node count) and every
/// pvsched element and attribute is checked; the caps' keys and values are
/// checked afterwards by the caps' own parser, as `pvsched vm set`'s are.
mod domain_xml {
    use roxmltree::{Document, Node, ParsingOptions};

    /// The namespace of pvsched's libvirt metadata.
    pub const NS: &str = "https://pvsched.dev/xmlns/libvirt/1";
    /// The namespaces of the metadata Nova's libvirt driver writes
    /// (`<nova:instance>`, with `<nova:flavor name="...">`).
    pub const NOVA_NS: [&str; 2] = [
        "http://openstack.org/xmlns/libvirt/nova/1.0",
        "http://openstack.org/xmlns/libvirt/nova/1.1",
    ];
    /// Most XML nodes read from one domain (libvirt's have a few hundred).
    const MAX_NODES: u32 = 100_000;
    /// Longest value of one cap.
    const MAX_VALUE: usize = 64;

    /// What the domain XML says for pvsched.
    #[derive(Debug, Default, PartialEq, Eq)]
    pub struct Metadata {
        /// The domain's `<name>`.
        pub name: Option<String>,
        /// Its `<metadata><pvsched:vm>`, if any.
        pub vm: Option<Vm>,
        /// The flavor Nova started it with (`<metadata><nova:instance>
        /// <nova:flavor name="...">`), if Nova did.
        pub nova_flavor: Option<String>,
        /// That flavor's `pvsched:*` extra specs (Nova 32.0, 2025.2, and
        /// later write a flavor's extra specs into `<nova:flavor>`), if it
        /// has any.
        pub nova_specs: Option<Vm>,
    }

    /// `<pvsched:vm region="device|none">`, optionally with
    /// `<pvsched:caps KEY="VALUE" .../>` inside; or the same from a Nova
    /// flavor's `pvsched:*` extra specs.
    #[derive(Debug, Default, PartialEq, Eq)]
    pub struct Vm {
        /// `region="device"` (`Some(true)`): the device serves
        /// pvschedd's region; `"none"`: caps only; `None`: not said
        /// (`qemu-attach`: none; `attach`: device).
        pub region: Option<bool>,
        /// The caps element's attributes, in order.
        pub caps: Option<Vec<(String, String)>>,
        /// Where it was read, for messages.
        pub source: &'static str,
    }

    /// The prefix of pvsched's Nova flavor extra specs.
    pub const SPEC_PREFIX: &str = "pvsched:";

    /// An element's name as written (`prefix:name`), for messages.
    fn qname(n: Node) -> String {
        match n.tag_name().namespace().and_then(|ns| n.lookup_prefix(ns)) {
            Some(p) if !p.is_empty() => format!("{p}:{}", n.tag_name().name()),
            _ => n.tag_name().name().to_owned(),
        }
    }

    fn elements<'a, 'i>(n: Node<'a, 'i>) -> impl Iterator<Item = Node<'a, 'i>> {
        n.children().filter(Node::is_element)
    }

    /// The child element `name` (no namespace) of `n`.
    fn child<'a, 'i>(n: Node<'a, 'i>, name: &str) -> Option<Node<'a, 'i>> {
        elements(n).find(|c| c.tag_name().namespace().is_none() && c.tag_name().name() == name)
    }

    /// Parses `xml`: the domain's name and pvsched metadata, or what is
    /// wrong with it.
    pub fn parse(xml: &str) -> Result<Metadata, String> {
        let opts = ParsingOptions {
            allow_dtd: false,
            nodes_limit: MAX_NODES,
            ..ParsingOptions::default()
        };
        let doc = Document::parse_with_options(xml, opts)
            .map_err(|e| format!("not a well-formed XML document: {e}"))?;
        let root = doc.root_element();
        if root.tag_name().name() != "domain" || root.tag_name().namespace().is_some() {
            return Err(format!(
                "the root element is <{}>, not a libvirt <domain>",
                qname(root)
            ));
        }
        let name = child(root, "name").map(|n| n.text().unwrap_or("").trim().to_owned());
        let mut vm = None;
        let mut nova_flavor = None;
        let mut nova_specs = None;
        for m in child(root, "metadata").into_iter().flat_map(elements) {
            let ns = m.tag_name().namespace();
            if ns.is_some_and(|ns| NOVA_NS.contains(&ns)) && m.tag_name().name() == "instance" {
                let flavor = elements(m)
                    .find(|f| f.tag_name().namespace() == ns && f.tag_name().name() == "flavor");
                nova_flavor = flavor.and_then(|f| f.attribute("name")).map(str::to_owned);
                if let Some(f) = flavor {
                    nova_specs = read_specs(f)?;
                }
            }
            if ns != Some(NS) {
                continue;
            }
            if m.tag_name().name() != "vm" {
                return Err(format!(
                    "<metadata>: unknown element <{}> (known: vm)",
                    qname(m)
                ));
            }
            if vm.is_some() {
                return Err(format!("two <{}> in <metadata>", qname(m)));
            }
            vm = Some(read_vm(m)?);
        }
        Ok(Metadata {
            name,
            vm,
            nova_flavor,
            nova_specs,
        })
    }

    /// The `pvsched:*` extra specs of a `<nova:flavor>`
    /// (`<nova:extraSpecs><nova:extraSpec name="KEY">VALUE`): `None`
    /// without any; `pvsched:region` is the region mode, every other key a
    /// cap. Other extra specs are Nova's and others' business.
    fn read_specs(flavor: Node) -> Result<Option<Vm>, String> {
        let ns = flavor.tag_name().namespace();
        let mine =
            |n: &Node, name: &str| n.tag_name().namespace() == ns && n.tag_name().name() == name;
        let mut vm = Vm {
            source: "its Nova flavor's extra specs",
            ..Vm::default()
        };
        let mut caps = Vec::new();
        let mut any = false;
        for specs in elements(flavor).filter(|n| mine(n, "extraSpecs")) {
            for spec in elements(specs).filter(|n| mine(n, "extraSpec")) {
                let Some(key) = spec
                    .attribute("name")
                    .and_then(|k| k.strip_prefix(SPEC_PREFIX))
                else {
                    continue;
                };
                any = true;
                let val = spec.text().unwrap_or("").trim();
                if val.len() > MAX_VALUE || val.chars().any(char::is_control) {
                    return Err(format!(
                        "extra spec {SPEC_PREFIX}{key}: not a cap value (at most {MAX_VALUE} \
                         characters, no control characters)"
                    ));
                }
                match (key, val) {
                    ("region", "device") => vm.region = Some(true),
                    ("region", "none") => vm.region = Some(false),
                    ("region", r) => {
                        return Err(format!(
                            "extra spec {SPEC_PREFIX}region={r:?}: region is \"device\" or \"none\""
                        ));
                    }
                    _ => caps.push((key.to_owned(), val.to_owned())),
                }
            }
        }
        if !caps.is_empty() {
            vm.caps = Some(caps);
        }
        Ok(any.then_some(vm))
    }

    /// `<pvsched:vm>` and its `<pvsched:caps>`.
    fn read_vm(v: Node) -> Result<Vm, String> {
        let q = qname(v);
        let mut vm = Vm {
            source: "<pvsched:caps>",
            ..Vm::default()
        };
        for a in v.attributes() {
            match (a.namespace(), a.name(), a.value()) {
                (None, "region", "device") => vm.region = Some(true),
                (None, "region", "none") => vm.region = Some(false),
                (None, "region", r) => {
                    return Err(format!(
                        "<{q} region={r:?}>: region is \"device\" or \"none\""
                    ));
                }
                (_, n, _) => return Err(format!("<{q}>: unknown attribute {n} (known: region)")),
            }
        }
        for c in elements(v) {
            let cq = qname(c);
            if c.tag_name().namespace() != Some(NS) || c.tag_name().name() != "caps" {
                return Err(format!("<{q}>: unknown element <{cq}> (known: caps)"));
            }
            if vm.caps.is_some() {
                return Err(format!("two <{cq}> in <{q}>"));
            }
            if let Some(inner) = elements(c).next() {
                return Err(format!("<{}> inside <{cq}>: not expected", qname(inner)));
            }
            let mut caps = Vec::new();
            for a in c.attributes() {
                let (n, val) = (a.name(), a.value());
                if a.namespace().is_some() {
                    return Err(format!("<{cq}>: attribute {n}: caps take no prefix"));
                }
                if val.len() > MAX_VALUE || val.chars().any(char::is_control) {
                    return Err(format!(
                        "<{cq}>: {n}: not a cap value (at most {MAX_VALUE} characters, \
                         no control characters)"
                    ));
                }
                caps.push((n.to_owned(), val.to_owned()));
            }
            vm.caps = Some(caps);
        }
        Ok(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::io::{BufRead, BufReader, Write};

    /// `--qmp` needs `--pid`, and a QMP socket whose peer is not that
    /// process (a socket someone else bound at the path) is refused before
    /// anything is asked of it.
    #[test]
    fn a_qmp_socket_is_trusted_only_for_the_process_named() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: QemuAttachArgs,
        }
        use clap::Parser;
        let e = Cli::try_parse_from(["qemu-attach", "--qmp", "/x.sock", "--name", "vm"])
            .err()
            .expect("--qmp without --pid refused");
        assert!(e.to_string().contains("--pid"), "{e}");
        Cli::try_parse_from([
            "qemu-attach",
            "--qmp",
            "/x.sock",
            "--name",
            "vm",
            "--pid",
            "7",
        ])
        .expect("--qmp with --pid");
        Cli::try_parse_from(["qemu-attach", "--libvirt", "web-1"]).expect("--libvirt alone");

        let dir = std::env::temp_dir().join(format!("pvsched-qmp-peer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&path);
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // A QMP server of this (test) process: greeting, then an answer
        // to every command.
        let t = std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = s.write_all(b"{\"QMP\":{}}\n");
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    let _ = s.write_all(b"{\"return\":[]}\n");
                    line.clear();
                }
            }
        });
        let other = std::process::id() + 1;
        let e = from_qmp(&path, Some(other), "vm").err().expect("refused");
        assert!(
            e.contains(&format!("served by process {}", std::process::id()))
                && e.contains(&format!("not QEMU {other}")),
            "{e}"
        );
        drop(t);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A domain XML as libvirt formats it, with pvsched's metadata.
    const DOMAIN: &str = r#"<domain type='qemu' id='2' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>web-1</name>
  <uuid>5684e521-2982-4c2c-8bd2-e6de55ae91a4</uuid>
  <metadata>
    <other:thing xmlns:other="https://example.org/other"><other:x a="1"/></other:thing>
    <pvsched:vm xmlns:pvsched="https://pvsched.dev/xmlns/libvirt/1" region="device">
      <!-- caps as pvsched vm set takes them -->
      <pvsched:caps max_rt_prio="3" halt_boost="nice" allow_rt="true"/>
    </pvsched:vm>
  </metadata>
  <memory unit='KiB'>65536</memory>
  <qemu:commandline>
    <qemu:arg value='{&quot;driver&quot;:&quot;vfio-user-pci&quot;}'/>
  </qemu:commandline>
</domain>
"#;

    #[test]
    fn domain_xml_metadata_gives_the_caps_and_region() {
        let m = domain_xml::parse(DOMAIN).unwrap();
        assert_eq!(m.name.as_deref(), Some("web-1"));
        let vm = m.vm.unwrap();
        assert_eq!(vm.region, Some(true));
        let caps = vm.caps.unwrap();
        assert_eq!(
            caps,
            [
                ("max_rt_prio", "3"),
                ("halt_boost", "nice"),
                ("allow_rt", "true")
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let c = pvsched_policy::Caps::default()
            .with_settings(caps.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .unwrap();
        assert_eq!(c.max_rt_prio, 3);
        // Another prefix for the same namespace is the same element; a
        // domain without it has no pvsched metadata.
        let other = DOMAIN
            .replace("pvsched:", "p:")
            .replace("xmlns:pvsched", "xmlns:p");
        assert_eq!(
            domain_xml::parse(&other)
                .unwrap()
                .vm
                .unwrap()
                .caps
                .unwrap()
                .len(),
            3
        );
        let plain = "<domain><name>a&amp;b</name><metadata/></domain>";
        let m = domain_xml::parse(plain).unwrap();
        assert_eq!((m.name.as_deref(), m.vm), (Some("a&b"), None));
        // Same element name in another namespace: not ours.
        let foreign = DOMAIN.replace(
            "https://pvsched.dev/xmlns/libvirt/1",
            "https://example.org/x",
        );
        assert_eq!(domain_xml::parse(&foreign).unwrap().vm, None);
    }

    #[test]
    fn bad_domain_xml_and_bad_caps_are_refused_with_the_reason() {
        for (xml, want) in [
            ("<domain><name>x</name>", "not a well-formed XML document"),
            ("<domain></domian>", "not a well-formed XML document"),
            ("<!DOCTYPE d [<!ENTITY e 'x'>]><domain/>", "DTD"),
            ("<network/>", "not a libvirt <domain>"),
            ("<domain/><domain/>", "not a well-formed XML document"),
            (
                "<domain><metadata><p:vm/></metadata></domain>",
                "unknown namespace prefix",
            ),
            ("<domain a='&bogus;'/>", "unknown entity"),
            ("<domain a='1' a='2'/>", "already defined"),
            ("<domain a=1/>", "not a well-formed XML document"),
        ] {
            let e = domain_xml::parse(xml).unwrap_err();
            assert!(e.contains(want), "{xml}: {e}");
        }
        let meta = |inner: &str| {
            format!(
                "<domain><metadata><pvsched:vm xmlns:pvsched='{}'{inner}</pvsched:vm></metadata></domain>",
                domain_xml::NS
            )
        };
        for (inner, want) in [
            (" region='guest'>", "region is"),
            (" cpu='1'>", "unknown attribute cpu"),
            ("><pvsched:cap/>", "unknown element"),
            ("><pvsched:caps/><pvsched:caps/>", "two <pvsched:caps>"),
            ("><pvsched:caps><x/></pvsched:caps>", "not expected"),
            ("><pvsched:caps max_rt_prio='1&#10;2'/>", "not a cap value"),
        ] {
            let e = domain_xml::parse(&meta(inner)).unwrap_err();
            assert!(e.contains(want), "{inner}: {e}");
        }
        // Keys and values are the caps' own: checked as `pvsched vm set` does.
        for bad in [
            ("bogus", "1"),
            ("max_rt_prio", "high"),
            ("nice_floor", "-40"),
        ] {
            let e = pvsched_policy::Caps::default()
                .with_settings([bad])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(bad.0) || e.contains("nice_floor"),
                "{bad:?}: {e}"
            );
        }
    }

    /// Nova's `<nova:instance><nova:flavor name>` (either namespace
    /// version) names the flavor; its caps file, if there is one, gives the
    /// caps; a flavor name that is not plainly a file name is never looked
    /// up.
    #[test]
    fn a_nova_flavor_maps_to_its_caps_file() {
        let nova = |ns: &str, flavor: &str| {
            format!(
                "<domain><name>instance-0000abcd</name><metadata>\
                 <nova:instance xmlns:nova='{ns}'><nova:name>web</nova:name>\
                 <nova:flavor name='{flavor}'><nova:vcpus>2</nova:vcpus></nova:flavor>\
                 </nova:instance></metadata></domain>"
            )
        };
        for ns in domain_xml::NOVA_NS {
            let m = domain_xml::parse(&nova(ns, "rt.small")).unwrap();
            assert_eq!(m.nova_flavor.as_deref(), Some("rt.small"));
            assert_eq!(m.vm, None);
        }
        let other = nova("http://openstack.org/xmlns/libvirt/nova/9.9", "rt.small");
        assert_eq!(domain_xml::parse(&other).unwrap().nova_flavor, None);
        let dir = std::env::temp_dir().join(format!("pvsched-flavors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rt.small.toml"), "max_rt_prio = 3\n").unwrap();
        std::fs::write(dir.join("bad.toml"), "max_rt_prio = 500\n").unwrap();
        let caps = flavor_caps(&dir, "rt.small").unwrap().unwrap();
        assert_eq!(caps.max_rt_prio, 3);
        assert!(flavor_caps(&dir, "bad").unwrap().is_err());
        for unplain in [
            "m1.small",
            "../rt.small",
            ".hidden",
            "a b",
            "",
            &"x".repeat(65),
        ] {
            assert!(flavor_caps(&dir, unplain).is_none(), "{unplain:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A flavor's extra specs as Nova 32.0 (2025.2) writes them into the
    /// domain XML (the shape of nova/virt/libvirt/config.py's
    /// LibvirtConfigGuestMetaNovaFlavorExtraSpecs): `pvsched:region` is
    /// the region mode, other `pvsched:*` keys are caps, other keys are
    /// not pvsched's; a flavor with none of them has no opinion.
    #[test]
    fn nova_flavor_extra_specs_opt_in_with_their_caps() {
        let nova = |specs: &str| {
            format!(
                "<domain><name>instance-0000abcd</name><metadata>\
                 <nova:instance xmlns:nova='http://openstack.org/xmlns/libvirt/nova/1.1'>\
                 <nova:flavor name='rt.small' id='7'><nova:memory>2048</nova:memory>\
                 <nova:vcpus>2</nova:vcpus><nova:extraSpecs>{specs}</nova:extraSpecs>\
                 </nova:flavor></nova:instance></metadata></domain>"
            )
        };
        let spec = |k: &str, v: &str| format!("<nova:extraSpec name='{k}'>{v}</nova:extraSpec>");
        let m = domain_xml::parse(&nova(&format!(
            "{}{}{}{}",
            spec("hw:cpu_policy", "dedicated"),
            spec("pvsched:region", "device"),
            spec("pvsched:max_rt_prio", "3"),
            spec("pvsched:halt_boost", " nice "),
        )))
        .unwrap();
        let vm = m.nova_specs.expect("opted in");
        assert_eq!(vm.region, Some(true));
        assert_eq!(
            vm.caps.unwrap(),
            [("max_rt_prio", "3"), ("halt_boost", "nice")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(m.vm, None);
        // Opted in with defaults; no pvsched key: no opinion.
        let m = domain_xml::parse(&nova(&spec("pvsched:region", "none"))).unwrap();
        assert_eq!(m.nova_specs.unwrap().region, Some(false));
        let m = domain_xml::parse(&nova(&spec("hw:mem_page_size", "large"))).unwrap();
        assert_eq!(m.nova_specs, None);
        let m = domain_xml::parse(&nova("")).unwrap();
        assert_eq!(
            (m.nova_flavor.as_deref(), m.nova_specs),
            (Some("rt.small"), None)
        );
        for (bad, want) in [
            (spec("pvsched:region", "guest"), "region is"),
            (
                spec("pvsched:max_rt_prio", &"9".repeat(65)),
                "not a cap value",
            ),
        ] {
            let e = domain_xml::parse(&nova(&bad)).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    /// Every prefix of a valid domain XML, and bytes flipped in it, give
    /// an answer or an error: never a panic.
    #[test]
    fn hostile_domain_xml_never_panics() {
        for end in 0..=DOMAIN.len() {
            if DOMAIN.is_char_boundary(end) {
                let _ = domain_xml::parse(&DOMAIN[..end]);
            }
        }
        let specials = ['<', '>', '&', '"', '\'', '/', '=', ':', ';', '#', ' ', 'é'];
        let chars: Vec<char> = DOMAIN.chars().collect();
        for i in 0..chars.len() {
            for &c in &specials {
                let mut v = chars.clone();
                v[i] = c;
                let _ = domain_xml::parse(&v.iter().collect::<String>());
            }
        }
        let deep = "<domain>".to_string() + &"<a>".repeat(10_000);
        assert!(domain_xml::parse(&deep).is_err());
        let many = format!("<domain>{}</domain>", "<a/>".repeat(200_000));
        assert!(domain_xml::parse(&many).unwrap_err().contains("nodes"));
    }

    #[test]
    fn apic_ids_follow_the_x86_topology_encoding() {
        // 2 sockets x 3 cores x 2 threads: cores take 2 bits, threads 1.
        let cpu = |s: u64, c: u64, t: u64| json!({"props": {"socket-id": s, "core-id": c, "thread-id": t}});
        let all: Vec<Value> = (0..2)
            .flat_map(|s| (0..3).flat_map(move |c| (0..2).map(move |t| cpu(s, c, t))))
            .collect();
        let ids = apic_ids(&all, &all);
        assert_eq!(&ids[..6], &[0, 1, 2, 3, 4, 5]);
        assert_eq!(&ids[6..], &[8, 9, 10, 11, 12, 13]);
        // No properties: the CPU index.
        let bare = vec![json!({"cpu-index": 0}), json!({"cpu-index": 1})];
        assert_eq!(apic_ids(&bare, &bare), vec![0, 1]);
    }
}
