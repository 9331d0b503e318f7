//! Measures one gateway process holding many simulated daemons: what their heartbeats cost the
//! database, the gateway's memory per session, and how long every daemon takes to reconnect
//! after the gateway is SIGKILLed and another starts on the same address.
//!
//! ```sh
//! cargo build --release -p compute-tests -p compute-sim
//! target/release/bench-gateway [daemons] [seconds]
//! ```
//!
//! The gateway is a real `compute-api serve --gateway-only` process (this package's `test-api`
//! build), the daemons are `compute-sim` clients in this process, heartbeating every 5 s (the
//! gateway's default), all on a throwaway embedded PostgreSQL on the same two cores. Asserts
//! nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use compute_tests::bench::{free_port, seed_nodes, sibling, spawn_gateway, start_daemons, until};

fn rss_kib(pid: u32) -> i64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn scalar(db: &compute_domain::db::Db, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql)
        .fetch_one(db.pool())
        .await
        .expect("query");
    n
}

/// The gateway's count of `flush_node_sessions` transactions, from its `/metrics`.
async fn flushes(port: u16) -> f64 {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| {
            l.starts_with("compute_db_transaction_seconds_count")
                && l.contains("flush_node_sessions")
        })
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: i64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let seconds: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
    let binary = sibling("test-api");
    let test_db = compute_tests::test_db_on_wall_clock_with(4).await;
    let db = test_db.db.clone();
    let nodes = seed_nodes(&db, n).await;
    let port = free_port();
    let mut g1 = spawn_gateway(&binary, &test_db.url, port, "bench-g1").await;
    let pid = g1.id().unwrap_or(0);
    let idle_rss = rss_kib(pid);

    let (stop, opened) = start_daemons(port, &nodes, 0);
    let connect = until("every daemon connects", Duration::from_secs(600), || {
        opened.load(Ordering::Relaxed) >= n
    })
    .await;
    println!(
        "{n} daemons connected to one gateway in {:.1} s ({:.0} sessions opened/s)",
        connect.as_secs_f64(),
        n as f64 / connect.as_secs_f64()
    );
    // Steady state: what the database does while every daemon heartbeats every 5 s. PostgreSQL
    // 15 reports an idle backend's counts up to 10 s late: let the connection storm's settle.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let xact = "SELECT (xact_commit + xact_rollback)::int8 FROM pg_stat_database WHERE datname = current_database()";
    let before = scalar(&db, xact).await;
    let flushes_before = flushes(port).await;
    let opens_before = opened.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let after = scalar(&db, xact).await;
    let flushed = flushes(port).await - flushes_before;
    let elapsed = t0.elapsed().as_secs_f64();
    let reopened = opened.load(Ordering::Relaxed) - opens_before;
    let max_epoch = scalar(
        &db,
        "SELECT coalesce(max(session_epoch), 0) FROM node_sessions",
    )
    .await;
    let rss = rss_kib(pid);
    let seen = scalar(&db, "SELECT count(*) FROM node_sessions WHERE closed_at IS NULL AND last_seen_at > compute_now() - interval '10 seconds'").await;
    println!(
        "steady state over {elapsed:.0} s with {n} daemons heartbeating every 5 s: the heartbeats cost {:.2} \
         transactions/s (the gateway's flushes: each one transaction, the lease fence and one UPDATE of every session); \
         the database ran {:.2} transactions/s in all (with the gateway's outbox tailer, 4/s, and its lease); \
         {seen} sessions seen within 10 s; {reopened} sessions reopened meanwhile (highest epoch {max_epoch})",
        flushed / elapsed,
        (after - before) as f64 / elapsed
    );
    println!(
        "gateway RSS: {:.1} MiB idle, {:.1} MiB with {n} sessions: {:.1} KiB per session",
        idle_rss as f64 / 1024.0,
        rss as f64 / 1024.0,
        (rss - idle_rss) as f64 / n as f64
    );
    // The gateway dies; another starts on the same address; every daemon reconnects.
    let before_kill = opened.load(Ordering::Relaxed);
    let killed = Instant::now();
    let _ = g1.start_kill();
    let _ = g1.wait().await;
    let _g2 = spawn_gateway(&binary, &test_db.url, port, "bench-g2").await;
    let up = killed.elapsed();
    let back = until("every daemon reconnects", Duration::from_secs(900), || {
        opened.load(Ordering::Relaxed) >= before_kill + n
    })
    .await;
    println!(
        "after SIGKILL: the second gateway was ready in {:.1} s; all {n} daemons were reconnected {:.1} s after the kill \
         (their backoff starts at 0.5 s and doubles)",
        up.as_secs_f64(),
        (up + back).as_secs_f64()
    );
    let _ = stop.send(true);
    tokio::time::sleep(Duration::from_millis(500)).await;
}
