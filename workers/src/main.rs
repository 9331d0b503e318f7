//! `compute-worker`: see [`compute_workers::cli`].

/// mimalloc: a request allocates thousands of small objects (parsed documents, values, rows),
/// which glibc's malloc serves at a third of the process's CPU (`docs/performance.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    compute_workers::cli::main().await
}
