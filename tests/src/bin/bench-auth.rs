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
//!    The three paths run in turn, `requests` each, over `rounds` rounds (default 9), the order
//!    turning every round, so a slow moment of the machine falls on all three rather than on one
//!    path's whole run. It prints each round's rates and ratios, the ratio of all rounds' totals,
//!    the median round's ratio, the best round of each, and this process's CPU per request of
//!    each path (the clients included).
//! 3. With `distinct` (the fifth argument), every request's document is new (the query and a
//!    comment with the request's number), so the API's kept parses (`graph::parse_cache`) never
//!    answer: what a request costs when its client sends a document the server has not seen.
//!    The default, `same`, sends one document again and again, as a client sends its usual
//!    operations.
//!
//! ```sh
//! cargo run --release -p compute-tests --bin bench-auth -- [iterations] [requests] [clients] [rounds] [same|distinct]
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

/// The CPU time this process's threads have used so far, in seconds (the sum of each thread's
/// `/proc/self/task/*/schedstat`, nanoseconds on a CPU): the clients, the bare server and the
/// API all run here, so a slice's CPU over its requests is what one request of that path cost
/// the machine (PostgreSQL aside: `{ __typename }` reads nothing).
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}

/// The numbers of `distinct` documents: never the same twice in a run.
static DOCUMENT: AtomicUsize = AtomicUsize::new(0);

/// The seconds `clients` clients take to send `requests` POSTs of `query` to `url` (after a
/// few untimed ones per client, which open the connections), and the CPU seconds this process
/// used meanwhile ([`cpu_seconds`]). With `distinct`, each request's document is `query` and a
/// comment no other request has.
async fn elapsed(
    url: &str,
    query: &str,
    token: Option<&str>,
    requests: usize,
    clients: usize,
    distinct: bool,
) -> (f64, f64) {
    let http = reqwest::Client::new();
    let body = serde_json::json!({ "query": query }).to_string();
    let next = Arc::new(AtomicUsize::new(0));
    let send = |http: reqwest::Client, next: Arc<AtomicUsize>, body: String, count: usize| {
        let (url, token) = (url.to_owned(), token.map(str::to_owned));
        let query = query.to_owned();
        async move {
            while next.fetch_add(1, Ordering::Relaxed) < count {
                let body = if distinct {
                    let n = DOCUMENT.fetch_add(1, Ordering::Relaxed);
                    serde_json::json!({ "query": format!("{query} # {n}") }).to_string()
                } else {
                    body.clone()
                };
                let mut req = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("accept", "application/json")
                    .body(body);
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
    let cpu = cpu_seconds();
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|_| tokio::spawn(send(http.clone(), next.clone(), body.clone(), requests)))
        .collect();
    for t in tasks {
        t.await.expect("a client");
    }
    (started.elapsed().as_secs_f64(), cpu_seconds() - cpu)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200_000);
    let requests: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let clients: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(8);
    let rounds: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(9).max(1);
    let distinct = match args.get(5).map(String::as_str) {
        None | Some("same") => false,
        Some("distinct") => true,
        Some(other) => panic!("the fifth argument is `same` or `distinct`, not {other:?}"),
    };
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
    let app = compute_tests::TestApp::builder()
        .on(compute_tests::test_db_on_wall_clock().await)
        .start()
        .await;
    let member = app.member("acme");
    let bare_url = format!("http://{bare}/graphql");
    let api_url = app.url("/graphql");
    let paths: [(&str, &str, &str, Option<&str>); 3] = [
        ("bare async-graphql", &bare_url, "{ hello }", None),
        ("API anonymous", &api_url, "{ __typename }", None),
        (
            "API with a member token",
            &api_url,
            "{ __typename }",
            Some(&member),
        ),
    ];
    println!(
        "\nwhole requests over HTTP, {rounds} rounds of {requests} per path, {clients} clients, \
         keep-alive, in this process, {}; the paths' order turns each round:",
        if distinct {
            "every request's document new"
        } else {
            "one document sent again and again"
        }
    );
    // Per path: the seconds of every round, in round order.
    let mut seconds: [Vec<f64>; 3] = Default::default();
    let mut cpu = [0.0f64; 3];
    for round in 0..rounds {
        // The order turns (0 1 2, 1 2 0, 2 0 1, …) so no path always runs first or last, and
        // the three of a round run within a second or two of each other: a slow moment of the
        // machine lands on all of them, not on one path's whole run.
        let mut line = format!("  round {}:", round + 1);
        for k in 0..3 {
            let p = (round + k) % 3;
            let (label, url, query, token) = paths[p];
            let (s, c) = elapsed(url, query, token, requests, clients, distinct).await;
            seconds[p].push(s);
            cpu[p] += c;
            line += &format!(" {label} {:.0}/s;", requests as f64 / s);
        }
        let ratio = |p: usize| seconds[0][round] / seconds[p][round];
        println!(
            "{line} ratios: anonymous {:.2}x, token {:.2}x",
            ratio(1),
            ratio(2)
        );
    }
    let total = |p: usize| (rounds * requests) as f64 / seconds[p].iter().sum::<f64>();
    let best = |p: usize| requests as f64 / seconds[p].iter().copied().fold(f64::MAX, f64::min);
    let median_ratio = |p: usize| {
        let mut r: Vec<f64> = (0..rounds).map(|i| seconds[0][i] / seconds[p][i]).collect();
        r.sort_by(f64::total_cmp);
        r[rounds / 2]
    };
    println!(
        "all rounds: bare {:.0}/s; API anonymous {:.0}/s ({:.2}x bare, median round {:.2}x); \
         API with a token {:.0}/s ({:.2}x bare, median round {:.2}x; {:.2}x anonymous)",
        total(0),
        total(1),
        total(1) / total(0),
        median_ratio(1),
        total(2),
        total(2) / total(0),
        median_ratio(2),
        total(2) / total(1)
    );
    let per = |p: usize| cpu[p] * 1e6 / (rounds * requests) as f64;
    println!(
        "CPU of this process per request (clients and server): bare {:.0} us; API anonymous {:.0} \
         us ({:.2}x bare); API with a token {:.0} us ({:.2}x bare)",
        per(0),
        per(1),
        per(1) / per(0),
        per(2),
        per(2) / per(0)
    );
    println!(
        "best round of each: bare {:.0}/s; API anonymous {:.0}/s ({:.2}x bare); API with a token \
         {:.0}/s ({:.2}x bare)",
        best(0),
        best(1),
        best(1) / best(0),
        best(2),
        best(2) / best(0)
    );
}
