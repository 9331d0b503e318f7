//! The capacity torture test: over a thousand concurrent operations through the GraphQL HTTP
//! endpoint against a fleet of 50 nodes with 8 GPUs each (exclusive, MIG and time-sliced), while
//! simulated time moves, an operator flips a tenant's quota between 0 and its limit and registers
//! nodes, and a reconciler (the workers' steps and the capacity recompute) runs beside them; then
//! every invariant checked with SQL of its own, independent of the code under test.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use compute_domain::fleet::changes::{self, NewDevice, NewNode, NewPool, NewSite};
use compute_domain::fleet::model::{DeviceMode, Labels, Layout, PoolKind};
use compute_domain::idempotency::Actor;
use compute_tests::{TestApp, test_db_with};
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::reservations::CREATE;

const NODES: usize = 50;
const OPERATIONS: usize = 1400;
const IN_FLIGHT: usize = 24;
const TENANTS: [&str; 6] = ["t0", "t1", "t2", "t3", "t4", "t5"];
/// The tenant whose GPU quota an operator flips between 0 and [`GPU_LIMIT`] during the run.
const FLIPPED: usize = 5;
const GPU_LIMIT: i64 = 60;
/// Where simulated time starts; operations move it 30 s at a time.
const T0: &str = "2031-01-01T00:00:00Z";
const TICK_SECONDS: i64 = 30;

/// The simulated time `secs` after [`T0`], as RFC 3339.
fn at(secs: i64) -> String {
    let t0 = chrono::DateTime::parse_from_rfc3339(T0).expect("T0");
    (t0 + chrono::Duration::seconds(secs)).to_rfc3339()
}

/// A small deterministic generator (xorshift), so a failing run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn build_fleet(app: &TestApp) -> (String, Vec<String>, Vec<String>) {
    let db = &app.db.db;
    let actor = Actor::operator("torture");
    let site = changes::create_site(
        db,
        &actor,
        NewSite {
            name: "torture".into(),
            region: None,
        },
        None,
    )
    .await
    .expect("site")
    .value;
    let pool = changes::create_pool(
        db,
        &actor,
        NewPool {
            site_id: site.id.clone(),
            name: "mixed".into(),
            kind: PoolKind::BareMetal,
            lost_after_seconds: None,
            vcpu_ratio: 2.0,
            memory_ratio: 1.0,
            disk_ratio: 1.0,
        },
        None,
    )
    .await
    .expect("pool")
    .value;
    let mig = Layout::parse(
        "layout",
        DeviceMode::Mig,
        Some(&[
            "3g.40gb".into(),
            "2g.20gb".into(),
            "1g.10gb".into(),
            "1g.10gb".into(),
        ]),
        None,
        81_920,
    )
    .expect("mig");
    let mut nodes = Vec::new();
    let mut devices = Vec::new();
    for n in 0..NODES {
        let gpus = (0..8)
            .map(|g| {
                let (model, memory, layout) = match g {
                    0..=3 => ("H100", 81_559, Layout::Exclusive),
                    4 | 5 => ("A100", 81_920, mig.clone()),
                    _ => ("L4", 23_034, Layout::TimeSlice(4)),
                };
                NewDevice {
                    uuid: compute_domain::fleet::model::GpuUuid::parse(
                        "uuid",
                        &format!("GPU-t{n}-{g}"),
                    )
                    .expect("a GPU uuid"),
                    vendor: "nvidia".into(),
                    model: model.into(),
                    memory_mib: memory,
                    layout,
                    // Two NVLink pairs among the H100s, two NUMA nodes: what
                    // `sameNvlinkDomain` and `sameNumaNode` keep together.
                    topology: compute_domain::fleet::model::Topology {
                        pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x17 + g)),
                        numa_node: Some(g / 4),
                        nvlink_domain: (g < 4).then(|| format!("nvl-{}", g / 2)),
                    },
                }
            })
            .collect();
        let registered = changes::register_node(
            db,
            NewNode {
                pool_id: pool.id.clone(),
                hostname: format!("torture-{n}"),
                // Five racks of ten nodes: what a gang `colocate: LABEL` keeps together.
                labels: Labels::from([("rack".to_owned(), format!("r{}", n % 5))]),
                taints: vec![],
                vcpu: 32,
                memory_mib: 262_144,
                disk_gib: 2_000,
                devices: gpus,
            },
        )
        .await
        .expect("node");
        devices.extend(registered.devices.iter().map(|d| d.id.clone()));
        nodes.push(registered.node.id);
    }
    for t in TENANTS {
        compute_domain::quota::set_quota(
            db,
            &actor,
            &compute_domain::ids::TenantId::parse("tenant", t).expect("valid tenant"),
            &compute_domain::ids::ScopeId::Pool(pool.id.clone()),
            compute_domain::quota::QuotaLimits {
                gpus: Some(GPU_LIMIT as f64),
                vcpu: Some(400),
                memory_mib: None,
            },
        )
        .await
        .expect("quota");
    }
    (
        pool.id.to_string(),
        nodes.into_iter().map(String::from).collect(),
        devices.into_iter().map(String::from).collect(),
    )
}

#[derive(Default)]
struct Tally {
    /// (operation, outcome) → count.
    counts: BTreeMap<(String, String), u64>,
    /// Responses that break the rules: 5xx, INTERNAL, deadlocks, replays that differ.
    violations: Vec<String>,
    /// Checks made during the run → how many times.
    checks: BTreeMap<String, u64>,
}

impl Tally {
    fn add(&mut self, op: &str, outcome: &str) {
        *self
            .counts
            .entry((op.to_owned(), outcome.to_owned()))
            .or_default() += 1;
    }
    fn checked(&mut self, what: &str, n: u64) {
        *self.checks.entry(what.to_owned()).or_default() += n;
    }
}

/// Posts until the answer is final: `IDEMPOTENCY_IN_PROGRESS` and `LOCK_TIMEOUT` are transient
/// (nothing was stored), so a client retries them with the same key.
async fn final_answer(
    app_url: &str,
    http: &reqwest::Client,
    token: &str,
    query: &str,
    variables: Value,
) -> (String, Value) {
    let mut answer = call(app_url, http, token, query, variables.clone()).await;
    for _ in 0..50 {
        if answer.0 != "IDEMPOTENCY_IN_PROGRESS" && answer.0 != "LOCK_TIMEOUT" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        answer = call(app_url, http, token, query, variables.clone()).await;
    }
    answer
}

/// What a createReservation answer says, for comparing answers to one key: the error code, or
/// the reservation and where it was placed.
fn answer_of(outcome: &str, body: &Value) -> Value {
    if outcome == "ok" {
        let r = &body["data"]["createReservation"]["reservation"];
        json!({ "id": r["id"], "allocations": r["allocations"] })
    } else {
        json!(outcome)
    }
}

/// Rollup rows that differ from the atoms, read in one statement (one snapshot).
const ROLLUP_MISMATCHES: &str = "SELECT count(*) FROM \
      (SELECT n.pool_id, d.model, a.kind, coalesce(a.profile, '') AS profile, count(*)::int AS atoms \
         FROM device_atoms a JOIN devices d ON d.id = a.device_id JOIN nodes n ON n.id = d.node_id \
        WHERE n.retired_at IS NULL GROUP BY 1, 2, 3, 4) t \
      FULL JOIN (SELECT pool_id, model, kind, profile, atoms FROM pool_capacity_rollup WHERE atoms <> 0) r \
        ON r.pool_id = t.pool_id AND r.model = t.model AND r.kind = t.kind AND r.profile = t.profile \
     WHERE coalesce(t.atoms, 0) <> coalesce(r.atoms, 0)";

/// Posts a GraphQL request; returns the outcome word and the body.
async fn call(
    app_url: &str,
    http: &reqwest::Client,
    token: &str,
    query: &str,
    variables: Value,
) -> (String, Value) {
    let res = http
        .post(app_url)
        .bearer_auth(token)
        .header("Accept", "application/graphql-response+json")
        .json(&json!({ "query": query, "variables": variables }))
        .send()
        .await
        .expect("POST");
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap_or(Value::Null);
    if status >= 500 {
        return (format!("HTTP {status}"), body);
    }
    match body["errors"][0]["extensions"]["code"].as_str() {
        Some(code) => (code.to_owned(), body),
        None => ("ok".into(), body),
    }
}

/// The gateway the torture's daemons are connected through, its lease held for a day of
/// simulated time (longer than the run).
struct Gateway {
    id: compute_domain::ids::GatewayId,
    db: compute_domain::db::Db,
    epoch: i64,
}

impl Gateway {
    async fn start(db: &compute_domain::db::Db) -> Gateway {
        use compute_domain::node_sessions as ns;
        let id = compute_domain::ids::GatewayId::parse("gateway", "gw-torture").expect("id");
        let fence = compute_domain::leases::acquire(
            db,
            &ns::gateway_lease(&id),
            "torture",
            std::time::Duration::from_secs(86_400),
        )
        .await
        .expect("acquire")
        .expect("the gateway's lease");
        Gateway {
            id,
            db: db.fenced(&fence),
            epoch: fence.epoch,
        }
    }

    /// Opens `node`'s session (the node becomes `CONNECTED`).
    async fn open(&self, node: &str) -> compute_domain::Result<i64> {
        use compute_domain::node_sessions::{Hello, Label};
        let hello = Hello {
            daemon_version: Label::parse("daemonVersion", "torture").expect("label"),
            journal_id: Label::parse("journalId", &format!("j-{node}")).expect("label"),
            observed_generation: 0,
        };
        let node = compute_domain::ids::NodeId::parse("node", node)?;
        compute_domain::node_sessions::open(&self.db, &node, &self.id, self.epoch, &hello).await
    }

    /// Reports every open session seen just now (so none is ended as stale).
    async fn flush(&self) -> compute_domain::Result<()> {
        let open: Vec<(String, i64)> = sqlx::query_as(
            "SELECT node_id, session_epoch FROM node_sessions WHERE gateway = $1 AND closed_at IS NULL",
        )
        .bind(self.id.as_str())
        .fetch_all(self.db.pool())
        .await
        .map_err(compute_domain::Error::from)?;
        let seen: Vec<compute_domain::node_sessions::Seen> = open
            .into_iter()
            .map(|(node, epoch)| compute_domain::node_sessions::Seen {
                node: compute_domain::ids::NodeId::parse("node", &node).expect("node"),
                epoch,
                age_seconds: 0.0,
            })
            .collect();
        compute_domain::node_sessions::flush(&self.db, &self.id, &seen).await?;
        Ok(())
    }
}

/// How many deadlocks PostgreSQL has detected in the test's database (its cumulative
/// statistics, flushed first).
async fn deadlocks(app: &TestApp) -> i64 {
    let pool = app.db.db.pool();
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await;
    let _ = sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(pool)
        .await;
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .fetch_one(pool)
        .await
        .expect("pg_stat_database")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_operations_keep_every_invariant() {
    let db = test_db_with(24).await;
    db.use_sim_clock(T0).await;
    let app = compute_tests::TestApp::builder().on(db).start().await;
    let deadlocks_before = deadlocks(&app).await;
    let (pool, nodes, devices) = build_fleet(&app).await;
    // Every node's daemon is connected; the reachability flips below disconnect and reconnect
    // them, and the liveness pass makes the disconnected ones unreachable as time passes.
    let gateway = Gateway::start(&app.db.db).await;
    for node in &nodes {
        gateway.open(node).await.expect("a session");
    }
    // The usage meter runs beside the clients with one-minute windows, so windows close while
    // reservations start, grow and end around them.
    compute_domain::usage::set_window(&app.db.db, 60)
        .await
        .expect("usage windows of a minute");
    let url = app.url("/graphql");
    let op_token = app.operator();
    let tokens: Vec<String> = TENANTS.iter().map(|t| app.member(t)).collect();
    // (tenant, reservation id, its start in seconds after T0)
    let created: Arc<Mutex<Vec<(usize, String, i64)>>> = Arc::new(Mutex::new(Vec::new()));
    let tally = Arc::new(Mutex::new(Tally::default()));
    // Seconds after T0 that simulated time has reached (moved only by the tick operation, which
    // updates this after the database, so it is never ahead of `compute_now()`).
    let clock = Arc::new(AtomicI64::new(0));
    let flipped_to_zero = Arc::new(AtomicBool::new(false));
    let ticking = tokio::sync::Mutex::new(0u32);
    let done = Arc::new(AtomicBool::new(false));

    let tasks = futures_util::stream::iter(0..OPERATIONS).map(|i| {
        let (gateway, ticking) = (&gateway, &ticking);
        let (url, http, op_token, tokens, pool, nodes, devices, created, tally, clock, flipped_to_zero, app) = (
            url.clone(),
            app.http.clone(),
            op_token.clone(),
            tokens.clone(),
            pool.clone(),
            nodes.clone(),
            devices.clone(),
            created.clone(),
            tally.clone(),
            clock.clone(),
            flipped_to_zero.clone(),
            &app,
        );
        async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
            let roll = rng.below(100);
            let tenant = rng.below(TENANTS.len() as u64) as usize;
            let token = &tokens[tenant];
            let now = clock.load(Ordering::SeqCst);
            let pick = |rng: &mut Rng| -> Option<(usize, String, i64)> {
                let list = created.lock().expect("lock");
                (!list.is_empty()).then(|| list[rng.below(list.len() as u64) as usize].clone())
            };
            let record = |op: &str, outcome: &str, body: &Value| {
                let mut t = tally.lock().expect("lock");
                t.add(op, outcome);
                let message = body["errors"][0]["message"].as_str().unwrap_or("");
                if outcome.starts_with("HTTP") || outcome == "INTERNAL" || message.contains("40P01") || message.contains("deadlock") {
                    t.violations.push(format!("{op}: {outcome}: {body}"));
                }
            };
            match roll {
                0..=49 => {
                    let mut gang = Value::Null;
                    let allocations = match rng.below(6) {
                        0 => json!([{ "gpuCount": 1 + rng.below(4), "model": "H100", "vcpu": 1 + rng.below(8), "memoryMib": 4096 }]),
                        1 => json!([{ "gpuKind": "MIG", "profile": if rng.below(2) == 0 { "1g.10gb" } else { "3g.40gb" },
                                      "gpuCount": 1 + rng.below(2), "vcpu": 2 }]),
                        // Two MIG allocations: 3/7 + 2/7 or 1/7 + 3/7, charged as one exact sum.
                        2 => json!([{ "gpuKind": "MIG", "profile": "3g.40gb", "gpuCount": 1, "vcpu": 1 },
                                    { "gpuKind": "MIG", "profile": if rng.below(2) == 0 { "2g.20gb" } else { "1g.10gb" }, "gpuCount": 1, "vcpu": 1 }]),
                        3 => json!([{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1 + rng.below(3), "vcpu": 1 }]),
                        // A gang: two H100 allocations on one node, on two distinct nodes, in one
                        // rack, or in one rack on two distinct nodes.
                        4 => {
                            gang = match rng.below(4) {
                                0 => json!({ "colocate": "NODE" }),
                                1 => json!({ "spread": true }),
                                2 => json!({ "colocate": "LABEL", "label": "rack" }),
                                _ => json!({ "colocate": "LABEL", "label": "rack", "spread": true }),
                            };
                            json!([{ "gpuCount": 1 + rng.below(2), "model": "H100", "vcpu": 1 },
                                   { "gpuCount": 1 + rng.below(2), "model": "H100", "vcpu": 1 }])
                        }
                        // Two H100 on one NVLink pair (each node has two).
                        _ => json!([{ "gpuCount": 2, "model": "H100", "sameNvlinkDomain": true, "vcpu": 1 }]),
                    };
                    // Now, or within five minutes: most of them start while the run goes on.
                    let start = if rng.below(4) == 0 { None } else { Some(now + 1 + rng.below(300) as i64) };
                    let ends = start.unwrap_or(now) + 1800 + rng.below(5400) as i64;
                    let key = format!("op-{i}");
                    let mut input = json!({ "i": { "poolId": pool, "endsAt": at(ends), "allocations": allocations, "gang": gang, "idempotencyKey": key } });
                    if let Some(s) = start {
                        input["i"]["startsAt"] = json!(at(s));
                    }
                    let again = rng.below(10);
                    let (outcome, body) = if again == 3 || again == 4 {
                        // Four identical requests at once (a client and its retries racing): every
                        // one must get the one answer the first to finish stored.
                        let answers = futures_util::future::join_all(
                            (0..4).map(|_| final_answer(&url, &http, token, CREATE, input.clone())),
                        )
                        .await;
                        let first = answer_of(&answers[0].0, &answers[0].1);
                        let fresh = answers
                            .iter()
                            .filter(|(o, b)| o == "ok" && b["extensions"]["idempotentReplay"] != json!(true))
                            .count();
                        let same = answers.iter().all(|(o, b)| answer_of(o, b) == first) && fresh <= 1;
                        record("burst same key", if same { "one answer" } else { "DIFFERENT" }, &Value::Null);
                        if !same {
                            let all: Vec<String> = answers.iter().map(|(o, b)| format!("{o}: {b}")).collect();
                            tally.lock().expect("lock").violations.push(format!("one key, several answers: {}", all.join(" | ")));
                        }
                        answers.into_iter().next().expect("four answers")
                    } else {
                        // A transient answer (LOCK_TIMEOUT under load) stores nothing: a client
                        // retries it with the same key, and the first final answer is the one
                        // the key keeps.
                        final_answer(&url, &http, token, CREATE, input.clone()).await
                    };
                    let r = &body["data"]["createReservation"]["reservation"];
                    let label = match (outcome.as_str(), r["state"].as_str()) {
                        ("ok", Some("PENDING")) => "pending".to_owned(),
                        ("ok", _) if body["data"]["createReservation"]["placementRetries"].as_i64().unwrap_or(0) > 0 => "placed after replanning".into(),
                        ("ok", _) => "placed".into(),
                        (other, _) => other.to_owned(),
                    };
                    record(if tenant == FLIPPED { "create (flipped)" } else { "create" }, &label, &body);
                    if outcome == "ok" {
                        created.lock().expect("lock").push((tenant, r["id"].as_str().unwrap_or_default().to_owned(), start.unwrap_or(now)));
                    }
                    match again {
                        // The reply was lost: the same request again must get the same answer.
                        0 | 1 => {
                            let (again, replay) = final_answer(&url, &http, token, CREATE, input.clone()).await;
                            let same = answer_of(&again, &replay) == answer_of(&outcome, &body)
                                && (outcome != "ok" || replay["extensions"]["idempotentReplay"] == json!(true));
                            record("retry same key", if same { "same answer" } else { "DIFFERENT" }, &replay);
                            if !same {
                                tally.lock().expect("lock").violations.push(format!("replay differs: first {body}, then {replay}"));
                            }
                        }
                        // The same key with other arguments.
                        2 => {
                            let mut other = input.clone();
                            other["i"]["endsAt"] = json!(at(ends + 86_400));
                            let (again, replay) = call(&url, &http, token, CREATE, other).await;
                            record("reuse key", &again, &replay);
                            if again != "IDEMPOTENCY_KEY_REUSED" {
                                tally.lock().expect("lock").violations.push(format!("key reuse answered {again}: {replay}"));
                            }
                        }
                        _ => {}
                    }
                }
                50..=58 => {
                    let Some((owner, id, _)) = pick(&mut rng) else { return };
                    let ends = now + 3 * 3600 + rng.below(7200) as i64;
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &tokens[owner],
                        "mutation($i: ExtendReservationInput!) { extendReservation(input: $i) { reservation { id } } }",
                        json!({ "i": { "id": id, "endsAt": at(ends), "idempotencyKey": format!("ext-{i}") } }),
                    )
                    .await;
                    record("extend", &outcome, &body);
                }
                59..=66 => {
                    let Some((owner, id, _)) = pick(&mut rng) else { return };
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &tokens[owner],
                        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { id } } }",
                        json!({ "i": { "id": id } }),
                    )
                    .await;
                    record("release", &outcome, &body);
                }
                67..=74 => {
                    // Around start times: half the cancels go to a reservation that has just
                    // started (within the last two ticks), when there is one.
                    let near = (rng.below(2) == 0)
                        .then(|| {
                            let list = created.lock().expect("lock");
                            list.iter().rev().find(|(_, _, s)| *s <= now && *s > now - 2 * TICK_SECONDS).cloned()
                        })
                        .flatten();
                    let Some((owner, id, start)) = near.or_else(|| pick(&mut rng)) else { return };
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &tokens[owner],
                        "mutation($i: ReservationActionInput!) { cancelReservation(input: $i) { reservation { id } } }",
                        json!({ "i": { "id": id } }),
                    )
                    .await;
                    let started = body["errors"][0]["message"].as_str().unwrap_or("").contains("can no longer be cancelled");
                    let label = match (outcome.as_str(), start <= now) {
                        ("CONFLICT", _) if started => "CONFLICT (started)".to_owned(),
                        ("ok", true) => "ok (pending or not started)".to_owned(),
                        (o, _) => o.to_owned(),
                    };
                    record("cancel", &label, &body);
                }
                75..=77 => {
                    // Ticks take turns (the move, the flush, the pass), so the liveness passes
                    // are one tick apart and no pass takes two ticks for an outage by chance;
                    // the fourth tick alone jumps 90 s, an outage the pass notices (its grace
                    // holds every disconnected node for 340 s), and the rest of the run is long
                    // enough after it for nodes to become unreachable while placements race.
                    let mut ticks = ticking.lock().await;
                    *ticks += 1;
                    let outage = *ticks == 4;
                    let seconds = if outage { 3 * TICK_SECONDS } else { TICK_SECONDS };
                    app.db.advance_clock(seconds).await;
                    clock.fetch_add(seconds, Ordering::SeqCst);
                    record("clock tick", if outage { "90 s (an outage)" } else { "30 s" }, &Value::Null);
                    // The liveness reconciler reacts to the time that passed (nodes long
                    // disconnected become unreachable), racing the placements in flight.
                    let pass = async {
                        gateway.flush().await?;
                        compute_domain::node_sessions::liveness_pass(&app.db.db).await
                    };
                    let outcome = match pass.await {
                        Ok(p) if p.outage_seconds.is_some() => "an outage noticed".to_owned(),
                        Ok(p) if p.unreachable > 0 => "some unreachable".to_owned(),
                        Ok(_) => "ok".to_owned(),
                        Err(e) => e.code().as_str().to_owned(),
                    };
                    drop(ticks);
                    record("liveness pass", &outcome, &Value::Null);
                }
                78 | 79 => {
                    let zero = !flipped_to_zero.fetch_xor(true, Ordering::SeqCst);
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &op_token,
                        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
                        json!({ "i": { "tenantId": TENANTS[FLIPPED], "scopeId": pool, "gpus": if zero { 0 } else { GPU_LIMIT } } }),
                    )
                    .await;
                    record("quota flip", &outcome, &body);
                }
                80 | 81 => {
                    let devices: Vec<Value> = (0..8)
                        .map(|g| match g {
                            0..=3 => json!({ "uuid": format!("GPU-new{i}-{g}"), "model": "H100", "memoryMib": 81559 }),
                            4 | 5 => json!({ "uuid": format!("GPU-new{i}-{g}"), "model": "A100", "memoryMib": 81920, "mode": "MIG",
                                              "layout": { "migProfiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"] } }),
                            _ => json!({ "uuid": format!("GPU-new{i}-{g}"), "model": "L4", "memoryMib": 23034, "mode": "TIME_SLICE",
                                          "layout": { "slots": 4 } }),
                        })
                        .collect();
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &op_token,
                        "mutation($i: RegisterNodeInput!) { registerNode(input: $i) { computeNode { id } } }",
                        json!({ "i": { "poolId": pool, "hostname": format!("torture-new-{i}"),
                            "resources": { "vcpu": 32, "memoryMib": 262144, "diskGib": 2000 }, "devices": devices } }),
                    )
                    .await;
                    record("register node", &outcome, &body);
                }
                _ => {
                    let node = &nodes[rng.below(nodes.len() as u64) as usize];
                    let device = &devices[rng.below(devices.len() as u64) as usize];
                    let (op, query, vars) = match roll {
                        84 | 85 => {
                            // A daemon leaves (its node DISCONNECTED, then UNREACHABLE as time
                            // passes) or comes back (CONNECTED): liveness racing placement.
                            let id = compute_domain::ids::NodeId::parse("node", node).expect("node");
                            let epoch: Option<i64> = sqlx::query_scalar(
                                "SELECT session_epoch FROM node_sessions WHERE node_id = $1 AND closed_at IS NULL",
                            )
                            .bind(node)
                            .fetch_optional(app.db.db.pool())
                            .await
                            .expect("session");
                            let outcome = match epoch {
                                Some(e) => compute_domain::node_sessions::close(
                                    &gateway.db,
                                    &id,
                                    e,
                                    compute_domain::node_sessions::CloseReason::DaemonClosed,
                                )
                                .await
                                .map(|_| "disconnected".to_owned()),
                                None => gateway.open(node).await.map(|_| "connected".to_owned()),
                            };
                            let outcome = outcome.unwrap_or_else(|e| e.code().as_str().to_owned());
                            record("reachability flip", &outcome, &Value::Null);
                            return;
                        }
                        82 | 83 => ("cordon", "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }", json!({ "i": { "id": node } })),
                        86..=88 => ("uncordon", "mutation($i: NodeActionInput!) { uncordonNode(input: $i) { computeNode { id } } }", json!({ "i": { "id": node } })),
                        89 | 90 => ("taint", "mutation($i: TaintNodeInput!) { taintNode(input: $i) { computeNode { id } } }",
                            json!({ "i": { "id": node, "taint": { "key": "torture", "effect": "NO_SCHEDULE" } } })),
                        91 => ("untaint", "mutation($i: UntaintNodeInput!) { untaintNode(input: $i) { computeNode { id } } }",
                            json!({ "i": { "id": node, "key": "torture" } })),
                        92 | 93 => ("health flip", "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { id } } }",
                            json!({ "i": { "id": device, "health": if rng.below(2) == 0 { "UNHEALTHY" } else { "HEALTHY" } } })),
                        94 | 95 => ("quarantine", "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { id } } }",
                            json!({ "i": { "id": device, "reason": "torture" } })),
                        96 => ("unquarantine", "mutation($i: UnquarantineDeviceInput!) { unquarantineDevice(input: $i) { device { id } } }",
                            json!({ "i": { "id": device } })),
                        _ => {
                            let (_, current) = call(&url, &http, &op_token,
                                "query($id: ID!) { node(id: $id) { ... on Device { version mode } } }", json!({ "id": device })).await;
                            let version = current["data"]["node"]["version"].as_i64().unwrap_or(1);
                            let layout = match current["data"]["node"]["mode"].as_str() {
                                Some("EXCLUSIVE") => json!({ "mode": "TIME_SLICE", "layout": { "slots": 4 } }),
                                _ => json!({ "mode": "EXCLUSIVE" }),
                            };
                            let mut input = json!({ "id": device, "version": version, "changeWindowSeconds": 0 });
                            input["mode"] = layout["mode"].clone();
                            if let Some(l) = layout.get("layout") {
                                input["layout"] = l.clone();
                            }
                            ("mode change", "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { id } } }", json!({ "i": input }))
                        }
                    };
                    let (outcome, body) = call(&url, &http, &op_token, query, vars).await;
                    record(op, &outcome, &body);
                }
            }
        }
    });
    let operations = async {
        tasks.buffer_unordered(IN_FLIGHT).collect::<Vec<()>>().await;
        done.store(true, Ordering::SeqCst);
    };
    // A worker beside the clients: the reservation steps and the capacity recompute, every
    // 100 ms, and after each pass one snapshot comparing the rollup with the atoms.
    let worker = async {
        let db = &app.db.db;
        let mut passes = 0u64;
        while !done.load(Ordering::SeqCst) && passes < 2_000 {
            passes += 1;
            use compute_domain::reservations::reconcile;
            let liveness = async {
                gateway.flush().await?;
                let p = compute_domain::node_sessions::liveness_pass(db).await?;
                Ok(p.disconnected + p.unreachable + p.lost)
            };
            let steps = [
                ("liveness", liveness.await),
                ("activate", reconcile::activate_due(db).await),
                ("expire", reconcile::expire_due(db).await),
                ("retry pending", reconcile::retry_pending(db).await),
                (
                    "rollup recompute",
                    changes::recompute_rollup(
                        db,
                        &compute_domain::ids::PoolId::parse("pool", &pool).expect("a pool id"),
                    )
                    .await,
                ),
                (
                    "usage meter",
                    compute_domain::usage::meter_pass(db, 100)
                        .await
                        .map(|p| p.records + p.checked),
                ),
            ];
            let (mismatched,): (i64,) = sqlx::query_as(ROLLUP_MISMATCHES)
                .fetch_one(db.pool())
                .await
                .expect("rollup snapshot");
            {
                let mut t = tally.lock().expect("lock");
                t.checked("rollup snapshots during the run", 1);
                if mismatched > 0 {
                    t.violations.push(format!(
                        "one snapshot saw {mismatched} rollup rows differ from the atoms"
                    ));
                }
                for (step, result) in steps {
                    match result {
                        Ok(n) => {
                            t.add(&format!("worker {step}"), "ok");
                            if step == "rollup recompute" {
                                t.checked(
                                    "rollup recomputes that found drift (must be 0)",
                                    u64::from(n > 0),
                                );
                                t.checked("rollup recomputes", 1);
                                if n > 0 {
                                    t.violations.push(format!("the rollup recompute corrected {n} rows: the rollup had drifted"));
                                }
                            }
                        }
                        Err(e) => {
                            let code = e.code().as_str();
                            t.add(&format!("worker {step}"), code);
                            if code == "INTERNAL" {
                                t.violations.push(format!("worker {step}: {e}"));
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    };
    tokio::join!(operations, worker);
    // The flipped tenant's limit back where it was, so `used <= max` holds for every row at the
    // end (a limit lowered below what is held refuses new charges without touching old ones).
    app.ok(
        &op_token,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": TENANTS[FLIPPED], "scopeId": pool, "gpus": GPU_LIMIT } }),
    )
    .await;

    let (checks, broken) = check_invariants(&app).await;
    let mut tally = std::mem::take(&mut *tally.lock().expect("lock"));
    for (what, n) in checks {
        tally.checked(&what, n);
    }
    tally
        .violations
        .extend(broken.into_iter().map(|b| format!("invariant broken: {b}")));
    let (checks, broken) = check_usage(&app).await;
    for (what, n) in checks {
        tally.checked(&what, n);
    }
    // Liveness raced placement: nodes became unreachable during the run.
    let unreachable: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE type = 'node.unreachable'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("events");
    tally.checked("nodes made unreachable during the run", unreachable as u64);
    if unreachable == 0 {
        tally
            .violations
            .push("no node became unreachable: the liveness race was not exercised".into());
    }
    // The lock order holds: PostgreSQL detected no deadlock in the whole run (a deadlock that
    // `Db::tx` or placement retried away is still counted here).
    let deadlocks = deadlocks(&app).await - deadlocks_before;
    tally.checked("deadlocks detected by PostgreSQL (40P01)", deadlocks as u64);
    if deadlocks > 0 {
        tally.violations.push(format!(
            "{deadlocks} deadlocks: the documented lock order was inverted"
        ));
    }
    tally
        .violations
        .extend(broken.into_iter().map(|b| format!("usage: {b}")));
    let total: u64 = tally
        .counts
        .iter()
        .filter(|((op, _), _)| !op.starts_with("worker"))
        .map(|(_, n)| n)
        .sum();
    let mut report = format!(
        "torture: {OPERATIONS} operations ({total} answers) over {NODES} nodes × 8 GPUs and the nodes registered during the run, \
         {IN_FLIGHT} in flight, simulated time moved {} s\n",
        clock.load(Ordering::SeqCst)
    );
    for ((op, outcome), n) in &tally.counts {
        report.push_str(&format!("  {op:<24} {outcome:<30} {n}\n"));
    }
    report.push_str("checks:\n");
    for (what, n) in &tally.checks {
        report.push_str(&format!("  {what:<64} {n}\n"));
    }
    report.push_str(&format!("violations: {}\n", tally.violations.len()));
    for v in &tally.violations {
        report.push_str(&format!("  {}\n", v.chars().take(400).collect::<String>()));
    }
    eprintln!("{report}");
    // CI prints it after the run (`.ci/run`); cargo test captures a passing test's output.
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("torture-report.txt"),
        &report,
    );
    assert!(total >= 1000, "{total} operations");
    assert!(tally.violations.is_empty(), "{report}");
    let count = |op: &str, outcome: &str| {
        tally
            .counts
            .get(&(op.to_owned(), outcome.to_owned()))
            .copied()
            .unwrap_or(0)
    };
    let contended = tally
        .counts
        .iter()
        .filter(|((op, o), _)| !op.starts_with("worker") && o != "ok" && o != "placed")
        .map(|(_, n)| n)
        .sum::<u64>();
    assert!(contended > 0, "the run had no contention at all: {report}");
    // The run did what it says: it exercised each of the new checks.
    assert!(
        count("burst same key", "one answer") > 0,
        "no burst: {report}"
    );
    assert!(
        count("create (flipped)", "QUOTA_EXCEEDED") > 0,
        "the flipped quota never refused: {report}"
    );
    assert!(
        count("cancel", "CONFLICT (started)") > 0,
        "no cancel came after a start: {report}"
    );
    assert!(
        count("register node", "ok") > 0,
        "no node registered during the run: {report}"
    );
    assert!(
        tally
            .checks
            .get("rollup snapshots during the run")
            .copied()
            .unwrap_or(0)
            > 0,
        "{report}"
    );
}

/// After the run: time moves past every booking's end, the meter closes every window, and then,
/// in SQL of the check's own, every allocation's billed seconds equal its booked time exactly,
/// no window is billed twice for one allocation, and each record has its one event.
async fn check_usage(app: &TestApp) -> (Vec<(String, u64)>, Vec<String>) {
    let db = &app.db.db;
    let (last_end,): (Option<f64>,) = sqlx::query_as(
        "SELECT extract(epoch FROM max(upper(during)) - compute_now())::float8 FROM device_bookings WHERE allocation_id IS NOT NULL",
    )
    .fetch_one(db.pool())
    .await
    .expect("last booking");
    app.db
        .advance_clock(last_end.unwrap_or(0.0).max(0.0) as i64 + 180)
        .await;
    let settled = compute_domain::usage::settle(
        db,
        std::time::Duration::from_millis(20),
        std::time::Duration::from_secs(120),
    )
    .await
    .expect("the meter catches up");
    assert!(
        !settled.more,
        "the meter caught up within 120 s: {settled:?}"
    );
    let mut broken = Vec::new();
    let wrong: Vec<(String, String, String)> = sqlx::query_as(
        "WITH booked AS (SELECT allocation_id, sum(extract(epoch FROM upper(during) - lower(during))) / count(*) AS s
                           FROM device_bookings WHERE allocation_id IS NOT NULL GROUP BY 1),
              billed AS (SELECT allocation_id, sum(booked_seconds) AS s FROM usage_records GROUP BY 1)
         SELECT coalesce(k.allocation_id, b.allocation_id), coalesce(b.s, 0)::text, coalesce(k.s, 0)::text
           FROM booked k FULL JOIN billed b USING (allocation_id)
          WHERE coalesce(b.s, 0) <> coalesce(k.s, 0)",
    )
    .fetch_all(db.pool())
    .await
    .expect("billed against booked");
    for (a, billed, booked) in &wrong {
        broken.push(format!("{a} billed {billed} s, booked {booked} s"));
    }
    let (allocations, records, adjustments, windows, doubled, events): (i64, i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT (SELECT count(DISTINCT allocation_id) FROM usage_records),
                    (SELECT count(*) FROM usage_records),
                    (SELECT count(*) FROM usage_records WHERE kind = 'adjustment'),
                    (SELECT count(*) FROM usage_periods WHERE closed),
                    (SELECT count(*) - count(DISTINCT (allocation_id, window_start)) FROM usage_records WHERE kind = 'window'),
                    (SELECT count(DISTINCT data->'usage'->>'key') FROM outbox WHERE type LIKE 'usage.%')",
        )
        .fetch_one(db.pool())
        .await
        .expect("usage counts");
    if doubled != 0 {
        broken.push(format!("{doubled} windows billed twice for one allocation"));
    }
    if events != records {
        broken.push(format!("{records} records but {events} usage events"));
    }
    if allocations == 0 {
        broken.push("nothing was billed".into());
    }
    (
        vec![
            (
                format!(
                    "usage: allocations billed exactly their booked seconds (of {allocations})"
                ),
                (allocations as u64).saturating_sub(wrong.len() as u64),
            ),
            ("usage: one-minute windows closed".into(), windows as u64),
            (
                "usage: records (adjustments among them)".into(),
                records as u64,
            ),
            ("usage: adjustments".into(), adjustments as u64),
        ],
        broken,
    )
}

/// Every invariant, in SQL written for the check, not borrowed from the code under test. Returns
/// what the newer checks looked at (a line of the report each, so a reader sees they ran on
/// something) and every invariant found broken (all of them, not only the first).
pub async fn check_invariants(app: &TestApp) -> (Vec<(String, u64)>, Vec<String>) {
    let pool = app.db.db.pool();
    let mut broken = Broken::default();
    let count = |sql: &'static str| async move {
        let (n,): (i64,) = sqlx::query_as(sql)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        n
    };
    broken.check(count("SELECT count(*) FROM device_bookings a JOIN device_bookings b ON a.atom = b.atom AND a.id < b.id AND a.during && b.during").await, "two bookings of one atom overlap");
    broken.check(count(
            "SELECT count(*) FROM device_bookings p JOIN devices d ON p.atom = d.uuid \
               JOIN device_bookings c ON c.device_id = d.id AND c.atom LIKE d.uuid || '/%' AND c.during && p.during \
              WHERE p.reason = 'allocation' AND c.reason = 'allocation'"
        )
        .await, "a GPU and one of its instances or slots are booked at the same instant");
    broken.check(count(
            "SELECT count(*) FROM node_resources r \
              WHERE r.allocated > floor(r.allocatable * r.ratio) \
                 OR r.allocated <> coalesce((SELECT sum(CASE r.resource WHEN 'vcpu' THEN a.vcpu WHEN 'memory_mib' THEN a.memory_mib ELSE a.disk_gib END) \
                                              FROM allocations a JOIN reservations v ON v.id = a.reservation_id \
                                             WHERE a.node_id = r.node_id AND v.state IN ('scheduled', 'active')), 0)"
        )
        .await, "a node's allocated scalars differ from its live allocations, or exceed its limit");
    broken.check(count(
            "SELECT count(*) FROM quota_usage q \
              WHERE q.used > q.max_amount \
                 OR q.used <> coalesce((SELECT sum((c->>'amount')::numeric) FROM reservations v, jsonb_array_elements(v.charged) c \
                                         WHERE v.tenant_id = q.tenant_id AND v.state IN ('pending', 'scheduled', 'active') \
                                           AND c->>'scope_kind' = q.scope_kind AND c->>'scope_id' = q.scope_id \
                                           AND c->>'resource' = q.resource), 0)"
        )
        .await, "a tenant's quota usage differs from the charges of its live reservations, or exceeds its maximum");
    broken.check(count(
            "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id JOIN reservations v ON v.id = a.reservation_id \
              WHERE v.state IN ('released', 'cancelled', 'expired', 'failed') AND upper(b.during) > coalesce(v.ended_at, v.ends_at)"
        )
        .await, "a finished reservation still holds a booking");
    // Gangs and topology: every placed gang under its rule, all of it or none of it placed, and
    // every allocation that keeps its GPUs on one NVLink domain on one.
    broken.check(count(
            "SELECT count(*) FROM (SELECT r.id FROM reservations r JOIN allocations a ON a.reservation_id = r.id \
                LEFT JOIN nodes n ON n.id = a.node_id \
              WHERE r.gang_colocate IS NOT NULL OR r.gang_spread \
              GROUP BY r.id, r.gang_colocate, r.gang_spread \
             HAVING count(a.node_id) NOT IN (0, count(*)) \
                 OR (r.gang_colocate = 'node' AND count(DISTINCT a.node_id) > 1) \
                 OR (r.gang_colocate = 'label' AND count(a.node_id) > 0 \
                     AND (count(DISTINCT n.labels->>r.gang_label) <> 1 OR count(n.labels->>r.gang_label) <> count(a.node_id))) \
                 OR (r.gang_spread AND count(DISTINCT a.node_id) <> count(a.node_id))) g"
        )
        .await, "a gang placed in part, or against its rule");
    broken.check(
        count(
            "SELECT count(*) FROM (SELECT a.id FROM allocations a, unnest(a.atoms) AS x(atom) \
               JOIN device_atoms t ON t.name = x.atom JOIN devices d ON d.id = t.device_id \
              WHERE a.same_nvlink_domain GROUP BY a.id \
             HAVING count(DISTINCT coalesce(d.nvlink_domain, d.id)) > 1) s",
        )
        .await,
        "an allocation's GPUs on several NVLink domains though it asked for one",
    );
    broken.check(count(
            "SELECT count(*) FROM reservations r WHERE NOT EXISTS \
               (SELECT 1 FROM idempotency_keys k WHERE k.operation = 'createReservation' AND k.response->>'id' = r.id)"
        )
        .await, "a reservation without the key that made it");
    broken.check(count(
            "SELECT count(*) FROM (SELECT response->>'id' FROM idempotency_keys \
               WHERE operation = 'createReservation' AND response ? 'id' GROUP BY 1 HAVING count(*) > 1) dup"
        )
        .await, "one key, two effects");
    // Eligibility: no allocation was placed (its commit) after a cordon, taint, quarantine,
    // health change or loss of reachability that excluded its node or device committed. Needs
    // commit timestamps.
    let (tracking,): (String,) = sqlx::query_as("SELECT current_setting('track_commit_timestamp')")
        .fetch_one(pool)
        .await
        .expect("setting");
    if tracking == "on" {
        broken.check(count(
                "WITH placed AS ( \
                   SELECT a.id, a.node_id, unnest(a.atoms) AS atom, pg_xact_commit_timestamp(a.xmin) AS at FROM allocations a WHERE a.node_id IS NOT NULL), \
                 node_events AS ( \
                   SELECT o.subject, pg_xact_commit_timestamp(o.xmin) AS at, o.data->'node' AS node \
                     FROM outbox o WHERE o.type LIKE 'node.%'), \
                 device_events AS ( \
                   SELECT o.subject, pg_xact_commit_timestamp(o.xmin) AS at, o.data->'device' AS device FROM outbox o WHERE o.type LIKE 'device.%') \
                 SELECT count(*) FROM placed p \
                  WHERE (SELECT (e.node->>'cordoned')::boolean OR jsonb_array_length(e.node->'taints') > 0 \
                                OR e.node->>'reachability' IN ('unreachable', 'lost') \
                           FROM node_events e WHERE e.subject = p.node_id AND e.at < p.at ORDER BY e.at DESC LIMIT 1) \
                     OR (SELECT (e.device->>'quarantined')::boolean OR e.device->>'health' = 'unhealthy' \
                           FROM device_events e JOIN device_atoms x ON x.device_id = e.subject \
                          WHERE x.name = p.atom AND e.at < p.at ORDER BY e.at DESC LIMIT 1)"
            )
            .await, "an allocation was placed after a change that excluded its node or device committed");
    } else {
        eprintln!(
            "torture: track_commit_timestamp is off on this server; the eligibility-order check was skipped"
        );
    }
    // A cancel leaves nothing: a reservation cancelled before its start never held its devices,
    // and one that had started is active and cannot be cancelled.
    broken.check(
        count(
            "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id \
               JOIN reservations v ON v.id = a.reservation_id WHERE v.state = 'cancelled'",
        )
        .await,
        "a cancelled reservation holds a booking",
    );
    // A booking starts where its reservation says it starts (a pending reservation placed late
    // starts at its placement).
    broken.check(
        count(
            "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id \
               JOIN reservations v ON v.id = a.reservation_id WHERE lower(b.during) <> v.starts_at",
        )
        .await,
        "a booking starts elsewhere than its reservation's startsAt",
    );
    // The GPU charge is the exact sum of the allocations' shares, rounded once.
    broken.check(
        count(
            "SELECT count(*) FROM reservations v WHERE v.charge_gpu <> \
               (SELECT round(sum(a.gpu_count * CASE a.gpu_kind WHEN 'gpu' THEN 1::numeric \
                                 WHEN 'mig' THEN split_part(a.profile, 'g', 1)::numeric / 7 \
                                 ELSE 1::numeric / a.slots_per_gpu END), 6) \
                  FROM allocations a WHERE a.reservation_id = v.id)",
        )
        .await,
        "a reservation's GPU charge is not its exact share rounded once",
    );
    broken.check(
        count(ROLLUP_MISMATCHES).await,
        "the capacity rollup differs from the atoms",
    );
    let mut looked_at = Vec::new();
    for (what, sql) in [
        (
            "cancelled reservations, none holding a booking",
            "SELECT count(*) FROM reservations WHERE state = 'cancelled'",
        ),
        (
            "cancelled after their requested start (pending ones)",
            "SELECT count(*) FROM reservations WHERE state = 'cancelled' AND ended_at >= starts_at",
        ),
        (
            "bookings starting at their reservation's startsAt",
            "SELECT count(*) FROM device_bookings WHERE allocation_id IS NOT NULL",
        ),
        (
            "reservations whose GPU charge is the exact sum rounded once",
            "SELECT count(*) FROM reservations",
        ),
        (
            "of them with two or more allocations",
            "SELECT count(*) FROM reservations v WHERE (SELECT count(*) FROM allocations a WHERE a.reservation_id = v.id) > 1",
        ),
        (
            "rollup rows equal to their atoms at the end",
            "SELECT count(*) FROM pool_capacity_rollup",
        ),
        (
            "gangs placed whole under their rule (on one node, spread, in one rack)",
            "SELECT count(*) FROM reservations r WHERE (r.gang_colocate IS NOT NULL OR r.gang_spread) \
               AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id AND a.node_id IS NULL)",
        ),
        (
            "of them, in one rack (colocate: LABEL)",
            "SELECT count(*) FROM reservations r WHERE r.gang_colocate = 'label' \
               AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id AND a.node_id IS NULL)",
        ),
        (
            "gangs left pending whole",
            "SELECT count(*) FROM reservations r WHERE (r.gang_colocate IS NOT NULL OR r.gang_spread) \
               AND NOT EXISTS (SELECT 1 FROM allocations a WHERE a.reservation_id = r.id AND a.node_id IS NOT NULL)",
        ),
        (
            "allocations placed on one NVLink domain as asked",
            "SELECT count(*) FROM allocations WHERE same_nvlink_domain AND node_id IS NOT NULL",
        ),
    ] {
        looked_at.push((what.to_owned(), count(sql).await as u64));
    }
    (looked_at, broken.0)
}

/// The invariants a check found broken, each with how many rows broke it.
#[derive(Default)]
struct Broken(Vec<String>);

impl Broken {
    fn check(&mut self, rows: i64, what: &str) {
        if rows != 0 {
            self.0.push(format!("{what} ({rows} rows)"));
        }
    }
}
