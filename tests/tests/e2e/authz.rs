//! Authorization from the database (issue 40): grants an administrator changes live, felt by
//! the next request of every API process, closing the streams they no longer cover; scoped
//! operators; service accounts; and every mutation asking for its grant.

use std::time::{Duration, Instant};

use compute_api::auth::Role;
use compute_tests::{TestApp, eventually, spawn_app};
use serde_json::{Value, json};

use crate::subscriptions::{EVENTS, SseStream, close_of, now, subscribe};

const WAIT: Duration = Duration::from_secs(10);

pub(crate) const GRANT: &str = "mutation($input: GrantRoleInput!) { grantRole(input: $input) { grant { id subject issuer role tenantId scopeId grantedBy } idempotentReplay } }";
pub(crate) const REVOKE: &str = "mutation($input: RevokeRoleInput!) { revokeRole(input: $input) { revokedGrantId pausedEventSinkIds idempotentReplay } }";
const VIEWER: &str = "{ viewer { subject issuer tenantId roles operatorScopeIds } }";
const RESERVATIONS: &str = "{ reservations(first: 1) { totalCount } }";

/// An administrator's token (by its claims: nothing is granted yet).
fn admin(app: &TestApp) -> String {
    app.token("root@admins", None, &[Role::Admin])
}

/// The code of the first error of `body`, or `OK` without errors.
fn code(body: &Value) -> String {
    match body.get("errors") {
        None => "OK".into(),
        Some(e) => e[0]["extensions"]["code"]
            .as_str()
            .unwrap_or("<uncoded>")
            .to_owned(),
    }
}

async fn viewer(app: &TestApp, token: &str) -> Value {
    app.ok(token, VIEWER, json!({})).await["viewer"].clone()
}

/// Erin, made a member of acme by a grant (so a revocation can take it back), once every API
/// process feels the grant: her token.
async fn erin_of_acme(app: &TestApp, admin: &str) -> String {
    app.ok(
        admin,
        GRANT,
        json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
    )
    .await;
    let erin = app.token("erin", Some("acme"), &[Role::Member]);
    eventually("erin's grant is felt", WAIT, || async {
        (viewer(app, &erin).await["roles"] == json!(["MEMBER"])).then_some(())
    })
    .await;
    erin
}

#[tokio::test]
async fn grants_override_claims_and_a_revocation_is_refused_at_once() {
    let app = spawn_app().await;
    let admin = admin(&app);
    // Bob's token says member of acme; no grant names him yet.
    let bob = app.token("bob", Some("acme"), &[Role::Member]);
    assert_eq!(viewer(&app, &bob).await["tenantId"], "acme");
    assert_eq!(
        code(&app.graphql(RESERVATIONS, json!({}), Some(&bob)).await.1),
        "OK"
    );

    // A grant moves him to beta: the grant, not the claim, decides from the next request on.
    let input =
        json!({ "subject": "bob", "role": "MEMBER", "tenantId": "beta", "idempotencyKey": "g1" });
    let granted = app.ok(&admin, GRANT, json!({ "input": input })).await["grantRole"].clone();
    assert_eq!(granted["grant"]["issuer"], compute_tests::TEST_ISSUER);
    assert_eq!(granted["grant"]["grantedBy"], "root@admins");
    assert_eq!(granted["idempotentReplay"], false);
    let again = app.ok(&admin, GRANT, json!({ "input": input })).await["grantRole"].clone();
    assert_eq!(again["idempotentReplay"], true);
    assert_eq!(again["grant"]["id"], granted["grant"]["id"]);
    assert_eq!(app.count("authz_grants").await, 1);
    eventually("bob's grant is felt", WAIT, || async {
        (viewer(&app, &bob).await["tenantId"] == "beta").then_some(())
    })
    .await;
    assert_eq!(viewer(&app, &bob).await["roles"], json!(["MEMBER"]));

    // Revoked: refused by the next request, well within a second.
    let revoked = app
        .ok(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "bob", "role": "MEMBER", "tenantId": "beta", "idempotencyKey": "r1" } }),
        )
        .await["revokeRole"]
        .clone();
    assert_eq!(revoked["revokedGrantId"], granted["grant"]["id"]);
    assert_eq!(revoked["idempotentReplay"], false);
    let started = Instant::now();
    let refused = eventually("bob is refused", WAIT, || async {
        let c = code(&app.graphql(RESERVATIONS, json!({}), Some(&bob)).await.1);
        (c != "OK").then_some(c)
    })
    .await;
    let felt = started.elapsed();
    assert_eq!(refused, "FORBIDDEN");
    assert!(felt < Duration::from_secs(1), "felt after {felt:?}");
    // Managed, with no grant: the token's member claim no longer counts.
    assert_eq!(viewer(&app, &bob).await["roles"], json!([]));
    // A retry of the revocation gets its answer again; without the key it is NOT_FOUND.
    let input =
        json!({ "subject": "bob", "role": "MEMBER", "tenantId": "beta", "idempotencyKey": "r1" });
    let replay = app.ok(&admin, REVOKE, json!({ "input": input })).await["revokeRole"].clone();
    assert_eq!(replay["idempotentReplay"], true);
    assert_eq!(replay["revokedGrantId"], granted["grant"]["id"]);
    let (c, _) = app
        .fails(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "bob", "role": "MEMBER", "tenantId": "beta" } }),
        )
        .await;
    assert_eq!(c, "NOT_FOUND");

    // The events say who changed what.
    let (types,): (Vec<String>,) = sqlx::query_as(
        "SELECT array_agg(type ORDER BY txid, seq) FROM outbox WHERE type LIKE 'authz.%'",
    )
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(types, ["authz.granted", "authz.revoked"]);
}

#[tokio::test]
async fn bad_grants_are_refused_and_write_nothing() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let before = (
        app.count("authz_grants").await,
        app.count("authz_principals").await,
        app.count("authz_changes").await,
        app.count("outbox").await,
    );
    let cases = [
        (json!({ "subject": "", "role": "OPERATOR" }), "subject"),
        (
            json!({ "subject": "a\u{7}b", "role": "OPERATOR" }),
            "subject",
        ),
        (json!({ "subject": "carol", "role": "MEMBER" }), "tenantId"),
        (
            json!({ "subject": "carol", "role": "OPERATOR", "tenantId": "acme" }),
            "tenantId",
        ),
        (
            json!({ "subject": "carol", "role": "MEMBER", "tenantId": "acme", "scopeId": "pool_00000000000000000000000000000000" }),
            "scopeId",
        ),
        (
            json!({ "subject": "carol", "role": "OPERATOR", "scopeId": "pool_00000000000000000000000000000000" }),
            "scopeId",
        ),
        (
            json!({ "subject": "carol", "role": "OPERATOR", "scopeId": "rack-7" }),
            "scopeId",
        ),
        (
            json!({ "subject": "sa_00000000000000000000000000000000", "role": "OPERATOR" }),
            "subject",
        ),
    ];
    for (input, field) in cases {
        let (c, error) = app.fails(&admin, GRANT, json!({ "input": input })).await;
        assert_eq!(c, "BAD_USER_INPUT", "{input}: {error}");
        assert_eq!(error["extensions"]["field"], field, "{input}: {error}");
    }
    // A role that does not exist is refused by the schema's enum before any resolver runs, as
    // the caller's input (`BAD_USER_INPUT`, naming the value) when it came in the variables.
    let (c, error) = app
        .fails(
            &admin,
            GRANT,
            json!({ "input": { "subject": "carol", "role": "ROOT" } }),
        )
        .await;
    assert_eq!(c, "BAD_USER_INPUT", "{error}");
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.contains("ROOT")),
        "{error}"
    );
    // Only administrators grant.
    let (c, _) = app
        .fails(
            &app.operator(),
            GRANT,
            json!({ "input": { "subject": "carol", "role": "OPERATOR" } }),
        )
        .await;
    assert_eq!(c, "FORBIDDEN");
    let after = (
        app.count("authz_grants").await,
        app.count("authz_principals").await,
        app.count("authz_changes").await,
        app.count("outbox").await,
    );
    assert_eq!(before, after, "a refused grant writes nothing");

    // The last administrator grant cannot go, even raced by two revocations.
    for who in ["ann", "ben"] {
        app.ok(
            &admin,
            GRANT,
            json!({ "input": { "subject": who, "role": "ADMIN" } }),
        )
        .await;
    }
    let revoke = |who: &'static str| {
        app.graphql_in_background(
            &admin,
            REVOKE,
            json!({ "input": { "subject": who, "role": "ADMIN" } }),
        )
    };
    let (a, b) = (revoke("ann"), revoke("ben"));
    let codes = [code(&a.await.expect("ann")), code(&b.await.expect("ben"))];
    let mut sorted = codes.clone();
    sorted.sort();
    assert_eq!(sorted, ["CONFLICT", "OK"], "{codes:?}");
    let (admins,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM authz_grants WHERE role = 'admin'")
            .fetch_one(app.db.db.pool())
            .await
            .expect("count");
    assert_eq!(admins, 1);
}

/// Two `compute-api serve` processes on one database: a revocation committed through one is
/// refused by both within a second (printed).
#[tokio::test]
async fn a_revocation_is_felt_by_two_api_processes_within_a_second() {
    let db = compute_tests::test_db_on_wall_clock().await;
    let env = db.process_env();
    let (_a, base_a) = crate::crash::start_api_with(&env, &[]).await;
    let (_b, base_b) = crate::crash::start_api_with(&env, &[]).await;
    let http = reqwest::Client::new();
    let token = |sub: &str, tenant: Option<&str>, roles: &[Role]| {
        compute_tests::mint(compute_tests::claims(sub, tenant, roles, 3600))
    };
    let admin = token("root@admins", None, &[Role::Admin]);
    let post = |base: &str, token: &str, query: &str, variables: Value| {
        let req = http
            .post(format!("{base}/graphql"))
            .bearer_auth(token)
            .json(&json!({ "query": query, "variables": variables }));
        async move {
            req.send()
                .await
                .expect("the API answers")
                .json::<Value>()
                .await
                .expect("JSON")
        }
    };
    let mut figures = Vec::new();
    for round in 0..3 {
        let sub = format!("dana{round}");
        let dana = token(&sub, Some("acme"), &[Role::Member]);
        let body = post(
            &base_a,
            &admin,
            GRANT,
            json!({ "input": { "subject": sub, "role": "MEMBER", "tenantId": "acme" } }),
        )
        .await;
        assert_eq!(code(&body), "OK", "{body}");
        for base in [&base_a, &base_b] {
            eventually("the grant is felt", WAIT, || async {
                (code(&post(base, &dana, RESERVATIONS, json!({})).await) == "OK").then_some(())
            })
            .await;
        }
        let body = post(
            &base_a,
            &admin,
            REVOKE,
            json!({ "input": { "subject": sub, "role": "MEMBER", "tenantId": "acme" } }),
        )
        .await;
        assert_eq!(code(&body), "OK", "{body}");
        let committed = Instant::now();
        let mut felt = Vec::new();
        for base in [&base_a, &base_b] {
            eventually("the revocation is felt", WAIT, || async {
                (code(&post(base, &dana, RESERVATIONS, json!({})).await) == "FORBIDDEN")
                    .then_some(())
            })
            .await;
            felt.push(committed.elapsed());
        }
        let slowest = *felt.iter().max().expect("two");
        figures.push(slowest);
        assert!(
            slowest < Duration::from_secs(1),
            "round {round}: the revocation was felt after {felt:?}"
        );
    }
    eprintln!(
        "revocation felt by both API processes after (committed → refused, per round): {:?}",
        figures
    );
}

#[tokio::test]
async fn streams_close_and_sinks_pause_when_their_grant_is_revoked() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let erin = erin_of_acme(&app, &admin).await;
    let sink = app
        .ok(
            &erin,
            "mutation { createEventSink(input: { url: \"http://127.0.0.1:9/hook\" }) { eventSink { id active } } }",
            json!({}),
        )
        .await["createEventSink"]["eventSink"]["id"]
        .clone();
    // Another subject's stream stays open.
    let other = app.member("acme");
    let after = now(&app).await;
    let vars = json!({ "after": after, "types": ["test.tick"] });
    let mut ws = subscribe(&app, &erin, "1", EVENTS, vars.clone()).await;
    let mut ws_other = subscribe(&app, &other, "1", EVENTS, vars.clone()).await;
    let (status, mut sse) = SseStream::open(
        &app,
        &erin,
        json!({ "query": EVENTS, "variables": vars }),
        None,
    )
    .await;
    assert_eq!(status, 200);
    // A grant added does not close anything.
    app.ok(
        &admin,
        GRANT,
        json!({ "input": { "subject": "erin", "role": "OPERATOR", "scopeId": null } }),
    )
    .await;
    let revoked = app
        .ok(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
        )
        .await["revokeRole"]
        .clone();
    // Still an operator of the fleet: her streams are covered; her tenant sink too.
    assert_eq!(revoked["pausedEventSinkIds"], json!([]));
    // But what she starts next on the open connection runs as she is now, as over HTTP: an
    // operator of no tenant, not a member of acme (who could still reserve on acme's quota).
    eventually("the revocation is felt over HTTP", WAIT, || async {
        (viewer(&app, &erin).await["tenantId"].is_null()).then_some(())
    })
    .await;
    crate::subscriptions::send(
        &mut ws,
        json!({ "id": "2", "type": "subscribe", "payload": { "query": VIEWER } }),
    )
    .await;
    let seen = loop {
        let m = crate::subscriptions::next_msg(&mut ws).await;
        if m["id"] == "2" && m["type"] == "next" {
            break m;
        }
    };
    assert_eq!(
        seen["payload"]["data"]["viewer"]["tenantId"],
        Value::Null,
        "{seen}"
    );
    assert_eq!(
        seen["payload"]["data"]["viewer"]["roles"],
        json!(["OPERATOR"]),
        "{seen}"
    );
    let revoked = app
        .ok(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "erin", "role": "OPERATOR" } }),
        )
        .await["revokeRole"]
        .clone();
    assert_eq!(revoked["pausedEventSinkIds"], json!([sink.clone()]));
    let (active,): (bool,) = sqlx::query_as("SELECT active FROM event_sinks WHERE id = $1")
        .bind(sink.as_str())
        .fetch_one(app.db.db.pool())
        .await
        .expect("the sink");
    assert!(!active, "the sink of a subject without access is paused");

    let (code_ws, reason) = close_of(&mut ws).await;
    assert_eq!(code_ws, 4403, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    let e = sse.next().await;
    assert_eq!(e.event, "next");
    assert!(e.data.contains("FORBIDDEN"), "{e:?}");
    assert_eq!(sse.next().await.event, "complete");
    // The other subscriber's stream still delivers.
    sqlx::query("SELECT compute_emit('test.tick', 'acme', 'still-here', '{}')")
        .execute(app.db.db.pool())
        .await
        .expect("emit");
    let msg = crate::subscriptions::next_msg(&mut ws_other).await;
    assert_eq!(
        msg["payload"]["data"]["events"]["subject"], "still-here",
        "{msg}"
    );
}

/// A usage export is a stream like the others: a revocation stops it before its next page, and
/// the body is cut short (a transfer that does not finish, never a file that looks whole).
#[tokio::test]
async fn a_usage_export_stops_part_way_when_its_callers_grant_is_revoked() {
    let app = spawn_app().await;
    let admin = admin(&app);
    // 100,000 records: far more than the socket's buffers hold, so the export is still paging
    // when the revocation lands.
    const RECORDS: usize = 100_000;
    sqlx::query(
        "INSERT INTO usage_periods (window_start, window_end, closed) \
         VALUES ('2031-01-01T00:00:00Z', '2031-01-01T01:00:00Z', true)",
    )
    .execute(app.db.db.pool())
    .await
    .expect("period");
    sqlx::query(
        "INSERT INTO usage_records (key, kind, seq, allocation_id, reservation_id, tenant_id, pool_id, \
                window_start, window_end, model, gpu_kind, atoms, booked_seconds, gpu_seconds, \
                vcpu_seconds, memory_mib_seconds, disk_gib_seconds) \
         SELECT 'cmp:' || a || ':' || compute_json_time('2031-01-01T00:00:00Z'), 'window', 0, a, \
                'rsv_' || repeat('0', 32), 'acme', 'pool_' || repeat('0', 32), '2031-01-01T00:00:00Z', '2031-01-01T01:00:00Z', 'H100', 'gpu', 1, \
                3600, 3600, 0, 0, 0 \
           FROM (SELECT 'alc_' || lpad(to_hex(g), 32, '0') AS a FROM generate_series(1, $1) g) s",
    )
    .bind(RECORDS as i32)
    .execute(app.db.db.pool())
    .await
    .expect("records");
    let erin = erin_of_acme(&app, &admin).await;
    let mut res = app
        .http
        .get(app.url("/usage.csv?from=2031-01-01T00:00:00Z&to=2031-01-02T00:00:00Z"))
        .bearer_auth(&erin)
        .send()
        .await
        .expect("get");
    assert_eq!(res.status().as_u16(), 200, "{:?}", res.text().await);
    let mut lines = 0;
    let first = res.chunk().await.expect("a first chunk").expect("bytes");
    lines += first.iter().filter(|b| **b == b'\n').count();
    app.ok(
        &admin,
        REVOKE,
        json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
    )
    .await;
    eventually("the revocation is felt", WAIT, || async {
        (viewer(&app, &erin).await["roles"] == json!([])).then_some(())
    })
    .await;
    let ended = loop {
        match res.chunk().await {
            Ok(Some(bytes)) => lines += bytes.iter().filter(|b| **b == b'\n').count(),
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        }
    };
    assert!(
        ended.is_err(),
        "the export was not cut: {lines} lines of {}",
        RECORDS + 1
    );
    assert!(lines < RECORDS + 1, "{lines}");
}

/// A sink paused because its creator lost the grant that covered it would deliver, if resumed
/// as it is, to the URL that creator chose, signed with the secret that creator was shown.
/// Another member resumes it only by taking it over: `url` and `rotateSecret` in the same
/// change, which gives a new secret and makes the sink theirs. A sink whose creator is still
/// covered resumes as before, and `rotateSecret` alone works on any sink.
#[tokio::test]
async fn a_sink_whose_creator_was_revoked_resumes_only_when_taken_over_with_a_new_secret() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let erin = erin_of_acme(&app, &admin).await;
    const CREATE: &str = "mutation($url: String!) { createEventSink(input: { url: $url }) { eventSink { id } secret } }";
    const UPDATE: &str = "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { active version } secret } }";
    let made = app
        .ok(&erin, CREATE, json!({ "url": "http://127.0.0.1:9/erin" }))
        .await["createEventSink"]
        .clone();
    let sink = made["eventSink"]["id"].as_str().expect("id").to_owned();
    let revoked = app
        .ok(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
        )
        .await["revokeRole"]
        .clone();
    assert_eq!(revoked["pausedEventSinkIds"], json!([sink]));
    let stored = |app: &compute_tests::TestApp| {
        let pool = app.db.db.pool().clone();
        let sink = sink.clone();
        async move {
            sqlx::query_as::<_, (bool, String, String, i64, i64)>(
                "SELECT active, url, created_by, version, \
                        (SELECT count(*) FROM outbox WHERE subject = $1) FROM event_sinks WHERE id = $1",
            )
            .bind(&sink)
            .fetch_one(&pool)
            .await
            .expect("the sink")
        }
    };
    let before = stored(&app).await;
    assert_eq!((before.0, before.2.as_str()), (false, "erin"));
    // Another member of acme: a resume alone, with a URL alone or with a new secret alone is
    // refused, and leaves the sink, its version and its events as they were.
    let alice = app.member("acme");
    for change in [
        json!({ "active": true }),
        json!({ "active": true, "url": "http://127.0.0.1:9/alice" }),
        json!({ "active": true, "rotateSecret": true }),
    ] {
        let mut i = change.clone();
        i["id"] = json!(sink);
        let (code, error) = app.fails(&alice, UPDATE, json!({ "i": i })).await;
        assert_eq!(code, "FORBIDDEN", "{change}: {error}");
        assert!(
            error["message"]
                .as_str()
                .unwrap_or_default()
                .contains("rotateSecret"),
            "{error}"
        );
        assert_eq!(stored(&app).await, before, "{change} changed nothing");
    }
    // Taken over: active, the URL given, alice's, and a new secret shown once.
    let taken = app
        .ok(
            &alice,
            UPDATE,
            json!({ "i": { "id": sink, "active": true, "url": "http://127.0.0.1:9/alice", "rotateSecret": true } }),
        )
        .await["updateEventSink"]
        .clone();
    assert_eq!(taken["eventSink"]["active"], true);
    let secret = taken["secret"].as_str().expect("a new secret").to_owned();
    assert!(secret.starts_with("whsec_"), "{secret}");
    assert_ne!(json!(secret), made["secret"]);
    let after = stored(&app).await;
    assert_eq!(
        (after.0, after.1.as_str(), after.2.as_str()),
        (true, "http://127.0.0.1:9/alice", "alice@acme")
    );
    let (sealed,): (String,) = sqlx::query_as("SELECT secret FROM event_sinks WHERE id = $1")
        .bind(&sink)
        .fetch_one(app.db.db.pool())
        .await
        .expect("the secret");
    assert_eq!(
        compute_domain::secrets::open(app.db.db.keyring(), &sealed, &sink).expect("opens"),
        secret,
        "deliveries are signed with the secret the new owner was shown"
    );
    // A sink whose creator is still covered, paused by hand, is resumed by a teammate as it
    // is (no takeover), and its secret stays unless asked.
    let own = app
        .ok(&alice, CREATE, json!({ "url": "http://127.0.0.1:9/own" }))
        .await["createEventSink"]["eventSink"]["id"]
        .clone();
    app.ok(
        &alice,
        UPDATE,
        json!({ "i": { "id": own, "active": false } }),
    )
    .await;
    let bob = app.token("bob", Some("acme"), &[Role::Member]);
    let resumed = app
        .ok(&bob, UPDATE, json!({ "i": { "id": own, "active": true } }))
        .await["updateEventSink"]
        .clone();
    assert_eq!(resumed["eventSink"]["active"], true);
    assert_eq!(resumed["secret"], Value::Null);
    let (owner,): (String,) = sqlx::query_as("SELECT created_by FROM event_sinks WHERE id = $1")
        .bind(own.as_str())
        .fetch_one(app.db.db.pool())
        .await
        .expect("owner");
    assert_eq!(owner, "alice@acme");
    let rotated = app
        .ok(
            &bob,
            UPDATE,
            json!({ "i": { "id": own, "rotateSecret": true } }),
        )
        .await["updateEventSink"]
        .clone();
    assert!(
        rotated["secret"]
            .as_str()
            .is_some_and(|s| s.starts_with("whsec_")),
        "{rotated}"
    );
}

/// A first grant makes a subject managed: what its token's claims gave stops counting, and so
/// do the event sinks it made under them. Moving a member of acme (by its claims) to beta
/// pauses its acme sink in the grant's transaction; its beta sink made afterwards stays.
#[tokio::test]
async fn a_grant_that_moves_a_member_pauses_the_sinks_of_its_former_tenant() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let alice = app.token("alice", Some("acme"), &[Role::Member]);
    const CREATE: &str = "mutation { createEventSink(input: { url: \"http://127.0.0.1:9/hook\" }) { eventSink { id } } }";
    let sink =
        app.ok(&alice, CREATE, json!({})).await["createEventSink"]["eventSink"]["id"].clone();
    let moved = app
        .ok(
            &admin,
            "mutation($input: GrantRoleInput!) { grantRole(input: $input) { grant { id } pausedEventSinkIds idempotentReplay } }",
            json!({ "input": { "subject": "alice", "role": "MEMBER", "tenantId": "beta", "idempotencyKey": "move-alice" } }),
        )
        .await["grantRole"]
        .clone();
    assert_eq!(
        moved["pausedEventSinkIds"],
        json!([sink.clone()]),
        "{moved}"
    );
    let active = |id: Value| {
        let pool = app.db.db.pool().clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT active FROM event_sinks WHERE id = $1")
                .bind(id.as_str().unwrap_or_default().to_owned())
                .fetch_one(&pool)
                .await
                .expect("the sink")
        }
    };
    assert!(
        !active(sink.clone()).await,
        "acme's events no longer go to alice's sink"
    );
    let paused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'event_sink.updated' AND subject = $1",
    )
    .bind(sink.as_str().unwrap_or_default())
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(paused, 1, "the pause is an event");
    // Her token still says acme; her grant says beta, and a sink of beta is hers to keep.
    let beta = app.token("alice", Some("beta"), &[Role::Member]);
    eventually("alice's grant is felt", WAIT, || async {
        (viewer(&app, &beta).await["tenantId"] == json!("beta")).then_some(())
    })
    .await;
    let kept = app.ok(&beta, CREATE, json!({})).await["createEventSink"]["eventSink"]["id"].clone();
    let again = app
        .ok(
            &admin,
            GRANT,
            json!({ "input": { "subject": "alice", "role": "OPERATOR", "scopeId": null } }),
        )
        .await;
    assert!(again["grantRole"]["grant"]["id"].is_string(), "{again}");
    assert!(active(kept).await, "a sink her grants cover stays active");
}

/// A connection resolves its caller, then listens for changes that shrink it: a revocation
/// applied between the two (a WebSocket opened as its subject was revoked) is found at the
/// first look, not missed until the token expires.
#[tokio::test]
async fn a_revocation_between_resolving_a_caller_and_listening_is_not_missed() {
    use compute_api::auth::{Claimed, Viewer};
    use compute_domain::ids::TenantId;
    let app = spawn_app().await;
    let admin = admin(&app);
    app.ok(
        &admin,
        GRANT,
        json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
    )
    .await;
    let projection = compute_api::authz::Authz::load(app.db.db.clone(), app.clock.clone())
        .await
        .expect("a projection");
    let acme = TenantId::parse("tenant", "acme").expect("a tenant");
    let claimed = Viewer {
        subject: "erin".into(),
        issuer: compute_tests::TEST_ISSUER.into(),
        tenant: Some(acme.clone()),
        roles: vec![Role::Member],
        scopes: Vec::new(),
        unavailable: false,
        claimed: Some(Claimed {
            roles: vec![Role::Member],
            tenant: Some(acme),
        }),
        node: None,
        expires_at: i64::MAX,
        valid_for: Duration::from_secs(3600),
    };
    let before = projection.resolve(claimed);
    assert_eq!(before.roles, [Role::Member]);
    // A listener from before the revocation hears it; one from after looks once.
    let early = projection.shrinks(Some(&before));
    app.ok(
        &admin,
        REVOKE,
        json!({ "input": { "subject": "erin", "role": "MEMBER", "tenantId": "acme" } }),
    )
    .await;
    projection
        .step()
        .await
        .expect("the projection reads the change");
    let late = projection.shrinks(Some(&before));
    for (which, listener) in [("early", early), ("late", late)] {
        tokio::time::timeout(WAIT, listener)
            .await
            .unwrap_or_else(|_| panic!("the {which} listener missed the revocation"));
    }
    // A caller the grants still cover is not closed at the first look.
    let covered = projection.resolve(before.clone());
    assert!(
        tokio::time::timeout(
            Duration::from_millis(200),
            projection.shrinks(Some(&covered))
        )
        .await
        .is_err(),
        "nothing shrank for a caller resolved after the change"
    );
}

/// A token that gives no role that reads the fleet reads nothing of it: a node daemon's, and a
/// subject whose claims a revocation took away. `viewer` still answers who they are.
#[tokio::test]
async fn a_caller_without_a_reading_role_reads_nothing_of_the_fleet() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let p = crate::reservations::pool(&app).await;
    let bob = app.token("bob", None, &[Role::Operator]);
    let revoked = app
        .ok(
            &admin,
            REVOKE,
            json!({ "input": { "subject": "bob", "role": "OPERATOR" } }),
        )
        .await;
    assert!(
        revoked["revokeRole"]["revokedGrantId"].is_null(),
        "{revoked}"
    );
    eventually("bob's revocation is felt", WAIT, || async {
        (viewer(&app, &bob).await["roles"] == json!([])).then_some(())
    })
    .await;
    let node = app.node_token(&p.nodes[0]);
    let pool_id = p.pool.clone();
    let reads = [
        ("{ sites(first: 5) { totalCount } }".to_owned(), json!({})),
        ("{ pools(first: 5) { totalCount } }".to_owned(), json!({})),
        (
            "query($id: ID!) { node(id: $id) { id } }".to_owned(),
            json!({ "id": pool_id }),
        ),
        ("{ eventCursor }".to_owned(), json!({})),
    ];
    for (who, token) in [("a node daemon", &node), ("a revoked subject", &bob)] {
        for (q, vars) in &reads {
            let (_, body) = app.graphql(q, vars.clone(), Some(token)).await;
            assert_eq!(code(&body), "FORBIDDEN", "{who}: {q}: {body}");
            assert!(
                body["data"].is_null() || !body["data"].to_string().contains("pool_"),
                "{who}: {body}"
            );
        }
        let (_, body) = app
            .graphql("{ viewer { subject roles } }", json!({}), Some(token))
            .await;
        assert_eq!(code(&body), "OK", "{who}: {body}");
    }
    // A member still reads the fleet's public face.
    let member = app.member("acme");
    let (_, body) = app
        .graphql(
            "{ pools(first: 5) { totalCount } }",
            json!({}),
            Some(&member),
        )
        .await;
    assert_eq!(code(&body), "OK", "{body}");
    assert!(
        body["data"]["pools"]["totalCount"].as_i64().unwrap_or(0) >= 1,
        "{body}"
    );
}

#[tokio::test]
async fn a_scoped_operator_changes_only_its_pool_and_sees_only_its_commands() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let ops = app.operator();
    let site = app
        .ok(
            &ops,
            "mutation { createSite(input: { name: \"s1\" }) { site { id } } }",
            json!({}),
        )
        .await["createSite"]["site"]["id"]
        .clone();
    let pool = |name: &str| {
        let (app, ops, site) = (&app, ops.clone(), site.clone());
        let name = name.to_owned();
        async move {
            app.ok(
                &ops,
                "mutation($s: ID!, $n: String!) { createPool(input: { siteId: $s, name: $n, kind: BARE_METAL }) { pool { id } } }",
                json!({ "s": site, "n": name }),
            )
            .await["createPool"]["pool"]["id"]
                .clone()
        }
    };
    let (mine, theirs) = (pool("mine").await, pool("theirs").await);
    let node = |pool: Value, host: &str| {
        let (app, ops) = (&app, ops.clone());
        let host = host.to_owned();
        async move {
            app.ok(
                &ops,
                "mutation($p: ID!, $h: String!) { registerNode(input: { poolId: $p, hostname: $h, resources: { vcpu: 8, memoryMib: 1024, diskGib: 10 } }) { computeNode { id version } } }",
                json!({ "p": pool, "h": host }),
            )
            .await["registerNode"]["computeNode"]["id"]
                .clone()
        }
    };
    let (my_node, their_node) = (
        node(mine.clone(), "h-mine").await,
        node(theirs.clone(), "h-theirs").await,
    );
    app.ok(
        &admin,
        GRANT,
        json!({ "input": { "subject": "paula", "role": "OPERATOR", "scopeId": mine } }),
    )
    .await;
    let paula = app.token("paula", None, &[Role::Operator]);
    eventually("paula's grant is felt", WAIT, || async {
        (viewer(&app, &paula).await["operatorScopeIds"] == json!([mine.clone()])).then_some(())
    })
    .await;
    assert_eq!(
        viewer(&app, &paula).await["roles"],
        json!([]),
        "no fleet-wide operator role"
    );

    const CORDON: &str =
        "mutation($id: ID!) { cordonNode(input: { id: $id }) { computeNode { cordoned } } }";
    const RUN: &str = "mutation($n: ID!, $k: String!) { runCommand(input: { computeNodeId: $n, kind: NOOP, idempotencyKey: $k }) { command { id } } }";
    let run =
        |node: &Value, key: &str| app.graphql(RUN, json!({ "n": node, "k": key }), Some(&paula));
    assert_eq!(
        code(
            &app.graphql(CORDON, json!({ "id": my_node }), Some(&paula))
                .await
                .1
        ),
        "OK"
    );
    assert_eq!(
        code(
            &app.graphql(CORDON, json!({ "id": their_node }), Some(&paula))
                .await
                .1
        ),
        "FORBIDDEN"
    );
    let (_, mine_cmd) = run(&my_node, "k1").await;
    assert_eq!(code(&mine_cmd), "OK", "{mine_cmd}");
    assert_eq!(code(&run(&their_node, "k2").await.1), "FORBIDDEN");
    // Whole-fleet changes are not a pool operator's.
    assert_eq!(
        code(
            &app.graphql(
                "mutation { createSite(input: { name: \"s2\" }) { site { id } } }",
                json!({}),
                Some(&paula)
            )
            .await
            .1
        ),
        "FORBIDDEN"
    );
    assert_eq!(
        code(&app.graphql("mutation($s: ID!) { createPool(input: { siteId: $s, name: \"x\", kind: BARE_METAL }) { pool { id } } }", json!({ "s": site }), Some(&paula)).await.1),
        "FORBIDDEN"
    );
    // Its commands: one node of its pool at a time; another pool's command is refused.
    let (_, theirs_cmd) = app
        .graphql(RUN, json!({ "n": their_node, "k": "k3" }), Some(&ops))
        .await;
    let their_cmd = theirs_cmd["data"]["runCommand"]["command"]["id"].clone();
    const COMMANDS: &str = "query($n: ID) { commands(computeNodeId: $n) { totalCount } }";
    let listed = app.ok(&paula, COMMANDS, json!({ "n": my_node })).await;
    assert_eq!(listed["commands"]["totalCount"], 1);
    assert_eq!(
        code(
            &app.graphql(COMMANDS, json!({ "n": their_node }), Some(&paula))
                .await
                .1
        ),
        "FORBIDDEN"
    );
    assert_eq!(
        code(&app.graphql(COMMANDS, json!({}), Some(&paula)).await.1),
        "FORBIDDEN"
    );
    assert_eq!(
        code(
            &app.graphql(
                "query($id: ID!) { command(id: $id) { id } }",
                json!({ "id": their_cmd }),
                Some(&paula)
            )
            .await
            .1
        ),
        "FORBIDDEN"
    );
}

#[tokio::test]
async fn a_service_account_gets_a_scoped_token_shown_once_and_revocable() {
    let app = spawn_app().await;
    let admin = admin(&app);
    let made = app
        .ok(
            &admin,
            "mutation { createServiceAccount(input: { name: \"billing exporter\", expiresInSeconds: 3600, role: MEMBER, tenantId: \"acme\" }) { serviceAccount { id name expiresAt } grant { role tenantId } token } }",
            json!({}),
        )
        .await["createServiceAccount"]
        .clone();
    let token = made["token"].as_str().expect("a token").to_owned();
    let id = made["serviceAccount"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert!(token.starts_with("cst_"), "{token}");
    // Only the token's hash is kept.
    let (hash,): (Vec<u8>,) =
        sqlx::query_as("SELECT token_hash FROM service_accounts WHERE id = $1")
            .bind(&id)
            .fetch_one(app.db.db.pool())
            .await
            .expect("the account");
    assert_eq!(hash, compute_domain::authz::token_hash(&token));
    let (stored,): (String,) =
        sqlx::query_as("SELECT row_to_json(s)::text FROM service_accounts s WHERE id = $1")
            .bind(&id)
            .fetch_one(app.db.db.pool())
            .await
            .expect("the row");
    assert!(!stored.contains(&token[4..]), "the token is not stored");

    let me = eventually("the account is known", WAIT, || async {
        let (status, body) = app.graphql(VIEWER, json!({}), Some(&token)).await;
        (status == 200 && code(&body) == "OK").then(|| body["data"]["viewer"].clone())
    })
    .await;
    assert_eq!(me["subject"], id.as_str());
    assert_eq!(me["issuer"], "compute:service-account");
    assert_eq!(me["tenantId"], "acme");
    assert_eq!(me["roles"], json!(["MEMBER"]));
    // Its grant is its scope: not an operator.
    let (c, _) = app
        .fails(
            &token,
            "mutation { createSite(input: { name: \"s\" }) { site { id } } }",
            json!({}),
        )
        .await;
    assert_eq!(c, "FORBIDDEN");
    // A wrong token is 401.
    let (status, _) = app
        .graphql(VIEWER, json!({}), Some(&format!("cst_{}", "0".repeat(64))))
        .await;
    assert_eq!(status, 401);

    // Revoked: refused within a second.
    app.ok(
        &admin,
        "mutation($id: ID!) { revokeServiceAccount(input: { id: $id }) { serviceAccount { revokedAt revokedBy } } }",
        json!({ "id": id }),
    )
    .await;
    let started = Instant::now();
    eventually("the revoked token is refused", WAIT, || async {
        (app.graphql(VIEWER, json!({}), Some(&token)).await.0 == 401).then_some(())
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    // Another one expires with business time.
    let made = app
        .ok(
            &admin,
            "mutation { createServiceAccount(input: { name: \"ci\", expiresInSeconds: 120, role: OPERATOR }) { token } }",
            json!({}),
        )
        .await["createServiceAccount"]
        .clone();
    let ci = made["token"].as_str().expect("a token").to_owned();
    eventually("the account is known", WAIT, || async {
        (code(&app.graphql(VIEWER, json!({}), Some(&ci)).await.1) == "OK").then_some(())
    })
    .await;
    app.db.advance_clock(121).await;
    let (status, body) = app.graphql(VIEWER, json!({}), Some(&ci)).await;
    assert_eq!(status, 401, "{body}");
}

/// A value of GraphQL input type `ty` for field `field` of mutation `mutation`, from the
/// introspection `types`: well-formed, so a refusal is the authorization's, not the parser's.
fn sample(types: &Value, ty: &Value, field: &str, mutation: &str) -> Option<Value> {
    match ty["kind"].as_str()? {
        "NON_NULL" => sample(types, &ty["ofType"], field, mutation),
        "LIST" => Some(json!([])),
        "SCALAR" => Some(match ty["name"].as_str()? {
            "ID" => {
                let prefix = id_prefix(field, mutation);
                json!(format!("{prefix}_{}", "0".repeat(32)))
            }
            "String" => match field {
                "idempotencyKey" => json!("key-1"),
                "url" => json!("http://127.0.0.1:9/hook"),
                "tenantId" => json!("acme"),
                "hostname" => json!("h1"),
                "reason" => json!("because"),
                "subject" => json!("someone"),
                _ => json!("x1"),
            },
            "Int" => json!(60),
            "Float" => json!(1.0),
            "Boolean" => json!(false),
            "DateTime" => json!("2031-01-01T00:00:00Z"),
            "JSON" => json!({}),
            _ => json!("x1"),
        }),
        "ENUM" => {
            let name = ty["name"].as_str()?;
            let t = types.as_array()?.iter().find(|t| t["name"] == name)?;
            Some(t["enumValues"][0]["name"].clone())
        }
        "INPUT_OBJECT" => {
            let name = ty["name"].as_str()?;
            let t = types.as_array()?.iter().find(|t| t["name"] == name)?;
            let mut out = serde_json::Map::new();
            for f in t["inputFields"].as_array()? {
                if f["type"]["kind"] == "NON_NULL" && f["defaultValue"].is_null() {
                    let n = f["name"].as_str()?;
                    out.insert(n.to_owned(), sample(types, &f["type"], n, mutation)?);
                }
            }
            Some(Value::Object(out))
        }
        _ => None,
    }
}

/// The id prefix of an `ID` field.
fn id_prefix(field: &str, mutation: &str) -> &'static str {
    let by_field = [
        ("siteId", "site"),
        ("poolId", "pool"),
        ("scopeId", "pool"),
        ("computeNodeId", "node"),
        ("reservationId", "rsv"),
        ("allocationId", "alc"),
        ("deviceId", "dev"),
    ];
    if let Some((_, p)) = by_field.iter().find(|(f, _)| *f == field) {
        return p;
    }
    let by_mutation = [
        ("JoinToken", "njt"),
        ("Site", "site"),
        ("Pool", "pool"),
        ("Node", "node"),
        ("Device", "dev"),
        ("Reservation", "rsv"),
        ("EventSink", "snk"),
        ("Command", "cmd"),
        ("Instance", "ins"),
        ("ServiceAccount", "sa"),
    ];
    by_mutation
        .iter()
        .find(|(m, _)| mutation.contains(m))
        .map(|(_, p)| *p)
        .unwrap_or("x")
}

/// Every mutation of the schema, asked by a caller whose grants give it nothing, is
/// `FORBIDDEN`: a new mutation that forgets to ask is caught here.
#[tokio::test]
async fn every_mutation_refuses_a_caller_without_the_grant() {
    let app = spawn_app().await;
    let admin = admin(&app);
    // Mallory's token claims everything; an administrator took it all away.
    app.ok(
        &admin,
        REVOKE,
        json!({ "input": { "subject": "mallory", "role": "OPERATOR" } }),
    )
    .await;
    let mallory = app.token(
        "mallory",
        Some("acme"),
        &[Role::Admin, Role::Operator, Role::Member],
    );
    eventually("mallory is managed", WAIT, || async {
        (viewer(&app, &mallory).await["roles"] == json!([])).then_some(())
    })
    .await;
    // A member may not do an administrator's or an operator's work either.
    let member = app.member("acme");
    let schema = app
        .ok(
            &admin,
            "{ __schema { mutationType { fields { name args { name type { kind name ofType { kind name ofType { kind name } } } } } }
               types { name kind enumValues { name } inputFields { name defaultValue type { kind name ofType { kind name ofType { kind name } } } } } } }",
            json!({}),
        )
        .await;
    let types = &schema["__schema"]["types"];
    let fields = schema["__schema"]["mutationType"]["fields"]
        .as_array()
        .expect("mutations");
    assert!(fields.len() >= 36, "{} mutations", fields.len());
    let member_may = [
        "createReservation",
        "extendReservation",
        "releaseReservation",
        "cancelReservation",
        "createEventSink",
        "updateEventSink",
        "deleteEventSink",
        "createInstance",
        "stopInstance",
    ];
    let mut wrong = Vec::new();
    for f in fields {
        let name = f["name"].as_str().expect("a name");
        let mut args = serde_json::Map::new();
        let mut decl = Vec::new();
        let mut uses = Vec::new();
        for a in f["args"].as_array().expect("args") {
            let an = a["name"].as_str().expect("an arg name");
            let Some(v) = sample(types, &a["type"], an, name) else {
                wrong.push(format!("{name}: no sample for argument {an}"));
                continue;
            };
            args.insert(an.to_owned(), v);
            decl.push(format!("${an}: {}", type_ref(&a["type"])));
            uses.push(format!("{an}: ${an}"));
        }
        let doc = format!(
            "mutation({}) {{ {name}({}) {{ __typename }} }}",
            decl.join(", "),
            uses.join(", ")
        );
        let callers: Vec<(&str, &String)> = if member_may.contains(&name) {
            vec![("mallory", &mallory)]
        } else {
            vec![("mallory", &mallory), ("a member", &member)]
        };
        for (who, token) in callers {
            let (_, body) = app
                .graphql(&doc, Value::Object(args.clone()), Some(token))
                .await;
            let c = code(&body);
            if c != "FORBIDDEN" {
                wrong.push(format!("{name} by {who}: {c}: {body}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A type reference as a variable declaration writes it.
fn type_ref(ty: &Value) -> String {
    match ty["kind"].as_str() {
        Some("NON_NULL") => format!("{}!", type_ref(&ty["ofType"])),
        Some("LIST") => format!("[{}]", type_ref(&ty["ofType"])),
        _ => ty["name"].as_str().unwrap_or_default().to_owned(),
    }
}

/// `serve --authz grants`: a token's claims give nothing; `grant-admin`'s grant does.
#[tokio::test]
async fn with_grants_only_a_token_without_grants_has_no_role() {
    let app = TestApp::builder().grants_only().start().await;
    let claimed = app.token("root@admins", None, &[Role::Admin, Role::Operator]);
    let (c, _) = app
        .fails(
            &claimed,
            "mutation { createSite(input: { name: \"s\" }) { site { id } } }",
            json!({}),
        )
        .await;
    assert_eq!(c, "FORBIDDEN");
    assert_eq!(viewer(&app, &claimed).await["roles"], json!([]));
    // The first administrator, made without a token (`compute-api grant-admin`).
    compute_domain::authz::bootstrap_admin(&app.db.db, compute_tests::TEST_ISSUER, "root@admins")
        .await
        .expect("bootstrap");
    eventually("the administrator's grant is felt", WAIT, || async {
        (viewer(&app, &claimed).await["roles"] == json!(["ADMIN", "OPERATOR"])).then_some(())
    })
    .await;
    app.ok(
        &claimed,
        "mutation { createSite(input: { name: \"s\" }) { site { id } } }",
        json!({}),
    )
    .await;
}

/// With the database unreachable, decisions come from the projection while it is trusted,
/// then are refused with the retryable `UNAVAILABLE`, never allowed; they come back with the
/// database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_unreachable_old_grants_are_trusted_briefly_then_refused() {
    use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres};
    let dir = std::env::temp_dir()
        .join("compute-tests")
        .join(format!("authz-outage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = EmbeddedOptions {
        data_dir: dir.clone(),
        durable: false,
        max_connections: 40,
    };
    let mut pg = EmbeddedPostgres::start(options.clone())
        .await
        .expect("the test's own server");
    pg.ensure_database("authz").await.expect("database");
    let db = compute_tests::test_db_at(&pg.url("authz"), "authz", true).await;
    let app = TestApp::builder()
        .on(db)
        .authz_trust(Duration::from_secs(2))
        .start()
        .await;
    let member = app.member("acme");
    assert_eq!(viewer(&app, &member).await["roles"], json!(["MEMBER"]));
    pg.shutdown();
    let down = Instant::now();
    // `viewer` reads no table: it answers from the projection while the projection is trusted.
    let (_, body) = app.graphql(VIEWER, json!({}), Some(&member)).await;
    assert_eq!(code(&body), "OK", "{body}");
    let refused = eventually("old grants stop being trusted", WAIT, || async {
        let (_, body) = app.graphql(VIEWER, json!({}), Some(&member)).await;
        (code(&body) != "OK").then_some(body)
    })
    .await;
    assert!(
        down.elapsed() >= Duration::from_secs(1),
        "{:?}",
        down.elapsed()
    );
    assert_eq!(code(&refused), "UNAVAILABLE", "{refused}");
    assert_eq!(
        refused["errors"][0]["extensions"]["retryable"], true,
        "{refused}"
    );
    // `/metrics` says why: the projection's age past its trust, and the refusals counted.
    let metrics = app.metrics().await;
    let figure = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} is exported: {metrics}"))
    };
    assert!(
        figure("compute_authz_projection_age_seconds") >= 1.0,
        "{metrics}"
    );
    assert!(
        figure("compute_authz_stale_refusals_total") >= 1.0,
        "{metrics}"
    );
    assert!(figure("compute_authz_feed_reads_total") >= 1.0, "{metrics}");
    pg.start_again(&options)
        .await
        .expect("the database is back");
    eventually("grants are read again", Duration::from_secs(30), || async {
        let (_, body) = app.graphql(VIEWER, json!({}), Some(&member)).await;
        (code(&body) == "OK").then_some(())
    })
    .await;
    drop(app);
    pg.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The feed keeps a day: older changes are pruned (the grants stay, they are their own rows),
/// newer ones and the projection's decisions are untouched.
#[tokio::test]
async fn the_feed_is_pruned_after_a_day_and_the_grants_stay() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let admin = admin(&app);
    app.ok(
        &admin,
        GRANT,
        json!({ "input": { "subject": "old", "role": "MEMBER", "tenantId": "acme" } }),
    )
    .await;
    // The projection has read the change (it polls every 100 ms) before a day passes.
    let old = app.token("old", Some("beta"), &[Role::Member]);
    eventually("old's grant is felt", WAIT, || async {
        (viewer(&app, &old).await["tenantId"] == "acme").then_some(())
    })
    .await;
    app.db.advance_clock(25 * 3600).await;
    let admin = self::admin(&app);
    app.ok(
        &admin,
        GRANT,
        json!({ "input": { "subject": "new", "role": "MEMBER", "tenantId": "beta" } }),
    )
    .await;
    let feed = || async {
        sqlx::query_scalar::<_, String>("SELECT subject FROM authz_changes ORDER BY txid, seq")
            .fetch_all(app.db.db.pool())
            .await
            .expect("feed")
    };
    assert_eq!(feed().await, ["old", "new"]);
    // The pruning keeps what a transaction still running anywhere in the cluster might not
    // have seen (`txid < xmin`, cluster-wide), and the other tests' databases share this
    // cluster: one of their transactions, begun before the old grant, holds it back a moment.
    let deadline = Instant::now() + WAIT;
    let mut pruned = 0;
    while pruned == 0 && Instant::now() < deadline {
        pruned += compute_domain::authz::prune(&app.db.db)
            .await
            .expect("prune");
        if pruned == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_eq!(pruned, 1);
    assert_eq!(
        feed().await,
        ["new"],
        "only the change older than a day went"
    );
    assert_eq!(
        app.count("authz_grants WHERE subject = 'old'").await,
        1,
        "its grant stays"
    );
    let old = app.token("old", Some("beta"), &[Role::Member]);
    assert_eq!(
        viewer(&app, &old).await["tenantId"],
        "acme",
        "decided by its grant"
    );
}

/// A grant to a service account takes the account's row before the principal's, as revoking
/// the account does: a transaction that holds the account `FOR UPDATE` and then the principal
/// (the revocation's order) makes the grant wait, holding nothing; the other way round the two
/// waited on each other.
#[tokio::test]
async fn a_grant_to_a_service_account_locks_the_account_before_the_principal() {
    use compute_domain::authz::{GrantRole, GrantSpec, Principal, create_service_account, grant};
    use compute_domain::idempotency::Actor;
    let app = spawn_app().await;
    let admin = Actor::operator("root");
    let (account, _, _) = create_service_account(&app.db.db, &admin, "ci", 3600, None)
        .await
        .expect("an account");
    let principal = Principal::service_account(&account.id);
    let mut side = app
        .db
        .db
        .pool()
        .begin()
        .await
        .expect("a second transaction");
    sqlx::query("SELECT 1 FROM service_accounts WHERE id = $1 FOR UPDATE")
        .bind(account.id.as_str())
        .execute(&mut *side)
        .await
        .expect("hold the account, as its revocation does");
    let db = app.db.db.clone().without_contention_retry();
    let spec = GrantSpec {
        principal: principal.clone(),
        role: GrantRole::Member,
        tenant_id: Some(compute_tests::tenant("acme")),
        scope_id: None,
    };
    let granting = tokio::spawn(async move { grant(&db, &admin, spec, None).await });
    app.until_lock_waiters(1).await;
    sqlx::query(
        "INSERT INTO authz_principals AS a (issuer, subject, managed_by) VALUES ($1, $2, 'root')
         ON CONFLICT (issuer, subject) DO UPDATE SET managed_by = a.managed_by",
    )
    .bind(&principal.issuer)
    .bind(&principal.subject)
    .execute(&mut *side)
    .await
    .expect("the principal: the grant holds no row while it waits");
    side.rollback().await.expect("let go");
    let made = granting.await.expect("join").expect("granted, no deadlock");
    assert_eq!(made.value.grant.subject, principal.subject);
    assert_eq!(made.value.grant.role, GrantRole::Member);
}

/// A service account's event sink is paused when the account expires, as when it is revoked:
/// an expired token holds nothing (the reconciler's pass pauses it, with its
/// `event_sink.updated` event), and a member who resumes it sees it paused again at the next
/// pass (level-triggered).
#[tokio::test]
async fn an_expired_service_accounts_sinks_are_paused_at_every_pass() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let admin = admin(&app);
    let made = app
        .ok(
            &admin,
            "mutation { createServiceAccount(input: { name: \"exporter\", expiresInSeconds: 120, role: MEMBER, tenantId: \"acme\" }) { serviceAccount { id } token } }",
            json!({}),
        )
        .await["createServiceAccount"]
        .clone();
    let token = made["token"].as_str().expect("a token").to_owned();
    let account = made["serviceAccount"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    eventually("the account is known", WAIT, || async {
        (code(&app.graphql(VIEWER, json!({}), Some(&token)).await.1) == "OK").then_some(())
    })
    .await;
    let sink = app
        .ok(
            &token,
            "mutation { createEventSink(input: { url: \"http://127.0.0.1:9/hook\" }) { eventSink { id } } }",
            json!({}),
        )
        .await["createEventSink"]["eventSink"]["id"]
        .as_str()
        .expect("sink")
        .to_owned();
    let state = || async {
        sqlx::query_as::<_, (bool, String)>(
            "SELECT active, created_by FROM event_sinks WHERE id = $1",
        )
        .bind(&sink)
        .fetch_one(app.db.db.pool())
        .await
        .expect("the sink")
    };
    let mut reconciler = compute_workers::Reconciler::new(app.db.db.clone(), "worker-authz");
    assert_eq!(reconciler.pass().await.expect("pass").sinks_paused, 0);
    assert_eq!(state().await, (true, account.clone()));
    app.db.advance_clock(121).await;
    assert_eq!(reconciler.pass().await.expect("pass").sinks_paused, 1);
    assert_eq!(state().await, (false, account.clone()), "paused at expiry");
    let updated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE type = 'event_sink.updated' AND subject = $1",
    )
    .bind(&sink)
    .fetch_one(app.db.db.pool())
    .await
    .expect("events");
    assert_eq!(updated, 1);
    // A member of acme cannot resume it as it is (it would deliver where the account chose,
    // with the account's secret).
    let member = app.member("acme");
    const UPDATE: &str = "mutation($i: UpdateEventSinkInput!) { updateEventSink(input: $i) { eventSink { active } } }";
    let (code, _) = app
        .fails(
            &member,
            UPDATE,
            json!({ "i": { "id": sink, "active": true } }),
        )
        .await;
    assert_eq!(code, "FORBIDDEN");
    // Active again all the same (a resume that committed just before the account expired):
    // the next pass pauses it again.
    sqlx::query("UPDATE event_sinks SET active = true WHERE id = $1")
        .bind(sink.as_str())
        .execute(app.db.db.pool())
        .await
        .expect("resume");
    assert_eq!(reconciler.pass().await.expect("pass").sinks_paused, 1);
    assert_eq!(state().await, (false, account), "paused again");
    // Taken over, it is the member's, and the passes leave it alone.
    app.ok(
        &member,
        UPDATE,
        json!({ "i": { "id": sink, "active": true, "url": "http://127.0.0.1:9/mine", "rotateSecret": true } }),
    )
    .await;
    assert_eq!(state().await, (true, "alice@acme".to_owned()));
    assert_eq!(reconciler.pass().await.expect("pass").sinks_paused, 0);
    assert_eq!(state().await, (true, "alice@acme".to_owned()));
}
