//! What browser frontends need from the API, over the real transports: CORS with an allowlist
//! (preflight, allowed and refused origins), automatic persisted queries over POST and GET (an
//! unknown hash, a hash that is not its text's), and trusted documents (`--persisted-only`: a
//! registered operation runs by hash or text, anything else is refused, over HTTP and WebSocket).

use compute_api::persisted::{Persisted, sha256_hex};
use compute_tests::{TestApp, spawn_app};
use serde_json::{Value, json};

use crate::subscriptions::{connect, init, next_msg, send};

const CONSOLE: &str = "https://console.example.com";

async fn preflight(app: &TestApp, origin: &str) -> reqwest::Response {
    app.http
        .request(reqwest::Method::OPTIONS, app.url("/graphql"))
        .header("Origin", origin)
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization,content-type,traceparent",
        )
        .send()
        .await
        .expect("preflight")
}

fn header(res: &reqwest::Response, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().expect("text").to_owned())
}

#[tokio::test]
async fn cors_answers_the_listed_origins_only() {
    let app = compute_tests::TestApp::builder()
        .frontends(Persisted::automatic(), &[CONSOLE])
        .start()
        .await;
    let res = preflight(&app, CONSOLE).await;
    assert!(res.status().is_success(), "{}", res.status());
    assert_eq!(
        header(&res, "access-control-allow-origin").as_deref(),
        Some(CONSOLE)
    );
    let methods = header(&res, "access-control-allow-methods").unwrap_or_default();
    assert!(
        methods.contains("POST") && methods.contains("GET"),
        "{methods}"
    );
    let headers = header(&res, "access-control-allow-headers")
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(
        headers.contains("authorization")
            && headers.contains("content-type")
            && headers.contains("traceparent"),
        "{headers}"
    );
    assert_eq!(
        header(&res, "access-control-allow-credentials"),
        None,
        "bearer tokens, no cookies"
    );
    assert!(header(&res, "access-control-max-age").is_some());
    assert!(
        header(&res, "vary")
            .unwrap_or_default()
            .to_ascii_lowercase()
            .contains("origin")
    );

    // Another origin's preflight gets no permission.
    let res = preflight(&app, "https://evil.example.com").await;
    assert_eq!(header(&res, "access-control-allow-origin"), None);

    // The request itself: the allowed origin may read the answer; another may not.
    for (origin, allowed) in [(CONSOLE, true), ("https://evil.example.com", false)] {
        let res = app
            .http
            .post(app.url("/graphql"))
            .header("Origin", origin)
            .json(&json!({ "query": "{ __typename }" }))
            .send()
            .await
            .expect("post");
        assert_eq!(res.status(), 200);
        assert_eq!(
            header(&res, "access-control-allow-origin").is_some(),
            allowed,
            "{origin}"
        );
        // The page may read the trace id a user quotes.
        if allowed {
            let exposed = header(&res, "access-control-expose-headers")
                .unwrap_or_default()
                .to_ascii_lowercase();
            assert!(exposed.contains("x-trace-id"), "{exposed}");
        }
    }

    // Without --cors-origin no origin is allowed.
    let plain = spawn_app().await;
    let res = preflight(&plain, CONSOLE).await;
    assert_eq!(header(&res, "access-control-allow-origin"), None);
}

async fn post(app: &TestApp, accept: &str, body: Value) -> (u16, Value) {
    let res = app
        .http
        .post(app.url("/graphql"))
        .header("Accept", accept)
        .bearer_auth(app.member("acme"))
        .json(&body)
        .send()
        .await
        .expect("post");
    let status = res.status().as_u16();
    (status, res.json().await.expect("json"))
}

fn persisted(hash: &str) -> Value {
    json!({ "persistedQuery": { "version": 1, "sha256Hash": hash } })
}

#[tokio::test]
async fn automatic_persisted_queries_over_post_and_get() {
    let app = spawn_app().await;
    let query = "query Who { viewer { subject tenantId } }";
    let hash = sha256_hex(query);

    // The hash alone first: not known yet. A request error: 200 for application/json, 400 for
    // application/graphql-response+json, with the code clients look for.
    for (accept, status) in [
        ("application/json", 200),
        ("application/graphql-response+json", 400),
    ] {
        let (s, body) = post(&app, accept, json!({ "extensions": persisted(&hash) })).await;
        assert_eq!(s, status, "{accept}: {body}");
        assert_eq!(
            body["errors"][0]["extensions"]["code"],
            "PERSISTED_QUERY_NOT_FOUND"
        );
        assert_eq!(body["errors"][0]["message"], "PersistedQueryNotFound");
        assert!(body.get("data").is_none(), "{body}");
    }
    // A hash that is not the text's registers nothing.
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "query": "{ __typename }", "extensions": persisted(&hash) }),
    )
    .await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"],
        "PERSISTED_QUERY_HASH_MISMATCH"
    );
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "extensions": persisted(&hash) }),
    )
    .await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"],
        "PERSISTED_QUERY_NOT_FOUND"
    );
    // The text with its hash runs and registers it; then the hash alone runs, over GET too.
    let (s, body) = post(
        &app,
        "application/json",
        json!({ "query": query, "extensions": persisted(&hash) }),
    )
    .await;
    assert_eq!(
        (s, &body["data"]["viewer"]["subject"]),
        (200, &json!("alice@acme")),
        "{body}"
    );
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "extensions": persisted(&hash) }),
    )
    .await;
    assert_eq!(body["data"]["viewer"]["tenantId"], "acme", "{body}");
    let res = app
        .http
        .get(app.url("/graphql"))
        .query(&[
            ("extensions", persisted(&hash).to_string()),
            ("operationName", "Who".into()),
        ])
        .bearer_auth(app.member("globex"))
        .send()
        .await
        .expect("get");
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.expect("json");
    assert_eq!(
        body["data"]["viewer"]["tenantId"], "globex",
        "each caller's own answer: {body}"
    );
    // A malformed persistedQuery is the caller's mistake.
    let (s, body) = post(
        &app,
        "application/json",
        json!({ "extensions": { "persistedQuery": { "version": 1, "sha256Hash": "abc" } } }),
    )
    .await;
    assert_eq!(
        (s, body["errors"][0]["extensions"]["code"].as_str()),
        (400, Some("BAD_REQUEST"))
    );
}

#[tokio::test]
async fn persisted_only_runs_the_manifest_and_refuses_everything_else() {
    let registered = "query Who { viewer { subject } }";
    let hash = sha256_hex(registered);
    let manifest = json!({ "format": "apollo-persisted-query-manifest", "version": 1,
        "operations": [{ "id": hash, "name": "Who", "type": "query", "body": registered }] });
    let app = compute_tests::TestApp::builder()
        .frontends(
            Persisted::from_manifest(&manifest.to_string(), true).expect("manifest"),
            &[],
        )
        .start()
        .await;
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "extensions": persisted(&hash) }),
    )
    .await;
    assert_eq!(body["data"]["viewer"]["subject"], "alice@acme", "{body}");
    let (_, body) = post(&app, "application/json", json!({ "query": registered })).await;
    assert_eq!(
        body["data"]["viewer"]["subject"], "alice@acme",
        "its text runs too: {body}"
    );
    let other = "{ viewer { subject tenantId } }";
    for body in [
        json!({ "query": other }),
        json!({ "query": other, "extensions": persisted(&sha256_hex(other)) }),
    ] {
        let (s, answer) = post(&app, "application/graphql-response+json", body).await;
        assert_eq!(s, 400);
        assert_eq!(
            answer["errors"][0]["extensions"]["code"],
            "PERSISTED_QUERY_REQUIRED"
        );
    }
    // The refused request with its hash registered nothing: the hash alone is still unknown.
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "extensions": persisted(&sha256_hex(other)) }),
    )
    .await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"],
        "PERSISTED_QUERY_NOT_FOUND"
    );

    // Over graphql-transport-ws: the operation fails, the connection stays.
    let mut ws = connect(&app, "graphql-transport-ws").await;
    init(&mut ws, &app.member("acme")).await;
    send(
        &mut ws,
        json!({ "id": "1", "type": "subscribe", "payload": { "query": "subscription { events { id } }" } }),
    )
    .await;
    send(
        &mut ws,
        json!({ "id": "2", "type": "subscribe", "payload": { "extensions": persisted(&hash) } }),
    )
    .await;
    let mut seen = Vec::new();
    while seen.len() < 3 {
        seen.push(next_msg(&mut ws).await);
    }
    let refused = seen
        .iter()
        .find(|m| m["id"] == "1")
        .expect("an answer to 1");
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(
        refused["payload"][0]["extensions"]["code"],
        "PERSISTED_QUERY_REQUIRED"
    );
    let ran: Vec<&Value> = seen.iter().filter(|m| m["id"] == "2").collect();
    assert_eq!(ran[0]["type"], "next", "{seen:?}");
    assert_eq!(ran[0]["payload"]["data"]["viewer"]["subject"], "alice@acme");
}

#[tokio::test]
async fn the_console_runs_under_persisted_only_by_hash_and_nothing_else_does() {
    // No manifest at all: only the console's operations, which ship with the binary.
    let app = compute_tests::TestApp::builder()
        .frontends(
            Persisted::from_manifest("{}", true).expect("an empty manifest"),
            &[],
        )
        .start()
        .await;
    let ops = compute_api::console::operations();
    let viewer = ops
        .iter()
        .find(|o| o.name == "ConsoleViewer")
        .expect("ConsoleViewer");
    // As the console sends it: GET, the hash only.
    let url = format!(
        "{}?operationName=ConsoleViewer&extensions={}",
        app.url("/graphql"),
        json!({ "persistedQuery": { "version": 1, "sha256Hash": viewer.hash } })
    );
    let body: Value = reqwest::Client::new()
        .get(url)
        .bearer_auth(app.member("acme"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON");
    assert_eq!(body["data"]["viewer"]["tenantId"], "acme", "{body}");
    // The module the console imports carries the same hashes the server trusts.
    let module = reqwest::get(app.url("/console/operations.js"))
        .await
        .expect("GET")
        .text()
        .await
        .expect("text");
    for op in ops {
        assert!(module.contains(&op.hash), "{} missing", op.name);
    }
    // Anything else is refused.
    let (_, body) = post(
        &app,
        "application/json",
        json!({ "query": "{ viewer { subject } }" }),
    )
    .await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"],
        "PERSISTED_QUERY_REQUIRED"
    );
}

#[tokio::test]
async fn the_console_is_served_with_validators_caching_and_a_strict_policy() {
    let app = spawn_app().await;
    let http = reqwest::Client::new();
    let page = http.get(app.url("/")).send().await.expect("GET /");
    assert_eq!(page.status(), 200);
    assert_eq!(
        header(&page, "content-type").as_deref(),
        Some("text/html; charset=utf-8")
    );
    let csp = header(&page, "content-security-policy").expect("a CSP");
    assert!(csp.contains("script-src 'self';"), "{csp}");
    assert!(csp.contains("connect-src 'self'"), "{csp}");
    assert!(
        !csp.contains("unsafe"),
        "the console allows nothing inline: {csp}"
    );
    assert_eq!(header(&page, "cache-control").as_deref(), Some("no-cache"));
    let etag = header(&page, "etag").expect("an ETag");
    assert!(page.text().await.expect("text").contains("/console/app.js"));
    // Revalidation: the same ETag is a 304 with no body.
    let again = http
        .get(app.url("/"))
        .header("If-None-Match", &etag)
        .send()
        .await
        .expect("GET /");
    assert_eq!(again.status(), 304);
    assert!(again.bytes().await.expect("body").is_empty());
    let stale = http
        .get(app.url("/"))
        .header("If-None-Match", "\"not-it\"")
        .send()
        .await
        .expect("GET /");
    assert_eq!(stale.status(), 200);
    // A versioned vendor file is cached for good; a module is revalidated.
    let vendor = http
        .get(app.url("/console/vendor/graphiql-3.8.3/graphiql.min.js"))
        .send()
        .await
        .expect("GET");
    assert_eq!(
        header(&vendor, "cache-control").as_deref(),
        Some("public, max-age=31536000, immutable")
    );
    assert_eq!(
        header(&vendor, "content-type").as_deref(),
        Some("text/javascript; charset=utf-8")
    );
    let module = http
        .get(app.url("/console/app.js"))
        .send()
        .await
        .expect("GET");
    assert_eq!(
        header(&module, "cache-control").as_deref(),
        Some("no-cache")
    );
    assert_eq!(
        header(&module, "x-content-type-options").as_deref(),
        Some("nosniff")
    );
    // GraphiQL, from the binary, with its own policy; `GET /graphql` from a browser is it too.
    let graphiql = http.get(app.url("/graphiql")).send().await.expect("GET");
    let policy = header(&graphiql, "content-security-policy").expect("a CSP");
    assert!(policy.contains("script-src 'self';"), "{policy}");
    let html = graphiql.text().await.expect("text");
    assert!(html.contains("/console/vendor/graphiql-3.8.3/graphiql.min.js"));
    assert!(!html.contains("https://"), "no CDN: {html}");
    let browser = http
        .get(app.url("/graphql"))
        .header("Accept", "text/html")
        .send()
        .await
        .expect("GET");
    assert_eq!(browser.text().await.expect("text"), html);
    // No such file, no path escape, and no development token from `serve`.
    for path in [
        "/console/nope.js",
        "/console/../Cargo.toml",
        "/console/index.html",
    ] {
        let res = http.get(app.url(path)).send().await.expect("GET");
        assert_eq!(res.status(), 404, "{path}");
    }
    let token = http
        .get(app.url("/console/dev-token"))
        .send()
        .await
        .expect("GET");
    assert_eq!(token.status(), 204, "serve has no development token");
    assert!(token.bytes().await.expect("body").is_empty());
}
