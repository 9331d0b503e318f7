//! The `compute-worker` binary, built inside this package so end-to-end tests can start real
//! worker processes (and kill them) by path (`CARGO_BIN_EXE_test-worker`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_tests::end_with_parent();
    compute_workers::cli::main().await
}
