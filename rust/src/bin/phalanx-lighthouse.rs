//! The standalone lighthouse. See `phalanx-lighthouse --help`.

use clap::Parser;
use phalanx::cli::{log_to_stderr, run_lighthouse, LighthouseArgs};

fn main() -> std::process::ExitCode {
    log_to_stderr();
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
