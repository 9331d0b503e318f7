//! `compute-worker`: see [`compute_workers::cli`].

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_workers::cli::main().await
}
