//! A machine joins the fleet by itself, and what it reports is checked (`docs/nodes.md`,
//! "Enrollment" and "Inventory and health"): the real `compute-agent` (`CARGO_BIN_EXE_test-agent`)
//! joins with one-time tokens made through GraphQL, describes its machine with `--inventory`
//! files, and the gateway compares each report with the registration. The database's clock is
//! simulated.

use std::path::{Path, PathBuf};
use std::time::Duration;

use compute_tests::TestApp;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::reservations::pool;

const WAIT: Duration = Duration::from_secs(30);
const CREATE_TOKEN: &str = "mutation($i: CreateNodeJoinTokenInput!) { createNodeJoinToken(input: $i) { secret idempotentReplay nodeJoinToken { id state poolId expiresAt } } }";
const REVOKE_TOKEN: &str = "mutation($i: RevokeNodeJoinTokenInput!) { revokeNodeJoinToken(input: $i) { nodeJoinToken { id state revokedAt } } }";
const TOKENS: &str = "query($p: ID) { nodeJoinTokens(poolId: $p) { totalCount edges { node { id state computeNodeId usedAt labels { key value } } } } }";
const NODE: &str = "query($id: ID!) { computeNode: node(id: $id) { ... on ComputeNode { hostname labels { key value }
    version inventory inventoryReportedAt conditions { type status message }
    devices { id uuid model memoryMib mode migProfiles health healthReason healthSince quarantined inventoryMismatch \
              pciBusId numaNode nvlinkDomain } } } }";
const RESERVE: &str = "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id state version allocations { atoms } } } }";
const RETIRE: &str =
    "mutation($i: NodeActionInput!) { retireNode(input: $i) { computeNode { lifecycle } } }";
const ACCEPT: &str = "mutation($i: AcceptNodeInventoryInput!) { acceptNodeInventory(input: $i) { computeNode { id } } }";

fn test_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir()
        .join("compute-enrollment-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("test dir");
    d
}

/// `compute-agent` with `args`, its state in `state`, logging to `<state>.log`.
fn agent(app: &TestApp, state: &Path, args: &[&str]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.with_extension("log"))
        .expect("agent log");
    Command::new(env!("CARGO_BIN_EXE_test-agent"))
        .args(args)
        .args(["--url", &app.agent_url(), "--listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(state)
        .env_remove("COMPUTE_AGENT_TOKEN")
        .env_remove("COMPUTE_AGENT_NODE_ID")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("compute-agent starts")
}

/// Waits for `child` to exit; its code and its log.
async fn exits(mut child: Child, state: &Path) -> (i32, String) {
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the agent exits")
        .expect("status");
    let log = std::fs::read_to_string(state.with_extension("log")).unwrap_or_default();
    (status.code().unwrap_or(-1), log)
}

/// A machine's inventory file: `gpus` are TOML tables' bodies.
fn inventory(path: &Path, hostname: &str, gpus: &[&str]) {
    let mut text =
        format!("hostname = \"{hostname}\"\nvcpu = 32\nmemory_mib = 262144\ndisk_gib = 1000\n");
    for g in gpus {
        text.push_str("[[gpu]]\n");
        text.push_str(g);
        text.push('\n');
    }
    std::fs::write(path, text).expect("inventory file");
}

const H100_A0: &str = "uuid = \"GPU-A0\"\nmodel = \"H100\"\nmemory_mib = 81559";
const H100_A1: &str = "uuid = \"GPU-A1\"\nmodel = \"H100\"\nmemory_mib = 81559";

async fn setup() -> (TestApp, crate::reservations::Pool) {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    app.gateway.refresh_lease().await.expect("gateway lease");
    let p = pool(&app).await;
    (app, p)
}

/// A join token for `pool` living `seconds`: (its id, its secret).
async fn token(app: &TestApp, pool: &str, seconds: i64) -> (String, String) {
    let t = app
        .ok(
            &app.operator(),
            CREATE_TOKEN,
            json!({ "i": { "poolId": pool, "expiresInSeconds": seconds,
                           "labels": [{ "key": "rack", "value": "r9" }] } }),
        )
        .await["createNodeJoinToken"]
        .clone();
    assert_eq!(t["nodeJoinToken"]["state"], "ACTIVE", "{t}");
    (
        t["nodeJoinToken"]["id"].as_str().expect("id").to_owned(),
        t["secret"]
            .as_str()
            .expect("the secret, shown once")
            .to_owned(),
    )
}

async fn node_named(app: &TestApp, hostname: &str) -> Option<String> {
    sqlx::query_scalar("SELECT id FROM nodes WHERE hostname = $1")
        .bind(hostname)
        .fetch_optional(app.db.db.pool())
        .await
        .expect("nodes")
}

async fn connected(app: &TestApp, node: &str) {
    compute_tests::eventually("the node's session opens", WAIT, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT session_epoch FROM node_sessions WHERE node_id = $1 AND closed_at IS NULL",
        )
        .bind(node)
        .fetch_optional(app.db.db.pool())
        .await
        .expect("session")
    })
    .await;
}

async fn node(app: &TestApp, id: &str) -> Value {
    app.ok(&app.operator(), NODE, json!({ "id": id })).await["computeNode"].clone()
}

fn device<'a>(node: &'a Value, uuid: &str) -> &'a Value {
    node["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| d["uuid"] == uuid)
        .unwrap_or_else(|| panic!("no device {uuid} in {node}"))
}

/// Waits until node `id` answers `done`; the node then.
async fn until_node(app: &TestApp, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    compute_tests::eventually(what, WAIT, || async {
        let n = node(app, id).await;
        done(&n).then_some(n)
    })
    .await
}

fn mismatch(n: &Value) -> Option<String> {
    n["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "InventoryMismatch")
        .and_then(|c| c["message"].as_str().map(str::to_owned))
}

/// `compute-agent` for registered node `node` (its JWT), describing the machine with `inv`.
fn registered_agent(app: &TestApp, node: &str, state: &Path, inv: &str) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(state.with_extension("log"))
        .expect("agent log");
    Command::new(env!("CARGO_BIN_EXE_test-agent"))
        .args(["--url", &app.agent_url(), "--listen", "127.0.0.1:0"])
        .args(["--node-id", node, "--inventory", inv])
        .arg("--state-dir")
        .arg(state)
        .env("COMPUTE_AGENT_TOKEN", app.node_token(node))
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("compute-agent starts")
}

fn sighup(child: &Child) {
    let pid = child.id().expect("pid");
    let _ = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status();
}

#[tokio::test]
async fn a_machine_joins_with_a_fresh_token_and_no_other_token_makes_a_node() {
    let (app, p) = setup().await;
    let dir = test_dir("join");
    let file = dir.join("inventory.toml");
    inventory(
        &file,
        "joined-1",
        &[
            "uuid = \"GPU-J0\"\nmodel = \"H100\"\nmemory_mib = 81559\npci_bus_id = \"00000000:17:00.0\"\nnuma_node = 0\nnvlink_domain = \"nvl-j\"",
            "uuid = \"GPU-J1\"\nmodel = \"A100\"\nmemory_mib = 81920\nmig = [{ uuid = \"MIG-J1a\", profile = \"3g.40gb\" }, { uuid = \"MIG-J1b\", profile = \"4g.40gb\" }]",
        ],
    );
    let (token_id, secret) = token(&app, &p.pool, 600).await;
    let state = dir.join("state");
    let inv = file.to_str().expect("path");
    let joined = agent(
        &app,
        &state,
        &[
            "join",
            "--token",
            &secret,
            "--pool",
            &p.pool,
            "--inventory",
            inv,
        ],
    );
    let id =
        compute_tests::eventually("the machine joins", WAIT, || node_named(&app, "joined-1")).await;
    connected(&app, &id).await;
    // Registered with exactly the file's devices, in the token's pool, with its labels.
    let n = until_node(&app, &id, "the inventory is checked", |n| {
        !n["inventoryReportedAt"].is_null()
    })
    .await;
    assert_eq!(mismatch(&n), None, "{n}");
    assert_eq!(n["labels"], json!([{ "key": "rack", "value": "r9" }]));
    let uuids: Vec<&str> = n["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter_map(|d| d["uuid"].as_str())
        .collect();
    assert_eq!(uuids.len(), 2, "{n}");
    assert_eq!(device(&n, "GPU-J0")["mode"], "EXCLUSIVE");
    assert_eq!(
        (
            &device(&n, "GPU-J0")["numaNode"],
            &device(&n, "GPU-J0")["nvlinkDomain"]
        ),
        (&json!(0), &json!("nvl-j")),
        "registered with the topology the machine reported"
    );
    assert_eq!(device(&n, "GPU-J1")["nvlinkDomain"], Value::Null);
    assert_eq!(device(&n, "GPU-J1")["mode"], "MIG");
    assert_eq!(
        device(&n, "GPU-J1")["migProfiles"],
        json!(["3g.40gb", "4g.40gb"])
    );
    let pool_of: String = sqlx::query_scalar("SELECT pool_id FROM nodes WHERE id = $1")
        .bind(&id)
        .fetch_one(app.db.db.pool())
        .await
        .expect("pool");
    assert_eq!(pool_of, p.pool);
    // The credential is the state directory's, 0600, and only its digest is in the database.
    use std::os::unix::fs::PermissionsExt;
    let credential = state.join("credential");
    let mode = std::fs::metadata(&credential)
        .expect("credential")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let secret_on_disk = std::fs::read_to_string(&credential).expect("read");
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM node_credentials WHERE node_id = $1 AND secret_sha256 = sha256(convert_to($2, 'UTF8'))",
    )
    .bind(&id)
    .bind(&secret_on_disk)
    .fetch_one(app.db.db.pool())
    .await
    .expect("digest");
    assert_eq!(stored, 1);
    let tokens = app
        .ok(&app.operator(), TOKENS, json!({ "p": p.pool }))
        .await["nodeJoinTokens"]
        .clone();
    assert_eq!(tokens["totalCount"], 1);
    let t = &tokens["edges"][0]["node"];
    assert_eq!(t["id"], token_id.as_str());
    assert_eq!(t["state"], "USED");
    assert_eq!(t["computeNodeId"], id.as_str());
    let used: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'join_token.used' AND subject = $1",
    )
    .bind(&token_id)
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(used, 1);

    // Refused: the same token again, an expired one, a revoked one, another pool's, a
    // malformed one. Each exits 3 with its code, and leaves no node and no credential.
    let nodes_before = app.count("nodes").await;
    let other_pool = crate::fleet::add_pool(
        &app,
        &p.site,
        json!({ "name": "other", "kind": "BARE_METAL" }),
    )
    .await;
    let (expired_id, expired) = token(&app, &p.pool, 60).await;
    let (revoked_id, revoked) = token(&app, &p.pool, 600).await;
    let (_, others) = token(&app, &other_pool, 600).await;
    app.ok(
        &app.operator(),
        REVOKE_TOKEN,
        json!({ "i": { "id": revoked_id } }),
    )
    .await;
    app.db.advance_clock(120).await;
    // Revoking a token that expired returns it as it is: no revocation, no event.
    let as_it_is = app
        .ok(
            &app.operator(),
            REVOKE_TOKEN,
            json!({ "i": { "id": expired_id } }),
        )
        .await["revokeNodeJoinToken"]["nodeJoinToken"]
        .clone();
    assert_eq!(
        (&as_it_is["state"], &as_it_is["revokedAt"]),
        (&json!("EXPIRED"), &Value::Null),
        "{as_it_is}"
    );
    let revocations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'join_token.revoked' AND subject = $1",
    )
    .bind(&expired_id)
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(revocations, 0);
    inventory(
        &file,
        "joined-2",
        &["uuid = \"GPU-J9\"\nmodel = \"H100\"\nmemory_mib = 81559"],
    );
    for (name, secret, code) in [
        ("again", secret.as_str(), "JOIN_TOKEN_USED"),
        ("expired", expired.as_str(), "JOIN_TOKEN_EXPIRED"),
        ("revoked", revoked.as_str(), "JOIN_TOKEN_REVOKED"),
        ("other-pool", others.as_str(), "JOIN_TOKEN_OTHER_POOL"),
        ("malformed", "cjt_not-a-token", "JOIN_TOKEN_INVALID"),
    ] {
        let state = dir.join(name);
        let child = agent(
            &app,
            &state,
            &[
                "join",
                "--token",
                secret,
                "--pool",
                &p.pool,
                "--inventory",
                inv,
            ],
        );
        let (status, log) = exits(child, &state).await;
        assert_eq!(status, 3, "{name}: {log}");
        assert!(log.contains(code), "{name}: no {code} in {log}");
        assert!(!state.join("credential").exists(), "{name}");
        assert_eq!(app.count("nodes").await, nodes_before, "{name}");
        assert_eq!(node_named(&app, "joined-2").await, None, "{name}");
    }

    // Retiring the node revokes its credential: the agent's next session is refused for good.
    drop(joined);
    app.ok(&app.operator(), RETIRE, json!({ "i": { "id": id } }))
        .await;
    let revoked_at: Option<String> =
        sqlx::query_scalar("SELECT revoked_at::text FROM node_credentials WHERE node_id = $1")
            .bind(&id)
            .fetch_one(app.db.db.pool())
            .await
            .expect("credential");
    assert!(revoked_at.is_some());
    let again = agent(&app, &state, &["--inventory", inv]);
    let (status, log) = exits(again, &state).await;
    assert_eq!(status, 3, "{log}");
    assert!(log.contains("unknown or revoked"), "{log}");
}

#[tokio::test]
async fn two_machines_racing_for_one_token_make_one_node() {
    let (app, p) = setup().await;
    let dir = test_dir("race");
    let (_, secret) = token(&app, &p.pool, 600).await;
    let mut children = Vec::new();
    for k in 0..2 {
        let file = dir.join(format!("inventory-{k}.toml"));
        inventory(
            &file,
            &format!("racer-{k}"),
            &[&format!(
                "uuid = \"GPU-R{k}\"\nmodel = \"H100\"\nmemory_mib = 81559"
            )],
        );
        let state = dir.join(format!("state-{k}"));
        let child = agent(
            &app,
            &state,
            &[
                "join",
                "--token",
                &secret,
                "--inventory",
                file.to_str().expect("path"),
            ],
        );
        children.push((child, state));
    }
    // The loser exits 3 with JOIN_TOKEN_USED; the winner joins and keeps running.
    let joined: i64 = compute_tests::eventually("one machine joins", WAIT, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM nodes WHERE hostname LIKE 'racer-%'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("nodes");
        (n > 0).then_some(n)
    })
    .await;
    assert_eq!(joined, 1);
    let mut refused = 0;
    for (mut child, state) in children {
        match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
            Ok(status) => {
                let log = std::fs::read_to_string(state.with_extension("log")).unwrap_or_default();
                assert_eq!(status.expect("status").code(), Some(3), "{log}");
                assert!(log.contains("JOIN_TOKEN_USED"), "{log}");
                assert!(!state.join("credential").exists());
                refused += 1;
            }
            Err(_) => assert!(
                state.join("credential").exists(),
                "the winner keeps its credential"
            ),
        }
    }
    assert_eq!(refused, 1);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM nodes WHERE hostname LIKE 'racer-%'")
        .fetch_one(app.db.db.pool())
        .await
        .expect("nodes");
    assert_eq!(n, 1, "still one node");
}

#[tokio::test]
async fn many_joins_racing_in_the_database_register_one_node() {
    let (app, p) = setup().await;
    let (_, secret) = token(&app, &p.pool, 600).await;
    let db = app.db.db.clone();
    let tasks: Vec<_> = (0..8)
        .map(|k| {
            let (db, secret) = (db.clone(), secret.clone());
            tokio::spawn(async move {
                let inv = compute_protocol::Inventory {
                    hostname: format!("db-racer-{k}"),
                    vcpu: 8,
                    memory_mib: 1024,
                    disk_gib: 10,
                    gpus: vec![compute_protocol::GpuInventory {
                        uuid: format!("GPU-DR{k}"),
                        vendor: "nvidia".into(),
                        model: "H100".into(),
                        memory_mib: 81_559,
                        pci_bus_id: None,
                        numa_node: None,
                        nvlink_domain: None,
                        mig_enabled: false,
                        mig: vec![],
                    }],
                };
                compute_domain::fleet::enrollment::join(&db, &secret, None, &inv)
                    .await
                    .expect("no error")
                    .map(|j| j.registered.node.id.to_string())
                    .map_err(|r| r.code)
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => ok += 1,
            Err(code) => assert_eq!(code, "JOIN_TOKEN_USED"),
        }
    }
    assert_eq!(ok, 1);
    let nodes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM nodes WHERE hostname LIKE 'db-racer-%'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("nodes");
    assert_eq!(nodes, 1);
    let devices: i64 = sqlx::query_scalar("SELECT count(*) FROM devices WHERE uuid LIKE 'GPU-DR%'")
        .fetch_one(app.db.db.pool())
        .await
        .expect("devices");
    assert_eq!(devices, 1, "a loser's GPUs are not half-written");
}

/// `createReservation` of `gpus` GPUs on node h100-a.
async fn reserve(app: &TestApp, pool: &str, key: &str, gpus: i64) -> (String, Value) {
    let (status, body) = app
        .graphql(
            RESERVE,
            crate::reservations::input(
                pool,
                key,
                json!([{ "gpuCount": gpus, "nodeSelector": [{ "key": "host", "value": "h100-a" }] }]),
            ),
            Some(&app.member("acme")),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let code = compute_tests::first_code(&body).unwrap_or("").to_owned();
    (
        code,
        body["data"]["createReservation"]["reservation"].clone(),
    )
}

/// Cancels reservation `r` (one that waits).
async fn cancel(app: &TestApp, r: &Value) {
    app.ok(
        &app.member("acme"),
        "mutation($i: ReservationActionInput!) { cancelReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": r["id"] } }),
    )
    .await;
}

#[tokio::test]
async fn a_gpu_lost_between_two_starts_leaves_placement_and_its_booking_stays() {
    let (app, p) = setup().await;
    let dir = test_dir("lost-gpu");
    let file = dir.join("inventory.toml");
    let inv = file.to_str().expect("path").to_owned();
    let h100a = &p.nodes[0];
    // Both GPUs there: nothing differs. The report says where they sit, which the registration
    // did not: the topology is recorded, not compared. A reservation takes one of them.
    let placed = |gpu: &str, bus: &str| {
        format!(
            "{gpu}\npci_bus_id = \"00000000:{bus}:00.0\"\nnuma_node = 1\nnvlink_domain = \"nvl-x\""
        )
    };
    inventory(
        &file,
        "h100-a",
        &[&placed(H100_A0, "2a"), &placed(H100_A1, "3b")],
    );
    let state = dir.join("state");
    let first = registered_agent(&app, h100a, &state, &inv);
    let n = until_node(&app, h100a, "the first report", |n| {
        !n["inventoryReportedAt"].is_null()
    })
    .await;
    assert_eq!(mismatch(&n), None, "{n}");
    let a0 = device(&n, "GPU-A0");
    assert_eq!(
        (&a0["pciBusId"], &a0["numaNode"], &a0["nvlinkDomain"]),
        (&json!("00000000:2A:00.0"), &json!(1), &json!("nvl-x")),
        "{a0}"
    );
    assert_eq!(device(&n, "GPU-A1")["pciBusId"], "00000000:3B:00.0");
    let (code, r) = reserve(&app, &p.pool, "k-lost-1", 1).await;
    assert_eq!(code, "", "{r}");
    let booked = r["allocations"][0]["atoms"][0]
        .as_str()
        .expect("atom")
        .to_owned();
    let other = if booked == "GPU-A0" { H100_A1 } else { H100_A0 };
    let other_uuid = if booked == "GPU-A0" {
        "GPU-A1"
    } else {
        "GPU-A0"
    };

    // The booked GPU is gone from the machine at the next start.
    drop(first);
    inventory(&file, "h100-a", &[other]);
    let second = registered_agent(&app, h100a, &state, &inv);
    let n = until_node(&app, h100a, "InventoryMismatch", |n| mismatch(n).is_some()).await;
    let message = mismatch(&n).expect("condition");
    assert!(
        message.contains(&format!("GPU {booked} (H100) is missing from the machine")),
        "{message}"
    );
    let lost = device(&n, &booked);
    assert_eq!(lost["quarantined"], true, "out of placement: {lost}");
    assert!(
        lost["inventoryMismatch"]
            .as_str()
            .is_some_and(|m| m.contains("missing")),
        "{lost}"
    );
    assert_eq!(device(&n, other_uuid)["quarantined"], false);
    // The reservation keeps its booking.
    let (state_now, bookings): (String, i64) = sqlx::query_as(
        "SELECT r.state, (SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id \
                           WHERE a.reservation_id = r.id AND b.atom = $2 AND upper(b.during) > compute_now()) \
           FROM reservations r WHERE r.id = $1",
    )
    .bind(r["id"].as_str().expect("id"))
    .bind(&booked)
    .fetch_one(app.db.db.pool())
    .await
    .expect("reservation");
    assert_eq!((state_now.as_str(), bookings), ("active", 1));
    // Placement no longer sees it: two GPUs on h100-a do not fit once the other is free.
    app.ok(
        &app.member("acme"),
        "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { state } } }",
        json!({ "i": { "id": r["id"] } }),
    )
    .await;
    let (code, r2) = reserve(&app, &p.pool, "k-lost-2", 2).await;
    assert_eq!(
        (code.as_str(), &r2["state"]),
        ("", &json!("PENDING")),
        "waits: {r2}"
    );
    cancel(&app, &r2).await;
    let (code, r2) = reserve(&app, &p.pool, "k-lost-3", 1).await;
    assert_eq!(code, "", "{r2}");
    assert_eq!(r2["allocations"][0]["atoms"][0], other_uuid);
    // Accepting the report cannot remove a GPU: CONFLICT says what to do, nothing changes.
    let (code, body) = app
        .fails(&app.operator(), ACCEPT, json!({ "i": { "id": h100a } }))
        .await;
    assert_eq!(code, "CONFLICT", "{body}");
    assert!(body.to_string().contains("retireDevice"), "{body}");
    // The GPU is back: the next reading (SIGHUP) clears the condition and returns it.
    inventory(&file, "h100-a", &[H100_A0, H100_A1]);
    sighup(&second);
    let n = until_node(&app, h100a, "the mismatch ends", |n| mismatch(n).is_none()).await;
    assert_eq!(device(&n, &booked)["quarantined"], false, "{n}");
    assert_eq!(device(&n, &booked)["inventoryMismatch"], Value::Null);
    let events: Vec<String> = sqlx::query_scalar(
        "SELECT type FROM outbox WHERE subject = $1 AND type LIKE 'node.inventory_%' ORDER BY txid, seq",
    )
    .bind(h100a)
    .fetch_all(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(
        events,
        ["node.inventory_mismatch", "node.inventory_matched"]
    );
    // It goes for good: the operator retires it (nothing is booked on it), and the node agrees
    // with its registration again, with one GPU less in the pool.
    inventory(&file, "h100-a", &[other]);
    sighup(&second);
    let n = until_node(&app, h100a, "the mismatch again", |n| mismatch(n).is_some()).await;
    let gone = device(&n, &booked)["id"].clone();
    let capacity = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT sum(atoms)::bigint FROM pool_capacity_rollup WHERE pool_id = $1",
        )
        .bind(&p.pool)
        .fetch_one(app.db.db.pool())
        .await
        .expect("capacity")
    };
    let before = capacity().await;
    let retired = app
        .ok(
            &app.operator(),
            "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { retiredAt quarantined } } }",
            json!({ "i": { "id": gone } }),
        )
        .await["retireDevice"]["device"]
        .clone();
    assert!(retired["retiredAt"].is_string(), "{retired}");
    assert_eq!(retired["quarantined"], true);
    let n = node(&app, h100a).await;
    assert_eq!(mismatch(&n), None, "{n}");
    assert_eq!(capacity().await, before - 1);
    // The other GPU, which holds a booking, cannot be retired.
    let held = device(&n, other_uuid)["id"].clone();
    let (code, body) = app
        .fails(
            &app.operator(),
            "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { retiredAt } } }",
            json!({ "i": { "id": held } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "{body}");
}

#[tokio::test]
async fn an_xid_error_marks_the_gpu_unhealthy_and_placement_avoids_it() {
    let (app, p) = setup().await;
    let dir = test_dir("xid");
    let file = dir.join("inventory.toml");
    let inv = file.to_str().expect("path").to_owned();
    let h100a = &p.nodes[0];
    inventory(&file, "h100-a", &[H100_A0, H100_A1]);
    let state = dir.join("state");
    let child = registered_agent(&app, h100a, &state, &inv);
    until_node(&app, h100a, "the first report", |n| {
        !n["inventoryReportedAt"].is_null()
    })
    .await;
    // A reservation holds one GPU; then that GPU reports XID 79 (with a harmless XID 13).
    let (code, held) = reserve(&app, &p.pool, "k-xid-held", 1).await;
    assert_eq!(code, "", "{held}");
    let sick = held["allocations"][0]["atoms"][0]
        .as_str()
        .expect("atom")
        .to_owned();
    let (well, well_uuid) = if sick == "GPU-A0" {
        (H100_A1, "GPU-A1")
    } else {
        (H100_A0, "GPU-A0")
    };
    let sick_body = if sick == "GPU-A0" { H100_A0 } else { H100_A1 };
    inventory(
        &file,
        "h100-a",
        &[&format!("{sick_body}\nxid = [13, 79]"), well],
    );
    sighup(&child);
    let n = until_node(&app, h100a, "the GPU unhealthy", |n| {
        device(n, &sick)["health"] == "UNHEALTHY"
    })
    .await;
    let d = device(&n, &sick);
    assert_eq!(d["healthReason"], "XID 79: GPU has fallen off the bus");
    assert!(d["healthSince"].is_string(), "{d}");
    assert_eq!(device(&n, well_uuid)["health"], "HEALTHY");
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'device.health_changed' \
            AND data #>> '{device,uuid}' = $1 AND data #>> '{device,health}' = 'unhealthy'",
    )
    .bind(&sick)
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(events, 1);
    // The reservation keeps it, and its tenant sees why: a change with its version and event.
    const RESERVATION: &str = "query($id: ID!) { reservation(id: $id) { state version conditions { type message } allocations { atoms } } }";
    let changes = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox WHERE type = 'reservation.conditions_changed' AND subject = $1",
        )
        .bind(held["id"].as_str().expect("id"))
        .fetch_one(app.db.db.pool())
        .await
        .expect("events")
    };
    assert_eq!(changes().await, 1);
    let r = app
        .ok(
            &app.member("acme"),
            RESERVATION,
            json!({ "id": held["id"] }),
        )
        .await["reservation"]
        .clone();
    assert_eq!(r["state"], "ACTIVE");
    assert_eq!(
        r["version"].as_i64(),
        held["version"].as_i64().map(|v| v + 1),
        "{r}"
    );
    assert_eq!(r["allocations"][0]["atoms"][0], sick.as_str());
    let condition = r["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == "DeviceUnhealthy")
        .unwrap_or_else(|| panic!("no DeviceUnhealthy in {r}"));
    assert!(
        condition["message"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("{sick}: XID 79"))),
        "{condition}"
    );
    // A new reservation avoids it; with the other GPU taken too, one waits.
    let (code, r2) = reserve(&app, &p.pool, "k-xid-1", 1).await;
    assert_eq!(code, "", "{r2}");
    assert_eq!(r2["allocations"][0]["atoms"][0], well_uuid);
    let (code, pending) = reserve(&app, &p.pool, "k-xid-2", 1).await;
    assert_eq!(
        (code.as_str(), &pending["state"]),
        ("", &json!("PENDING")),
        "waits: {pending}"
    );
    cancel(&app, &pending).await;
    // A passing report (the GPU was reset) makes it healthy again, and the condition goes.
    inventory(&file, "h100-a", &[H100_A0, H100_A1]);
    sighup(&child);
    until_node(&app, h100a, "the GPU healthy again", |n| {
        device(n, &sick)["health"] == "HEALTHY"
    })
    .await;
    let r = app
        .ok(
            &app.member("acme"),
            RESERVATION,
            json!({ "id": held["id"] }),
        )
        .await["reservation"]
        .clone();
    assert!(
        r["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .all(|c| c["type"] != "DeviceUnhealthy"),
        "{r}"
    );
    assert_eq!(
        r["version"].as_i64(),
        held["version"].as_i64().map(|v| v + 2),
        "{r}"
    );
    assert_eq!(changes().await, 2);
}

#[tokio::test]
async fn the_inventory_subcommand_says_plainly_what_it_found() {
    let dir = test_dir("inventory");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_test-agent"))
            .arg("inventory")
            .args(args)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .env_remove("COMPUTE_AGENT_INVENTORY")
            .output()
            .expect("compute-agent inventory")
    };
    // This machine has no NVIDIA GPU (no NVML): it says so, and exits 0.
    let out = run(&["--nvidia-smi", "/nonexistent/nvidia-smi"]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no NVIDIA GPU found"), "{stderr}");
    let found: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(found["gpus"], json!([]));
    assert!(found["vcpu"].as_i64().is_some_and(|v| v >= 1), "{found}");
    assert!(
        found["memoryMib"].as_i64().is_some_and(|v| v > 0),
        "{found}"
    );
    // With a file: its devices, and their health.
    let file = dir.join("inventory.toml");
    inventory(
        &file,
        "gpu-7",
        &[H100_A0, &format!("{H100_A1}\necc_double_bit = 1")],
    );
    let out = run(&["--inventory", file.to_str().expect("path")]);
    assert!(out.status.success(), "{out:?}");
    let found: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(found["hostname"], "gpu-7");
    assert_eq!(found["gpus"][0]["uuid"], "GPU-A0");
    assert_eq!(found["gpus"][1]["memoryMib"], 81559);
    assert_eq!(found["health"]["GPU-A1"]["health"], "unhealthy");
    assert_eq!(found["health"]["GPU-A0"]["health"], "healthy");
    // A broken file is an error naming it (exit 2).
    std::fs::write(&file, "[[gpu]]\nuuid = 7\n").expect("write");
    let out = run(&["--inventory", file.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("inventory.toml"));
}

/// A GPU whose model the machine reports differently is renamed by `acceptNodeInventory`, and
/// its atoms move to its new model's capacity counts in the same transaction: the rollup agrees
/// with a recount, and retiring it later takes them from the right counts. (They stayed under
/// the old model, and the retirement failed `INTERNAL` on the new model's `CHECK`.)
#[tokio::test]
async fn a_renamed_gpu_moves_its_capacity_to_its_new_model() {
    let (app, p) = setup().await;
    let dir = test_dir("renamed");
    let file = dir.join("inventory.toml");
    let inv = file.to_str().expect("path").to_owned();
    let h100a = &p.nodes[0];
    inventory(
        &file,
        "h100-a",
        &[&H100_A0.replace("\"H100\"", "\"H100 SXM\""), H100_A1],
    );
    let _agent = registered_agent(&app, h100a, &dir.join("state"), &inv);
    until_node(&app, h100a, "the mismatch", |n| mismatch(n).is_some()).await;
    app.ok(&app.operator(), ACCEPT, json!({ "i": { "id": h100a } }))
        .await;
    let counts = || async {
        sqlx::query_as::<_, (String, i32)>(
            "SELECT model, atoms FROM pool_capacity_rollup WHERE pool_id = $1 AND kind = 'gpu' AND atoms > 0 ORDER BY model",
        )
        .bind(&p.pool)
        .fetch_all(app.db.db.pool())
        .await
        .expect("rollup")
    };
    let after = counts().await;
    assert!(
        after.contains(&("H100 SXM".to_owned(), 1)),
        "the renamed GPU counts under its new model: {after:?}"
    );
    let pool = compute_domain::ids::PoolId::parse("pool", &p.pool).expect("pool");
    let fixed = compute_domain::fleet::changes::recompute_rollup(&app.db.db, &pool)
        .await
        .expect("recount");
    assert_eq!(fixed, 0, "no drift: {after:?} against {:?}", counts().await);
    let n = node(&app, h100a).await;
    app.ok(
        &app.operator(),
        "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { retiredAt } } }",
        json!({ "i": { "id": device(&n, "GPU-A0")["id"] } }),
    )
    .await;
    let fixed = compute_domain::fleet::changes::recompute_rollup(&app.db.db, &pool)
        .await
        .expect("recount");
    assert_eq!(fixed, 0, "no drift after the retirement");
}

/// `acceptNodeInventory(version:)` covers the report it accepts: a report of another inventory
/// (here 64 vCPU where the operator read 32) makes the node newer, and an acceptance of the
/// version read before it is `CONFLICT` with nothing written; accepted at the new version, the
/// node takes the figures the operator then saw.
#[tokio::test]
async fn an_acceptance_of_the_version_read_before_another_report_is_a_conflict() {
    let (app, p) = setup().await;
    let dir = test_dir("accept-version");
    let file = dir.join("inventory.toml");
    let inv = file.to_str().expect("path").to_owned();
    let h100a = &p.nodes[0];
    let renamed = H100_A0.replace("\"H100\"", "\"H100 SXM\"");
    inventory(&file, "h100-a", &[&renamed, H100_A1]);
    let agent = registered_agent(&app, h100a, &dir.join("state"), &inv);
    let read = until_node(&app, h100a, "the mismatch", |n| mismatch(n).is_some()).await;
    assert_eq!(read["inventory"]["vcpu"], 32, "{read}");
    let seen = read["version"].as_i64().expect("version");
    // The machine now says 64 vCPU.
    let text = std::fs::read_to_string(&file)
        .expect("inventory")
        .replace("vcpu = 32", "vcpu = 64");
    std::fs::write(&file, text).expect("inventory");
    sighup(&agent);
    let now = until_node(&app, h100a, "the second report", |n| {
        n["inventory"]["vcpu"] == 64
    })
    .await;
    assert!(
        now["version"].as_i64().expect("version") > seen,
        "another inventory makes the node newer: {now}"
    );
    let (code, e) = app
        .fails(
            &app.operator(),
            ACCEPT,
            json!({ "i": { "id": h100a, "version": seen } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "{e}");
    let vcpu = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT allocatable FROM node_resources WHERE node_id = $1 AND resource = 'vcpu'",
        )
        .bind(h100a)
        .fetch_one(app.db.db.pool())
        .await
        .expect("vcpu")
    };
    assert_eq!(vcpu().await, 32, "nothing accepted");
    assert_eq!(device(&node(&app, h100a).await, "GPU-A0")["model"], "H100");
    let current = node(&app, h100a).await["version"]
        .as_i64()
        .expect("version");
    app.ok(
        &app.operator(),
        ACCEPT,
        json!({ "i": { "id": h100a, "version": current } }),
    )
    .await;
    assert_eq!(vcpu().await, 64, "the figures seen are accepted");
    assert_eq!(
        device(&node(&app, h100a).await, "GPU-A0")["model"],
        "H100 SXM"
    );
}
