//! Reservations through GraphQL: placement, quotas, idempotency and the lifecycle.

use compute_tests::{TestApp, spawn_app};
use serde_json::{Value, json};

use crate::fleet::{CREATE_SITE, REGISTER};

pub const CREATE: &str = "mutation($i: CreateReservationInput!) { createReservation(input: $i) { idempotentReplay placementRetries \
    reservation { id state startsAt endsAt gpuCharge version conditions { type reason message counts { reason count } } \
    allocations { id gpuKind gpuCount atoms computeNodeId } } } }";
const EXTEND: &str = "mutation($i: ExtendReservationInput!) { extendReservation(input: $i) { idempotentReplay reservation { id state endsAt version } } }";
const RELEASE: &str = "mutation($i: ReservationActionInput!) { releaseReservation(input: $i) { reservation { id state endedAt version } } }";
const CANCEL: &str = "mutation($i: ReservationActionInput!) { cancelReservation(input: $i) { reservation { id state version } } }";

/// A pool with two H100 nodes (2 GPUs each, one tainted), one A100 node with a MIG GPU and a
/// 4-slot GPU, and a quota of 8 GPUs and 64 vCPU for tenant `acme`.
pub struct Pool {
    pub pool: String,
    pub site: String,
    pub nodes: Vec<String>,
}

pub async fn pool(app: &TestApp) -> Pool {
    let op = app.operator();
    let (site, pool) = crate::fleet::site_with_pool(
        app,
        "rsv-site",
        json!({ "name": "gpu", "kind": "BARE_METAL" }),
    )
    .await;
    let mut nodes = Vec::new();
    for (host, taints, devices) in [
        (
            "h100-a",
            json!([]),
            json!([{ "uuid": "GPU-A0", "model": "H100", "memoryMib": 81559 }, { "uuid": "GPU-A1", "model": "H100", "memoryMib": 81559 }]),
        ),
        (
            "h100-b",
            json!([{ "key": "dedicated", "value": "train", "effect": "NO_SCHEDULE" }]),
            json!([{ "uuid": "GPU-B0", "model": "H100", "memoryMib": 81559 }, { "uuid": "GPU-B1", "model": "H100", "memoryMib": 81559 }]),
        ),
        (
            "a100-c",
            json!([]),
            json!([
                { "uuid": "GPU-C0", "model": "A100", "memoryMib": 81920, "mode": "MIG", "layout": { "migProfiles": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"] } },
                { "uuid": "GPU-C1", "model": "A100", "memoryMib": 81920, "mode": "TIME_SLICE", "layout": { "slots": 4 } }
            ]),
        ),
    ] {
        let d = app
            .ok(&op, REGISTER, json!({ "i": { "poolId": pool, "hostname": host, "taints": taints,
                "labels": [{ "key": "host", "value": host }],
                "resources": { "vcpu": 32, "memoryMib": 262144, "diskGib": 1000 }, "devices": devices } }))
            .await;
        nodes.push(
            d["registerNode"]["computeNode"]["id"]
                .as_str()
                .expect("node")
                .to_owned(),
        );
    }
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": pool, "gpus": 8, "vcpu": 64 } }),
    )
    .await;
    Pool { pool, site, nodes }
}

/// Gives `tenant` a quota of 8 GPUs and 64 vCPU on `pool`, as [`pool`] gives acme.
pub async fn quota_for(app: &TestApp, tenant: &str, pool: &str) {
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": tenant, "scopeId": pool, "gpus": 8, "vcpu": 64 } }),
    )
    .await;
}

pub fn input(pool: &str, key: &str, allocations: Value) -> Value {
    json!({ "i": { "poolId": pool, "endsAt": "2031-01-01T02:00:00Z", "allocations": allocations, "idempotencyKey": key } })
}

async fn used(app: &TestApp, resource: &str) -> f64 {
    let (u,): (f64,) = sqlx::query_as(
        "SELECT used::float8 FROM quota_usage WHERE tenant_id = 'acme' AND resource = $1",
    )
    .bind(resource)
    .fetch_one(app.db.db.pool())
    .await
    .expect("quota");
    u
}

async fn allocated_vcpu(app: &TestApp) -> i64 {
    let (n,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(allocated), 0)::bigint FROM node_resources WHERE resource = 'vcpu'",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("allocated");
    n
}

async fn setup() -> (TestApp, Pool, String) {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let member = app.member("acme");
    (app, p, member)
}

#[tokio::test]
async fn a_reservation_is_placed_charged_and_released() {
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "k1",
                json!([{ "gpuCount": 1, "model": "H100", "vcpu": 8, "memoryMib": 65536 }]),
            ),
        )
        .await;
    let r = &d["createReservation"]["reservation"];
    assert_eq!(r["state"], "ACTIVE");
    assert_eq!(r["gpuCharge"], 1.0);
    assert_eq!(d["createReservation"]["idempotentReplay"], false);
    let alloc = &r["allocations"][0];
    assert_eq!(
        alloc["computeNodeId"],
        p.nodes[0].as_str(),
        "the untainted H100 node"
    );
    assert_eq!(alloc["atoms"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        (used(&app, "gpu").await, used(&app, "vcpu").await),
        (1.0, 8.0)
    );
    assert_eq!(allocated_vcpu(&app).await, 8);
    assert_eq!(
        app.count("outbox WHERE type = 'reservation.active' AND tenant_id = 'acme'")
            .await,
        1
    );

    app.db.advance_clock(600).await;
    let id = r["id"].clone();
    let d = app.ok(&member, RELEASE, json!({ "i": { "id": id } })).await;
    assert_eq!(d["releaseReservation"]["reservation"]["state"], "RELEASED");
    assert_eq!(
        d["releaseReservation"]["reservation"]["endedAt"],
        "2031-01-01T00:10:00+00:00"
    );
    assert_eq!(
        (used(&app, "gpu").await, used(&app, "vcpu").await),
        (0.0, 0.0),
        "quota refunded"
    );
    assert_eq!(allocated_vcpu(&app).await, 0, "scalars refunded");
    let (upper,): (String,) =
        sqlx::query_as("SELECT upper(during)::text FROM device_bookings WHERE allocation_id = $1")
            .bind(alloc["id"].as_str())
            .fetch_one(app.db.db.pool())
            .await
            .expect("booking");
    assert_eq!(
        upper, "2031-01-01 00:10:00+00",
        "the booking ends at the release"
    );
    let (code, error) = app
        .fails(&member, RELEASE, json!({ "i": { "id": id } }))
        .await;
    assert_eq!(code, "CONFLICT", "released is terminal: {error}");
}

#[tokio::test]
async fn advance_reservations_share_an_atom_without_overlapping() {
    let (app, p, member) = setup().await;
    let want = json!([{ "gpuCount": 2, "model": "H100" }]);
    let window = |start: &str, end: &str, key: &str| json!({ "i": { "poolId": p.pool, "startsAt": start, "endsAt": end, "allocations": want, "idempotencyKey": key } });
    let first = app
        .ok(
            &member,
            CREATE,
            window("2031-01-01T04:00:00Z", "2031-01-01T06:00:00Z", "a"),
        )
        .await;
    let second = app
        .ok(
            &member,
            CREATE,
            window("2031-01-01T06:00:00Z", "2031-01-01T08:00:00Z", "b"),
        )
        .await;
    let atoms =
        |d: &Value| d["createReservation"]["reservation"]["allocations"][0]["atoms"].clone();
    assert_eq!(
        first["createReservation"]["reservation"]["state"],
        "SCHEDULED"
    );
    assert_eq!(atoms(&first), json!(["GPU-A0", "GPU-A1"]));
    assert_eq!(
        atoms(&second),
        atoms(&first),
        "back to back on the same atoms"
    );
    // An overlapping third cannot have them; the tainted node is not tolerated, so it waits.
    let third = app
        .ok(
            &member,
            CREATE,
            window("2031-01-01T05:00:00Z", "2031-01-01T07:00:00Z", "c"),
        )
        .await;
    let r = &third["createReservation"]["reservation"];
    assert_eq!(r["state"], "PENDING");
    assert_eq!(r["conditions"][0]["type"], "Unschedulable");
    let why = r["conditions"][0]["message"].as_str().unwrap_or("");
    assert!(
        why.contains("no schedulable node in pool gpu has 2 H100 GPUs free"),
        "{why}"
    );
    // Why, node by node, counted by the search that looked: the untainted H100 node has its
    // GPUs booked over the window, the tainted one is not tolerated, the A100 node has no H100.
    assert!(
        why.ends_with(
            "0/3 nodes fit (2 without 2 H100 GPUs free over the window, 1 with an untolerated taint)"
        ),
        "{why}"
    );
    assert_eq!(
        r["conditions"][0]["counts"],
        json!([
            { "reason": "InsufficientGpus", "count": 2 },
            { "reason": "TaintNotTolerated", "count": 1 }
        ])
    );
    assert_eq!(
        used(&app, "gpu").await,
        6.0,
        "a pending reservation holds its quota"
    );
    // Cancelling the pending one gives its quota back.
    let d = app
        .ok(&member, CANCEL, json!({ "i": { "id": r["id"] } }))
        .await;
    assert_eq!(d["cancelReservation"]["reservation"]["state"], "CANCELLED");
    assert_eq!(used(&app, "gpu").await, 4.0);
    // Cancelling a scheduled one frees its atoms.
    let id = first["createReservation"]["reservation"]["id"].clone();
    app.ok(&member, CANCEL, json!({ "i": { "id": id } })).await;
    let (n,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM device_bookings WHERE allocation_id = $1")
            .bind(first["createReservation"]["reservation"]["allocations"][0]["id"].as_str())
            .fetch_one(app.db.db.pool())
            .await
            .expect("bookings");
    assert_eq!(n, 0, "a cancelled advance reservation keeps no booking");
}

#[tokio::test]
async fn mig_instances_slots_tolerations_and_selectors_place_where_they_should() {
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "mig",
                json!([{ "gpuKind": "MIG", "profile": "1g.10gb", "gpuCount": 2 }]),
            ),
        )
        .await;
    let r = &d["createReservation"]["reservation"];
    assert_eq!(
        r["allocations"][0]["atoms"],
        json!(["GPU-C0/mig/2", "GPU-C0/mig/3"])
    );
    assert_eq!(r["gpuCharge"], 0.285714, "2 × 1/7 of a GPU");
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "slots",
                json!([{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 3 }]),
            ),
        )
        .await;
    assert_eq!(
        d["createReservation"]["reservation"]["allocations"][0]["atoms"],
        json!(["GPU-C1/s0", "GPU-C1/s1", "GPU-C1/s2"])
    );
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "tol",
                json!([{ "gpuCount": 1, "model": "H100",
            "nodeSelector": [{ "key": "host", "value": "h100-b" }],
            "tolerations": [{ "key": "dedicated", "effect": "NO_SCHEDULE" }] }]),
            ),
        )
        .await;
    assert_eq!(
        d["createReservation"]["reservation"]["allocations"][0]["computeNodeId"],
        p.nodes[1].as_str()
    );
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "sel",
                json!([{ "gpuCount": 1, "nodeSelector": [{ "key": "host", "value": "h100-b" }] }]),
            ),
        )
        .await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "PENDING",
        "a selector without the toleration"
    );
    // Cordoning the only untainted H100 node leaves nowhere for whole H100s.
    let op = app.operator();
    app.ok(
        &op,
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": p.nodes[0] } }),
    )
    .await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "cordoned",
                json!([{ "gpuCount": 1, "model": "H100" }]),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "PENDING");
    // Each node of the pool is counted once, by the first reason that rules it out (ties by
    // reason name).
    assert_eq!(
        d["createReservation"]["reservation"]["conditions"][0]["counts"],
        json!([
            { "reason": "InsufficientGpus", "count": 1 },
            { "reason": "NodeCordoned", "count": 1 },
            { "reason": "TaintNotTolerated", "count": 1 }
        ]),
        "{d}"
    );
}

#[tokio::test]
async fn quota_is_final_and_replayed_and_writes_nothing() {
    let (app, p, member) = setup().await;
    let (rows, events) = (app.count("reservations").await, app.count("outbox").await);
    let too_many = input(&p.pool, "big", json!([{ "gpuCount": 9 }]));
    let (code, error) = app.fails(&member, CREATE, too_many.clone()).await;
    assert_eq!(code, "QUOTA_EXCEEDED", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("would hold 9 of its 8 GPUs"),
        "{error}"
    );
    assert_eq!(
        (app.count("reservations").await, app.count("outbox").await),
        (rows, events)
    );
    assert_eq!(used(&app, "gpu").await, 0.0);
    // A repeat gets the same answer even after the quota was raised: the first answer is final.
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 10 } }),
    )
    .await;
    let (code, _) = app.fails(&member, CREATE, too_many).await;
    assert_eq!(code, "QUOTA_EXCEEDED", "replayed");
    // A site quota limits too.
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.site, "vcpu": 4 } }),
    )
    .await;
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "cpu", json!([{ "gpuCount": 1, "vcpu": 8 }])),
        )
        .await;
    assert_eq!(code, "QUOTA_EXCEEDED");
    assert!(
        error["message"].as_str().unwrap_or("").contains("site"),
        "{error}"
    );
}

/// The edges a create or an extension may reach: a start at most 366 days ahead, an end
/// moved by less than a microsecond (no move: PostgreSQL keeps microseconds), and a request for
/// none of a resource whose limit was lowered below what the tenant holds of it.
#[tokio::test]
async fn a_far_start_a_sub_microsecond_extension_and_a_zero_ask_under_a_lowered_limit() {
    let (app, p, member) = setup().await;
    let at = |key: &str, starts: &str, ends: &str| {
        json!({ "i": { "poolId": p.pool, "startsAt": starts, "endsAt": ends,
            "allocations": [{ "gpuCount": 1 }], "idempotencyKey": key } })
    };
    let (rows, events) = (app.count("reservations").await, app.count("outbox").await);
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            at("far", "2032-01-03T00:00:00Z", "2032-01-03T01:00:00Z"),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{error}");
    assert_eq!(error["extensions"]["field"], "startsAt", "{error}");
    assert_eq!(
        (app.count("reservations").await, app.count("outbox").await),
        (rows, events),
        "nothing written"
    );
    assert_eq!(used(&app, "gpu").await, 0.0, "nothing charged");
    app.ok(
        &member,
        CREATE,
        at("near", "2031-12-30T00:00:00Z", "2031-12-30T01:00:00Z"),
    )
    .await;

    let made = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "now", json!([{ "gpuCount": 1, "vcpu": 8 }])),
        )
        .await;
    let id = made["createReservation"]["reservation"]["id"].clone();
    let version = made["createReservation"]["reservation"]["version"].clone();
    let events = app.count("outbox").await;
    let (code, error) = app
        .fails(&member, EXTEND, json!({ "i": { "id": id, "endsAt": "2031-01-01T02:00:00.0000005Z", "idempotencyKey": "half-a-microsecond" } }))
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{error}");
    assert_eq!(app.count("outbox").await, events, "no event");
    let (now_version,): (i64,) = sqlx::query_as("SELECT version FROM reservations WHERE id = $1")
        .bind(id.as_str())
        .fetch_one(app.db.db.pool())
        .await
        .expect("the reservation");
    assert_eq!(json!(now_version), version, "unchanged");

    // acme holds 8 vCPU; its limit goes down to 4. More vCPU is refused, none is not.
    app.ok(
        &app.operator(),
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "vcpu": 4 } }),
    )
    .await;
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "more-cpu", json!([{ "gpuCount": 1, "vcpu": 1 }])),
        )
        .await;
    assert_eq!(code, "QUOTA_EXCEEDED", "{error}");
    let gpu_only = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "no-cpu", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(
        gpu_only["createReservation"]["reservation"]["state"], "ACTIVE",
        "{gpu_only}"
    );
    assert_eq!(used(&app, "vcpu").await, 8.0, "nothing more charged");
}

/// Another tenant's reservation is NOT_FOUND however busy it is: the caller's tenant is part of
/// the lookup, so a row it may not see is neither locked nor waited for (a wait ended in
/// `LOCK_TIMEOUT`, which told that the id exists).
#[tokio::test]
async fn another_tenants_busy_reservation_is_not_found_at_once() {
    let (app, p, member) = setup().await;
    let made = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "busy", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let id = made["createReservation"]["reservation"]["id"].clone();
    let allocation = made["createReservation"]["reservation"]["allocations"][0]["id"].clone();
    let mut holder = app.db.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM reservations WHERE id = $1 FOR UPDATE")
        .bind(id.as_str())
        .execute(&mut *holder)
        .await
        .expect("acme's row, held");
    let globex = app.member("globex");
    for (what, doc, vars) in [
        ("cancel", CANCEL, json!({ "i": { "id": id } })),
        (
            "extend",
            EXTEND,
            json!({ "i": { "id": id, "endsAt": "2031-01-01T05:00:00Z", "idempotencyKey": "x" } }),
        ),
        (
            "createInstance",
            "mutation($i: CreateInstanceInput!) { createInstance(input: $i) { instance { id } } }",
            json!({ "i": { "allocationId": allocation, "image": "x", "idempotencyKey": "i" } }),
        ),
    ] {
        // A wait for the held row would end in LOCK_TIMEOUT.
        let (code, error) = app.fails(&globex, doc, vars).await;
        assert_eq!(code, "NOT_FOUND", "{what}: {error}");
    }
    holder.rollback().await.expect("rollback");
}

/// A limit set where the tenant already holds something starts from what it holds: acme holds
/// 2 GPUs and 8 vCPU on the pool when its site gets a limit of 3 GPUs, so one more GPU fits and
/// a second does not; the release of a reservation made before the limit gives its share back.
/// (The row started at 0, and acme could have taken 3 more.)
#[tokio::test]
async fn a_new_limit_counts_what_the_tenant_already_holds_and_an_end_refunds_it() {
    let (app, p, member) = setup().await;
    let mut held = Vec::new();
    for key in ["a", "b"] {
        let made = app
            .ok(
                &member,
                CREATE,
                input(&p.pool, key, json!([{ "gpuCount": 1, "vcpu": 4 }])),
            )
            .await;
        held.push(made["createReservation"]["reservation"]["id"].clone());
    }
    let set = app
        .ok(
            &app.operator(),
            "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { resource max used } } }",
            json!({ "i": { "tenantId": "acme", "scopeId": p.site, "gpus": 3, "vcpu": 100 } }),
        )
        .await;
    assert_eq!(
        set["setQuota"]["quotas"],
        json!([
            { "resource": "GPUS", "max": 3.0, "used": 2.0 },
            { "resource": "VCPU", "max": 100.0, "used": 8.0 }
        ]),
        "{set}"
    );
    app.ok(
        &member,
        CREATE,
        input(&p.pool, "c", json!([{ "gpuCount": 1 }])),
    )
    .await;
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "d", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(code, "QUOTA_EXCEEDED", "{error}");
    assert!(
        error["message"].as_str().unwrap_or("").contains("site"),
        "{error}"
    );
    app.ok(&member, RELEASE, json!({ "i": { "id": held[0] } }))
        .await;
    // The site's rows hold exactly what the live reservations were charged on them.
    let rows: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT q.resource, q.used::float8, \
                coalesce((SELECT sum((c->>'amount')::float8) FROM reservations r, jsonb_array_elements(r.charged) c \
                           WHERE r.tenant_id = q.tenant_id AND r.state IN ('pending', 'scheduled', 'active') \
                             AND c->>'scope_kind' = 'site' AND c->>'scope_id' = q.scope_id AND c->>'resource' = q.resource), 0) \
           FROM quota_usage q WHERE q.tenant_id = 'acme' AND q.scope_kind = 'site' ORDER BY q.resource",
    )
    .fetch_all(app.db.db.pool())
    .await
    .expect("the site's rows");
    assert_eq!(
        rows,
        [("gpu".to_owned(), 2.0, 2.0), ("vcpu".to_owned(), 4.0, 4.0)],
        "b and c hold the site's GPUs; b its vCPU"
    );
    // Migration 0044 repairs a row the old `setQuota` made: the site's GPU row as it would have
    // been (nothing charged on it), then the migration's repair, run again.
    let pool = app.db.db.pool();
    sqlx::query(
        "WITH gone AS (UPDATE reservations r SET charged = (SELECT coalesce(jsonb_agg(c), '[]') FROM jsonb_array_elements(r.charged) c \
                                                          WHERE NOT (c->>'scope_kind' = 'site' AND c->>'resource' = 'gpu')) \
                        WHERE r.tenant_id = 'acme' RETURNING 1) \
         UPDATE quota_usage SET used = 0 WHERE tenant_id = 'acme' AND scope_kind = 'site' AND resource = 'gpu'",
    )
    .execute(pool)
    .await
    .expect("the row as the old setQuota left it");
    let migration = include_str!("../../../migrations/0044_new_quota_counts_holdings.sql");
    let repair = &migration[..migration
        .find("CREATE OR REPLACE FUNCTION")
        .expect("the function after the repair")];
    sqlx::raw_sql(repair)
        .execute(pool)
        .await
        .expect("the repair");
    let (used, entries): (f64, i64) = sqlx::query_as(
        "SELECT (SELECT used::float8 FROM quota_usage WHERE tenant_id = 'acme' AND scope_kind = 'site' AND resource = 'gpu'), \
                (SELECT count(*) FROM reservations r, jsonb_array_elements(r.charged) c \
                  WHERE r.tenant_id = 'acme' AND r.state IN ('pending', 'scheduled', 'active') \
                    AND c->>'scope_kind' = 'site' AND c->>'resource' = 'gpu')",
    )
    .fetch_one(pool)
    .await
    .expect("repaired");
    assert_eq!(
        (used, entries),
        (2.0, 2),
        "b and c charged to the row again"
    );
    // A create in flight (here a transaction holding the tenant's quota lock shared, as every
    // create does while it charges) holds back a new limit until it commits, so the count
    // cannot miss what it charges.
    let mut in_flight = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock_shared(hashtextextended('quota:acme', 0))")
        .execute(&mut *in_flight)
        .await
        .expect("shared");
    let release = async {
        compute_tests::until_one_waits_for_an_advisory_lock(
            pool,
            "the new limit waits for the create",
        )
        .await;
        in_flight.commit().await.expect("commit");
    };
    let operator = app.operator();
    let (set, ()) = tokio::join!(
        app.graphql(
            "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { resource used } } }",
            json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "memoryMib": 1048576 } }),
            Some(&operator),
        ),
        release
    );
    assert_eq!(
        set.1["data"]["setQuota"]["quotas"][0]["resource"], "MEMORY_MIB",
        "{}",
        set.1
    );
}

#[tokio::test]
async fn idempotency_keys_have_exact_semantics() {
    let (app, p, member) = setup().await;
    let req = input(&p.pool, "same", json!([{ "gpuCount": 1, "model": "H100" }]));
    let first = app.ok(&member, CREATE, req.clone()).await;
    // The reply is lost; the client sends the same request again.
    let (status, again) = app.graphql(CREATE, req.clone(), Some(&member)).await;
    assert_eq!(status, 200);
    assert_eq!(again["extensions"]["idempotentReplay"], true, "{again}");
    assert_eq!(again["data"]["createReservation"]["idempotentReplay"], true);
    assert_eq!(
        again["data"]["createReservation"]["reservation"]["id"],
        first["createReservation"]["reservation"]["id"]
    );
    assert_eq!(app.count("reservations").await, 1, "one effect");
    assert_eq!(used(&app, "gpu").await, 1.0, "charged once");

    let other_args = input(&p.pool, "same", json!([{ "gpuCount": 2, "model": "H100" }]));
    let (code, _) = app.fails(&member, CREATE, other_args).await;
    assert_eq!(code, "IDEMPOTENCY_KEY_REUSED");
    let colleague = app.token("bob@acme", Some("acme"), &[compute_api::auth::Role::Member]);
    let theirs = app.ok(&colleague, CREATE, req.clone()).await;
    assert_ne!(
        theirs["createReservation"]["reservation"]["id"],
        first["createReservation"]["reservation"]["id"],
        "keys are per identity"
    );

    // A repeat while the first still runs: the key's row is held by an open transaction.
    let mut holder = sqlx::PgConnection::connect_with_url(&app.db.url).await;
    sqlx::raw_sql("BEGIN; INSERT INTO idempotency_keys (tenant_id, subject, key, operation, fingerprint) VALUES ('acme', 'alice@acme', 'busy', 'createReservation', '{}')")
        .execute(&mut holder)
        .await
        .expect("hold");
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "busy", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(code, "IDEMPOTENCY_IN_PROGRESS", "{error}");
    assert_eq!(error["extensions"]["retryable"], true);
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release");
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("idempotencyKey"))
    );
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM idempotency_keys WHERE key = ''")
        .fetch_one(app.db.db.pool())
        .await
        .expect("keys");
    assert_eq!(n, 0, "nothing stored for a request refused by validation");
}

trait ConnectWithUrl {
    async fn connect_with_url(url: &str) -> sqlx::PgConnection;
}

impl ConnectWithUrl for sqlx::PgConnection {
    async fn connect_with_url(url: &str) -> sqlx::PgConnection {
        use sqlx::Connection;
        sqlx::PgConnection::connect(url).await.expect("connect")
    }
}

#[tokio::test]
async fn extend_grows_every_booking_or_none() {
    let (app, p, member) = setup().await;
    let a = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "a", json!([{ "gpuCount": 2, "model": "H100" }])),
        )
        .await;
    let a_id = a["createReservation"]["reservation"]["id"].clone();
    let b = app
        .ok(&member, CREATE, json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T03:00:00Z", "endsAt": "2031-01-01T04:00:00Z",
            "allocations": [{ "gpuCount": 1, "model": "H100" }], "idempotencyKey": "b" } }))
        .await;
    let b_alloc = b["createReservation"]["reservation"]["allocations"][0]["id"]
        .as_str()
        .expect("alloc")
        .to_owned();
    let d = app.ok(&member, EXTEND, json!({ "i": { "id": a_id, "endsAt": "2031-01-01T03:00:00Z", "idempotencyKey": "e1" } })).await;
    assert_eq!(
        d["extendReservation"]["reservation"]["endsAt"],
        "2031-01-01T03:00:00+00:00"
    );
    let (code, error) = app
        .fails(&member, EXTEND, json!({ "i": { "id": a_id, "endsAt": "2031-01-01T05:00:00Z", "idempotencyKey": "e2" } }))
        .await;
    assert_eq!(code, "CONFLICT");
    assert!(
        error["message"].as_str().unwrap_or("").contains(&b_alloc),
        "names the blocker: {error}"
    );
    // Another tenant's booking blocks too, and is not named: its id is that tenant's.
    let globex = app.member("globex");
    let g = app
        .ok(&globex, CREATE, json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T04:00:00Z", "endsAt": "2031-01-01T05:00:00Z",
            "allocations": [{ "gpuCount": 2, "model": "H100" }], "idempotencyKey": "g" } }))
        .await;
    let g_alloc = g["createReservation"]["reservation"]["allocations"][0]["id"]
        .as_str()
        .expect("alloc")
        .to_owned();
    let (code, error) = app
        .fails(&member, EXTEND, json!({ "i": { "id": a_id, "endsAt": "2031-01-01T05:00:00Z", "idempotencyKey": "e3" } }))
        .await;
    assert_eq!(code, "CONFLICT");
    let message = error["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&format!("by your allocation {b_alloc}")),
        "{message}"
    );
    assert!(
        message
            .contains("is booked from 2031-01-01T04:00:00+00:00 by another tenant's reservation"),
        "{message}"
    );
    assert!(!message.contains(&g_alloc), "{message}");
    let (uppers,): (Vec<String>,) = sqlx::query_as(
        "SELECT array_agg(upper(b.during)::text) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = $1",
    )
    .bind(a_id.as_str())
    .fetch_one(app.db.db.pool())
    .await
    .expect("bookings");
    assert_eq!(
        uppers,
        vec!["2031-01-01 03:00:00+00", "2031-01-01 03:00:00+00"],
        "none grew"
    );
    let d = app.ok(&member, EXTEND, json!({ "i": { "id": a_id, "endsAt": "2031-01-01T03:00:00Z", "idempotencyKey": "e1" } })).await;
    assert_eq!(d["extendReservation"]["idempotentReplay"], true);
}

#[tokio::test]
async fn tenants_see_only_their_own_reservations() {
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "k", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let other = app.member("globex");
    for (query, vars) in [
        (
            "query($id: ID!) { reservation(id: $id) { id } }",
            json!({ "id": id }),
        ),
        (
            "query($id: ID!) { node(id: $id) { id } }",
            json!({ "id": id }),
        ),
        (RELEASE, json!({ "i": { "id": id } })),
        (CANCEL, json!({ "i": { "id": id } })),
    ] {
        let (code, _) = app.fails(&other, query, vars).await;
        assert_eq!(code, "NOT_FOUND", "{query}");
    }
    let d = app
        .ok(&other, "{ reservations { totalCount } }", json!({}))
        .await;
    assert_eq!(d["reservations"]["totalCount"], 0);
    let d = app.ok(&member, "{ reservations(state: ACTIVE) { totalCount edges { node { id allocations { computeNode { id } } } } } }", json!({})).await;
    assert_eq!(d["reservations"]["totalCount"], 1);
    assert_eq!(
        d["reservations"]["edges"][0]["node"]["allocations"][0]["computeNode"],
        Value::Null,
        "members do not see nodes"
    );
    let d = app
        .ok(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { ... on Reservation { tenantId state } } }",
            json!({ "id": id }),
        )
        .await;
    assert_eq!(d["node"], json!({ "tenantId": "acme", "state": "ACTIVE" }));
    let node_token = app.token("daemon", None, &[compute_api::auth::Role::Node]);
    let (code, _) = app
        .fails(
            &node_token,
            CREATE,
            input(&p.pool, "n", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(code, "FORBIDDEN");
}

#[tokio::test]
async fn a_held_quota_row_is_lock_timeout_and_nothing_is_written() {
    let (app, p, member) = setup().await;
    let mut holder = sqlx::PgConnection::connect_with_url(&app.db.url).await;
    sqlx::raw_sql("BEGIN; SELECT * FROM quota_usage FOR UPDATE")
        .execute(&mut holder)
        .await
        .expect("hold");
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "slow", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(code, "LOCK_TIMEOUT", "{error}");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release");
    assert_eq!(app.count("reservations").await, 0);
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "slow", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(
        d["createReservation"]["idempotentReplay"], false,
        "a lock timeout is not stored: the retry runs"
    );
}

async fn state_of(app: &TestApp, id: &Value) -> String {
    let d = app
        .ok(
            &app.operator(),
            "query($id: ID!) { reservation(id: $id) { state } }",
            json!({ "id": id }),
        )
        .await;
    d["reservation"]["state"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A pending reservation's retry that finds the same reason changes only `nextAttemptAt`: no
/// version, no event (a tenant's `expectedVersion` stays good). A retry that finds another
/// reason (a node cordoned in between) is a change like any other: the condition, `version` and
/// a `reservation.conditions_changed` event.
#[tokio::test]
async fn a_pending_reservations_condition_changes_with_a_version_and_an_event_and_only_then() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    // Three H100s: the untainted node has two, the other's taint is not tolerated.
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "three",
                json!([{ "gpuCount": 3, "model": "H100" }]),
            ),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    const READ: &str = "query($id: ID!) { reservation(id: $id) { state version updatedAt nextAttemptAt \
        conditions { type reason since counts { reason count } } } }";
    let read = || async { app.ok(&member, READ, json!({ "id": id })).await["reservation"].clone() };
    let changes = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox WHERE type = 'reservation.conditions_changed' AND subject = $1",
        )
        .bind(id.as_str())
        .fetch_one(app.db.db.pool())
        .await
        .expect("events")
    };
    let first = read().await;
    assert_eq!(first["state"], "PENDING");
    assert_eq!(first["conditions"][0]["type"], "Unschedulable");
    let db = &app.db.db;
    app.db.advance_clock(45).await;
    assert_eq!(reconcile::retry_pending(db).await.expect("retry"), 0);
    let same = read().await;
    assert_ne!(
        same["nextAttemptAt"], first["nextAttemptAt"],
        "tried again later"
    );
    assert_eq!(
        (&same["version"], &same["updatedAt"], &same["conditions"]),
        (&first["version"], &first["updatedAt"], &first["conditions"]),
        "the same reason is no change"
    );
    assert_eq!(changes().await, 0);
    // The untainted node cordoned: another reason.
    app.ok(
        &app.operator(),
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": p.nodes[0] } }),
    )
    .await;
    app.db.advance_clock(45).await;
    assert_eq!(reconcile::retry_pending(db).await.expect("retry"), 0);
    let other = read().await;
    assert_eq!(
        other["version"].as_i64(),
        first["version"].as_i64().map(|v| v + 1)
    );
    assert!(
        other["conditions"][0]["counts"]
            .as_array()
            .expect("counts")
            .iter()
            .any(|c| c["reason"] == "NodeCordoned"),
        "{other}"
    );
    assert_ne!(other["updatedAt"], first["updatedAt"]);
    assert_eq!(changes().await, 1);
}

/// Time moves reservations: the reconcilers' steps, stepped with the simulated clock.
#[tokio::test]
async fn time_starts_expires_and_retries_reservations() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let create = |start: Option<&str>, end: &str, key: &str, alloc: Value| {
        let mut i = json!({ "i": { "poolId": p.pool, "endsAt": end, "allocations": [alloc], "idempotencyKey": key } });
        if let Some(s) = start {
            i["i"]["startsAt"] = json!(s);
        }
        i
    };
    let id = |d: &Value| d["createReservation"]["reservation"]["id"].clone();
    let later = app
        .ok(
            &member,
            CREATE,
            create(
                Some("2031-01-01T01:00:00Z"),
                "2031-01-01T02:00:00Z",
                "later",
                json!({ "gpuKind": "MIG", "profile": "3g.40gb", "gpuCount": 1 }),
            ),
        )
        .await;
    let short = app
        .ok(
            &member,
            CREATE,
            create(
                None,
                "2031-01-01T00:30:00Z",
                "short",
                json!({ "gpuCount": 2, "model": "H100", "vcpu": 4 }),
            ),
        )
        .await;
    let waiting = app
        .ok(
            &member,
            CREATE,
            create(
                None,
                "2031-01-01T03:00:00Z",
                "waiting",
                json!({ "gpuCount": 2, "model": "H100" }),
            ),
        )
        .await;
    let doomed = app
        .ok(
            &member,
            CREATE,
            create(
                None,
                "2031-01-01T00:20:00Z",
                "doomed",
                json!({ "gpuCount": 2, "model": "H100" }),
            ),
        )
        .await;
    assert_eq!(state_of(&app, &id(&later)).await, "SCHEDULED");
    assert_eq!(state_of(&app, &id(&short)).await, "ACTIVE");
    assert_eq!(state_of(&app, &id(&waiting)).await, "PENDING");
    assert_eq!(state_of(&app, &id(&doomed)).await, "PENDING");
    let db = &app.db.db;
    assert_eq!(
        reconcile::retry_pending(db).await.expect("retry"),
        0,
        "not due yet"
    );
    app.db.advance_clock(45).await;
    assert_eq!(
        reconcile::retry_pending(db).await.expect("retry"),
        0,
        "still no capacity"
    );
    let d = app
        .ok(
            &member,
            "query($id: ID!) { reservation(id: $id) { nextAttemptAt conditions { message } } }",
            json!({ "id": id(&waiting) }),
        )
        .await;
    assert_eq!(
        d["reservation"]["nextAttemptAt"], "2031-01-01T00:01:15+00:00",
        "tried again 30 s later"
    );

    app.db.advance_clock(30 * 60).await; // 00:30:45
    assert_eq!(
        reconcile::expire_due(db).await.expect("expire"),
        2,
        "the short one and the pending one that never fit"
    );
    assert_eq!(state_of(&app, &id(&short)).await, "EXPIRED");
    assert_eq!(state_of(&app, &id(&doomed)).await, "EXPIRED");
    assert_eq!(used(&app, "vcpu").await, 0.0, "expiry gives quota back");
    assert_eq!(allocated_vcpu(&app).await, 0, "and scalars");
    assert_eq!(
        reconcile::retry_pending(db).await.expect("retry"),
        1,
        "capacity came back"
    );
    assert_eq!(state_of(&app, &id(&waiting)).await, "ACTIVE");
    assert_eq!(
        reconcile::expire_due(db).await.expect("again"),
        0,
        "a step with nothing due does nothing"
    );

    app.db.advance_clock(30 * 60).await; // 01:00:45
    assert_eq!(reconcile::activate_due(db).await.expect("activate"), 1);
    assert_eq!(state_of(&app, &id(&later)).await, "ACTIVE");
    assert_eq!(reconcile::activate_due(db).await.expect("again"), 0);
    app.db.advance_clock(2 * 3600).await; // 03:00:45
    assert_eq!(reconcile::expire_due(db).await.expect("expire"), 2);
    assert_eq!(used(&app, "gpu").await, 0.0, "every charge came back");
    for t in [
        "reservation.active",
        "reservation.expired",
        "reservation.scheduled",
        "reservation.pending",
    ] {
        assert!(
            app.count(&format!("outbox WHERE type = '{t}'")).await >= 1,
            "{t}"
        );
    }
}

#[tokio::test]
async fn each_state_refuses_what_the_table_does_not_allow() {
    let (app, p, member) = setup().await;
    let scheduled = app
        .ok(&member, CREATE, json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T01:00:00Z", "endsAt": "2031-01-01T02:00:00Z",
            "allocations": [{ "gpuCount": 1 }], "idempotencyKey": "s" } }))
        .await;
    let d = app
        .ok(
            &member,
            RELEASE,
            json!({ "i": { "id": scheduled["createReservation"]["reservation"]["id"] } }),
        )
        .await;
    assert_eq!(
        d["releaseReservation"]["reservation"]["state"], "RELEASED",
        "a scheduled reservation can be released"
    );
    let active = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "a", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let active_id = active["createReservation"]["reservation"]["id"].clone();
    let (code, error) = app
        .fails(&member, CANCEL, json!({ "i": { "id": active_id } }))
        .await;
    assert_eq!(
        code, "CONFLICT",
        "an active reservation is released, not cancelled: {error}"
    );
    let (code, error) = app
        .fails(
            &member,
            RELEASE,
            json!({ "i": { "id": active_id, "version": 7 } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["currentVersion"]),
        ("CONFLICT", &json!(1))
    );
    let (code, _) = app
        .fails(&member, EXTEND, json!({ "i": { "id": active_id, "endsAt": "2031-01-01T01:00:00Z", "idempotencyKey": "earlier" } }))
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "an extension moves the end later");
    let (_, body) = app
        .graphql(
            CREATE,
            input(&p.pool, "anon", json!([{ "gpuCount": 1 }])),
            None,
        )
        .await;
    assert_eq!(compute_tests::first_code(&body), Some("UNAUTHENTICATED"));
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            input(&p.pool, "zero", json!([{ "gpuCount": 0 }])),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("allocations[0].gpuCount"))
    );
    let (code, _) = app
        .fails(
            &member,
            CREATE,
            input(
                "pool_0000000000000000000000000000beef",
                "nopool",
                json!([{ "gpuCount": 1 }]),
            ),
        )
        .await;
    assert_eq!(code, "NOT_FOUND");
}

/// A reservation on a node that is lost fails, and gives everything back.
#[tokio::test]
async fn a_lost_node_fails_its_reservations() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "x",
                json!([{ "gpuCount": 1, "model": "H100", "vcpu": 4 }]),
            ),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    assert_eq!(
        reconcile::fail_lost(&app.db.db).await.expect("step"),
        0,
        "no node is lost"
    );
    // A node marked lost by hand in a bare-metal pool fails nothing: bare metal is never lost
    // automatically (the liveness reconciler marks only provider and VPS nodes lost).
    sqlx::query("UPDATE nodes SET reachability = 'lost' WHERE id = $1")
        .bind(&p.nodes[0])
        .execute(app.db.db.pool())
        .await
        .expect("lose the node");
    assert_eq!(
        reconcile::fail_lost(&app.db.db).await.expect("step"),
        0,
        "bare metal"
    );
    sqlx::query("UPDATE pools SET kind = 'provider' WHERE id = $1")
        .bind(&p.pool)
        .execute(app.db.db.pool())
        .await
        .expect("a provider pool");
    app.db.advance_clock(60).await;
    assert_eq!(reconcile::fail_lost(&app.db.db).await.expect("step"), 1);
    let d = app
        .ok(&member, "query($id: ID!) { reservation(id: $id) { state endedAt conditions { type message } } }", json!({ "id": id }))
        .await;
    assert_eq!(d["reservation"]["state"], "FAILED");
    assert_eq!(d["reservation"]["endedAt"], "2031-01-01T00:01:00+00:00");
    assert_eq!(
        d["reservation"]["conditions"][0]["message"],
        format!("its node {} was lost", p.nodes[0])
    );
    assert_eq!(
        (used(&app, "gpu").await, allocated_vcpu(&app).await),
        (0.0, 0)
    );
    assert_eq!(
        reconcile::fail_lost(&app.db.db).await.expect("step"),
        0,
        "failed is terminal"
    );
}

/// The reconciler does the work only where it holds the lease, and moves reservations with time.
#[tokio::test]
async fn the_reconciler_works_where_it_holds_the_lease() {
    use compute_workers::Reconciler;
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "r", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    app.ok(
        &member,
        EXTEND,
        json!({ "i": { "id": id, "endsAt": "2031-01-01T02:30:00Z", "idempotencyKey": "x" } }),
    )
    .await;
    let mut a = Reconciler::new(app.db.db.clone(), "worker-a");
    let mut b = Reconciler::new(app.db.db.clone(), "worker-b");
    let first = a.pass().await.expect("pass");
    assert!(first.held);
    assert_eq!(first.expired, 0, "nothing due yet");
    assert!(!b.pass().await.expect("pass").held, "a holds the lease");
    app.db.advance_clock(3 * 3600).await;
    let pass = a.pass().await.expect("pass");
    assert_eq!(
        (pass.held, pass.expired),
        (true, 1),
        "a took its expired lease back and expired the reservation"
    );
    assert!(!b.pass().await.expect("pass").held);
    assert_eq!(state_of(&app, &id).await, "EXPIRED");
    a.release().await;
    assert!(
        b.pass().await.expect("pass").held,
        "a released lease is taken at once"
    );
}

/// Issue 12: the reconciler's writes are fenced like the work queue's. A reconciler that lost
/// its lease between its check and its writes (a pause, a slow pass) writes nothing: each of its
/// transactions checks the lease first and fails with `LEASE_LOST`; the new holder does the work.
#[tokio::test]
async fn a_reconciler_whose_lease_was_taken_writes_nothing() {
    use compute_domain::leases;
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "r", json!([{ "gpuCount": 1 }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    let db = &app.db.db;
    let old = leases::acquire(db, "singleton:test-reconciler", "worker-a", leases::TTL)
        .await
        .expect("acquire")
        .expect("free");
    app.db.advance_clock(3 * 3600).await; // the reservation is due, and a's lease has expired
    let new = leases::acquire(db, "singleton:test-reconciler", "worker-b", leases::TTL)
        .await
        .expect("acquire")
        .expect("expired");
    assert_eq!(new.epoch, old.epoch + 1);
    for (step, result) in [
        ("expire", reconcile::expire_due(&db.fenced(&old)).await),
        ("activate", reconcile::activate_due(&db.fenced(&old)).await),
    ] {
        let e = result.expect_err("a stale fence writes nothing");
        assert!(
            matches!(e, compute_domain::Error::LeaseLost(_)),
            "{step}: {e}"
        );
    }
    // The row itself (the API derives EXPIRED from the time alone, whatever the row says).
    let stored = || async {
        let (state,): (String,) =
            sqlx::query_as("SELECT state::text FROM reservations WHERE id = $1")
                .bind(id.as_str())
                .fetch_one(db.pool())
                .await
                .expect("row");
        state
    };
    assert_eq!(stored().await, "active", "the stale holder changed nothing");
    assert_eq!(
        reconcile::expire_due(&db.fenced(&new))
            .await
            .expect("expire"),
        1,
        "the holder does the work"
    );
    assert_eq!(stored().await, "expired");
}

/// Issue 10 A: repeats of one key sent together, while an operator raises the quota between
/// the first request's refusal and its repeats' turn, all get the first's answer. The order is
/// forced with row locks: the first waits on the quota rows held by this test, the quota change
/// queues behind it, the repeats wait on the first's key. Before the fix, the first's
/// `QUOTA_EXCEEDED` was recorded after its transaction had rolled back and released the key, so
/// a repeat took the key, found the raised quota and created a reservation under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_of_a_key_racing_a_quota_change_all_get_the_first_answer() {
    let (app, p, member) = setup().await;
    let set_gpus =
        |gpus: i64| json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": gpus } });
    const SET_QUOTA: &str =
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }";
    app.ok(&app.operator(), SET_QUOTA, set_gpus(0)).await;
    let req = input(&p.pool, "flip", json!([{ "gpuCount": 1 }]));

    let mut holder = sqlx::PgConnection::connect_with_url(&app.db.url).await;
    sqlx::raw_sql("BEGIN; SELECT * FROM quota_usage WHERE tenant_id = 'acme' FOR UPDATE")
        .execute(&mut holder)
        .await
        .expect("hold");
    let send = |req: Value| app.graphql_in_background(&member, CREATE, req);
    let first = send(req.clone());
    app.until_lock_waiters(1).await;
    let raise = app.graphql_in_background(&app.operator(), SET_QUOTA, set_gpus(8));
    app.until_lock_waiters(2).await;
    let repeats: Vec<_> = (0..3).map(|_| send(req.clone())).collect();
    app.until_lock_waiters(5).await;
    sqlx::raw_sql("COMMIT")
        .execute(&mut holder)
        .await
        .expect("release");

    let mut answers = vec![first.await.expect("first")];
    for r in repeats {
        answers.push(r.await.expect("repeat"));
    }
    let raised = raise.await.expect("raise");
    assert!(raised["errors"].is_null(), "{raised}");
    let codes: Vec<Option<&str>> = answers.iter().map(compute_tests::first_code).collect();
    assert_eq!(
        codes,
        vec![Some("QUOTA_EXCEEDED"); 4],
        "one key, one answer: {answers:?}"
    );
    assert_eq!(
        app.count("reservations").await,
        0,
        "no effect under the key"
    );
    assert_eq!(used(&app, "gpu").await, 0.0, "nothing charged");
    // Afterwards too, the key keeps its answer, though the quota now allows the request.
    let (code, _) = app.fails(&member, CREATE, req).await;
    assert_eq!(code, "QUOTA_EXCEEDED");
}

/// Issue 10 C: the GPU charge is the exact sum of the allocations' shares, rounded once.
#[tokio::test]
async fn the_gpu_charge_is_summed_exactly_and_rounded_once() {
    let (app, p, member) = setup().await;
    // 3/7 + 2/7 = 5/7 = 0.714285714…: 0.714286 once rounded, where rounding each share first
    // gives 0.428571 + 0.285714 = 0.714285.
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "mig-pair",
                json!([
                    { "gpuKind": "MIG", "profile": "3g.40gb", "gpuCount": 1 },
                    { "gpuKind": "MIG", "profile": "2g.20gb", "gpuCount": 1 }
                ]),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["gpuCharge"], 0.714286);
    assert_eq!(
        used(&app, "gpu").await,
        0.714286,
        "the quota is charged the same"
    );
    // Three slots of a 4-slot GPU and a whole GPU: 1.75, exactly.
    let d = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "slots",
                json!([
                    { "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 3 },
                    { "gpuCount": 1, "model": "H100" }
                ]),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["gpuCharge"], 1.75);
    assert_eq!(used(&app, "gpu").await, 2.464286);
    // The refund gives back exactly what was charged.
    let id = d["createReservation"]["reservation"]["id"].clone();
    app.ok(&member, RELEASE, json!({ "i": { "id": id } })).await;
    assert_eq!(used(&app, "gpu").await, 0.714286);
}

/// Issue 10 D: states follow time, not the reconciler's progress. A reservation whose window
/// has started is active (it can be released, not cancelled), and one whose window has ended is
/// expired, before any reconciler has run; a cancel before the start leaves nothing behind; a
/// pending reservation placed after its requested start starts at its placement.
#[tokio::test]
async fn states_follow_time_before_the_reconciler_moves_them() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let at = |start: &str, end: &str, key: &str, gpus: i64| {
        json!({ "i": { "poolId": p.pool, "startsAt": start, "endsAt": end,
            "allocations": [{ "gpuCount": gpus, "model": "H100" }], "idempotencyKey": key } })
    };
    let id = |d: &Value| d["createReservation"]["reservation"]["id"].clone();
    let bookings = |rid: Value| {
        let pool = app.db.db.pool().clone();
        async move {
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT to_char(lower(b.during) AT TIME ZONE 'UTC', 'HH24:MI:SS'), to_char(upper(b.during) AT TIME ZONE 'UTC', 'HH24:MI:SS') \
                   FROM device_bookings b \
                   JOIN allocations a ON a.id = b.allocation_id WHERE a.reservation_id = $1 ORDER BY b.id",
            )
            .bind(rid.as_str().unwrap_or_default())
            .fetch_all(&pool)
            .await
            .expect("bookings");
            rows
        }
    };
    let early = id(&app
        .ok(
            &member,
            CREATE,
            at("2031-01-01T01:00:00Z", "2031-01-01T02:00:00Z", "early", 1),
        )
        .await);
    let started = id(&app
        .ok(
            &member,
            CREATE,
            at("2031-01-01T01:00:00Z", "2031-01-01T02:00:00Z", "started", 1),
        )
        .await);
    assert_eq!(state_of(&app, &started).await, "SCHEDULED");

    // Before the start, a cancel withdraws it and leaves nothing: no booking, no charge.
    app.db.advance_clock(3600 - 10).await; // 00:59:50
    let d = app
        .ok(&member, CANCEL, json!({ "i": { "id": early } }))
        .await;
    assert_eq!(d["cancelReservation"]["reservation"]["state"], "CANCELLED");
    assert!(
        bookings(early.clone()).await.is_empty(),
        "a cancelled reservation books nothing"
    );
    assert_eq!(used(&app, "gpu").await, 1.0, "its charge came back");

    // Eleven seconds after the start, no reconciler has run: it is active all the same.
    app.db.advance_clock(21).await; // 01:00:11
    assert_eq!(state_of(&app, &started).await, "ACTIVE");
    let d = app
        .ok(
            &member,
            "query($s: ReservationState) { reservations(state: $s) { totalCount edges { node { id } } } }",
            json!({ "s": "ACTIVE" }),
        )
        .await;
    assert_eq!(
        d["reservations"]["edges"][0]["node"]["id"], started,
        "the filter agrees: {d}"
    );
    let (code, error) = app
        .fails(&member, CANCEL, json!({ "i": { "id": started } }))
        .await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("release it"),
        "the refusal says what to do instead: {error}"
    );
    assert_eq!(
        bookings(started.clone()).await,
        vec![("01:00:00".to_owned(), "02:00:00".to_owned())],
        "the refused cancel left its booking as it was"
    );
    let d = app
        .ok(&member, RELEASE, json!({ "i": { "id": started } }))
        .await;
    assert_eq!(d["releaseReservation"]["reservation"]["state"], "RELEASED");
    assert_eq!(
        bookings(started.clone()).await,
        vec![("01:00:00".to_owned(), "01:00:11".to_owned())],
        "released: held from its start to the release"
    );
    assert_eq!(
        reconcile::activate_due(&app.db.db).await.expect("activate"),
        0,
        "nothing left to start"
    );

    // Past its end, a reservation is expired before the reconciler gives its quota back.
    let short = id(&app
        .ok(
            &member,
            CREATE,
            at("2031-01-01T01:00:11Z", "2031-01-01T01:30:00Z", "short", 1),
        )
        .await);
    app.db.advance_clock(30 * 60).await; // 01:30:11
    assert_eq!(state_of(&app, &short).await, "EXPIRED");
    let (code, error) = app
        .fails(&member, RELEASE, json!({ "i": { "id": short } }))
        .await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert_eq!(reconcile::expire_due(&app.db.db).await.expect("expire"), 1);
    assert_eq!(state_of(&app, &short).await, "EXPIRED");
    assert_eq!(used(&app, "gpu").await, 0.0);

    // Pending past its requested start, placed later: it starts at its placement.
    let hog = id(&app
        .ok(
            &member,
            CREATE,
            at("2031-01-01T01:30:11Z", "2031-01-01T03:00:00Z", "hog", 2),
        )
        .await);
    let d = app
        .ok(
            &member,
            CREATE,
            at("2031-01-01T01:30:11Z", "2031-01-01T03:00:00Z", "late", 2),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "PENDING");
    let late = id(&d);
    app.db.advance_clock(60).await; // 01:31:11
    app.ok(&member, RELEASE, json!({ "i": { "id": hog } }))
        .await;
    assert_eq!(
        reconcile::retry_pending(&app.db.db).await.expect("retry"),
        1
    );
    let d = app
        .ok(
            &member,
            "query($id: ID!) { reservation(id: $id) { state startsAt } }",
            json!({ "id": late }),
        )
        .await;
    assert_eq!(d["reservation"]["state"], "ACTIVE");
    assert_eq!(
        d["reservation"]["startsAt"], "2031-01-01T01:31:11+00:00",
        "its start is its placement"
    );
    for (from, _) in bookings(late).await {
        assert_eq!(from, "01:31:11", "and so are its bookings'");
    }
}

#[tokio::test]
async fn an_atom_is_never_booked_from_before_it_existed() {
    // A GPU's last whole-GPU booking ends at its release; a mode change then makes slot atoms.
    // A reservation that starts before the mode change (a start within the grace of the past,
    // or a transaction whose `compute_now()` is older than the change) must not book the new
    // atoms from that start: the slot's booking would overlap the parent's (the atom rule).
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let member = app.member("acme");
    let op = app.operator();
    let whole = app
        .ok(
            &member,
            CREATE,
            input(
                &p.pool,
                "whole",
                json!([{ "gpuCount": 2, "model": "H100" }]),
            ),
        )
        .await;
    let whole = &whole["createReservation"]["reservation"];
    assert_eq!(whole["state"], "ACTIVE", "{whole}");
    app.db.advance_clock(30).await;
    app.ok(&member, RELEASE, json!({ "i": { "id": whole["id"] } }))
        .await;
    let (dev, version): (String, i64) =
        sqlx::query_as("SELECT id, version FROM devices WHERE uuid = 'GPU-A0'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("device");
    app.ok(
        &op,
        "mutation($i: ChangeDeviceModeInput!) { changeDeviceMode(input: $i) { device { mode } } }",
        json!({ "i": { "id": dev, "version": version, "mode": "TIME_SLICE", "layout": { "slots": 4 }, "changeWindowSeconds": 0 } }),
    )
    .await;
    // Twenty seconds before the mode change, within the grace for starts in the past.
    let before = json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T00:00:10Z", "endsAt": "2031-01-01T01:00:00Z",
        "allocations": [{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1, "model": "H100" }], "idempotencyKey": "before" } });
    let d = app.ok(&member, CREATE, before).await;
    let r = &d["createReservation"]["reservation"];
    assert_eq!(
        r["state"], "PENDING",
        "the new slots did not exist from 00:00:10: {r}"
    );
    let (overlaps,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM device_bookings p JOIN devices d ON p.atom = d.uuid \
           JOIN device_bookings c ON c.device_id = d.id AND c.atom LIKE d.uuid || '/%' AND c.during && p.during",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("overlaps");
    assert_eq!(
        overlaps, 0,
        "a GPU and one of its slots booked at the same instant"
    );
    // From the change on, the slots are there to take.
    let after = json!({ "i": { "poolId": p.pool, "endsAt": "2031-01-01T01:00:00Z",
        "allocations": [{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1, "model": "H100" }], "idempotencyKey": "after" } });
    let d = app.ok(&member, CREATE, after).await;
    assert_eq!(
        d["createReservation"]["reservation"]["allocations"][0]["atoms"],
        json!(["GPU-A0/s0"])
    );
}

/// A create answers with its reservation from the statement that wrote it (as JSON,
/// `compute_reservation_json`), not from a read-back of the row: every scalar of that answer is
/// what the row says when read as a row, for a reservation placed and for one left pending with
/// its conditions, and for the replay of each.
#[tokio::test]
async fn a_create_answers_with_the_reservation_as_its_row_reads() {
    let (app, p, member) = setup().await;
    const FIELDS: &str = "id tenantId createdBy state startsAt endsAt endedAt \
        conditions { type status reason message counts { reason count } } gpuCharge vcpuCharge \
        memoryMibCharge nextAttemptAt version createdAt updatedAt";
    let create = format!(
        "mutation($i: CreateReservationInput!) {{ createReservation(input: $i) {{ idempotentReplay reservation {{ {FIELDS} }} }} }}"
    );
    let read = format!("query($id: ID!) {{ reservation(id: $id) {{ {FIELDS} }} }}");
    let asks = [
        (
            "placed",
            json!([{ "gpuCount": 1, "model": "H100", "vcpu": 8, "memoryMib": 65536 }]),
        ),
        // More H100s than the pool has: held pending, with its `Unschedulable` condition.
        ("pending", json!([{ "gpuCount": 6, "model": "H100" }])),
    ];
    for (key, allocations) in asks {
        let first = app
            .ok(&member, &create, input(&p.pool, key, allocations.clone()))
            .await["createReservation"]
            .clone();
        let answered = &first["reservation"];
        let row = app
            .ok(&member, &read, json!({ "id": answered["id"] }))
            .await["reservation"]
            .clone();
        assert_eq!(
            answered, &row,
            "{key}: the create's answer and the row differ"
        );
        match key {
            "placed" => assert_eq!(row["state"], "ACTIVE", "{row}"),
            _ => {
                assert_eq!(row["state"], "PENDING", "{row}");
                assert!(row["nextAttemptAt"].is_string(), "{row}");
                assert!(
                    !row["conditions"].as_array().expect("conditions").is_empty(),
                    "{row}"
                );
            }
        }
        assert_eq!(first["idempotentReplay"], false, "{key}");
        let again = app
            .ok(&member, &create, input(&p.pool, key, allocations))
            .await["createReservation"]
            .clone();
        assert_eq!(again["idempotentReplay"], true, "{key}");
        assert_eq!(
            again["reservation"], row,
            "{key}: the replay's answer and the row differ"
        );
    }
}

/// Replanning, deterministically: a second transaction holds the vCPU counters
/// (`node_resources`, the last rows an attempt locks) of the tightest nodes, so each attempt on
/// one of them waits out its lock timeout and is rolled back to its savepoint, and the search
/// runs again without that node. The contested nodes have 1 GPU free and the others 2, and the
/// search looks at 2 fitting nodes and takes the tightest, so while a contested node remains,
/// the search picks one. "At most three attempts per allocation": with two contested nodes the
/// third attempt places it (`placementRetries` 2); with three, the reservation is `PENDING` with
/// `Unschedulable` / `LostRace` after the third, though a fourth node is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contested_placement_replans_elsewhere_and_gives_up_after_three_attempts() {
    let app = spawn_app().await;
    // `reservations::input` ends at 2031-01-01T02:00Z: a reservation of two hours, not years.
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let op = app.operator();
    let site = app
        .ok(&op, CREATE_SITE, json!({ "i": { "name": "replan" } }))
        .await["createSite"]["site"]["id"]
        .as_str()
        .expect("site")
        .to_owned();
    let mut nodes = std::collections::BTreeMap::new();
    let mut pools = std::collections::BTreeMap::new();
    for (pool_name, hosts) in [
        ("two-contested", &[("a1", 1), ("a2", 1), ("a3", 2)][..]),
        (
            "three-contested",
            &[("b1", 1), ("b2", 1), ("b3", 1), ("b4", 2)][..],
        ),
    ] {
        let pool = crate::fleet::add_pool(
            &app,
            &site,
            json!({ "name": pool_name, "kind": "BARE_METAL" }),
        )
        .await;
        for (host, gpus) in hosts {
            let devices: Vec<Value> = (0..*gpus)
                .map(|g| json!({ "uuid": format!("GPU-{host}-{g}"), "model": "H100", "memoryMib": 81559 }))
                .collect();
            let id = app
                .ok(&op, REGISTER, json!({ "i": { "poolId": pool, "hostname": host,
                    "resources": { "vcpu": 32, "memoryMib": 262144, "diskGib": 1000 }, "devices": devices } }))
                .await["registerNode"]["computeNode"]["id"]
                .as_str()
                .expect("node")
                .to_owned();
            nodes.insert(*host, id);
        }
        pools.insert(pool_name, pool);
    }
    let hold = |hosts: &[&str]| {
        let ids: Vec<String> = hosts.iter().map(|h| nodes[h].clone()).collect();
        let pool = app.db.db.pool().clone();
        async move {
            let mut side = pool.begin().await.expect("a second transaction");
            let held: Vec<(String,)> = sqlx::query_as(
                "SELECT node_id FROM node_resources WHERE node_id = ANY($1) ORDER BY node_id, resource FOR UPDATE",
            )
            .bind(&ids)
            .fetch_all(&mut *side)
            .await
            .expect("hold the counters");
            assert!(!held.is_empty());
            side
        }
    };
    let acme = app.member("acme");
    let one_gpu = json!([{ "gpuCount": 1, "vcpu": 1 }]);

    // Two contested: attempts on a1 and a2 (in either order) time out, the third places on a3.
    let side = hold(&["a1", "a2"]).await;
    let placed = app
        .ok(
            &acme,
            CREATE,
            input(&pools["two-contested"], "replan-1", one_gpu.clone()),
        )
        .await["createReservation"]
        .clone();
    side.rollback().await.expect("let go");
    assert_eq!(placed["placementRetries"], 2, "{placed}");
    assert_eq!(placed["reservation"]["state"], "ACTIVE");
    assert_eq!(
        placed["reservation"]["allocations"][0]["computeNodeId"].as_str(),
        Some(nodes["a3"].as_str()),
        "placed on the node not contested"
    );

    // Three contested: three attempts, then it gives up, though b4 is free.
    let side = hold(&["b1", "b2", "b3"]).await;
    let pending = app
        .ok(
            &acme,
            CREATE,
            input(&pools["three-contested"], "replan-2", one_gpu),
        )
        .await["createReservation"]
        .clone();
    side.rollback().await.expect("let go");
    let r = &pending["reservation"];
    assert_eq!(r["state"], "PENDING", "{pending}");
    assert_eq!(pending["placementRetries"], 3);
    assert!(r["allocations"][0]["computeNodeId"].is_null());
    assert_eq!(r["conditions"][0]["type"], "Unschedulable");
    assert_eq!(r["conditions"][0]["reason"], "LostRace");
    assert_eq!(
        r["conditions"][0]["counts"],
        json!([{ "reason": "LostRace", "count": 3 }])
    );
    let booked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id \
          WHERE a.reservation_id = $1",
    )
    .bind(r["id"].as_str().expect("id"))
    .fetch_one(app.db.db.pool())
    .await
    .expect("bookings");
    assert_eq!(booked, 0, "every attempt rolled back to its savepoint");
}

/// Under the lock-order tests' mode (`Db::without_contention_retry`) a deadlock inside a
/// placement attempt fails the call (`40P01`, nothing written) instead of being taken for a
/// lost race and replanned away; without it, the same deadlock is replanned. The deadlock is
/// made on purpose: a second transaction holds node h100-a's counters, the placement pinned to
/// h100-a waits on them while it holds the node row `FOR SHARE`, and the second transaction then
/// asks for the node row `FOR UPDATE` (the documented order inverted). PostgreSQL's detector
/// runs first in the placement's backend, which waited first, and aborts its statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_inside_placement_fails_the_call_when_contention_is_not_retried() {
    use compute_domain::idempotency::Actor;
    use compute_domain::reservations::lifecycle::create_reservation;
    use compute_domain::reservations::model::{AllocationInput, parse_request};
    let app = spawn_app().await;
    let p = pool(&app).await;
    let a = p.nodes[0].clone();
    let acme = Actor::member("alice", compute_tests::tenant("acme"));
    let now = app.db.db.compute_now().await.expect("now");
    let request = parse_request(
        &p.pool,
        None,
        now + chrono::Duration::hours(1),
        &[AllocationInput {
            gpu_count: 1,
            vcpu: 1,
            node_selector: vec![("host".into(), "h100-a".into())],
            ..AllocationInput::default()
        }],
        None,
    )
    .expect("request");
    let deadlock = |db: compute_domain::db::Db, key: &'static str| {
        let (app, a, acme, request) = (&app, a.clone(), acme.clone(), request.clone());
        async move {
            let mut side = app
                .db
                .db
                .pool()
                .begin()
                .await
                .expect("a second transaction");
            sqlx::query(
                "SELECT 1 FROM node_resources WHERE node_id = $1 ORDER BY resource FOR UPDATE",
            )
            .bind(&a)
            .execute(&mut *side)
            .await
            .expect("hold the counters");
            let placing =
                tokio::spawn(async move { create_reservation(&db, &acme, request, key).await });
            app.until_lock_waiters(1).await;
            sqlx::query("SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE")
                .bind(&a)
                .execute(&mut *side)
                .await
                .expect("the node row, once the placement let it go");
            side.rollback().await.expect("let go");
            placing.await.expect("join")
        }
    };
    let strict = deadlock(app.db.db.clone().without_contention_retry(), "dl-strict").await;
    match strict {
        Err(compute_domain::Error::Contention { sqlstate, attempts }) => {
            assert_eq!((sqlstate.as_str(), attempts), ("40P01", 1));
        }
        other => panic!("a deadlock fails the call in this mode: {other:?}"),
    }
    assert_eq!(app.count("reservations").await, 0, "nothing written");
    // The same deadlock in production's mode: the attempt is replanned without h100-a, the only
    // node the selector allows, so the reservation waits, pending.
    let (made, stats) = deadlock(app.db.db.clone(), "dl-replanned")
        .await
        .expect("replanned, not failed");
    assert_eq!(stats.replans, 1);
    assert_eq!(
        made.value.state,
        compute_domain::reservations::state::State::Pending
    );
}

/// A placement of several allocations takes its locks in key order, whatever order its
/// allocations name the nodes in (migration 0039). Two allocations pinned by their selectors:
/// the first to the node with the greater id, the second to the other. A second transaction, in
/// the documented order, holds the lower node's counters, waits until the placement waits on
/// them, then asks for the higher node's. Placing allocation by allocation, as before, the
/// placement held the higher node's counters (its first allocation's) while waiting on the
/// lower's: a deadlock, which the lock-order tests' mode (`Db::without_contention_retry`)
/// reports as 40P01. In key order the placement asks for the lower node's counters first and
/// holds nothing the second transaction wants: it waits, then places both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_of_several_allocations_locks_its_nodes_in_key_order() {
    use compute_domain::fleet::model::TaintEffect;
    use compute_domain::idempotency::Actor;
    use compute_domain::reservations::lifecycle::create_reservation;
    use compute_domain::reservations::model::{AllocationInput, parse_request};
    let app = spawn_app().await;
    let p = pool(&app).await;
    // h100-a and h100-b (tainted, tolerated below), ordered by id.
    let (a, b) = (p.nodes[0].clone(), p.nodes[1].clone());
    let ((lo, lo_host), (hi, hi_host)) = if a < b {
        ((a, "h100-a"), (b, "h100-b"))
    } else {
        ((b, "h100-b"), (a, "h100-a"))
    };
    let on = |host: &str| AllocationInput {
        gpu_count: 1,
        vcpu: 1,
        node_selector: vec![("host".into(), host.into())],
        tolerations: vec![(
            "dedicated".into(),
            Some("train".into()),
            Some(TaintEffect::NoSchedule),
        )],
        ..AllocationInput::default()
    };
    let now = app.db.db.compute_now().await.expect("now");
    let request = parse_request(
        &p.pool,
        None,
        now + chrono::Duration::hours(1),
        &[on(hi_host), on(lo_host)],
        None,
    )
    .expect("request");
    let acme = Actor::member("alice", compute_tests::tenant("acme"));
    let db = app.db.db.clone().without_contention_retry();
    let mut side = app
        .db
        .db
        .pool()
        .begin()
        .await
        .expect("a second transaction");
    sqlx::query("SELECT 1 FROM node_resources WHERE node_id = $1 ORDER BY resource FOR UPDATE")
        .bind(&lo)
        .execute(&mut *side)
        .await
        .expect("hold the lower node's counters");
    let placing =
        tokio::spawn(async move { create_reservation(&db, &acme, request, "key-order").await });
    app.until_lock_waiters(1).await;
    sqlx::query("SELECT 1 FROM node_resources WHERE node_id = $1 ORDER BY resource FOR UPDATE")
        .bind(&hi)
        .execute(&mut *side)
        .await
        .expect("the higher node's counters: the placement holds none of them while it waits");
    side.rollback().await.expect("let go");
    let (made, stats) = placing.await.expect("join").expect("placed, no deadlock");
    assert_eq!(stats.replans, 0);
    let nodes: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT node_id FROM allocations WHERE reservation_id = $1 ORDER BY ordinal",
    )
    .bind(made.value.id.as_str())
    .fetch_all(app.db.db.pool())
    .await
    .expect("allocations");
    assert_eq!(
        nodes,
        vec![Some(hi), Some(lo)],
        "each allocation on its node"
    );
}

/// Setting a quota takes the tenant's rows in key order (gpu, memory_mib, vcpu), as a create's
/// charge does: a transaction that holds `memory_mib` and then takes `vcpu` (the documented order)
/// waits for `set_quota` or lets it wait, never closes a cycle with it. Given in the request's
/// order (vCPU before memory), the upsert held `vcpu` while waiting for `memory_mib`.
#[tokio::test]
async fn setting_a_quota_locks_its_rows_in_key_order() {
    use compute_domain::idempotency::Actor;
    use compute_domain::ids::ScopeId;
    use compute_domain::quota::{QuotaLimits, set_quota};
    let app = spawn_app().await;
    let p = pool(&app).await;
    let scope = ScopeId::Pool(compute_domain::ids::PoolId::parse("poolId", &p.pool).expect("id"));
    let acme = compute_tests::tenant("acme");
    let operator = Actor::operator("root");
    let limits = |n: i64| QuotaLimits {
        gpus: None,
        vcpu: Some(n),
        memory_mib: Some(n * 1024),
    };
    set_quota(&app.db.db, &operator, &acme, &scope, limits(64))
        .await
        .expect("the rows exist");
    let row = "SELECT 1 FROM quota_usage WHERE tenant_id = 'acme' AND scope_kind = 'pool' AND scope_id = $1 AND resource = $2 FOR UPDATE";
    let mut side = app
        .db
        .db
        .pool()
        .begin()
        .await
        .expect("a second transaction");
    sqlx::query(row)
        .bind(&p.pool)
        .bind("memory_mib")
        .execute(&mut *side)
        .await
        .expect("hold memory_mib");
    let db = app.db.db.clone().without_contention_retry();
    let setting = tokio::spawn({
        let (acme, scope) = (acme.clone(), scope.clone());
        async move { set_quota(&db, &operator, &acme, &scope, limits(128)).await }
    });
    app.until_lock_waiters(1).await;
    sqlx::query(row)
        .bind(&p.pool)
        .bind("vcpu")
        .execute(&mut *side)
        .await
        .expect("vcpu: set_quota holds none of the rows while it waits");
    side.commit().await.expect("let go");
    let set = setting.await.expect("join").expect("set, no deadlock");
    let mut maxima: Vec<(String, f64)> = set
        .iter()
        .map(|q| (q.resource.as_str().to_owned(), q.max_amount))
        .collect();
    maxima.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        maxima,
        vec![
            ("memory_mib".to_owned(), 131_072.0),
            ("vcpu".to_owned(), 128.0)
        ]
    );
}

/// The events tell the story the reads told: a scheduled reservation whose window has started
/// reads `ACTIVE` before the reconciler activates it; released (or expired) before the reconciler
/// came, its events are still `scheduled`, `active`, then the end, in that order, the activation's
/// payload saying `active`. One the reconciler did activate gets one `reservation.active`, not two.
#[tokio::test]
async fn a_reservation_read_as_active_has_its_active_event_whatever_ends_it() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let create = |key: &str, start: &str, end: &str| {
        json!({ "i": { "poolId": p.pool, "startsAt": start, "endsAt": end, "idempotencyKey": key,
            "allocations": [{ "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 1 }] } })
    };
    let id_of = |d: &Value| d["createReservation"]["reservation"]["id"].clone();
    let released = id_of(
        &app.ok(
            &member,
            CREATE,
            create("r", "2031-01-01T00:01:00Z", "2031-01-01T01:00:00Z"),
        )
        .await,
    );
    let expired = id_of(
        &app.ok(
            &member,
            CREATE,
            create("e", "2031-01-01T00:01:00Z", "2031-01-01T00:05:00Z"),
        )
        .await,
    );
    let activated = id_of(
        &app.ok(
            &member,
            CREATE,
            create("a", "2031-01-01T00:01:00Z", "2031-01-01T01:00:00Z"),
        )
        .await,
    );
    assert_eq!(state_of(&app, &released).await, "SCHEDULED");
    app.db.advance_clock(120).await;
    // No reconciler has run: the reads already say ACTIVE.
    for id in [&released, &expired, &activated] {
        assert_eq!(state_of(&app, id).await, "ACTIVE");
    }
    let d = app
        .ok(&member, RELEASE, json!({ "i": { "id": released } }))
        .await;
    assert_eq!(d["releaseReservation"]["reservation"]["state"], "RELEASED");
    // The reconciler activates the third (its step for that one reservation); then expiry comes
    // for the short one, which no reconciler ever activated.
    let rid = |v: &Value| {
        compute_domain::ids::ReservationId::parse("rsv", v.as_str().expect("id")).expect("an id")
    };
    let (step, _) = reconcile::reconcile_one(&app.db.db, &rid(&activated))
        .await
        .expect("reconcile");
    assert_eq!(step, reconcile::Step::Started);
    let stored: String = sqlx::query_scalar("SELECT state FROM reservations WHERE id = $1")
        .bind(expired.as_str())
        .fetch_one(app.db.db.pool())
        .await
        .expect("state");
    assert_eq!(
        stored, "scheduled",
        "the short one is still stored scheduled"
    );
    app.db.advance_clock(600).await;
    assert_eq!(
        reconcile::expire_due(&app.db.db).await.expect("expire"),
        1,
        "the short one expired"
    );
    let events = |id: Value| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_as::<_, (String, String)>(
                "SELECT type, data->'reservation'->>'state' FROM outbox WHERE subject = $1 ORDER BY txid, seq",
            )
            .bind(id.as_str())
            .fetch_all(&pool)
            .await
            .expect("events")
        }
    };
    let pair = |t: &str, s: &str| (t.to_owned(), s.to_owned());
    assert_eq!(
        events(released).await,
        vec![
            pair("reservation.scheduled", "scheduled"),
            pair("reservation.active", "active"),
            pair("reservation.released", "released")
        ]
    );
    assert_eq!(
        events(expired).await,
        vec![
            pair("reservation.scheduled", "scheduled"),
            pair("reservation.active", "active"),
            pair("reservation.expired", "expired")
        ]
    );
    let activated_events: Vec<String> = events(activated)
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    assert_eq!(
        activated_events
            .iter()
            .filter(|t| *t == "reservation.active")
            .count(),
        1,
        "{activated_events:?}"
    );
}

const RULES: &str = "mutation($i: UpdatePoolInput!) { updatePool(input: $i) { pool { version \
    rules { maxDurationSeconds maxLeadSeconds maxFutureGpuHours extendAfterStart } } } }";

pub async fn pool_version(app: &TestApp, pool: &str) -> i64 {
    let d = app
        .ok(
            &app.operator(),
            "query($id: ID!) { node(id: $id) { ... on Pool { version } } }",
            json!({ "id": pool }),
        )
        .await;
    d["node"]["version"].as_i64().expect("version")
}

async fn admitted_under(app: &TestApp, token: &str, id: &Value) -> Value {
    let d = app
        .ok(
            token,
            "query($id: ID!) { reservation(id: $id) { admittedUnder { maxDurationSeconds maxLeadSeconds maxFutureGpuHours extendAfterStart } } }",
            json!({ "id": id }),
        )
        .await;
    d["reservation"]["admittedUnder"].clone()
}

/// A pool's rules refuse by name and limit, write nothing when they refuse, replay their refusal
/// under the key, judge an extension by the rules in force, and leave existing reservations as
/// they were admitted when the rules change.
#[tokio::test]
async fn pool_rules_refuse_by_name_and_limit_and_record_what_admitted() {
    let (app, p, member) = setup().await;
    let op = app.operator();
    let version = pool_version(&app, &p.pool).await;
    let rules = json!({ "maxDurationSeconds": 7200, "maxLeadSeconds": 86400, "maxFutureGpuHours": 6.0, "extendAfterStart": false });
    let d = app
        .ok(
            &op,
            RULES,
            json!({ "i": { "id": p.pool, "version": version, "rules": rules } }),
        )
        .await;
    assert_eq!(d["updatePool"]["pool"]["rules"], rules, "{d}");
    // Rules are checked where they enter.
    let (code, error) = app
        .fails(
            &op,
            RULES,
            json!({ "i": { "id": p.pool, "version": version + 1, "rules": { "maxLeadSeconds": 0 } } }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{error}");
    assert_eq!(error["extensions"]["field"], "rules.maxLeadSeconds");

    let window = |start: &str, end: &str, gpus: i64, key: &str| {
        json!({ "i": { "poolId": p.pool, "startsAt": start, "endsAt": end,
            "allocations": [{ "gpuCount": gpus, "model": "H100" }], "idempotencyKey": key } })
    };
    let (rows, events) = (app.count("reservations").await, app.count("outbox").await);
    let too_long = window("2031-01-01T00:00:00Z", "2031-01-01T03:00:00Z", 1, "long");
    for _ in 0..2 {
        let (code, error) = app.fails(&member, CREATE, too_long.clone()).await;
        assert_eq!(code, "POLICY_VIOLATION", "{error}");
        assert_eq!(error["extensions"]["rule"], "maxDurationSeconds");
        assert_eq!(error["extensions"]["limit"], 7200);
        assert!(
            error["message"]
                .as_str()
                .unwrap_or("")
                .contains("would last 10800 seconds"),
            "{error}"
        );
    }
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            window("2031-01-03T00:00:00Z", "2031-01-03T01:00:00Z", 1, "far"),
        )
        .await;
    assert_eq!(
        (
            code.as_str(),
            &error["extensions"]["rule"],
            &error["extensions"]["limit"]
        ),
        ("POLICY_VIOLATION", &json!("maxLeadSeconds"), &json!(86400)),
        "{error}"
    );
    // Nothing written by a refusal: no reservation, no event, no charge.
    assert_eq!(
        (app.count("reservations").await, app.count("outbox").await),
        (rows, events)
    );
    assert_eq!(used(&app, "gpu").await, 0.0);

    // GPU-hours booked ahead: 2 GPUs for 2 h is 4 of 6; 2 more for 1.5 h would be 7.
    let first = app
        .ok(
            &member,
            CREATE,
            window("2031-01-01T00:00:00Z", "2031-01-01T02:00:00Z", 2, "four"),
        )
        .await;
    let first_id = first["createReservation"]["reservation"]["id"].clone();
    assert_eq!(admitted_under(&app, &member, &first_id).await, rules);
    let (code, error) = app
        .fails(
            &member,
            CREATE,
            window("2031-01-01T00:00:00Z", "2031-01-01T01:30:00Z", 2, "seven"),
        )
        .await;
    assert_eq!(code, "POLICY_VIOLATION", "{error}");
    assert_eq!(error["extensions"]["rule"], "maxFutureGpuHours");
    assert_eq!(error["extensions"]["limit"].as_f64(), Some(6.0));
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains("holds 4 and asks 3"),
        "{error}"
    );
    // Exactly at the limit is allowed (it may wait for capacity: pending counts too).
    app.ok(
        &member,
        CREATE,
        window("2031-01-01T00:00:00Z", "2031-01-01T02:00:00Z", 1, "six"),
    )
    .await;

    // The first has started: no extension.
    let extend = |key: &str| json!({ "i": { "id": first_id, "endsAt": "2031-01-01T02:30:00Z", "idempotencyKey": key } });
    let (code, error) = app.fails(&member, EXTEND, extend("ext-1")).await;
    assert_eq!(
        (
            code.as_str(),
            &error["extensions"]["rule"],
            &error["extensions"]["limit"]
        ),
        (
            "POLICY_VIOLATION",
            &json!("extendAfterStart"),
            &json!(false)
        ),
        "{error}"
    );

    // Rules change: existing reservations keep what admitted them; the extension asked again
    // (with a new key: the first answer is final) is judged by the rules now in force.
    let version = pool_version(&app, &p.pool).await;
    let d = app
        .ok(
            &op,
            RULES,
            json!({ "i": { "id": p.pool, "version": version, "rules": {} } }),
        )
        .await;
    let none = json!({ "maxDurationSeconds": null, "maxLeadSeconds": null, "maxFutureGpuHours": null, "extendAfterStart": true });
    assert_eq!(d["updatePool"]["pool"]["rules"], none);
    assert_eq!(admitted_under(&app, &member, &first_id).await, rules);
    let (code, _) = app.fails(&member, EXTEND, extend("ext-1")).await;
    assert_eq!(code, "POLICY_VIOLATION", "replayed under its key");
    let d = app.ok(&member, EXTEND, extend("ext-2")).await;
    assert_eq!(
        d["extendReservation"]["reservation"]["endsAt"],
        "2031-01-01T02:30:00+00:00"
    );
    assert_eq!(admitted_under(&app, &member, &first_id).await, none);

    // The length is compared to the microsecond, as the create does: half a second past the
    // limit is past it (a count of whole seconds let an extension through).
    let version = pool_version(&app, &p.pool).await;
    app.ok(
        &op,
        RULES,
        json!({ "i": { "id": p.pool, "version": version, "rules": { "maxDurationSeconds": 9000 } } }),
    )
    .await;
    let (code, error) = app
        .fails(
            &member,
            EXTEND,
            json!({ "i": { "id": first_id, "endsAt": "2031-01-01T02:30:00.5Z", "idempotencyKey": "ext-3" } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["rule"]),
        ("POLICY_VIOLATION", &json!("maxDurationSeconds")),
        "{error}"
    );
}

/// The GPU-hours rule under concurrent creates of one tenant: a limit with room for four
/// one-GPU-hour reservations admits exactly four of twelve sent at once, whatever their order.
#[tokio::test]
async fn the_gpu_hours_rule_holds_under_concurrent_creates() {
    let (app, p, _) = setup().await;
    let version = pool_version(&app, &p.pool).await;
    app.ok(
        &app.operator(),
        RULES,
        json!({ "i": { "id": p.pool, "version": version, "rules": { "maxFutureGpuHours": 4 } } }),
    )
    .await;
    let beta = app.member("beta");
    let calls = (0..12).map(|n| {
        let (app, beta, pool) = (&app, &beta, &p.pool);
        async move {
            let (_, body) = app
                .graphql(
                    CREATE,
                    json!({ "i": { "poolId": pool, "endsAt": "2031-01-01T01:00:00Z",
                        "allocations": [{ "gpuCount": 1 }], "idempotencyKey": format!("c{n}") } }),
                    Some(beta),
                )
                .await;
            body
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    let created = answers
        .iter()
        .filter(|b| b["data"]["createReservation"]["reservation"]["id"].is_string())
        .count();
    let refused = answers
        .iter()
        .filter(|b| b["errors"][0]["extensions"]["rule"] == "maxFutureGpuHours")
        .count();
    assert_eq!((created, refused), (4, 8), "{answers:?}");
    let (held,): (f64,) =
        sqlx::query_as("SELECT compute_future_gpu_hours('beta', $1, NULL, compute_now())::float8")
            .bind(&p.pool)
            .fetch_one(app.db.db.pool())
            .await
            .expect("sum");
    assert_eq!(held, 4.0);
}

async fn conditions_of(app: &TestApp, token: &str, id: &Value) -> Value {
    let d = app
        .ok(
            token,
            "query($id: ID!) { reservation(id: $id) { state conditions { type reason } } }",
            json!({ "id": id }),
        )
        .await;
    d["reservation"].clone()
}

/// Idle reservations: reported once when no instance has run for the grace of the rules that
/// admitted them, never while an instance lives, and released only where those rules say so.
#[tokio::test]
async fn idle_reservations_are_reported_and_released_only_where_the_rules_say() {
    let (app, p, member) = setup().await;
    let db = app.db.db.clone();
    let op = app.operator();
    let set_rules = |rules: Value| {
        let (app, op, pool) = (&app, &op, p.pool.clone());
        async move {
            let version = pool_version(app, &pool).await;
            app.ok(
                op,
                RULES,
                json!({ "i": { "id": pool, "version": version, "rules": rules } }),
            )
            .await;
        }
    };
    let create = |key: &str| {
        let (app, member, pool) = (&app, &member, p.pool.clone());
        let key = key.to_owned();
        async move {
            let d = app
                .ok(
                    member,
                    CREATE,
                    json!({ "i": { "poolId": pool, "endsAt": "2031-01-01T05:00:00Z",
                        "allocations": [{ "gpuCount": 1, "model": "H100" }], "idempotencyKey": key } }),
                )
                .await;
            d["createReservation"]["reservation"]["id"].clone()
        }
    };
    let mark = || async {
        compute_domain::reservations::reconcile::mark_idle(&db)
            .await
            .expect("idle sweep")
    };
    let (code, error) = app
        .fails(
            &op,
            RULES,
            json!({ "i": { "id": p.pool, "version": pool_version(&app, &p.pool).await, "rules": { "releaseIdle": true } } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), &error["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("rules.releaseIdle"))
    );
    set_rules(json!({ "idleGraceSeconds": 600 })).await;
    let reported = create("reported").await;
    // A second one whose instance runs: never idle while it lives.
    let busy = create("busy").await;
    sqlx::query(
        "INSERT INTO instances (id, tenant_id, reservation_id, allocation_id, node_id, image, state, created_by, started_at)
         SELECT 'ins_busy', 'acme', a.reservation_id, a.id, a.node_id, 'img', 'running', 'test', compute_now()
           FROM allocations a WHERE a.reservation_id = $1",
    )
    .bind(busy.as_str())
    .execute(db.pool())
    .await
    .expect("a running instance");
    app.db.advance_clock(599).await;
    assert_eq!(mark().await, 0, "not before the grace");
    app.db.advance_clock(2).await;
    assert_eq!(mark().await, 1, "the idle one, once");
    assert_eq!(mark().await, 0, "reported once");
    assert_eq!(
        conditions_of(&app, &member, &reported).await,
        json!({ "state": "ACTIVE", "conditions": [{ "type": "Idle", "reason": "NoRunningInstance" }] })
    );
    assert_eq!(
        conditions_of(&app, &member, &busy).await,
        json!({ "state": "ACTIVE", "conditions": [] })
    );
    let (idle_events,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM outbox WHERE type = 'reservation.idle' AND subject = $1",
    )
    .bind(reported.as_str())
    .fetch_one(db.pool())
    .await
    .expect("events");
    assert_eq!(idle_events, 1);
    // Its instance stops: idle a grace after the stop, not after the start.
    sqlx::query(
        "UPDATE instances SET state = 'stopped', stopped_at = compute_now() WHERE id = 'ins_busy'",
    )
    .execute(db.pool())
    .await
    .expect("stop");
    app.db.advance_clock(599).await;
    assert_eq!(mark().await, 0, "idle only a grace after the stop");
    app.db.advance_clock(2).await;
    assert_eq!(mark().await, 1);

    // Rules that release: only the reservations they admit; the others stay as admitted. (The
    // second H100 is given back first, for the next one.)
    app.ok(&member, RELEASE, json!({ "i": { "id": busy } }))
        .await;
    set_rules(json!({ "idleGraceSeconds": 600, "releaseIdle": true })).await;
    let released = create("released").await;
    let held = used(&app, "gpu").await;
    app.db.advance_clock(601).await;
    assert_eq!(mark().await, 1);
    assert_eq!(
        conditions_of(&app, &member, &released).await,
        json!({ "state": "RELEASED", "conditions": [{ "type": "Idle", "reason": "ReleasedIdle" }] })
    );
    assert_eq!(used(&app, "gpu").await, held - 1.0, "its quota came back");
    assert_eq!(
        conditions_of(&app, &member, &reported).await["state"],
        "ACTIVE",
        "admitted under report-only rules"
    );
}

/// Placement plans without locks, then locks the chosen GPUs `FOR SHARE` and checks them again
/// on their latest version. A GPU renamed (an accepted inventory, here its update held open)
/// after the plan read it and committed while the placement waited for its row: the H100
/// asked for is now an A100, and the attempt is a lost race, never a booking of the A100.
#[tokio::test]
async fn a_gpu_renamed_while_placement_waits_for_it_is_not_booked_as_the_model_asked() {
    let (app, p, member) = setup().await;
    let pool = app.db.db.pool();
    // Both H100s of h100-a (the only node an H100 without tolerations fits) become A100s in a
    // transaction that holds their rows.
    let mut rename = pool.begin().await.expect("begin");
    let renamed =
        sqlx::query("UPDATE devices SET model = 'A100' WHERE node_id = $1 AND model = 'H100'")
            .bind(&p.nodes[0])
            .execute(&mut *rename)
            .await
            .expect("rename")
            .rows_affected();
    assert_eq!(renamed, 2);
    let commit = async {
        compute_tests::eventually(
            "the placement waits for the renamed GPU's row",
            std::time::Duration::from_secs(10),
            || async {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                        AND wait_event_type = 'Lock' AND application_name LIKE 'compute create %'",
                )
                .fetch_one(pool)
                .await
                .expect("activity");
                (waiting == 1).then_some(())
            },
        )
        .await;
        rename.commit().await.expect("commit");
    };
    let (created, ()) = tokio::join!(
        app.graphql(
            CREATE,
            input(
                &p.pool,
                "renamed",
                json!([{ "gpuCount": 1, "model": "H100" }])
            ),
            Some(&member)
        ),
        commit
    );
    let r = &created.1["data"]["createReservation"]["reservation"];
    assert_eq!(r["state"], "PENDING", "{}", created.1);
    assert_eq!(r["conditions"][0]["reason"], "NoCapacity", "{r}");
    let booked: i64 = sqlx::query_scalar("SELECT count(*) FROM device_bookings")
        .fetch_one(pool)
        .await
        .expect("bookings");
    assert_eq!(booked, 0, "nothing booked: {r}");
}

/// An idle reservation whose instance is being created (the creation holds the reservation's
/// row `FOR SHARE` and inserts the instance) is not released under it: the idle sweep waits for
/// the row, then reads the instance the creation committed, and leaves the reservation alone.
#[tokio::test]
async fn an_instance_made_while_the_idle_sweep_waits_keeps_its_reservation() {
    let (app, p, member) = setup().await;
    let db = app.db.db.clone();
    let version = pool_version(&app, &p.pool).await;
    app.ok(
        &app.operator(),
        RULES,
        json!({ "i": { "id": p.pool, "version": version, "rules": { "idleGraceSeconds": 600, "releaseIdle": true } } }),
    )
    .await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "idle", json!([{ "gpuCount": 1, "model": "H100" }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    app.db.advance_clock(601).await;
    // A creation in flight: the row held `FOR SHARE`, the instance inserted, not committed.
    let mut creating = db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM reservations WHERE id = $1 FOR SHARE")
        .bind(&id)
        .execute(&mut *creating)
        .await
        .expect("share");
    sqlx::query(
        "INSERT INTO instances (id, tenant_id, reservation_id, allocation_id, node_id, image, state, created_by)
         SELECT 'ins_new', 'acme', a.reservation_id, a.id, a.node_id, 'img', 'provisioning', 'test'
           FROM allocations a WHERE a.reservation_id = $1",
    )
    .bind(&id)
    .execute(&mut *creating)
    .await
    .expect("the instance");
    let commit = async {
        app.until_lock_waiters(1).await;
        creating.commit().await.expect("commit");
    };
    let (marked, ()) = tokio::join!(
        compute_domain::reservations::reconcile::mark_idle(&db),
        commit
    );
    assert_eq!(
        marked.expect("idle sweep"),
        0,
        "not idle: an instance was made"
    );
    assert_eq!(
        conditions_of(&app, &member, &json!(id)).await,
        json!({ "state": "ACTIVE", "conditions": [] })
    );
}

/// A reservation whose window is over belongs to expiry, even when the expiry pass is behind:
/// activation does not make it active (with an event saying so), and a lost node does not turn
/// it `FAILED` after its end; the expiry then ends both at their `endsAt`.
#[tokio::test]
async fn a_reservation_past_its_end_is_expired_not_activated_or_failed() {
    use compute_domain::reservations::reconcile;
    let (app, p, member) = setup().await;
    let db = &app.db.db;
    let later = app
        .ok(&member, CREATE, json!({ "i": { "poolId": p.pool, "startsAt": "2031-01-01T01:00:00Z", "endsAt": "2031-01-01T02:00:00Z",
            "allocations": [{ "gpuCount": 1, "model": "H100" }], "idempotencyKey": "later" } }))
        .await["createReservation"]["reservation"]["id"]
        .clone();
    let now = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "now", json!([{ "gpuCount": 1, "model": "H100" }])),
        )
        .await["createReservation"]["reservation"]["id"]
        .clone();
    sqlx::query("UPDATE nodes SET reachability = 'lost' WHERE id = $1")
        .bind(&p.nodes[0])
        .execute(db.pool())
        .await
        .expect("lose the node");
    sqlx::query("UPDATE pools SET kind = 'provider' WHERE id = $1")
        .bind(&p.pool)
        .execute(db.pool())
        .await
        .expect("a provider pool");
    // 02:30: both windows are over, and no pass has run since their creation.
    app.db.advance_clock(9000).await;
    assert_eq!(reconcile::activate_due(db).await.expect("activate"), 0);
    assert_eq!(reconcile::fail_lost(db).await.expect("fail lost"), 0);
    assert_eq!(reconcile::expire_due(db).await.expect("expire"), 2);
    for id in [&later, &now] {
        let d = app
            .ok(
                &member,
                "query($id: ID!) { reservation(id: $id) { state endedAt } }",
                json!({ "id": id }),
            )
            .await;
        assert_eq!(
            d["reservation"],
            json!({ "state": "EXPIRED", "endedAt": "2031-01-01T02:00:00+00:00" }),
            "{id}"
        );
    }
    let failed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE type = 'reservation.failed'")
            .fetch_one(db.pool())
            .await
            .expect("events");
    assert_eq!(failed, 0);
}

/// An extension grows its bookings one at a time in atom order, as placement books atoms, so
/// it never deadlocks with a create booking the same atoms from its end. Here the booking of
/// GPU-A0 was moved by an earlier update (its row now comes after GPU-A1's in the table), and
/// a second transaction books GPU-A0 and then GPU-A1 from 02:00 as a create would. The
/// extension waits at GPU-A0, the second transaction books GPU-A1 and commits, and the
/// extension is refused `CONFLICT`. (Grown in one statement, in the table's order, it took
/// GPU-A1 first: the booking of GPU-A1 then waited on it while it waited at GPU-A0, a
/// deadlock, which the lock-order mode fails instead of retrying.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_grows_its_bookings_in_atom_order_and_never_deadlocks_with_a_create() {
    use compute_domain::idempotency::Actor;
    let (app, p, member) = setup().await;
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "two", json!([{ "gpuCount": 2, "model": "H100" }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let pool = app.db.db.pool();
    // Two updates of an indexed value (not HOT, so its index entries follow the row): the
    // booking of GPU-A0 ends as it was, in a row after GPU-A1's.
    for sql in [
        "UPDATE device_bookings SET during = tstzrange(lower(during), upper(during) + interval '1 second') WHERE atom = 'GPU-A0'",
        "UPDATE device_bookings SET during = tstzrange(lower(during), upper(during) - interval '1 second') WHERE atom = 'GPU-A0'",
    ] {
        sqlx::query(sql)
            .execute(pool)
            .await
            .expect("move GPU-A0's booking");
    }
    let order: Vec<String> = sqlx::query_scalar("SELECT atom FROM device_bookings ORDER BY ctid")
        .fetch_all(pool)
        .await
        .expect("order");
    assert_eq!(
        order,
        ["GPU-A1", "GPU-A0"],
        "the table's order is not the atoms'"
    );
    let mut create = pool.begin().await.expect("begin");
    let book = |atom: &'static str| {
        format!(
            "INSERT INTO device_bookings (atom, device_id, allocation_id, during) \
             SELECT '{atom}', a.device_id, 'alc_other', tstzrange('2031-01-01T02:00:00Z', '2031-01-01T03:00:00Z') \
               FROM device_atoms a WHERE a.name = '{atom}'"
        )
    };
    sqlx::query(&book("GPU-A0"))
        .execute(&mut *create)
        .await
        .expect("GPU-A0");
    let db = app.db.db.clone().without_contention_retry();
    let rid = compute_domain::ids::ReservationId::parse("reservation", &id).expect("id");
    let extending = tokio::spawn(async move {
        compute_domain::reservations::lifecycle::extend_reservation(
            &db,
            &Actor::member("alice", compute_tests::tenant("acme")),
            &rid,
            "2031-01-01T04:00:00Z".parse().expect("time"),
            "grow",
        )
        .await
    });
    app.until_lock_waiters(1).await;
    sqlx::query(&book("GPU-A1"))
        .execute(&mut *create)
        .await
        .expect("GPU-A1 is not held by the waiting extension");
    create.commit().await.expect("commit");
    match extending.await.expect("join") {
        Err(compute_domain::Error::Conflict { message, .. }) => {
            assert!(message.contains("booked"), "{message}");
        }
        other => panic!("refused CONFLICT, not a deadlock: {other:?}"),
    }
}

/// An extension is new time, which placement would not book on a cordoned node or a
/// quarantined GPU: refused `CONFLICT` naming the node or the GPU, the reservation keeping its
/// end; once the operator lifts the cordon and the quarantine, it extends.
#[tokio::test]
async fn an_extension_is_refused_on_a_cordoned_node_or_a_quarantined_gpu() {
    let (app, p, member) = setup().await;
    let op = app.operator();
    let d = app
        .ok(
            &member,
            CREATE,
            input(&p.pool, "x", json!([{ "gpuCount": 1, "model": "H100" }])),
        )
        .await;
    let id = d["createReservation"]["reservation"]["id"].clone();
    let atom = d["createReservation"]["reservation"]["allocations"][0]["atoms"][0]
        .as_str()
        .expect("atom")
        .to_owned();
    let node = &p.nodes[0];
    let extend = |key: &str| json!({ "i": { "id": id, "endsAt": "2031-01-01T03:00:00Z", "idempotencyKey": key } });
    app.ok(
        &op,
        "mutation($id: ID!) { cordonNode(input: { id: $id }) { computeNode { cordoned } } }",
        json!({ "id": node }),
    )
    .await;
    let (code, error) = app.fails(&member, EXTEND, extend("cordoned")).await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains(&format!("node {node} is cordoned")),
        "{error}"
    );
    app.ok(
        &op,
        "mutation($id: ID!) { uncordonNode(input: { id: $id }) { computeNode { cordoned } } }",
        json!({ "id": node }),
    )
    .await;
    let (device,): (String,) = sqlx::query_as("SELECT device_id FROM device_atoms WHERE name = $1")
        .bind(&atom)
        .fetch_one(app.db.db.pool())
        .await
        .expect("device");
    app.ok(
        &op,
        "mutation($i: QuarantineDeviceInput!) { quarantineDevice(input: $i) { device { quarantined } } }",
        json!({ "i": { "id": device, "reason": "flaky memory" } }),
    )
    .await;
    let (code, error) = app.fails(&member, EXTEND, extend("quarantined")).await;
    assert_eq!(code, "CONFLICT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap_or("")
            .contains(&format!("GPU {atom} is quarantined")),
        "{error}"
    );
    app.ok(
        &op,
        "mutation($i: UnquarantineDeviceInput!) { unquarantineDevice(input: $i) { device { quarantined } } }",
        json!({ "i": { "id": device } }),
    )
    .await;
    let d = app.ok(&member, EXTEND, extend("clear")).await;
    assert_eq!(
        d["extendReservation"]["reservation"]["endsAt"],
        "2031-01-01T03:00:00+00:00"
    );
}

/// A transaction that moves two reservations wakes their instances at its commit in key order,
/// whatever order it moved the reservations in (migration 0048, as 0042 for commands): against
/// an instance batch's finish holding the first instance's `work_queue` row and reaching for
/// the second's, the commit waits for the first row and holds no other, so both go through.
/// (Enqueued in the order the reservations moved, the commit took the second instance's row,
/// waited for the first, and PostgreSQL rolled one of the two back as a deadlock.)
#[tokio::test]
async fn reservations_moved_together_wake_their_instances_in_key_order_at_commit() {
    let (app, p, member) = setup().await;
    let pool = app.db.db.pool();
    let mut ids = Vec::new();
    for (key, instance) in [("ra", "ins_rv_a"), ("rb", "ins_rv_b")] {
        let d = app
            .ok(
                &member,
                CREATE,
                input(&p.pool, key, json!([{ "gpuCount": 1, "model": "H100" }])),
            )
            .await;
        let id = d["createReservation"]["reservation"]["id"]
            .as_str()
            .expect("id")
            .to_owned();
        sqlx::query(
            "INSERT INTO instances (id, tenant_id, reservation_id, allocation_id, node_id, image, state, created_by, started_at)
             SELECT $2, 'acme', a.reservation_id, a.id, a.node_id, 'img', 'running', 'test', compute_now()
               FROM allocations a WHERE a.reservation_id = $1",
        )
        .bind(&id)
        .bind(instance)
        .execute(pool)
        .await
        .expect("a running instance");
        ids.push(id);
    }
    sqlx::query("SELECT compute_enqueue('instance', ARRAY['ins_rv_a', 'ins_rv_b'], 8, 0)")
        .execute(pool)
        .await
        .expect("the instances' rows");
    let generation = || async {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT key, gen FROM work_queue WHERE kind = 'instance' AND key LIKE 'ins_rv_%' ORDER BY key",
        )
        .fetch_all(pool)
        .await
        .expect("generations")
    };
    let before = generation().await;
    // The mover: B's reservation, then A's.
    let mut mover = pool.begin().await.expect("begin");
    for id in [&ids[1], &ids[0]] {
        sqlx::query("UPDATE reservations SET ends_at = ends_at + interval '1 hour' WHERE id = $1")
            .bind(id)
            .execute(&mut *mover)
            .await
            .expect("a reservation moves");
    }
    // The finish: A's row first, in key order.
    let mut finish = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM work_queue WHERE kind = 'instance' AND key = 'ins_rv_a' FOR UPDATE")
        .execute(&mut *finish)
        .await
        .expect("A's row");
    let committed = tokio::spawn(mover.commit());
    app.until_lock_waiters(1).await;
    sqlx::query("SELECT 1 FROM work_queue WHERE kind = 'instance' AND key = 'ins_rv_b' FOR UPDATE")
        .execute(&mut *finish)
        .await
        .expect("B's row: the mover holds no row but the one it waits for");
    finish.commit().await.expect("the finish commits");
    committed
        .await
        .expect("join")
        .expect("the mover commits: no deadlock");
    let after = generation().await;
    assert_eq!(
        after
            .iter()
            .zip(&before)
            .map(|((k, a), (_, b))| (k.as_str(), a - b))
            .collect::<Vec<_>>(),
        [("ins_rv_a", 1), ("ins_rv_b", 1)],
        "each instance woken once"
    );
}
