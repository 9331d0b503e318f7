//! Runs a command with `DATABASE_URL` pointing at a throwaway, migrated PostgreSQL, then stops
//! the server and removes its files. Used by `scripts/sqlx-prepare` to check every static
//! statement against the migrations and write `.sqlx/`; needs nothing but the server binaries.
//!
//! ```text
//! cargo run -p compute-embedded-pg --bin with-throwaway-postgres -- cargo check --workspace
//! ```

use std::io::Write;
use std::process::ExitCode;

use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres};

const DATABASE: &str = "compute";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((program, rest)) = args.split_first() else {
        let _ = writeln!(
            std::io::stderr(),
            "usage: with-throwaway-postgres <command> [args…]"
        );
        return ExitCode::from(2);
    };
    let dir = std::env::temp_dir().join(format!("compute-throwaway-pg-{}", std::process::id()));
    let code = match run(&dir, program, rest).await {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "with-throwaway-postgres: {e}");
            ExitCode::FAILURE
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    code
}

async fn run(
    dir: &std::path::Path,
    program: &str,
    args: &[String],
) -> Result<ExitCode, Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    let pg = EmbeddedPostgres::start(EmbeddedOptions {
        data_dir: dir.to_owned(),
        durable: false,
        max_connections: 20,
    })
    .await?;
    pg.ensure_database(DATABASE).await?;
    let url = pg.url(DATABASE);
    let pool = sqlx::PgPool::connect(&url).await?;
    sqlx::migrate!("../migrations").run(&pool).await?;
    pool.close().await;
    // The server's keeper is a thread of its own, so waiting here blocks nothing it needs.
    let status = std::process::Command::new(program)
        .args(args)
        .env("DATABASE_URL", &url)
        .status()?;
    drop(pg);
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}
