//! Availability search and the capacity timeline, through GraphQL against the real calendar.

use chrono::{DateTime, Duration, Utc};
use compute_tests::spawn_app;
use serde_json::{Value, json};

use crate::fleet::REGISTER;
use crate::reservations::{CREATE, pool, pool_version};

const AVAILABILITY: &str = "query($p: ID!, $a: [AllocationInput!]!, $d: Int!, $nb: DateTime, $na: DateTime, $f: Int) { \
    availability(poolId: $p, allocations: $a, durationSeconds: $d, notBefore: $nb, notAfter: $na, first: $f) { \
      searchedFrom searchedTo windows { startsAt endsAt latestStart placements { allocation computeNodeId computeNode { hostname } freeAtoms } } \
      unschedulable { reason count } message } }";
const TIMELINE: &str = "query($p: ID!, $from: DateTime!, $to: DateTime!, $s: Int!, $m: String) { \
    capacityTimeline(poolId: $p, from: $from, to: $to, stepSeconds: $s, model: $m) { stepSeconds steps { startsAt endsAt total booked free unavailable } } }";
const CANCEL: &str = "mutation($i: ReservationActionInput!) { cancelReservation(input: $i) { reservation { id state } } }";

fn create(pool: &str, key: &str, start: &str, end: &str, allocations: Value) -> Value {
    json!({ "i": { "poolId": pool, "startsAt": start, "endsAt": end, "allocations": allocations, "idempotencyKey": key } })
}

fn ask(pool: &str, allocations: Value, seconds: i64) -> Value {
    json!({ "p": pool, "a": allocations, "d": seconds })
}

/// An app on the simulated clock at 2031-01-01 with an empty bare-metal pool in a site of its own.
async fn app_with_pool(site: &str, pool: &str) -> (compute_tests::TestApp, String) {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let (_, pool) =
        crate::fleet::site_with_pool(&app, site, json!({ "name": pool, "kind": "BARE_METAL" }))
            .await;
    (app, pool)
}

#[tokio::test]
async fn the_earliest_windows_say_where_and_until_when_and_nothing_says_why() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let member = app.member("acme");
    let op = app.operator();
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": p.pool, "gpus": 20 } }),
    )
    .await;
    let two = json!([{ "gpuCount": 2, "model": "H100" }]);
    // h100-a's two GPUs: booked until 02:00, and one of them again from 03:00 to 04:00.
    app.ok(
        &member,
        CREATE,
        create(
            &p.pool,
            "a",
            "2031-01-01T00:00:00Z",
            "2031-01-01T02:00:00Z",
            two.clone(),
        ),
    )
    .await;
    app.ok(
        &member,
        CREATE,
        create(
            &p.pool,
            "b",
            "2031-01-01T03:00:00Z",
            "2031-01-01T04:00:00Z",
            json!([{ "gpuCount": 1, "model": "H100" }]),
        ),
    )
    .await;

    // Two H100 GPUs for an hour: h100-b is tainted, so only h100-a can take them, exactly at
    // 02:00 (ending as the 03:00 booking begins), then from 04:00 on.
    let d = app
        .ok(&member, AVAILABILITY, ask(&p.pool, two.clone(), 3600))
        .await;
    let a = &d["availability"];
    assert_eq!(a["searchedFrom"], "2031-01-01T00:00:00+00:00");
    assert_eq!(
        a["searchedTo"], "2031-01-15T00:00:00+00:00",
        "14 days by default"
    );
    let windows = a["windows"].as_array().expect("windows");
    let starts: Vec<(&str, &str)> = windows
        .iter()
        .map(|w| {
            (
                w["startsAt"].as_str().unwrap_or(""),
                w["latestStart"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        starts,
        vec![
            ("2031-01-01T02:00:00+00:00", "2031-01-01T02:00:00+00:00"),
            ("2031-01-01T04:00:00+00:00", "2031-01-15T00:00:00+00:00"),
        ]
    );
    assert_eq!(windows[0]["endsAt"], "2031-01-01T03:00:00+00:00");
    let place = &windows[0]["placements"][0];
    assert_eq!(place["computeNodeId"], p.nodes[0].as_str());
    assert_eq!(place["freeAtoms"], 2);
    assert_eq!(
        place["computeNode"],
        Value::Null,
        "a tenant is not shown the node"
    );
    assert_eq!(a["unschedulable"], json!([]));
    assert_eq!(a["message"], Value::Null);
    let d = app
        .ok(&op, AVAILABILITY, ask(&p.pool, two.clone(), 3600))
        .await;
    assert_eq!(
        d["availability"]["windows"][0]["placements"][0]["computeNode"]["hostname"],
        "h100-a"
    );

    // What the window says is what a create finds: at 02:00 it is placed, at 01:59 it waits.
    let d = app
        .ok(
            &member,
            CREATE,
            create(
                &p.pool,
                "c",
                "2031-01-01T02:00:00Z",
                "2031-01-01T03:00:00Z",
                two.clone(),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "SCHEDULED");
    let d = app
        .ok(
            &member,
            CREATE,
            create(
                &p.pool,
                "d",
                "2031-01-01T04:00:00Z",
                "2031-01-01T05:00:00Z",
                two.clone(),
            ),
        )
        .await;
    assert_eq!(d["createReservation"]["reservation"]["state"], "SCHEDULED");
    // Those two are now booked: the next window starts at 05:00.
    let d = app
        .ok(&member, AVAILABILITY, ask(&p.pool, two.clone(), 3600))
        .await;
    assert_eq!(
        d["availability"]["windows"][0]["startsAt"],
        "2031-01-01T05:00:00+00:00"
    );

    // Tolerating the taint, h100-b takes them now.
    let tolerant =
        json!([{ "gpuCount": 2, "model": "H100", "tolerations": [{ "key": "dedicated" }] }]);
    let d = app
        .ok(&member, AVAILABILITY, ask(&p.pool, tolerant, 3600))
        .await;
    let w = &d["availability"]["windows"][0];
    assert_eq!(w["startsAt"], "2031-01-01T00:00:00+00:00");
    assert_eq!(w["placements"][0]["computeNodeId"], p.nodes[1].as_str());

    // Two allocations of two H100 GPUs each need both H100 nodes at once.
    let pair = json!([
        { "gpuCount": 2, "model": "H100", "tolerations": [{ "key": "dedicated" }] },
        { "gpuCount": 2, "model": "H100", "tolerations": [{ "key": "dedicated" }] }
    ]);
    let d = app
        .ok(&member, AVAILABILITY, ask(&p.pool, pair, 3600))
        .await;
    let w = &d["availability"]["windows"][0];
    assert_eq!(w["startsAt"], "2031-01-01T05:00:00+00:00");
    let nodes: Vec<&Value> = w["placements"]
        .as_array()
        .expect("placements")
        .iter()
        .map(|p| &p["computeNodeId"])
        .collect();
    assert_eq!(nodes.len(), 2);
    assert_ne!(nodes[0], nodes[1], "never the same atoms twice");

    // Three H100 GPUs on one node never fit: counted node by node, as placement counts.
    let d = app
        .ok(
            &member,
            AVAILABILITY,
            ask(&p.pool, json!([{ "gpuCount": 3, "model": "H100" }]), 3600),
        )
        .await;
    let a = &d["availability"];
    assert_eq!(a["windows"], json!([]));
    assert_eq!(
        a["unschedulable"],
        json!([
            { "reason": "InsufficientGpus", "count": 2 },
            { "reason": "TaintNotTolerated", "count": 1 }
        ])
    );
    let why = a["message"].as_str().unwrap_or("");
    assert!(
        why.contains("gives 3 H100 GPUs for 3600 seconds: 0/3 nodes fit (2 never with 3 H100 GPUs free for the whole window, 1 with an untolerated taint)"),
        "{why}"
    );

    // Refused as a create would be: over quota, over a pool rule; bad input names the field.
    let (code, e) = app
        .fails(
            &member,
            AVAILABILITY,
            ask(&p.pool, json!([{ "gpuCount": 14 }]), 3600),
        )
        .await;
    assert_eq!(code, "QUOTA_EXCEEDED", "{e}");
    // No start is offered past 366 days ahead, where a create would be refused.
    let mut far = ask(&p.pool, json!([{ "gpuCount": 1 }]), 3600);
    far["nb"] = json!("2032-01-03T00:00:00Z");
    let (code, e) = app.fails(&member, AVAILABILITY, far).await;
    assert_eq!(code, "BAD_USER_INPUT", "{e}");
    assert_eq!(e["extensions"]["field"], "notBefore");
    app.ok(
        &op,
        "mutation($i: UpdatePoolInput!) { updatePool(input: $i) { pool { id } } }",
        json!({ "i": { "id": p.pool, "version": pool_version(&app, &p.pool).await,
                "rules": { "maxDurationSeconds": 3600, "maxLeadSeconds": 7200 } } }),
    )
    .await;
    let (code, e) = app
        .fails(&member, AVAILABILITY, ask(&p.pool, two.clone(), 3601))
        .await;
    assert_eq!(code, "POLICY_VIOLATION", "{e}");
    assert_eq!(e["extensions"]["rule"], "maxDurationSeconds");
    assert_eq!(e["extensions"]["limit"], 3600);
    // The lead rule narrows the starts searched: none of 00:00 to 02:00 fits.
    let d = app
        .ok(&member, AVAILABILITY, ask(&p.pool, two.clone(), 3600))
        .await;
    assert_eq!(d["availability"]["searchedTo"], "2031-01-01T02:00:00+00:00");
    assert_eq!(
        d["availability"]["windows"][0]["startsAt"],
        Value::Null,
        "{d}"
    );
    let mut bad = ask(&p.pool, two.clone(), 3600);
    bad["f"] = json!(21);
    let (code, e) = app.fails(&member, AVAILABILITY, bad).await;
    assert_eq!(code, "BAD_USER_INPUT", "{e}");
    assert_eq!(e["extensions"]["field"], "first");
    let (code, e) = app
        .fails(&member, AVAILABILITY, ask(&p.pool, two.clone(), 0))
        .await;
    assert_eq!(
        (code.as_str(), &e["extensions"]["field"]),
        ("BAD_USER_INPUT", &json!("durationSeconds"))
    );
    let (code, e) = app
        .fails(
            &member,
            AVAILABILITY,
            ask("pool_00000000000000000000000000000000", two, 3600),
        )
        .await;
    assert_eq!(code, "NOT_FOUND", "{e}");
}

#[tokio::test]
async fn the_timeline_counts_free_booked_and_unavailable_atoms_per_step() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = pool(&app).await;
    let member = app.member("acme");
    let op = app.operator();
    app.ok(
        &member,
        CREATE,
        create(
            &p.pool,
            "a",
            "2031-01-01T00:00:00Z",
            "2031-01-01T02:00:00Z",
            json!([{ "gpuCount": 2, "model": "H100" }]),
        ),
    )
    .await;
    app.ok(
        &member,
        CREATE,
        create(
            &p.pool,
            "b",
            "2031-01-01T01:30:00Z",
            "2031-01-01T03:00:00Z",
            json!([{ "gpuCount": 1, "model": "H100", "tolerations": [{ "key": "dedicated" }] }]),
        ),
    )
    .await;
    // Two bookings of the same two GPUs inside one step count each GPU once.
    for (key, from, to) in [
        ("c", "2031-01-01T02:00:00Z", "2031-01-01T02:30:00Z"),
        ("d", "2031-01-01T02:40:00Z", "2031-01-01T03:20:00Z"),
    ] {
        let d = app
            .ok(
                &member,
                CREATE,
                create(
                    &p.pool,
                    key,
                    from,
                    to,
                    json!([{ "gpuCount": 2, "model": "H100" }]),
                ),
            )
            .await;
        assert_eq!(
            d["createReservation"]["reservation"]["allocations"][0]["computeNodeId"],
            p.nodes[0].as_str()
        );
    }
    // h100-b is cordoned: its other GPU cannot be booked now.
    app.ok(
        &op,
        "mutation($i: CordonNodeInput!) { cordonNode(input: $i) { computeNode { id } } }",
        json!({ "i": { "id": p.nodes[1], "reason": "maintenance" } }),
    )
    .await;
    let vars = json!({ "p": p.pool, "from": "2031-01-01T00:00:00Z", "to": "2031-01-01T04:00:00Z", "s": 3600, "m": "H100" });
    let d = app.ok(&member, TIMELINE, vars).await;
    let t = &d["capacityTimeline"];
    assert_eq!(t["stepSeconds"], 3600);
    let steps: Vec<(i64, i64, i64, i64)> = t["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| {
            (
                s["total"].as_i64().unwrap_or(-1),
                s["booked"].as_i64().unwrap_or(-1),
                s["free"].as_i64().unwrap_or(-1),
                s["unavailable"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    // 00-01: h100-a's two booked; 01-02: and h100-b's first from 01:30; 02-03: that one and
    // h100-a's two again (twice each, counted once); 03-04: h100-a's two until 03:20. h100-b's
    // other GPU is unavailable throughout (its node is cordoned), and so is the first one when it
    // is not booked.
    assert_eq!(
        steps,
        vec![(4, 2, 0, 2), (4, 3, 0, 1), (4, 3, 0, 1), (4, 2, 0, 2)]
    );
    assert_eq!(
        t["steps"][3]["startsAt"], "2031-01-01T03:00:00+00:00",
        "steps start from `from`"
    );
    let (code, e) = app
        .fails(
            &member,
            TIMELINE,
            json!({ "p": p.pool, "from": "2031-01-01T00:00:00Z", "to": "2031-02-01T00:00:00Z", "s": 60 }),
        )
        .await;
    assert_eq!(code, "BAD_USER_INPUT", "{e}");
    assert_eq!(e["extensions"]["field"], "stepSeconds");
    // A range that is not a whole number of seconds still gets a last step that ends at or
    // after `to` (whole seconds dropped the half second, and the step with it).
    for (to, n) in [("2031-01-01T00:00:00.5Z", 1), ("2031-01-01T01:00:00.5Z", 2)] {
        let d = app
            .ok(
                &member,
                TIMELINE,
                json!({ "p": p.pool, "from": "2031-01-01T00:00:00Z", "to": to, "s": 3600, "m": "H100" }),
            )
            .await;
        let steps = d["capacityTimeline"]["steps"].as_array().expect("steps");
        assert_eq!(steps.len(), n, "to {to}: {d}");
    }
}

/// Minutes from the start of the calendar, as a time.
fn at(m: i64) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2031-01-01T00:00:00Z")
        .expect("time")
        .with_timezone(&Utc)
        + Duration::minutes(m)
}

fn rfc(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// A small random calendar built with real creates, then random questions: the windows
/// returned are the stretches a brute force over every half minute finds from the bookings
/// themselves, and a create at the earliest start is placed where a create a minute before it
/// (when that is searched) is not.
#[tokio::test]
async fn the_earliest_window_is_the_true_earliest_on_a_random_calendar() {
    let (app, pool) = app_with_pool("avail-site", "calendar").await;
    let op = app.operator();
    let member = app.member("acme");
    let mut nodes = Vec::new();
    for n in 0..3 {
        let devices: Vec<Value> = (0..3)
            .map(|g| json!({ "uuid": format!("GPU-{n}-{g}"), "model": "H100", "memoryMib": 81559 }))
            .collect();
        let d = app
            .ok(&op, REGISTER, json!({ "i": { "poolId": pool, "hostname": format!("cal-{n}"),
                "resources": { "vcpu": 64, "memoryMib": 262144, "diskGib": 1000 }, "devices": devices } }))
            .await;
        nodes.push(
            d["registerNode"]["computeNode"]["id"]
                .as_str()
                .expect("id")
                .to_owned(),
        );
    }
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut below = |n: i64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % n as u64) as i64
    };
    for k in 0..40 {
        let start = below(600);
        let len = 10 + below(120);
        let d = app
            .ok(
                &member,
                CREATE,
                create(
                    &pool,
                    &format!("cal-{k}"),
                    &rfc(at(start)),
                    &rfc(at(start + len)),
                    json!([{ "gpuCount": 1 + below(3) }]),
                ),
            )
            .await;
        let r = &d["createReservation"]["reservation"];
        if r["state"] == "PENDING" {
            app.ok(&member, CANCEL, json!({ "i": { "id": r["id"] } }))
                .await;
        }
    }

    for q in 0..12 {
        // The bookings as they are now, node by node: (node, atom) -> [from, to) in minutes.
        let rows: Vec<(String, String, f64, f64)> = sqlx::query_as(
            "SELECT d.node_id, b.atom, extract(epoch FROM lower(b.during))::float8, extract(epoch FROM upper(b.during))::float8
               FROM device_bookings b JOIN devices d ON d.id = b.device_id",
        )
        .fetch_all(app.db.db.pool())
        .await
        .expect("bookings");
        let base = at(0).timestamp() as f64;
        let busy = |node: &str, atom: &str| -> Vec<(f64, f64)> {
            rows.iter()
                .filter(|r| r.0 == node && r.1 == atom)
                .map(|r| ((r.2 - base) / 60.0, (r.3 - base) / 60.0))
                .collect()
        };
        let count = 1 + below(3);
        let dur = 15 + below(150);
        let not_before = below(300);
        let not_after = not_before + 60 + below(400);
        // Whether `count` GPUs fit on one node for [s, s + dur), by brute force.
        let fits = |s: f64| {
            nodes.iter().enumerate().any(|(n, node)| {
                (0..3)
                    .filter(|g| {
                        busy(node, &format!("GPU-{n}-{g}"))
                            .iter()
                            .all(|&(b0, b1)| b1 <= s || s + dur as f64 <= b0)
                    })
                    .count() as i64
                    >= count
            })
        };
        let mut truth: Vec<(f64, f64)> = Vec::new();
        let mut open: Option<f64> = None;
        let mut last = not_before as f64;
        let mut half = 2 * not_before;
        while half <= 2 * not_after {
            let s = half as f64 / 2.0;
            match (open, fits(s)) {
                (None, true) => open = Some(s),
                (Some(o), false) => {
                    truth.push((o, last));
                    open = None;
                }
                _ => {}
            }
            last = s;
            half += 1;
        }
        if let Some(o) = open {
            truth.push((o, not_after as f64));
        }
        truth.truncate(5);

        let d = app
            .ok(
                &member,
                AVAILABILITY,
                json!({ "p": pool, "a": [{ "gpuCount": count }], "d": dur * 60,
                        "nb": rfc(at(not_before)), "na": rfc(at(not_after)) }),
            )
            .await;
        let minutes = |v: &Value| {
            let t = DateTime::parse_from_rfc3339(v.as_str().expect("time")).expect("rfc3339");
            (t.timestamp() as f64 - base) / 60.0
        };
        let got: Vec<(f64, f64)> = d["availability"]["windows"]
            .as_array()
            .expect("windows")
            .iter()
            .map(|w| (minutes(&w["startsAt"]), minutes(&w["latestStart"]).floor()))
            .collect();
        assert_eq!(
            got, truth,
            "question {q}: {count} GPUs for {dur} minutes, starts {not_before}..{not_after}"
        );
        let Some(&(first, _)) = truth.first() else {
            continue;
        };
        // A create at the earliest start is placed; a minute before it, it is not.
        let first = first as i64;
        let mk = |key: String, s: i64| {
            create(
                &pool,
                &key,
                &rfc(at(s)),
                &rfc(at(s + dur)),
                json!([{ "gpuCount": count }]),
            )
        };
        if first > not_before {
            let d = app
                .ok(&member, CREATE, mk(format!("early-{q}"), first - 1))
                .await;
            let r = &d["createReservation"]["reservation"];
            assert_eq!(r["state"], "PENDING", "question {q}: a minute early fits");
            app.ok(&member, CANCEL, json!({ "i": { "id": r["id"] } }))
                .await;
        }
        let d = app.ok(&member, CREATE, mk(format!("at-{q}"), first)).await;
        let r = &d["createReservation"]["reservation"];
        assert_ne!(
            r["state"], "PENDING",
            "question {q}: the earliest window did not fit"
        );
    }
}

/// An allocation's kind, MIG profile and slots decide which atoms serve it, as placement decides:
/// two of the four 1g.10gb instances but not two 3g.40gb of one MIG GPU; three slots of a GPU in
/// four, never of a GPU in two; and the answer names the atoms' node.
#[tokio::test]
async fn mig_profiles_and_slots_are_matched_as_placement_matches_them() {
    let (app, pool) = app_with_pool("avail-mig-site", "sliced").await;
    let op = app.operator();
    let member = app.member("acme");
    let devices = json!([
        { "uuid": "GPU-mig-0", "model": "A100", "memoryMib": 81920, "mode": "MIG",
          "layout": { "migProfiles": ["3g.40gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb"] } },
        { "uuid": "GPU-ts-0", "model": "L4", "memoryMib": 23034, "mode": "TIME_SLICE", "layout": { "slots": 4 } },
        { "uuid": "GPU-whole-0", "model": "H100", "memoryMib": 81559 }
    ]);
    let node = app
        .ok(&op, REGISTER, json!({ "i": { "poolId": pool, "hostname": "sliced-0",
            "resources": { "vcpu": 64, "memoryMib": 262144, "diskGib": 1000 }, "devices": devices } }))
        .await["registerNode"]["computeNode"]["id"]
        .clone();
    app.ok(
        &op,
        "mutation($i: SetQuotaInput!) { setQuota(input: $i) { quotas { max } } }",
        json!({ "i": { "tenantId": "acme", "scopeId": pool, "gpus": 20 } }),
    )
    .await;
    let first = |d: &Value| d["availability"]["windows"][0].clone();
    let mig = |profile: &str, count: i64| json!([{ "gpuKind": "MIG", "profile": profile, "gpuCount": count }]);
    let slots = |per_gpu: i64, count: i64| json!([{ "gpuKind": "SLOT", "slotsPerGpu": per_gpu, "gpuCount": count }]);

    let d = app
        .ok(&member, AVAILABILITY, ask(&pool, mig("1g.10gb", 2), 3600))
        .await;
    let w = first(&d);
    assert_eq!(w["startsAt"], "2031-01-01T00:00:00+00:00", "{d}");
    assert_eq!(w["placements"][0]["computeNodeId"], node);
    assert_eq!(
        w["placements"][0]["freeAtoms"], 4,
        "the four 1g.10gb instances, not the 3g: {d}"
    );

    let d = app
        .ok(&member, AVAILABILITY, ask(&pool, mig("3g.40gb", 2), 3600))
        .await;
    assert_eq!(d["availability"]["windows"], json!([]), "{d}");
    assert_eq!(
        d["availability"]["unschedulable"],
        json!([{ "reason": "InsufficientGpus", "count": 1 }])
    );

    let d = app
        .ok(&member, AVAILABILITY, ask(&pool, slots(4, 3), 3600))
        .await;
    assert_eq!(first(&d)["placements"][0]["freeAtoms"], 4, "{d}");
    let d = app
        .ok(&member, AVAILABILITY, ask(&pool, slots(2, 1), 3600))
        .await;
    assert_eq!(
        d["availability"]["windows"],
        json!([]),
        "no GPU in two slots: {d}"
    );

    // Whole GPUs are the H100 alone: neither the MIG GPU nor the sliced one serves them.
    let d = app
        .ok(
            &member,
            AVAILABILITY,
            ask(&pool, json!([{ "gpuCount": 1 }]), 3600),
        )
        .await;
    assert_eq!(first(&d)["placements"][0]["freeAtoms"], 1, "{d}");
    let d = app
        .ok(
            &member,
            AVAILABILITY,
            ask(&pool, json!([{ "gpuCount": 1, "model": "A100" }]), 3600),
        )
        .await;
    assert_eq!(d["availability"]["windows"], json!([]), "{d}");

    // Two allocations of one request: bit by bit, each served by its own atoms.
    let d = app
        .ok(
            &member,
            AVAILABILITY,
            ask(
                &pool,
                json!([{ "gpuKind": "MIG", "profile": "3g.40gb", "gpuCount": 1 },
                              { "gpuKind": "SLOT", "slotsPerGpu": 4, "gpuCount": 2 }]),
                3600,
            ),
        )
        .await;
    let w = first(&d);
    assert_eq!(w["placements"][0]["freeAtoms"], 1, "{d}");
    assert_eq!(w["placements"][1]["freeAtoms"], 4, "{d}");
}
