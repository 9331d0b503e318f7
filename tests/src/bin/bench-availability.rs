//! Availability search at fleet scale (issue 38): `nodes` nodes × 8 H100 (default 1,250: 10,000
//! GPUs) in `pools` pools of equal size (default 1) with `bookings` bookings (default 50,000)
//! over 14 days, then `availability` for whole GPUs on one node of the first pool through
//! GraphQL over HTTP, one request at a time, and `capacityTimeline` for the 14 days in hours.
//! Prints p50, p99 and max of each question, and how PostgreSQL reads the pool's bookings (with
//! several pools, an index range scan that leaves the other pools' bookings unread).
//!
//! The bookings are written straight into `device_bookings` (the exclusion constraint still
//! checks each), every atom booked about `bookings / atoms` times: one booking in each of that
//! many equal slots of the 14 days (which begin a day before now, so some are running), at a
//! random offset in its slot and 1 to 36 hours long. The search reads them as it would read
//! bookings that placement wrote.
//!
//! ```sh
//! cargo build --release -p compute-tests --bin bench-availability
//! target/release/bench-availability [nodes] [bookings] [questions] [pools]
//! ```

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::{Duration, Instant};

use serde_json::{Value, json};

const AVAILABILITY: &str = "query($p: ID!, $a: [AllocationInput!]!, $d: Int!, $nb: DateTime) { \
    availability(poolId: $p, allocations: $a, durationSeconds: $d, notBefore: $nb) { \
      windows { startsAt latestStart placements { computeNodeId freeAtoms } } unschedulable { reason count } } }";
const TIMELINE: &str = "query($p: ID!, $from: DateTime!, $to: DateTime!) { \
    capacityTimeline(poolId: $p, from: $from, to: $to, stepSeconds: 3600) { steps { booked free } } }";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A plan's nodes, outermost first: each node's type, its index and its index condition.
fn describe_plan(node: &Value) -> String {
    let mut out = node["Node Type"].as_str().unwrap_or("?").to_owned();
    if let Some(i) = node["Index Name"].as_str() {
        out += &format!(" using {i}");
    }
    if let Some(c) = node["Index Cond"].as_str() {
        out += &format!(" on {c}");
    }
    for child in node["Plans"].as_array().into_iter().flatten() {
        out += &format!(" <- {}", describe_plan(child));
    }
    out
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let nodes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1250);
    let bookings: i64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(50_000);
    let questions: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    let pools: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1)
        .clamp(1, nodes.max(1));
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .start()
        .await;
    let db = app.db.db.clone();
    let started = Instant::now();
    let nodes = nodes / pools * pools;
    let pool = compute_tests::bench::gpu_fleet(&db, pools, nodes / pools, 8).await[0].to_string();
    println!(
        "fleet: {pools} pool(s) of {} nodes × 8 H100 ({} GPUs), built in {:.1} s; the questions ask the first pool",
        nodes / pools,
        nodes * 8,
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let atoms = (nodes * 8) as i64;
    let per_atom = (bookings + atoms - 1) / atoms;
    // Slot k of an atom spans 14 days / per_atom from a day ago; its booking starts at a random
    // offset in the first 40% of the slot and lasts 1 to 36 hours (within the slot).
    let written = sqlx::query(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during)
         SELECT a.name, a.device_id, 'alc_' || md5(a.name || ':' || k),
                tstzrange(s, s + interval '1 hour' * (1 + floor(random() * least(36, h.slot_h * 0.6 - 1))))
           FROM (SELECT a.*, row_number() OVER (ORDER BY a.name) AS n FROM device_atoms a) a,
                generate_series(0, $2 - 1) AS k,
                LATERAL (SELECT (14.0 * 24 / $2)::float8 AS slot_h) h,
                LATERAL (SELECT compute_now() - interval '1 day' + interval '1 hour' * (k * h.slot_h)
                                + interval '1 hour' * (random() * h.slot_h * 0.4) AS s) t
          WHERE k * $1 + (a.n - 1) < $3",
    )
    .bind(atoms)
    .bind(per_atom as i32)
    .bind(bookings)
    .execute(db.pool())
    .await
    .expect("bookings")
    .rows_affected();
    // Statistics, as a database in service has them (autovacuum would take a while).
    sqlx::query("ANALYZE")
        .execute(db.pool())
        .await
        .expect("analyze");
    println!(
        "bookings: {written} over 14 days ({per_atom} slots per GPU), written in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let member = app.member("acme");
    let now: chrono::DateTime<chrono::Utc> = serde_json::from_value(
        app.ok(&member, "{ serverTime }", json!({})).await["serverTime"].clone(),
    )
    .expect("a time");
    // What the search reads of the bookings, as PostgreSQL plans it at this scale: the scan
    // and its index, the rows it returned and the rows in the table.
    let plan: (Value,) = sqlx::query_as(&format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) {}",
        compute_domain::reservations::availability::POOL_BOOKINGS
    ))
    .bind(&pool)
    .bind(now)
    .bind(now + chrono::Duration::days(14))
    .fetch_one(db.pool())
    .await
    .expect("the bookings' plan");
    let (total,): (i64,) = sqlx::query_as("SELECT count(*) FROM device_bookings")
        .fetch_one(db.pool())
        .await
        .expect("count");
    let scan = &plan.0[0]["Plan"];
    println!(
        "the first pool's bookings read for 14 days: {}; {} rows of the table's {total}, in {:.1} ms",
        describe_plan(scan),
        scan["Actual Rows"],
        plan.0[0]["Execution Time"].as_f64().unwrap_or(0.0)
    );
    // Warm the connection pool and the plans.
    for _ in 0..5 {
        app.ok(
            &member,
            AVAILABILITY,
            json!({ "p": pool, "a": [{ "gpuCount": 8 }], "d": 3600 }),
        )
        .await;
    }
    println!(
        "\n{:<52} {:>9} {:>9} {:>9}   first window (of the last question)",
        "question", "p50 ms", "p99 ms", "max ms"
    );
    for (count, hours) in [(8, 1), (8, 8), (8, 24), (4, 24), (1, 72)] {
        let mut took = Vec::with_capacity(questions);
        let mut last = Value::Null;
        for q in 0..questions {
            // From now to 12 days ahead, a different start for each question.
            let nb = now + chrono::Duration::minutes(((q * 9_973) % (12 * 24 * 60)) as i64);
            let vars = json!({ "p": pool, "a": [{ "gpuCount": count }], "d": hours * 3600,
                               "nb": nb.to_rfc3339() });
            // A caller per 50 questions, each well within its query budget per minute.
            let caller = app.member(&format!("tenant-{}", q / 50));
            let t = Instant::now();
            let d = app.ok(&caller, AVAILABILITY, vars).await;
            took.push(t.elapsed());
            last = d["availability"]["windows"][0].clone();
        }
        took.sort();
        println!(
            "{:<52} {:>9.1} {:>9.1} {:>9.1}   {}",
            format!(
                "availability: {count} GPU{} on one node for {hours} h",
                if count == 1 { "" } else { "s" }
            ),
            ms(percentile(&took, 0.5)),
            ms(percentile(&took, 0.99)),
            ms(*took.last().expect("one")),
            if last.is_null() {
                "none".to_owned()
            } else {
                format!(
                    "{} (to {})",
                    last["startsAt"].as_str().unwrap_or(""),
                    last["latestStart"].as_str().unwrap_or("")
                )
            }
        );
    }
    let mut took = Vec::new();
    for _ in 0..questions.min(50) {
        let vars = json!({ "p": pool, "from": now.to_rfc3339(), "to": (now + chrono::Duration::days(14)).to_rfc3339() });
        let t = Instant::now();
        app.ok(&member, TIMELINE, vars).await;
        took.push(t.elapsed());
    }
    took.sort();
    println!(
        "{:<52} {:>9.1} {:>9.1} {:>9.1}",
        "capacityTimeline: 14 days in 336 steps of an hour",
        ms(percentile(&took, 0.5)),
        ms(percentile(&took, 0.99)),
        ms(*took.last().expect("one"))
    );
}
