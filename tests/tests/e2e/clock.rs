use compute_domain::clock::Clock;
use compute_tests::test_db;
use serde_json::json;

#[tokio::test]
async fn server_time_follows_the_simulated_clock() {
    let db = test_db().await;
    db.use_sim_clock("2031-05-01T12:00:00Z").await;
    let app = compute_tests::TestApp::builder().on(db).start().await;
    let (status, body) = app.graphql("{ serverTime }", json!({}), None).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["serverTime"], "2031-05-01T12:00:00+00:00");

    app.db.advance_clock(90).await;
    let (_, body) = app.graphql("{ serverTime }", json!({}), None).await;
    assert_eq!(body["data"]["serverTime"], "2031-05-01T12:01:30+00:00");
}

#[tokio::test]
async fn the_rust_clock_is_anchored_to_compute_now_and_measures_skew() {
    // On the wall clock first: the skew measured is this process's against PostgreSQL's.
    let db = compute_tests::test_db_on_wall_clock().await;
    let clock = Clock::anchored(&db.db).await.expect("anchor");
    let reading = clock.last_reading();
    assert!(
        reading.ok(),
        "wall clock and compute_now() agree: {reading:?}"
    );
    let wall = chrono::Utc::now();
    assert!((clock.now() - wall).num_milliseconds().abs() < 1000);

    db.use_sim_clock("2030-01-01T00:00:00Z").await;
    let reading = clock.sample(&db.db).await.expect("sample");
    assert!(!reading.ok(), "a skew of years is reported: {reading:?}");
    assert!(
        reading.skew_ms > 0,
        "the simulated clock is ahead: {reading:?}"
    );
    // Simulated time stands still between samples: the clock does not run on by itself.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    assert_eq!(clock.now().to_rfc3339(), "2030-01-01T00:00:00+00:00");
}

#[tokio::test]
async fn simulated_time_only_moves_forward_and_needs_switching_on() {
    // A database on the wall clock, as production's: simulated time is switched on explicitly.
    let db = compute_tests::test_db_on_wall_clock().await;
    let err = sqlx::query("SELECT compute_set_sim_clock('2030-01-01Z')")
        .execute(db.db.pool())
        .await
        .expect_err("not on simulated time yet");
    assert!(err.to_string().contains("not on simulated time"), "{err}");
    db.use_sim_clock("2030-01-01T00:00:00Z").await;
    let err = sqlx::query("SELECT compute_advance_sim_clock(interval '-1 second')")
        .execute(db.db.pool())
        .await
        .expect_err("backwards");
    assert!(err.to_string().contains("only moves forward"), "{err}");
}

/// Simulated time stands still within a transaction, as `now()` does in production: a
/// transaction that read `compute_now()` keeps reading the same time while another moves the
/// clock; the next transaction reads the new time; the transaction that moves it sees the move.
#[tokio::test]
async fn simulated_time_stands_still_within_a_transaction() {
    let db = test_db().await;
    db.use_sim_clock("2031-05-01T12:00:00Z").await;
    let mut tx = db.db.pool().begin().await.expect("begin");
    assert_eq!(read(&mut tx).await, "12:00:00");
    db.advance_clock(90).await;
    assert_eq!(
        read(&mut tx).await,
        "12:00:00",
        "the same transaction, the same time"
    );
    tx.commit().await.expect("commit");
    let mut tx = db.db.pool().begin().await.expect("begin");
    assert_eq!(
        read(&mut tx).await,
        "12:01:30",
        "a new transaction, the new time"
    );
    sqlx::query("SELECT compute_advance_sim_clock(interval '30 seconds')")
        .execute(&mut *tx)
        .await
        .expect("advance");
    assert_eq!(read(&mut tx).await, "12:02:00", "the mover sees its move");
    tx.rollback().await.expect("rollback");
    let mut conn = db.db.pool().acquire().await.expect("conn");
    assert_eq!(
        read(&mut conn).await,
        "12:01:30",
        "a rolled-back move never happened"
    );
}

async fn read(conn: &mut sqlx::PgConnection) -> String {
    let (t,): (String,) =
        sqlx::query_as("SELECT to_char(compute_now() AT TIME ZONE 'UTC', 'HH24:MI:SS')")
            .fetch_one(conn)
            .await
            .expect("compute_now");
    t
}
