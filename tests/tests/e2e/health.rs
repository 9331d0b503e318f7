use compute_tests::{spawn_app, test_db};
use serde_json::{Value, json};

#[tokio::test]
async fn readyz_reports_database_migrations_and_clock_skew() {
    // The wall clock: production's `compute_now()`, which reports `simulated: false`.
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .start()
        .await;
    let res = app.http.get(app.url("/readyz")).send().await.expect("GET");
    assert_eq!(res.status().as_u16(), 200);
    let body: Value = res.json().await.expect("json");
    assert_eq!(body["status"], "ready", "{body}");
    assert_eq!(body["checks"]["database"]["status"], "pass");
    let migrations = &body["checks"]["migrations"];
    assert_eq!(migrations["status"], "pass");
    assert_eq!(migrations["pending"], 0);
    assert_eq!(migrations["applied"], migrations["expected"]);
    assert!(migrations["expected"].as_u64().unwrap_or(0) >= 2);
    let skew = &body["checks"]["clock.skew"];
    assert_eq!(skew["status"], "pass", "{skew}");
    assert!(skew["skew_ms"].as_i64().expect("skew_ms").abs() < 1000);
    assert_eq!(skew["simulated"], json!(false));

    let res = app.http.get(app.url("/healthz")).send().await.expect("GET");
    assert_eq!(res.status().as_u16(), 200);
}

#[tokio::test]
async fn readyz_warns_about_a_clock_far_from_the_wall_clock() {
    let db = test_db().await;
    db.use_sim_clock("2020-01-01T00:00:00Z").await;
    let app = compute_tests::TestApp::builder().on(db).start().await;
    let body: Value = app
        .http
        .get(app.url("/readyz"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    assert_eq!(
        body["status"], "ready",
        "skew warns, it does not make the process unready"
    );
    let skew = &body["checks"]["clock.skew"];
    assert_eq!(skew["status"], "warn", "{skew}");
    assert!(
        skew["skew_ms"].as_i64().expect("skew_ms") < -86_400_000,
        "{skew}"
    );
    assert_eq!(skew["simulated"], json!(true));
}

#[tokio::test]
async fn readyz_is_unavailable_when_a_migration_is_missing() {
    let app = spawn_app().await;
    sqlx::query(
        "DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations)",
    )
    .execute(app.db.db.pool())
    .await
    .expect("forget a migration");
    let res = app.http.get(app.url("/readyz")).send().await.expect("GET");
    assert_eq!(res.status().as_u16(), 503);
    let body: Value = res.json().await.expect("json");
    assert_eq!(body["checks"]["migrations"]["pending"], 1, "{body}");
}

/// A small parser for the Prometheus text format (0.0.4): every line is a comment or
/// `name{labels} value`.
fn parse_prometheus(text: &str) -> Vec<(String, String, f64)> {
    let mut samples = Vec::new();
    // OpenMetrics: the exposition ends with `# EOF`, and nothing follows it.
    assert!(text.ends_with("# EOF\n"), "no # EOF at the end");
    for line in text.lines() {
        if line.is_empty() || line == "# EOF" {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let kind = rest.split_whitespace().next().unwrap_or("");
            assert!(
                ["HELP", "TYPE", "UNIT"].contains(&kind),
                "bad comment line: {line}"
            );
            if kind == "TYPE" {
                let t = rest.split_whitespace().nth(2).unwrap_or("");
                assert!(
                    [
                        "counter",
                        "gauge",
                        "histogram",
                        "summary",
                        "unknown",
                        "info"
                    ]
                    .contains(&t),
                    "{line}"
                );
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, l)) => {
                assert!(l.ends_with('}'), "unclosed labels: {line}");
                (n, l.trim_end_matches('}'))
            }
            None => (series, ""),
        };
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        for pair in labels.split("\",").filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .unwrap_or_else(|| panic!("bad label: {line}"));
            assert!(
                k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
            assert!(v.starts_with('"'), "{line}");
        }
        samples.push((name.to_owned(), labels.to_owned(), value));
    }
    samples
}

#[tokio::test]
async fn metrics_parse_as_openmetrics_text_and_count_requests() {
    let app = spawn_app().await;
    for _ in 0..3 {
        app.graphql("{ __typename }", json!({}), None).await;
    }
    app.graphql("{ nope }", json!({}), None).await;
    // A method nobody defined: counted as OTHER, so a caller cannot add series by inventing them.
    let invented = reqwest::Method::from_bytes(b"FOO1").expect("a method token");
    let res = app
        .http
        .request(invented, app.url("/graphql"))
        .send()
        .await
        .expect("FOO1");
    assert_eq!(res.status().as_u16(), 405);
    // One named transaction that commits, and one that fails (a duplicate name).
    let op = app.token("ops", None, &[compute_api::auth::Role::Operator]);
    let create = "mutation { createSite(input: { name: \"ams\" }) { site { id } } }";
    app.graphql(create, json!({}), Some(&op)).await;
    app.graphql(create, json!({}), Some(&op)).await;
    let res = app.http.get(app.url("/metrics")).send().await.expect("GET");
    assert_eq!(res.status().as_u16(), 200);
    assert!(
        res.headers()["content-type"]
            .to_str()
            .unwrap_or("")
            .starts_with("application/openmetrics-text; version=1.0.0")
    );
    let samples = parse_prometheus(&res.text().await.expect("text"));
    let value = |name: &str, labels: &str| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && l == labels)
            .map(|(_, _, v)| *v)
    };
    let requests = "compute_http_server_request_duration_seconds_count";
    assert_eq!(
        value(
            requests,
            r#"http_route="/graphql",http_request_method="POST",http_response_status_code="200""#
        ),
        Some(5.0),
        "three queries and two mutations (a field error is still 200)"
    );
    assert_eq!(
        value(
            requests,
            r#"http_route="/graphql",http_request_method="POST",http_response_status_code="400""#
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            requests,
            r#"http_route="/graphql",http_request_method="_OTHER",http_response_status_code="405""#
        ),
        Some(1.0),
        "an invented method is _OTHER"
    );
    assert!(
        !samples.iter().any(|(_, l, _)| l.contains("FOO1")),
        "no series names the invented method"
    );
    let graphql: f64 = samples
        .iter()
        .filter(|(n, l, _)| n == requests && l.contains(r#"http_route="/graphql""#))
        .map(|(_, _, v)| v)
        .sum();
    assert_eq!(graphql, 7.0, "every request to /graphql is timed");
    assert_eq!(
        value(
            "compute_graphql_errors_total",
            r#"code="GRAPHQL_VALIDATION_FAILED""#
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            "compute_db_transaction_seconds_count",
            r#"transaction="create_site",kind="write""#
        ),
        Some(2.0),
        "every named transaction is timed"
    );
    assert_eq!(
        value(
            "compute_db_transaction_errors_total",
            r#"transaction="create_site",code="CONFLICT""#
        ),
        Some(1.0),
        "and its failures counted by code"
    );
    assert_eq!(value("compute_db_pool_max_connections", ""), Some(8.0));
    assert!(value("compute_db_pool_connections", r#"state="idle""#).is_some());
}
