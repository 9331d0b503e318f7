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

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name),
    )
    .expect("fixture")
}

fn sign_eddsa(kid: Option<&str>) -> String {
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
    header.kid = kid.map(str::to_owned);
    jsonwebtoken::encode(
        &header,
        &claims("carol", Some("acme"), &[Role::Operator], 3600),
        &jsonwebtoken::EncodingKey::from_ed_pem(&fixture("ed25519-private.pem")).expect("key"),
    )
    .expect("sign EdDSA")
}

#[test]
fn public_key_verifiers_pin_their_algorithm() {
    use compute_api::auth::{KeySource, Verifier};
    let pem = fixture("ed25519-public.pem");
    let verifier = Verifier::new(
        KeySource::PublicKeyPem {
            algorithm: jsonwebtoken::Algorithm::EdDSA,
            pem: pem.clone(),
        },
        compute_tests::TEST_ISSUER,
        compute_tests::TEST_AUDIENCE,
    )
    .expect("verifier");
    let viewer = verifier.verify(&sign_eddsa(None)).expect("EdDSA token");
    assert_eq!(viewer.subject, "carol");

    // The classic confusion: an HS256 token whose HMAC key is the public key's PEM.
    let confused = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims("mallory", Some("acme"), &[Role::Operator], 3600),
        &jsonwebtoken::EncodingKey::from_secret(&pem),
    )
    .expect("sign HS256");
    let err = verifier.verify(&confused).expect_err("algorithm is pinned");
    assert_eq!(err.code(), compute_domain::ErrorCode::Unauthenticated);
    assert!(err.to_string().contains("HS256"), "{err}");

    let jwks = Verifier::new(
        KeySource::Jwks {
            algorithm: jsonwebtoken::Algorithm::EdDSA,
            jwks: String::from_utf8(fixture("ed25519-jwks.json")).expect("utf-8"),
        },
        compute_tests::TEST_ISSUER,
        compute_tests::TEST_AUDIENCE,
    )
    .expect("JWKS verifier");
    assert_eq!(
        jwks.verify(&sign_eddsa(Some("test-ed25519")))
            .expect("known kid")
            .subject,
        "carol"
    );
    assert!(
        Verifier::new(
            KeySource::Jwks {
                algorithm: jsonwebtoken::Algorithm::RS256,
                jwks: String::from_utf8(fixture("ed25519-jwks.json")).expect("utf-8"),
            },
            compute_tests::TEST_ISSUER,
            compute_tests::TEST_AUDIENCE,
        )
        .is_err(),
        "a JWKS with no key for the configured algorithm is a configuration error"
    );
}

#[tokio::test]
async fn a_tenant_claim_that_is_not_a_tenant_id_is_refused_at_the_door() {
    let app = spawn_app().await;
    for tenant in ["", " acme", "a\u{0}b", "-x"] {
        let token = app.token("alice", Some(tenant), &[Role::Member]);
        let (status, body) = app.graphql(VIEWER, json!({}), Some(&token)).await;
        assert_eq!(status, 401, "{tenant:?}: {body}");
        assert_eq!(
            first_code(&body),
            Some("UNAUTHENTICATED"),
            "{tenant:?}: {body}"
        );
        let message = body["errors"][0]["message"].as_str().unwrap_or("");
        assert!(message.contains("tenant claim"), "{tenant:?}: {message}");
    }
}

#[tokio::test]
async fn an_operator_and_a_member_of_the_same_subject_never_share_idempotency_keys() {
    // An operator's keys live in a scope of their own (`:operator`), which no tenant id can
    // name: a member token with the operator's subject and key runs its own request.
    let app = spawn_app().await;
    let operator = app.token("shared-subject", None, &[Role::Operator]);
    let member = app.token(
        "shared-subject",
        Some("acme"),
        &[Role::Member, Role::Operator],
    );
    let plain_member = app.token("shared-subject", Some("acme"), &[Role::Member]);
    let input = |name: &str| json!({ "i": { "name": name, "idempotencyKey": "k-1" } });
    let create = "mutation($i: CreateSiteInput!) { createSite(input: $i) { site { id name } idempotentReplay } }";
    let (_, first) = app
        .graphql(create, input("by-operator"), Some(&operator))
        .await;
    let first_id = first["data"]["createSite"]["site"]["id"].clone();
    assert!(first_id.is_string(), "{first}");
    // The same subject and key under another authority is another scope: a new request, not
    // the operator's stored response.
    let (_, second) = app
        .graphql(create, input("by-operator-with-tenant"), Some(&member))
        .await;
    assert_eq!(
        second["data"]["createSite"]["idempotentReplay"],
        json!(false),
        "{second}"
    );
    assert_ne!(
        second["data"]["createSite"]["site"]["id"], first_id,
        "{second}"
    );
    // A member cannot create sites at all, and certainly gets no operator's response.
    let (_, third) = app
        .graphql(create, input("by-operator"), Some(&plain_member))
        .await;
    assert_eq!(first_code(&third), Some("FORBIDDEN"), "{third}");
    // The operator itself gets its answer back.
    let (_, again) = app
        .graphql(create, input("by-operator"), Some(&operator))
        .await;
    assert_eq!(
        again["data"]["createSite"]["site"]["id"], first_id,
        "{again}"
    );
    assert_eq!(
        again["data"]["createSite"]["idempotentReplay"],
        json!(true),
        "{again}"
    );
}

#[tokio::test]
async fn a_token_expires_when_business_time_passes_its_exp_and_leeway() {
    // The verifier reads business time (`compute_now()`, simulated here): moving the clock is
    // what expires a token, and what makes a token with a later `nbf` valid. The server's clock
    // is re-anchored when the test moves time, and runs on from there by the monotonic clock, so
    // each pair of requests below is made within the second the clock was moved to.
    let app = spawn_app().await;
    let now: i64 = sqlx::query_scalar("SELECT extract(epoch FROM compute_now())::bigint")
        .fetch_one(app.db.db.pool())
        .await
        .expect("compute_now()");
    let mut c = app.claims("alice", Some("acme"), &[Role::Member], 3600);
    (c.iat, c.nbf, c.exp) = (Some(now), Some(now - 5), now + 3600);
    let token = mint(c.clone());
    // Not valid before its `nbf` (less the leeway), by business time.
    (c.iat, c.nbf, c.exp) = (Some(now), Some(now + 60), now + 3600);
    let early = mint(c);
    let (status, body) = app.graphql(VIEWER, json!({}), Some(&early)).await;
    assert_eq!(status, 401, "{body}");
    let message = body["errors"][0]["message"].as_str().unwrap_or("");
    assert!(message.contains("not valid yet"), "{message}");
    app.db.advance_clock(55).await;
    let (status, body) = app.graphql(VIEWER, json!({}), Some(&early)).await;
    assert_eq!(
        status, 200,
        "valid from its nbf less the 5 s leeway: {body}"
    );
    // An hour and the 5 s leeway later, the token is at its last second: still accepted.
    app.db.advance_clock(3600 + 5 - 55).await;
    let last = app.graphql(VIEWER, json!({}), Some(&token)).await;
    // One second more, and it has expired.
    app.db.advance_clock(1).await;
    let after = app.graphql(VIEWER, json!({}), Some(&token)).await;
    let (status, body) = last;
    assert_eq!(status, 200, "{body}");
    let (status, body) = after;
    assert_eq!(status, 401, "{body}");
    assert_eq!(first_code(&body), Some("UNAUTHENTICATED"));
    let message = body["errors"][0]["message"].as_str().unwrap_or("");
    assert!(message.contains("expired"), "{message}");
}

#[tokio::test]
async fn a_tenant_without_a_role_reads_nothing_of_its_tenant() {
    // Each operation requires its role: a token that names a tenant but carries neither the
    // member nor the operator role (a node daemon's, say) reads no reservations, quotas or
    // events of that tenant.
    let app = spawn_app().await;
    for roles in [&[][..], &[Role::Node][..]] {
        let token = app.token("someone", Some("acme"), roles);
        for query in [
            "{ reservations(first: 5) { totalCount } }",
            "{ quotas { max } }",
            "{ eventSinks(first: 5) { totalCount } }",
        ] {
            let (_, body) = app.graphql(query, json!({}), Some(&token)).await;
            assert_eq!(
                first_code(&body),
                Some("FORBIDDEN"),
                "{roles:?} {query}: {body}"
            );
        }
    }
}
