use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use compute_api::cli::{self, Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => cli::serve(*args).await,
        Command::Dev(args) => cli::dev(args).await,
        Command::Migrate(args) => cli::migrate(args).await,
        Command::Schema => {
            let _ = write!(std::io::stdout().lock(), "{}", compute_api::graph::sdl());
            Ok(())
        }
        Command::Token(args) => cli::token(args).map(|t| {
            let _ = writeln!(std::io::stdout().lock(), "{t}");
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let detail = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            let _ = writeln!(std::io::stderr().lock(), "error: {e}{detail}");
            ExitCode::FAILURE
        }
    }
}
