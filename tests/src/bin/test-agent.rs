//! The `compute-agent` binary, built inside this package so end-to-end tests can start real node
//! daemons (and SIGKILL them) by path (`CARGO_BIN_EXE_test-agent`): the same `main` as
//! `agent/src/main.rs`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_tests::end_with_parent();
    compute_agent::cli::main().await
}
