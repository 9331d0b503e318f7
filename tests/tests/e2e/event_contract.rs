//! Events are a public contract (`docs/webhooks.md`): this drives every event type once through
//! the domain's real code paths (commands and reconcilers, on the simulated clock) and pins
//! each payload's shape against `tests/snapshots/event-payloads.json`. Renaming a row field, or
//! a code path that writes another shape, fails here. After a deliberate change of the contract,
//! run with `UPDATE_SNAPSHOTS=1`, document it in `docs/webhooks.md` and the changelog.

use std::collections::BTreeMap;

use chrono::{Duration, Utc};
use compute_domain::actor::Actor;
use compute_domain::events::{
    CommandPayload, DevicePayload, EventSinkPayload, EventType, Family, InstancePayload,
    NodePayload, PoolPayload, QuotaPayload, ReservationPayload, SitePayload, UsagePayload,
};
use compute_domain::fleet::changes::{
    self as fleet, LayoutRequest, NewDevice, NewNode, NewPool, NewSite, PoolChanges,
};
use compute_domain::fleet::model::{
    DeviceMode, Health, Labels, Layout, PoolKind, Reason, Taint, TaintEffect,
};
use compute_domain::ids::ScopeId;
use compute_domain::quota::{self, QuotaLimits};
use compute_domain::reservations::lifecycle as rsv;
use compute_domain::reservations::model::{AllocationInput, parse_request};
use compute_domain::reservations::reconcile;
use compute_domain::sinks::{self, Scope, SinkChange};
use serde_json::{Value, json};

use compute_tests::{tenant, test_db};

/// The shape of a JSON value: objects keep their keys, arrays the merged shape of their items,
/// leaves become their JSON type; a key seen with two types gets both (`string|null`).
fn shape(v: &Value) -> Value {
    match v {
        Value::Null => json!("null"),
        Value::Bool(_) => json!("boolean"),
        Value::Number(_) => json!("number"),
        Value::String(_) => json!("string"),
        Value::Array(items) => {
            let merged = items.iter().map(shape).reduce(|a, b| merge(&a, &b));
            json!([merged.unwrap_or(json!("empty"))])
        }
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (k.clone(), shape(v))).collect())
        }
    }
}

fn merge(a: &Value, b: &Value) -> Value {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut out = x.clone();
            for (k, v) in y {
                let m = match x.get(k) {
                    Some(old) => merge(old, v),
                    None => v.clone(),
                };
                out.insert(k.clone(), m);
            }
            Value::Object(out)
        }
        (Value::Array(x), Value::Array(y)) => match (x.first(), y.first()) {
            (Some(p), Some(q)) if p == &json!("empty") => json!([q]),
            (Some(p), Some(q)) if q == &json!("empty") => json!([p]),
            (Some(p), Some(q)) => json!([merge(p, q)]),
            _ => a.clone(),
        },
        (Value::String(x), Value::String(y)) => {
            let mut kinds: Vec<&str> = x.split('|').chain(y.split('|')).collect();
            kinds.sort_unstable();
            kinds.dedup();
            json!(kinds.join("|"))
        }
        // An object or array seen null elsewhere.
        (Value::String(n), other) | (other, Value::String(n)) if n == "null" => {
            let mut o = other.clone();
            if let Value::Object(m) = &mut o {
                m.insert("(nullable)".into(), json!(true));
            }
            o
        }
        _ => a.clone(),
    }
}

/// Reads a payload back with the public type of its family (which refuses unknown fields).
fn read_back(t: EventType, data: &Value) -> Result<(), String> {
    let ok = match t.family() {
        Family::Site => serde_json::from_value::<SitePayload>(data.clone()).map(|_| ()),
        Family::Pool => serde_json::from_value::<PoolPayload>(data.clone()).map(|_| ()),
        Family::Node => serde_json::from_value::<NodePayload>(data.clone()).map(|_| ()),
        Family::Device => serde_json::from_value::<DevicePayload>(data.clone()).map(|_| ()),
        Family::Reservation => {
            serde_json::from_value::<ReservationPayload>(data.clone()).map(|_| ())
        }
        Family::Quota => serde_json::from_value::<QuotaPayload>(data.clone()).map(|_| ()),
        Family::EventSink => serde_json::from_value::<EventSinkPayload>(data.clone()).map(|_| ()),
        Family::Command => serde_json::from_value::<CommandPayload>(data.clone()).map(|_| ()),
        Family::Instance => serde_json::from_value::<InstancePayload>(data.clone()).map(|_| ()),
        Family::Usage => serde_json::from_value::<UsagePayload>(data.clone()).map(|_| ()),
        Family::JoinToken => {
            serde_json::from_value::<compute_domain::events::JoinTokenPayload>(data.clone())
                .map(|_| ())
        }
        Family::Authz => {
            serde_json::from_value::<compute_domain::events::AuthzPayload>(data.clone()).map(|_| ())
        }
    };
    ok.map_err(|e| format!("{t}: {e}: {data}"))
}

/// The gateway these tests open sessions on.
fn gw_contract() -> compute_domain::ids::GatewayId {
    compute_domain::ids::GatewayId::parse("gateway", "gw-contract").expect("a gateway id")
}

fn alloc(count: i64) -> AllocationInput {
    AllocationInput {
        gpu_count: count,
        vcpu: 4,
        memory_mib: 1024,
        disk_gib: 10,
        ..AllocationInput::default()
    }
}

#[tokio::test]
async fn every_event_payload_keeps_its_documented_shape() {
    let t = test_db().await;
    t.use_sim_clock("2031-05-01T08:00:00Z").await;
    let db = &t.db;
    let operator = Actor::operator("ops");
    let acme = Actor::member("alice", tenant("acme"));

    // Fleet: site, pool, a node with an exclusive and a MIG GPU.
    let site = fleet::create_site(
        db,
        &operator,
        NewSite {
            name: "ams1".into(),
            region: Some("eu-west".into()),
        },
        None,
    )
    .await
    .expect("site")
    .value;
    let site = fleet::update_site(db, &site.id, site.version, None, Some("eu-north".into()))
        .await
        .expect("update site");
    let pool = fleet::create_pool(
        db,
        &operator,
        NewPool {
            site_id: site.id.clone(),
            name: "h100".into(),
            kind: PoolKind::Provider,
            lost_after_seconds: Some(3600),
            vcpu_ratio: 1.0,
            memory_ratio: 1.0,
            disk_ratio: 1.0,
        },
        None,
    )
    .await
    .expect("pool")
    .value;
    let pool = fleet::update_pool(
        db,
        &pool.id,
        pool.version,
        PoolChanges {
            vcpu_ratio: Some(2.0),
            ..PoolChanges::default()
        },
    )
    .await
    .expect("update pool");
    let mig = Layout::parse(
        "layout",
        DeviceMode::Mig,
        Some(&["3g.40gb".into(), "3g.40gb".into()]),
        None,
        81_920,
    )
    .expect("layout");
    // A whole GPU with its topology, a MIG GPU without: the shape has both.
    let device = |uuid: &str, layout: Layout| NewDevice {
        uuid: compute_domain::fleet::model::GpuUuid::parse("uuid", uuid).expect("a GPU uuid"),
        vendor: "nvidia".into(),
        model: "H100".into(),
        memory_mib: 81_920,
        topology: compute_domain::fleet::model::Topology {
            pci_bus_id: matches!(layout, Layout::Exclusive).then(|| "00000000:17:00.0".into()),
            numa_node: matches!(layout, Layout::Exclusive).then_some(0),
            nvlink_domain: matches!(layout, Layout::Exclusive).then(|| "nvl-0".into()),
        },
        layout,
    };
    let node_of = |host: &str, gpus: Vec<NewDevice>| NewNode {
        pool_id: pool.id.clone(),
        hostname: host.into(),
        labels: Labels::from([("rack".to_owned(), "r1".to_owned())]),
        taints: vec![],
        vcpu: 64,
        memory_mib: 1 << 20,
        disk_gib: 1000,
        devices: gpus,
    };
    let registered = fleet::register_node(
        db,
        node_of(
            "h1",
            vec![
                device("GPU-1", Layout::Exclusive),
                device("GPU-4", Layout::Exclusive),
                device("GPU-2", mig),
            ],
        ),
    )
    .await
    .expect("register");
    let node = registered.node.clone();
    let gpu = registered.devices[0].clone();
    let node = fleet::update_node(
        db,
        &node.id,
        node.version,
        Labels::from([("rack".to_owned(), "r2".to_owned())]),
    )
    .await
    .expect("update node");
    let node = fleet::cordon_node(
        db,
        &node.id,
        None,
        Reason::parse_optional("reason", Some("maintenance")).expect("reason"),
    )
    .await
    .expect("cordon");
    let node = fleet::uncordon_node(db, &node.id, None)
        .await
        .expect("uncordon");
    let taint =
        Taint::new("taint", "dedicated", "ml", TaintEffect::PreferNoSchedule).expect("taint");
    fleet::taint_node(db, &node.id, None, taint)
        .await
        .expect("taint");
    fleet::untaint_node(db, &node.id, None, "dedicated", None)
        .await
        .expect("untaint");
    let gpu = fleet::set_device_health(
        db,
        &gpu.id,
        None,
        Health::Degraded,
        Reason::parse_optional("reason", Some("ecc")).expect("reason"),
    )
    .await
    .expect("health");
    let gpu = fleet::quarantine_device(
        db,
        &gpu.id,
        None,
        Reason::parse("reason", "burn-in").expect("reason"),
    )
    .await
    .expect("quarantine");
    let gpu = fleet::release_quarantine(db, &gpu.id, None)
        .await
        .expect("unquarantine");
    let _ = fleet::set_device_health(db, &gpu.id, None, Health::Healthy, None)
        .await
        .expect("healthy");
    let spare = fleet::register_node(db, node_of("h2", vec![device("GPU-3", Layout::Exclusive)]))
        .await
        .expect("spare");
    fleet::change_device_mode(
        db,
        &spare.devices[0].id,
        spare.devices[0].version,
        LayoutRequest {
            mode: DeviceMode::TimeSlice,
            mig_profiles: None,
            slots: Some(4),
        },
        0,
    )
    .await
    .expect("mode");

    // Quotas and sinks.
    quota::set_quota(
        db,
        &operator,
        &tenant("acme"),
        &ScopeId::Pool(pool.id.clone()),
        QuotaLimits {
            gpus: Some(8.0),
            vcpu: Some(64),
            memory_mib: None,
        },
    )
    .await
    .expect("quota");
    let scope = Scope {
        tenant_id: Some(tenant("acme")),
    };
    let (sink, _) = sinks::create(
        db,
        &scope,
        "alice",
        "https://example.com/hooks",
        vec!["reservation.active".into()],
        1,
    )
    .await
    .expect("sink");
    let (sink, _) = sinks::update(
        db,
        &scope,
        "alice",
        &sink.id,
        SinkChange {
            active: Some(false),
            ..SinkChange::default()
        },
    )
    .await
    .expect("update sink");
    sinks::delete(db, &scope, &sink.id)
        .await
        .expect("delete sink");

    // Reservations, through every state.
    let now = db.compute_now().await.expect("now");
    let request = |start: Option<chrono::DateTime<Utc>>, hours: i64, gpus: i64| {
        let s = start.unwrap_or(now);
        parse_request(
            pool.id.as_str(),
            start,
            s + Duration::hours(hours),
            &[alloc(gpus)],
            None,
        )
        .expect("request")
    };
    // An instance through every state, its daemon answering as a real one would; then its
    // reservation is released, so the GPU is free for what follows.
    {
        use compute_domain::instances::{self as ins, InstanceRequest};
        use compute_domain::node_commands as cmds;
        let r = rsv::create_reservation(db, &acme, request(None, 2, 1), "k-inst")
            .await
            .expect("a reservation for an instance")
            .0
            .value;
        let (allocation, node): (String, String) =
            sqlx::query_as("SELECT id, node_id FROM allocations WHERE reservation_id = $1")
                .bind(&r.id)
                .fetch_one(db.pool())
                .await
                .expect("its allocation");
        let node = compute_domain::ids::NodeId::parse("node", &node).expect("node");
        // Its GPU unhealthy, then healthy again: `reservation.conditions_changed` twice. Both
        // whole GPUs of h1, whichever placement took, so the devices' `healthSince` in later
        // node events is the same in every run.
        for gpu in &registered.devices[..2] {
            for health in [Health::Unhealthy, Health::Healthy] {
                fleet::set_device_health(db, &gpu.id, None, health, None)
                    .await
                    .expect("health");
            }
        }
        let hello = compute_domain::node_sessions::Hello {
            daemon_version: compute_domain::node_sessions::Label::parse("daemonVersion", "sim/1")
                .expect("label"),
            journal_id: compute_domain::node_sessions::Label::parse("journalId", "j-inst")
                .expect("label"),
            observed_generation: 0,
        };
        let epoch = compute_domain::node_sessions::open(db, &node, &gw_contract(), 1, &hello)
            .await
            .expect("a session");
        // Runs the step's command as the daemon would: acknowledged, then this outcome.
        let answer = |instance: compute_domain::ids::InstanceId, step: &'static str, ok: bool| {
            let node = node.clone();
            async move {
                cmds::dispatch_node(db, &node).await.expect("dispatch");
                let (id,): (String,) =
                    sqlx::query_as("SELECT id FROM commands WHERE idempotency_key = $1")
                        .bind(ins::step_key(&instance, step))
                        .fetch_one(db.pool())
                        .await
                        .expect("the step's command");
                let id = compute_domain::ids::CommandId::parse("id", &id).expect("id");
                cmds::ack(db, &node, epoch, &id).await.expect("ack");
                let report = cmds::Report::parse(
                    ok,
                    json!({}),
                    // Not `DEVICE_OVERLAP`: its GPU would stay held to the window's end, and
                    // the reservations below need it.
                    (!ok).then(|| "START_FAILED".to_owned()),
                    None,
                )
                .expect("valid Report");
                cmds::finish(db, &node, epoch, &id, &report)
                    .await
                    .expect("finish");
                ins::reconcile(db, &instance).await.expect("step")
            }
        };
        let new_instance = |key: &'static str| {
            let (allocation, acme) = (allocation.clone(), acme.clone());
            async move {
                let req = InstanceRequest::parse(
                    compute_domain::ids::AllocationId::parse("a", &allocation).expect("allocation"),
                    "img".into(),
                    vec!["run".into()],
                    [("A".to_owned(), "1".to_owned())].into(),
                )
                .expect("valid InstanceRequest");
                let i = ins::create_instance(db, &acme, req, key)
                    .await
                    .expect("an instance")
                    .value;
                ins::reconcile(db, &i.id).await.expect("first step");
                i.id
            }
        };
        let first = new_instance("k-i1").await;
        answer(first.clone(), "run", true).await;
        ins::stop_instance(db, &acme, &first).await.expect("stop");
        ins::reconcile(db, &first).await.expect("stopping");
        let stopped = answer(first.clone(), "stop", true).await;
        assert_eq!(stopped.moved, [ins::State::Stopped]);
        let second = new_instance("k-i2").await;
        let failed = answer(second, "run", false).await;
        assert_eq!(failed.moved, [ins::State::Failed]);
        // A third runs, and its workload exits on its own.
        let third = new_instance("k-i3").await;
        answer(third.clone(), "run", true).await;
        let exit = ins::ReportedExit::parse(Some(3), None, 1.0).expect("valid ReportedExit");
        let exited = ins::record_exit(db, &node, epoch, &third, exit)
            .await
            .expect("record the exit");
        let ins::ExitRecord::Recorded(exited) = exited else {
            panic!("not recorded: {exited:?}");
        };
        assert_eq!(exited.state, ins::State::Exited);
        // Reported again on the same session: nothing to record, and the daemon may forget it.
        assert!(matches!(
            ins::record_exit(db, &node, epoch, &third, exit)
                .await
                .expect("again"),
            ins::ExitRecord::Nothing
        ));
        compute_domain::node_sessions::close(
            db,
            &node,
            epoch,
            compute_domain::node_sessions::CloseReason::DaemonClosed,
        )
        .await
        .expect("close");
        // On a session no longer current: nothing recorded, and the gateway ends that session
        // so the daemon reports it again on its next one.
        assert!(matches!(
            ins::record_exit(db, &node, epoch, &third, exit)
                .await
                .expect("on a closed session"),
            ins::ExitRecord::SessionNotCurrent
        ));
        rsv::release_reservation(db, &acme, &r.id, None)
            .await
            .expect("release");
    }
    let active = rsv::create_reservation(db, &acme, request(None, 2, 1), "k-active")
        .await
        .expect("active")
        .0
        .value;
    rsv::extend_reservation(
        db,
        &acme,
        &active.id,
        active.ends_at + Duration::hours(1),
        "k-extend",
    )
    .await
    .expect("extend");
    rsv::release_reservation(db, &acme, &active.id, None)
        .await
        .expect("release");
    let later = rsv::create_reservation(
        db,
        &acme,
        request(Some(now + Duration::hours(1)), 1, 1),
        "k-later",
    )
    .await
    .expect("later")
    .0
    .value;
    rsv::cancel_reservation(db, &acme, &later.id, None)
        .await
        .expect("cancel");
    rsv::create_reservation(db, &acme, request(None, 1, 3), "k-pending")
        .await
        .expect("pending");
    // A gang whose first allocation keeps its GPUs on one NVLink domain: the payload carries
    // the rule and the allocation's flags (it stays pending: the node has too few GPUs).
    rsv::create_reservation(
        db,
        &acme,
        parse_request(
            pool.id.as_str(),
            None,
            now + Duration::hours(1),
            &[
                AllocationInput {
                    same_nvlink_domain: true,
                    ..alloc(2)
                },
                alloc(1),
            ],
            Some(&compute_domain::reservations::model::GangInput {
                colocate: Some(compute_domain::reservations::model::Colocate::Label),
                label: Some("rack".into()),
                spread: Some(true),
            }),
        )
        .expect("a gang"),
        "k-gang",
    )
    .await
    .expect("gang");
    // From here on the pool's rules report a reservation idle after 5 minutes without an
    // instance: the one that starts in 10 minutes is idle 5 minutes after its start.
    let version: i64 = sqlx::query_scalar("SELECT version FROM pools WHERE id = $1")
        .bind(pool.id.as_str())
        .fetch_one(db.pool())
        .await
        .expect("pool version");
    fleet::update_pool(
        db,
        &pool.id,
        version,
        PoolChanges {
            rules: Some(
                compute_domain::fleet::PoolRules::parse(None, None, None, None, Some(300), None)
                    .expect("rules"),
            ),
            ..PoolChanges::default()
        },
    )
    .await
    .expect("idle rules");
    rsv::create_reservation(
        db,
        &acme,
        request(Some(now + Duration::minutes(10)), 1, 1),
        "k-starts",
    )
    .await
    .expect("starts");
    let doomed = rsv::create_reservation(db, &acme, request(None, 5, 1), "k-doomed")
        .await
        .expect("doomed")
        .0
        .value;
    t.advance_clock(15 * 60).await;
    assert!(
        reconcile::activate_due(db).await.expect("activate") >= 1,
        "the batch path writes reservation.active"
    );
    assert!(
        reconcile::mark_idle(db).await.expect("mark idle") >= 1,
        "an idle reservation writes reservation.idle"
    );
    sqlx::query("UPDATE pools SET kind = 'provider' WHERE id IN (SELECT n.pool_id FROM nodes n JOIN allocations a ON a.node_id = n.id WHERE a.reservation_id = $1)")
        .bind(&doomed.id)
        .execute(db.pool())
        .await
        .expect("a provider pool");
    sqlx::query("UPDATE nodes SET reachability = 'lost' WHERE id IN (SELECT node_id FROM allocations WHERE reservation_id = $1)")
        .bind(&doomed.id)
        .execute(db.pool())
        .await
        .expect("lose the node");
    reconcile::fail_lost(db).await.expect("fail lost");
    t.advance_clock(2 * 3600).await;
    reconcile::expire_due(db).await.expect("expire");

    // Drain and retire the spare (its mode-change hold has ended).
    fleet::drain_node(db, &spare.node.id, None)
        .await
        .expect("drain");
    fleet::retire_device(db, &spare.devices[0].id, None)
        .await
        .expect("retire its GPU");
    fleet::retire_node(db, &spare.node.id, None)
        .await
        .expect("retire");

    // A daemon's session on h1 opens and closes; the liveness pass makes the nodes unreachable,
    // then (a provider pool, lostAfter 1 h) lost.
    let hello = compute_domain::node_sessions::Hello {
        daemon_version: compute_domain::node_sessions::Label::parse("daemonVersion", "sim/1")
            .expect("label"),
        journal_id: compute_domain::node_sessions::Label::parse("journalId", "j1").expect("label"),
        observed_generation: 0,
    };
    let h1 = registered.node.id.clone();
    let epoch = compute_domain::node_sessions::open(db, &h1, &gw_contract(), 1, &hello)
        .await
        .expect("open a session");
    // Its daemon reports an inventory without GPU-4, then the whole machine again.
    {
        use compute_protocol::{GpuInventory, Inventory, MigInstance};
        let gpu = |uuid: &str, mig: &[&str]| GpuInventory {
            uuid: uuid.into(),
            vendor: "nvidia".into(),
            model: "H100".into(),
            memory_mib: 81_920,
            pci_bus_id: None,
            numa_node: None,
            nvlink_domain: None,
            mig_enabled: !mig.is_empty(),
            mig: mig
                .iter()
                .map(|p| MigInstance {
                    uuid: format!("MIG-{p}"),
                    profile: (*p).into(),
                })
                .collect(),
        };
        let mut inv = Inventory {
            hostname: "h1".into(),
            vcpu: 64,
            memory_mib: 1 << 20,
            disk_gib: 1000,
            gpus: vec![gpu("GPU-1", &[]), gpu("GPU-2", &["3g.40gb", "3g.40gb"])],
        };
        let d = fleet::report_inventory(db, &h1, epoch, &inv)
            .await
            .expect("report")
            .expect("current");
        assert_eq!(d, ["GPU GPU-4 (H100) is missing from the machine"]);
        inv.gpus.push(gpu("GPU-4", &[]));
        let d = fleet::report_inventory(db, &h1, epoch, &inv)
            .await
            .expect("report")
            .expect("current");
        assert!(d.is_empty(), "{d:?}");
        // A join token made, one revoked, one used by a machine that joins, which is retired.
        use compute_domain::fleet::enrollment::{self, NewJoinToken};
        let new_token = |key: &'static str| {
            let (operator, pool) = (operator.clone(), pool.id.clone());
            async move {
                enrollment::create_join_token(
                    db,
                    &operator,
                    NewJoinToken {
                        pool_id: pool,
                        expires_in_seconds: 600,
                        labels: Labels::from([("joined".to_owned(), "yes".to_owned())]),
                    },
                    Some(key.into()),
                )
                .await
                .expect("a join token")
                .value
            }
        };
        let revoked = new_token("t-revoked").await;
        enrollment::revoke_join_token(db, &operator, &revoked.token.id)
            .await
            .expect("revoke");
        let used = new_token("t-used").await;
        let joined = enrollment::join(
            db,
            used.secret.as_deref().expect("the secret"),
            None,
            &Inventory {
                hostname: "h9".into(),
                gpus: vec![gpu("GPU-9", &[])],
                ..inv.clone()
            },
        )
        .await
        .expect("join")
        .expect("joined");
        fleet::retire_node(db, &joined.registered.node.id, None)
            .await
            .expect("retire the joined node");
    }
    // Commands on h1: one succeeds (with progress), one fails, one is cancelled, one is taken
    // back by a newer session of the daemon.
    use compute_domain::node_commands::{self as cmds, CommandRequest, Kind, Report};
    let run = |kind: Kind, key: &'static str| {
        let (operator, h1) = (operator.clone(), h1.clone());
        async move {
            cmds::run_command(
                db,
                &operator,
                CommandRequest::parse(h1, kind, json!({}), 0, None).expect("valid CommandRequest"),
                key,
            )
            .await
            .expect("run a command")
            .value
        }
    };
    let ok = run(Kind::Noop, "c-ok").await;
    let bad = run(Kind::ResetGpu, "c-bad").await;
    cmds::dispatch_node(db, &h1).await.expect("dispatch");
    assert_eq!(
        cmds::ack(db, &h1, epoch, &ok.id).await.expect("ack"),
        cmds::AckAnswer::Proceed
    );
    assert!(
        cmds::progress(db, &h1, epoch, &ok.id, &json!({ "percent": 50 }))
            .await
            .expect("progress")
    );
    let report = |succeeded: bool| {
        Report::parse(
            succeeded,
            json!({}),
            (!succeeded).then(|| "GPU_BUSY".to_owned()),
            (!succeeded).then(|| "the GPU is busy".to_owned()),
        )
        .expect("valid Report")
    };
    for (c, succeeded) in [(&ok, true), (&bad, false)] {
        assert!(
            cmds::finish(db, &h1, epoch, &c.id, &report(succeeded))
                .await
                .expect("finish")
                .is_some()
        );
    }
    let withdrawn = run(Kind::Noop, "c-cancel").await;
    cmds::cancel(db, &operator, &withdrawn.id)
        .await
        .expect("cancel");
    run(Kind::Noop, "c-requeue").await;
    cmds::dispatch_node(db, &h1).await.expect("dispatch");
    let epoch = compute_domain::node_sessions::open(db, &h1, &gw_contract(), 1, &hello)
        .await
        .expect("a newer session takes the command back");
    compute_domain::node_sessions::close(
        db,
        &h1,
        epoch,
        compute_domain::node_sessions::CloseReason::DaemonClosed,
    )
    .await
    .expect("close it");
    t.advance_clock(41).await;
    compute_domain::node_sessions::liveness_pass(db)
        .await
        .expect("unreachable");
    t.advance_clock(3601).await;
    compute_domain::node_sessions::liveness_pass(db)
        .await
        .expect("lost");

    // Usage: the windows the scenario's bookings held are closed (usage.window_closed); then a
    // booking inside a closed window is corrected in SQL and announced as a reservation change,
    // as a late change would be, and the meter's check adjusts the window (usage.window_adjusted).
    // Grants: one given, one taken back (a member's sink paused with it).
    {
        use compute_domain::authz::{self, GrantRole, GrantSpec, Principal};
        let admin = Actor::operator("root");
        let spec = |role: GrantRole, tenant: Option<&str>| {
            GrantSpec::new(
                Principal::parse("subject", "compute-dev", "bob").expect("a principal"),
                role,
                tenant.map(compute_tests::tenant),
                None,
            )
            .expect("a grant")
        };
        authz::grant(db, &admin, spec(GrantRole::Member, Some("acme")), None)
            .await
            .expect("grant");
        authz::revoke(db, &admin, spec(GrantRole::Member, Some("acme")), None)
            .await
            .expect("revoke");
    }

    t.advance_clock(2 * 3600).await;
    let pass = compute_domain::usage::meter_pass(db, 1000)
        .await
        .expect("the meter closes the windows");
    assert!(pass.records > 0, "{pass:?}");
    sqlx::query(
        "WITH one AS (SELECT b.id, a.reservation_id FROM device_bookings b JOIN allocations a ON a.id = b.allocation_id
                       JOIN usage_records u ON u.allocation_id = a.id AND u.seq = 0
                      WHERE upper(b.during) - lower(b.during) > interval '2 minutes' ORDER BY b.id LIMIT 1),
              cut AS (UPDATE device_bookings b SET during = tstzrange(lower(b.during), lower(b.during) + interval '1 minute')
                        FROM one WHERE b.id = one.id RETURNING one.reservation_id)
         SELECT compute_emit('reservation.' || r.state, r.tenant_id, r.id, compute_reservation_payload(r.id))
           FROM reservations r JOIN cut ON cut.reservation_id = r.id",
    )
    .execute(db.pool())
    .await
    .expect("a correction inside a closed window");
    let pass = compute_domain::usage::settle(
        db,
        std::time::Duration::from_millis(20),
        std::time::Duration::from_secs(30),
    )
    .await
    .expect("the meter adjusts");
    assert!(pass.checked > 0, "{pass:?}");

    // Every type was written; each reads back as its public type; shapes match the snapshot.
    let rows: Vec<(String, Value)> =
        sqlx::query_as("SELECT type, data FROM outbox ORDER BY txid, seq")
            .fetch_all(db.pool())
            .await
            .expect("outbox");
    let mut shapes: BTreeMap<String, Value> = BTreeMap::new();
    let mut problems = Vec::new();
    for (ty, data) in &rows {
        let Some(t) = EventType::parse(ty) else {
            problems.push(format!("`{ty}` is not an EventType"));
            continue;
        };
        if let Err(e) = read_back(t, data) {
            problems.push(e);
        }
        // `Event.payload`, the typed union, reads every event too.
        match compute_api::graph::payloads::payload(ty, data) {
            Ok(Some(_)) => {}
            Ok(None) => problems.push(format!("{ty}: Event.payload is null")),
            Err(e) => problems.push(format!("{ty}: Event.payload: {e}")),
        }
        let s = shape(data);
        let merged = match shapes.get(ty) {
            Some(old) => merge(old, &s),
            None => s,
        };
        shapes.insert(ty.clone(), merged);
    }
    for t in EventType::ALL {
        if !shapes.contains_key(t.as_str()) {
            problems.push(format!("no `{t}` event was written by the scenario"));
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    let actual = serde_json::to_string_pretty(&shapes).expect("json") + "\n";
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshots/event-payloads.json");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &actual).expect("write the snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        expected == actual,
        "event payload shapes differ from {} (a webhook body would change). If deliberate, run with \
         UPDATE_SNAPSHOTS=1, document it in docs/webhooks.md and docs/changelog.md.\n--- actual:\n{actual}",
        path.display()
    );
}
