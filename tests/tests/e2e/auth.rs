use compute_api::auth::Role;
use compute_tests::{claims, first_code, mint, spawn_app};
use serde_json::json;

const VIEWER: &str = "{ viewer { subject tenantId roles } }";

#[tokio::test]
async fn a_valid_token_reaches_the_viewer() {
    let app = spawn_app().await;
    let token = app.token("alice", Some("acme"), &[Role::Member]);
    let (status, body) = app.graphql(VIEWER, json!({}), Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["data"]["viewer"],
        json!({ "subject": "alice", "tenantId": "acme", "roles": ["MEMBER"] })
    );
}

#[tokio::test]
async fn bad_expired_and_wrongly_signed_tokens_are_unauthenticated() {
    let app = spawn_app().await;

    let mut expired = claims("alice", Some("acme"), &[Role::Member], 3600);
    expired.exp -= 7200;
    expired.nbf = Some(expired.exp - 3600);

    let other_algorithm = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS512),
        &claims("alice", Some("acme"), &[Role::Member], 3600),
        &jsonwebtoken::EncodingKey::from_secret(compute_tests::TEST_SECRET.as_bytes()),
    )
    .expect("sign HS512");

    let mut wrong_audience = claims("alice", Some("acme"), &[Role::Member], 3600);
    wrong_audience.aud = "someone-else".into();

    let cases = [
        ("garbage", "not-a-jwt".to_owned(), "well-formed"),
        ("expired", mint(expired), "expired"),
        ("HS512 instead of HS256", other_algorithm, "HS512"),
        ("wrong audience", mint(wrong_audience), "audience"),
    ];
    for (case, token, why) in cases {
        let (status, body) = app.graphql(VIEWER, json!({}), Some(&token)).await;
        assert_eq!(status, 401, "{case}: {body}");
        assert_eq!(first_code(&body), Some("UNAUTHENTICATED"), "{case}: {body}");
        let message = body["errors"][0]["message"].as_str().unwrap_or("");
        assert!(message.contains(why), "{case}: {message}");
        assert!(
            body.get("data").is_none(),
            "{case}: no data on a refused request"
        );
    }
}

#[tokio::test]
async fn an_anonymous_caller_gets_unauthenticated_on_viewer_but_may_introspect() {
    let app = spawn_app().await;
    let (status, body) = app.graphql(VIEWER, json!({}), None).await;
    assert_eq!(status, 200, "a field error is not a request error: {body}");
    assert_eq!(first_code(&body), Some("UNAUTHENTICATED"));
    assert_eq!(body["data"], json!(null));
    assert_eq!(body["errors"][0]["path"], json!(["viewer"]));

    let (status, body) = app
        .graphql("{ __schema { queryType { name } } }", json!({}), None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["data"]["__schema"]["queryType"]["name"], "Query");
}
