//! The fleet page against a hand-written single SQL statement for the same page (issue 15).
//!
//! A fleet of `pools` × `nodes per pool` nodes of 8 H100 each (default 9 × 250: 2,250 nodes,
//! 18,000 GPUs and as many atoms). The page: one pool's first 100 nodes with their resources,
//! GPUs and atoms (800 GPUs), asked for through GraphQL over HTTP by an operator, and the same
//! page as JSON from one SQL statement (`json_agg` of the same rows, the same order), sent by a
//! client in one round trip. Each is asked `requests` times in turn from one client; it prints
//! p50 and p99 of each, the ratio of the p50s, the statements the GraphQL page took and how
//! many rows of `devices` and `device_atoms` it read (`pg_stat_user_tables`, indicative: the
//! statistics arrive up to a second late), the plan of its devices statement, and the time of its
//! devices, resources and atoms statements alone.
//!
//! Asserts nothing but that both answers hold the same 800 GPUs: a benchmark, not a test.
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-fleet [requests] [pools] [nodes per pool]
//! ```

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::{Duration, Instant};

use compute_domain::fleet;
use serde_json::{Value, json};

const PAGE: &str = "query($pool: ID!) { node(id: $pool) { ... on Pool { id name computeNodes(first: 100) { totalCount \
    edges { node { id hostname resources { resource free } devices { id model mode atoms { name } } } } } } } }";

/// The same page in one statement: what a hand-written endpoint would send.
const HAND: &str = r#"
SELECT json_build_object('data', json_build_object('node', json_build_object(
  'id', p.id, 'name', p.name,
  'computeNodes', json_build_object(
    'totalCount', (SELECT count(*) FROM nodes c WHERE c.pool_id = p.id),
    'edges', (SELECT json_agg(json_build_object('node', json_build_object(
        'id', n.id, 'hostname', n.hostname,
        'resources', (SELECT json_agg(json_build_object('resource', r.resource,
                         'free', floor(r.allocatable * r.ratio)::bigint - r.allocated) ORDER BY r.resource)
                        FROM node_resources r WHERE r.node_id = n.id),
        'devices', (SELECT json_agg(json_build_object('id', d.id, 'model', d.model, 'mode', d.mode,
                       'atoms', (SELECT json_agg(json_build_object('name', a.name) ORDER BY a.ordinal)
                                   FROM device_atoms a WHERE a.device_id = d.id)) ORDER BY d.id)
                      FROM devices d WHERE d.node_id = n.id))) ORDER BY n.id)
               FROM (SELECT id, hostname FROM nodes WHERE pool_id = p.id ORDER BY id LIMIT 100) n)))))::text
  FROM pools p WHERE p.id = $1
"#;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn gpus(body: &Value) -> usize {
    body["data"]["node"]["computeNodes"]["edges"]
        .as_array()
        .map_or(0, |edges| {
            edges
                .iter()
                .map(|e| e["node"]["devices"].as_array().map_or(0, Vec::len))
                .sum()
        })
}

async fn rows_read(db: &compute_domain::db::Db) -> i64 {
    sqlx::query_scalar::<_, i64>(
        "SELECT sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))::bigint
           FROM pg_stat_user_tables WHERE relname IN ('devices', 'device_atoms')",
    )
    .fetch_one(db.pool())
    .await
    .expect("pg_stat_user_tables")
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg =
        |i: usize, default: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let (requests, pools, per_pool) = (arg(1, 300), arg(2, 9), arg(3, 250));
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .limits(compute_api::limits::Limits {
            max_cost: u64::MAX,
            budget_per_minute: u64::MAX / 2,
            ..Default::default()
        })
        .start()
        .await;
    let db = app.db.db.clone();
    let seeding = Instant::now();
    let pool = compute_tests::bench::gpu_fleet(&db, pools, per_pool, 8)
        .await
        .remove(0)
        .to_string();
    sqlx::raw_sql("VACUUM ANALYZE")
        .execute(db.pool())
        .await
        .expect("vacuum");
    println!(
        "fleet: {pools} pools × {per_pool} nodes × 8 H100 = {} GPUs (seeded in {:.0} s); the page: one pool's first 100 nodes, 800 GPUs; {requests} requests of each, one client",
        pools * per_pool * 8,
        seeding.elapsed().as_secs_f64()
    );
    let operator = app.operator();
    let http = reqwest::Client::new();
    let url = app.url("/graphql");
    let graphql = || {
        let (http, url, operator, pool) =
            (http.clone(), url.clone(), operator.clone(), pool.clone());
        async move {
            http.post(&url)
                .bearer_auth(&operator)
                .header("accept", "application/json")
                .json(&json!({ "query": PAGE, "variables": { "pool": pool } }))
                .send()
                .await
                .expect("an answer")
                .text()
                .await
                .expect("a body")
        }
    };
    let hand = || {
        let (db, pool) = (db.clone(), pool.clone());
        async move {
            sqlx::query_scalar::<_, String>(HAND)
                .bind(pool)
                .fetch_one(db.pool())
                .await
                .expect("the hand-written page")
        }
    };
    let g: Value = serde_json::from_str(&graphql().await).expect("JSON");
    let h: Value = serde_json::from_str(&hand().await).expect("JSON");
    assert!(g.get("errors").is_none(), "{g}");
    assert_eq!((gpus(&g), gpus(&h)), (800, 800), "both pages hold 800 GPUs");

    // What one GraphQL page reads (after warm-up, so plans are settled).
    for _ in 0..10 {
        graphql().await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before = rows_read(&db).await;
    graphql().await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let read = rows_read(&db).await - before;
    println!(
        "one GraphQL page read {read} rows of devices and device_atoms (it returns 800 of each)"
    );

    // The statements the GraphQL page runs, alone, in the order it runs them (what the page
    // costs the database and its round trips, without HTTP, GraphQL and JSON).
    let node_ids: Vec<compute_domain::ids::NodeId> = g["data"]["node"]["computeNodes"]["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .filter_map(|e| {
            e["node"]["id"]
                .as_str()
                .and_then(compute_domain::ids::NodeId::from_trusted)
        })
        .collect();
    let statements = || {
        let (db, node_ids) = (db.clone(), node_ids.clone());
        async move {
            let devices = fleet::devices_by_nodes(&db, &node_ids)
                .await
                .expect("devices");
            fleet::resources_by_nodes(&db, &node_ids)
                .await
                .expect("resources");
            let device_ids: Vec<_> = devices.iter().map(|d| d.id.clone()).collect();
            fleet::atoms_by_devices(&db, &device_ids)
                .await
                .expect("atoms");
        }
    };
    for (what, sql, ids) in [(
        "devices of the page's nodes",
        "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) SELECT d.* FROM unnest($1::text[]) AS k(id) \
             CROSS JOIN LATERAL (SELECT * FROM devices x WHERE x.node_id = k.id OFFSET 0) d ORDER BY d.node_id, d.id",
        node_ids
            .iter()
            .map(|n| n.as_str().to_owned())
            .collect::<Vec<_>>(),
    )] {
        let plan: Vec<String> = sqlx::query_scalar(sql)
            .bind(ids)
            .fetch_all(db.pool())
            .await
            .expect("explain");
        println!("plan of the {what}:\n  {}", plan.join("\n  "));
    }

    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..requests {
        let t = Instant::now();
        graphql().await;
        times[0].push(t.elapsed());
        let t = Instant::now();
        hand().await;
        times[1].push(t.elapsed());
        let t = Instant::now();
        statements().await;
        times[2].push(t.elapsed());
    }
    for t in &mut times {
        t.sort();
    }
    for (name, t) in [
        ("graphql", &times[0]),
        ("hand-written SQL", &times[1]),
        (
            "graphql's devices, resources and atoms statements alone",
            &times[2],
        ),
    ] {
        println!(
            "{name}: p50 {:.2?}, p99 {:.2?}",
            percentile(t, 0.5),
            percentile(t, 0.99)
        );
    }
    println!(
        "ratio of the p50s, graphql / hand-written: {:.2}",
        percentile(&times[0], 0.5).as_secs_f64() / percentile(&times[1], 0.5).as_secs_f64()
    );
}
