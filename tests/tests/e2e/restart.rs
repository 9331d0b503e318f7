//! The database restarted under load: requests in flight and during the outage get a retryable
//! code (`UNAVAILABLE`, `LOCK_TIMEOUT`) or succeed, never `INTERNAL`; nothing is half-written;
//! `/readyz` says not ready while the database is away; the pool recovers without restarting
//! the API; each key retried afterwards finds exactly one effect.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres};
use compute_tests::eventually;
use serde_json::{Value, json};

use crate::reservations::{CREATE, input, pool};

fn outcome(body: &Value) -> Result<String, String> {
    match body["data"]["createReservation"]["reservation"]["id"].as_str() {
        Some(id) => Ok(id.to_owned()),
        None => Err(body["errors"][0]["extensions"]["code"]
            .as_str()
            .unwrap_or("<none>")
            .to_owned()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_under_load_is_retryable_and_the_pool_recovers() {
    let dir = std::env::temp_dir()
        .join("compute-tests")
        .join(format!("restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = EmbeddedOptions {
        data_dir: dir.clone(),
        durable: false,
        max_connections: 40,
    };
    let mut pg = EmbeddedPostgres::start(options.clone())
        .await
        .expect("the test's own server");
    pg.ensure_database("restart").await.expect("database");
    let db = compute_tests::test_db_at(&pg.url("restart"), "restart", true).await;
    let app = compute_tests::TestApp::builder().on(db).start().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    // A quota that does not run out: the load writes reservations (placed, then pending once
    // the GPUs are taken) rather than cheap refusals.
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 100000, "vcpu": 100000 } }),
    )
    .await;
    let member = app.member("acme");
    let ready = |app: &compute_tests::TestApp| {
        let req = app.http.get(app.url("/readyz")).send();
        async move { req.await.map(|r| r.status().as_u16()).unwrap_or(0) }
    };
    assert_eq!(ready(&app).await, 200);

    // Two clients reserve in a loop, each with keys of its own, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..2 {
        let (http, url, member, pool_id, stop) = (
            app.http.clone(),
            app.url("/graphql"),
            member.clone(),
            p.pool.clone(),
            stop.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut answers: Vec<(String, Option<Result<String, String>>)> = Vec::new();
            let mut k = 0;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("c{c}-{k}");
                k += 1;
                let body = input(&pool_id, &key, json!([{ "gpuCount": 1 }]));
                let answer = match http
                    .post(&url)
                    .bearer_auth(&member)
                    .json(&json!({ "query": CREATE, "variables": body }))
                    .send()
                    .await
                {
                    Ok(res) => res.json::<Value>().await.ok().map(|b| outcome(&b)),
                    Err(_) => None,
                };
                answers.push((key, answer));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The database goes away for a while.
    tokio::task::block_in_place(|| pg.shutdown());
    eventually(
        "/readyz says not ready while the database is away",
        Duration::from_secs(30),
        || async { (ready(&app).await == 503).then_some(()) },
    )
    .await;
    // Longer than the pool's 5 s acquire timeout: a request that waits for a connection gives
    // up with UNAVAILABLE (a shorter outage is absorbed: the waiting request succeeds).
    tokio::time::sleep(Duration::from_secs(6)).await;
    pg.start_again(&options)
        .await
        .expect("the server starts again");
    eventually(
        "the pool recovers without a restart of the API",
        Duration::from_secs(60),
        || async { (ready(&app).await == 200).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for c in clients {
        answers.extend(c.await.expect("client"));
    }

    let mut codes: HashMap<String, usize> = HashMap::new();
    for (_, a) in &answers {
        if let Some(Err(code)) = a {
            *codes.entry(code.clone()).or_default() += 1;
        }
    }
    let placed = answers
        .iter()
        .filter(|(_, a)| matches!(a, Some(Ok(_))))
        .count();
    let cut = answers.iter().filter(|(_, a)| a.is_none()).count();
    eprintln!(
        "{} requests across the restart: {placed} reservations, {cut} without an answer, codes {codes:?}",
        answers.len()
    );
    assert!(
        codes.get("UNAVAILABLE").copied().unwrap_or(0) > 0,
        "the outage was seen: {codes:?}"
    );
    for code in codes.keys() {
        assert!(
            ["UNAVAILABLE", "LOCK_TIMEOUT", "QUOTA_EXCEEDED"].contains(&code.as_str()),
            "a retryable or final code, never {code}: {codes:?}"
        );
    }

    // Every key is retried; each finds one effect, and the database holds exactly those.
    let mut ids = HashSet::new();
    let mut refused = 0;
    for (key, first) in &answers {
        let body = input(&p.pool, key, json!([{ "gpuCount": 1 }]));
        let (_, retry) = app.graphql(CREATE, body, Some(&member)).await;
        let retry = outcome(&retry);
        if let Some(Ok(id)) = first {
            assert_eq!(retry.as_ref(), Ok(id), "{key}: the first answer stands");
        }
        match retry {
            Ok(id) => assert!(ids.insert(id), "{key}: an id of its own"),
            Err(code) => {
                assert_eq!(code, "QUOTA_EXCEEDED", "{key}: a final answer");
                refused += 1;
            }
        }
    }
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM reservations")
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
    assert_eq!(
        rows as usize,
        ids.len(),
        "no reservation without its key's answer"
    );
    assert_eq!(ids.len() + refused, answers.len());
    drop(app);
    drop(pg);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that leaves in the middle of its mutation: the server drops the request, its
/// transaction rolls back, and its connection goes back to the pool clean. The request waits on
/// a lock the test holds, so it is in flight (inside its transaction) when the client leaves;
/// the lock is released well within the 2 s lock timeout, so a server that kept the request
/// running after its client left would commit the reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_leaves_stops_and_rolls_back() {
    use tokio::io::AsyncWriteExt;
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 100 } }),
    )
    .await;
    let member = app.member("acme");
    let mut holder = app.db.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM quota_usage WHERE tenant_id = 'acme' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .expect("hold acme's quota rows");

    let body = json!({ "query": CREATE, "variables": input(&p.pool, "gone-1", json!([{ "gpuCount": 1 }])) })
        .to_string();
    let mut client = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    let request = format!(
        "POST /graphql HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {member}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    client
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    app.until_lock_waiters(1).await;
    drop(client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.commit().await.expect("release the lock");

    // The request's backend finishes its statement, rolls back and goes idle.
    let pool_ = app.db.db.pool().clone();
    eventually(
        "no backend of the API is in a transaction",
        Duration::from_secs(10),
        || {
            let pool_ = pool_.clone();
            async move {
                let (busy,): (i64,) = sqlx::query_as(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                     AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction', \
                     'idle in transaction (aborted)')",
                )
                .fetch_one(&pool_)
                .await
                .expect("pg_stat_activity");
                (busy == 0).then_some(())
            }
        },
    )
    .await;
    for (table, n) in [
        ("reservations", app.count("reservations").await),
        ("idempotency_keys", app.count("idempotency_keys").await),
    ] {
        assert_eq!(n, 0, "{table}: the abandoned request wrote nothing");
    }
    let (events,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM outbox WHERE type LIKE 'reservation.%'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("events");
    assert_eq!(events, 0, "and emitted nothing");

    // The same key from a client that waits: one reservation (the lock is free now).
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "gone-1", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(d["createReservation"]["idempotentReplay"], false, "{d}");
    assert_eq!(app.count("reservations").await, 1);
}

/// A pooled connection cut while it sat idle (a restart of the database or of a pooler, a
/// pooler's idle timeout) is found dead by the ping it gets when it has been idle for more than
/// half a second, and replaced before any request uses it: no request sees it. (Without the
/// ping, each cut connection fails the next statement handed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_while_idle_are_replaced_before_a_request_uses_them() {
    let app = compute_tests::spawn_app().await;
    let operator = app.operator();
    let query = "{ sites(first: 1) { totalCount } }";
    let ok = |body: &Value| body.get("errors").is_none() && body["data"]["sites"].is_object();
    // Several requests at once, each of which must succeed: the pool opens several connections.
    let at_once = || async {
        let requests: Vec<_> = (0..6)
            .map(|_| app.graphql_in_background(&operator, query, json!({})))
            .collect();
        for r in requests {
            let body = r.await.expect("a request");
            assert!(ok(&body), "{body}");
        }
    };
    at_once().await;
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()
            AND application_name = 'compute' AND state = 'idle'
            AND query NOT ILIKE 'listen%') cut",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("pg_terminate_backend");
    assert!(cut >= 2, "the pool held {cut} idle connections to cut");
    // Past the window in which a connection is handed out without a ping.
    tokio::time::sleep(Duration::from_millis(700)).await;
    for _ in 0..cut + 2 {
        let (status, body) = app.graphql(query, json!({}), Some(&operator)).await;
        assert_eq!(status, 200, "{body}");
        assert!(ok(&body), "a request was handed a cut connection: {body}");
    }
    at_once().await;
}
