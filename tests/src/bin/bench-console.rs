//! The web console with a large fleet, in a real headless Chromium (issue 16: "it stays fast
//! with 1,000 nodes × 8 GPUs").
//!
//! Builds one pool of `nodes` nodes × 8 H100 (default 1,000: 8,000 GPUs) through the product's
//! commands, books `reservations` of them over the next day through GraphQL, then signs in to
//! the console and prints how long each page takes to show its data, how many DOM elements it
//! holds and the page's JavaScript heap: the fleet page with the pool's node list opened (every
//! node, paged through `computeNodes` 100 at a time), the timeline (every atom of the pool and
//! the reservations over now ± a day), and a scroll of each virtualised list to its end.
//! Screenshots go to `target/browser/bench-*.png`.
//!
//! Asserts nothing but that the pages show what was built: a benchmark, not a test.
//!
//! ```sh
//! cargo build --release -p compute-tests
//! target/release/bench-console [nodes] [reservations]
//! ```

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::{Duration, Instant};

use compute_tests::cdp::Browser;
use serde_json::json;

const CREATE: &str =
    "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id } } }";

async fn timed(b: &Browser, what: &str, condition: &str) -> Duration {
    let started = Instant::now();
    b.wait_for(condition, Duration::from_secs(300)).await;
    let took = started.elapsed();
    let dom = b.eval("document.getElementsByTagName('*').length").await;
    let heap = b.call("Performance.getMetrics", json!({})).await;
    let used = heap["metrics"]
        .as_array()
        .and_then(|m| m.iter().find(|x| x["name"] == "JSHeapUsedSize"))
        .and_then(|x| x["value"].as_f64())
        .unwrap_or(0.0);
    println!(
        "{what:<44} {:>7.0} ms   {dom:>6} DOM elements   JS heap {:>5.1} MiB",
        took.as_secs_f64() * 1000.0,
        used / 1048576.0
    );
    took
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let nodes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let reservations: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(300);
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .start()
        .await;
    let started = Instant::now();
    let pools = compute_tests::bench::gpu_fleet(&app.db.db, 1, nodes, 8).await;
    let pool = pools[0].to_string();
    println!(
        "fleet: 1 pool, {nodes} nodes × 8 H100 ({} GPUs), built in {:.1} s",
        nodes * 8,
        started.elapsed().as_secs_f64()
    );
    let operator = app.operator();
    app.ok(
        &operator,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": pool, "gpus": 100000.0, "vcpu": 10000000, "memoryMib": 1000000000 } }),
    )
    .await;
    let member = app.member("acme");
    let now: chrono::DateTime<chrono::Utc> = serde_json::from_value(
        app.ok(&member, "{ serverTime }", json!({})).await["serverTime"].clone(),
    )
    .expect("a time");
    for i in 0..reservations {
        // Spread over the next 20 hours, 1 to 4 GPUs for 1 to 6 hours.
        let start = now + chrono::Duration::minutes(((i * 37) % (20 * 60)) as i64 + 5);
        let end = start + chrono::Duration::hours(1 + (i % 6) as i64);
        app.ok(
            &member,
            CREATE,
            json!({ "i": {
                "poolId": pool, "startsAt": start, "endsAt": end, "idempotencyKey": format!("bench-console-{i}"),
                "allocations": [{ "gpuKind": "GPU", "gpuCount": 1 + (i % 4), "model": "H100" }],
            } }),
        )
        .await;
    }
    println!("{reservations} reservations over the next 20 hours\n");

    let b = Browser::launch(1440, 1000).await;
    b.call("Performance.enable", json!({})).await;
    b.goto(&app.url("/")).await;
    b.wait_for("document.querySelector('#token')", Duration::from_secs(30))
        .await;
    b.fill("#token", &operator).await;
    b.click("#sign-in", 1).await;
    timed(
        &b,
        "fleet page (sites, pools, capacity)",
        "document.querySelector('.site .cap')",
    )
    .await;
    b.click(".pool h3 button.link", 1).await;
    timed(
        &b,
        &format!("fleet: the pool's {nodes} nodes listed"),
        &format!("(document.querySelector('.node-summary') || {{}}).textContent?.startsWith('{nodes} nodes')"),
    )
    .await;
    b.eval("document.querySelector('.nodes .vlist').scrollTop = 1e9")
        .await;
    timed(
        &b,
        "fleet: scrolled to the last node",
        &format!(
            "[...document.querySelectorAll('.node-row')].some(e => parseInt(e.style.top) === {})",
            (nodes - 1) * 34
        ),
    )
    .await;
    b.screenshot(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/browser/bench-fleet.png"
    )))
    .await;
    b.eval("window.location.hash = '#/timeline'").await;
    timed(
        &b,
        "timeline: the pool's reservations over ± 1 day",
        &format!(
            "(t => t && (t.startsWith('{total} atoms') || t.includes(' of {total} ')))((document.querySelector('.gantt-axis') || {{}}).textContent)",
            total = nodes * 8
        ),
    )
    .await;
    let shown = b
        .eval("document.querySelector('.gantt-axis').textContent")
        .await;
    println!("  timeline says: {shown}");
    b.screenshot(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/browser/bench-timeline.png"
    )))
    .await;
    let rows = b
        .eval("parseInt(document.querySelector('#timeline .vlist-inner').style.height) / 24")
        .await
        .as_f64()
        .unwrap_or(1.0) as usize;
    b.eval("document.querySelector('#timeline .vlist').scrollTop = 1e9")
        .await;
    timed(
        &b,
        &format!("timeline: scrolled to the last of {rows} rows"),
        &format!(
            "[...document.querySelectorAll('#timeline .gantt-row')].some(e => parseInt(e.style.top) === {})",
            rows.saturating_sub(1) * 24
        ),
    )
    .await;
    let problems = b.problems.lock().expect("lock").clone();
    if !problems.is_empty() {
        println!("\nproblems the page reported: {problems:?}");
    }
}
