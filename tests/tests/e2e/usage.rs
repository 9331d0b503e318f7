//! Usage windows for billing, on the simulated clock: what a window bills (prorated, weighted as
//! quotas weigh GPUs), what an extension and an early release change, the late change that only
//! an adjustment can record, a meter SIGKILLed while catching up and its successor writing each
//! window once, an outage caught up in order, and billing that goes on while a node is
//! disconnected and stops when a lost node's reservation fails. Read back through the graph, the
//! CSV export and the outbox.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use compute_tests::TestApp;
use compute_workers::usage::UsageMeter;
use serde_json::{Value, json};

use crate::reservations::CREATE;

const T0: &str = "2031-01-01T09:20:00Z";
const WAIT: Duration = Duration::from_secs(60);

/// The simulated time `secs` after [`T0`], as RFC 3339.
fn at(secs: i64) -> String {
    let t0 = chrono::DateTime::parse_from_rfc3339(T0).expect("T0");
    (t0 + chrono::Duration::seconds(secs)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Creates a reservation from now to `ends_at` as `token`; its id and its allocations' ids.
async fn reserve(
    app: &TestApp,
    token: &str,
    pool: &str,
    key: &str,
    ends_at: &str,
    allocations: Value,
) -> (String, Vec<String>) {
    let d = app
        .ok(
            token,
            CREATE,
            json!({ "i": { "poolId": pool, "endsAt": ends_at, "allocations": allocations, "idempotencyKey": key } }),
        )
        .await;
    let r = &d["createReservation"]["reservation"];
    assert_eq!(r["state"], "ACTIVE", "{d}");
    let allocations = r["allocations"]
        .as_array()
        .expect("allocations")
        .iter()
        .map(|a| a["id"].as_str().expect("id").to_owned())
        .collect();
    (r["id"].as_str().expect("id").to_owned(), allocations)
}

/// Each allocation's records: (window start as RFC 3339, seq) → booked seconds, as text.
async fn records_of(app: &TestApp, allocation: &str) -> BTreeMap<(String, i32), String> {
    sqlx::query_as::<_, (String, i32, String)>(
        "SELECT compute_json_time(window_start), seq, compute_amount_text(booked_seconds)
           FROM usage_records WHERE allocation_id = $1",
    )
    .bind(allocation)
    .fetch_all(app.db.db.pool())
    .await
    .expect("records")
    .into_iter()
    .map(|(w, s, b)| ((w, s), b))
    .collect()
}

fn windows(pairs: &[(&str, i32, &str)]) -> BTreeMap<(String, i32), String> {
    pairs
        .iter()
        .map(|(w, s, b)| ((format!("2031-01-01T{w}:00:00Z"), *s), (*b).to_owned()))
        .collect()
}

/// Moves the clock `seconds` on, runs a pass of `meter` (the worker's), then settles the meter:
/// passes until every committed reservation change is checked (the check reads below the
/// cluster-wide commit-safe horizon, which other tests' open transactions can hold back).
async fn step(
    app: &TestApp,
    meter: &mut UsageMeter,
    seconds: i64,
) -> compute_domain::usage::MeterPass {
    let mut p = step_once(app, meter, seconds).await;
    let rest = compute_domain::usage::settle(&app.db.db, Duration::from_millis(20), WAIT)
        .await
        .expect("settle the meter");
    assert!(!rest.more, "the meter settled within {WAIT:?}");
    p.windows_closed += rest.windows_closed;
    p.records += rest.records;
    p.checked += rest.checked;
    p
}

/// Moves the clock `seconds` on and runs a pass of `meter`.
async fn step_once(
    app: &TestApp,
    meter: &mut UsageMeter,
    seconds: i64,
) -> compute_domain::usage::MeterPass {
    app.db.advance_clock(seconds).await;
    meter.pass().await.expect("meter pass")
}

const REPORT: &str = "query($t: String, $from: DateTime!, $to: DateTime!, $g: [UsageGroupBy!]) {
  usage(tenantId: $t, from: $from, to: $to, groupBy: $g) {
    tenantId closedThrough windowSeconds
    total { records bookedSeconds gpuSeconds vcpuSeconds memoryMibSeconds diskGibSeconds }
    groups { edges { node { tenantId poolId model gpuKind profile reservationId
      amounts { records bookedSeconds gpuSeconds vcpuSeconds } } } pageInfo { hasNextPage } }
  } }";

/// The report's groups page by key: a group that appears before the page's cursor between two
/// pages (a window closing, a late first record) neither repeats a group nor hides one. With
/// an offset, the next page began with the last group of the one before.
#[tokio::test]
async fn report_groups_page_by_key_and_a_group_added_between_pages_repeats_none() {
    let app = compute_tests::spawn_app().await;
    let db = app.db.db.pool();
    sqlx::query(
        "INSERT INTO usage_periods (window_start, window_end, closed) \
         VALUES ('2031-01-01T00:00:00Z', '2031-01-01T01:00:00Z', true)",
    )
    .execute(db)
    .await
    .expect("period");
    let record = |n: i32| {
        sqlx::query(
            "INSERT INTO usage_records (key, kind, seq, allocation_id, reservation_id, tenant_id, pool_id, \
                    window_start, window_end, model, gpu_kind, atoms, booked_seconds, gpu_seconds, \
                    vcpu_seconds, memory_mib_seconds, disk_gib_seconds) \
             SELECT 'cmp:' || a || ':' || compute_json_time('2031-01-01T00:00:00Z'), 'window', 0, a, \
                    'rsv_' || lpad(to_hex($1), 32, '0'), 'acme', 'pool_' || repeat('0', 32), \
                    '2031-01-01T00:00:00Z', '2031-01-01T01:00:00Z', 'H100', 'gpu', 1, 60, 60, 0, 0, 0 \
               FROM (SELECT 'alc_' || lpad(to_hex($1), 32, '0') AS a) s",
        )
        .bind(n)
        .execute(db)
    };
    for n in [2, 3, 4] {
        record(n).await.expect("record");
    }
    const PAGE: &str = "query($after: String) { usage(tenantId: \"acme\", from: \"2031-01-01T00:00:00Z\", \
        to: \"2031-01-02T00:00:00Z\", groupBy: [RESERVATION]) { groups(first: 1, after: $after) { \
        edges { cursor node { reservationId } } pageInfo { hasNextPage hasPreviousPage } } } }";
    let op = app.operator();
    let page = |after: Value| {
        let (app, op) = (&app, op.clone());
        async move { app.ok(&op, PAGE, json!({ "after": after })).await["usage"]["groups"].clone() }
    };
    let id = |n: i32| format!("rsv_{n:032x}");
    let first = page(Value::Null).await;
    assert_eq!(first["edges"][0]["node"]["reservationId"], id(2));
    assert_eq!(first["pageInfo"]["hasPreviousPage"], false);
    // A group that sorts before the cursor appears between the pages.
    record(1).await.expect("record");
    let second = page(first["edges"][0]["cursor"].clone()).await;
    assert_eq!(
        second["edges"][0]["node"]["reservationId"],
        id(3),
        "the group after the cursor, not the cursor's own again: {second}"
    );
    assert_eq!(second["pageInfo"]["hasPreviousPage"], true);
    let third = page(second["edges"][0]["cursor"].clone()).await;
    assert_eq!(third["edges"][0]["node"]["reservationId"], id(4));
    assert_eq!(third["pageInfo"]["hasNextPage"], false);
    let (code, e) = app
        .fails(&op, PAGE, json!({ "after": "not-a-cursor" }))
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{e}");
}

/// A record whose end differs from its window's period (written before migration 0046 by a
/// window whose length changed part-way) made the check pair one window twice and write the
/// same adjustment key twice: a unique violation at every pass, the meter stopped for good.
/// The check keys a window by its period, so the next change of that reservation checks it
/// once. Changes that cannot move bookings (`reservation.conditions_changed` among them) are
/// not read at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_cut_short_by_an_old_length_change_does_not_stop_the_meter() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let mut meter = UsageMeter::new(app.db.db.clone(), "meter-a");
    let h100 = json!([{ "gpuCount": 1, "model": "H100" }]);
    let (r, a) = reserve(&app, &acme, &p.pool, "cut", &at(8400), h100).await;
    // To 11:01: the 09:00 and 10:00 windows close.
    step(&app, &mut meter, 6060).await;
    assert_eq!(
        records_of(&app, &a[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600")])
    );
    // The 10:00 record as the old code could leave it: ending at 10:10, not at its period's end.
    sqlx::query(
        "UPDATE usage_records SET window_end = '2031-01-01T10:10:00Z' \
          WHERE allocation_id = $1 AND window_start = '2031-01-01T10:00:00Z'",
    )
    .bind(&a[0])
    .execute(app.db.db.pool())
    .await
    .expect("cut short");
    // A release is read, and checks both closed windows once; a change after it that moves
    // nothing booked is not read (the meter's position stays at the release).
    app.ok(
        &acme,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": r } }),
    )
    .await;
    sqlx::query("SELECT compute_emit('reservation.conditions_changed', 'acme', $1, '{}')")
        .bind(&r)
        .execute(app.db.db.pool())
        .await
        .expect("emit");
    step(&app, &mut meter, 60).await;
    let (at_release,): (bool,) = sqlx::query_as(
        "SELECT (m.checked_txid, m.checked_seq) = (o.txid, o.seq) FROM usage_meter m, \
                (SELECT txid, seq FROM outbox WHERE type = 'reservation.released' AND subject = $1) o",
    )
    .bind(&r)
    .fetch_one(app.db.db.pool())
    .await
    .expect("the meter's position");
    assert!(
        at_release,
        "the meter read the release and nothing after it"
    );
    assert_eq!(
        records_of(&app, &a[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600")]),
        "nothing to adjust in the closed windows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_bill_exactly_the_booked_seconds_and_an_extension_or_release_only_what_it_changes()
{
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let mut meter = UsageMeter::new(app.db.db.clone(), "meter-a");

    // At 09:20: a whole H100 to 11:40 (three windows), a MIG 3g.40gb instance to 10:50, one to
    // be extended (to 10:30, then 11:30) and one to be released early (at 10:15).
    let h100 =
        json!([{ "gpuCount": 1, "model": "H100", "vcpu": 4, "memoryMib": 1024, "diskGib": 10 }]);
    let (r_three, a_three) = reserve(&app, &acme, &p.pool, "three", &at(8400), h100.clone()).await;
    let (_, a_mig) = reserve(
        &app,
        &acme,
        &p.pool,
        "mig",
        &at(5400),
        json!([{ "gpuKind": "MIG", "gpuCount": 1, "profile": "3g.40gb" }]),
    )
    .await;
    let (r_ext, a_ext) = reserve(
        &app,
        &acme,
        &p.pool,
        "ext",
        &at(4200),
        json!([{ "gpuCount": 1, "model": "H100" }]),
    )
    .await;
    let (r_rel, a_rel) = reserve(
        &app,
        &app.member("globex"),
        &p.pool,
        "rel",
        &at(8400),
        json!([{ "gpuCount": 1, "model": "H100",
                 "tolerations": [{ "key": "dedicated", "value": "train", "effect": "NO_SCHEDULE" }] }]),
    )
    .await;

    // Nothing is due before 10:01 (the 09:00 window's end and the minute of grace).
    assert_eq!(step(&app, &mut meter, 40 * 60).await.windows_closed, 0);
    let pass = step(&app, &mut meter, 61).await;
    assert_eq!((pass.windows_closed, pass.records), (1, 4), "{pass:?}");

    // At 10:10 the extension, at 10:15 the release: both change the open window and later
    // ones only, so no adjustment is ever written.
    app.db.advance_clock(9 * 60 - 1).await;
    app.ok(
        &acme,
        "mutation($i: ExtendReservationInput!) { extendReservation(input: $i) { reservation { endsAt } } }",
        json!({ "i": { "id": r_ext, "endsAt": at(7800), "idempotencyKey": "ext-1" } }),
    )
    .await;
    app.db.advance_clock(5 * 60).await;
    app.ok(
        &app.member("globex"),
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": r_rel } }),
    )
    .await;
    // To 12:01: the 10:00 and 11:00 windows close, in order.
    let pass = step(&app, &mut meter, 106 * 60).await;
    assert_eq!(pass.windows_closed, 2, "{pass:?}");
    assert_eq!(
        pass.checked, 0,
        "no change landed in a closed window: {pass:?}"
    );

    assert_eq!(
        records_of(&app, &a_three[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600"), ("11", 0, "2400")])
    );
    assert_eq!(
        records_of(&app, &a_mig[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3000")])
    );
    assert_eq!(
        records_of(&app, &a_ext[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600"), ("11", 0, "1800")]),
        "extended from 10:30 to 11:30"
    );
    assert_eq!(
        records_of(&app, &a_rel[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "900")]),
        "released at 10:15"
    );
    // The weights and scalars of the records: a MIG 3g instance is 3/7 of a GPU, each record
    // rounded once to six decimals (1028.571429 + 1285.714286).
    let (gpu, vcpu, mem, disk): (String, String, String, String) = sqlx::query_as(
        "SELECT compute_amount_text(sum(gpu_seconds)), compute_amount_text(sum(vcpu_seconds)),
                compute_amount_text(sum(memory_mib_seconds)), compute_amount_text(sum(disk_gib_seconds))
           FROM usage_records WHERE allocation_id = $1",
    )
    .bind(&a_mig[0])
    .fetch_one(app.db.db.pool())
    .await
    .expect("mig sums");
    assert_eq!(
        (gpu.as_str(), vcpu.as_str(), mem.as_str(), disk.as_str()),
        ("2314.285715", "0", "0", "0")
    );
    let (gpu, vcpu, mem, disk): (String, String, String, String) = sqlx::query_as(
        "SELECT compute_amount_text(sum(gpu_seconds)), compute_amount_text(sum(vcpu_seconds)),
                compute_amount_text(sum(memory_mib_seconds)), compute_amount_text(sum(disk_gib_seconds))
           FROM usage_records WHERE allocation_id = $1",
    )
    .bind(&a_three[0])
    .fetch_one(app.db.db.pool())
    .await
    .expect("h100 sums");
    assert_eq!(
        (gpu.as_str(), vcpu.as_str(), mem.as_str(), disk.as_str()),
        ("8400", "33600", "8601600", "84000")
    );

    // One usage.window_closed event per record, about its allocation, keyed as the record.
    let events: Vec<(String, Option<String>, String, Value)> = sqlx::query_as(
        "SELECT type, tenant_id, subject, data FROM outbox WHERE type LIKE 'usage.%' ORDER BY txid, seq",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(events.len(), 10);
    for (t, tenant, subject, data) in &events {
        assert_eq!(t, "usage.window_closed");
        assert_eq!(data["usage"]["allocationId"], json!(subject));
        assert_eq!(data["usage"]["tenantId"], json!(tenant));
        assert_eq!(
            data["usage"]["key"],
            json!(format!(
                "cmp:{subject}:{}",
                data["usage"]["windowStart"].as_str().expect("start")
            ))
        );
    }

    // The graph: acme's usage by reservation adds up to its total; globex's is its own.
    let vars =
        |g: Value| json!({ "from": "2031-01-01T09:00:00Z", "to": "2031-01-01T12:00:00Z", "g": g });
    let d = app.ok(&acme, REPORT, vars(json!(["RESERVATION"]))).await;
    let u = &d["usage"];
    assert_eq!(u["tenantId"], "acme");
    assert_eq!(u["closedThrough"], "2031-01-01T12:00:00+00:00");
    assert_eq!(u["windowSeconds"], 3600);
    assert_eq!(
        u["total"],
        json!({ "records": 8, "bookedSeconds": "21600", "gpuSeconds": "18514.285715",
                "vcpuSeconds": "33600", "memoryMibSeconds": "8601600", "diskGibSeconds": "84000" })
    );
    let groups: HashMap<String, Value> = u["groups"]["edges"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|e| {
            (
                e["node"]["reservationId"].as_str().expect("id").to_owned(),
                e["node"]["amounts"].clone(),
            )
        })
        .collect();
    assert_eq!(groups.len(), 3);
    assert_eq!(groups[&r_three]["bookedSeconds"], "8400");
    assert_eq!(groups[&r_ext]["bookedSeconds"], "7800");
    let d = app.ok(&acme, REPORT, vars(json!(["MODEL"]))).await;
    let models: Vec<(Value, Value, Value, Value)> = d["usage"]["groups"]["edges"]
        .as_array()
        .expect("groups")
        .iter()
        .map(|e| {
            let n = &e["node"];
            (
                n["model"].clone(),
                n["gpuKind"].clone(),
                n["profile"].clone(),
                n["amounts"]["gpuSeconds"].clone(),
            )
        })
        .collect();
    assert_eq!(
        models,
        [
            (
                json!("A100"),
                json!("MIG"),
                json!("3g.40gb"),
                json!("2314.285715")
            ),
            (json!("H100"), json!("GPU"), Value::Null, json!("16200")),
        ]
    );
    // A member asking for another tenant gets its own; an operator gets what it asks for.
    let d = app
        .ok(
            &acme,
            REPORT,
            json!({ "t": "globex", "from": "2031-01-01T09:00:00Z", "to": "2031-01-01T12:00:00Z" }),
        )
        .await;
    assert_eq!(d["usage"]["tenantId"], "acme");
    let d = app
        .ok(&app.operator(), REPORT, json!({ "t": "globex", "from": "2031-01-01T09:00:00Z", "to": "2031-01-01T12:00:00Z", "g": ["TENANT"] }))
        .await;
    assert_eq!(d["usage"]["total"]["bookedSeconds"], "3300");
    let d = app
        .ok(&app.operator(), REPORT, json!({ "from": "2031-01-01T10:00:00Z", "to": "2031-01-01T11:00:00Z", "g": ["TENANT"] }))
        .await;
    assert_eq!(
        d["usage"]["total"]["records"], 4,
        "the 10:00 window only: {d}"
    );
    // Bad ranges are BAD_USER_INPUT on `to`.
    for (from, to) in [
        ("2031-01-01T12:00:00Z", "2031-01-01T09:00:00Z"),
        ("2030-01-01T00:00:00Z", "2031-06-01T00:00:00Z"),
    ] {
        let (code, body) = app
            .fails(&acme, REPORT, json!({ "from": from, "to": to }))
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{body}");
        assert_eq!(body["extensions"]["field"], "to");
    }

    // The CSV export: a header and one line per record, in (window, key) order.
    let csv = |token: Option<String>, query: &str| {
        let mut req = app.http.get(app.url(&format!("/usage.csv?{query}")));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move {
            let res = req.send().await.expect("get");
            let status = res.status().as_u16();
            let ct = res
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap_or("").to_owned());
            (status, ct, res.text().await.expect("body"))
        }
    };
    let range = "from=2031-01-01T09:00:00Z&to=2031-01-01T12:00:00Z";
    let (status, ct, body) = csv(Some(acme.clone()), range).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(ct.as_deref(), Some("text/csv; charset=utf-8"));
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines[0], compute_api::transport::csv::HEADER.trim_end());
    assert_eq!(lines.len(), 1 + 8, "{body}");
    let first: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(first[6], "2031-01-01T09:00:00Z");
    assert_eq!(first[2], "acme");
    let sum: f64 = lines[1..]
        .iter()
        .map(|l| {
            l.split(',')
                .nth(12)
                .expect("booked")
                .parse::<f64>()
                .expect("number")
        })
        .sum();
    assert_eq!(sum, 21600.0);
    let (status, _, body) = csv(Some(app.operator()), range).await;
    assert_eq!((status, body.lines().count()), (200, 1 + 10));
    let (status, _, body) = csv(None, range).await;
    assert_eq!(status, 401);
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("json")["errors"][0]["extensions"]["code"],
        "UNAUTHENTICATED"
    );
    let (status, _, body) = csv(Some(acme.clone()), "from=yesterday&to=2031-01-01T12:00:00Z").await;
    assert_eq!(status, 400);
    let e = &serde_json::from_str::<Value>(&body).expect("json")["errors"][0]["extensions"];
    assert_eq!(
        (e["code"].as_str(), e["field"].as_str()),
        (Some("BAD_USER_INPUT"), Some("from"))
    );
    let (status, _, _) = csv(Some(app.node_token(&p.nodes[0])), range).await;
    assert_eq!(status, 403, "a node token is neither member nor operator");
}

/// A release whose transaction began before a window's end (its time is the transaction's) and
/// commits after the meter closed the window: the window was billed to the old end, and only an
/// adjustment can record what the release changed. The release reads its time, then waits on the
/// tenant's quota rows (it refunds them first) while time passes and the meter closes the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_commits_after_its_window_closed_is_an_adjustment() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let mut meter = UsageMeter::new(app.db.db.clone(), "meter-a");
    let (r, a) = reserve(
        &app,
        &acme,
        &p.pool,
        "late",
        &at(3 * 3600),
        json!([{ "gpuCount": 1, "vcpu": 2 }]),
    )
    .await;
    // To 09:59:50, then the release starts and waits on the quota rows.
    app.db.advance_clock(39 * 60 + 50).await;
    let mut holder = app.db.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM quota_usage WHERE tenant_id = 'acme' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .expect("hold the quota rows");
    let release = app.graphql_in_background(
        &acme,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state endedAt } } }",
        json!({ "i": { "id": r } }),
    );
    app.until_lock_waiters(1).await;
    // 10:01:00: the 09:00 window closes with the booking still to 12:20.
    // The worker's pass only: settling would wait on the horizon while the release waits on us.
    let pass = step_once(&app, &mut meter, 70).await;
    assert_eq!((pass.windows_closed, pass.records), (1, 1), "{pass:?}");
    holder.commit().await.expect("let the release go");
    let d = release.await.expect("release task");
    assert_eq!(
        d["data"]["releaseReservation"]["reservation"]["endedAt"], "2031-01-01T09:59:50+00:00",
        "{d}"
    );
    let pass = step(&app, &mut meter, 3600).await;
    assert_eq!(pass.checked, 1, "one adjustment: {pass:?}");
    assert_eq!(
        records_of(&app, &a[0]).await,
        windows(&[("09", 0, "2400"), ("09", 1, "-10")]),
        "the window billed 2,400 s, its adjustment -10 s; the 10:00 window bills nothing"
    );
    let (key, kind, vcpu): (String, String, String) = sqlx::query_as(
        "SELECT data->'usage'->>'key', data->'usage'->>'kind', data->'usage'->>'vcpuSeconds'
           FROM outbox WHERE type = 'usage.window_adjusted'",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("the adjustment's event");
    assert_eq!(key, format!("cmp:{}:2031-01-01T09:00:00Z:adj:1", a[0]));
    assert_eq!((kind.as_str(), vcpu.as_str()), ("adjustment", "-20"));
    // Checking again changes nothing: the adjustment is written once.
    let pass = step(&app, &mut meter, 3600).await;
    assert_eq!(pass.checked, 0, "{pass:?}");
    let d = app
        .ok(
            &acme,
            REPORT,
            json!({ "from": "2031-01-01T09:00:00Z", "to": "2031-01-01T13:00:00Z" }),
        )
        .await;
    assert_eq!(d["usage"]["total"]["bookedSeconds"], "2390");
    assert_eq!(d["usage"]["total"]["records"], 2);
}

/// Every window between the first booking and the meter's end, from the database alone: the
/// periods are contiguous, each allocation has one window record per window its bookings
/// overlap and none for others, records sum to its booked time, and each record has one event.
async fn check_exactly_once(app: &TestApp) -> (i64, i64) {
    let db = app.db.db.pool();
    let (periods, gaps, open): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE next_start IS NOT NULL AND next_start <> window_end),
                count(*) FILTER (WHERE NOT closed)
           FROM (SELECT window_start, window_end, closed, lead(window_start) OVER (ORDER BY window_start) AS next_start
                   FROM usage_periods) p",
    )
    .fetch_one(db)
    .await
    .expect("periods");
    assert_eq!(
        (gaps, open),
        (0, 0),
        "contiguous and closed: {periods} periods"
    );
    let (missing, extra): (i64, i64) = sqlx::query_as(
        "WITH expected AS (
             SELECT DISTINCT b.allocation_id, p.window_start FROM device_bookings b
               JOIN usage_periods p ON tstzrange(p.window_start, p.window_end) && b.during
              WHERE b.allocation_id IS NOT NULL),
              actual AS (SELECT allocation_id, window_start FROM usage_records WHERE seq = 0)
         SELECT (SELECT count(*) FROM (SELECT * FROM expected EXCEPT SELECT * FROM actual) m),
                (SELECT count(*) FROM (SELECT * FROM actual EXCEPT SELECT * FROM expected) e)",
    )
    .fetch_one(db)
    .await
    .expect("records");
    assert_eq!(
        (missing, extra),
        (0, 0),
        "a window record for each window an allocation held"
    );
    let (window_records, pairs): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT (allocation_id, window_start)) FROM usage_records WHERE kind = 'window'",
    )
    .fetch_one(db)
    .await
    .expect("pairs");
    assert_eq!(
        window_records, pairs,
        "no window billed twice for one allocation"
    );
    let wrong: Vec<(String, String, String)> = sqlx::query_as(
        "WITH billed AS (SELECT allocation_id, sum(booked_seconds) AS s FROM usage_records GROUP BY 1),
              span AS (SELECT min(window_start) AS f, max(window_end) AS t FROM usage_periods),
              booked AS (SELECT b.allocation_id,
                                sum(extract(epoch FROM upper(b.during * tstzrange(span.f, span.t)) - lower(b.during * tstzrange(span.f, span.t)))) AS s,
                                count(*) AS atoms
                           FROM device_bookings b, span WHERE b.allocation_id IS NOT NULL AND b.during && tstzrange(span.f, span.t)
                          GROUP BY 1)
         SELECT k.allocation_id, coalesce(b.s, 0)::text, (k.s / k.atoms)::text FROM booked k LEFT JOIN billed b USING (allocation_id)
          WHERE coalesce(b.s, 0) <> k.s / k.atoms",
    )
    .fetch_all(db)
    .await
    .expect("sums");
    assert!(
        wrong.is_empty(),
        "billed ≠ booked (allocation, billed, booked): {wrong:?}"
    );
    let (records, events, keys): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM usage_records),
                (SELECT count(*) FROM outbox WHERE type LIKE 'usage.%'),
                (SELECT count(DISTINCT data->'usage'->>'key') FROM outbox WHERE type LIKE 'usage.%')",
    )
    .fetch_one(db)
    .await
    .expect("events");
    assert_eq!((events, keys), (records, records), "one event per record");
    (periods, records)
}

fn meter_process(app: &TestApp) -> tokio::process::Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args([
            "--role",
            "reconcile",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--usage-every-seconds",
            "0.05",
            "--usage-window-seconds",
            "60",
        ])
        .envs(app.db.process_env())
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker process")
}

async fn closed_periods(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM usage_periods WHERE closed")
        .fetch_one(app.db.db.pool())
        .await
        .expect("periods")
}

/// A day of one-minute windows for four allocations, caught up by a real worker process that is
/// SIGKILLed part-way; a second process takes the lease over and finishes. Each window is
/// written exactly once (checked in SQL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_meter_and_its_successor_write_each_window_once() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let day = 24 * 3600;
    reserve(
        &app,
        &acme,
        &p.pool,
        "k1",
        &at(day),
        json!([{ "gpuCount": 2, "model": "H100", "vcpu": 8 }]),
    )
    .await;
    reserve(
        &app,
        &acme,
        &p.pool,
        "k2",
        &at(day - 1234),
        json!([{ "gpuKind": "MIG", "gpuCount": 1, "profile": "1g.10gb" }]),
    )
    .await;
    reserve(
        &app,
        &acme,
        &p.pool,
        "k3",
        &at(day / 2),
        json!([{ "gpuKind": "SLOT", "gpuCount": 2, "slotsPerGpu": 4 }]),
    )
    .await;
    app.db.advance_clock(day + 180).await;

    let mut first = meter_process(&app);
    // Killed early in its catch-up (1,440 windows), so the kill lands mid-way whatever the load.
    compute_tests::eventually("the first worker closes windows", WAIT, || async {
        (closed_periods(&app).await >= 100).then_some(())
    })
    .await;
    first.kill().await.expect("SIGKILL");
    let at_kill = closed_periods(&app).await;
    assert!(at_kill < 1440, "killed part-way: {at_kill} windows closed");
    // Its lease runs out (15 s of business time); a second process takes over.
    app.db.advance_clock(16).await;
    let _second = meter_process(&app);
    compute_tests::eventually("the second worker closes the rest", WAIT, || async {
        let m = compute_domain::usage::meter(&app.db.db)
            .await
            .expect("meter");
        let due = chrono::DateTime::parse_from_rfc3339(&at(day)).expect("end");
        m.closed_through.filter(|c| *c >= due).map(|_| ())
    })
    .await;
    let (periods, records) = check_exactly_once(&app).await;
    eprintln!(
        "usage: {at_kill} windows closed before the SIGKILL, {periods} in all, {records} records"
    );
    let owners: i64 = sqlx::query_scalar("SELECT epoch FROM leases WHERE name = 'singleton:usage'")
        .fetch_one(app.db.db.pool())
        .await
        .expect("lease");
    assert_eq!(owners, 2, "the second process took the lease over");
}

/// No worker ran for two hours: the next pass closes the missed windows in order, with no gap
/// and no duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_of_every_worker_is_caught_up_in_order() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let mut meter = UsageMeter::new(app.db.db.clone(), "meter-a");
    let (_, a) = reserve(
        &app,
        &acme,
        &p.pool,
        "o1",
        &at(5 * 3600),
        json!([{ "gpuCount": 1 }]),
    )
    .await;
    assert_eq!(step(&app, &mut meter, 41 * 60 + 1).await.windows_closed, 1);
    // 10:01 → 12:31: two hours without a worker, then one pass.
    let pass = step(&app, &mut meter, 150 * 60).await;
    assert_eq!((pass.windows_closed, pass.records), (2, 2), "{pass:?}");
    assert_eq!(
        records_of(&app, &a[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600"), ("11", 0, "3600")])
    );
    let events: Vec<String> = sqlx::query_scalar(
        "SELECT data->'usage'->>'windowStart' FROM outbox WHERE type = 'usage.window_closed' ORDER BY txid, seq",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(
        events,
        [
            "2031-01-01T09:00:00Z",
            "2031-01-01T10:00:00Z",
            "2031-01-01T11:00:00Z"
        ],
        "in order"
    );
    check_exactly_once(&app).await;
}

/// A node whose daemon went away keeps its reservation's devices, and its reservation keeps
/// billing; a lost node's reservation fails, and billing stops at that moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_node_keeps_billing_and_a_lost_one_stops_when_its_reservation_fails() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let op = app.operator();
    let provider = app
        .ok(&op, crate::fleet::CREATE_POOL, json!({ "i": { "siteId": p.site, "name": "cloud", "kind": "PROVIDER", "lostAfterSeconds": 600 } }))
        .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("pool")
        .to_owned();
    app.ok(
        &op,
        crate::fleet::REGISTER,
        json!({ "i": { "poolId": provider, "hostname": "cloud-1",
            "resources": { "vcpu": 8, "memoryMib": 65536, "diskGib": 100 },
            "devices": [{ "uuid": "GPU-P0", "model": "L4", "memoryMib": 24000 }] } }),
    )
    .await;
    // h100-a's daemon connects, a reservation lands there, the daemon goes away.
    let node = p.nodes[0].clone();
    let session = compute_sim::Session::open(&crate::commands::daemon_config(&app, &node, "j1", 0))
        .await
        .expect("open");
    let (_, on_a) = reserve(
        &app,
        &acme,
        &p.pool,
        "d1",
        &at(2 * 3600),
        json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
    )
    .await;
    let (lost_rsv, on_cloud) = reserve(
        &app,
        &acme,
        &provider,
        "c1",
        &at(2 * 3600),
        json!([{ "gpuCount": 1 }]),
    )
    .await;
    session.bye().await;
    let mut reconciler = compute_workers::Reconciler::new(app.db.db.clone(), "worker");
    let mut meter = UsageMeter::new(app.db.db.clone(), "worker");
    // 10 s steps (the gateway's lease renewed at each) for 15 minutes: h100-a is disconnected,
    // then unreachable; cloud-1 (never connected) unreachable at 40 s, lost at 640 s. Then in
    // half-hour steps to 12:35, when the 11:00 window has closed.
    let mut lost_at = None;
    for step in 0..96 {
        let seconds = if step < 90 { 10 } else { 1800 };
        app.db.advance_clock(seconds).await;
        app.gateway.refresh_lease().await.expect("gateway lease");
        reconciler.pass().await.expect("reconciler pass");
        meter.pass().await.expect("meter pass");
        if lost_at.is_none() {
            let state: String = sqlx::query_scalar("SELECT state FROM reservations WHERE id = $1")
                .bind(&lost_rsv)
                .fetch_one(app.db.db.pool())
                .await
                .expect("state");
            if state == "failed" {
                lost_at = Some(app.db.db.compute_now().await.expect("now"));
            }
        }
    }
    let reach: String = sqlx::query_scalar("SELECT reachability FROM nodes WHERE id = $1")
        .bind(&node)
        .fetch_one(app.db.db.pool())
        .await
        .expect("reachability");
    assert_eq!(reach, "unreachable");
    assert_eq!(
        records_of(&app, &on_a[0]).await,
        windows(&[("09", 0, "2400"), ("10", 0, "3600"), ("11", 0, "1200")]),
        "reserved time is billed while the node is away"
    );
    let lost_at = lost_at.expect("the cloud reservation failed");
    let t0 = chrono::DateTime::parse_from_rfc3339(T0).expect("T0");
    let expected = (lost_at - t0.with_timezone(&chrono::Utc)).num_seconds();
    assert!(
        (640..=700).contains(&expected),
        "failed {expected} s after it began"
    );
    let billed: String = sqlx::query_scalar(
        "SELECT compute_amount_text(sum(booked_seconds)) FROM usage_records WHERE allocation_id = $1",
    )
    .bind(&on_cloud[0])
    .fetch_one(app.db.db.pool())
    .await
    .expect("billed");
    assert_eq!(
        billed,
        expected.to_string(),
        "billed up to the failure, not a second more"
    );
    check_exactly_once(&app).await;
}

/// A window keeps the length it began with when the meter's length changes between two of its
/// batches (a worker started with another `--usage-window-seconds`): the batches after the
/// change bill to the same end, and the next window, of the new length, starts there. (The
/// rest of the window was billed to the new, shorter end, and the next window's period then
/// overlapped this one's: the meter failed at every pass.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_keeps_its_length_when_the_meter_changes_between_its_batches() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    for key in ["a", "b"] {
        reserve(
            &app,
            &acme,
            &p.pool,
            key,
            &at(8400),
            json!([{ "gpuCount": 1, "model": "H100" }]),
        )
        .await;
    }
    let db = &app.db.db;
    // 10:01: the 09:00 window is due; its first batch takes one of the two allocations.
    app.db.advance_clock(41 * 60).await;
    let first = compute_domain::usage::close_batch(db, 1)
        .await
        .expect("batch");
    assert_eq!((first.written, first.closed), (1, false), "{first:?}");
    assert!(
        compute_domain::usage::set_window(db, 600)
            .await
            .expect("window")
    );
    let second = compute_domain::usage::close_batch(db, 10)
        .await
        .expect("batch");
    assert_eq!(
        (second.written, second.closed, second.window_end),
        (1, true, first.window_end),
        "the rest of the window, to the same end"
    );
    let ends: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT compute_json_time(window_end) FROM usage_records WHERE window_start = $1",
    )
    .bind(first.window_start)
    .fetch_all(db.pool())
    .await
    .expect("ends");
    assert_eq!(ends, ["2031-01-01T10:00:00Z"]);
    // The next window has the new length and closes once due.
    app.db.advance_clock(11 * 60).await;
    let next = compute_domain::usage::close_batch(db, 10)
        .await
        .expect("the next window closes");
    assert_eq!(
        (next.window_start, next.window_end - next.window_start),
        (first.window_end, chrono::Duration::seconds(600))
    );
    assert!(next.closed && next.written == 2, "{next:?}");
    // A meter that the old definition left inside a closed period (10:05, in 10:00-10:10) goes
    // on from that period's end, instead of failing on the periods' overlap at every pass.
    sqlx::query("UPDATE usage_meter SET closed_through = closed_through - interval '5 minutes'")
        .execute(db.pool())
        .await
        .expect("wedge");
    app.db.advance_clock(10 * 60).await;
    let after = compute_domain::usage::close_batch(db, 10)
        .await
        .expect("the meter goes on");
    assert_eq!(after.window_start, next.window_end, "{after:?}");
}

/// The outbox's retention prune waits for the usage meter as it waits for an active sink: the
/// meter finds the reservations whose closed windows it must correct (a late release, an
/// extension) in the outbox after its checked position, and a change pruned before it read it
/// would never be billed. Past the retention, a release the meter has not checked stays; once
/// checked, it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_prune_keeps_the_changes_the_meter_has_not_checked() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock(T0).await;
    let p = crate::reservations::pool(&app).await;
    let acme = app.member("acme");
    let mut meter = UsageMeter::new(app.db.db.clone(), "meter-a");
    let (r, _) = reserve(
        &app,
        &acme,
        &p.pool,
        "kept",
        &at(3 * 3600),
        json!([{ "gpuCount": 1 }]),
    )
    .await;
    // The meter runs and checks every change so far.
    step(&app, &mut meter, 70 * 60).await;
    app.ok(
        &acme,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": r } }),
    )
    .await;
    let db = &app.db.db;
    let released = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox WHERE type = 'reservation.released' AND subject = $1",
        )
        .bind(&r)
        .fetch_one(db.pool())
        .await
        .expect("count")
    };
    assert_eq!(released().await, 1);
    app.db.advance_clock(8 * 24 * 3600).await;
    compute_domain::sinks::prune_outbox(
        db,
        compute_domain::outbox::RETENTION,
        compute_workers::HARD_MAX_AGE,
    )
    .await
    .expect("prune");
    assert_eq!(
        released().await,
        1,
        "past the retention, but the meter has not checked it"
    );
    // Checked, it goes (the prune reads below the commit-safe horizon, which other tests' open
    // transactions can hold back for a moment: it runs again until the event is gone).
    let rest = compute_domain::usage::settle(db, Duration::from_millis(20), WAIT)
        .await
        .expect("settle the meter");
    assert!(!rest.more);
    let deadline = std::time::Instant::now() + WAIT;
    while released().await > 0 {
        compute_domain::sinks::prune_outbox(
            db,
            compute_domain::outbox::RETENTION,
            compute_workers::HARD_MAX_AGE,
        )
        .await
        .expect("prune");
        assert!(
            std::time::Instant::now() < deadline,
            "the checked release is pruned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
