//! phalanx's Rust core: the quorum engine, the lighthouse, the per-group manager
//! server, the state transfer of checkpoint-free recovery, and (with the `python`
//! feature) their Python bindings, `phalanx._core`.

pub mod auth;
pub mod cli;
pub mod datagram;
pub mod delta;
pub mod door;
mod error;
pub mod fdlimit;
pub mod frames;
pub mod gate;
/// Files import downward only, never in a circle: a test that reads the whole crate.
#[cfg(test)]
mod layers;
pub mod lighthouse;
/// Load generators for the benchmarks (`phalanx._core._testing`).
#[cfg(feature = "testing")]
pub mod loadgen;
pub mod manager;
pub mod proto;
pub mod quorum;
pub mod server;
mod sockopt;
pub mod state;
pub mod store;
mod transport;
pub mod validate;

pub use error::{Error, ErrorKind};

#[cfg(feature = "python")]
mod python;

/// Many small, short-lived allocations per request (strings, frames); mimalloc serves
/// them with less contention than the system allocator. Its v2 line (Cargo.toml): the
/// v3 line of libmimalloc-sys 0.1.49 (mimalloc 3.3.2) read freed per-thread state when
/// the thread that first called into the extension had ended, a segfault in the next
/// thread to call (tests/test_threads.py).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
