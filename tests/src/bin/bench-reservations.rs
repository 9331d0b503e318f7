//! Measures reservation throughput: creates and releases through the domain (no HTTP), with a
//! number of concurrent clients, on a throwaway embedded PostgreSQL (or `DATABASE_URL`).
//!
//! ```sh
//! cargo run --release -p compute-tests --bin bench-reservations -- [operations] [clients]
//! ```
//!
//! Prints transactions per second and latency percentiles; asserts nothing (a benchmark, not a
//! test).

use std::io::Write;
use std::time::{Duration, Instant};

use compute_domain::fleet::commands::{self, NewDevice, NewNode, NewPool, NewSite};
use compute_domain::fleet::model::{AtomKind, Labels, Layout, PoolKind};
use compute_domain::idempotency::Actor;
use compute_domain::reservations::commands as rsv;
use compute_domain::reservations::model::{AllocationRequest, ReservationRequest};
use futures_util::StreamExt;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() {
    compute_tests::init_logging();
    let args: Vec<String> = std::env::args().collect();
    let operations: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let clients: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let test_db = compute_tests::test_db_with(clients as u32 + 2).await;
    let db = test_db.db.clone();
    let actor = Actor::member(
        "bench",
        compute_domain::ids::TenantId::parse("tenant", "bench").expect("valid tenant"),
    );
    let site = commands::create_site(
        &db,
        &actor,
        NewSite {
            name: "bench".into(),
            region: None,
        },
        None,
    )
    .await
    .expect("site")
    .value;
    let pool = commands::create_pool(
        &db,
        &actor,
        NewPool {
            site_id: site.id,
            name: "bench".into(),
            kind: PoolKind::BareMetal,
            lost_after_seconds: None,
            vcpu_ratio: 4.0,
            memory_ratio: 1.0,
            disk_ratio: 1.0,
        },
        None,
    )
    .await
    .expect("pool")
    .value;
    for n in 0..50 {
        commands::register_node(
            &db,
            NewNode {
                pool_id: pool.id.clone(),
                hostname: format!("bench-{n}"),
                labels: Labels::new(),
                taints: vec![],
                vcpu: 256,
                memory_mib: 1 << 21,
                disk_gib: 10_000,
                devices: (0..8)
                    .map(|g| NewDevice {
                        uuid: compute_domain::fleet::model::GpuUuid::parse(
                            "uuid",
                            &format!("GPU-b{n}-{g}"),
                        )
                        .expect("a GPU uuid"),
                        vendor: "nvidia".into(),
                        model: "H100".into(),
                        memory_mib: 81_559,
                        layout: Layout::Exclusive,
                    })
                    .collect(),
            },
        )
        .await
        .expect("node");
    }
    let request = |_: usize| ReservationRequest {
        pool_id: pool.id.clone(),
        starts_at: None,
        ends_at: chrono::Utc::now() + chrono::Duration::hours(1),
        allocations: vec![AllocationRequest {
            gpu_kind: AtomKind::Gpu,
            gpu_count: 1,
            model: None,
            profile: None,
            slots_per_gpu: None,
            vcpu: 4,
            memory_mib: 8192,
            disk_gib: 10,
            node_selector: Labels::new(),
            tolerations: vec![],
        }],
    };
    // Each client creates a reservation and releases it, so the fleet never fills up.
    let started = Instant::now();
    let latencies: Vec<(Duration, Duration, bool)> = futures_util::stream::iter(0..operations)
        .map(|i| {
            let (db, actor, req) = (db.clone(), actor.clone(), request(i));
            async move {
                let t = Instant::now();
                let (outcome, _) = rsv::create_reservation(&db, &actor, req, &format!("bench-{i}"))
                    .await
                    .expect("create");
                let created = t.elapsed();
                let pending =
                    outcome.value.state == compute_domain::reservations::state::State::Pending;
                if pending {
                    let why = outcome
                        .value
                        .conditions
                        .first()
                        .and_then(|c| c.message.clone())
                        .unwrap_or_default();
                    let _ = writeln!(std::io::stderr(), "pending: {why}");
                }
                let t = Instant::now();
                if pending {
                    rsv::cancel_reservation(&db, &actor, &outcome.value.id, None)
                        .await
                        .expect("cancel");
                } else {
                    rsv::release_reservation(&db, &actor, &outcome.value.id, None)
                        .await
                        .expect("release");
                }
                (created, t.elapsed(), pending)
            }
        })
        .buffer_unordered(clients)
        .collect()
        .await;
    let elapsed = started.elapsed();
    let mut creates: Vec<Duration> = latencies.iter().map(|l| l.0).collect();
    let mut releases: Vec<Duration> = latencies.iter().map(|l| l.1).collect();
    let pending = latencies.iter().filter(|l| l.2).count();
    creates.sort();
    releases.sort();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{operations} creates + {operations} releases, {clients} clients, 50 nodes × 8 GPUs: {:.2} s\n\
         throughput: {:.0} transactions/s ({:.0} reservations/s created and released)\n\
         create  p50 {:?}  p90 {:?}  p99 {:?}\n\
         release p50 {:?}  p90 {:?}  p99 {:?}\n\
         pending (3 placement attempts lost races): {pending}",
        elapsed.as_secs_f64(),
        (2 * operations) as f64 / elapsed.as_secs_f64(),
        operations as f64 / elapsed.as_secs_f64(),
        percentile(&creates, 0.5),
        percentile(&creates, 0.9),
        percentile(&creates, 0.99),
        percentile(&releases, 0.5),
        percentile(&releases, 0.9),
        percentile(&releases, 0.99),
    );
}
