//! Measures what the API's token cache saves: one HS256 member token verified again and again,
//! from memory (`Verifier::verify`, the path every request takes) and fully
//! (`Verifier::verify_uncached`: the signature and every claim), in this process.
//!
//! ```sh
//! cargo run --release -p compute-tests --bin bench-auth -- [iterations]
//! ```
//!
//! Asserts nothing: a benchmark, not a test.

#![allow(clippy::print_stdout, reason = "a benchmark prints its figures")]

use std::time::Instant;

use compute_api::auth::{KeySource, Role, Secret, Verifier};

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
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
}
