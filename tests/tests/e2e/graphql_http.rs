//! Conformance to the GraphQL-over-HTTP specification.

use compute_tests::spawn_app;
use serde_json::{Value, json};

const GQL: &str = "application/graphql-response+json";

async fn post(
    app: &compute_tests::TestApp,
    accept: Option<&str>,
    body: &str,
) -> (u16, String, String) {
    let mut req = app
        .http
        .post(app.url("/graphql"))
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    if let Some(a) = accept {
        req = req.header("Accept", a);
    }
    let res = req.send().await.expect("POST");
    let status = res.status().as_u16();
    let ct = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    (status, ct, res.text().await.expect("body"))
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).expect("JSON")
}

#[tokio::test]
async fn the_response_media_type_follows_accept() {
    let app = spawn_app().await;
    let q = r#"{"query":"{ __typename }"}"#;
    let (s, ct, body) = post(&app, Some(GQL), q).await;
    assert_eq!(
        (s, ct.as_str()),
        (200, "application/graphql-response+json; charset=utf-8")
    );
    assert_eq!(parse(&body)["data"]["__typename"], "Query");

    let (s, ct, _) = post(&app, Some("application/json"), q).await;
    assert_eq!((s, ct.as_str()), (200, "application/json; charset=utf-8"));

    // (No Accept at all means application/json: a unit test covers it; this client always sends one.)
    // A wildcard is a legacy client's: application/json, as the specification says a server
    // SHOULD answer it (the graphql-http audit's two findings).
    let (s, ct, _) = post(&app, Some("*/*"), q).await;
    assert_eq!((s, ct.as_str()), (200, "application/json; charset=utf-8"));
    let (s, ct, body) = post(&app, Some("*/*"), r#"{"query": "{ nope }"}"#).await;
    assert_eq!(
        (s, ct.as_str()),
        (200, "application/json; charset=utf-8"),
        "a request error is 200 for application/json: {body}"
    );

    let (s, _, _) = post(&app, Some("application/xml"), q).await;
    assert_eq!(s, 406);
}

/// The specification's response fields come in the order the selection set asks for them (a
/// serializer through a sorted map would write `alpha`, `mid`, `zeta`), and `data` before
/// `extensions`.
#[tokio::test]
async fn response_fields_follow_the_selection_order() {
    let app = spawn_app().await;
    let q = r#"{"query":"{ zeta: __typename alpha: __typename mid: __typename }"}"#;
    let (s, _, body) = post(&app, Some(GQL), q).await;
    assert_eq!(s, 200, "{body}");
    let at = |key: &str| {
        body.find(&format!("\"{key}\""))
            .unwrap_or_else(|| panic!("{key} in {body}"))
    };
    assert!(
        at("zeta") < at("alpha") && at("alpha") < at("mid"),
        "fields in selection order: {body}"
    );
    assert!(at("data") < at("extensions"), "data first: {body}");
    assert_eq!(parse(&body)["data"]["mid"], "Query");
}

#[tokio::test]
async fn request_errors_are_400_with_graphql_response_json_and_200_with_json() {
    let app = spawn_app().await;
    for (query, code) in [
        ("{ viewer { ", "GRAPHQL_PARSE_FAILED"),
        ("{ noSuchField }", "GRAPHQL_VALIDATION_FAILED"),
        // A subscription over plain HTTP: told where to go instead.
        ("subscription { events { id } }", "BAD_REQUEST"),
    ] {
        let body = json!({ "query": query }).to_string();
        let (s, _, text) = post(&app, Some(GQL), &body).await;
        let v = parse(&text);
        assert_eq!(s, 400, "{query}: {text}");
        assert!(
            v.get("data").is_none(),
            "a request error has no data entry: {text}"
        );
        assert_eq!(v["errors"][0]["extensions"]["code"], code, "{text}");

        let (s, _, text) = post(&app, Some("application/json"), &body).await;
        assert_eq!(s, 200, "legacy application/json stays 200: {text}");
        assert_eq!(parse(&text)["errors"][0]["extensions"]["code"], code);
    }
}

#[tokio::test]
async fn malformed_http_requests_are_400_or_415() {
    let app = spawn_app().await;
    let (s, _, text) = post(&app, Some(GQL), "{not json").await;
    assert_eq!(s, 400, "{text}");
    assert_eq!(
        parse(&text)["errors"][0]["extensions"]["code"],
        "BAD_REQUEST"
    );

    let (s, _, text) = post(&app, Some(GQL), r#"{"variables":{}}"#).await;
    assert_eq!(s, 400, "no query: {text}");

    let (s, _, text) = post(
        &app,
        Some(GQL),
        r#"{"query":"{ __typename }","variables":[1]}"#,
    )
    .await;
    assert_eq!(s, 400, "variables must be a map: {text}");

    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Content-Type", "text/plain")
        .body("{ __typename }")
        .send()
        .await
        .expect("POST");
    assert_eq!(res.status().as_u16(), 415);
}

#[tokio::test]
async fn get_runs_queries_refuses_mutations_and_serves_graphiql_to_browsers() {
    let app = spawn_app().await;
    let res = app
        .http
        .get(app.url("/graphql"))
        .query(&[
            (
                "query",
                "query Q($n: String!) { __type(name: $n) { name } }",
            ),
            ("variables", r#"{"n":"ViewerInfo"}"#),
            ("operationName", "Q"),
        ])
        .header("Accept", GQL)
        .send()
        .await
        .expect("GET");
    let status = res.status().as_u16();
    let body = res.json::<Value>().await.expect("json");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["__type"]["name"], "ViewerInfo");

    let res = app
        .http
        .get(app.url("/graphql"))
        .query(&[("query", "mutation { __typename }")])
        .header("Accept", GQL)
        .send()
        .await
        .expect("GET");
    assert_eq!(res.status().as_u16(), 405);
    assert_eq!(
        res.headers().get("allow").and_then(|v| v.to_str().ok()),
        Some("POST")
    );

    let res = app
        .http
        .get(app.url("/graphql"))
        .header("Accept", "text/html,application/xhtml+xml,*/*;q=0.8")
        .send()
        .await
        .expect("GET");
    assert_eq!(res.status().as_u16(), 200);
    let html = res.text().await.expect("html");
    assert!(html.contains("graphiql"), "GraphiQL page");

    let res = app.http.put(app.url("/graphql")).send().await.expect("PUT");
    assert_eq!(res.status().as_u16(), 405);
}

#[tokio::test]
async fn input_async_graphql_cannot_coerce_is_coded_as_the_callers_whatever_its_wording() {
    // The codes do not rest on async-graphql's English. A variable whose value its type refuses
    // is a request error (GraphQL over HTTP: 400, no data) coded BAD_USER_INPUT: the caller's
    // data is wrong, as when a resolver refuses an input. The same value written as a literal in
    // the document is GRAPHQL_VALIDATION_FAILED: the document is wrong. A value that passes the
    // type check but not its scalar's parser fails at its field: every resolver error is coded,
    // so an uncoded field error can only be async-graphql's report of such input, and it is
    // BAD_USER_INPUT with the field's path, never INTERNAL.
    let app = compute_tests::spawn_app().await;
    let token = app.token("ops", None, &[compute_api::auth::Role::Operator]);
    let request_errors = [
        (
            "a mistyped variable",
            "query($n: Int) { sites(first: $n) { totalCount } }",
            serde_json::json!({ "n": "ten" }),
            "BAD_USER_INPUT",
        ),
        (
            // The cost of a connection is computed from its page size before it runs, so a
            // page size that is not an Int is refused with the request.
            "a page size too large for Int",
            "query($n: Int) { sites(first: $n) { totalCount } }",
            serde_json::json!({ "n": 1u64 << 40 }),
            "BAD_USER_INPUT",
        ),
        (
            "an enum value that does not exist",
            "query($k: PoolKind) { pools(kind: $k) { totalCount } }",
            serde_json::json!({ "k": "SPACESHIP" }),
            "BAD_USER_INPUT",
        ),
        (
            "an enum value that does not exist, deep in an input object",
            "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id } } }",
            serde_json::json!({ "i": { "poolId": "pool_00000000000000000000000000000000",
                "endsAt": "2030-01-01T00:00:00Z", "allocations": [{ "gpuKind": "WARP", "gpuCount": 1 }] } }),
            "BAD_USER_INPUT",
        ),
        (
            "a mistyped literal",
            "{ sites(first: \"ten\") { totalCount } }",
            serde_json::json!({}),
            "GRAPHQL_VALIDATION_FAILED",
        ),
        (
            "a literal page size too large for Int",
            "{ sites(first: 1099511627776) { totalCount } }",
            serde_json::json!({}),
            "GRAPHQL_VALIDATION_FAILED",
        ),
        (
            "an enum literal that does not exist",
            "{ pools(kind: SPACESHIP) { totalCount } }",
            serde_json::json!({}),
            "GRAPHQL_VALIDATION_FAILED",
        ),
        (
            "a literal beside a good variable",
            "query($n: Int) { sites(first: $n) { totalCount } pools(kind: SPACESHIP) { totalCount } }",
            serde_json::json!({ "n": 2 }),
            "GRAPHQL_VALIDATION_FAILED",
        ),
    ];
    for (case, query, variables, code) in request_errors {
        let (status, body) = app.graphql(query, variables, Some(&token)).await;
        assert_eq!(status, 400, "{case}: {body}");
        assert_eq!(
            body["errors"][0]["extensions"]["code"], code,
            "{case}: {body}"
        );
        assert!(body.get("data").is_none(), "{case}: {body}");
    }
    let field_errors = [
        (
            "a number too large for Int",
            "mutation($n: Int) { setQuota(input: { tenantId: \"acme\", scopeId: \"pool_00000000000000000000000000000000\", vcpu: $n }) { quotas { max } } }",
            serde_json::json!({ "n": 1u64 << 40 }),
            "setQuota",
        ),
        (
            "a time that is not a time",
            "query($w: WindowInput) { reservations(window: $w) { totalCount } }",
            serde_json::json!({ "w": { "start": "yesterday", "end": "2030-01-01T00:00:00Z" } }),
            "reservations",
        ),
    ];
    for (case, query, variables, field) in field_errors {
        let (status, body) = app.graphql(query, variables, Some(&token)).await;
        assert_eq!(status, 200, "{case}: a field error: {body}");
        assert_eq!(
            body["errors"][0]["extensions"]["code"], "BAD_USER_INPUT",
            "{case}: {body}"
        );
        assert_eq!(
            body["errors"][0]["path"],
            serde_json::json!([field]),
            "{case}: {body}"
        );
    }
}

#[tokio::test]
async fn one_callers_bad_input_never_changes_another_callers_results() {
    // Each request has loaders of its own, and bad keys are refused before SQL: while one caller
    // floods the API with cursors holding NUL bytes and windows outside PostgreSQL's range, a
    // concurrent victim's nested, batched reads all succeed, and the attacker gets
    // BAD_USER_INPUT, never INTERNAL.
    use compute_api::auth::Role;
    let app = compute_tests::spawn_app().await;
    let op = app.token("ops", None, &[Role::Operator]);
    for name in ["s1", "s2", "s3"] {
        let site = app
            .ok(
                &op,
                crate::fleet::CREATE_SITE,
                serde_json::json!({ "i": { "name": name } }),
            )
            .await["createSite"]["site"]["id"]
            .clone();
        app.ok(
            &op,
            crate::fleet::CREATE_POOL,
            serde_json::json!({ "i": { "siteId": site, "name": "p", "kind": "BARE_METAL" } }),
        )
        .await;
    }
    let nul_cursor = compute_domain::page::encode_cursor("pool_\u{0}");
    let attacker = app.token("mallory", Some("evil"), &[Role::Member]);
    let victim = app.token("alice", Some("acme"), &[Role::Member]);
    let bad = [
        (
            "query($c: String) { sites(first: 10) { edges { node { pools(first: 5, after: $c) { totalCount } } } } }",
            serde_json::json!({ "c": nul_cursor }),
        ),
        (
            "query($w: WindowInput) { sites(first: 10) { edges { node { capacity(window: $w) { total } } } } }",
            serde_json::json!({ "w": { "start": "-200000-01-01T00:00:00Z", "end": "2030-01-01T00:00:00Z" } }),
        ),
    ];
    let good = "{ sites(first: 10) { edges { node { id pools(first: 5) { totalCount edges { node { id } } } capacity { total } } } } }";
    let mut tasks = Vec::new();
    for i in 0..40 {
        let (query, variables) = bad[i % bad.len()].clone();
        let a = app.graphql_in_background(&attacker, query, variables);
        let v = app.graphql_in_background(&victim, good, serde_json::json!({}));
        tasks.push((a, v));
    }
    for (a, v) in tasks {
        let attacked = a.await.expect("join");
        let seen = v.await.expect("join");
        assert!(
            seen.get("errors").is_none(),
            "the victim saw an error: {seen}"
        );
        assert_eq!(
            seen["data"]["sites"]["edges"].as_array().map(Vec::len),
            Some(3),
            "{seen}"
        );
        let codes: Vec<&str> = attacked["errors"]
            .as_array()
            .map(|e| {
                e.iter()
                    .filter_map(|e| e["extensions"]["code"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            !codes.is_empty() && codes.iter().all(|c| *c == "BAD_USER_INPUT"),
            "the attacker's input is refused as such: {attacked}"
        );
    }
}

#[tokio::test]
async fn a_document_of_several_operations_runs_the_named_one_without_the_others_variables() {
    // As GraphiQL sends its whole editor, and generated clients their whole file.
    let app = spawn_app().await;
    let document = "query Sites($first: Int!) { sites(first: $first) { totalCount } }\n\
                    query Time { serverTime ...Me }\n\
                    fragment Me on Query { viewer { subject } }\n\
                    fragment Unused on Query { serverTime }";
    let ask = |name: &str| {
        let body = json!({ "query": document, "operationName": name }).to_string();
        let app = &app;
        async move {
            let res = app
                .http
                .post(app.url("/graphql"))
                .bearer_auth(app.operator())
                .header("Content-Type", "application/json")
                .body(body)
                .send()
                .await
                .expect("POST");
            parse(&res.text().await.expect("body"))
        }
    };
    let time = ask("Time").await;
    assert!(time["errors"].is_null(), "{time}");
    assert_eq!(time["data"]["viewer"]["subject"], "root@ops");
    assert!(time["data"]["serverTime"].is_string());
    // The named operation's own variables are still required.
    let sites = ask("Sites").await;
    assert_eq!(sites["data"], Value::Null, "{sites}");
    assert!(
        sites["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("first")),
        "{sites}"
    );
    // A name no operation has, and no name, are errors as the specification says.
    for name in [Some("Nope"), None] {
        let body = match name {
            Some(n) => json!({ "query": document, "operationName": n }),
            None => json!({ "query": document }),
        };
        let (_, _, text) = post(&app, Some(GQL), &body.to_string()).await;
        let v = parse(&text);
        assert!(
            v["errors"].is_array() && v["data"].is_null(),
            "{name:?}: {v}"
        );
    }
}

#[tokio::test]
async fn a_document_sent_again_is_answered_as_the_first_time() {
    // The door keeps the parse of the documents it saw lately (`graph::parse_cache`) and clones
    // it for the next request of the same text. The door then reduces the clone to the
    // operation the request names, so the kept parse must not remember the last request's
    // choice: each request of one text, alternating names, gets its own operation's answer.
    let app = spawn_app().await;
    let reused = "compute_graphql_documents_total{parse=\"reused\"}";
    let parsed = "compute_graphql_documents_total{parse=\"parsed\"}";
    let series = |name: &'static str| {
        let app = &app;
        async move { compute_tests::metric(&app.metrics().await, name) }
    };
    let (reused_before, parsed_before) = (series(reused).await, series(parsed).await);
    let document = "query A { a: __typename }\nquery B { b: __schema { queryType { name } } }";
    let expected = [
        ("A", json!({ "a": "Query" })),
        ("B", json!({ "b": { "queryType": { "name": "Query" } } })),
    ];
    for round in 0..3 {
        for (name, data) in &expected {
            let body = json!({ "query": document, "operationName": name }).to_string();
            let (status, _, text) = post(&app, Some(GQL), &body).await;
            let v = parse(&text);
            assert_eq!(status, 200, "{v}");
            assert!(v["errors"].is_null(), "round {round}, {name}: {v}");
            assert_eq!(&v["data"], data, "round {round}, {name}: {v}");
        }
    }
    // Six requests of one text: one parse, five clones of it.
    assert_eq!(series(parsed).await - parsed_before, 1.0);
    assert_eq!(series(reused).await - reused_before, 5.0);
    // A document that does not parse is parsed (and refused) each time, at the same place.
    let broken = json!({ "query": "{\n  __typename\n  oops(" }).to_string();
    let (first_status, _, first) = post(&app, Some(GQL), &broken).await;
    let (again_status, _, again) = post(&app, Some(GQL), &broken).await;
    let (mut first, mut again) = (parse(&first), parse(&again));
    assert_eq!((first_status, again_status), (400, 400), "{first} {again}");
    assert_eq!(first["errors"][0]["locations"][0]["line"], 3, "{first}");
    // Two requests, two traces; the rest of the errors is the same.
    let trace = |v: &mut Value| v["errors"][0]["extensions"]["traceId"].take();
    assert_ne!(trace(&mut first), trace(&mut again));
    assert_eq!(first["errors"], again["errors"]);
    assert_eq!(series(parsed).await - parsed_before, 3.0);
}
