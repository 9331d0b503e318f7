//! Measures commands end to end, `runCommand` → dispatched → pushed → acknowledged →
//! `succeeded`, through one and then two `compute-worker --role dispatch` processes, to many
//! simulated daemons on one gateway process.
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-commands [nodes] [commands] [rate=R]
//! ```
//!
//! The gateway is a real `compute-api serve --gateway-only` process and the dispatchers real
//! `compute-worker --role dispatch` processes (this package's `test-api` and `test-worker`
//! builds); the daemons are `compute-sim` clients in this process and `runCommand` is the
//! domain's (the transaction the GraphQL mutation runs), all on a throwaway embedded PostgreSQL
//! on the same two cores. Each phase first sends a burst (every command at once, from 8
//! callers: the throughput), then a steady rate of half that throughput, or `rate=R` a second
//! (the latency from the `runCommand` transaction to the `result` transaction, as the database
//! timed them). Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use compute_domain::db::Db;
use compute_domain::idempotency::Actor;
use compute_domain::ids::NodeId;
use compute_domain::node_commands::{self as cmds, CommandRequest, Kind};
use compute_tests::bench::{
    command_latency, free_port, seed_nodes, sibling, spawn_gateway, start_daemons, until,
};

fn dispatcher(binary: &std::path::Path, url: &str) -> tokio::process::Child {
    tokio::process::Command::new(binary)
        .args([
            "--role",
            "dispatch",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .env("DATABASE_URL", url)
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a dispatcher")
}

async fn run_one(db: &Db, node: &str, key: String) {
    cmds::run_command(
        db,
        &Actor::operator("bench"),
        CommandRequest::parse(
            NodeId::parse("node", node).expect("node id"),
            Kind::Noop,
            serde_json::json!({}),
            0,
            None,
        )
        .expect("valid CommandRequest"),
        &key,
    )
    .await
    .expect("runCommand");
}

async fn succeeded(db: &Db, label: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE state = 'succeeded' AND idempotency_key LIKE $1",
    )
    .bind(format!("api:bench:{label}-%"))
    .fetch_one(db.pool())
    .await
    .expect("count")
}

/// p50 and p99 of `finished_at - created_at`, in milliseconds, of the phase's commands.
async fn latency(db: &Db, label: &str) -> (f64, f64) {
    let (p50, p99, _) = command_latency(db, &format!("api:bench:{label}-%")).await;
    (p50, p99)
}

async fn wait_done(db: &Db, label: &str, m: i64) -> Duration {
    let started = Instant::now();
    while succeeded(db, label).await < m {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{label}: not done in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    started.elapsed()
}

/// A burst of `m` commands from 8 callers; commands completed per second.
async fn burst(db: &Db, nodes: &Arc<Vec<String>>, label: &str, m: i64) -> f64 {
    let started = Instant::now();
    let mut callers = Vec::new();
    for c in 0..8 {
        let (db, nodes, label) = (db.clone(), nodes.clone(), label.to_owned());
        callers.push(tokio::spawn(async move {
            let mut i = c;
            while i < m {
                run_one(
                    &db,
                    &nodes[i as usize % nodes.len()],
                    format!("{label}-{i}"),
                )
                .await;
                i += 8;
            }
        }));
    }
    for c in callers {
        c.await.expect("caller");
    }
    let submitted = started.elapsed();
    wait_done(db, label, m).await;
    let elapsed = started.elapsed();
    let (p50, p99) = latency(db, label).await;
    println!(
        "  burst of {m}: submitted in {:.1} s ({:.0} runCommand/s), all succeeded after {:.1} s: \
         {:.0} commands completed/s; latency while queued p50 {p50:.0} ms, p99 {p99:.0} ms",
        submitted.as_secs_f64(),
        m as f64 / submitted.as_secs_f64(),
        elapsed.as_secs_f64(),
        m as f64 / elapsed.as_secs_f64()
    );
    m as f64 / elapsed.as_secs_f64()
}

/// The p50 of each leg, in ms: created → dispatched, dispatched → acknowledged, acknowledged →
/// result.
async fn legs(db: &Db, label: &str) -> (f64, f64, f64) {
    sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM dispatched_at - created_at) * 1000),                 percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - dispatched_at) * 1000),                 percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at) * 1000)            FROM commands WHERE idempotency_key LIKE $1",
    )
    .bind(format!("api:bench:{label}-%"))
    .fetch_one(db.pool())
    .await
    .expect("legs")
}

/// `rate` commands a second for `seconds`; p50 and p99 latency.
async fn steady(db: &Db, nodes: &Arc<Vec<String>>, label: &str, rate: f64, seconds: u64) {
    let total = (rate * seconds as f64) as i64;
    let every = Duration::from_secs_f64(1.0 / rate);
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = Vec::new();
    for i in 0..total {
        ticker.tick().await;
        let (db, nodes, label) = (db.clone(), nodes.clone(), label.to_owned());
        sent.push(tokio::spawn(async move {
            run_one(
                &db,
                &nodes[(i * 7) as usize % nodes.len()],
                format!("{label}-{i}"),
            )
            .await;
        }));
    }
    for s in sent {
        s.await.expect("caller");
    }
    wait_done(db, label, total).await;
    let (p50, p99) = latency(db, label).await;
    let (to_dispatch, to_ack, to_result) = legs(db, label).await;
    println!(
        "  steady {rate:.0} commands/s for {seconds} s ({total}): runCommand → succeeded p50 {p50:.1} ms, p99 {p99:.1} ms \
         (p50 of each leg: created → dispatched {to_dispatch:.1} ms, → acknowledged {to_ack:.1} ms, → result {to_result:.1} ms)"
    );
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: i64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1_000);
    let m: i64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    // `rate=R`: the steady phases at R commands a second (issue 36 asks for its latencies at
    // 200/s) instead of half the burst's throughput, which moves from run to run.
    let fixed_rate: Option<f64> = args
        .iter()
        .find_map(|a| a.strip_prefix("rate=")?.parse().ok())
        .filter(|r: &f64| *r > 0.0);
    let api = sibling("test-api");
    let worker = sibling("test-worker");
    let test_db = compute_tests::test_db_on_wall_clock_with(8).await;
    let db = test_db.db.clone();
    let nodes = Arc::new(seed_nodes(&db, n).await);
    // The daemons start at the nodes' generation: no apply_spec in the figures.
    sqlx::query("UPDATE nodes SET observed_generation = generation")
        .execute(db.pool())
        .await
        .expect("generations");
    let port = free_port();
    let _gateway = spawn_gateway(&api, &test_db.url, port, "bench-gw").await;
    let (stop, opened) = start_daemons(port, &nodes, 1);
    let connect = until("every daemon connects", Duration::from_secs(600), || {
        opened.load(Ordering::Relaxed) >= n
    })
    .await;
    println!(
        "{n} daemons connected to one gateway in {:.1} s",
        connect.as_secs_f64()
    );

    let _first = dispatcher(&worker, &test_db.url);
    tokio::time::sleep(Duration::from_secs(3)).await;
    println!("one dispatch process:");
    let one = burst(&db, &nodes, "one", m).await;
    let (a, b, c) = legs(&db, "one").await;
    println!(
        "  (burst, p50 of each leg: created → dispatched {a:.0} ms, → acknowledged {b:.0} ms, → result {c:.0} ms)"
    );
    let slow: Vec<(f64, f64, f64, i32, i64)> = sqlx::query_as(
        "SELECT extract(epoch FROM dispatched_at - created_at)::float8, extract(epoch FROM started_at - dispatched_at)::float8, \
                extract(epoch FROM finished_at - started_at)::float8, attempts, session_epoch \
           FROM commands WHERE idempotency_key LIKE 'api:bench:one-%' ORDER BY finished_at - created_at DESC LIMIT 5",
    )
    .fetch_all(db.pool())
    .await
    .expect("slowest");
    println!(
        "  (the slowest: [to dispatch s, to ack s, to result s, attempts, session epoch] {slow:?})"
    );
    steady(
        &db,
        &nodes,
        "one-steady",
        fixed_rate.unwrap_or((one / 2.0).max(1.0)),
        10,
    )
    .await;

    let _second = dispatcher(&worker, &test_db.url);
    // The first gives shards back at its next rebalance (every 5 s) once it sees the second.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let spread: Vec<(String, i64)> = sqlx::query_as(
        "SELECT owner, count(*) FROM leases WHERE name LIKE 'shard:node_commands:%' AND expires_at > compute_now() GROUP BY owner ORDER BY owner",
    )
    .fetch_all(db.pool())
    .await
    .expect("leases");
    println!("two dispatch processes (shards held: {spread:?}):");
    let two = burst(&db, &nodes, "two", m).await;
    steady(
        &db,
        &nodes,
        "two-steady",
        fixed_rate.unwrap_or((two / 2.0).max(1.0)),
        10,
    )
    .await;
    let _ = stop.send(true);
    tokio::time::sleep(Duration::from_millis(500)).await;
}
