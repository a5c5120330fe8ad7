//! The transports' integration tests (vfio-user and QEMU's multi-process
//! proxy, the sandboxed device binary, hostile peers), in one test binary:
//! every test binary links the whole crate graph, so one link instead of one
//! per file. Tests of different modules run side by side (`--test-threads`)
//! like tests of one module: each owns its processes, threads and temporary
//! files.

mod common;
#[path = "support/slot_dump_check.rs"]
mod slot_dump_check;
#[path = "support/vfio_client.rs"]
mod vfio_client;
#[path = "support/vfio_raw.rs"]
mod vfio_raw;

mod device_binary;
mod mpqemu_hostile;
mod mpqemu_scripted_peer;
mod sandboxed_device;
mod vfio_user_binary;
mod vfio_user_hostile;
mod vfio_user_server;
