use compute_embedded_pg::{EmbeddedOptions, EmbeddedPostgres};
use sqlx::Connection;

/// What `compute-api dev` relies on: a second start reuses the data of the first, and dropping
/// the handle stops the server.
#[tokio::test]
async fn a_second_start_keeps_the_data_and_drop_stops_the_server() {
    let dir = std::env::temp_dir()
        .join("compute-tests")
        .join(format!("embedded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = EmbeddedOptions {
        data_dir: dir.clone(),
        durable: false,
        max_connections: 20,
    };

    let first = EmbeddedPostgres::start(options.clone())
        .await
        .expect("first start");
    first.ensure_database("keep").await.expect("create db");
    let mut conn = sqlx::PgConnection::connect(&first.url("keep"))
        .await
        .expect("connect");
    sqlx::raw_sql("CREATE TABLE kept (v text); INSERT INTO kept VALUES ('from the first run')")
        .execute(&mut conn)
        .await
        .expect("write");
    conn.close().await.expect("close");
    let first_url = first.url("keep");
    drop(first);
    assert!(
        sqlx::PgConnection::connect(&first_url).await.is_err(),
        "the server stops with its handle"
    );

    let second = EmbeddedPostgres::start(options)
        .await
        .expect("second start");
    let mut conn = sqlx::PgConnection::connect(&second.url("keep"))
        .await
        .expect("connect");
    let (v,): (String,) = sqlx::query_as("SELECT v FROM kept")
        .fetch_one(&mut conn)
        .await
        .expect("read");
    assert_eq!(v, "from the first run");
    conn.close().await.expect("close");
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}
