//! The results page is generated from the benchmarks' JSON: a report type
//! that can be read back renders its own markdown.
//!
//! A stand-in with the lead's signature until main carries the real
//! module (merge takes main's).

/// A report that renders itself as markdown tables.
pub trait Render: serde::de::DeserializeOwned {
    /// The report as markdown.
    fn markdown(&self) -> String;
}
