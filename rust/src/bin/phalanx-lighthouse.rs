//! The standalone lighthouse. See `phalanx-lighthouse --help`.

use std::io::IsTerminal;

use clap::Parser;
use phalanx::cli::{run_lighthouse, LighthouseArgs};

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = LighthouseArgs::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("cannot start the tokio runtime");
    match runtime.block_on(run_lighthouse(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("phalanx-lighthouse: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
