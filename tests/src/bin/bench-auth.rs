//! What authentication costs a request.
//!
//! 1. One HS256 member token verified again and again, from memory (`Verifier::verify`, the
//!    path every request takes) and fully (`Verifier::verify_uncached`: the signature and every
//!    claim), in this process.
//! 2. Whole requests over HTTP against a bare async-graphql server on axum (a one-field schema,
//!    the request parsed, executed and serialized, nothing else) and against the API (the real
//!    server on a throwaway database: limits, cost analysis, tracing, metrics, the viewer),
//!    anonymous and with the member token, the same tiny query (`{ __typename }`) that touches
//!    no database. `clients` concurrent clients with keep-alive connections in this process.
//!
//! ```sh
//! cargo run --release -p compute-tests --bin bench-auth -- [iterations] [requests] [clients]
//! ```
//!
//! Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use compute_api::auth::{KeySource, Role, Secret, Verifier};

/// The bare server's schema: one field.
struct Bare;

#[async_graphql::Object]
impl Bare {
    async fn hello(&self) -> &'static str {
        "world"
    }
}

type BareSchema =
    async_graphql::Schema<Bare, async_graphql::EmptyMutation, async_graphql::EmptySubscription>;

/// A bare async-graphql server on axum: POST /graphql, JSON in and out.
async fn bare_server() -> std::net::SocketAddr {
    let schema = BareSchema::new(
        Bare,
        async_graphql::EmptyMutation,
        async_graphql::EmptySubscription,
    );
    let app = axum::Router::new().route(
        "/graphql",
        axum::routing::post(move |axum::Json(req): axum::Json<async_graphql::Request>| {
            let schema = schema.clone();
            async move { axum::Json(schema.execute(req).await) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Requests per second: `requests` POSTs of `query` to `url` from `clients` clients.
async fn rate(url: &str, query: &str, token: Option<&str>, requests: usize, clients: usize) -> f64 {
    let http = reqwest::Client::new();
    let body = serde_json::json!({ "query": query }).to_string();
    let next = Arc::new(AtomicUsize::new(0));
    let send = |http: reqwest::Client, next: Arc<AtomicUsize>, body: String, count: usize| {
        let (url, token) = (url.to_owned(), token.map(str::to_owned));
        async move {
            while next.fetch_add(1, Ordering::Relaxed) < count {
                let mut req = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("accept", "application/json")
                    .body(body.clone());
                if let Some(t) = &token {
                    req = req.bearer_auth(t);
                }
                let res = req.send().await.expect("an answer");
                assert!(res.status().is_success(), "{}", res.status());
                let text = res.text().await.expect("a body");
                assert!(!text.contains("\"errors\""), "{text}");
            }
        }
    };
    // Warm up: connections open, caches filled.
    let warm: Vec<_> = (0..clients)
        .map(|_| {
            tokio::spawn(send(
                http.clone(),
                Arc::new(AtomicUsize::new(0)),
                body.clone(),
                20,
            ))
        })
        .collect();
    for t in warm {
        t.await.expect("warm-up");
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(send(http.clone(), next.clone(), body.clone(), requests)))
        .collect();
    for t in tasks {
        t.await.expect("a client");
    }
    requests as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let requests: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let clients: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(8);
    let verifier = Verifier::new(
        KeySource::Hs256(Secret::new(compute_tests::TEST_SECRET)),
        compute_tests::TEST_ISSUER,
        compute_tests::TEST_AUDIENCE,
    )
    .expect("verifier");
    let token = compute_tests::mint(compute_tests::claims(
        "alice",
        Some("acme"),
        &[Role::Member],
        3600,
    ));
    let time = |label: &str, f: &dyn Fn() -> bool| {
        let started = Instant::now();
        let mut ok = 0u32;
        for _ in 0..n {
            ok += u32::from(f());
        }
        let per = started.elapsed().as_nanos() as f64 / f64::from(n);
        println!("{label}: {per:.0} ns per token ({ok} of {n} accepted)");
        per
    };
    let full = time("verified fully (signature and claims)", &|| {
        verifier.verify_uncached(&token).is_ok()
    });
    let cached = time("answered from the cache", &|| {
        verifier.verify(&token).is_ok()
    });
    println!("the cache answers {:.1}x faster", full / cached);

    let bare = bare_server().await;
    let app = compute_tests::spawn_app().await;
    let member = app.member("acme");
    let bare_url = format!("http://{bare}/graphql");
    let api_url = app.url("/graphql");
    println!(
        "\nwhole requests over HTTP, {requests} per run, {clients} clients, keep-alive, in this process:"
    );
    let mut best = [0.0f64; 3];
    // Three rounds, interleaved, so a slow moment of the machine does not land on one only;
    // the best of each is kept.
    for round in 1..=3 {
        let runs = [
            rate(&bare_url, "{ hello }", None, requests, clients).await,
            rate(&api_url, "{ __typename }", None, requests, clients).await,
            rate(&api_url, "{ __typename }", Some(&member), requests, clients).await,
        ];
        println!(
            "  round {round}: bare async-graphql {:.0}/s, API anonymous {:.0}/s, API with a member token {:.0}/s",
            runs[0], runs[1], runs[2]
        );
        for (b, r) in best.iter_mut().zip(runs) {
            *b = b.max(r);
        }
    }
    println!(
        "best: bare {:.0}/s; API anonymous {:.0}/s ({:.2}x bare); API with a token {:.0}/s ({:.2}x bare, {:.2}x anonymous)",
        best[0],
        best[1],
        best[1] / best[0],
        best[2],
        best[2] / best[0],
        best[2] / best[1]
    );
}
