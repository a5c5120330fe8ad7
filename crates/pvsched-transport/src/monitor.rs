//! What a transport saw, shared with observers on other threads (the slot
//! dumper of the `pvsched-device` binary, tests).
//!
//! The transport updates it after every message; readers take a copy.

use crate::backend::TransportDevice;
use pvsched_device::RegionView;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};

/// Observable device and transport state.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MonitorState {
    /// STATUS register now.
    pub status: u32,
    /// ERROR register now.
    pub error: u32,
    /// GENERATION register now (counts successful DRIVER_OKs).
    pub generation: u32,
    /// Every STATUS value observed after a message.
    pub statuses_seen: BTreeSet<u32>,
    /// Every non-zero ERROR value observed after a message.
    pub errors_seen: BTreeSet<u32>,
    /// Number of times STATUS went from non-zero to 0 (driver or QEMU reset).
    pub resets_seen: u64,
    /// Messages handled, by command name.
    pub messages: BTreeMap<String, u64>,
    /// Messages that failed to parse (logged, answered if a reply was due).
    pub malformed: u64,
    /// BAR accesses that hit no decoded BAR.
    pub stray_bar_accesses: u64,
    /// Whether the proxy closed the connection.
    pub disconnected: bool,
    /// View onto the attached region (not serialised).
    #[serde(skip)]
    pub view: Option<RegionView>,
}

/// Shared monitor; cheap to lock (the transport holds it briefly per message).
#[derive(Debug, Default)]
pub struct TransportMonitor {
    state: Mutex<MonitorState>,
}

impl TransportMonitor {
    /// A monitor with nothing observed.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, MonitorState> {
        // A panicking observer must not take the transport down with it.
        pvsched_util::lock(&self.state)
    }

    /// Copy of the current state.
    pub fn snapshot(&self) -> MonitorState {
        self.lock().clone()
    }

    /// Record a handled message and the device's state after it.
    pub fn after_message(&self, name: &str, dev: &dyn TransportDeviceView) {
        let mut s = self.lock();
        *s.messages.entry(name.to_owned()).or_default() += 1;
        let status = dev.status();
        if s.status != 0 && status == 0 {
            s.resets_seen += 1;
        }
        s.status = status;
        s.error = dev.error();
        s.generation = dev.generation();
        s.statuses_seen.insert(status);
        if s.error != 0 {
            let e = s.error;
            s.errors_seen.insert(e);
        }
        s.view = dev.region_view().filter(RegionView::is_attached);
    }

    /// Record a malformed message.
    pub fn malformed(&self) {
        self.lock().malformed += 1;
    }

    /// Record a BAR access that hit no decoded BAR.
    pub fn stray_bar_access(&self) {
        self.lock().stray_bar_accesses += 1;
    }

    /// Record the end of the connection.
    pub fn disconnected(&self) {
        self.lock().disconnected = true;
    }
}

/// The read-only part of [`TransportDevice`] the monitor needs (object safe).
pub trait TransportDeviceView {
    /// STATUS.
    fn status(&self) -> u32;
    /// ERROR.
    fn error(&self) -> u32;
    /// GENERATION.
    fn generation(&self) -> u32;
    /// Attached region.
    fn region_view(&self) -> Option<RegionView>;
}

impl<D: TransportDevice> TransportDeviceView for D {
    fn status(&self) -> u32 {
        TransportDevice::status(self)
    }
    fn error(&self) -> u32 {
        TransportDevice::error(self)
    }
    fn generation(&self) -> u32 {
        TransportDevice::generation(self)
    }
    fn region_view(&self) -> Option<RegionView> {
        TransportDevice::region_view(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::TransportDevice;
    use pvsched_abi as abi;
    use pvsched_device::{BarIndex, DeviceConfig, NullSink, PciDevice, PvschedDevice};
    use std::sync::Arc;

    #[test]
    fn records_statuses_and_resets() {
        let mut d = PvschedDevice::new(DeviceConfig::new(1), Arc::new(NullSink)).expect("device");
        let m = TransportMonitor::new();
        m.after_message("bar_write", &d);
        d.write_bar(
            BarIndex(0),
            u64::from(abi::REG_STATUS),
            &abi::STATUS_ACKNOWLEDGE.to_le_bytes(),
        );
        m.after_message("bar_write", &d);
        TransportDevice::reset(&mut d);
        m.after_message("device_reset", &d);
        m.malformed();
        let s = m.snapshot();
        assert_eq!(
            s.statuses_seen.iter().copied().collect::<Vec<_>>(),
            vec![0, 1]
        );
        assert_eq!(s.resets_seen, 1);
        assert_eq!(s.status, 0);
        assert_eq!(s.messages.get("bar_write"), Some(&2));
        assert_eq!(s.malformed, 1);
        assert!(s.view.is_none());
    }
}
