//! Topology and gangs (issue 38, section 2), through GraphQL against the real placement:
//! GPUs kept on one NVLink domain or NUMA node, and reservations whose allocations are placed
//! together on one node or one rack, or spread over distinct nodes, all of them or none; the
//! availability search answers for them as placement places them.

use compute_tests::TestApp;
use serde_json::{Value, json};

use crate::fleet::REGISTER;

const CREATE: &str = "mutation($i: CreateReservationInput!) { createReservation(input: $i) { \
    reservation { id state gang { colocate label spread } conditions { type reason message counts { reason count } } \
    allocations { gpuCount sameNvlinkDomain sameNumaNode atoms computeNodeId } } } }";
const AVAILABILITY: &str = "query($p: ID!, $a: [AllocationInput!]!, $d: Int!, $g: GangInput) { \
    availability(poolId: $p, allocations: $a, durationSeconds: $d, gang: $g) { \
      windows { startsAt latestStart placements { allocation computeNodeId freeAtoms } } unschedulable { reason count } message } }";

/// The fleet of these tests: four nodes in two racks, with what they know of their topology.
struct Racks {
    pool: String,
    /// By host name: `n1`, `n2` (rack r1), `n3`, `n4` (rack r2).
    nodes: std::collections::BTreeMap<String, String>,
}

/// `n1`: 8 H100 on two NVLink domains (GPUs 0-3 and 4-7) and two NUMA nodes (even and odd
/// GPUs); `n2`: 4 on one domain; `n3`: 4 of unknown topology; `n4`: 2 on one domain.
async fn racks(app: &TestApp) -> Racks {
    let op = app.operator();
    let (_, pool) = crate::fleet::site_with_pool(
        app,
        "gang-site",
        json!({ "name": "gangs", "kind": "BARE_METAL" }),
    )
    .await;
    let gpu = |host: &str, g: usize, nvl: Option<String>, numa: Option<usize>| {
        let mut d = json!({ "uuid": format!("GPU-{}-{g}", host.to_uppercase()), "model": "H100", "memoryMib": 81559,
                            "pciBusId": format!("00000000:{:02x}:00.0", 0x17 + g) });
        if let Some(n) = nvl {
            d["nvlinkDomain"] = json!(n);
        }
        if let Some(n) = numa {
            d["numaNode"] = json!(n);
        }
        d
    };
    let mut nodes = std::collections::BTreeMap::new();
    for (host, rack, gpus) in [
        (
            "n1",
            "r1",
            (0..8)
                .map(|g| gpu("n1", g, Some(format!("n1-nvl-{}", g / 4)), Some(g % 2)))
                .collect::<Vec<_>>(),
        ),
        (
            "n2",
            "r1",
            (0..4)
                .map(|g| gpu("n2", g, Some("n2-nvl".into()), Some(0)))
                .collect(),
        ),
        (
            "n3",
            "r2",
            (0..4).map(|g| gpu("n3", g, None, None)).collect(),
        ),
        (
            "n4",
            "r2",
            (0..2)
                .map(|g| gpu("n4", g, Some("n4-nvl".into()), Some(0)))
                .collect(),
        ),
    ] {
        let d = app
            .ok(&op, REGISTER, json!({ "i": { "poolId": pool, "hostname": host,
                "labels": [{ "key": "host", "value": host }, { "key": "rack", "value": rack }],
                "resources": { "vcpu": 64, "memoryMib": 262144, "diskGib": 1000 }, "devices": gpus } }))
            .await;
        nodes.insert(
            host.to_owned(),
            d["registerNode"]["computeNode"]["id"]
                .as_str()
                .expect("node")
                .to_owned(),
        );
    }
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": pool, "gpus": 64 } }),
    )
    .await;
    Racks { pool, nodes }
}

fn create(pool: &str, key: &str, start: &str, end: &str, allocations: Value, gang: Value) -> Value {
    json!({ "i": { "poolId": pool, "startsAt": start, "endsAt": end, "allocations": allocations,
                   "gang": gang, "idempotencyKey": key } })
}

/// The GPU indexes (on its node) of an allocation's atoms, from their names (`GPU-N1-5`).
fn gpu_indexes(allocation: &Value) -> Vec<usize> {
    allocation["atoms"]
        .as_array()
        .expect("atoms")
        .iter()
        .map(|a| {
            a.as_str()
                .and_then(|s| s.rsplit('-').next())
                .and_then(|n| n.parse().ok())
                .expect("an exclusive GPU's atom")
        })
        .collect()
}

fn nodes_of(r: &Value) -> Vec<String> {
    r["allocations"]
        .as_array()
        .expect("allocations")
        .iter()
        .map(|a| a["computeNodeId"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[tokio::test]
async fn gpus_kept_on_one_nvlink_domain_or_numa_node_as_the_topology_says() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let r = racks(&app).await;
    let op = app.operator();
    let acme = app.member("acme");

    // The topology as registered, the bus id written as NVML writes it.
    let d = app
        .ok(
            &op,
            "query($id: ID!) { node(id: $id) { ... on ComputeNode { devices { uuid pciBusId numaNode nvlinkDomain } } } }",
            json!({ "id": r.nodes["n1"] }),
        )
        .await;
    let devices = d["node"]["devices"].as_array().expect("devices");
    let five = devices
        .iter()
        .find(|d| d["uuid"] == "GPU-N1-5")
        .expect("GPU 5");
    assert_eq!(
        five,
        &json!({ "uuid": "GPU-N1-5", "pciBusId": "00000000:1C:00.0", "numaNode": 1, "nvlinkDomain": "n1-nvl-1" })
    );
    // Bad topology is refused where it enters, naming the field; nothing is registered.
    let nodes_before = app.count("nodes").await;
    for (device, field) in [
        (
            json!({ "uuid": "GPU-X0", "model": "H100", "memoryMib": 1, "numaNode": 5000 }),
            "devices[0].numaNode",
        ),
        (
            json!({ "uuid": "GPU-X0", "model": "H100", "memoryMib": 1, "pciBusId": "17:00.0; rm" }),
            "devices[0].pciBusId",
        ),
        (
            json!({ "uuid": "GPU-X0", "model": "H100", "memoryMib": 1, "nvlinkDomain": "" }),
            "devices[0].nvlinkDomain",
        ),
    ] {
        let (code, e) = app
            .fails(
                &op,
                REGISTER,
                json!({ "i": { "poolId": r.pool, "hostname": "bad",
                "resources": { "vcpu": 1, "memoryMib": 1, "diskGib": 1 }, "devices": [device] } }),
            )
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{e}");
        assert_eq!(e["extensions"]["field"], field, "{e}");
    }
    assert_eq!(app.count("nodes").await, nodes_before);

    let on = |host: &str, n: usize, nvl: bool, numa: bool| {
        json!([{ "gpuCount": n, "nodeSelector": [{ "key": "host", "value": host }],
                 "sameNvlinkDomain": nvl, "sameNumaNode": numa }])
    };
    let (t0, t2, t4) = (
        "2031-01-01T00:00:00Z",
        "2031-01-01T02:00:00Z",
        "2031-01-01T04:00:00Z",
    );
    // Four GPUs on one NVLink domain of n1: GPUs 0-3 or 4-7, never a mix.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "nvl",
                t0,
                t2,
                on("n1", 4, true, false),
                Value::Null,
            ),
        )
        .await;
    let a = &d["createReservation"]["reservation"]["allocations"][0];
    assert_eq!(a["sameNvlinkDomain"], true);
    let mut gpus = gpu_indexes(a);
    gpus.sort_unstable();
    assert!(gpus == [0, 1, 2, 3] || gpus == [4, 5, 6, 7], "{gpus:?}");
    let taken_domain = gpus[0] / 4;
    // The other domain is free, so four more on one domain fit now; but four on one NUMA node
    // do not (two even and two odd GPUs are left), until the first reservation ends.
    let d = app
        .ok(
            &acme,
            AVAILABILITY,
            json!({ "p": r.pool, "a": on("n1", 4, false, true), "d": 3600 }),
        )
        .await;
    let windows = d["availability"]["windows"].as_array().expect("windows");
    assert_eq!(windows[0]["startsAt"], "2031-01-01T02:00:00+00:00", "{d}");
    assert_eq!(
        windows[0]["placements"][0]["freeAtoms"], 4,
        "one NUMA node's GPUs"
    );
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "numa-early",
                t0,
                t2,
                on("n1", 4, false, true),
                Value::Null,
            ),
        )
        .await;
    let pending = &d["createReservation"]["reservation"];
    assert_eq!(pending["state"], "PENDING", "{pending}");
    assert_eq!(
        pending["conditions"][0]["counts"],
        json!([{ "reason": "NodeSelectorMismatch", "count": 3 }, { "reason": "InsufficientGpus", "count": 1 }])
    );
    let message = pending["conditions"][0]["message"].as_str().unwrap_or("");
    assert!(message.contains("4 GPUs on one NUMA node"), "{message}");
    // Without the rule the same four GPUs fit now.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "plain",
                t0,
                t2,
                on("n1", 4, false, false),
                Value::Null,
            ),
        )
        .await;
    let plain = &d["createReservation"]["reservation"];
    assert_eq!(plain["state"], "ACTIVE", "{plain}");
    let mut rest = gpu_indexes(&plain["allocations"][0]);
    rest.sort_unstable();
    assert!(rest.iter().all(|g| g / 4 != taken_domain), "{rest:?}");
    // At 02:00, where availability said, one NUMA node's four GPUs are placed.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "numa",
                t2,
                t4,
                on("n1", 4, false, true),
                Value::Null,
            ),
        )
        .await;
    let a = &d["createReservation"]["reservation"]["allocations"][0];
    let gpus = gpu_indexes(a);
    assert_eq!(gpus.len(), 4);
    assert!(
        gpus.iter().all(|g| g % 2 == gpus[0] % 2),
        "one NUMA node: {gpus:?}"
    );

    // A GPU of unknown topology is a domain of its own: one fits, two never do on n3.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "n3-one",
                t0,
                t2,
                on("n3", 1, true, true),
                Value::Null,
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "ACTIVE");
    let d = app
        .ok(
            &acme,
            AVAILABILITY,
            json!({ "p": r.pool, "a": on("n3", 2, true, false), "d": 3600 }),
        )
        .await;
    assert_eq!(d["availability"]["windows"], json!([]), "{d}");
    assert_eq!(
        d["availability"]["unschedulable"],
        json!([{ "reason": "NodeSelectorMismatch", "count": 3 }, { "reason": "InsufficientGpus", "count": 1 }])
    );
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "n3-two",
                t2,
                t4,
                on("n3", 2, true, false),
                Value::Null,
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "PENDING");
}

#[tokio::test]
async fn a_gang_is_placed_together_or_apart_all_of_it_or_none() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let r = racks(&app).await;
    let acme = app.member("acme");
    let host_of: std::collections::BTreeMap<String, String> = r
        .nodes
        .iter()
        .map(|(h, id)| (id.clone(), h.clone()))
        .collect();
    let rack_of = |id: &str| {
        if ["n1", "n2"].contains(&host_of[id].as_str()) {
            "r1"
        } else {
            "r2"
        }
    };
    let gpus = |n: usize, k: usize| json!(vec![json!({ "gpuCount": n }); k]);
    let (t0, t2, t4) = (
        "2031-01-01T00:00:00Z",
        "2031-01-01T02:00:00Z",
        "2031-01-01T04:00:00Z",
    );

    // Bad rules are refused where they enter, and nothing is written.
    let before = app.count("reservations").await;
    for (gang, field) in [
        (json!({ "colocate": "LABEL" }), "gang.label"),
        (json!({ "colocate": "NODE", "label": "rack" }), "gang.label"),
        (json!({ "colocate": "NODE", "spread": true }), "gang.spread"),
        (json!({}), "gang"),
        (
            json!({ "colocate": "LABEL", "label": "no spaces" }),
            "gang.label",
        ),
    ] {
        let (code, e) = app
            .fails(
                &acme,
                CREATE,
                create(&r.pool, "bad", t0, t2, gpus(1, 2), gang),
            )
            .await;
        assert_eq!(code, "BAD_USER_INPUT", "{e}");
        assert_eq!(e["extensions"]["field"], field, "{e}");
    }
    assert_eq!(app.count("reservations").await, before);

    // Two allocations of three GPUs on one node: only n1 has six.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "node",
                t0,
                t2,
                gpus(3, 2),
                json!({ "colocate": "NODE" }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(
        rsv["gang"],
        json!({ "colocate": "NODE", "label": null, "spread": false })
    );
    let nodes = nodes_of(rsv);
    assert_eq!(nodes, vec![r.nodes["n1"].clone(); 2], "{rsv}");
    // Three of four GPUs in one rack: r1 has n1's two left and n2's four.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "rack",
                t0,
                t2,
                gpus(2, 3),
                json!({ "colocate": "LABEL", "label": "rack" }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(rsv["state"], "ACTIVE", "{rsv}");
    assert!(nodes_of(rsv).iter().all(|n| rack_of(n) == "r1"), "{rsv}");
    // Spread: two single GPUs on two distinct nodes; r1 is full, so n3 and n4, where the
    // tightest node alone would have taken both.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "spread",
                t0,
                t2,
                gpus(1, 2),
                json!({ "spread": true }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(rsv["state"], "ACTIVE", "{rsv}");
    let mut spread = nodes_of(rsv);
    spread.sort();
    let mut r2 = vec![r.nodes["n3"].clone(), r.nodes["n4"].clone()];
    r2.sort();
    assert_eq!(spread, r2, "{rsv}");

    // A gang that cannot fit: two allocations of five GPUs on one node (n1 has eight, but not
    // ten). Each fits alone, never together: PENDING, with nothing booked.
    let bookings = app.count("device_bookings").await;
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "too-big",
                t2,
                t4,
                gpus(5, 2),
                json!({ "colocate": "NODE" }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(rsv["state"], "PENDING", "{rsv}");
    assert_eq!(
        rsv["conditions"][0]["counts"],
        json!([{ "reason": "AllocationsConflict", "count": 4 }])
    );
    let message = rsv["conditions"][0]["message"].as_str().unwrap_or("");
    assert!(
        message.contains("never all together on one node"),
        "{message}"
    );
    assert!(nodes_of(rsv).iter().all(String::is_empty));
    assert_eq!(
        app.count("device_bookings").await,
        bookings,
        "nothing booked"
    );
    // Availability says the same, for the same reason.
    let d = app
        .ok(
            &acme,
            AVAILABILITY,
            json!({ "p": r.pool, "a": gpus(5, 2), "d": 3600, "g": { "colocate": "NODE" } }),
        )
        .await;
    assert_eq!(d["availability"]["windows"], json!([]));
    assert_eq!(
        d["availability"]["unschedulable"],
        json!([{ "reason": "AllocationsConflict", "count": 4 }])
    );

    // Until 02:00 n1 is full, and six GPUs on one node fit nowhere else: from 02:00, on n1.
    let d = app
        .ok(
            &acme,
            AVAILABILITY,
            json!({ "p": r.pool, "a": gpus(3, 2), "d": 3600, "g": { "colocate": "NODE" } }),
        )
        .await;
    let w = &d["availability"]["windows"][0];
    assert_eq!(w["startsAt"], "2031-01-01T02:00:00+00:00", "{d}");
    let picks: Vec<&str> = w["placements"]
        .as_array()
        .expect("placements")
        .iter()
        .map(|p| p["computeNodeId"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(picks, vec![r.nodes["n1"].as_str(); 2]);
    // A create just before waits; at the window's start it is placed where it said.
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "node-early",
                "2031-01-01T01:59:00Z",
                t4,
                gpus(3, 2),
                json!({ "colocate": "NODE" }),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "PENDING");
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "node-at",
                t2,
                t4,
                gpus(3, 2),
                json!({ "colocate": "NODE" }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(rsv["state"], "SCHEDULED", "{rsv}");
    assert_eq!(nodes_of(rsv), vec![r.nodes["n1"].clone(); 2]);

    // Five single GPUs spread: four nodes only, never.
    let d = app
        .ok(
            &acme,
            AVAILABILITY,
            json!({ "p": r.pool, "a": gpus(1, 5), "d": 3600, "g": { "spread": true } }),
        )
        .await;
    assert_eq!(d["availability"]["windows"], json!([]), "{d}");
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "spread-5",
                t2,
                t4,
                gpus(1, 5),
                json!({ "spread": true }),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "PENDING");
    // Two GPUs on distinct nodes of one rack, from 02:00: r2's n3 and n4 are free then (n1 is
    // held by `node-at`; r1 still has n2, so either rack may be chosen, on two nodes of it).
    let d = app
        .ok(
            &acme,
            CREATE,
            create(
                &r.pool,
                "rack-spread",
                t2,
                t4,
                gpus(2, 2),
                json!({ "colocate": "LABEL", "label": "rack", "spread": true }),
            ),
        )
        .await;
    let rsv = &d["createReservation"]["reservation"];
    assert_eq!(rsv["state"], "SCHEDULED", "{rsv}");
    let two = nodes_of(rsv);
    assert_ne!(two[0], two[1], "{rsv}");
    assert_eq!(rack_of(&two[0]), rack_of(&two[1]), "{rsv}");
}

/// Two allocations that each keep four GPUs on one NVLink domain fit on n1, one domain each,
/// as a gang on one node and without a gang, where `availability` offers them. (Placement left
/// the plan's taken atoms out after an allocation picked its domain: both picked the first, the
/// second found none of its four there, and the reservation waited for a node it could never
/// get.)
#[tokio::test]
async fn allocations_that_keep_their_gpus_together_share_a_node_one_group_each() {
    let app = compute_tests::spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let r = racks(&app).await;
    let acme = app.member("acme");
    let two = |numa: bool| {
        let a = if numa {
            json!({ "gpuCount": 4, "sameNumaNode": true, "nodeSelector": [{ "key": "host", "value": "n1" }] })
        } else {
            json!({ "gpuCount": 4, "sameNvlinkDomain": true })
        };
        json!([a.clone(), a])
    };
    let cases = [
        (
            "gang",
            two(false),
            json!({ "colocate": "NODE" }),
            "2031-01-01T01:00:00Z",
        ),
        ("plain", two(true), Value::Null, "2031-01-01T03:00:00Z"),
    ];
    for (case, allocations, gang, start) in cases {
        let d = app
            .ok(
                &acme,
                AVAILABILITY,
                json!({ "p": r.pool, "a": allocations, "d": 3600, "g": gang }),
            )
            .await;
        let w = &d["availability"]["windows"][0];
        assert_eq!(
            nodes_of(&json!({ "allocations": w["placements"] })),
            [r.nodes["n1"].clone(), r.nodes["n1"].clone()],
            "{case}: availability offers n1 for both: {d}"
        );
        let end = start.replace("T01", "T02").replace("T03", "T04");
        let d = app
            .ok(
                &acme,
                CREATE,
                create(&r.pool, case, start, &end, allocations, gang),
            )
            .await;
        let rsv = &d["createReservation"]["reservation"];
        assert_eq!(rsv["state"], "SCHEDULED", "{case}: {rsv}");
        assert_eq!(
            nodes_of(rsv),
            [r.nodes["n1"].clone(), r.nodes["n1"].clone()],
            "{case}"
        );
        let group = |g: usize| if case == "gang" { g / 4 } else { g % 2 };
        let groups: Vec<Vec<usize>> = (0..2)
            .map(|i| {
                let mut g: Vec<usize> = gpu_indexes(&rsv["allocations"][i])
                    .into_iter()
                    .map(group)
                    .collect();
                g.dedup();
                g
            })
            .collect();
        assert_eq!(groups[0].len(), 1, "{case}: one group: {rsv}");
        assert_eq!(groups[1].len(), 1, "{case}: one group: {rsv}");
        assert_ne!(groups[0], groups[1], "{case}: one group each: {rsv}");
    }
}
