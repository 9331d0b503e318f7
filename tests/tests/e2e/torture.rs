//! The capacity torture test: over a thousand concurrent operations through the GraphQL HTTP
//! endpoint against a fleet of 50 nodes with 8 GPUs each (exclusive, MIG and time-sliced), then
//! every invariant checked with SQL of its own, independent of the code under test.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use compute_domain::fleet::commands::{self, NewDevice, NewNode, NewPool, NewSite};
use compute_domain::fleet::model::{DeviceMode, Labels, Layout, PoolKind};
use compute_domain::idempotency::Actor;
use compute_tests::{TestApp, spawn_app_on, test_db_with};
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::reservations::CREATE;

const NODES: usize = 50;
const OPERATIONS: usize = 1200;
const IN_FLIGHT: usize = 24;
const TENANTS: [&str; 6] = ["t0", "t1", "t2", "t3", "t4", "t5"];

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
    let actor = Actor {
        subject: "torture".into(),
        tenant: None,
    };
    let site = commands::create_site(
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
    let pool = commands::create_pool(
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
                    uuid: format!("GPU-t{n}-{g}"),
                    vendor: "nvidia".into(),
                    model: model.into(),
                    memory_mib: memory,
                    layout,
                }
            })
            .collect();
        let registered = commands::register_node(
            db,
            NewNode {
                pool_id: pool.id.clone(),
                hostname: format!("torture-{n}"),
                labels: Labels::new(),
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
            t,
            &pool.id,
            compute_domain::quota::QuotaLimits {
                gpus: Some(60.0),
                vcpu: Some(400),
                memory_mib: None,
            },
        )
        .await
        .expect("quota");
    }
    (pool.id, nodes, devices)
}

#[derive(Default)]
struct Tally {
    /// (operation, outcome) → count.
    counts: BTreeMap<(String, String), u64>,
    /// Responses that break the rules: 5xx, INTERNAL, deadlocks, replays that differ.
    violations: Vec<String>,
}

impl Tally {
    fn add(&mut self, op: &str, outcome: &str) {
        *self
            .counts
            .entry((op.to_owned(), outcome.to_owned()))
            .or_default() += 1;
    }
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_operations_keep_every_invariant() {
    let db = test_db_with(20).await;
    db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let app = spawn_app_on(db).await;
    let (pool, nodes, devices) = build_fleet(&app).await;
    let url = app.url("/graphql");
    let op_token = app.operator();
    let tokens: Vec<String> = TENANTS.iter().map(|t| app.member(t)).collect();
    let created: Arc<Mutex<Vec<(usize, String)>>> = Arc::new(Mutex::new(Vec::new()));
    let tally = Arc::new(Mutex::new(Tally::default()));

    let tasks = futures_util::stream::iter(0..OPERATIONS).map(|i| {
        let (url, http, op_token, tokens, pool, nodes, devices, created, tally) = (
            url.clone(),
            app.http.clone(),
            op_token.clone(),
            tokens.clone(),
            pool.clone(),
            nodes.clone(),
            devices.clone(),
            created.clone(),
            tally.clone(),
        );
        async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D));
            let roll = rng.below(100);
            let tenant = rng.below(TENANTS.len() as u64) as usize;
            let token = &tokens[tenant];
            let pick = |rng: &mut Rng| -> Option<(usize, String)> {
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
                0..=54 => {
                    let allocation = match rng.below(3) {
                        0 => json!({ "gpuCount": 1 + rng.below(4), "model": "H100", "vcpu": 1 + rng.below(8), "memoryMib": 4096 }),
                        1 => json!({ "gpuKind": "MIG", "profile": if rng.below(2) == 0 { "1g.10gb" } else { "3g.40gb" },
                                     "gpuCount": 1 + rng.below(2), "vcpu": 2 }),
                        _ => json!({ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1 + rng.below(3), "vcpu": 1 }),
                    };
                    let start = rng.below(4);
                    let (starts, ends) = (
                        format!("2031-01-01T{:02}:00:00Z", start),
                        format!("2031-01-01T{:02}:30:00Z", start + 1 + rng.below(3)),
                    );
                    let key = format!("op-{i}");
                    let mut input = json!({ "i": { "poolId": pool, "endsAt": ends, "allocations": [allocation], "idempotencyKey": key } });
                    if start > 0 {
                        input["i"]["startsAt"] = json!(starts);
                    }
                    let (outcome, body) = call(&url, &http, token, CREATE, input.clone()).await;
                    let r = &body["data"]["createReservation"]["reservation"];
                    let label = match (outcome.as_str(), r["state"].as_str()) {
                        ("ok", Some("PENDING")) => "pending".to_owned(),
                        ("ok", _) if body["data"]["createReservation"]["placementRetries"].as_i64().unwrap_or(0) > 0 => "placed after replanning".into(),
                        ("ok", _) => "placed".into(),
                        (other, _) => other.to_owned(),
                    };
                    record("create", &label, &body);
                    if outcome == "ok" {
                        created.lock().expect("lock").push((tenant, r["id"].as_str().unwrap_or_default().to_owned()));
                    }
                    match rng.below(10) {
                        // The reply was lost: the same request again must get the same answer.
                        0 | 1 => {
                            let (again, replay) = call(&url, &http, token, CREATE, input.clone()).await;
                            let same = again == outcome
                                && (outcome != "ok"
                                    || (replay["extensions"]["idempotentReplay"] == json!(true)
                                        && replay["data"]["createReservation"]["reservation"]["id"] == r["id"]
                                        && replay["data"]["createReservation"]["reservation"]["allocations"] == r["allocations"]));
                            record("retry same key", if same { "same answer" } else { "DIFFERENT" }, &replay);
                            if !same {
                                tally.lock().expect("lock").violations.push(format!("replay differs: first {body}, then {replay}"));
                            }
                        }
                        // The same key with other arguments.
                        2 => {
                            let mut other = input.clone();
                            other["i"]["endsAt"] = json!("2031-01-02T00:00:00Z");
                            let (again, replay) = call(&url, &http, token, CREATE, other).await;
                            record("reuse key", &again, &replay);
                            if again != "IDEMPOTENCY_KEY_REUSED" {
                                tally.lock().expect("lock").violations.push(format!("key reuse answered {again}: {replay}"));
                            }
                        }
                        _ => {}
                    }
                }
                55..=66 => {
                    let Some((owner, id)) = pick(&mut rng) else { return };
                    let ends = format!("2031-01-01T{:02}:45:00Z", 5 + rng.below(3));
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &tokens[owner],
                        "mutation($i: ExtendReservationInput!) { extendReservation(input: $i) { reservation { id } } }",
                        json!({ "i": { "id": id, "endsAt": ends, "idempotencyKey": format!("ext-{i}") } }),
                    )
                    .await;
                    record("extend", &outcome, &body);
                }
                67..=76 => {
                    let Some((owner, id)) = pick(&mut rng) else { return };
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
                77..=81 => {
                    let Some((owner, id)) = pick(&mut rng) else { return };
                    let (outcome, body) = call(
                        &url,
                        &http,
                        &tokens[owner],
                        "mutation($i: ReservationActionInput!) { cancelReservation(input: $i) { reservation { id } } }",
                        json!({ "i": { "id": id } }),
                    )
                    .await;
                    record("cancel", &outcome, &body);
                }
                _ => {
                    let node = &nodes[rng.below(nodes.len() as u64) as usize];
                    let device = &devices[rng.below(devices.len() as u64) as usize];
                    let (op, query, vars) = match roll {
                        82..=85 => ("cordon", "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }", json!({ "i": { "id": node } })),
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
    tasks.buffer_unordered(IN_FLIGHT).collect::<Vec<()>>().await;

    let tally = std::mem::take(&mut *tally.lock().expect("lock"));
    let total: u64 = tally.counts.values().sum();
    let mut report =
        format!("torture: {total} operations over {NODES} nodes × 8 GPUs, {IN_FLIGHT} in flight\n");
    for ((op, outcome), n) in &tally.counts {
        report.push_str(&format!("  {op:<16} {outcome:<26} {n}\n"));
    }
    eprintln!("{report}");
    // CI prints it after the run (`.ci/run`); cargo test captures a passing test's output.
    let _ = std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("torture-report.txt"),
        &report,
    );
    assert!(total >= 1000, "{total} operations");
    assert!(
        tally.violations.is_empty(),
        "{}",
        tally.violations.join("\n")
    );
    let contended = tally
        .counts
        .iter()
        .filter(|((_, o), _)| o != "ok" && o != "placed")
        .map(|(_, n)| n)
        .sum::<u64>();
    assert!(contended > 0, "the run had no contention at all: {report}");

    check_invariants(&app).await;
}

/// Every invariant, in SQL written for the check, not borrowed from the code under test.
pub async fn check_invariants(app: &TestApp) {
    let pool = app.db.db.pool();
    let count = |sql: &'static str| async move {
        let (n,): (i64,) = sqlx::query_as(sql)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        n
    };
    assert_eq!(
        count("SELECT count(*) FROM device_bookings a JOIN device_bookings b ON a.atom = b.atom AND a.id < b.id AND a.during && b.during").await,
        0,
        "two bookings of one atom overlap"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM device_bookings p JOIN devices d ON p.atom = d.uuid \
               JOIN device_bookings c ON c.device_id = d.id AND c.atom LIKE d.uuid || '/%' AND c.during && p.during \
              WHERE p.reason = 'allocation' AND c.reason = 'allocation'"
        )
        .await,
        0,
        "a GPU and one of its instances or slots are booked at the same instant"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM node_resources r \
              WHERE r.allocated > floor(r.allocatable * r.ratio) \
                 OR r.allocated <> coalesce((SELECT sum(CASE r.resource WHEN 'vcpu' THEN a.vcpu WHEN 'memory_mib' THEN a.memory_mib ELSE a.disk_gib END) \
                                              FROM allocations a JOIN reservations v ON v.id = a.reservation_id \
                                             WHERE a.node_id = r.node_id AND v.state IN ('scheduled', 'active')), 0)"
        )
        .await,
        0,
        "a node's allocated scalars differ from its live allocations, or exceed its limit"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM quota_usage q \
              WHERE q.used > q.max_amount \
                 OR q.used <> coalesce((SELECT sum((c->>'amount')::numeric) FROM reservations v, jsonb_array_elements(v.charged) c \
                                         WHERE v.tenant_id = q.tenant_id AND v.state IN ('pending', 'scheduled', 'active') \
                                           AND c->>'scope_kind' = q.scope_kind AND c->>'scope_id' = q.scope_id \
                                           AND c->>'resource' = q.resource), 0)"
        )
        .await,
        0,
        "a tenant's quota usage differs from the charges of its live reservations, or exceeds its maximum"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id JOIN reservations v ON v.id = a.reservation_id \
              WHERE v.state IN ('released', 'cancelled', 'expired', 'failed') AND upper(b.during) > coalesce(v.ended_at, v.ends_at)"
        )
        .await,
        0,
        "a finished reservation still holds a booking"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM reservations r WHERE NOT EXISTS \
               (SELECT 1 FROM idempotency_keys k WHERE k.operation = 'createReservation' AND k.response->>'reservationId' = r.id)"
        )
        .await,
        0,
        "a reservation without the key that made it"
    );
    assert_eq!(
        count(
            "SELECT count(*) FROM (SELECT response->>'reservationId' FROM idempotency_keys \
               WHERE operation = 'createReservation' AND response ? 'reservationId' GROUP BY 1 HAVING count(*) > 1) dup"
        )
        .await,
        0,
        "one key, two effects"
    );
    // Eligibility: no allocation was placed (its commit) after a cordon, taint, quarantine or
    // health change that excluded its node or device committed. Needs commit timestamps.
    let (tracking,): (String,) = sqlx::query_as("SELECT current_setting('track_commit_timestamp')")
        .fetch_one(pool)
        .await
        .expect("setting");
    if tracking == "on" {
        assert_eq!(
            count(
                "WITH placed AS ( \
                   SELECT a.id, a.node_id, unnest(a.atoms) AS atom, pg_xact_commit_timestamp(a.xmin) AS at FROM allocations a WHERE a.node_id IS NOT NULL), \
                 node_events AS ( \
                   SELECT o.subject, pg_xact_commit_timestamp(o.xmin) AS at, coalesce(o.data->'node', o.data) AS node \
                     FROM outbox o WHERE o.type LIKE 'node.%'), \
                 device_events AS ( \
                   SELECT o.subject, pg_xact_commit_timestamp(o.xmin) AS at, o.data AS device FROM outbox o WHERE o.type LIKE 'device.%') \
                 SELECT count(*) FROM placed p \
                  WHERE (SELECT (e.node->>'cordoned')::boolean OR jsonb_array_length(e.node->'taints') > 0 \
                           FROM node_events e WHERE e.subject = p.node_id AND e.at < p.at ORDER BY e.at DESC LIMIT 1) \
                     OR (SELECT (e.device->>'quarantined')::boolean OR e.device->>'health' = 'unhealthy' \
                           FROM device_events e JOIN device_atoms x ON x.device_id = e.subject \
                          WHERE x.name = p.atom AND e.at < p.at ORDER BY e.at DESC LIMIT 1)"
            )
            .await,
            0,
            "an allocation was placed after a change that excluded its node or device committed"
        );
    } else {
        eprintln!(
            "torture: track_commit_timestamp is off on this server; the eligibility-order check was skipped"
        );
    }
}
