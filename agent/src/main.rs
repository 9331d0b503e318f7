//! `compute-agent`: the node daemon (`docs/agent.md`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_agent::cli::main().await
}
