//! pvsched host policy: the pure, deterministic Rust reference model of the
//! BPF policy in `bpf-policy/` (docs/operating.md, "What the policy does").
//!
//! - [`caps`]: per-VM admin caps and policy knobs, parsed from TOML
//!   (`caps.toml`), converted to the BPF map record by the agent.
//! - [`event`]: trace events, decisions and the shared constants
//!   (`PVS_EV_*`, `PVS_R_*`, `PVS_ST_*` of `bpf-policy/intf.h`).
//! - [`intf`]: the BPF ↔ userspace records (`struct pvs_*` of
//!   `bpf-policy/intf.h`), the agent's map values and the model's state.
//! - [`model`]: the state machine, step for step the same as the BPF code,
//!   driven by event traces. The agent's differential test runs the same
//!   generated traces through the BPF program (`BPF_PROG_TEST_RUN`) and this
//!   model and requires identical decisions.
//!
//! ```
//! use pvsched_policy::{Caps, Event, GuestFields, VmModel};
//! let caps = Caps::default();
//! let mut vm = VmModel::new(caps, &[100, 101], &[0, 1]);
//! let fifo = GuestFields { policy: pvsched_abi::POLICY_FIFO, rt_prio: 2, ..Default::default() };
//! vm.step(0, Event::GuestWrite { vcpu: 0, guest: fifo });
//! let d = vm.step(1_000, Event::SwitchOut { vcpu: 0, preempted: true });
//! assert_eq!(d[0].kind, pvsched_abi::BOOST_RT);
//! ```

pub mod caps;
pub mod event;
pub mod intf;
pub mod model;

pub use caps::{BoostKind, Caps, CapsError, CapsLimit, CoschedUs, KickPairs, WaitOn};
pub use event::{Decision, Event, GuestFields};
pub use intf::PvsVcpu;
pub use model::VmModel;
