//! Processes killed at any moment: an API process SIGKILLed in the middle of a stream of
//! idempotent mutations loses and doubles nothing; each client's retry with the same key finds
//! exactly one effect.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use compute_tests::{TEST_AUDIENCE, TEST_ISSUER, TEST_SECRET, eventually};
use serde_json::{Value, json};

use crate::reservations::{CREATE, input, pool};

/// A real `compute-api serve` process on `db`; its base URL once `/readyz` says ready.
async fn start_api(db: &compute_tests::TestDb) -> (tokio::process::Child, String) {
    start_api_with(&db.process_env(), &[]).await
}

/// [`start_api`] with more `serve` arguments.
pub(crate) async fn start_api_with(
    env: &[(&'static str, String)],
    extra: &[&str],
) -> (tokio::process::Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec!["serve", "--listen", listen.as_str()];
    args.extend_from_slice(extra);
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_test-api"))
        .args(&args)
        .envs(env.iter().cloned())
        .env("COMPUTE_JWT_HS256_SECRET", TEST_SECRET)
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("COMPUTE_JWT_ISSUER", TEST_ISSUER)
        .env("COMPUTE_JWT_AUDIENCE", TEST_AUDIENCE)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the API");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually("the API process is ready", Duration::from_secs(60), || {
        let req = http.get(format!("{base}/readyz")).send();
        async move { req.await.ok().filter(|r| r.status().is_success()) }
    })
    .await;
    (child, base)
}

async fn post(http: &reqwest::Client, base: &str, token: &str, body: Value) -> Option<Value> {
    let res = http
        .post(format!("{base}/graphql"))
        .bearer_auth(token)
        .json(&json!({ "query": CREATE, "variables": body }))
        .send()
        .await
        .ok()?;
    res.json::<Value>().await.ok()
}

/// What a key's answer says happened: a reservation's id, or a final error's code.
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
async fn an_api_killed_mid_stream_leaves_each_key_exactly_one_effect() {
    const KEYS: usize = 60;
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    // A quota that does not run out: every key's effect is a reservation (placed, or pending
    // once the GPUs are taken).
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 100000, "vcpu": 100000 } }),
    )
    .await;
    let member = app.member("acme");
    let (mut first, base) = start_api(&app.db).await;
    let http = reqwest::Client::new();
    let request = |k: usize| input(&p.pool, &format!("crash-{k}"), json!([{ "gpuCount": 1 }]));

    // Every key at once; the process is SIGKILLed as soon as a few have answered.
    let mut sent = tokio::task::JoinSet::new();
    for k in 0..KEYS {
        let (http, base, member, body) = (http.clone(), base.clone(), member.clone(), request(k));
        sent.spawn(async move { (k, post(&http, &base, &member, body).await) });
    }
    let mut before: HashMap<usize, Result<String, String>> = HashMap::new();
    let mut lost = 0;
    while let Some(done) = sent.join_next().await {
        let (k, answer) = done.expect("join");
        match answer {
            Some(body) => {
                before.insert(k, outcome(&body));
            }
            None => lost += 1,
        }
        if before.len() == 5 {
            first.start_kill().expect("SIGKILL");
        }
    }
    let _ = first.wait().await;
    assert!(
        lost > 0,
        "the kill cut requests off in flight ({} answered)",
        before.len()
    );

    // A new process; every client retries its key.
    let (_second, base) = start_api(&app.db).await;
    let mut after: HashMap<usize, Result<String, String>> = HashMap::new();
    for k in 0..KEYS {
        let body = post(&http, &base, &member, request(k))
            .await
            .expect("the new process answers");
        after.insert(k, outcome(&body));
    }
    for (k, answer) in &before {
        assert_eq!(
            after.get(k),
            Some(answer),
            "key {k}: the retry finds the answer given before the kill"
        );
    }
    let ids: HashSet<&String> = after.values().filter_map(|a| a.as_ref().ok()).collect();
    let refused = after.values().filter(|a| a.is_err()).count();
    eprintln!(
        "{} keys answered before the kill, {lost} cut off; after the restart {} reservations, \
         {refused} final refusals",
        before.len(),
        ids.len()
    );
    assert_eq!(
        ids.len() + refused,
        KEYS,
        "one answer per key, ids distinct"
    );
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM reservations")
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
    assert_eq!(
        rows as usize,
        ids.len(),
        "exactly the reservations the keys answer with: none lost, none doubled"
    );
    let (created,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM outbox WHERE type IN ('reservation.active', 'reservation.pending', 'reservation.scheduled')",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(
        created as usize,
        ids.len(),
        "one creation event per reservation"
    );
    for a in after.values() {
        if let Err(code) = a {
            assert_eq!(code, "QUOTA_EXCEEDED", "a final answer, replayed: {a:?}");
        }
    }
}
