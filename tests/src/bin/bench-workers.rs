//! Measures the workers: work-queue throughput (enqueue, then claim and finish) with 1, 2 and 4
//! worker processes, webhook deliveries per second to a local receiver, and to 100 sinks whose
//! receiver answers after 50 ms (one event per POST, then batches).
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-workers [items] [events] [only=queue|webhooks|reconcile|slow] [reservations=N] [slow-events=N] [batch=N]
//! ```
//!
//! The workers are real `compute-worker` processes (this package's `test-worker` build of it),
//! on a throwaway embedded PostgreSQL, on the same two cores as this process. Queue items are of
//! the `noop` kind, so the figure is the queue's own cost (claim, fenced finish), not a
//! reconciler's. Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use compute_domain::db::{Db, TxKind};
use compute_domain::ids::TenantId;
use compute_domain::work_queue::{self, SHARDS, WorkKind};

fn worker(binary: &std::path::Path, url: &str, role: &str, kinds: &str) -> tokio::process::Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0);
    tokio::process::Command::new(binary)
        .args([
            "--role",
            role,
            "--queue-kinds",
            kinds,
            "--listen",
            &format!("127.0.0.1:{port}"),
            // The receiver is on this machine.
            "--webhooks-allow-private",
        ])
        .env("DATABASE_URL", url)
        // The test databases seal sink secrets under the tests' key.
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker")
}

async fn count(db: &Db, sql: &str) -> i64 {
    let (n,): (i64,) = sqlx::query_as(sql)
        .fetch_one(db.pool())
        .await
        .expect("count");
    n
}

async fn queue_run(binary: &std::path::Path, items: usize, processes: usize) {
    let test_db = compute_tests::test_db_on_wall_clock_with(8).await;
    let db = test_db.db.clone();
    let mut children: Vec<_> = (0..processes)
        .map(|_| worker(binary, &test_db.url, "reconcile", WorkKind::Noop.as_str()))
        .collect();
    // Wait until the shards have spread over the processes (they rebalance every 5 s).
    let spread = Instant::now();
    let share = (SHARDS as usize).div_ceil(processes) as i64;
    loop {
        let owners = count(
            &db,
            "SELECT count(DISTINCT owner) FROM leases WHERE name LIKE 'shard:noop:%' AND expires_at > compute_now()",
        )
        .await;
        let most = count(
            &db,
            "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM leases WHERE name LIKE 'shard:noop:%' AND expires_at > compute_now() GROUP BY owner) c",
        )
        .await;
        let total = count(
            &db,
            "SELECT count(*) FROM leases WHERE name LIKE 'shard:noop:%' AND expires_at > compute_now()",
        )
        .await;
        if owners as usize == processes && most <= share && total == SHARDS as i64 {
            break;
        }
        if spread.elapsed() > Duration::from_secs(60) {
            println!("  (shards did not spread in 60 s: {owners} owners, {total} shards held)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Enqueue everything due a few seconds from now, so the workers start on a full queue.
    let delay = Duration::from_secs(4);
    let enqueue_started = Instant::now();
    let clients = 4;
    let per = items / clients;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            for chunk in (0..per).collect::<Vec<_>>().chunks(100) {
                let keys: Vec<String> = chunk.iter().map(|i| format!("k{c}-{i}")).collect();
                db.tx("queue_run", TxKind::Write, |conn| {
                    let keys = keys.clone();
                    Box::pin(async move {
                        for k in &keys {
                            work_queue::enqueue(conn, WorkKind::Noop, k, SHARDS, delay).await?;
                        }
                        Ok(())
                    })
                })
                .await
                .expect("enqueue");
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let enqueued = enqueue_started.elapsed();
    let total = per * clients;
    let due_at = enqueue_started + delay;
    if Instant::now() > due_at {
        println!(
            "  (enqueueing took longer than the {delay:?} delay; the claim figure includes some of it)"
        );
    }
    tokio::time::sleep_until(due_at.into()).await;
    let started = Instant::now();
    while count(&db, "SELECT count(*) FROM work_queue WHERE kind = 'noop'").await > 0 {
        if started.elapsed() > Duration::from_secs(300) {
            println!("  (gave up after 300 s)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drained = started.elapsed();
    println!(
        "  {processes} worker process(es): enqueue {:>6.0}/s ({total} in {:.2} s, 4 clients, 100 a transaction); claim + finish {:>6.0}/s ({:.2} s)",
        total as f64 / enqueued.as_secs_f64(),
        enqueued.as_secs_f64(),
        total as f64 / drained.as_secs_f64(),
        drained.as_secs_f64()
    );
    for c in &mut children {
        let _ = c.start_kill();
    }
    for c in &mut children {
        let _ = c.wait().await;
    }
}

/// Commits `n` `bench.tick` events of tenant `bench` in one transaction, numbered from 1
/// (`data.n`).
async fn emit_ticks(db: &Db, n: usize) {
    sqlx::query("SELECT compute_emit('bench.tick', 'bench', 'e' || g, jsonb_build_object('n', g)) FROM generate_series(1, $1) g")
        .bind(n as i32)
        .execute(db.pool())
        .await
        .expect("events");
}

async fn webhook_run(binary: &std::path::Path, events: usize) {
    let test_db = compute_tests::test_db_on_wall_clock_with(4).await;
    let db = test_db.db.clone();
    let received = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let counter = received.clone();
    let router = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::Relaxed);
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    compute_domain::sinks::create(
        &db,
        &compute_domain::sinks::Scope {
            tenant_id: Some(TenantId::parse("tenant", "bench").expect("valid tenant")),
        },
        "bench",
        &url,
        vec!["bench.tick".into()],
        1,
    )
    .await
    .expect("sink");
    emit_ticks(&db, events).await;
    let started = Instant::now();
    let mut child = worker(binary, &test_db.url, "outbox", "reservation");
    while (received.load(Ordering::Relaxed) as usize) < events {
        if started.elapsed() > Duration::from_secs(300) {
            println!("  (gave up after 300 s)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = started.elapsed();
    println!(
        "  1 worker process, 1 sink: {} deliveries in {:.2} s = {:.0}/s (includes the process's start-up)",
        received.load(Ordering::Relaxed),
        took.as_secs_f64(),
        received.load(Ordering::Relaxed) as f64 / took.as_secs_f64()
    );
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// Issue 36's queue goal: `n` real reservations of 100 tenants, all starting at one moment and
/// ending at another, activated and then expired by one worker process's reservation
/// reconciler.
async fn reconcile_run(binary: &std::path::Path, n: usize) {
    use compute_domain::ids::ScopeId;
    use compute_domain::quota::{self, QuotaLimits};
    let test_db = compute_tests::test_db_on_wall_clock_with(16).await;
    let app = Arc::new(compute_tests::TestApp::builder().on(test_db).start().await);
    let db = app.db.db.clone();
    let pools = compute_tests::bench::gpu_fleet(&db, 1, n.div_ceil(8), 8).await;
    sqlx::query("UPDATE nodes SET reachability = 'connected'")
        .execute(db.pool())
        .await
        .expect("connected");
    // 100 tenants, as in bench-reservations: an expiry gives back its tenant's quota, and one
    // tenant's quota row would serialize them all.
    let tenants: Vec<String> = (0..100).map(|t| format!("tenant-{t}")).collect();
    for t in &tenants {
        quota::set_quota(
            &db,
            &compute_domain::idempotency::Actor::operator("bench"),
            &compute_tests::tenant(t),
            &ScopeId::Pool(pools[0].clone()),
            QuotaLimits {
                gpus: Some(1_000_000.0),
                vcpu: Some(100_000_000),
                memory_mib: Some(100_000_000_000),
            },
        )
        .await
        .expect("quota");
    }
    // Every reservation starts at one moment, late enough for all to be created first, and ends
    // 20 s later.
    let lead = Duration::from_secs(10 + n as u64 / 150);
    let starts = chrono::Utc::now() + chrono::Duration::from_std(lead).expect("lead");
    let ends = starts + chrono::Duration::seconds(20);
    let tokens: Arc<Vec<String>> = Arc::new(
        tenants
            .iter()
            .map(|t| {
                app.token(
                    &format!("bench@{t}"),
                    Some(t),
                    &[compute_api::auth::Role::Member],
                )
            })
            .collect(),
    );
    let created = Instant::now();
    let clients = 16;
    let mut tasks = Vec::new();
    // Creates answered after the start (not `SCHEDULED`): the run would then measure less.
    let late = Arc::new(AtomicU64::new(0));
    for c in 0..clients {
        let (app, tokens, pool, late) = (
            app.clone(),
            tokens.clone(),
            pools[0].to_string(),
            late.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for i in (c..n).step_by(clients) {
                let vars = serde_json::json!({ "i": {
                    "poolId": pool, "startsAt": starts.to_rfc3339(), "endsAt": ends.to_rfc3339(),
                    "allocations": [{ "gpuCount": 1, "model": "H100", "vcpu": 4, "memoryMib": 8192 }],
                    "idempotencyKey": format!("r{i}"),
                }});
                let (status, body) = app
                    .graphql("mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { state } } }", vars, Some(&tokens[i % tokens.len()]))
                    .await;
                assert!(
                    status == 200 && body.get("errors").is_none(),
                    "createReservation: {body}"
                );
                if body["data"]["createReservation"]["reservation"]["state"] != "SCHEDULED" {
                    late.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("creates");
    }
    println!(
        "  {n} reservations created in {:.1} s, starting {:.1} s later ({} created after the start)",
        created.elapsed().as_secs_f64(),
        (starts - chrono::Utc::now()).num_milliseconds() as f64 / 1000.0,
        late.load(Ordering::Relaxed)
    );
    let mut child = worker(binary, &app.db.url, "reconcile", "reservation");
    let until_state = |states: &'static str, at: chrono::DateTime<chrono::Utc>| {
        let db = db.clone();
        async move {
            let wait = (at - chrono::Utc::now()).to_std().unwrap_or_default();
            tokio::time::sleep(wait).await;
            let from = Instant::now();
            let sql = format!("SELECT count(*) FROM reservations WHERE state IN ({states})");
            loop {
                if count(&db, &sql).await as usize >= n {
                    return Some(from.elapsed());
                }
                if from.elapsed() > Duration::from_secs(300) {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    for (what, states, at) in [
        ("activated", "'active', 'expired'", starts),
        ("expired", "'expired'", ends),
    ] {
        match until_state(states, at).await {
            Some(took) => println!(
                "  1 worker process: {n} {what} in {:.2} s from their time = {:.0} reconciles/s",
                took.as_secs_f64(),
                n as f64 / took.as_secs_f64()
            ),
            None => println!("  1 worker process: not all {what} within 300 s"),
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// What a slow receiver saw: deliveries, POSTs, and events that arrived out of order (an event
/// number not above the last one its sink received).
#[derive(Default)]
struct Seen {
    deliveries: AtomicU64,
    posts: AtomicU64,
    out_of_order: AtomicU64,
    last: std::sync::Mutex<std::collections::HashMap<String, i64>>,
}

impl Seen {
    /// Records one POST's body to `sink`: a single event, or a batch's deliveries.
    fn record(&self, sink: &str, body: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
            return;
        };
        let numbers: Vec<i64> = match v.get("deliveries").and_then(|d| d.as_array()) {
            Some(batch) => batch
                .iter()
                .filter_map(|d| d["event"]["data"]["n"].as_i64())
                .collect(),
            None => v["data"]["n"].as_i64().into_iter().collect(),
        };
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let at = last.entry(sink.to_owned()).or_insert(0);
        for n in &numbers {
            if *n <= *at {
                self.out_of_order.fetch_add(1, Ordering::Relaxed);
            }
            *at = *n;
        }
        self.posts.fetch_add(1, Ordering::Relaxed);
        self.deliveries
            .fetch_add(numbers.len() as u64, Ordering::Relaxed);
    }
}

/// Issue 36's webhook goal: `sinks` sinks whose receiver answers each POST after `wait`, each
/// receiving `events` events, delivered by `processes` worker processes.
async fn slow_webhook_run(
    binary: &std::path::Path,
    events: usize,
    sinks: usize,
    batch_size: i32,
    processes: usize,
    wait: Duration,
) {
    let test_db = compute_tests::test_db_on_wall_clock_with(8).await;
    let db = test_db.db.clone();
    let seen = Arc::new(Seen::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let recorder = seen.clone();
    let router = axum::Router::new().route(
        "/hook/{sink}",
        axum::routing::post(
            move |axum::extract::Path(sink): axum::extract::Path<String>,
                  body: axum::body::Bytes| {
                let recorder = recorder.clone();
                async move {
                    tokio::time::sleep(wait).await;
                    recorder.record(&sink, &body);
                    axum::http::StatusCode::NO_CONTENT
                }
            },
        ),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let scope = compute_domain::sinks::Scope {
        tenant_id: Some(TenantId::parse("tenant", "bench").expect("valid tenant")),
    };
    for i in 0..sinks {
        compute_domain::sinks::create(
            &db,
            &scope,
            "bench",
            &format!("{base}/{i}"),
            vec!["bench.tick".into()],
            batch_size,
        )
        .await
        .expect("sink");
    }
    emit_ticks(&db, events).await;
    let total = (events * sinks) as u64;
    let started = Instant::now();
    let mut children: Vec<_> = (0..processes)
        .map(|_| worker(binary, &test_db.url, "outbox", "reservation"))
        .collect();
    // The rate is measured from the first delivery, so the processes' start-up is left out.
    let mut first: Option<Instant> = None;
    while seen.deliveries.load(Ordering::Relaxed) < total {
        if first.is_none() && seen.posts.load(Ordering::Relaxed) > 0 {
            first = Some(Instant::now());
        }
        if started.elapsed() > Duration::from_secs(600) {
            println!("  (gave up after 600 s)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = Instant::now();
    let from = first.unwrap_or(started);
    let delivered = seen.deliveries.load(Ordering::Relaxed);
    println!(
        "  {processes} process(es), {sinks} sinks, batch size {batch_size}, receiver {} ms: {delivered} of {total} deliveries in {} POSTs, {:.2} s from the first = {:.0}/s; out of order {}",
        wait.as_millis(),
        seen.posts.load(Ordering::Relaxed),
        (done - from).as_secs_f64(),
        delivered as f64 / (done - from).as_secs_f64(),
        seen.out_of_order.load(Ordering::Relaxed),
    );
    for c in &mut children {
        let _ = c.start_kill();
    }
    for c in &mut children {
        let _ = c.wait().await;
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (options, positional): (Vec<&String>, Vec<&String>) =
        args.iter().skip(1).partition(|a| a.contains('='));
    let option = |name: &str| {
        options
            .iter()
            .find_map(|o| o.strip_prefix(&format!("{name}=")))
            .map(str::to_owned)
    };
    let items: usize = positional
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let events: usize = positional
        .get(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    // `only=queue|webhooks|reconcile|slow` runs one part; `reservations=N` (default 10000) the
    // reconcilers' run; `slow-events=N` (default 2000) and
    // `batch=N` (default 100) shape the slow receivers' run.
    let only = option("only");
    let slow_events: usize = option("slow-events")
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000);
    let batch: i32 = option("batch").and_then(|s| s.parse().ok()).unwrap_or(100);
    let reconciles: usize = option("reservations")
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let runs = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let binary = std::env::current_exe()
        .expect("own path")
        .with_file_name("test-worker");
    if !binary.exists() {
        println!(
            "{} is missing: build with `cargo build --release -p compute-tests`",
            binary.display()
        );
        std::process::exit(2);
    }
    if runs("queue") {
        println!("work queue, {items} noop items:");
        for processes in [1, 2, 4] {
            queue_run(&binary, items, processes).await;
        }
    }
    if runs("webhooks") {
        println!("webhooks, {events} events to a local receiver:");
        webhook_run(&binary, events).await;
    }
    if runs("reconcile") {
        println!("work queue, {reconciles} real reservations activated, then expired:");
        reconcile_run(&binary, reconciles).await;
    }
    if runs("slow") {
        println!(
            "webhooks, 100 sinks whose receiver answers after 50 ms, {slow_events} events each:"
        );
        // One event per POST, as before batches: one round trip per event caps a sink at 20/s.
        slow_webhook_run(
            &binary,
            (slow_events / 20).max(1),
            100,
            1,
            1,
            Duration::from_millis(50),
        )
        .await;
        slow_webhook_run(
            &binary,
            slow_events,
            100,
            batch,
            1,
            Duration::from_millis(50),
        )
        .await;
    }
}
