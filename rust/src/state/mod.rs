//! Checkpoint-free recovery's data path. Every rank serves the state of its last
//! committed step straight from the memory that holds it (`server`); a healing rank
//! stripes the download over all up-to-date peers at once, straight into its own
//! tensors (`fetch`, one connection of it in `link`). The framing (`wire`) and the
//! stripe plan (`plan`) are pure; `baseline` is the raw-TCP yardstick of the benchmark.
//!
//! Bulk bytes go over plain TCP with a small binary framing rather than gRPC: a chunk
//! is read from the socket directly into its destination, with no message buffer and
//! no second copy in between.

pub mod baseline;
pub mod fetch;
mod link;
pub mod plan;
pub mod server;
pub mod wire;

pub use fetch::{fetch_manifest, fetch_state, DestRegion, FetchOptions, FetchStats};
pub use server::{Corruption, ServerOptions, SourceRegion, StateServer};
