//! What the device tells the host policy: [`PolicySink`].
//!
//! The device calls the sink from the thread that handles the guest's
//! register access, so implementations must be quick and must not call back
//! into the device.

use crate::region::RegionInfo;

/// Receiver of device events for the host policy.
///
/// Every method has a default that does nothing.
///
/// ```
/// use pvsched_device::{PolicySink, RegionInfo};
/// use std::sync::atomic::{AtomicU32, Ordering};
///
/// #[derive(Default)]
/// struct CountKicks(AtomicU32);
/// impl PolicySink for CountKicks {
///     fn kick(&self, _slot: u32) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
/// }
/// let sink = CountKicks::default();
/// sink.kick(0);
/// assert_eq!(sink.0.load(Ordering::Relaxed), 1);
/// ```
pub trait PolicySink: Send + Sync {
    /// A region was attached at DRIVER_OK (or re-attached after guest
    /// memory was remapped or the device was restored). Take
    /// [`PvschedDevice::region_view`](crate::PvschedDevice::region_view) to
    /// access it.
    fn region_attached(&self, _region: &RegionInfo) {}

    /// The region was detached (reset, failure, back end gone). Views stop
    /// working before this is called.
    fn region_detached(&self) {}

    /// The guest wrote `slot` (a valid slot index) to KICK while DRIVER_OK.
    fn kick(&self, _slot: u32) {}

    /// The device serves `n` vCPU slots (called once at device creation).
    fn vcpu_count(&self, _n: u32) {}

    /// `HOST_F_*` bits to publish in the region header at attach
    /// (for example `HOST_F_POLICY_ACTIVE` when a policy reads the slots).
    fn host_flags(&self) -> u32 {
        0
    }
}

/// A sink that ignores every event.
#[derive(Clone, Copy, Debug, Default)]
pub struct NullSink;

impl PolicySink for NullSink {}
