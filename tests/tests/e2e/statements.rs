//! The data loaders keep the number of SQL statements of a tree query independent of the size of
//! the fleet. Statements are counted (sqlx logs each one under the `sqlx::query` target), never
//! timed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use compute_domain::fleet::commands::{self, NewDevice, NewNode, NewPool, NewSite};
use compute_domain::fleet::model::{Labels, Layout, PoolKind};
use compute_domain::idempotency::Actor;
use compute_tests::TestApp;
use serde_json::json;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

struct CountStatements(Arc<AtomicUsize>);

/// Whether a logged statement is the outbox tailer's or an outbox poke's (they run on the
/// test's thread too, on their own schedule, and are not part of the query being measured).
#[derive(Default)]
struct IsTailer(bool);

impl tracing::field::Visit for IsTailer {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "db.statement" || field.name() == "summary" {
            let text = format!("{value:?}");
            self.0 |= text.contains("pg_snapshot_xmin") || text.contains("pg_notify");
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "db.statement" || field.name() == "summary" {
            self.0 |= value.contains("pg_snapshot_xmin") || value.contains("pg_notify");
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for CountStatements {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            let mut tailer = IsTailer::default();
            event.record(&mut tailer);
            if !tailer.0 {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

async fn fleet_of(app: &TestApp, nodes: usize) {
    let db = &app.db.db;
    let actor = Actor::operator("test");
    let site = commands::create_site(
        db,
        &actor,
        NewSite {
            name: "big".into(),
            region: None,
        },
        None,
    )
    .await
    .expect("site")
    .value;
    for p in 0..2 {
        let pool = commands::create_pool(
            db,
            &actor,
            NewPool {
                site_id: site.id.clone(),
                name: format!("pool-{p}"),
                kind: PoolKind::BareMetal,
                lost_after_seconds: None,
                vcpu_ratio: 1.0,
                memory_ratio: 1.0,
                disk_ratio: 1.0,
            },
            None,
        )
        .await
        .expect("pool")
        .value;
        for n in 0..nodes / 2 {
            commands::register_node(
                db,
                NewNode {
                    pool_id: pool.id.clone(),
                    hostname: format!("p{p}-n{n}"),
                    labels: Labels::new(),
                    taints: vec![],
                    vcpu: 128,
                    memory_mib: 1 << 20,
                    disk_gib: 1000,
                    devices: (0..8)
                        .map(|g| NewDevice {
                            uuid: compute_domain::fleet::model::GpuUuid::parse(
                                "uuid",
                                &format!("GPU-p{p}-n{n}-g{g}"),
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
    }
}

const TREE: &str = "{ sites(first: 10) { edges { node { id name pools(first: 100) { totalCount edges { node { id name \
    capacity { model free } computeNodes(first: 100) { totalCount edges { node { id hostname resources { resource free } \
    devices { id model mode atoms { name } } } } } } } } } } } }";

/// Runs the tree query; returns the statements it took and the number of GPUs it returned.
async fn statements_for_tree(app: &TestApp) -> (usize, usize) {
    let counter = Arc::new(AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(CountStatements(counter.clone()));
    let guard = tracing::subscriber::set_default(subscriber);
    let data = app.ok(&app.operator(), TREE, json!({})).await;
    drop(guard);
    let gpus = data["sites"]["edges"][0]["node"]["pools"]["edges"]
        .as_array()
        .expect("pools")
        .iter()
        .flat_map(|p| {
            p["node"]["computeNodes"]["edges"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|n| n["node"]["devices"].as_array().map_or(0, Vec::len))
        .sum();
    (counter.load(Ordering::SeqCst), gpus)
}

#[tokio::test]
async fn a_tree_query_issues_the_same_statements_for_2_and_100_nodes() {
    // The tree asks for up to 10 × 100 × 100 nodes: far over the default cost limit, which is
    // an operator's setting; this test measures statements, so it raises it.
    let limits = || compute_api::limits::Limits {
        max_cost: u64::MAX,
        budget_per_minute: u64::MAX / 2,
        ..Default::default()
    };
    let small = compute_tests::spawn_app_with_limits(limits()).await;
    fleet_of(&small, 2).await;
    let large = compute_tests::spawn_app_with_limits(limits()).await;
    fleet_of(&large, 100).await;

    let (small_statements, small_gpus) = statements_for_tree(&small).await;
    let (large_statements, large_gpus) = statements_for_tree(&large).await;
    assert_eq!(
        (small_gpus, large_gpus),
        (16, 800),
        "the whole tree came back"
    );
    assert!(small_statements > 0, "statements are being counted");
    assert_eq!(
        small_statements, large_statements,
        "2 nodes took {small_statements} statements, 100 nodes took {large_statements}"
    );
    // sites, pools, pool counts, capacity, nodes, node counts, resources, devices, atoms.
    assert!(large_statements <= 10, "{large_statements} statements");
    eprintln!(
        "tree query: {small_statements} statements for 2 nodes, {large_statements} for 100 nodes (800 GPUs)"
    );
}
