//! Checks that need no database: the committed schema and the wall-clock rule.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
}

#[test]
fn schema_graphql_is_the_printed_schema() {
    let committed = std::fs::read_to_string(root().join("schema.graphql")).expect("schema.graphql");
    let printed = compute_api::schema::sdl();
    assert!(
        committed == printed,
        "schema.graphql differs from the schema the code prints; regenerate it with\n  \
         cargo run -p compute-api -- schema > schema.graphql"
    );
}

/// Every SQL string in the crates and migrations reads time through compute_now(). The only
/// exceptions: the migration that defines compute_now(), the scanner's own examples, and lines
/// marked `check-sql-now: allow`.
#[test]
fn no_sql_reads_the_wall_clock() {
    let findings = compute_tests::sqlscan::scan_tree(
        root(),
        &[
            "api/src",
            "domain/src",
            "workers/src",
            "tests/src",
            "tests/tests",
            "migrations",
        ],
        &["migrations/0001_clock.sql", "tests/src/sqlscan.rs"],
    );
    let list: Vec<String> = findings.iter().map(ToString::to_string).collect();
    assert!(
        list.is_empty(),
        "SQL that reads the wall clock (use compute_now(), or mark the line \
         `check-sql-now: allow` with the reason):\n{}",
        list.join("\n")
    );
}
