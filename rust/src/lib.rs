//! phalanx's Rust core: the quorum engine, the lighthouse, the per-group manager
//! server, and (with the `python` feature) their Python bindings, `phalanx._core`.

pub mod quorum;
