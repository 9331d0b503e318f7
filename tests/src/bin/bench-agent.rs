//! Measures one real node daemon: `compute-agent` (this package's `test-agent` build) on one node,
//! behind a real gateway (`compute-api serve --gateway-only`) and a real dispatcher
//! (`compute-worker --role all`: the dispatcher and the reconcilers), all on a throwaway embedded PostgreSQL on the same cores.
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-agent [workloads=100] [noops=200] [rate=20] [instances=8]
//! ```
//!
//! 1. `workloads` `run_instance` commands at once (each a `sleep` under the process runtime, no
//!    GPU): `run_instance` created → succeeded (its workload started), p50 and p99.
//! 2. The agent with them running: its resident memory, and its CPU over 10 s idle.
//! 3. `noops` `runCommand(noop)` at `rate` a second: created → succeeded, p50 and p99, as the
//!    database timed them, and the agent's CPU meanwhile.
//! 4. `drain_workloads` (grace 5 s): how long until every workload is gone.
//! 5. `instances` times, one after another: `createReservation` of one GPU now, `createInstance`
//!    on it, until the instance is `running` (the reconciler's workflow, the dispatcher, the
//!    agent's start, the result): the wall time and `started_at - created_at` as the database
//!    timed it, p50 and max.
//!
//! Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::{Duration, Instant};

use compute_domain::db::Db;
use compute_domain::idempotency::Actor;
use compute_domain::ids::{AllocationId, NodeId, PoolId, ScopeId};
use compute_domain::instances::{self, InstanceRequest};
use compute_domain::node_commands::{self as cmds, CommandRequest, Kind};
use compute_domain::quota::{self, QuotaLimits};
use compute_domain::reservations::{
    self,
    model::{AllocationInput, ReservationRequest, parse_allocation},
};
use compute_tests::bench::{command_latency, free_port, gpu_fleet, sibling, spawn_gateway};

async fn run(db: &Db, node: &str, kind: Kind, args: serde_json::Value, key: &str) {
    cmds::run_command(
        db,
        &Actor::operator("bench"),
        CommandRequest::parse(
            NodeId::parse("node", node).expect("node id"),
            kind,
            args,
            0,
            None,
        )
        .expect("valid CommandRequest"),
        key,
    )
    .await
    .expect("runCommand");
}

async fn finished(db: &Db, like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM commands WHERE state IN ('succeeded', 'failed') AND idempotency_key LIKE $1",
    )
    .bind(format!("api:bench:{like}"))
    .fetch_one(db.pool())
    .await
    .expect("count")
}

async fn wait_finished(db: &Db, like: &str, n: i64) -> Duration {
    let started = Instant::now();
    while finished(db, like).await < n {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{like}: not done in 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

async fn latency(db: &Db, like: &str) -> (f64, f64, i64) {
    command_latency(db, &format!("api:bench:{like}")).await
}

/// The agent's CPU time so far (user + system), in seconds, and its resident memory in MiB.
fn usage(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the name.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|t| t.parse::<f64>().ok()))
        .sum();
    let rss_kib: f64 = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    // Linux's USER_HZ is 100 on every architecture this runs on.
    (ticks / 100.0, rss_kib / 1024.0)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let workloads: i64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    let noops: i64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(200);
    let rate: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(20.0);
    let instances: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(8);
    let api = sibling("test-api");
    let worker = sibling("test-worker");
    let agent_bin = sibling("test-agent");
    let test_db = compute_tests::test_db_on_wall_clock_with(8).await;
    let db = test_db.db.clone();
    // One node of `instances` whole H100s (at least one), as an operator registers it.
    let pool = gpu_fleet(&db, 1, 1, instances.max(1)).await.remove(0);
    let node: String = sqlx::query_scalar("SELECT id FROM nodes WHERE pool_id = $1")
        .bind(pool.as_str())
        .fetch_one(db.pool())
        .await
        .expect("the node");
    sqlx::query("UPDATE nodes SET observed_generation = generation")
        .execute(db.pool())
        .await
        .expect("generations");
    let tenant = compute_tests::tenant("bench");
    quota::set_quota(
        &db,
        &Actor::operator("bench"),
        &tenant,
        &ScopeId::Pool(pool.clone()),
        QuotaLimits {
            gpus: Some(1_000.0),
            vcpu: Some(100_000),
            memory_mib: Some(100_000_000),
        },
    )
    .await
    .expect("quota");
    let port = free_port();
    let _gateway = spawn_gateway(&api, &test_db.url, port, "bench-gw").await;
    let _dispatcher = tokio::process::Command::new(&worker)
        .args([
            "--role",
            "all",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .env("DATABASE_URL", &test_db.url)
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a dispatcher");
    let state = std::env::temp_dir().join(format!("bench-agent-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    // The machine as registered (`gpu_fleet`'s node), so the inventory check agrees with it.
    std::fs::create_dir_all(&state).expect("state dir");
    let inventory = state.with_extension("inventory.toml");
    let gpus: String = (0..instances.max(1))
        .map(|g| {
            format!("[[gpu]]\nuuid = \"GPU-p0-n0-g{g}\"\nmodel = \"H100\"\nmemory_mib = 81559\n")
        })
        .collect();
    std::fs::write(
        &inventory,
        format!(
            "hostname = \"p0-n0\"\nvcpu = 256\nmemory_mib = {}\ndisk_gib = 10000\n{gpus}",
            1 << 21
        ),
    )
    .expect("inventory file");
    let config = compute_tests::bench::daemon(port, &node, "unused", 0);
    let agent = tokio::process::Command::new(&agent_bin)
        .args(["--url", &config.url, "--node-id", &node, "--listen", "off"])
        .arg("--state-dir")
        .arg(&state)
        .arg("--inventory")
        .arg(&inventory)
        .env("COMPUTE_AGENT_TOKEN", &config.token)
        .env(
            "RUST_LOG",
            std::env::var("BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .kill_on_drop(true)
        .spawn()
        .expect("start compute-agent");
    let pid = agent.id().expect("pid");
    let started = Instant::now();
    loop {
        let open: Option<i64> = sqlx::query_scalar(
            "SELECT session_epoch FROM node_sessions WHERE node_id = $1 AND closed_at IS NULL",
        )
        .bind(&node)
        .fetch_optional(db.pool())
        .await
        .expect("session");
        if open.is_some() {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "no session");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Settle: the dispatcher takes its shards.
    tokio::time::sleep(Duration::from_secs(3)).await;

    for k in 0..workloads {
        let args = serde_json::json!({ "instanceId": format!("ins_{k:032x}"), "image": "host",
            "command": ["sleep", "600"], "devices": [] });
        run(&db, &node, Kind::RunInstance, args, &format!("run-{k:05}")).await;
    }
    let took = wait_finished(&db, "run-%", workloads).await;
    let (p50, p99, failed) = latency(&db, "run-%").await;
    println!(
        "{workloads} run_instance at once: all started in {:.2} s; created → workload running p50 {p50:.0} ms, p99 {p99:.0} ms ({failed} failed)",
        took.as_secs_f64()
    );

    let (cpu0, _) = usage(pid);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (cpu1, rss) = usage(pid);
    println!(
        "the agent with {workloads} running workloads: {rss:.1} MiB resident, {:.2}% of a core idle (10 s)",
        (cpu1 - cpu0) * 10.0
    );

    let period = Duration::from_secs_f64(1.0 / rate);
    let began = Instant::now();
    for k in 0..noops {
        let due = began + period * k as u32;
        tokio::time::sleep_until(due.into()).await;
        run(
            &db,
            &node,
            Kind::Noop,
            serde_json::json!({}),
            &format!("noop-{k:05}"),
        )
        .await;
    }
    wait_finished(&db, "noop-%", noops).await;
    let (cpu2, rss2) = usage(pid);
    let (p50, p99, failed) = latency(&db, "noop-%").await;
    println!(
        "{noops} runCommand(noop) at {rate}/s through the agent: created → succeeded p50 {p50:.1} ms, p99 {p99:.1} ms ({failed} failed); agent CPU {:.2}% of a core, {rss2:.1} MiB",
        (cpu2 - cpu1) / began.elapsed().as_secs_f64() * 100.0
    );

    let (d, a, r): (f64, f64, f64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM dispatched_at - created_at) * 1000), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - dispatched_at) * 1000), \
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at) * 1000) \
           FROM commands WHERE idempotency_key LIKE 'api:bench:noop-%'",
    )
    .fetch_one(db.pool())
    .await
    .expect("legs");
    println!(
        "  (p50 of each leg: created → dispatched {d:.1} ms, → acknowledged {a:.1} ms, → result {r:.1} ms)"
    );

    let drain = Instant::now();
    run(
        &db,
        &node,
        Kind::DrainWorkloads,
        serde_json::json!({ "graceSeconds": 5 }),
        "drain",
    )
    .await;
    wait_finished(&db, "drain", 1).await;
    let (_, _, failed) = latency(&db, "drain").await;
    println!(
        "drain_workloads of {workloads}: {:.2} s ({failed} failed)",
        drain.elapsed().as_secs_f64()
    );

    let member = Actor::member("bench-member", tenant);
    let (mut walls, mut timed) = (Vec::new(), Vec::new());
    for k in 0..instances {
        let began = Instant::now();
        let allocation = one_gpu(&db, &member, &pool, k).await;
        let instance = instances::create_instance(
            &db,
            &member,
            InstanceRequest::parse(
                allocation,
                "host".into(),
                vec!["sleep".into(), "600".into()],
                Default::default(),
            )
            .expect("valid InstanceRequest"),
            &format!("instance-{k}"),
        )
        .await
        .expect("createInstance")
        .value;
        let ms: f64 = loop {
            let ms: Option<f64> = sqlx::query_scalar(
                "SELECT CASE WHEN state = 'running' THEN extract(epoch FROM started_at - created_at)::float8 * 1000 END \
                   FROM instances WHERE id = $1",
            )
            .bind(instance.id.as_str())
            .fetch_one(db.pool())
            .await
            .expect("the instance");
            if let Some(ms) = ms {
                break ms;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "instance {k} not running in a minute"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        walls.push(began.elapsed().as_secs_f64() * 1000.0);
        timed.push(ms);
    }
    if instances > 0 {
        println!(
            "{instances} instances one after another, createInstance → running: p50 {:.0} ms, max {:.0} ms as the database timed it; \
             createReservation + createInstance → seen running p50 {:.0} ms, max {:.0} ms",
            median(&mut timed),
            timed.iter().cloned().fold(0.0, f64::max),
            median(&mut walls),
            walls.iter().cloned().fold(0.0, f64::max),
        );
    }
    drop(agent);
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_file(&inventory);
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `createReservation` of one whole GPU now for an hour in `pool`; its allocation's id.
async fn one_gpu(db: &Db, member: &Actor, pool: &PoolId, k: usize) -> AllocationId {
    let allocation = parse_allocation(
        "allocations[0]",
        &AllocationInput {
            gpu_count: 1,
            vcpu: 1,
            memory_mib: 1024,
            disk_gib: 1,
            ..Default::default()
        },
    )
    .expect("an allocation");
    let (created, _) = reservations::lifecycle::create_reservation(
        db,
        member,
        ReservationRequest {
            pool_id: pool.clone(),
            starts_at: None,
            ends_at: chrono::Utc::now() + chrono::Duration::hours(1),
            allocations: vec![allocation],
            gang: None,
        },
        &format!("reservation-{k}"),
    )
    .await
    .expect("createReservation");
    let id: String = sqlx::query_scalar("SELECT id FROM allocations WHERE reservation_id = $1")
        .bind(created.value.id.as_str())
        .fetch_one(db.pool())
        .await
        .expect("its allocation");
    AllocationId::from_trusted(&id).expect("an allocation id")
}
