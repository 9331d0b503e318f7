//! The data loaders keep the number of SQL statements of a tree query independent of the size of
//! the fleet. Statements are counted (sqlx logs each one under the `sqlx::query` target), never
//! timed.

use std::sync::Arc;

use compute_tests::TestApp;
use serde_json::json;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The statements sqlx logged while counting, by their summary (a failure names them).
struct CountStatements(Arc<std::sync::Mutex<Vec<String>>>);

/// A logged statement's text, and whether it is a background task's: the outbox tailer's, an
/// outbox poke's, or the gateway's poll of the commands to push (they run on the test's thread
/// too, on their own schedule, and are not part of the query being measured).
#[derive(Default)]
struct Statement {
    text: String,
    background: bool,
}

impl tracing::field::Visit for Statement {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "db.statement" || field.name() == "summary" {
            self.background |= [
                "pg_snapshot_xmin",
                "pg_notify",
                "FROM commands c WHERE c.gateway",
            ]
            .iter()
            .any(|t| value.contains(t));
            if field.name() == "summary" {
                self.text = value.to_owned();
            }
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for CountStatements {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            let mut statement = Statement::default();
            event.record(&mut statement);
            if !statement.background {
                self.0.lock().expect("not poisoned").push(statement.text);
            }
        }
    }
}

async fn fleet_of(app: &TestApp, nodes: usize) {
    compute_tests::bench::gpu_fleet(&app.db.db, 2, nodes / 2, 8).await;
}

const TREE: &str = "{ sites(first: 10) { edges { node { id name pools(first: 100) { totalCount edges { node { id name \
    capacity { model free } computeNodes(first: 100) { totalCount edges { node { id hostname resources { resource free } \
    devices { id model mode atoms { name } } } } } } } } } } } }";

/// Runs the tree query; returns the statements it took and the number of GPUs it returned.
async fn statements_for_tree(app: &TestApp) -> (Vec<String>, usize) {
    let counter = Arc::new(std::sync::Mutex::new(Vec::new()));
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
    // The server's clock samples `compute_now()` every second on simulated time, beside the
    // query, on the same thread: not one of the query's statements.
    let statements = counter
        .lock()
        .expect("not poisoned")
        .iter()
        .filter(|s| !s.starts_with("SELECT compute_now() AS"))
        .cloned()
        .collect();
    (statements, gpus)
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
    let small = compute_tests::TestApp::builder()
        .limits(limits())
        .start()
        .await;
    fleet_of(&small, 2).await;
    let large = compute_tests::TestApp::builder()
        .limits(limits())
        .start()
        .await;
    fleet_of(&large, 100).await;

    let (small_statements, small_gpus) = statements_for_tree(&small).await;
    let (large_statements, large_gpus) = statements_for_tree(&large).await;
    assert_eq!(
        (small_gpus, large_gpus),
        (16, 800),
        "the whole tree came back"
    );
    assert!(!small_statements.is_empty(), "statements are being counted");
    assert_eq!(
        small_statements.len(),
        large_statements.len(),
        "2 nodes took {small_statements:#?}, 100 nodes took {large_statements:#?}"
    );
    // sites, pools, pool counts, capacity, nodes, node counts, resources, devices, atoms.
    assert!(
        large_statements.len() <= 10,
        "{large_statements:#?} statements"
    );
    eprintln!(
        "tree query: {} statements for 2 nodes, {} for 100 nodes (800 GPUs)",
        small_statements.len(),
        large_statements.len()
    );
}
