//! The codegen check of the console's operations: `graphql_client`, the standard Rust GraphQL
//! code generator, generates a typed client for every operation in
//! `api/console/operations.graphql` from `schema.graphql`. A field the schema does not have, a
//! variable of the wrong type or an unknown operation fails this file's build, as it would fail
//! graphql-codegen or the Relay compiler for a TypeScript frontend. The tests then run some of
//! the generated requests against the real server and decode the answers into the generated
//! types, and check that every operation of the file has its generated client here.

use graphql_client::{GraphQLQuery, Response};

// The schema's custom scalars, as the generated code names them.
type DateTime = String;
#[allow(clippy::upper_case_acronyms)]
type JSON = serde_json::Value;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleViewer;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleFleet;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsolePoolNodes;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsolePoolAtoms;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleReservations;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleCapacity;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleReservationCounts;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleQuotas;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleCreateReservation;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleExtendReservation;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleReleaseReservation;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleCancelReservation;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleCordonNode;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleUncordonNode;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleDrainNode;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleQuarantineDevice;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleUnquarantineDevice;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleAcceptNodeInventory;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleSetQuota;

#[derive(GraphQLQuery)]
#[graphql(
    schema_path = "../schema.graphql",
    query_path = "../api/console/operations.graphql",
    response_derives = "Debug"
)]
pub struct ConsoleEvents;

const GENERATED: &[&str] = &[
    "ConsoleViewer",
    "ConsoleFleet",
    "ConsolePoolNodes",
    "ConsolePoolAtoms",
    "ConsoleReservations",
    "ConsoleReservationCounts",
    "ConsoleQuotas",
    "ConsoleCreateReservation",
    "ConsoleExtendReservation",
    "ConsoleReleaseReservation",
    "ConsoleCancelReservation",
    "ConsoleCordonNode",
    "ConsoleUncordonNode",
    "ConsoleDrainNode",
    "ConsoleQuarantineDevice",
    "ConsoleUnquarantineDevice",
    "ConsoleAcceptNodeInventory",
    "ConsoleSetQuota",
    "ConsoleEvents",
    "ConsoleCapacity",
];

#[test]
fn every_console_operation_has_a_generated_client() {
    let names: Vec<String> = compute_api::console::operations()
        .iter()
        .map(|o| o.name.clone())
        .collect();
    let mut generated: Vec<String> = GENERATED.iter().map(|s| s.to_string()).collect();
    let mut expected = names.clone();
    generated.sort();
    expected.sort();
    assert_eq!(
        generated, expected,
        "give every operation a generated client in tests/tests/codegen.rs"
    );
}

async fn run<Q: GraphQLQuery>(
    app: &compute_tests::TestApp,
    token: &str,
    variables: Q::Variables,
) -> Q::ResponseData
where
    Q::ResponseData: std::fmt::Debug,
{
    let body = Q::build_query(variables);
    let answer: Response<Q::ResponseData> = reqwest::Client::new()
        .post(app.url("/graphql"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .expect("POST /graphql")
        .json()
        .await
        .expect("the answer decodes into the generated types");
    assert!(answer.errors.is_none(), "{:?}", answer.errors);
    answer.data.expect("data")
}

#[tokio::test]
async fn the_generated_client_runs_against_the_server() {
    let app = compute_tests::spawn_app().await;
    let operator = app.operator();
    let viewer = run::<ConsoleViewer>(&app, &operator, console_viewer::Variables {}).await;
    assert_eq!(viewer.viewer.subject, "root@ops");
    assert!(!viewer.event_cursor.is_empty());
    let fleet =
        run::<ConsoleFleet>(&app, &operator, console_fleet::Variables { window: None }).await;
    assert_eq!(fleet.sites.total_count, 0, "a new database has no sites");
    let counts = run::<ConsoleReservationCounts>(
        &app,
        &operator,
        console_reservation_counts::Variables { window: None },
    )
    .await;
    assert_eq!(counts.active.total_count, 0);
}

#[tokio::test]
async fn every_console_operation_passes_the_servers_validation() {
    // The generator checks fields; the server checks the rest (arguments, variable use,
    // directives). Sent with only a page size (which the cost needs before validation), a
    // valid operation can only fail on a missing required variable (`BAD_USER_INPUT`, and
    // nothing runs), never on validation.
    let app = compute_tests::spawn_app().await;
    let operator = app.operator();
    let http = reqwest::Client::new();
    for op in compute_api::console::operations() {
        if op.kind == "subscription" {
            continue;
        }
        let answer: serde_json::Value = http
            .post(app.url("/graphql"))
            .bearer_auth(&operator)
            .json(&serde_json::json!({
                "query": op.body, "operationName": op.name, "variables": { "first": 1 },
            }))
            .send()
            .await
            .expect("POST /graphql")
            .json()
            .await
            .expect("JSON");
        for e in answer["errors"].as_array().into_iter().flatten() {
            let code = e["extensions"]["code"].as_str().unwrap_or_default();
            assert_eq!(code, "BAD_USER_INPUT", "{}: {e}", op.name);
        }
    }
}
