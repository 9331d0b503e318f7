//! Scale-out: two `compute-api serve` processes and two `compute-worker` processes on one
//! database through PgBouncer in transaction pooling mode, as `README.md` ("Running several
//! processes") deploys them. Duplicates of each key race across the two APIs, a subscription on
//! one API sees what the other committed (woken by its direct `LISTEN`), and the workers place
//! what waited, all through a pool smaller than the processes' own pools.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use compute_tests::{eventually, spawn_app};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::crash::start_api_with;
use crate::reservations::{CREATE, input, pool};

/// Server connections PgBouncer may open for the database: fewer than the processes ask for.
const POOL_SIZE: u32 = 6;

fn start_worker(env: &[(&'static str, String)]) -> tokio::process::Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    tokio::process::Command::new(env!("CARGO_BIN_EXE_test-worker"))
        .args(["--role", "all", "--listen", &format!("127.0.0.1:{port}")])
        .envs(env.iter().cloned())
        .env("COMPUTE_SECRETS_KEY", compute_tests::SECRETS_KEY)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start a worker process")
}

async fn graphql(http: &reqwest::Client, base: &str, token: &str, query: &str, v: Value) -> Value {
    http.post(format!("{base}/graphql"))
        .bearer_auth(token)
        .json(&json!({ "query": query, "variables": v }))
        .send()
        .await
        .expect("the API answers")
        .json()
        .await
        .expect("JSON")
}

async fn metric(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_apis_and_two_workers_share_one_database_through_pgbouncer() {
    const KEYS: usize = 12;
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 100, "vcpu": 1000 } }),
    )
    .await;
    let pooled = compute_tests::pgbouncer_for(&app.db, POOL_SIZE).await;
    let env = pooled.process_env();
    let (_a, base_a) = start_api_with(&env, &[]).await;
    let (_b, base_b) = start_api_with(&env, &[]).await;
    let _workers = [start_worker(&env), start_worker(&env)];
    let http = reqwest::Client::new();
    let member = app.member("acme");

    // A subscription on B, from the present.
    let after =
        graphql(&http, &base_b, &member, "{ eventCursor }", json!({})).await["data"]["eventCursor"]
            .clone();
    let mut req = format!("{}/graphql", base_b.replacen("http", "ws", 1))
        .into_client_request()
        .expect("request");
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "graphql-transport-ws".parse().expect("header"),
    );
    let (mut ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .expect("upgrade");
    let send = |v: Value| Message::Text(v.to_string().into());
    ws.send(send(json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {member}") } })))
        .await
        .expect("init");
    ws.send(send(json!({ "id": "e", "type": "subscribe", "payload": {
        "query": "subscription($after: String) { events(after: $after, types: [\"reservation.active\", \"reservation.pending\"]) { type subject } }",
        "variables": { "after": after } } })))
        .await
        .expect("subscribe");

    // Each key twice at once, once to each API: 1 untainted-H100 GPU each, 2 such GPUs.
    let mut sent = tokio::task::JoinSet::new();
    for k in 0..KEYS {
        for base in [&base_a, &base_b] {
            let (http, base, member) = (http.clone(), base.clone(), member.clone());
            let body = input(
                &p.pool,
                &format!("scale-{k}"),
                json!([{ "gpuCount": 1, "model": "H100" }]),
            );
            sent.spawn(async move { (k, graphql(&http, &base, &member, CREATE, body).await) });
        }
    }
    let mut answers: HashMap<usize, Vec<String>> = HashMap::new();
    while let Some(done) = sent.join_next().await {
        let (k, body) = done.expect("join");
        let r = &body["data"]["createReservation"]["reservation"];
        let id = r["id"]
            .as_str()
            .unwrap_or_else(|| panic!("key {k}: {body}"));
        answers.entry(k).or_default().push(id.to_owned());
    }
    for (k, ids) in &answers {
        assert_eq!(
            ids[0], ids[1],
            "key {k}: both APIs answer the same reservation"
        );
    }
    let ids: HashSet<String> = answers.values().map(|v| v[0].clone()).collect();
    assert_eq!(ids.len(), KEYS, "one reservation per key");
    let (rows,): (i64,) = sqlx::query_as("SELECT count(*) FROM reservations")
        .fetch_one(app.db.db.pool())
        .await
        .expect("count");
    assert_eq!(
        rows as usize, KEYS,
        "no key booked twice across the processes"
    );

    // B's subscriber sees every creation, most of them committed by A.
    let mut seen = HashSet::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while seen.len() < KEYS {
            match ws.next().await.expect("open").expect("a frame") {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(t.as_str()).expect("json");
                    if v["type"] == "next" {
                        let subject = v["payload"]["data"]["events"]["subject"]
                            .as_str()
                            .expect("subject")
                            .to_owned();
                        assert!(seen.insert(subject.clone()), "{subject} delivered twice");
                    } else {
                        assert!(v["type"] == "connection_ack" || v["type"] == "ping", "{v}");
                    }
                }
                _ => continue,
            }
        }
    })
    .await
    .expect("B's subscriber receives every creation within 30 s");
    assert_eq!(seen, ids, "exactly the reservations created");
    // B's tailer hears writers' pokes on its direct LISTEN connection, not only its polls. Its
    // LISTEN may come up after the burst above (all of it read by polls then): a write after it
    // is heard. Each try writes once more (a quota set through the test's own process).
    compute_tests::eventually(
        "B's tailer hears a writer's poke on its direct LISTEN connection",
        Duration::from_secs(20),
        || async {
            if metric(&http, &base_b, "compute_outbox_tailer_pokes_total").await > 0.0 {
                return Some(());
            }
            app.ok(
                &app.operator(),
                "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
                json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 100, "vcpu": 1000 } }),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        },
    )
    .await;

    // The two placed ones are released (through A); the workers place two that waited.
    let states = |id: String| {
        let (http, base, member) = (http.clone(), base_a.clone(), member.clone());
        async move {
            graphql(
                &http,
                &base,
                &member,
                "query($id: ID!) { reservation(id: $id) { state } }",
                json!({ "id": id }),
            )
            .await["data"]["reservation"]["state"]
                .as_str()
                .expect("state")
                .to_owned()
        }
    };
    let mut active = Vec::new();
    for id in &ids {
        if states(id.clone()).await == "ACTIVE" {
            active.push(id.clone());
        }
    }
    assert_eq!(active.len(), 2, "two untainted H100 GPUs");
    for id in &active {
        let body = graphql(
            &http,
            &base_a,
            &member,
            "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
            json!({ "i": { "id": id } }),
        )
        .await;
        assert_eq!(
            body["data"]["releaseReservation"]["reservation"]["state"], "RELEASED",
            "{body}"
        );
    }
    app.db.advance_clock(30).await;
    let waiting: Vec<String> = ids
        .iter()
        .filter(|i| !active.contains(i))
        .cloned()
        .collect();
    eventually(
        "the workers place two of the waiting reservations",
        Duration::from_secs(60),
        || {
            let (waiting, states) = (waiting.clone(), &states);
            async move {
                let mut placed = 0;
                for id in waiting {
                    placed += usize::from(states(id).await == "ACTIVE");
                }
                (placed == 2).then_some(())
            }
        },
    )
    .await;

    // Everything above went through the pooler: the processes' connections (two pools of 16
    // and two of 8, as many as they opened) shared at most POOL_SIZE server connections.
    let stats = pooled.stats().await;
    assert!(
        stats.servers <= i64::from(POOL_SIZE) && stats.clients > stats.servers,
        "{} client connections on at most {POOL_SIZE} server connections: {stats:?}",
        stats.clients
    );
    eventually(
        "PgBouncer counts the processes' transactions",
        Duration::from_secs(10),
        || async { (pooled.stats().await.transactions > 100).then_some(()) },
    )
    .await;
}
