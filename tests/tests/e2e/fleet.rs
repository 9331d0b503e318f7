//! The fleet through GraphQL: every operator mutation, its validation, optimistic concurrency, the
//! atom rule, mode changes, capacity and tenant isolation.

use compute_tests::{TestApp, spawn_app};
use serde_json::{Value, json};

pub const CREATE_SITE: &str =
    "mutation($i: CreateSiteInput!) { createSite(input: $i) { site { id name version } } }";
pub const CREATE_POOL: &str = "mutation($i: CreatePoolInput!) { createPool(input: $i) { pool { id name kind version overcommit { vcpu memory disk } } } }";
pub const REGISTER: &str = "mutation($i: RegisterNodeInput!) { registerNode(input: $i) { computeNode { id hostname version generation \
    devices { id uuid mode version atoms { name kind profile shareNumerator shareDenominator } } } } }";

/// A site, a pool and one node with an exclusive, a MIG and a time-sliced GPU.
pub struct Fleet {
    pub site: String,
    pub pool: String,
    pub node: String,
    /// (device id, uuid) of the exclusive, MIG and time-sliced GPUs.
    pub gpus: Vec<(String, String)>,
}

/// The tests' one fleet fixture: a site named `site` (through `createSite`) with a pool in it
/// (through `createPool`; `pool` is the pool's input without `siteId`). Their ids.
pub async fn site_with_pool(app: &TestApp, site: &str, pool: Value) -> (String, String) {
    let op = app.operator();
    let site = app
        .ok(&op, CREATE_SITE, json!({ "i": { "name": site } }))
        .await["createSite"]["site"]["id"]
        .as_str()
        .expect("site id")
        .to_owned();
    let pool = add_pool(app, &site, pool).await;
    (site, pool)
}

/// A pool in `site` (`pool` is its input without `siteId`); its id.
pub async fn add_pool(app: &TestApp, site: &str, mut pool: Value) -> String {
    pool["siteId"] = json!(site);
    app.ok(&app.operator(), CREATE_POOL, json!({ "i": pool }))
        .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("pool id")
        .to_owned()
}

pub async fn small_fleet(app: &TestApp, tag: &str) -> Fleet {
    let op = app.operator();
    let (site, pool) = site_with_pool(
        app,
        &format!("site-{tag}"),
        json!({ "name": "gpu", "kind": "BARE_METAL", "overcommit": { "vcpu": 2 } }),
    )
    .await;
    let node = app
        .ok(
            &op,
            REGISTER,
            json!({ "i": {
                "poolId": pool,
                "hostname": format!("{tag}-node-1"),
                "labels": [{ "key": "rack", "value": "r1" }],
                "resources": { "vcpu": 64, "memoryMib": 524288, "diskGib": 2000 },
                "devices": [
                    { "uuid": format!("GPU-{tag}-0"), "model": "H100", "memoryMib": 81559 },
                    { "uuid": format!("GPU-{tag}-1"), "model": "A100", "memoryMib": 81920, "mode": "MIG",
                      "layout": { "migProfiles": ["3g.40gb", "2g.20gb", "1g.10gb"] } },
                    { "uuid": format!("GPU-{tag}-2"), "model": "L4", "memoryMib": 23034, "mode": "TIME_SLICE",
                      "layout": { "slots": 4 } }
                ]
            } }),
        )
        .await;
    let n = &node["registerNode"]["computeNode"];
    let gpus = n["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| {
            (
                d["id"].as_str().expect("id").to_owned(),
                d["uuid"].as_str().expect("uuid").to_owned(),
            )
        })
        .collect::<Vec<_>>();
    let mut by_uuid = gpus.clone();
    by_uuid.sort_by(|a, b| a.1.cmp(&b.1));
    Fleet {
        site,
        pool,
        node: n["id"].as_str().expect("node id").to_owned(),
        gpus: by_uuid,
    }
}

/// Books an atom directly, as the reservations issue's placement will.
pub async fn book(app: &TestApp, atom: &str, device: &str, allocation: &str, secs: i64) {
    sqlx::query(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
         VALUES ($1, $2, $3, tstzrange(compute_now(), compute_now() + make_interval(secs => $4::float8)))",
    )
    .bind(atom)
    .bind(device)
    .bind(allocation)
    .bind(secs as f64)
    .execute(app.db.db.pool())
    .await
    .expect("book");
}

fn atom_names(device: &Value) -> Vec<String> {
    device["atoms"]
        .as_array()
        .expect("atoms")
        .iter()
        .map(|a| a["name"].as_str().expect("name").to_owned())
        .collect()
}

#[tokio::test]
async fn the_atom_rule_holds_for_every_mode() {
    let app = spawn_app().await;
    let f = small_fleet(&app, "atoms").await;
    let data = app
        .ok(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { ... on ComputeNode { devices { uuid mode migProfiles slots \
             atoms { name kind profile shareNumerator shareDenominator } } } } }",
            json!({ "id": f.node }),
        )
        .await;
    let devices = data["node"]["devices"].as_array().expect("devices").clone();
    let by_uuid = |suffix: &str| {
        devices
            .iter()
            .find(|d| d["uuid"].as_str().is_some_and(|u| u.ends_with(suffix)))
            .cloned()
            .expect("device")
    };
    let exclusive = by_uuid("-0");
    assert_eq!(
        atom_names(&exclusive),
        vec!["GPU-atoms-0"],
        "an exclusive GPU is one atom: its UUID"
    );
    assert_eq!(exclusive["atoms"][0]["kind"], "GPU");

    let mig = by_uuid("-1");
    assert_eq!(mig["mode"], "MIG");
    assert_eq!(
        atom_names(&mig),
        vec![
            "GPU-atoms-1/mig/0",
            "GPU-atoms-1/mig/1",
            "GPU-atoms-1/mig/2"
        ]
    );
    assert!(
        !atom_names(&mig).contains(&"GPU-atoms-1".to_owned()),
        "the MIG parent is not bookable"
    );
    assert_eq!(mig["atoms"][0]["profile"], "3g.40gb");
    assert_eq!(
        (
            mig["atoms"][0]["shareNumerator"].as_i64(),
            mig["atoms"][0]["shareDenominator"].as_i64()
        ),
        (Some(3), Some(7))
    );

    let sliced = by_uuid("-2");
    assert_eq!(sliced["slots"], 4);
    assert_eq!(
        atom_names(&sliced),
        vec![
            "GPU-atoms-2/s0",
            "GPU-atoms-2/s1",
            "GPU-atoms-2/s2",
            "GPU-atoms-2/s3"
        ]
    );

    // Capacity counts atoms, by model and profile.
    let cap = app
        .ok(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { ... on Pool { capacity { model kind profile total booked free } } } }",
            json!({ "id": f.pool }),
        )
        .await;
    let cap = cap["node"]["capacity"]
        .as_array()
        .expect("capacity")
        .clone();
    assert_eq!(cap.len(), 5, "{cap:?}");
    let row = |model: &str, profile: Option<&str>| {
        cap.iter()
            .find(|r| r["model"] == model && r["profile"].as_str() == profile)
            .cloned()
            .unwrap_or_else(|| panic!("no capacity row for {model} {profile:?}: {cap:?}"))
    };
    assert_eq!(row("H100", None)["free"], 1);
    assert_eq!(row("A100", Some("1g.10gb"))["total"], 1);
    assert_eq!(row("L4", None)["total"], 4);
    assert_eq!(row("L4", None)["kind"], "SLOT");

    // The rollup kept in the same transactions agrees with the atoms.
    let rollup: Vec<(String, String, i32)> =
        sqlx::query_as("SELECT model, profile, atoms FROM pool_capacity_rollup WHERE pool_id = $1 ORDER BY model, profile")
            .bind(&f.pool)
            .fetch_all(app.db.db.pool())
            .await
            .expect("rollup");
    assert_eq!(
        rollup,
        vec![
            ("A100".into(), "1g.10gb".into(), 1),
            ("A100".into(), "2g.20gb".into(), 1),
            ("A100".into(), "3g.40gb".into(), 1),
            ("H100".into(), "".into(), 1),
            ("L4".into(), "".into(), 4)
        ]
    );
}

#[tokio::test]
async fn creates_are_idempotent_with_a_key() {
    let app = spawn_app().await;
    let op = app.operator();
    let input = json!({ "i": { "name": "same", "region": "eu", "idempotencyKey": "k-1" } });
    let first = app.ok(&op, CREATE_SITE, input.clone()).await;
    let again = app.ok(&op, CREATE_SITE, input).await;
    assert_eq!(first, again, "a retry gets the same answer");
    assert_eq!(app.count("sites").await, 1);
    assert_eq!(
        app.count("outbox WHERE type = 'site.created'").await,
        1,
        "and no second event"
    );

    let (code, _) = app
        .fails(
            &op,
            CREATE_SITE,
            json!({ "i": { "name": "other", "idempotencyKey": "k-1" } }),
        )
        .await;
    assert_eq!(code, "IDEMPOTENCY_KEY_REUSED");

    // Keys are scoped to the identity: another operator's k-1 is a new request.
    let other = app.token("bob@ops", Some("ops"), &[compute_api::auth::Role::Operator]);
    let (code, _) = app
        .fails(
            &other,
            CREATE_SITE,
            json!({ "i": { "name": "same", "region": "eu", "idempotencyKey": "k-1" } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "a new request for an existing name");

    let site = first["createSite"]["site"]["id"].clone();
    let pool_input = json!({ "i": { "siteId": site, "name": "p", "kind": "PROVIDER", "lostAfterSeconds": 600, "idempotencyKey": "p-1" } });
    let p1 = app.ok(&op, CREATE_POOL, pool_input.clone()).await;
    let p2 = app.ok(&op, CREATE_POOL, pool_input).await;
    assert_eq!(
        p1["createPool"]["pool"]["id"],
        p2["createPool"]["pool"]["id"]
    );
    assert_eq!(app.count("pools").await, 1);
}

#[tokio::test]
async fn bad_input_names_the_field_and_writes_nothing() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "bad").await;
    let (nodes, devices, events) = (
        app.count("nodes").await,
        app.count("devices").await,
        app.count("outbox").await,
    );
    let node = |devices: Value, vcpu: i64| json!({ "i": { "poolId": f.pool, "hostname": "bad-node-2", "resources": { "vcpu": vcpu, "memoryMib": 1024, "diskGib": 10 }, "devices": devices } });
    let cases = vec![
        ("negative count", node(json!([]), -4), "resources.vcpu"),
        (
            "unknown MIG profile",
            node(
                json!([{ "uuid": "GPU-x1", "model": "A100", "memoryMib": 81920, "mode": "MIG", "layout": { "migProfiles": ["5g.50gb"] } }]),
                8,
            ),
            "devices[0].layout",
        ),
        (
            "overlapping layout",
            node(
                json!([{ "uuid": "GPU-x2", "model": "A100", "memoryMib": 81920, "mode": "MIG", "layout": { "migProfiles": ["4g.40gb", "4g.40gb"] } }]),
                8,
            ),
            "devices[0].layout",
        ),
        (
            "a GPU listed twice",
            node(
                json!([{ "uuid": "GPU-x3", "model": "L4", "memoryMib": 23034 }, { "uuid": "GPU-x3", "model": "L4", "memoryMib": 23034 }]),
                8,
            ),
            "devices",
        ),
    ];
    for (case, input, field) in cases {
        let (code, error) = app.fails(&op, REGISTER, input).await;
        assert_eq!(code, "BAD_USER_INPUT", "{case}: {error}");
        assert_eq!(error["extensions"]["field"], field, "{case}: {error}");
    }
    let (code, error) = app
        .fails(&op, REGISTER, json!({ "i": { "poolId": "pool_nope", "hostname": "x", "resources": { "vcpu": 1, "memoryMib": 1, "diskGib": 1 } } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("poolId")),
        "malformed id"
    );
    let (code, error) = app
        .fails(&op, CREATE_POOL, json!({ "i": { "siteId": f.site, "name": "cheap", "kind": "BARE_METAL", "overcommit": { "vcpu": 0.5 } } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("overcommit.vcpu")),
        "ratio below 1"
    );
    let (code, error) = app
        .fails(&op, CREATE_POOL, json!({ "i": { "siteId": f.site, "name": "metal", "kind": "BARE_METAL", "lostAfterSeconds": 60 } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("lostAfterSeconds"))
    );
    let (code, _) = app
        .fails(&op, REGISTER, json!({ "i": { "poolId": f.pool, "hostname": "bad-node-1", "resources": { "vcpu": 1, "memoryMib": 1, "diskGib": 1 } } }))
        .await;
    assert_eq!(code, "CONFLICT", "a host name already registered");
    let (code, _) = app
        .fails(&op, REGISTER, json!({ "i": { "poolId": "pool_0000000000000000000000000000beef", "hostname": "y", "resources": { "vcpu": 1, "memoryMib": 1, "diskGib": 1 } } }))
        .await;
    assert_eq!(code, "NOT_FOUND");

    assert_eq!(
        (
            app.count("nodes").await,
            app.count("devices").await,
            app.count("outbox").await
        ),
        (nodes, devices, events),
        "failed mutations left no rows and no events"
    );
}

#[tokio::test]
async fn a_stale_version_is_a_conflict_carrying_the_current_one() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "stale").await;
    let update =
        "mutation($i: UpdateSiteInput!) { updateSite(input: $i) { site { name version } } }";
    let data = app
        .ok(
            &op,
            update,
            json!({ "i": { "id": f.site, "version": 1, "name": "renamed" } }),
        )
        .await;
    assert_eq!(
        data["updateSite"]["site"],
        json!({ "name": "renamed", "version": 2 })
    );
    let (code, error) = app
        .fails(
            &op,
            update,
            json!({ "i": { "id": f.site, "version": 1, "name": "again" } }),
        )
        .await;
    assert_eq!(code, "CONFLICT");
    assert_eq!(error["extensions"]["currentVersion"], 2);

    let update_node = "mutation($i: UpdateNodeInput!) { updateNode(input: $i) { computeNode { version generation labels { key value } } } }";
    let data = app
        .ok(&op, update_node, json!({ "i": { "id": f.node, "version": 1, "labels": [{ "key": "zone", "value": "a" }] } }))
        .await;
    assert_eq!(
        data["updateNode"]["computeNode"]["generation"], 2,
        "a spec change moves the generation"
    );
    let (code, error) = app
        .fails(
            &op,
            update_node,
            json!({ "i": { "id": f.node, "version": 1, "labels": [] } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["currentVersion"]),
        ("CONFLICT", &json!(2))
    );

    let update_pool = "mutation($i: UpdatePoolInput!) { updatePool(input: $i) { pool { version overcommit { vcpu } } } }";
    let (code, _) = app
        .fails(
            &op,
            update_pool,
            json!({ "i": { "id": f.pool, "version": 7, "name": "x" } }),
        )
        .await;
    assert_eq!(code, "CONFLICT");
    assert_eq!(
        app.count("outbox WHERE type IN ('site.updated', 'node.updated')")
            .await,
        2,
        "one event per change that committed"
    );
}

#[tokio::test]
async fn pool_ratios_reach_the_nodes_and_never_overcommit_them() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "ratio").await;
    let resources = "query($id: ID!) { node(id: $id) { ... on ComputeNode { resources { resource allocatable ratio limit allocated free } } } }";
    let data = app.ok(&op, resources, json!({ "id": f.node })).await;
    assert_eq!(
        data["node"]["resources"][2],
        json!({ "resource": "VCPU", "allocatable": 64, "ratio": 2.0, "limit": 128, "allocated": 0, "free": 128 })
    );

    sqlx::query(
        "UPDATE node_resources SET allocated = 100 WHERE node_id = $1 AND resource = 'vcpu'",
    )
    .bind(&f.node)
    .execute(app.db.db.pool())
    .await
    .expect("allocate");
    let update_pool = "mutation($i: UpdatePoolInput!) { updatePool(input: $i) { pool { version overcommit { vcpu } } } }";
    let (code, error) = app
        .fails(
            &op,
            update_pool,
            json!({ "i": { "id": f.pool, "version": 1, "overcommit": { "vcpu": 1.0 } } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "{error}");
    let data = app
        .ok(
            &op,
            update_pool,
            json!({ "i": { "id": f.pool, "version": 1, "overcommit": { "vcpu": 1.6 } } }),
        )
        .await;
    assert_eq!(
        data["updatePool"]["pool"],
        json!({ "version": 2, "overcommit": { "vcpu": 1.6 } })
    );
    let data = app.ok(&op, resources, json!({ "id": f.node })).await;
    assert_eq!(data["node"]["resources"][2]["limit"], 102);
    let err = sqlx::query(
        "UPDATE node_resources SET allocated = 103 WHERE node_id = $1 AND resource = 'vcpu'",
    )
    .bind(&f.node)
    .execute(app.db.db.pool())
    .await
    .expect_err("the CHECK backstop");
    assert!(
        err.to_string().contains("node_resources_within_limit"),
        "{err}"
    );
}

#[tokio::test]
async fn cordon_taint_drain_and_retire_follow_the_state_table() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let op = app.operator();
    let f = small_fleet(&app, "life").await;
    let fields =
        "{ computeNode { lifecycle cordoned cordonReason version taints { key value effect } } }";
    let cordon = format!("mutation($i: CordonNodeInput!) {{ cordonNode(input: $i) {fields} }}");
    let uncordon = format!("mutation($i: NodeActionInput!) {{ uncordonNode(input: $i) {fields} }}");
    let taint = format!("mutation($i: TaintNodeInput!) {{ taintNode(input: $i) {fields} }}");
    let untaint = format!("mutation($i: UntaintNodeInput!) {{ untaintNode(input: $i) {fields} }}");
    let retire = format!("mutation($i: NodeActionInput!) {{ retireNode(input: $i) {fields} }}");

    let d = app
        .ok(
            &op,
            &cordon,
            json!({ "i": { "id": f.node, "reason": "bios update" } }),
        )
        .await;
    assert_eq!(d["cordonNode"]["computeNode"]["lifecycle"], "CORDONED");
    assert_eq!(
        d["cordonNode"]["computeNode"]["cordonReason"],
        "bios update"
    );
    let (code, _) = app
        .fails(
            &op,
            &uncordon,
            json!({ "i": { "id": f.node, "version": 1 } }),
        )
        .await;
    assert_eq!(code, "CONFLICT", "the cordon moved the version");
    let d = app
        .ok(&op, &uncordon, json!({ "i": { "id": f.node } }))
        .await;
    assert_eq!(d["uncordonNode"]["computeNode"]["lifecycle"], "ACTIVE");

    let d = app.ok(&op, &taint, json!({ "i": { "id": f.node, "taint": { "key": "gpu", "value": "h100", "effect": "NO_SCHEDULE" } } })).await;
    assert_eq!(
        d["taintNode"]["computeNode"]["taints"],
        json!([{ "key": "gpu", "value": "h100", "effect": "NO_SCHEDULE" }])
    );
    let d = app.ok(&op, &taint, json!({ "i": { "id": f.node, "taint": { "key": "gpu", "value": "a100", "effect": "NO_SCHEDULE" } } })).await;
    assert_eq!(
        d["taintNode"]["computeNode"]["taints"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "same key and effect replaces"
    );
    let d = app
        .ok(
            &op,
            &untaint,
            json!({ "i": { "id": f.node, "key": "gpu" } }),
        )
        .await;
    assert_eq!(d["untaintNode"]["computeNode"]["taints"], json!([]));
    let (code, _) = app
        .fails(
            &op,
            &untaint,
            json!({ "i": { "id": f.node, "key": "gpu" } }),
        )
        .await;
    assert_eq!(code, "NOT_FOUND");

    let (exclusive_dev, exclusive_uuid) = f.gpus[0].clone();
    book(&app, &exclusive_uuid, &exclusive_dev, "alc_test", 3600).await;
    let d = app
        .ok(&op, "mutation($i: NodeActionInput!) { drainNode(input: $i) { computeNode { lifecycle } remaining { allocationId atoms until } } }", json!({ "i": { "id": f.node } }))
        .await;
    assert_eq!(d["drainNode"]["computeNode"]["lifecycle"], "CORDONED");
    assert_eq!(
        d["drainNode"]["remaining"],
        json!([{ "allocationId": "alc_test", "atoms": [exclusive_uuid], "until": "2031-01-01T01:00:00+00:00" }])
    );
    let (code, error) = app
        .fails(&op, &retire, json!({ "i": { "id": f.node } }))
        .await;
    assert_eq!(code, "CONFLICT");
    assert!(
        error["message"].as_str().unwrap_or("").contains("alc_test"),
        "{error}"
    );

    app.db.advance_clock(3600).await;
    let d = app.ok(&op, &retire, json!({ "i": { "id": f.node } })).await;
    assert_eq!(d["retireNode"]["computeNode"]["lifecycle"], "RETIRED");
    let (code, error) = app
        .fails(&op, &uncordon, json!({ "i": { "id": f.node } }))
        .await;
    assert_eq!(code, "CONFLICT");
    assert!(
        error["message"].as_str().unwrap_or("").contains("retired"),
        "{error}"
    );
    let cap = app
        .ok(
            &op,
            "query($id: ID!) { node(id: $id) { ... on Pool { capacity { total } } } }",
            json!({ "id": f.pool }),
        )
        .await;
    assert_eq!(
        cap["node"]["capacity"],
        json!([]),
        "a retired node's GPUs leave capacity"
    );
    let (atoms,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(atoms), 0)::bigint FROM pool_capacity_rollup WHERE pool_id = $1",
    )
    .bind(&f.pool)
    .fetch_one(app.db.db.pool())
    .await
    .expect("rollup");
    assert_eq!(atoms, 0);
    for t in [
        "node.cordoned",
        "node.uncordoned",
        "node.tainted",
        "node.untainted",
        "node.drained",
        "node.retired",
    ] {
        assert!(
            app.count(&format!("outbox WHERE type = '{t}'")).await >= 1,
            "{t} event"
        );
    }
}

#[tokio::test]
async fn health_and_quarantine_take_gpus_out_of_free_capacity() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "health").await;
    let free_h100 = || async {
        let d = app
            .ok(&op, "query($id: ID!) { node(id: $id) { ... on Pool { capacity { model total free } } } }", json!({ "id": f.pool }))
            .await;
        d["node"]["capacity"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["model"] == "H100").cloned())
            .expect("H100 row")
    };
    assert_eq!(
        free_h100().await,
        json!({ "model": "H100", "total": 1, "free": 1 })
    );
    let dev = f.gpus[0].0.clone();
    let d = app
        .ok(&op, "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { health healthReason version } } }", json!({ "i": { "id": dev, "health": "UNHEALTHY", "reason": "XID 79" } }))
        .await;
    assert_eq!(
        d["setDeviceHealth"]["device"],
        json!({ "health": "UNHEALTHY", "healthReason": "XID 79", "version": 2 })
    );
    assert_eq!(free_h100().await["free"], 0);
    app.ok(
        &op,
        "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { health } } }",
        json!({ "i": { "id": dev, "health": "HEALTHY" } }),
    )
    .await;
    let d = app
        .ok(&op, "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { quarantined quarantineReason } } }", json!({ "i": { "id": dev, "reason": "RMA" } }))
        .await;
    assert_eq!(
        d["quarantineDevice"]["device"],
        json!({ "quarantined": true, "quarantineReason": "RMA" })
    );
    assert_eq!(free_h100().await["free"], 0);
    let (code, error) = app
        .fails(&op, "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { id } } }", json!({ "i": { "id": dev, "reason": " " } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("reason"))
    );
    app.ok(&op, "mutation($i: UnquarantineDeviceInput!) { unquarantineDevice(input: $i) { device { quarantined } } }", json!({ "i": { "id": dev } })).await;
    assert_eq!(free_h100().await["free"], 1);

    // Cordoning takes the whole node out of free capacity (placement locks these rows FOR SHARE).
    app.ok(
        &op,
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": f.node } }),
    )
    .await;
    assert_eq!(
        free_h100().await,
        json!({ "model": "H100", "total": 1, "free": 0 })
    );
    for t in [
        "device.health_changed",
        "device.quarantined",
        "device.unquarantined",
    ] {
        assert!(
            app.count(&format!("outbox WHERE type = '{t}'")).await >= 1,
            "{t} event"
        );
    }
}

const CHANGE_MODE: &str = "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { mode version migProfiles slots atoms { name profile } } } }";

#[tokio::test]
async fn a_mode_change_replaces_the_atoms_and_holds_the_gpu() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let op = app.operator();
    let f = small_fleet(&app, "mode").await;
    let (dev, uuid) = f.gpus[0].clone();
    let d = app
        .ok(&op, CHANGE_MODE, json!({ "i": { "id": dev, "version": 1, "mode": "MIG", "layout": { "migProfiles": ["4g.40gb", "3g.40gb"] }, "changeWindowSeconds": 600 } }))
        .await;
    let device = &d["changeDeviceMode"]["device"];
    assert_eq!(device["mode"], "MIG");
    assert_eq!(device["version"], 2);
    assert_eq!(
        atom_names(device),
        vec![format!("{uuid}/mig/0"), format!("{uuid}/mig/1")]
    );

    // While the node applies the change, the GPU (parent and new atoms) is held.
    let held: Vec<(String,)> = sqlx::query_as(
        "SELECT atom FROM device_bookings WHERE device_id = $1 AND reason = 'mode_change' AND during @> compute_now() ORDER BY atom",
    )
    .bind(&dev)
    .fetch_all(app.db.db.pool())
    .await
    .expect("holds");
    let held: Vec<String> = held.into_iter().map(|(a,)| a).collect();
    assert_eq!(
        held,
        vec![
            uuid.clone(),
            format!("{uuid}/mig/0"),
            format!("{uuid}/mig/1")
        ]
    );
    let (code, error) = app
        .fails(
            &op,
            CHANGE_MODE,
            json!({ "i": { "id": dev, "version": 2, "mode": "EXCLUSIVE" } }),
        )
        .await;
    assert_eq!(
        code, "CONFLICT",
        "a second change inside the window: {error}"
    );
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("mode_change hold"),
        "{error}"
    );

    app.db.advance_clock(601).await;
    let d = app
        .ok(&op, CHANGE_MODE, json!({ "i": { "id": dev, "version": 2, "mode": "TIME_SLICE", "layout": { "slots": 2 }, "changeWindowSeconds": 0 } }))
        .await;
    assert_eq!(
        atom_names(&d["changeDeviceMode"]["device"]),
        vec![format!("{uuid}/s0"), format!("{uuid}/s1")]
    );
    let d = app.ok(&op, CHANGE_MODE, json!({ "i": { "id": dev, "version": 3, "mode": "EXCLUSIVE", "changeWindowSeconds": 0 } })).await;
    assert_eq!(
        atom_names(&d["changeDeviceMode"]["device"]),
        vec![uuid.clone()]
    );
    let (generation,): (i64,) = sqlx::query_as("SELECT generation FROM nodes WHERE id = $1")
        .bind(&f.node)
        .fetch_one(app.db.db.pool())
        .await
        .expect("generation");
    assert_eq!(
        generation, 4,
        "each mode change is a spec change of the node"
    );
    assert_eq!(
        app.count("outbox WHERE type = 'device.mode_changed'").await,
        3
    );

    let (code, error) = app
        .fails(&op, CHANGE_MODE, json!({ "i": { "id": dev, "version": 4, "mode": "MIG", "layout": { "migProfiles": ["1g.5gb"] } } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("layout")),
        "{error}"
    );
}

#[tokio::test]
async fn a_mode_change_is_refused_while_an_atom_is_booked() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let op = app.operator();
    let f = small_fleet(&app, "busy").await;
    let (dev, uuid) = f.gpus[1].clone(); // the MIG GPU
    // An advance booking, an hour from now, on one instance.
    sqlx::query(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
         VALUES ($1, $2, 'alc_future', tstzrange(compute_now() + interval '1 hour', compute_now() + interval '2 hours'))",
    )
    .bind(format!("{uuid}/mig/2"))
    .bind(&dev)
    .execute(app.db.db.pool())
    .await
    .expect("book");
    let (atoms, events) = (app.count("device_atoms").await, app.count("outbox").await);
    let (code, error) = app
        .fails(
            &op,
            CHANGE_MODE,
            json!({ "i": { "id": dev, "version": 1, "mode": "EXCLUSIVE" } }),
        )
        .await;
    assert_eq!(code, "CONFLICT");
    let message = error["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&format!("{uuid}/mig/2 is booked by alc_future")),
        "{message}"
    );
    assert_eq!(
        (app.count("device_atoms").await, app.count("outbox").await),
        (atoms, events),
        "nothing changed"
    );
    assert_eq!(
        app.count("device_bookings").await,
        1,
        "the probe bookings rolled back"
    );
    let d = app
        .ok(
            &op,
            "query($id: ID!) { node(id: $id) { ... on Device { mode version } } }",
            json!({ "id": dev }),
        )
        .await;
    assert_eq!(d["node"], json!({ "mode": "MIG", "version": 1 }));

    // The exclusion constraint itself refuses a parent booking over a child's, whoever asks:
    // the parent of a MIG GPU is simply not an atom, and a mode change books it.
    let err = sqlx::query(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
         VALUES ($1, $2, 'alc_dup', tstzrange(compute_now() + interval '90 minutes', compute_now() + interval '3 hours'))",
    )
    .bind(format!("{uuid}/mig/2"))
    .bind(&dev)
    .execute(app.db.db.pool())
    .await
    .expect_err("overlap");
    assert!(
        err.to_string().contains("device_bookings_no_overlap"),
        "{err}"
    );
}

#[tokio::test]
async fn quotas_are_set_by_operators_and_read_by_their_tenant() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "quota").await;
    let set = "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { tenantId scopeId scopeKind resource max used version } } }";
    let d = app
        .ok(
            &op,
            set,
            json!({ "i": { "tenantId": "acme", "scopeId": f.pool, "gpus": 2.5, "vcpu": 64 } }),
        )
        .await;
    assert_eq!(d["setQuota"]["quotas"].as_array().map(Vec::len), Some(2));
    let d = app
        .ok(
            &op,
            set,
            json!({ "i": { "tenantId": "acme", "scopeId": f.pool, "gpus": 4 } }),
        )
        .await;
    assert_eq!(d["setQuota"]["quotas"][0]["version"], 2);
    let (code, error) = app
        .fails(
            &op,
            set,
            json!({ "i": { "tenantId": "acme", "scopeId": f.node, "gpus": 1 } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("scopeId"))
    );
    let before = app.count("quota_usage").await;
    let (code, _) = app
        .fails(&op, set, json!({ "i": { "tenantId": "acme", "scopeId": "pool_0000000000000000000000000000beef", "gpus": 1 } }))
        .await;
    assert_eq!(code, "NOT_FOUND");
    assert_eq!(app.count("quota_usage").await, before, "nothing written");

    let acme = app.member("acme");
    let d = app
        .ok(&acme, "{ quotas { resource max used } }", json!({}))
        .await;
    assert_eq!(
        d["quotas"],
        json!([{ "resource": "GPUS", "max": 4.0, "used": 0.0 }, { "resource": "VCPU", "max": 64.0, "used": 0.0 }])
    );
    let other = app.member("globex");
    let d = app
        .ok(&other, "{ quotas(tenantId: \"acme\") { max } }", json!({}))
        .await;
    assert_eq!(
        d["quotas"],
        json!([]),
        "another tenant's quotas are invisible"
    );
    let (code, _) = app
        .fails(
            &acme,
            set,
            json!({ "i": { "tenantId": "acme", "scopeId": f.pool, "gpus": 100 } }),
        )
        .await;
    assert_eq!(code, "FORBIDDEN");
    assert_eq!(
        app.count("outbox WHERE type = 'quota.set' AND tenant_id = 'acme'")
            .await,
        2
    );
}

#[tokio::test]
async fn members_see_the_public_face_and_nothing_else() {
    let app = spawn_app().await;
    let f = small_fleet(&app, "iso").await;
    let member = app.member("acme");
    let d = app
        .ok(&member, "{ sites { totalCount edges { node { name pools { edges { node { name capacity { model free } } } } } } } }", json!({}))
        .await;
    assert_eq!(d["sites"]["totalCount"], 1);
    assert_eq!(
        d["sites"]["edges"][0]["node"]["pools"]["edges"][0]["node"]["name"],
        "gpu"
    );

    for (query, vars) in [
        ("{ computeNodes { totalCount } }", json!({})),
        ("{ devices { totalCount } }", json!({})),
        ("{ atoms { totalCount } }", json!({})),
        (
            "query($id: ID!) { node(id: $id) { ... on Pool { computeNodes { totalCount } } } }",
            json!({ "id": f.pool }),
        ),
        (
            "mutation { createSite(input: { name: \"mine\" }) { site { id } } }",
            json!({}),
        ),
    ] {
        let (code, _) = app.fails(&member, query, vars).await;
        assert_eq!(code, "FORBIDDEN", "{query}");
    }
    for id in [&f.node, &f.gpus[0].0] {
        let (code, _) = app
            .fails(
                &member,
                "query($id: ID!) { node(id: $id) { id } }",
                json!({ "id": id }),
            )
            .await;
        assert_eq!(code, "NOT_FOUND", "a member cannot see {id}");
    }
    let d = app
        .ok(
            &member,
            "query($ids: [ID!]!) { nodes(ids: $ids) { id } }",
            json!({ "ids": [f.site, f.node, f.pool] }),
        )
        .await;
    assert_eq!(
        d["nodes"],
        json!([{ "id": f.site }, null, { "id": f.pool }])
    );

    let (_, body) = app
        .graphql("{ sites { totalCount } }", json!({}), None)
        .await;
    assert_eq!(compute_tests::first_code(&body), Some("UNAUTHENTICATED"));
    let (code, _) = app
        .fails(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { id } }",
            json!({ "id": "nonsense" }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT");
}

#[tokio::test]
async fn connections_page_both_ways_with_opaque_cursors() {
    let app = spawn_app().await;
    let op = app.operator();
    let mut ids = Vec::new();
    for i in 0..5 {
        let d = app
            .ok(
                &op,
                CREATE_SITE,
                json!({ "i": { "name": format!("s{i}") } }),
            )
            .await;
        ids.push(
            d["createSite"]["site"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let page = "query($first: Int, $after: String, $last: Int, $before: String) { sites(first: $first, after: $after, last: $last, before: $before) { totalCount pageInfo { hasNextPage hasPreviousPage startCursor endCursor } edges { cursor node { id } } } }";
    let d = app.ok(&op, page, json!({ "first": 2 })).await;
    let names: Vec<&str> = d["sites"]["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .filter_map(|e| e["node"]["id"].as_str())
        .collect();
    assert_eq!(names, vec![ids[0].as_str(), ids[1].as_str()]);
    assert_eq!(d["sites"]["totalCount"], 5);
    assert_eq!(d["sites"]["pageInfo"]["hasNextPage"], true);
    let end = d["sites"]["pageInfo"]["endCursor"].clone();
    let d = app
        .ok(&op, page, json!({ "first": 10, "after": end }))
        .await;
    let names: Vec<&str> = d["sites"]["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .filter_map(|e| e["node"]["id"].as_str())
        .collect();
    assert_eq!(
        names,
        vec![ids[2].as_str(), ids[3].as_str(), ids[4].as_str()]
    );
    assert_eq!(d["sites"]["pageInfo"]["hasNextPage"], false);
    assert_eq!(d["sites"]["pageInfo"]["hasPreviousPage"], true);

    let d = app.ok(&op, page, json!({ "last": 2 })).await;
    let names: Vec<&str> = d["sites"]["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .filter_map(|e| e["node"]["id"].as_str())
        .collect();
    assert_eq!(
        names,
        vec![ids[3].as_str(), ids[4].as_str()],
        "last keeps the order"
    );
    assert_eq!(d["sites"]["pageInfo"]["hasPreviousPage"], true);
    let start = d["sites"]["pageInfo"]["startCursor"].clone();
    let d = app
        .ok(&op, page, json!({ "last": 2, "before": start }))
        .await;
    let names: Vec<&str> = d["sites"]["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .filter_map(|e| e["node"]["id"].as_str())
        .collect();
    assert_eq!(names, vec![ids[1].as_str(), ids[2].as_str()]);

    let (code, error) = app.fails(&op, page, json!({ "first": 101 })).await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("first"))
    );
    let (code, error) = app.fails(&op, page, json!({ "after": ids[0] })).await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("after")),
        "an id is not a cursor"
    );
}

#[tokio::test]
async fn filters_find_what_a_frontend_asks_for() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "filter").await;
    let other = small_fleet(&app, "other").await;
    let count = |q: String| {
        let app = &app;
        let op = op.clone();
        async move {
            let d = app.ok(&op, &q, json!({})).await;
            d.as_object()
                .and_then(|o| o.values().next())
                .map(|v| v["totalCount"].clone())
                .expect("count")
        }
    };
    assert_eq!(
        count(format!(
            "{{ computeNodes(siteId: \"{}\") {{ totalCount }} }}",
            f.site
        ))
        .await,
        1
    );
    assert_eq!(count("{ computeNodes { totalCount } }".into()).await, 2);
    assert_eq!(
        count(format!(
            "{{ devices(poolId: \"{}\") {{ totalCount }} }}",
            other.pool
        ))
        .await,
        3
    );
    assert_eq!(
        count("{ devices(model: \"A100\", mode: MIG) { totalCount } }".into()).await,
        2
    );
    assert_eq!(
        count("{ atoms(kind: SLOT) { totalCount } }".into()).await,
        8
    );
    assert_eq!(
        count("{ atoms(profile: \"3g.40gb\", free: true) { totalCount } }".into()).await,
        2
    );
    assert_eq!(
        count(format!(
            "{{ pools(siteId: \"{}\", kind: BARE_METAL) {{ totalCount }} }}",
            f.site
        ))
        .await,
        1
    );

    app.ok(
        &op,
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": f.node } }),
    )
    .await;
    assert_eq!(
        count("{ computeNodes(cordoned: true) { totalCount } }".into()).await,
        1
    );
    assert_eq!(
        count("{ computeNodes(hasFreeCapacity: true) { totalCount } }".into()).await,
        1
    );
    assert_eq!(
        count("{ computeNodes(hasFreeCapacity: false) { totalCount } }".into()).await,
        1
    );
    assert_eq!(
        count("{ computeNodes(reachability: CONNECTED) { totalCount } }".into()).await,
        0
    );
    assert_eq!(
        count("{ computeNodes(reachability: DISCONNECTED) { totalCount } }".into()).await,
        2
    );
}

/// One bad input per mutation: each is `BAD_USER_INPUT` naming its field, and writes nothing.
#[tokio::test]
async fn every_mutation_validates_its_input() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "valid").await;
    let dev = f.gpus[0].0.clone();
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "mutation($i: CreateSiteInput!) { createSite(input: $i) { site { id } } }",
            json!({ "name": "" }),
            "name",
        ),
        (
            "mutation($i: UpdateSiteInput!) { updateSite(input: $i) { site { id } } }",
            json!({ "id": f.pool, "version": 1 }),
            "id",
        ),
        (
            "mutation($i: CreatePoolInput!) { createPool(input: $i) { pool { id } } }",
            json!({ "siteId": f.site, "name": "x", "kind": "PROVIDER", "overcommit": { "memory": 101 } }),
            "overcommit.memory",
        ),
        (
            "mutation($i: UpdatePoolInput!) { updatePool(input: $i) { pool { id } } }",
            json!({ "id": f.pool, "version": 1, "lostAfterSeconds": -5 }),
            "lostAfterSeconds",
        ),
        (
            "mutation($i: RegisterNodeInput!) { registerNode(input: $i) { computeNode { id } } }",
            json!({ "poolId": f.pool, "hostname": "Not_A_Host", "resources": { "vcpu": 1, "memoryMib": 1, "diskGib": 1 } }),
            "hostname",
        ),
        (
            "mutation($i: UpdateNodeInput!) { updateNode(input: $i) { computeNode { id } } }",
            json!({ "id": f.node, "version": 1, "labels": [{ "key": "bad key", "value": "v" }] }),
            "labels",
        ),
        (
            "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
            json!({ "id": dev }),
            "id",
        ),
        (
            "mutation($i: NodeActionInput!) { uncordonNode(input: $i) { computeNode { id } } }",
            json!({ "id": "node_1" }),
            "id",
        ),
        (
            "mutation($i: TaintNodeInput!) { taintNode(input: $i) { computeNode { id } } }",
            json!({ "id": f.node, "taint": { "key": "", "effect": "NO_SCHEDULE" } }),
            "taint",
        ),
        (
            "mutation($i: UntaintNodeInput!) { untaintNode(input: $i) { computeNode { id } } }",
            json!({ "id": f.node, "key": "a b" }),
            "key",
        ),
        (
            "mutation($i: NodeActionInput!) { drainNode(input: $i) { computeNode { id } } }",
            json!({ "id": f.site }),
            "id",
        ),
        (
            "mutation($i: NodeActionInput!) { retireNode(input: $i) { computeNode { id } } }",
            json!({ "id": "" }),
            "id",
        ),
        (
            "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { id } } }",
            json!({ "id": f.node, "health": "HEALTHY" }),
            "id",
        ),
        (
            "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { id } } }",
            json!({ "id": dev, "reason": "" }),
            "reason",
        ),
        (
            "mutation($i: UnquarantineDeviceInput!) { unquarantineDevice(input: $i) { device { id } } }",
            json!({ "id": "dev_zz" }),
            "id",
        ),
        (
            "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { id } } }",
            json!({ "id": dev, "version": 1, "mode": "TIME_SLICE", "layout": { "slots": 65 } }),
            "layout",
        ),
        (
            "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { id } } }",
            json!({ "id": dev, "version": 1, "mode": "EXCLUSIVE", "changeWindowSeconds": -1 }),
            "changeWindowSeconds",
        ),
        (
            "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
            json!({ "tenantId": "acme", "scopeId": f.pool, "vcpu": -1 }),
            "vcpu",
        ),
        (
            "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
            json!({ "tenantId": "not a tenant", "scopeId": f.pool, "vcpu": 1 }),
            "tenantId",
        ),
    ];
    // Rows of every fleet table, versions of every node and device, and events, in one number.
    let snapshot = || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT ((SELECT count(*) FROM sites) + (SELECT count(*) FROM pools) + (SELECT count(*) FROM nodes) \
             + (SELECT count(*) FROM devices) + (SELECT count(*) FROM device_atoms) + (SELECT count(*) FROM quota_usage) \
             + (SELECT sum(version) FROM nodes) + (SELECT sum(version) FROM devices) + (SELECT count(*) FROM outbox))::bigint",
        )
        .fetch_one(app.db.db.pool())
        .await
        .expect("snapshot");
        n
    };
    let start = snapshot().await;
    for (mutation, input, field) in cases {
        let (code, error) = app.fails(&op, mutation, json!({ "i": input })).await;
        assert_eq!(code, "BAD_USER_INPUT", "{mutation}: {error}");
        assert_eq!(error["extensions"]["field"], field, "{mutation}: {error}");
        assert_eq!(snapshot().await, start, "{mutation} changed nothing");
    }
}

/// Eligibility is linearizable: a cordon waits for a placement that holds the node row FOR SHARE,
/// and commits after it, so the placement either ran before the cordon or sees it.
#[tokio::test]
async fn a_cordon_waits_for_a_placement_holding_the_node() {
    use sqlx::Connection;
    let app = spawn_app().await;
    let f = small_fleet(&app, "linear").await;
    let mut placement = sqlx::PgConnection::connect(&app.db.url)
        .await
        .expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut placement)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM nodes WHERE id = $1 FOR SHARE")
        .bind(&f.node)
        .execute(&mut placement)
        .await
        .expect("lock the node as placement does");

    let op = app.operator();
    let cordon = {
        let (url, node, op) = (app.url("/graphql"), f.node.clone(), op.clone());
        let http = app.http.clone();
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(op)
                .json(&json!({ "query": "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { cordoned } } }", "variables": { "i": { "id": node } } }))
                .send()
                .await
                .expect("POST")
                .json::<Value>()
                .await
                .expect("json")
        })
    };
    // The cordon is blocked on the row lock (observed, not slept on).
    app.until_lock_waiters(1).await;
    let (cordoned,): (bool,) = sqlx::query_as("SELECT cordoned FROM nodes WHERE id = $1")
        .bind(&f.node)
        .fetch_one(&mut placement)
        .await
        .expect("read");
    assert!(!cordoned, "the placement still sees the node schedulable");
    sqlx::query("COMMIT")
        .execute(&mut placement)
        .await
        .expect("commit");
    let body = cordon.await.expect("join");
    assert_eq!(
        body["data"]["cordonNode"]["computeNode"]["cordoned"], true,
        "{body}"
    );
}

/// Capacity over a window counts the bookings that overlap it, for pools and for sites.
#[tokio::test]
async fn capacity_over_a_window_sees_advance_bookings() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-06-01T00:00:00Z").await;
    let op = app.operator();
    let f = small_fleet(&app, "window").await;
    let (dev, uuid) = f.gpus[0].clone();
    sqlx::query(
        "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
         VALUES ($1, $2, 'alc_later', tstzrange('2031-06-01T10:00:00Z', '2031-06-01T12:00:00Z'))",
    )
    .bind(&uuid)
    .bind(&dev)
    .execute(app.db.db.pool())
    .await
    .expect("advance booking");
    let query = "query($site: ID!, $pool: ID!, $w: WindowInput) { \
        site: node(id: $site) { ... on Site { capacity(window: $w) { model booked free } } } \
        pool: node(id: $pool) { ... on Pool { capacity(window: $w) { model booked free } } } }";
    let h100 = |d: &Value, scope: &str| {
        d[scope]["capacity"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["model"] == "H100").cloned())
            .expect("H100 row")
    };
    let now = app
        .ok(&op, query, json!({ "site": f.site, "pool": f.pool }))
        .await;
    assert_eq!(
        h100(&now, "pool"),
        json!({ "model": "H100", "booked": 0, "free": 1 }),
        "free now"
    );
    let during = json!({ "start": "2031-06-01T11:00:00Z", "end": "2031-06-01T13:00:00Z" });
    let later = app
        .ok(
            &op,
            query,
            json!({ "site": f.site, "pool": f.pool, "w": during }),
        )
        .await;
    for scope in ["site", "pool"] {
        assert_eq!(
            h100(&later, scope),
            json!({ "model": "H100", "booked": 1, "free": 0 }),
            "{scope}"
        );
    }
    let after = json!({ "start": "2031-06-01T12:00:00Z", "end": "2031-06-01T14:00:00Z" });
    let after = app
        .ok(
            &op,
            query,
            json!({ "site": f.site, "pool": f.pool, "w": after }),
        )
        .await;
    assert_eq!(h100(&after, "pool")["free"], 1, "windows are half-open");
    let (code, error) = app
        .fails(&op, query, json!({ "site": f.site, "pool": f.pool, "w": { "start": "2031-06-02T00:00:00Z", "end": "2031-06-01T00:00:00Z" } }))
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("window"))
    );
}

/// The lock order of a pool's rollup rows and its work-queue row, proven with deadlocks not
/// retried (`Db::without_contention_retry`): GPUs of one pool change mode at once in opposite
/// directions (whole GPUs to slots, slots to whole GPUs), round after round. Every change
/// commits on its first attempt, and PostgreSQL counts no deadlock. (Before the fix, a change
/// enqueued the pool's rollup check between removing its old atoms and adding its new ones, and
/// two opposite changes deadlocked on the queue row and a rollup row.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_mode_changes_in_one_pool_never_deadlock() {
    use compute_domain::fleet::changes::{LayoutRequest, change_device_mode};
    use compute_domain::fleet::model::DeviceMode;
    use compute_domain::ids::DeviceId;
    let t = compute_tests::test_db_with(24).await;
    compute_tests::bench::gpu_fleet(&t.db, 1, 4, 4).await;
    let db = t.db.clone().without_contention_retry();
    let deadlocks = || async {
        let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(t.db.pool())
            .await;
        sqlx::query_scalar::<_, i64>(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(t.db.pool())
        .await
        .expect("deadlocks")
    };
    let before = deadlocks().await;
    let layout = |slots: bool| LayoutRequest {
        mode: if slots {
            DeviceMode::TimeSlice
        } else {
            DeviceMode::Exclusive
        },
        mig_profiles: None,
        slots: slots.then_some(4),
    };
    let devices: Vec<(String,)> = sqlx::query_as("SELECT id FROM devices ORDER BY id")
        .fetch_all(t.db.pool())
        .await
        .expect("devices");
    let ids: Vec<DeviceId> = devices
        .iter()
        .map(|(d,)| DeviceId::parse("id", d).expect("id"))
        .collect();
    // Half the GPUs start as slots, so every round has changes both ways.
    for id in ids.iter().step_by(2) {
        let v: i64 = sqlx::query_scalar("SELECT version FROM devices WHERE id = $1")
            .bind(id.as_str())
            .fetch_one(t.db.pool())
            .await
            .expect("version");
        change_device_mode(&db, id, v, layout(true), 0)
            .await
            .expect("to slots");
    }
    let mut changes = 0;
    for round in 0..6 {
        let results = futures_util::future::join_all(ids.iter().enumerate().map(|(i, id)| {
            let db = db.clone();
            let pool = t.db.pool().clone();
            async move {
                let (v, mode): (i64, String) =
                    sqlx::query_as("SELECT version, mode FROM devices WHERE id = $1")
                        .bind(id.as_str())
                        .fetch_one(&pool)
                        .await
                        .expect("device");
                let to_slots = mode == "exclusive";
                change_device_mode(&db, id, v, layout(to_slots), 0)
                    .await
                    .map_err(|e| format!("round {round}, GPU {i}: {e:?}"))
            }
        }))
        .await;
        for r in results {
            r.expect("every change commits at its first attempt");
            changes += 1;
        }
    }
    assert_eq!(changes, 6 * ids.len());
    assert_eq!(
        deadlocks().await - before,
        0,
        "PostgreSQL detected deadlocks"
    );
    // The rollup is exact after it all.
    let pools: Vec<(String,)> = sqlx::query_as("SELECT id FROM pools")
        .fetch_all(t.db.pool())
        .await
        .expect("pools");
    for (p,) in pools {
        let pool = compute_domain::ids::PoolId::parse("id", &p).expect("pool");
        assert_eq!(
            compute_domain::fleet::changes::recompute_rollup(&t.db, &pool)
                .await
                .expect("recompute"),
            0,
            "the rollup drifted"
        );
    }
}

/// A retired GPU, and every GPU of a retired node, accept no change: each is `CONFLICT`, and the
/// pool's capacity does not move. Retiring a retired node's GPU counted its atoms out of the
/// rollup a second time (`INTERNAL` on the rollup's check when it was the pool's last such GPU),
/// and a mode change gave a retired GPU atoms in capacity again.
#[tokio::test]
async fn retired_gpus_and_the_gpus_of_a_retired_node_accept_no_change() {
    let app = spawn_app().await;
    let op = app.operator();
    let f = small_fleet(&app, "ret").await;
    let capacity = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(sum(atoms), 0)::bigint FROM pool_capacity_rollup WHERE pool_id = $1",
        )
        .bind(&f.pool)
        .fetch_one(app.db.db.pool())
        .await
        .expect("capacity")
    };
    let events = || app.count("outbox");
    let (h100, l4) = (f.gpus[0].0.clone(), f.gpus[2].0.clone());
    let retired = app
        .ok(
            &op,
            "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { retiredAt version } } }",
            json!({ "i": { "id": h100 } }),
        )
        .await["retireDevice"]["device"]
        .clone();
    let version = retired["version"].clone();
    let (before, before_events) = (capacity().await, events().await);
    let on_retired = [
        (
            "changeDeviceMode",
            "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { id } } }",
            json!({ "i": { "id": h100, "version": version, "mode": "TIME_SLICE", "layout": { "slots": 8 } } }),
        ),
        (
            "quarantineDevice",
            "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { id } } }",
            json!({ "i": { "id": h100, "reason": "burn-in" } }),
        ),
        (
            "setDeviceHealth",
            "mutation($i: SetDeviceHealthInput!) { setDeviceHealth(input: $i) { device { id } } }",
            json!({ "i": { "id": h100, "health": "UNHEALTHY", "reason": "fan" } }),
        ),
    ];
    for (what, doc, vars) in &on_retired {
        let (code, body) = app.fails(&op, doc, vars.clone()).await;
        assert_eq!(code, "CONFLICT", "{what}: {body}");
        assert!(body.to_string().contains("retired"), "{what}: {body}");
    }
    assert_eq!(capacity().await, before, "capacity unchanged");
    assert_eq!(events().await, before_events, "no event");

    // The node goes; its last time-sliced GPU is not counted out twice.
    app.ok(
        &op,
        "mutation($i: NodeActionInput!) { retireNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": f.node } }),
    )
    .await;
    let (after_node, node_events) = (capacity().await, events().await);
    for (what, doc, vars) in [
        (
            "retireDevice",
            "mutation($i: RetireDeviceInput!) { retireDevice(input: $i) { device { id } } }",
            json!({ "i": { "id": l4 } }),
        ),
        (
            "quarantineDevice",
            "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { id } } }",
            json!({ "i": { "id": l4, "reason": "burn-in" } }),
        ),
    ] {
        let (code, body) = app.fails(&op, doc, vars).await;
        assert_eq!(code, "CONFLICT", "{what}: {body}");
        assert!(
            body.to_string().contains("retired compute node"),
            "{what}: {body}"
        );
    }
    assert_eq!(capacity().await, after_node, "capacity unchanged");
    assert_eq!(events().await, node_events, "no event");
}

/// A node has one taint per key and effect: registering two is refused where it enters.
#[tokio::test]
async fn a_registration_with_two_taints_of_one_key_and_effect_is_refused() {
    let app = spawn_app().await;
    let (_, pool) = site_with_pool(
        &app,
        "taints",
        json!({ "name": "gpu", "kind": "BARE_METAL" }),
    )
    .await;
    let (code, body) = app
        .fails(
            &app.operator(),
            REGISTER,
            json!({ "i": { "poolId": pool, "hostname": "twice",
                "taints": [{ "key": "gpu", "value": "a", "effect": "NO_SCHEDULE" }, { "key": "gpu", "value": "b", "effect": "NO_SCHEDULE" }],
                "resources": { "vcpu": 8, "memoryMib": 8192, "diskGib": 100 },
                "devices": [{ "uuid": "GPU-twice-0", "model": "H100", "memoryMib": 81559 }] } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{body}");
    assert_eq!(body["extensions"]["field"], "taints", "{body}");
    assert_eq!(app.count("nodes").await, 0, "nothing written");
}
