//! The `compute-api` binary, built inside this package so end-to-end tests can start real API
//! processes (and kill them) by path (`CARGO_BIN_EXE_test-api`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_tests::end_with_parent();
    compute_api::cli::main().await
}
