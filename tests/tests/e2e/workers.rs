//! The workers: leases whose loss stops work at once, shards spread over workers and taken
//! over, the reservation reconciler through the work queue on the simulated clock, event sinks
//! through GraphQL, and webhook delivery surviving a SIGKILLed worker process.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use compute_domain::leases::{Bound, HeldLease};
use compute_domain::work_queue::SHARDS;
use compute_tests::{TestApp, spawn_app};
use compute_workers::dispatch::signature;
use compute_workers::queue::{KINDS, QueueWorker};
use serde_json::{Value, json};
use sqlx::Connection;

use crate::reservations::{CREATE, input, pool};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_lost_lease_stops_its_work_at_once() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &app.db.db;
    let a = HeldLease::acquire_with(
        db,
        "singleton:test-work",
        "worker-a",
        Duration::from_secs(15),
        Duration::from_millis(50),
    )
    .await
    .expect("acquire")
    .expect("free");
    assert!(
        HeldLease::acquire(db, "singleton:test-work", "worker-b")
            .await
            .expect("acquire")
            .is_none(),
        "held: the other worker waits"
    );
    // Worker A is partway through work that would run forever.
    let work = a.bound(std::future::pending::<()>());
    // A stops renewing in time (its clock says 15 s passed); B takes over with a new epoch.
    app.db.advance_clock(16).await;
    let b = HeldLease::acquire(db, "singleton:test-work", "worker-b")
        .await
        .expect("acquire")
        .expect("expired, so free");
    assert_eq!(b.fence().epoch, a.fence().epoch + 1);
    // A's next renewal finds the lease gone, and its work is cancelled then, not at its end.
    let outcome = tokio::time::timeout(WAIT, work)
        .await
        .expect("cancelled in time");
    assert!(matches!(outcome, Bound::LeaseLost));
    assert!(a.is_lost());
    // And a fenced write by A now fails: the fence is what guarantees it.
    let write = db
        .fenced_tx(
            "a_lost_lease_stops_its_work_at_once",
            a.fence(),
            compute_domain::db::TxKind::Write,
            |conn| {
                Box::pin(async move {
                    sqlx::query("SELECT compute_emit('test.zombie', NULL, 'x', '{}')")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            },
        )
        .await;
    assert!(
        matches!(write, Err(compute_domain::Error::LeaseLost(_))),
        "{write:?}"
    );
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox WHERE type = 'test.zombie'")
        .fetch_one(db.pool())
        .await
        .expect("count");
    assert_eq!(n, 0, "the zombie wrote nothing");
}

#[tokio::test]
async fn shards_spread_over_workers_and_move_when_one_dies() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &app.db.db;
    let mut a = QueueWorker::new(db.clone(), "worker-a", &KINDS);
    let mut b = QueueWorker::new(db.clone(), "worker-b", &KINDS);
    a.rebalance().await.expect("a");
    let kinds = KINDS.len() as i32;
    assert_eq!(
        a.held().len() as i32,
        SHARDS * kinds,
        "alone, a takes every shard of every kind"
    );
    b.rebalance().await.expect("b joins");
    a.rebalance().await.expect("a gives back");
    b.rebalance().await.expect("b takes its share");
    let (ha, hb) = (a.held(), b.held());
    assert_eq!(
        (ha.len() as i32, hb.len() as i32),
        (SHARDS * kinds / 2, SHARDS * kinds / 2),
        "{ha:?} {hb:?}"
    );
    assert!(ha.iter().all(|s| !hb.contains(s)), "no shard held twice");
    // Worker a dies (no release, no renewal): after the TTL its shards are free for b.
    drop(a);
    app.db.advance_clock(16).await;
    b.rebalance().await.expect("b takes over");
    assert_eq!(b.held().len() as i32, SHARDS * kinds);
}

async fn state_of(app: &TestApp, token: &str, id: &Value) -> String {
    app.ok(
        token,
        "query($id: ID!) { reservation(id: $id) { state } }",
        json!({ "id": id }),
    )
    .await["reservation"]["state"]
        .as_str()
        .expect("state")
        .to_owned()
}

async fn used_gpu(app: &TestApp) -> f64 {
    let (u,): (f64,) = sqlx::query_as(
        "SELECT used::float8 FROM quota_usage WHERE tenant_id = 'acme' AND resource = 'gpu' AND scope_kind = 'pool'",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("quota");
    u
}

/// Steps `w` until nothing is due now (after renewing its leases, as time may have moved).
async fn drain(w: &mut QueueWorker) -> usize {
    w.rebalance().await.expect("rebalance");
    let mut total = 0;
    loop {
        let n = w.step().await.expect("step");
        if n == 0 {
            return total;
        }
        total += n;
    }
}

#[tokio::test]
async fn the_queue_schedules_a_pending_reservation_after_a_release_and_expires_an_active_one() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let member = app.member("acme");
    let mut w = QueueWorker::new(app.db.db.clone(), "worker-q", &KINDS);
    w.rebalance().await.expect("shards");
    // Both untainted H100s, until 01:00.
    let first = app
        .ok(
            &member,
            CREATE,
            json!({ "i": { "poolId": p.pool, "endsAt": "2031-01-01T01:00:00Z", "idempotencyKey": "first",
                "allocations": [{ "gpuCount": 2, "model": "H100" }] } }),
        )
        .await["createReservation"]["reservation"]["id"]
        .clone();
    let waiting = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "waiting",
                json!([{ "gpuCount": 2, "model": "H100" }]),
            ),
        )
        .await["createReservation"]["reservation"]["id"]
        .clone();
    assert_eq!(state_of(&app, &member, &waiting).await, "PENDING");
    assert!(
        drain(&mut w).await >= 2,
        "each change woke its reservation's reconciler"
    );
    assert_eq!(state_of(&app, &member, &first).await, "ACTIVE");
    assert_eq!(state_of(&app, &member, &waiting).await, "PENDING");

    // Capacity frees up at 00:00:10; the retry period is 30 s from the last attempt (00:00).
    app.db.advance_clock(10).await;
    app.ok(
        &member,
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": first } }),
    )
    .await;
    drain(&mut w).await;
    assert_eq!(
        state_of(&app, &member, &waiting).await,
        "PENDING",
        "not before its retry time"
    );
    app.db.advance_clock(20).await; // 00:00:30: one retry period after the last attempt
    drain(&mut w).await;
    assert_eq!(
        state_of(&app, &member, &waiting).await,
        "ACTIVE",
        "placed within one retry period"
    );
    let before = used_gpu(&app).await;
    assert_eq!(before, 2.0);

    // It ends at 02:00 (`input`'s end): the queue row wakes its reconciler then.
    app.db.advance_clock(2 * 3600).await;
    assert!(drain(&mut w).await >= 1);
    assert_eq!(state_of(&app, &member, &waiting).await, "EXPIRED");
    assert_eq!(used_gpu(&app).await, 0.0, "the quota came back");
    let (rows,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM work_queue WHERE kind = 'reservation'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("rows");
    assert_eq!(rows, 0, "nothing left to do for terminal reservations");
    let (bookings,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id \
          JOIN reservations r ON r.id = a.reservation_id WHERE r.id = $1 AND upper(b.during) > compute_now()",
    )
    .bind(waiting.as_str())
    .fetch_one(app.db.db.pool())
    .await
    .expect("bookings");
    assert_eq!(
        bookings, 0,
        "nothing left booked for the terminal reservation"
    );
}

#[tokio::test]
async fn the_rollup_reconciler_corrects_a_drifted_rollup() {
    let app = spawn_app().await;
    let p = pool(&app).await;
    let db = &app.db.db;
    let mut w = QueueWorker::new(db.clone(), "worker-r", &KINDS);
    w.rebalance().await.expect("shards");
    drain(&mut w).await; // the registrations enqueued their pool
    let truth: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT model, kind, atoms FROM pool_capacity_rollup WHERE pool_id = $1 ORDER BY 1, 2, 3",
    )
    .bind(&p.pool)
    .fetch_all(db.pool())
    .await
    .expect("rollup");
    assert!(!truth.is_empty());
    sqlx::query("UPDATE pool_capacity_rollup SET atoms = atoms + 7 WHERE pool_id = $1")
        .bind(&p.pool)
        .execute(db.pool())
        .await
        .expect("drift");
    assert_eq!(
        compute_domain::fleet::changes::recompute_rollup(db, &pool_id(&p.pool))
            .await
            .expect("recompute"),
        truth.len() as u64,
        "every drifted row corrected"
    );
    let after: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT model, kind, atoms FROM pool_capacity_rollup WHERE pool_id = $1 ORDER BY 1, 2, 3",
    )
    .bind(&p.pool)
    .fetch_all(db.pool())
    .await
    .expect("rollup");
    assert_eq!(after, truth);
}

/// Issue 10 B: a recompute racing a registration in the same pool never loses the
/// registration's increment. The order is forced with a row lock: the registration, once its
/// atoms and rollup increment are written, waits on the pool's work-queue row held by this test;
/// the recompute then starts. Before the fix, the recompute counted the atoms from a snapshot
/// taken before the registration committed, waited for the rollup row, and overwrote the
/// increment with that stale count (and logged a "drift" it had made itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recompute_racing_a_registration_keeps_the_rollup_exact() {
    let app = spawn_app().await;
    let p = pool(&app).await;
    let db = app.db.db.clone();
    let rollup_vs_atoms = || {
        let (db, pool) = (db.clone(), pool_id(&p.pool));
        async move {
            // One statement, one snapshot.
            let (rollup, atoms): (i64, i64) = sqlx::query_as(
                "SELECT (SELECT coalesce(sum(atoms), 0) FROM pool_capacity_rollup WHERE pool_id = $1)::bigint, \
                        (SELECT count(*) FROM device_atoms a JOIN devices d ON d.id = a.device_id \
                           JOIN nodes n ON n.id = d.node_id WHERE n.pool_id = $1 AND n.retired_at IS NULL)",
            )
            .bind(&pool)
            .fetch_one(db.pool())
            .await
            .expect("counts");
            (rollup, atoms)
        }
    };
    let (before, atoms) = rollup_vs_atoms().await;
    assert_eq!(before, atoms);

    let mut holder = sqlx::PgConnection::connect(&app.db.url)
        .await
        .expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut holder)
        .await
        .expect("begin");
    // The fixture's registrations left the pool's wake-up row (no worker runs here).
    sqlx::query("SELECT 1 FROM work_queue WHERE kind = 'pool_capacity' AND key = $1 FOR UPDATE")
        .bind(&p.pool)
        .fetch_one(&mut holder)
        .await
        .expect("hold the pool's wake-up");
    let register = app.graphql_in_background(
        &app.operator(),
        crate::fleet::REGISTER,
        json!({ "i": {
            "poolId": p.pool, "hostname": "h100-late",
            "resources": { "vcpu": 32, "memoryMib": 262144, "diskGib": 1000 },
            "devices": [{ "uuid": "GPU-L0", "model": "H100", "memoryMib": 81559 },
                        { "uuid": "GPU-L1", "model": "H100", "memoryMib": 81559 }] } }),
    );
    app.until_lock_waiters(1).await;
    let recompute = {
        let (db, pool) = (db.clone(), pool_id(&p.pool));
        tokio::spawn(
            async move { compute_domain::fleet::changes::recompute_rollup(&db, &pool).await },
        )
    };
    app.until_lock_waiters(2).await;
    sqlx::query("COMMIT")
        .execute(&mut holder)
        .await
        .expect("commit");
    let registered = register.await.expect("register");
    assert!(registered["errors"].is_null(), "{registered}");
    let fixed = recompute.await.expect("recompute").expect("recompute");
    let (rollup, atoms) = rollup_vs_atoms().await;
    assert_eq!(atoms, before + 2, "the registration's two GPUs");
    assert_eq!(
        rollup, atoms,
        "the rollup kept the registration's increment"
    );
    assert_eq!(fixed, 0, "and the recompute found nothing to correct");
}

const CREATE_SINK: &str = "mutation($i: CreateEventSinkInput!) { createEventSink(input: $i) { secret eventSink { id url types state cursor active tenantId } } }";
const SINKS: &str = "{ eventSinks { totalCount edges { node { id state delivered lagSeconds lastError failures cursor } } } }";

#[tokio::test]
async fn event_sinks_are_managed_per_tenant() {
    let app = spawn_app().await;
    let acme = app.member("acme");
    let d = app
        .ok(
            &acme,
            CREATE_SINK,
            json!({ "i": { "url": "http://127.0.0.1:9/hook", "types": ["reservation.active"] } }),
        )
        .await;
    let sink = &d["createEventSink"];
    assert!(
        sink["secret"]
            .as_str()
            .expect("secret")
            .starts_with("whsec_")
    );
    assert_eq!(sink["eventSink"]["tenantId"], "acme");
    assert_eq!(sink["eventSink"]["state"], "HEALTHY");
    let id = sink["eventSink"]["id"].clone();
    // Bad input leaves nothing behind.
    let before: (i64,) = sqlx::query_as("SELECT count(*) FROM event_sinks")
        .fetch_one(app.db.db.pool())
        .await
        .expect("n");
    let (code, _) = app
        .fails(&acme, CREATE_SINK, json!({ "i": { "url": "ftp://x" } }))
        .await;
    assert_eq!(code, "BAD_USER_INPUT");
    // URLs the dispatcher could not parse when it posts, refused though this server allows
    // private targets (they were stored, then retried without end).
    for url in ["http://h:70000/hook", "http://a^b/hook", "http://[zz]/hook"] {
        let (code, body) = app
            .fails(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{url}: {body}");
    }
    let (code, _) = app
        .fails(
            &acme,
            CREATE_SINK,
            json!({ "i": { "url": "http://x", "types": ["Nope"] } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT");
    let after: (i64,) = sqlx::query_as("SELECT count(*) FROM event_sinks")
        .fetch_one(app.db.db.pool())
        .await
        .expect("n");
    assert_eq!(before, after);
    // Another tenant neither sees nor changes it.
    let globex = app.member("globex");
    assert_eq!(
        app.ok(&globex, SINKS, json!({})).await["eventSinks"]["totalCount"],
        0
    );
    let (code, _) = app
        .fails(&globex, "mutation($i: DeleteEventSinkInput!) { deleteEventSink(input: $i) { deletedEventSinkId } }", json!({ "i": { "id": id } }))
        .await;
    assert_eq!(code, "NOT_FOUND");
    // The owner pauses it, with a version check, then deletes it.
    let (code, _) = app
        .fails(&acme, "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { active } } }", json!({ "i": { "id": id, "active": false, "expectedVersion": 7 } }))
        .await;
    assert_eq!(code, "CONFLICT");
    let d = app
        .ok(&acme, "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { active version } } }", json!({ "i": { "id": id, "active": false, "expectedVersion": 1 } }))
        .await;
    assert_eq!(
        d["updateEventSink"]["eventSink"],
        json!({ "active": false, "version": 2 })
    );
    assert_eq!(
        app.ok(&acme, SINKS, json!({})).await["eventSinks"]["totalCount"],
        1
    );
    app.ok(
        &acme,
        "mutation($i: DeleteEventSinkInput!) { deleteEventSink(input: $i) { deletedEventSinkId } }",
        json!({ "i": { "id": id } }),
    )
    .await;
    assert_eq!(
        app.ok(&acme, SINKS, json!({})).await["eventSinks"]["totalCount"],
        0
    );
}

/// A local webhook receiver: records each delivery's event id after checking its signature,
/// taking `delay` per request.
#[derive(Clone)]
struct Receiver {
    secret: Arc<Mutex<String>>,
    got: Arc<Mutex<Vec<String>>>,
    bad: Arc<Mutex<u32>>,
    delay: Duration,
    /// Each batch's `Idempotency-Key` and size, in arrival order (failed answers included).
    batches: Arc<Mutex<Vec<(String, usize)>>>,
    /// POSTs still to answer with a 500.
    fail_next: Arc<Mutex<u32>>,
    /// POSTs that arrived, counted before they pass the gate.
    arrived: Arc<std::sync::atomic::AtomicUsize>,
    /// Every POST waits for this before it is answered: a test holding it holds the receiver.
    gate: Arc<tokio::sync::Mutex<()>>,
}

async fn receive(
    State(r): State<Receiver>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::http::StatusCode {
    r.arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    drop(r.gate.lock().await);
    tokio::time::sleep(r.delay).await;
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let ts: i64 = h("compute-timestamp").parse().unwrap_or(0);
    let secret = r.secret.lock().expect("secret").clone();
    if h("compute-signature") != signature(&secret, ts, &body) {
        *r.bad.lock().expect("bad") += 1;
        return axum::http::StatusCode::UNAUTHORIZED;
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let failing = {
        let mut f = r.fail_next.lock().expect("fail");
        let failing = *f > 0;
        *f = f.saturating_sub(1);
        failing
    };
    if let Some(size) = headers.get("compute-batch-size") {
        // A batch: `{"deliveries": [{"idempotencyKey", "event"}, …]}`, keyed by its first and
        // last events.
        let deliveries = v["deliveries"].as_array().expect("a batch's deliveries");
        assert_eq!(
            size.to_str().ok(),
            Some(deliveries.len().to_string().as_str())
        );
        let (first, last) = (
            &deliveries[0]["event"]["id"],
            &deliveries[deliveries.len() - 1]["event"]["id"],
        );
        assert_eq!(
            h("idempotency-key"),
            format!(
                "batch:{}:{}",
                first.as_str().unwrap_or(""),
                last.as_str().unwrap_or("")
            )
        );
        r.batches
            .lock()
            .expect("batches")
            .push((h("idempotency-key"), deliveries.len()));
        if failing {
            return axum::http::StatusCode::INTERNAL_SERVER_ERROR;
        }
        for d in deliveries {
            assert_eq!(d["idempotencyKey"], d["event"]["id"], "{d}");
            if d["event"]["type"] == "test.tick" {
                let key = d["idempotencyKey"].as_str().unwrap_or("").to_owned();
                r.got.lock().expect("got").push(key);
            }
        }
        return axum::http::StatusCode::NO_CONTENT;
    }
    if failing {
        return axum::http::StatusCode::INTERNAL_SERVER_ERROR;
    }
    assert_eq!(
        v["id"].as_str(),
        Some(h("compute-event-id").as_str()),
        "the id header is the event's id"
    );
    // Receivers deduplicate on Idempotency-Key: a usage record's key, else the event's id.
    let usage = h("compute-event-type").starts_with("usage.");
    let key = if usage {
        v["data"]["usage"]["key"].as_str().unwrap_or("").to_owned()
    } else {
        h("compute-event-id")
    };
    assert_eq!(h("idempotency-key"), key, "the idempotency key header");
    if h("compute-event-type") == "test.tick" || usage {
        r.got.lock().expect("got").push(key);
    }
    axum::http::StatusCode::NO_CONTENT
}

async fn start_receiver(delay: Duration) -> (Receiver, String) {
    let r = Receiver {
        secret: Arc::default(),
        got: Arc::default(),
        bad: Arc::default(),
        delay,
        batches: Arc::default(),
        fail_next: Arc::default(),
        arrived: Arc::default(),
        gate: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let router = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(r.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (r, url)
}

fn worker_process(app: &TestApp) -> tokio::process::Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("port")
        .local_addr()
        .expect("addr")
        .port();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args([
            "--role",
            "outbox",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--webhooks-allow-private",
        ])
        .envs(app.db.process_env())
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker process")
}

#[tokio::test]
async fn a_webhook_sink_survives_a_sigkilled_worker() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let (receiver, url) = start_receiver(Duration::from_millis(10)).await;
    let acme = app.member("acme");
    let d = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
        .await;
    *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    // 300 events of acme (and some of another tenant, which the sink must not get).
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 150) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    sqlx::query(
        "SELECT compute_emit('test.tick', 'globex', 'g' || g, '{}') FROM generate_series(1, 20) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(151, 300) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    let committed: HashSet<String> = sqlx::query_as::<_, (String,)>(
        "SELECT id FROM outbox WHERE tenant_id = 'acme' AND type = 'test.tick'",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("ids")
    .into_iter()
    .map(|(id,)| id)
    .collect();
    assert_eq!(committed.len(), 300);

    // The first worker delivers part of the stream and is killed mid-batch.
    let mut first = worker_process(&app);
    tokio::time::timeout(WAIT, async {
        while receiver.got.lock().expect("got").len() < 130 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first worker delivers");
    first.kill().await.expect("SIGKILL");
    let at_kill = receiver.got.lock().expect("got").len();
    let (saved,): (i64,) = sqlx::query_as("SELECT delivered FROM outbox_cursors")
        .fetch_one(app.db.db.pool())
        .await
        .expect("cursor");
    assert!(
        saved >= 100 && (saved as usize) <= at_kill + 1,
        "a batch was saved (the sink's own creation event counts too): {saved} of {at_kill}"
    );

    // Its lease runs out (15 s of business time); a second worker takes the sink over.
    app.db.advance_clock(16).await;
    let _second = worker_process(&app);
    compute_tests::eventually("the second worker delivers the rest", WAIT, || async {
        let got: HashSet<String> = receiver.got.lock().expect("got").iter().cloned().collect();
        (got.len() >= committed.len()).then_some(())
    })
    .await;
    let got = receiver.got.lock().expect("got").clone();
    let unique: HashSet<String> = got.iter().cloned().collect();
    assert_eq!(
        unique, committed,
        "deduplicated by id: exactly the committed set"
    );
    let resent = got.len() - unique.len();
    assert!(
        resent <= 100,
        "at most the unsaved batch was sent again: {resent}"
    );
    assert_eq!(
        *receiver.bad.lock().expect("bad"),
        0,
        "every signature verified"
    );
    // In order: each event's first delivery comes after the one before it.
    let order: Vec<&String> = {
        let mut seen = HashSet::new();
        got.iter().filter(|id| seen.insert(*id)).collect()
    };
    let mut expected: Vec<(i64, String)> = sqlx::query_as(
        "SELECT seq, id FROM outbox WHERE tenant_id = 'acme' AND type = 'test.tick' ORDER BY txid, seq",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("order");
    let expected: Vec<String> = expected.drain(..).map(|(_, id)| id).collect();
    assert_eq!(
        order.into_iter().cloned().collect::<Vec<_>>(),
        expected,
        "in order per sink"
    );
    // The receiver can hold the last batch before the worker commits its cursor past it (the
    // delivery, then the save): the lag, read from the cursor, reaches 0 once the save lands.
    let s = compute_tests::eventually("the sink's cursor catches up", WAIT, || async {
        let d = app.ok(&acme, SINKS, json!({})).await;
        let s = d["eventSinks"]["edges"][0]["node"].clone();
        (s["lagSeconds"] == 0.0).then_some(s)
    })
    .await;
    assert_eq!(s["state"], "HEALTHY");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

async fn sink_row(app: &TestApp, id: &str) -> (i32, String, Option<String>) {
    sqlx::query_as("SELECT failures, state, last_error FROM event_sinks WHERE id = $1")
        .bind(id)
        .fetch_one(app.db.db.pool())
        .await
        .expect("sink")
}

/// Rebalances `dispatcher` (as its loop does every 2 s) until sink `bad` has failed `expected`
/// times.
async fn failures_reach(
    app: &TestApp,
    dispatcher: &mut compute_workers::dispatch::Dispatcher,
    bad: &str,
    expected: i32,
) -> (i32, String, Option<String>) {
    tokio::time::timeout(WAIT, async {
        loop {
            dispatcher.rebalance().await.expect("rebalance");
            let row = sink_row(app, bad).await;
            if row.0 >= expected {
                return row;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the failure is recorded")
}

#[tokio::test]
async fn a_failing_sink_backs_off_without_holding_up_the_others() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let (good, url) = start_receiver(Duration::ZERO).await;
    let acme = app.member("acme");
    let d = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
        .await;
    *good.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    // Nobody listens on this port: every POST fails.
    let dead = format!("http://127.0.0.1:{}/hook", free_port());
    let bad = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": dead } }))
        .await["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 5) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-d")
        .allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    dispatcher.rebalance().await.expect("rebalance");
    let (failures, state, error) = failures_reach(&app, &mut dispatcher, &bad, 1).await;
    assert_eq!((failures, state.as_str()), (1, "healthy"));
    assert_eq!(
        error.as_deref(),
        Some("unreachable"),
        "a coarse category: nothing of which ports are open"
    );
    // Meanwhile the healthy sink got everything.
    tokio::time::timeout(WAIT, async {
        while good.got.lock().expect("got").len() < 5 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the healthy sink is not held up");
    // It backs off: not retried before its time, retried after.
    dispatcher.rebalance().await.expect("rebalance");
    assert_eq!(sink_row(&app, &bad).await.0, 1, "backing off");
    for n in [2, 3] {
        app.db.advance_clock(300).await;
        failures_reach(&app, &mut dispatcher, &bad, n).await;
    }
    let d = app
        .ok(
            &acme,
            "query($id: ID!) { eventSink(id: $id) { state failures nextAttemptAt lastError } }",
            json!({ "id": bad }),
        )
        .await;
    assert_eq!(d["eventSink"]["state"], "FAILING", "{d}");
    assert_eq!(d["eventSink"]["failures"], 3);
    // The next attempt is 8 s after the third failure.
    let backoff = || async {
        sqlx::query_scalar::<_, f64>(
            "SELECT extract(epoch FROM next_attempt_at - last_error_at)::float8 FROM event_sinks WHERE id = $1",
        )
        .bind(&bad)
        .fetch_one(app.db.db.pool())
        .await
        .expect("backoff")
    };
    assert_eq!(backoff().await, 8.0);
    // A sink failing for days (about 3.5 at the 300 s cap): the exponent stops before
    // PostgreSQL's float8 overflows at 2^1024, so its 1,031st failure is recorded and it waits
    // the cap. Before session 42 the failure could not be recorded past 1,023 and the sink was
    // posted to every second, for ever.
    sqlx::query("UPDATE event_sinks SET failures = 1030 WHERE id = $1")
        .bind(&bad)
        .execute(app.db.db.pool())
        .await
        .expect("failures");
    app.db.advance_clock(300).await;
    failures_reach(&app, &mut dispatcher, &bad, 1031).await;
    assert_eq!(backoff().await, 300.0);
}

/// A tenant has at most 100 sinks, and two creates racing for the 100th place cannot both take
/// it: a create takes the tenant's `sinks` advisory lock and counts after it. Here a side
/// transaction holds that lock while it adds the 100th; a create waits for it, then counts 100
/// and is `CONFLICT` (without the lock, or with the count in the lock's statement, whose
/// snapshot predates the wait, it would make a 101st). A deletion frees a place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_has_at_most_100_sinks_even_when_creates_race_for_the_last() {
    let app = spawn_app().await;
    let acme = app.member("acme");
    let url = json!({ "i": { "url": "https://hooks.example.com/compute" } });
    let first = app.ok(&acme, CREATE_SINK, url.clone()).await["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let pool = app.db.db.pool();
    let copies = |ids: &'static str| {
        format!(
            "INSERT INTO event_sinks (id, tenant_id, url, types, secret, created_by, batch_size) \
             SELECT 'snk_' || lpad(to_hex(g), 32, '0'), tenant_id, url, types, secret, created_by, batch_size \
               FROM event_sinks, {ids} g WHERE id = $1"
        )
    };
    // 98 copies of the first: 99 sinks.
    sqlx::query(&copies("generate_series(1, 98)"))
        .bind(&first)
        .execute(pool)
        .await
        .expect("98 more");
    let mut side = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('sinks:acme', 0))")
        .execute(&mut *side)
        .await
        .expect("the tenant's lock");
    sqlx::query(&copies("generate_series(255, 255)"))
        .bind(&first)
        .execute(&mut *side)
        .await
        .expect("the 100th");
    let release = async {
        compute_tests::until_one_waits_for_an_advisory_lock(pool, "the create waits for the lock")
            .await;
        side.commit().await.expect("commit");
    };
    let ((code, body), ()) = tokio::join!(app.fails(&acme, CREATE_SINK, url.clone()), release);
    assert_eq!(code, "CONFLICT", "{body}");
    assert!(body.to_string().contains("100"), "{body}");
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM event_sinks WHERE tenant_id = 'acme'")
            .fetch_one(pool)
            .await
            .expect("count")
    };
    assert_eq!(count().await, 100);
    app.ok(
        &acme,
        "mutation($i: DeleteEventSinkInput!) { deleteEventSink(input: $i) { deletedEventSinkId } }",
        json!({ "i": { "id": first } }),
    )
    .await;
    app.ok(&acme, CREATE_SINK, url).await;
    assert_eq!(count().await, 100, "the freed place was taken");
}

/// A receiver, and acme's sink posting `test.tick` events to it (the receiver knows its secret);
/// the sink's id.
async fn tick_sink(app: &TestApp) -> (Receiver, String) {
    let (receiver, url) = start_receiver(Duration::ZERO).await;
    let d = app
        .ok(
            &app.member("acme"),
            CREATE_SINK,
            json!({ "i": { "url": url, "types": ["test.tick"] } }),
        )
        .await;
    *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    let id = d["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    (receiver, id)
}

/// A sink whose filter takes none of what is written (here, events of another type) moves its
/// cursor to the present once its minute has passed, so it holds back no pruning and is never
/// marked `BEHIND` for events it never wanted; and it passes over nothing it takes: an event of
/// a transaction still running when the cursor moves lies after the present, and is delivered
/// once that transaction commits. Before session 42 such a cursor never moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_sink_moves_its_cursor_past_what_it_does_not_take_and_misses_nothing() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let (receiver, id) = tick_sink(&app).await;
    let pool = app.db.db.pool();
    let cursor = || async {
        sqlx::query_as::<_, (i64, i64, bool)>(
            "SELECT txid::text::bigint, seq, updated_at = compute_now() FROM outbox_cursors WHERE sink_id = $1",
        )
        .bind(&id)
        .fetch_one(pool)
        .await
        .expect("cursor")
    };
    // A transaction still running holds an event the sink takes; events it does not take are
    // committed after it.
    let mut side = pool.begin().await.expect("begin");
    let held_txid: i64 = sqlx::query_scalar(
        "SELECT pg_current_xact_id()::text::bigint FROM (SELECT compute_emit('test.tick', 'acme', 'held', '{}')) e",
    )
    .fetch_one(&mut *side)
    .await
    .expect("held");
    sqlx::query(
        "SELECT compute_emit('test.noise', 'acme', 'n' || g, '{}') FROM generate_series(1, 5) g",
    )
    .execute(pool)
    .await
    .expect("noise");
    app.db.advance_clock(61).await;
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-q")
        .allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    dispatcher.rebalance().await.expect("rebalance");
    let looked = compute_tests::eventually("the quiet cursor is looked at", WAIT, || async {
        let c = cursor().await;
        c.2.then_some(c)
    })
    .await;
    assert!(
        looked.0 < held_txid,
        "the cursor stays before the running transaction's event: {looked:?}, held {held_txid}"
    );
    side.commit().await.expect("commit");
    // Delivered and saved (business time must not pass the sink's lease before the save, or
    // the save is refused and the event delivered again).
    compute_tests::eventually("the held event is delivered and saved", WAIT, || async {
        let delivered: i64 =
            sqlx::query_scalar("SELECT delivered FROM outbox_cursors WHERE sink_id = $1")
                .bind(&id)
                .fetch_one(pool)
                .await
                .expect("delivered");
        (delivered == 1).then_some(())
    })
    .await;
    // A minute later the cursor passes the noise, to the present.
    app.db.advance_clock(61).await;
    let head: (i64, i64) = sqlx::query_as(
        "SELECT txid::text::bigint, seq FROM outbox ORDER BY txid DESC, seq DESC LIMIT 1",
    )
    .fetch_one(pool)
    .await
    .expect("head");
    // (Business time passed the sink's lease: the dispatcher takes it again, as its loop does.)
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        dispatcher.rebalance().await.expect("rebalance");
        let c = cursor().await;
        if (c.0, c.1) == head {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            let xmin: i64 =
                sqlx::query_scalar("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")
                    .fetch_one(pool)
                    .await
                    .expect("xmin");
            panic!("the cursor is at {c:?}, the present at {head:?}, the cluster's xmin {xmin}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held: String = sqlx::query_scalar("SELECT id FROM outbox WHERE subject = 'held'")
        .fetch_one(pool)
        .await
        .expect("held event");
    assert_eq!(
        receiver.got.lock().expect("got").clone(),
        vec![held],
        "the one event it takes, and nothing else"
    );
}

/// A sink paused while its batch goes out (its tenant's `active: false`; a revocation pauses it
/// the same way) gets none of the rest: the dispatcher reads the sink again before each POST
/// after the first, so at most the POST in flight lands, and the cursor says what landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_paused_during_its_batch_gets_none_of_the_rest() {
    let app = spawn_app().await;
    let (receiver, id) = tick_sink(&app).await;
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 5) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    // The receiver holds its answers: the batch's first POST arrives and waits.
    let held = receiver.gate.lock().await;
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-p")
        .allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    dispatcher.rebalance().await.expect("rebalance");
    let arrived = || receiver.arrived.load(std::sync::atomic::Ordering::SeqCst);
    compute_tests::eventually("the first POST arrives", WAIT, || async {
        (arrived() == 1).then_some(())
    })
    .await;
    // Paused while that POST is in flight; then the receiver answers it.
    app.ok(
        &app.member("acme"),
        "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { active } } }",
        json!({ "i": { "id": id, "active": false } }),
    )
    .await;
    drop(held);
    let delivered = || async {
        sqlx::query_scalar::<_, i64>("SELECT delivered FROM outbox_cursors WHERE sink_id = $1")
            .bind(&id)
            .fetch_one(app.db.db.pool())
            .await
            .expect("cursor")
    };
    compute_tests::eventually("the POST in flight is saved", WAIT, || async {
        (delivered().await >= 1).then_some(())
    })
    .await;
    // Time for the rest of the batch, had it gone on (it would have gone at once).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(arrived(), 1, "none of the rest was posted");
    assert_eq!(
        receiver.got.lock().expect("got").len(),
        1,
        "the POST in flight landed"
    );
    assert_eq!(delivered().await, 1, "the cursor covers what landed");
}

/// A sink with a batch size gets its events in POSTs of up to that many, in order, signed, each
/// batch keyed by its first and last events; a failed batch is sent again from the same event
/// with the same key. A batch size outside 1..=100 is refused and writes nothing.
#[tokio::test]
async fn a_batching_sink_gets_its_events_in_order_in_batches_of_its_size() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let acme = app.member("acme");
    let (receiver, url) = start_receiver(Duration::ZERO).await;
    let before = app.count("event_sinks").await;
    for size in [0, 101, -1] {
        let (code, body) = app
            .fails(
                &acme,
                CREATE_SINK,
                json!({ "i": { "url": url, "batchSize": size } }),
            )
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{body}");
    }
    assert_eq!(
        app.count("event_sinks").await,
        before,
        "a refusal writes nothing"
    );
    let d = app
        .ok(
            &acme,
            "mutation($i: CreateEventSinkInput!) { createEventSink(input: $i) { secret eventSink { id batchSize } } }",
            json!({ "i": { "url": url, "types": ["test.tick"], "batchSize": 3 } }),
        )
        .await;
    assert_eq!(d["createEventSink"]["eventSink"]["batchSize"], 3);
    let id = d["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    let (code, _) = app
        .fails(&acme, "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { batchSize } } }", json!({ "i": { "id": id, "batchSize": 500 } }))
        .await;
    assert_eq!(code, "BAD_USER_INPUT");
    let (version,): (i64,) = sqlx::query_as("SELECT version FROM event_sinks WHERE id = $1")
        .bind(&id)
        .fetch_one(app.db.db.pool())
        .await
        .expect("version");
    assert_eq!(version, 1, "the refused update changed nothing");
    let ids: Vec<String> = sqlx::query_scalar(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 7) g ORDER BY g",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("emit");
    // The first POST is answered with a 500: the sink backs off, then sends that batch again.
    *receiver.fail_next.lock().expect("fail") = 1;
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-b")
        .allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    failures_reach(&app, &mut dispatcher, &id, 1).await;
    app.db.advance_clock(300).await;
    tokio::time::timeout(WAIT, async {
        while receiver.got.lock().expect("got").len() < 7 {
            dispatcher.rebalance().await.expect("rebalance");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("all seven are delivered");
    assert_eq!(
        *receiver.got.lock().expect("got"),
        ids,
        "each once, in order"
    );
    let batches = receiver.batches.lock().expect("batches").clone();
    assert_eq!(
        batches.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [3, 3, 3, 1],
        "batches of the sink's size: {batches:?}"
    );
    assert_eq!(
        batches[0], batches[1],
        "the failed batch is sent again as it was"
    );
    assert_eq!(batches[1].0, format!("batch:{}:{}", ids[0], ids[2]));
    assert_eq!(
        *receiver.bad.lock().expect("bad"),
        0,
        "every batch is signed"
    );
}

/// A receiver that answers every request with a redirect to `location`.
async fn start_redirector(location: String) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let location = location.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 8192];
                let _ = s.read(&mut buf).await;
                let answer = format!(
                    "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}/hook")
}

#[tokio::test]
async fn a_sink_naming_an_internal_address_is_refused_when_created_or_changed() {
    // `serve` without `--webhooks-allow-private`: a URL whose host is an internal address, in
    // any spelling the URL parser reads as one, or `localhost`, is the caller's error when the
    // sink is created or changed, not only a failed delivery later; nothing is written.
    let app = compute_tests::TestApp::builder()
        .public_webhooks_only()
        .start()
        .await;
    let acme = app.member("acme");
    let events_before = app.count("outbox").await;
    for target in [
        "http://127.0.0.1:8080/hook",
        "http://2130706433/hook",
        "http://0x7f.1/hook",
        "http://[::1]/hook",
        "http://[::ffff:169.254.169.254]/",
        "http://169.254.169.254/latest/meta-data/",
        "https://10.1.2.3/hook",
        "https://192.168.0.7/hook",
        "https://localhost/hook",
        "https://billing.localhost/hook",
    ] {
        let (code, error) = app
            .fails(&acme, CREATE_SINK, json!({ "i": { "url": target } }))
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{target}: {error}");
        assert_eq!(error["extensions"]["field"], "url", "{target}: {error}");
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains("--webhooks-allow-private")),
            "the message says how an operator allows it: {error}"
        );
    }
    assert_eq!(app.count("event_sinks").await, 0, "no sink written");
    assert_eq!(app.count("outbox").await, events_before, "no event written");
    // A public name is taken, and cannot be changed to an internal address.
    let sink = app
        .ok(
            &acme,
            CREATE_SINK,
            json!({ "i": { "url": "https://hooks.example.com/in" } }),
        )
        .await["createEventSink"]["eventSink"]["id"]
        .clone();
    let update =
        "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { url } } }";
    let (code, error) = app
        .fails(
            &acme,
            update,
            json!({ "i": { "id": sink, "url": "http://127.0.0.1:9/" } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{error}");
    let now = app.ok(&acme, SINKS_URLS, json!({})).await;
    assert_eq!(
        now["eventSinks"]["edges"][0]["node"]["url"], "https://hooks.example.com/in",
        "the refused change left the sink as it was: {now}"
    );
}

const SINKS_URLS: &str = "{ eventSinks { edges { node { url } } } }";

#[tokio::test]
async fn webhooks_reach_only_public_addresses_and_follow_no_redirect() {
    // A tenant's sink URL must not reach into the operator's network: by default, a loopback
    // receiver, a name that resolves to loopback and the metadata address are all refused,
    // and nothing is posted. With private targets allowed (on-premises receivers), a redirect
    // is still not followed: it is a failed delivery, and its target gets nothing.
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let (inside, url) = start_receiver(Duration::ZERO).await;
    let acme = app.member("acme");
    let mut ids = Vec::new();
    for target in [
        url.clone(),
        url.replace("127.0.0.1", "localhost"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://2130706433/hook".to_owned(),
    ] {
        ids.push(
            app.ok(&acme, CREATE_SINK, json!({ "i": { "url": target } }))
                .await["createEventSink"]["eventSink"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let (code, _) = app
        .fails(
            &acme,
            CREATE_SINK,
            json!({ "i": { "url": "https://user:pw@example.com/hook" } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "credentials in a URL are refused");
    sqlx::query("SELECT compute_emit('test.tick', 'acme', 'e1', '{}')")
        .execute(app.db.db.pool())
        .await
        .expect("emit");
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-s");
    dispatcher.idle = Duration::from_millis(20);
    for id in &ids {
        let (failures, _, error) = failures_reach(&app, &mut dispatcher, id, 1).await;
        assert_eq!(failures, 1);
        assert_eq!(
            error.as_deref(),
            Some(compute_workers::egress::REFUSED),
            "sink {id}"
        );
    }
    assert!(
        inside.got.lock().expect("got").is_empty(),
        "nothing reached the inside"
    );

    // Private targets allowed: a redirect to the receiver is not followed.
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let acme = app.member("acme");
    let (target, target_url) = start_receiver(Duration::ZERO).await;
    let redirector = start_redirector(target_url).await;
    let sink = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": redirector } }))
        .await["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    sqlx::query("SELECT compute_emit('test.tick', 'acme', 'e1', '{}')")
        .execute(app.db.db.pool())
        .await
        .expect("emit");
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-r")
        .allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    let (_, _, error) = failures_reach(&app, &mut dispatcher, &sink, 1).await;
    assert_eq!(error.as_deref(), Some("HTTP 302"));
    assert!(
        target.got.lock().expect("got").is_empty(),
        "the redirect was not followed"
    );
}

#[tokio::test]
async fn outbox_pruning_waits_for_sinks_up_to_the_hard_maximum() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &app.db.db;
    let scope = compute_domain::sinks::Scope {
        tenant_id: Some(compute_tests::tenant("acme")),
    };
    let (sink, _) =
        compute_domain::sinks::create(db, &scope, "test", "http://127.0.0.1:9/x", vec![], 1)
            .await
            .expect("sink");
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 3) g",
    )
    .execute(db.pool())
    .await
    .expect("emit");
    let ticks = || async {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox WHERE type = 'test.tick'")
            .fetch_one(db.pool())
            .await
            .expect("count");
        n
    };
    app.db.advance_clock(8 * 24 * 3600).await;
    compute_domain::sinks::prune_outbox(
        db,
        compute_domain::outbox::RETENTION,
        compute_workers::HARD_MAX_AGE,
    )
    .await
    .expect("prune");
    assert_eq!(
        ticks().await,
        3,
        "past the retention, but the sink has not received them"
    );
    assert_eq!(
        compute_domain::sinks::get(db, &scope, &sink.id)
            .await
            .expect("sink")
            .state,
        compute_domain::sinks::SinkState::Healthy
    );
    app.db.advance_clock(23 * 24 * 3600).await; // 31 days
    // The pruner never deletes an event whose transaction may still be in flight: one at or past
    // the cluster's snapshot xmin, which an open transaction of another test (on another
    // database of the same server) can hold back for a moment. So it runs again until the ticks
    // are gone, as the hourly pruner would.
    let deadline = std::time::Instant::now() + WAIT;
    let mut pruned = 0;
    loop {
        pruned += compute_domain::sinks::prune_outbox(
            db,
            compute_domain::outbox::RETENTION,
            compute_workers::HARD_MAX_AGE,
        )
        .await
        .expect("prune");
        if ticks().await == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "past the hard maximum they go anyway: not within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pruned >= 3, "the three ticks were pruned: {pruned}");
    let after = compute_domain::sinks::get(db, &scope, &sink.id)
        .await
        .expect("sink");
    assert_eq!(
        after.state,
        compute_domain::sinks::SinkState::Behind,
        "and the sink says it fell behind"
    );
    assert_eq!(
        after.cursor(),
        compute_domain::outbox::pruned_through(db)
            .await
            .expect("front")
    );
}

#[tokio::test]
async fn sinks_spread_over_dispatchers_when_one_joins() {
    let app = spawn_app().await;
    // A receiver that takes anything: the point here is who delivers, not what.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let router = axum::Router::new().route(
        "/hook",
        axum::routing::post(|| async { axum::http::StatusCode::NO_CONTENT }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let acme = app.member("acme");
    for _ in 0..4 {
        app.ok(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
            .await;
    }
    let db = app.db.db.clone();
    let mut one = compute_workers::dispatch::Dispatcher::new(db.clone(), "dispatcher-1")
        .allowing_private_targets(true);
    let mut two = compute_workers::dispatch::Dispatcher::new(db.clone(), "dispatcher-2")
        .allowing_private_targets(true);
    one.rebalance().await.expect("one");
    assert_eq!(one.sinks_held(), 4, "alone, it delivers every sink");
    two.rebalance().await.expect("two joins");
    assert_eq!(two.sinks_held(), 0, "every sink is held");
    one.rebalance().await.expect("one hands two over");
    assert_eq!(one.sinks_held(), 2);
    tokio::time::timeout(WAIT, async {
        while two.sinks_held() < 2 {
            two.rebalance().await.expect("two takes its share");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the handed-over sinks are taken");
    assert_eq!((one.sinks_held(), two.sinks_held()), (2, 2));
    let (holders,): (i64,) = sqlx::query_as(
        "SELECT count(DISTINCT owner) FROM leases WHERE name LIKE 'singleton:outbox-dispatch:%' AND expires_at > compute_now()",
    )
    .fetch_one(db.pool())
    .await
    .expect("holders");
    assert_eq!(holders, 2);
}

#[tokio::test]
async fn a_worker_serves_its_metrics_and_health() {
    // On the wall clock first: the skew reported is this process's against PostgreSQL's.
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .start()
        .await;
    let db = app.db.db.clone();
    for key in ["a", "b", "c"] {
        enqueue_noop(&db, key).await;
    }
    let mut w = QueueWorker::new(
        db.clone(),
        "worker-m",
        &[compute_domain::work_queue::WorkKind::Noop],
    );
    assert_eq!(drain(&mut w).await, 3);
    // The usage meter's first pass starts it at the window of now (no bookings yet).
    let mut meter = compute_workers::usage::UsageMeter::new(db.clone(), "worker-m");
    meter.pass().await.expect("meter pass");
    let stats = compute_workers::Stats {
        queue: w.stats(),
        dispatch: compute_workers::dispatch::Dispatcher::new(db, "worker-m").stats(),
        usage: meter.stats(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let registry = compute_domain::metrics::Registry::default();
    stats.register(&registry);
    let clock = compute_domain::clock::Clock::anchored(&app.db.db)
        .await
        .expect("a clock");
    let served = clock.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, compute_workers::http::router(registry, served)).await;
    });
    let health = || async {
        let res = app
            .http
            .get(format!("http://{addr}/healthz"))
            .send()
            .await
            .expect("healthz");
        assert_eq!(res.status().as_u16(), 200);
        res.json::<serde_json::Value>().await.expect("json")
    };
    let h = health().await;
    assert_eq!(h["status"], "pass");
    assert_eq!(h["checks"]["clock.skew"]["status"], "pass", "{h}");
    assert_eq!(h["checks"]["clock.skew"]["limit_ms"], 1000);
    // compute_now() moves years ahead (a simulated clock): the next sample (taken at every lease
    // renewal by `run`) sees the skew, and /healthz reports it.
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let reading = clock.sample(&app.db.db).await.expect("sample");
    assert!(!reading.ok());
    let h = health().await;
    assert_eq!(h["checks"]["clock.skew"]["status"], "warn", "{h}");
    let skew = h["checks"]["clock.skew"]["skew_ms"].as_i64().expect("skew");
    assert!(
        skew > 86_400_000,
        "compute_now() is ahead by more than a day: {skew}"
    );
    let text = app
        .http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body");
    assert!(
        text.lines()
            .any(|l| l == "compute_work_items_total{outcome=\"done\"} 3"),
        "{text}"
    );
    let lag: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("compute_usage_lag_seconds "))
        .unwrap_or_else(|| panic!("the usage lag: {text}"))
        .parse()
        .expect("a number");
    assert!(
        (0.0..3600.0).contains(&lag),
        "now is inside the first open window: {lag}"
    );
    assert!(
        text.lines()
            .any(|l| l == "compute_usage_records_total{by=\"window\"} 0"),
        "{text}"
    );
    assert_eq!(
        text.matches("# TYPE compute_work_items counter").count(),
        1,
        "one TYPE line per metric (OpenMetrics names the family without _total): {text}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
}

fn pool_id(id: &str) -> compute_domain::ids::PoolId {
    compute_domain::ids::PoolId::parse("pool", id).expect("a pool id")
}

/// Runs a dispatcher on `db` until the receiver has `n` ticks, then stops it (its leases let go).
async fn deliver_until(db: compute_domain::db::Db, owner: &str, receiver: &Receiver, n: usize) {
    let mut dispatcher =
        compute_workers::dispatch::Dispatcher::new(db, owner).allowing_private_targets(true);
    dispatcher.idle = Duration::from_millis(20);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(dispatcher.run(async move {
        let _ = stopped.await;
    }));
    tokio::time::timeout(WAIT, async {
        while receiver.got.lock().expect("got").len() < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{owner} delivers {n} ticks"));
    let _ = stop.send(());
    running.await.expect("the dispatcher stops");
}

/// Billing receives each closed usage window through a webhook sink, with the window's key as the
/// idempotency key to deduplicate on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_windows_reach_a_billing_webhook_keyed_by_their_window() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T09:20:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let (receiver, url) = start_receiver(Duration::ZERO).await;
    let acme = app.member("acme");
    let d = app
        .ok(
            &acme,
            CREATE_SINK,
            json!({ "i": { "url": url, "types": ["usage.window_closed", "usage.window_adjusted"] } }),
        )
        .await;
    *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    app.ok(
        &acme,
        crate::reservations::CREATE,
        json!({ "i": { "poolId": p.pool, "endsAt": "2031-01-01T11:20:00Z",
                       "allocations": [{ "gpuCount": 1 }], "idempotencyKey": "bill" } }),
    )
    .await;
    app.db.advance_clock(3 * 3600).await;
    let pass = compute_domain::usage::settle(&app.db.db, Duration::from_millis(20), WAIT)
        .await
        .expect("the meter");
    assert_eq!((pass.windows_closed, pass.records), (3, 3), "{pass:?}");
    deliver_until(app.db.db.clone(), "dispatcher-usage", &receiver, 3).await;
    let mut got = receiver.got.lock().expect("got").clone();
    got.sort();
    let mut keys: Vec<String> = sqlx::query_scalar("SELECT key FROM usage_records")
        .fetch_all(app.db.db.pool())
        .await
        .expect("keys");
    keys.sort();
    assert_eq!(got, keys, "each window's record, keyed by its window");
    assert!(keys.iter().all(|k| k.starts_with("cmp:alc_")), "{keys:?}");
}

#[tokio::test]
async fn sink_secrets_are_sealed_at_rest_and_survive_a_key_rotation() {
    use compute_domain::secrets::Keyring;
    let app = spawn_app().await;
    let (receiver, url) = start_receiver(Duration::ZERO).await;
    let acme = app.member("acme");
    let mut ids = Vec::new();
    for _ in 0..2 {
        let d = app
            .ok(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
            .await;
        *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
            .as_str()
            .expect("secret")
            .to_owned();
        ids.push(
            d["createEventSink"]["eventSink"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    // Only the second sink delivers in this test; the first one is paused.
    sqlx::query("UPDATE event_sinks SET active = false WHERE id = $1")
        .bind(&ids[0])
        .execute(app.db.db.pool())
        .await
        .expect("pause");
    let secret = receiver.secret.lock().expect("secret").clone();
    let stored = |id: String| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT secret FROM event_sinks WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .expect("stored secret")
        }
    };
    let sealed = stored(ids[1].clone()).await;
    assert!(sealed.starts_with("sealed:v1:"), "{sealed}");
    let hex = secret.trim_start_matches("whsec_");
    assert!(
        !sealed.contains(hex),
        "the database holds no trace of the secret"
    );
    let old = app.db.db.keyring().expect("the test handle has a key");
    assert_eq!(old.open(&sealed, &ids[1]).expect("opens"), secret);
    assert!(
        old.open(&sealed, &ids[0]).is_err(),
        "a sealed secret copied onto another sink's row does not open"
    );

    // Delivery opens it and signs with the secret the tenant was shown.
    let tick = |n: i32| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query("SELECT compute_emit('test.tick', 'acme', 'e' || $1, '{}')")
                .bind(n)
                .execute(&pool)
                .await
                .expect("emit");
        }
    };
    tick(1).await;
    deliver_until(app.db.db.clone(), "worker-key1", &receiver, 1).await;

    // Rotation: a new key, the old one still accepted; a secret stored before any key (plain)
    // is sealed by the same command.
    sqlx::query(
        "UPDATE event_sinks SET secret = 'whsec_legacy_0123456789abcdef0123456789' WHERE id = $1",
    )
    .bind(&ids[0])
    .execute(app.db.db.pool())
    .await
    .expect("a plain secret");
    let new_key = Keyring::generate_key().expect("key");
    let rotating = app.db.db.clone().with_keyring(
        Keyring::from_config(Some(&new_key), Some(compute_tests::SECRETS_KEY)).expect("ring"),
    );
    let done = compute_domain::sinks::reseal_all(&rotating)
        .await
        .expect("reseal");
    assert_eq!((done.resealed, done.current), (2, 0));
    let again = compute_domain::sinks::reseal_all(&rotating)
        .await
        .expect("reseal again");
    assert_eq!(
        (again.resealed, again.current),
        (0, 2),
        "a second run changes nothing"
    );
    let new_only = Keyring::from_config(Some(&new_key), None).expect("ring");
    let new_ring = new_only.as_deref().expect("ring");
    let legacy = stored(ids[0].clone()).await;
    assert!(new_ring.is_current(&legacy), "{legacy}");
    assert_eq!(
        new_ring.open(&legacy, &ids[0]).expect("opens"),
        "whsec_legacy_0123456789abcdef0123456789"
    );
    let resealed = stored(ids[1].clone()).await;
    assert_ne!(resealed, sealed);
    assert!(
        old.open(&resealed, &ids[1]).is_err(),
        "the old key no longer opens it"
    );

    // A worker still on the old key alone cannot open the resealed secrets: the sink shows it
    // and backs off (it was retried every second, the sink still HEALTHY).
    tick(2).await;
    let mut stale = compute_workers::dispatch::Dispatcher::new(app.db.db.clone(), "worker-stale")
        .allowing_private_targets(true);
    stale.idle = Duration::from_millis(20);
    let (failures, _, error) = failures_reach(&app, &mut stale, &ids[1], 1).await;
    assert_eq!(
        (failures, error.as_deref()),
        (1, Some(compute_workers::dispatch::SECRET_UNOPENED))
    );
    stale.run(async {}).await;
    assert_eq!(
        receiver.got.lock().expect("got").len(),
        1,
        "nothing was posted"
    );
    sqlx::query("UPDATE event_sinks SET next_attempt_at = NULL WHERE id = $1")
        .bind(&ids[1])
        .execute(app.db.db.pool())
        .await
        .expect("due again");

    // With the old key dropped, a worker on the new key alone still signs correctly.
    deliver_until(
        app.db.db.clone().with_keyring(new_only.clone()),
        "worker-key2",
        &receiver,
        2,
    )
    .await;
    assert_eq!(
        *receiver.bad.lock().expect("bad"),
        0,
        "every signature verified"
    );
}

/// The worker's flags are typed where they enter, as the API's: a bad value is refused at start
/// (exit 2, naming the flag and what it takes), before any connection.
#[test]
fn the_worker_refuses_bad_flags_at_start() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
            .args(["--database-url", "postgres://nobody@127.0.0.1:1/none"])
            .args(args)
            .env_remove("DATABASE_URL")
            .output()
            .expect("run the worker");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (args, says) in [
        (
            &["--queue-kinds", "reservation,bogus"][..],
            "unknown work kind `bogus` (known: ",
        ),
        (&["--resync-seconds", "0"][..], "1 to 86400 seconds"),
        (
            &["--usage-every-seconds", "soon"][..],
            "`soon` is not a number of seconds",
        ),
        (&["--usage-window-seconds", "59"][..], "60..=86400"),
        (
            &["--log-format", "xml"][..],
            "unknown log format `xml`: use pretty or json",
        ),
    ] {
        let (code, stderr) = run(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // A good value goes on to connect (and fails there, not at the flags).
    let (code, stderr) = run(&["--queue-kinds", "reservation, noop", "--log-format", "json"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("cannot connect"), "{stderr}");
}

/// A waker listening for the writers' pokes until `stop`, returned once its LISTEN connection
/// has heard one (a writing commit's).
async fn listening_waker(
    db: &compute_domain::db::Db,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> compute_workers::wake::Waker {
    let waker = compute_workers::wake::Waker::default();
    tokio::spawn(waker.clone().listen(db.clone(), stop));
    compute_tests::eventually("the waker hears pokes", Duration::from_secs(10), || async {
        db.tx("poke", compute_domain::db::TxKind::Write, |_| {
            Box::pin(async { Ok(()) })
        })
        .await
        .expect("a write");
        tokio::time::sleep(Duration::from_millis(50)).await;
        (waker.pokes() > 0).then_some(())
    })
    .await;
    waker
}

/// A sink of acme's delivered by a dispatcher woken by pokes and idling a minute between looks,
/// once it has caught up: its receiver, the dispatcher (kept alive) and its counters.
async fn caught_up_sink(
    app: &compute_tests::TestApp,
    owner: &str,
) -> (
    Receiver,
    compute_workers::dispatch::Dispatcher,
    Arc<compute_workers::dispatch::DispatchStats>,
) {
    let db = app.db.db.clone();
    let (receiver, url) = start_receiver(Duration::ZERO).await;
    let acme = app.member("acme");
    let d = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": url } }))
        .await;
    *receiver.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    let waker = listening_waker(&db, std::future::pending()).await;
    let mut dispatcher = compute_workers::dispatch::Dispatcher::new(db.clone(), owner)
        .allowing_private_targets(true)
        .woken_by(&waker);
    dispatcher.idle = Duration::from_secs(60);
    let stats = dispatcher.stats();
    dispatcher.rebalance().await.expect("rebalance");
    compute_tests::eventually(
        "the sink caught up and idles",
        Duration::from_secs(10),
        || async {
            (stats.idle_waits.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(())
        },
    )
    .await;
    (receiver, dispatcher, stats)
}

/// A caught-up sink poked for an event that an older transaction, still running, holds back
/// (the reader takes only rows below the snapshot's xmin) looks again within milliseconds rather
/// than idling: the older transaction here ends without writing, so no poke would follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_held_back_by_a_running_transaction_looks_again_soon() {
    let app = spawn_app().await;
    let db = app.db.db.clone();
    let (receiver, _dispatcher, stats) = caught_up_sink(&app, "worker-held").await;
    let before = receiver.got.lock().expect("got").len();
    // An older transaction takes its xid and stays open; it writes nothing, so its end pokes
    // no one (a plain pool transaction, not `Db::tx`).
    let mut older = db.pool().begin().await.expect("begin");
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *older)
        .await
        .expect("an xid");
    db.tx("emit", compute_domain::db::TxKind::Write, |conn| {
        Box::pin(async move {
            sqlx::query("SELECT compute_emit('test.tick', 'acme', 'held', '{}')")
                .execute(&mut *conn)
                .await?;
            Ok(())
        })
    })
    .await
    .expect("an event");
    compute_tests::eventually(
        "the poked sink finds the event held back",
        Duration::from_secs(10),
        || async { (stats.held_back.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;
    assert_eq!(
        receiver.got.lock().expect("got").len(),
        before,
        "nothing is delivered while the older transaction runs"
    );
    older.commit().await.expect("the older transaction ends");
    compute_tests::eventually(
        "the event reaches the receiver long before the sink's one-minute look",
        Duration::from_secs(10),
        || async { (receiver.got.lock().expect("got").len() > before).then_some(()) },
    )
    .await;
}

/// Enqueues a `noop` item `key` in a writing transaction (whose commit pokes the listeners).
async fn enqueue_noop(db: &compute_domain::db::Db, key: &'static str) {
    db.tx("enqueue_noop", compute_domain::db::TxKind::Write, |conn| {
        Box::pin(async move {
            compute_domain::work_queue::enqueue(
                conn,
                compute_domain::work_queue::WorkKind::Noop,
                key,
                SHARDS,
                Duration::ZERO,
            )
            .await
        })
    })
    .await
    .expect("enqueue");
}

/// Workers are poked, and a lost poke only delays: a queue loop idling for a minute runs an
/// item enqueued by a writing commit within seconds (the commit's poke ends its wait); a loop
/// that hears no poke at all runs it by polling, within its interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_wakes_an_idle_queue_and_polling_alone_still_delivers() {
    let app = spawn_app().await;
    let db = app.db.db.clone();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let until_stop = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let waker = listening_waker(&db, until_stop(stopped.clone())).await;
    let done = |key: &'static str| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM work_queue WHERE kind = 'noop' AND key = $1",
            )
            .bind(key)
            .fetch_one(&pool)
            .await
            .expect("queue")
                == 0
        }
    };
    let shards_held = |owner: &'static str| {
        let pool = db.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM leases WHERE name LIKE 'shard:noop:%' AND owner = $1 AND expires_at > compute_now()",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .expect("leases")
                == i64::from(SHARDS)
        }
    };

    // 1. Woken: the loop idles for a minute after its first empty step.
    let woken = QueueWorker::new(
        db.clone(),
        "w-woken",
        &[compute_domain::work_queue::WorkKind::Noop],
    )
    .woken_by(&waker);
    let stats = woken.stats();
    tokio::spawn(woken.run(Duration::from_secs(60), until_stop(stopped.clone())));
    compute_tests::eventually(
        "the woken loop holds its shards and has begun its idle wait",
        Duration::from_secs(10),
        || async {
            (shards_held("w-woken").await
                && stats.idle_waits.load(std::sync::atomic::Ordering::Relaxed) > 0)
                .then_some(())
        },
    )
    .await;
    enqueue_noop(&db, "poked").await;
    compute_tests::eventually(
        "the poked item runs long before the loop's one-minute poll",
        Duration::from_secs(15),
        || async { done("poked").await.then_some(()) },
    )
    .await;
    // The loop counts an item after its finishing commit, which the check above can see
    // first: the count follows within moments, and is then exactly one.
    compute_tests::eventually(
        "the loop counts the item it ran",
        Duration::from_secs(5),
        || async { (stats.succeeded.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;
    assert_eq!(
        stats.succeeded.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let _ = stop.send(true);

    // 2. Every poke dropped (no waker): a loop polling every 300 ms still runs the item.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let polling = QueueWorker::new(
        db.clone(),
        "w-polling",
        &[compute_domain::work_queue::WorkKind::Noop],
    );
    let stats = polling.stats();
    tokio::spawn(polling.run(Duration::from_millis(300), until_stop(stopped.clone())));
    compute_tests::eventually(
        "the polling loop holds its shards and has begun its idle wait",
        Duration::from_secs(20),
        || async {
            (shards_held("w-polling").await
                && stats.idle_waits.load(std::sync::atomic::Ordering::Relaxed) > 0)
                .then_some(())
        },
    )
    .await;
    enqueue_noop(&db, "polled").await;
    compute_tests::eventually(
        "the polled item runs within a few of the loop's intervals",
        Duration::from_secs(5),
        || async { done("polled").await.then_some(()) },
    )
    .await;
    // The loop counts an item after its finishing commit, which the check above can see
    // first: the count follows within moments, and is then exactly one.
    compute_tests::eventually(
        "the loop counts the item it ran",
        Duration::from_secs(5),
        || async { (stats.succeeded.load(std::sync::atomic::Ordering::Relaxed) > 0).then_some(()) },
    )
    .await;
    assert_eq!(
        stats.succeeded.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let _ = stop.send(true);
}

/// The same for a webhook sink: caught up, it waits a minute between looks at the outbox; an
/// event written by a commit reaches the receiver within seconds, woken by the commit's poke.
/// (Without pokes the sinks poll: every other webhook test here runs so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_wakes_a_caught_up_webhook_sink() {
    let app = spawn_app().await;
    let db = app.db.db.clone();
    let (receiver, _dispatcher, _) = caught_up_sink(&app, "worker-poked").await;
    let before = receiver.got.lock().expect("got").len();
    db.tx("emit", compute_domain::db::TxKind::Write, |conn| {
        Box::pin(async move {
            sqlx::query("SELECT compute_emit('test.tick', 'acme', 'poked', '{}')")
                .execute(&mut *conn)
                .await?;
            Ok(())
        })
    })
    .await
    .expect("an event");
    compute_tests::eventually(
        "the event reaches the receiver long before the sink's one-minute look",
        Duration::from_secs(15),
        || async { (receiver.got.lock().expect("got").len() > before).then_some(()) },
    )
    .await;
}

/// A worker's claimed batch expires its due reservations in one transaction: several tenants'
/// quota and the nodes' scalars come back exactly, each expired reservation gets its one
/// `reservation.expired` (after its `reservation.active` when no reconciler activated it), and
/// the batch's reservations that are not due are left as they were.
#[tokio::test]
async fn a_batch_of_expiries_gives_back_exactly_what_each_held() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let op = app.operator();
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "beta", "scopeId": p.pool, "gpus": 8, "vcpu": 64 } }),
    )
    .await;
    let mut ids = Vec::new();
    for (tenant, key, start, end) in [
        ("acme", "a1", None, "2031-01-01T00:10:00Z"),
        ("acme", "a2", None, "2031-01-01T00:10:00Z"),
        ("beta", "b1", None, "2031-01-01T00:10:00Z"),
        // Starts at 00:01, never activated: read as active, then expired.
        (
            "beta",
            "b2",
            Some("2031-01-01T00:01:00Z"),
            "2031-01-01T00:10:00Z",
        ),
        // Not due when the others are; the pool's four slots are taken, so it waits, pending,
        // holding its quota and no scalars.
        ("acme", "later", None, "2031-01-01T05:00:00Z"),
    ] {
        let mut i = json!({ "i": { "poolId": p.pool, "endsAt": end, "idempotencyKey": key,
            "allocations": [{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1, "vcpu": 2 }] } });
        if let Some(s) = start {
            i["i"]["startsAt"] = json!(s);
        }
        let d = app.ok(&app.member(tenant), CREATE, i).await;
        ids.push(
            d["createReservation"]["reservation"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let used = |tenant: &'static str| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, f64>(
                "SELECT coalesce(sum(used), 0)::float8 FROM quota_usage WHERE tenant_id = $1 AND resource = 'gpu'",
            )
            .bind(tenant)
            .fetch_one(&pool)
            .await
            .expect("used")
        }
    };
    assert_eq!(used("acme").await, 0.75);
    assert_eq!(used("beta").await, 0.5);
    let allocated_vcpu = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(sum(allocated), 0)::bigint FROM node_resources WHERE resource = 'vcpu'",
        )
        .fetch_one(app.db.db.pool())
        .await
        .expect("vcpu")
    };
    assert_eq!(
        allocated_vcpu().await,
        8,
        "four placed reservations of 2 vCPU"
    );
    app.db.advance_clock(3600).await;
    let expired = compute_domain::reservations::reconcile::expire_batch(
        &app.db.db,
        &ids.iter()
            .map(|i| compute_domain::ids::ReservationId::parse("rsv", i).expect("id"))
            .collect::<Vec<_>>(),
    )
    .await
    .expect("a batch");
    assert_eq!(expired.len(), 4, "the four due ones: {expired:?}");
    assert!(
        !expired.iter().any(|e| e.as_str() == ids[4]),
        "the later one is not due"
    );
    assert_eq!(
        used("acme").await,
        0.25,
        "acme keeps the pending one's quarter"
    );
    assert_eq!(used("beta").await, 0.0);
    assert_eq!(
        allocated_vcpu().await,
        0,
        "every placed one's vCPU came back"
    );
    for (n, id) in ids.iter().enumerate() {
        let types: Vec<String> =
            sqlx::query_scalar("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq")
                .bind(id)
                .fetch_all(app.db.db.pool())
                .await
                .expect("events");
        let expected: &[&str] = match n {
            0..=2 => &["reservation.active", "reservation.expired"],
            3 => &[
                "reservation.scheduled",
                "reservation.active",
                "reservation.expired",
            ],
            _ => &["reservation.pending"],
        };
        assert_eq!(types, expected, "reservation {n}");
    }
    // Again: nothing is due any more.
    let again = compute_domain::reservations::reconcile::expire_batch(
        &app.db.db,
        &ids.iter()
            .map(|i| compute_domain::ids::ReservationId::parse("rsv", i).expect("id"))
            .collect::<Vec<_>>(),
    )
    .await
    .expect("a batch");
    assert!(again.is_empty());
}

/// An item that keeps failing backs off at the cap however often it failed (`power(2, 1024)`
/// overflowed `float8`, failed the batch's finish and left every item of the shard claimed),
/// and an item enqueued again while it ran is due at once after the failure.
#[tokio::test]
async fn an_item_that_failed_a_thousand_times_still_backs_off_and_a_new_generation_runs_at_once() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = app.db.db.clone();
    // A key no reservation id can be: it fails at every run.
    sqlx::query("SELECT compute_enqueue('reservation', ARRAY['bogus'], $1, 0)")
        .bind(SHARDS)
        .execute(db.pool())
        .await
        .expect("enqueue");
    sqlx::query("UPDATE work_queue SET attempts = 1024 WHERE key = 'bogus'")
        .execute(db.pool())
        .await
        .expect("attempts");
    let mut w = QueueWorker::new(db.clone(), "worker-f", &KINDS);
    w.rebalance().await.expect("shards");
    w.step().await.expect("a step with a failing item succeeds");
    let row = || async {
        sqlx::query_as::<_, (i32, Option<i64>, f64, bool)>(
            "SELECT attempts, claimed_gen, extract(epoch FROM not_before - compute_now())::float8, \
                    last_error LIKE '%not its subject''s id%' FROM work_queue WHERE key = 'bogus'",
        )
        .fetch_one(db.pool())
        .await
        .expect("row")
    };
    assert_eq!(
        row().await,
        (1025, None, 300.0, true),
        "failed, unclaimed, due after the 300 s cap"
    );
    // A new generation while it runs: claim it, enqueue again, then fail the claimed run.
    app.db.advance_clock(300).await;
    let items = db
        .tx("claim", compute_domain::db::TxKind::Maintenance, |conn| {
            Box::pin(async move {
                let shards: Vec<i32> = (0..SHARDS).collect();
                compute_domain::work_queue::claim(
                    conn,
                    compute_domain::work_queue::WorkKind::Reservation,
                    &shards,
                    10,
                    std::time::Duration::from_secs(60),
                )
                .await
            })
        })
        .await
        .expect("claim");
    assert_eq!(items.len(), 1);
    sqlx::query("SELECT compute_enqueue('reservation', ARRAY['bogus'], $1, 0)")
        .bind(SHARDS)
        .execute(db.pool())
        .await
        .expect("enqueue again");
    let item = items[0].clone();
    db.tx(
        "fail",
        compute_domain::db::TxKind::Maintenance,
        move |conn| {
            let item = item.clone();
            Box::pin(async move { compute_domain::work_queue::fail(conn, &item, "failed").await })
        },
    )
    .await
    .expect("fail");
    let (attempts, claimed, due_in, _) = row().await;
    assert_eq!(
        (attempts, claimed, due_in),
        (1025, None, 0.0),
        "the new generation is due now and its attempts are not counted up"
    );
}

/// A sink handed over to spread the work is not taken again by the same dispatcher while the
/// task that hands it over still delivers its last batch: the fair share going back up (a
/// dispatcher's presence lapsing, a tenant's new or resumed sink) made a second task deliver
/// the same events beside the first, and the first's release then ended the second's lease.
#[tokio::test]
async fn a_sink_handed_over_is_not_taken_again_while_its_last_batch_is_posted() {
    let app = spawn_app().await;
    let acme = app.member("acme");
    // Sink A takes anything; sink B (the later id, the one handed over) is held at its gate.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url_a = format!("http://{}/hook", listener.local_addr().expect("addr"));
    let router = axum::Router::new().route(
        "/hook",
        axum::routing::post(|| async { axum::http::StatusCode::NO_CONTENT }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    app.ok(&acme, CREATE_SINK, json!({ "i": { "url": url_a } }))
        .await;
    let (b, url_b) = start_receiver(Duration::ZERO).await;
    let d = app
        .ok(&acme, CREATE_SINK, json!({ "i": { "url": url_b } }))
        .await;
    *b.secret.lock().expect("secret") = d["createEventSink"]["secret"]
        .as_str()
        .expect("secret")
        .to_owned();
    sqlx::query(
        "SELECT compute_emit('test.tick', 'acme', 'e' || g, '{}') FROM generate_series(1, 5) g",
    )
    .execute(app.db.db.pool())
    .await
    .expect("emit");
    let db = app.db.db.clone();
    let held = b.gate.lock().await;
    let mut one = compute_workers::dispatch::Dispatcher::new(db.clone(), "dispatcher-1")
        .allowing_private_targets(true);
    one.idle = Duration::from_millis(20);
    one.rebalance().await.expect("rebalance");
    assert_eq!(one.sinks_held(), 2);
    let arrived = || b.arrived.load(std::sync::atomic::Ordering::SeqCst);
    compute_tests::eventually("B's first batch is at its receiver", WAIT, || async {
        (arrived() >= 1).then_some(())
    })
    .await;
    // Another dispatcher appears: the share is 1, B is handed over (its batch still posting).
    let ghost = compute_workers::queue::presence_lease("dispatcher", "ghost");
    sqlx::query(
        "INSERT INTO leases (name, owner, epoch, expires_at) VALUES ($1, 'ghost', 1, compute_now() + interval '1 hour')",
    )
    .bind(&ghost)
    .execute(db.pool())
    .await
    .expect("ghost");
    one.rebalance().await.expect("rebalance");
    assert_eq!(one.sinks_held(), 1, "B handed over");
    // It lapses: the share is 2 again, and B is due, but its task has not ended.
    sqlx::query(
        "UPDATE leases SET expires_at = compute_now() - interval '1 second' WHERE name = $1",
    )
    .bind(&ghost)
    .execute(db.pool())
    .await
    .expect("lapse");
    one.rebalance().await.expect("rebalance");
    assert_eq!(
        one.sinks_held(),
        1,
        "B is not taken again while it is handed over"
    );
    drop(held);
    // Once its task ended, B is taken again and everything arrives once.
    tokio::time::timeout(WAIT, async {
        while b.got.lock().expect("got").len() < 5 {
            one.rebalance().await.expect("rebalance");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("B gets its five ticks");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let got = b.got.lock().expect("got").clone();
    let mut once = got.clone();
    once.sort();
    once.dedup();
    assert_eq!(once.len(), got.len(), "no event twice: {got:?}");
    assert_eq!(*b.bad.lock().expect("bad"), 0);
}

/// One reservation whose expiry fails at every pass (here a charge its quota row cannot give
/// back) does not hold up the others: the resync logs it and goes on (it stopped at the first
/// failure, and the failing one, first by id, came first again at every pass).
#[tokio::test]
async fn a_reservation_that_fails_to_expire_does_not_hold_up_the_others() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 8 } }),
    )
    .await;
    let member = app.member("acme");
    let mut ids = Vec::new();
    for key in ["first", "second"] {
        let d = app
            .ok(
                &member,
                CREATE,
                json!({ "i": { "poolId": p.pool, "endsAt": "2031-01-01T01:00:00Z", "idempotencyKey": key,
                    "allocations": [{ "gpuCount": 1 }] } }),
            )
            .await;
        ids.push(d["createReservation"]["reservation"]["id"].clone());
    }
    ids.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
    sqlx::query(
        "UPDATE reservations SET charged = (SELECT jsonb_agg(c || '{\"amount\": 1000}') FROM jsonb_array_elements(charged) c) \
          WHERE id = $1",
    )
    .bind(ids[0].as_str())
    .execute(app.db.db.pool())
    .await
    .expect("break the first");
    app.db.advance_clock(3600).await;
    let moved = compute_domain::reservations::reconcile::expire_due(&app.db.db)
        .await
        .expect("the pass goes on past the failure");
    assert_eq!(moved, 1);
    // The rows (the API shows a reservation past its end as expired either way).
    let rows: Vec<String> = sqlx::query_scalar("SELECT state FROM reservations ORDER BY id")
        .fetch_all(app.db.db.pool())
        .await
        .expect("states");
    assert_eq!(
        rows,
        ["active", "expired"],
        "the second expired past the first's failure"
    );
    assert_eq!(state_of(&app, &member, &ids[1]).await, "EXPIRED");
}
