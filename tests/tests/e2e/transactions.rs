use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use compute_domain::db::{Db, MAX_ATTEMPTS, TxKind};
use compute_domain::{Error, ErrorCode};
use compute_tests::test_db;
use sqlx::Connection;

#[tokio::test]
async fn every_kind_states_its_isolation_and_timeouts_without_leaking_them() {
    let t = test_db().await;
    // One connection, so the check after the transaction sees the same session.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&t.url)
        .await
        .expect("pool");
    let db = Db::from_pool(pool);
    let settings = db
        .tx("every_kind_states_its_isolation_and_timeouts_without_leaking_them", TxKind::Read, |conn| {
            Box::pin(async move {
                let row: (String, String, String, String) = sqlx::query_as(
                    "SELECT current_setting('transaction_isolation'), current_setting('lock_timeout'), \
                     current_setting('statement_timeout'), current_setting('transaction_read_only')",
                )
                .fetch_one(conn)
                .await?;
                Ok(row)
            })
        })
        .await
        .expect("read tx");
    assert_eq!(
        settings,
        (
            "read committed".into(),
            "2s".into(),
            "10s".into(),
            "on".into()
        )
    );
    let (lock_timeout,): (String,) = sqlx::query_as("SELECT current_setting('lock_timeout')")
        .fetch_one(db.pool())
        .await
        .expect("after");
    assert_eq!(lock_timeout, "0", "SET LOCAL ends with the transaction");

    let err = db
        .tx(
            "every_kind_states_its_isolation_and_timeouts_without_leaking_them",
            TxKind::Read,
            |conn| {
                Box::pin(async move {
                    sqlx::query("CREATE TABLE nope (x int)")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            },
        )
        .await
        .expect_err("a read transaction cannot write");
    assert_eq!(err.sqlstate().as_deref(), Some("25006"));
}

#[tokio::test]
async fn a_lock_wait_past_the_timeout_is_lock_timeout() {
    let t = test_db().await;
    sqlx::raw_sql(
        "CREATE TABLE things (id int PRIMARY KEY, v int); INSERT INTO things VALUES (1, 0)",
    )
    .execute(t.db.pool())
    .await
    .expect("setup");
    let mut holder = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::raw_sql("BEGIN; SELECT * FROM things WHERE id = 1 FOR UPDATE")
        .execute(&mut holder)
        .await
        .expect("hold the row");

    let attempts = Arc::new(AtomicU32::new(0));
    let counter = attempts.clone();
    let err =
        t.db.tx(
            "a_lock_wait_past_the_timeout_is_lock_timeout",
            TxKind::Write,
            move |conn| {
                counter.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    sqlx::query("UPDATE things SET v = v + 1 WHERE id = 1")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            },
        )
        .await
        .expect_err("the row is held");
    assert!(matches!(err, Error::LockTimeout), "{err:?}");
    assert_eq!(err.code(), ErrorCode::LockTimeout);
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        1,
        "a lock timeout is not retried"
    );

    sqlx::raw_sql("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release");
    let (v,): (i32,) = sqlx::query_as("SELECT v FROM things WHERE id = 1")
        .fetch_one(t.db.pool())
        .await
        .expect("read");
    assert_eq!(v, 0, "nothing half-written");
}

/// Runs a transaction that writes a row, then fails with `sqlstate` on its first `fail_times`
/// attempts.
async fn flaky(db: &Db, sqlstate: &'static str, fail_times: u32) -> (Result<(), Error>, u32) {
    let raise: &'static str = match sqlstate {
        "40P01" => "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40P01'; END $$",
        _ => "DO $$ BEGIN RAISE EXCEPTION 'simulated' USING ERRCODE = '40001'; END $$",
    };
    let attempts = Arc::new(AtomicU32::new(0));
    let counter = attempts.clone();
    let result = db
        .tx("flaky", TxKind::Write, move |conn| {
            let attempt = counter.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move {
                sqlx::query("INSERT INTO attempts (n) VALUES ($1)")
                    .bind(attempt as i32)
                    .execute(&mut *conn)
                    .await?;
                if attempt <= fail_times {
                    sqlx::query(raise).execute(&mut *conn).await?;
                }
                Ok(())
            })
        })
        .await;
    (result, attempts.load(Ordering::SeqCst))
}

#[tokio::test]
async fn deadlocks_and_serialization_failures_are_retried_then_reported() {
    let t = test_db().await;
    sqlx::query("CREATE TABLE attempts (n int)")
        .execute(t.db.pool())
        .await
        .expect("setup");

    let (result, attempts) = flaky(&t.db, "40P01", 1).await;
    result.expect("the second attempt commits");
    assert_eq!(attempts, 2);
    let rows: Vec<(i32,)> = sqlx::query_as("SELECT n FROM attempts")
        .fetch_all(t.db.pool())
        .await
        .expect("rows");
    assert_eq!(rows, vec![(2,)], "only the committed attempt left a row");

    let (result, attempts) = flaky(&t.db, "40001", 99).await;
    let err = result.expect_err("gives up");
    assert_eq!(attempts, MAX_ATTEMPTS);
    assert_eq!(err.code(), ErrorCode::LockTimeout);
    assert!(
        matches!(&err, Error::Contention { sqlstate, attempts } if sqlstate == "40001" && *attempts == MAX_ATTEMPTS),
        "{err:?}"
    );
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM attempts")
        .fetch_one(t.db.pool())
        .await
        .expect("count");
    assert_eq!(n, 1, "failed attempts left nothing");
}

/// A transaction abandoned at any moment (a client gone, a loop stopped mid-step) leaves no open
/// transaction behind: the next autocommit statement on the pool commits at once. sqlx queues no
/// `ROLLBACK` for a transaction dropped while its `BEGIN` is in flight, so without the closing
/// guard in `Db::tx` that connection returned to the pool inside the transaction, and a later
/// write on it stayed uncommitted, holding its locks (a lease row, in CI through PgBouncer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_abandoned_at_any_moment_leaves_no_transaction_open() {
    let t = test_db().await;
    sqlx::query("CREATE TABLE probe (n int PRIMARY KEY)")
        .execute(t.db.pool())
        .await
        .expect("table");
    // One connection, so each probe runs on the connection the abandoned transaction had.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&t.url)
        .await
        .expect("pool");
    let db = Db::from_pool(pool);
    let mut observer = sqlx::PgConnection::connect(&t.url).await.expect("observer");
    let mut abandoned_mid_flight = 0;
    for n in 0..400i32 {
        let work = {
            let db = db.clone();
            tokio::spawn(async move {
                db.tx("abandoned", TxKind::Write, |conn| {
                    Box::pin(async move {
                        sqlx::query("SELECT 1").execute(conn).await?;
                        Ok(())
                    })
                })
                .await
            })
        };
        // Abandon it somewhere between its acquire and its commit (blocking this thread while
        // the other worker thread runs it).
        std::thread::sleep(std::time::Duration::from_micros(
            u64::from(n as u32 % 40) * 15,
        ));
        work.abort();
        if matches!(work.await, Err(e) if e.is_cancelled()) {
            abandoned_mid_flight += 1;
        }
        sqlx::query("INSERT INTO probe (n) VALUES ($1)")
            .bind(n)
            .execute(db.pool())
            .await
            .expect("probe");
        let (seen,): (i64,) = sqlx::query_as("SELECT count(*) FROM probe WHERE n = $1")
            .bind(n)
            .fetch_one(&mut observer)
            .await
            .expect("observe");
        assert_eq!(
            seen, 1,
            "probe {n}: an autocommit write after an abandoned transaction is not committed"
        );
    }
    assert!(
        abandoned_mid_flight > 50,
        "the test abandons transactions in flight ({abandoned_mid_flight} of 400)"
    );
}
