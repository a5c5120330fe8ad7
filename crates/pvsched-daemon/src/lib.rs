//! pvschedd: the one privileged pvsched process on a host. It loads the BPF
//! policy once ([`pvsched_agent::Agent`]), serves VMMs on a UNIX socket
//! (`/run/pvsched/pvschedd.sock`), registers their VMs after checking that
//! every thread belongs to the registering process, gives each VM its own
//! region map (passed to its VMM with `SCM_RIGHTS`), applies per-VM caps
//! within an operator maximum (live changes with `pvsched vm set`), and
//! exports status and Prometheus metrics. docs/operating.md is the
//! operator's guide.
//!
//! - [`proto`]: the wire protocol (JSON over `SOCK_SEQPACKET`).
//! - [`wire`]: the socket calls.
//! - [`config`]: `pvschedd.toml` and the per-VM caps files.
//! - [`server`]: the socket side: the epoll loop, clients and their reply
//!   queues, signals, the VMMs' pidfds; who may ask for what.
//! - `registry` (private): the VMs: registration and its checks, caps,
//!   reservations, unregistration, and status snapshots as plain data.
//! - [`metrics`]: Prometheus text and its HTTP endpoint.
//! - [`persist`]: what outlives a pvschedd process: the ledger of boosted
//!   threads and the detached registrations.
//! - [`client`]: what VMMs and the `pvsched` CLI use (a VMM links it
//!   through `pvsched-host`, which puts pvschedd and the in-process agent
//!   behind one interface).
//!
//! If pvschedd dies (SIGKILL, OOM, panic → abort), its guardian process
//! ([`pvsched_agent::guardian`]) restores every boosted thread; if the
//! guardian dies with it, the ledger file it restores from is read again by
//! `pvschedd --restore` (the unit's `ExecStopPost=`) and by the next
//! pvschedd before it loads the policy.

pub mod cli;
pub mod client;
pub mod config;
pub mod http;
pub mod metrics;
pub mod persist;
pub mod proto;
mod registry;
pub mod server;
pub mod sockdiag;
pub mod wire;

pub use client::{Client, ClientError, RegionMap, Registered, Session};
pub use config::Config;
pub use proto::{ErrorKind, RegisterVm};
pub use server::Server;
