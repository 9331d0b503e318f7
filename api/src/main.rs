//! The `compute-api` binary: see `compute_api::cli`.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_api::cli::main().await
}
