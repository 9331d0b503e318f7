//! Leases with fencing, and the work queue.

use std::time::Duration;

use compute_domain::db::TxKind;
use compute_domain::leases::{self, TTL};
use compute_domain::work_queue;
use compute_domain::{Error, ErrorCode};
use compute_tests::test_db;
use sqlx::Connection;

/// The hourly prune deletes the leases no process takes again, an hour after they expired:
/// presences, gateways, deleted sinks' deliveries. Shard and fixed singleton leases stay (their
/// epochs fence their next holders), and so do a live sink's and a lease expired only lately.
#[tokio::test]
async fn the_prune_deletes_only_leases_no_process_takes_again() {
    use compute_domain::sinks::{self, Scope};
    let t = test_db().await;
    t.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &t.db;
    let scope = Scope {
        tenant_id: Some(compute_tests::tenant("acme")),
    };
    let (live, _) = sinks::create(db, &scope, "alice", "https://example.com/hooks", vec![], 1)
        .await
        .expect("a sink");
    let (gone, _) = sinks::create(db, &scope, "alice", "https://example.com/gone", vec![], 1)
        .await
        .expect("a sink");
    sinks::delete(db, &scope, &gone.id).await.expect("deleted");
    let names = [
        leases::name::presence("worker", "old-host-1"),
        leases::name::presence("dispatch", "old-host-2"),
        leases::name::presence("worker", "lately"),
        "gateway:old-gateway".to_owned(),
        leases::name::outbox_dispatch(gone.id.as_str()),
        leases::name::outbox_dispatch(live.id.as_str()),
        leases::name::RESERVATIONS.to_owned(),
        leases::name::shard("reservation", 0),
    ];
    for name in &names {
        leases::acquire(db, name, "someone", TTL)
            .await
            .expect("acquire")
            .expect("free");
    }
    // All expire; one is taken again later and expires only 10 minutes before the prune.
    t.advance_clock(2 * 3600).await;
    leases::acquire(db, &names[2], "someone", TTL)
        .await
        .expect("acquire")
        .expect("free");
    t.advance_clock(600).await;
    assert_eq!(
        leases::prune(db, leases::PRUNE_AFTER).await.expect("prune"),
        4
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT name FROM leases ORDER BY name")
        .fetch_all(db.pool())
        .await
        .expect("leases");
    let mut expected = vec![
        names[2].clone(),
        names[5].clone(),
        names[6].clone(),
        names[7].clone(),
    ];
    expected.sort();
    assert_eq!(left, expected);
    // A pruned name is free: whoever takes it starts a new line of epochs.
    assert!(
        leases::acquire(db, &names[0], "someone-else", TTL)
            .await
            .expect("acquire")
            .is_some_and(|f| f.epoch == 1),
        "a presence name is free again"
    );
}

#[tokio::test]
async fn a_lease_is_held_renewed_lost_and_taken_over_with_a_new_epoch() {
    let t = test_db().await;
    t.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &t.db;
    let a = leases::acquire(db, "singleton:expiry", "worker-a", TTL)
        .await
        .expect("acquire")
        .expect("free");
    assert_eq!(a.epoch, 1);
    assert!(
        leases::acquire(db, "singleton:expiry", "worker-b", TTL)
            .await
            .expect("try")
            .is_none(),
        "held by a"
    );
    t.advance_clock(10).await;
    assert!(
        leases::renew(db, &a, TTL).await.expect("renew"),
        "a renews in time"
    );
    t.advance_clock(14).await;
    assert!(
        leases::acquire(db, "singleton:expiry", "worker-b", TTL)
            .await
            .expect("try")
            .is_none(),
        "the renewal counted"
    );
    t.advance_clock(2).await; // 16 s after the renewal: expired
    let b = leases::acquire(db, "singleton:expiry", "worker-b", TTL)
        .await
        .expect("acquire")
        .expect("expired");
    assert_eq!(b.epoch, 2, "a takeover increments the epoch");
    assert!(
        !leases::renew(db, &a, TTL).await.expect("renew"),
        "a lost it"
    );
    let again = leases::acquire(db, "singleton:expiry", "worker-b", TTL)
        .await
        .expect("renew by acquire")
        .expect("held");
    assert_eq!(again.epoch, 2, "the holder's own acquire keeps the epoch");

    sqlx::query("CREATE TABLE effects (by text)")
        .execute(db.pool())
        .await
        .expect("table");
    let write = |fence: leases::Fence| async move {
        db.fenced_tx(
            "a_lease_is_held_renewed_lost_and_taken_over_with_a_new_epoch",
            &fence,
            TxKind::Maintenance,
            |conn| {
                let by = fence.owner.clone();
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects VALUES ($1)")
                        .bind(by)
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            },
        )
        .await
    };
    let err = write(a.clone()).await.expect_err("fenced out");
    assert!(matches!(err, Error::LeaseLost(_)), "{err:?}");
    assert_eq!(err.code(), ErrorCode::Conflict);
    write(b.clone()).await.expect("the holder writes");
    let rows: Vec<(String,)> = sqlx::query_as("SELECT by FROM effects")
        .fetch_all(db.pool())
        .await
        .expect("rows");
    assert_eq!(
        rows,
        vec![("worker-b".to_owned(),)],
        "the zombie wrote nothing"
    );
    leases::release(db, &b).await.expect("release");
    let c = leases::acquire(db, "singleton:expiry", "worker-c", TTL)
        .await
        .expect("acquire")
        .expect("released");
    assert_eq!(c.epoch, 3);
}

/// A takeover waits for the old holder's fenced transaction: the zombie either commits while it
/// still holds the lease, or never.
#[tokio::test]
async fn a_takeover_waits_for_the_old_holders_fenced_transaction() {
    let t = test_db().await;
    t.use_sim_clock("2031-01-01T00:00:00Z").await;
    let a = leases::acquire(&t.db, "singleton:x", "a", TTL)
        .await
        .expect("acquire")
        .expect("free");
    let mut zombie = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut zombie)
        .await
        .expect("begin");
    leases::check(&mut zombie, &a).await.expect("fence holds");
    t.advance_clock(20).await;
    let db = t.db.clone();
    let takeover = tokio::spawn(async move { leases::acquire(&db, "singleton:x", "b", TTL).await });
    let pool = t.db.pool();
    compute_tests::eventually(
        "the takeover waits on the zombie's FOR SHARE",
        Duration::from_secs(5),
        || async move {
            let (n,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(pool)
            .await
            .expect("activity");
            (n > 0).then_some(())
        },
    )
    .await;
    sqlx::query("COMMIT")
        .execute(&mut zombie)
        .await
        .expect("commit");
    let b = takeover
        .await
        .expect("join")
        .expect("acquire")
        .expect("taken over");
    assert_eq!(b.epoch, 2);
}

#[tokio::test]
async fn the_work_queue_never_loses_a_wake_up() {
    let t = test_db().await;
    t.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = &t.db;
    let enqueue = |key: &'static str| async move {
        db.tx(
            "the_work_queue_never_loses_a_wake_up",
            TxKind::Write,
            |conn| {
                Box::pin(async move {
                    work_queue::enqueue(
                        conn,
                        work_queue::WorkKind::Reservation,
                        key,
                        4,
                        Duration::ZERO,
                    )
                    .await
                })
            },
        )
        .await
        .expect("enqueue")
    };
    enqueue("rsv_1").await;
    enqueue("rsv_1").await;
    let (n, generation): (i64, i64) = sqlx::query_as("SELECT count(*), max(gen) FROM work_queue")
        .fetch_one(db.pool())
        .await
        .expect("rows");
    assert_eq!(
        (n, generation),
        (1, 2),
        "one row per key; enqueueing again bumps gen"
    );

    let all_shards = [0, 1, 2, 3];
    let claim = || async {
        db.tx(
            "the_work_queue_never_loses_a_wake_up",
            TxKind::Maintenance,
            |conn| {
                Box::pin(async move {
                    work_queue::claim(
                        conn,
                        work_queue::WorkKind::Reservation,
                        &all_shards,
                        10,
                        Duration::from_secs(60),
                    )
                    .await
                })
            },
        )
        .await
        .expect("claim")
    };
    let items = claim().await;
    assert_eq!(items.len(), 1);
    assert!(
        claim().await.is_empty(),
        "a claimed item is not claimed twice"
    );
    enqueue("rsv_1").await; // dirtied again while it runs
    let done = db
        .tx(
            "the_work_queue_never_loses_a_wake_up",
            TxKind::Maintenance,
            |conn| {
                let item = items[0].clone();
                Box::pin(async move { work_queue::complete(conn, &item).await })
            },
        )
        .await
        .expect("complete");
    assert!(!done, "a key enqueued during the run survives");
    let items = claim().await;
    assert_eq!(items[0].generation, 3, "and runs again");
    db.tx(
        "the_work_queue_never_loses_a_wake_up",
        TxKind::Maintenance,
        |conn| {
            let item = items[0].clone();
            Box::pin(async move { work_queue::fail(conn, &item, "node daemon unreachable").await })
        },
    )
    .await
    .expect("fail");
    assert!(claim().await.is_empty(), "backing off");
    t.advance_clock(1).await;
    let items = claim().await;
    assert_eq!(items[0].attempts, 1);
    let (error,): (String,) = sqlx::query_as("SELECT last_error FROM work_queue")
        .fetch_one(db.pool())
        .await
        .expect("row");
    assert_eq!(error, "node daemon unreachable", "kept for operators");
    assert!(
        db.tx(
            "the_work_queue_never_loses_a_wake_up",
            TxKind::Maintenance,
            |conn| {
                let item = items[0].clone();
                Box::pin(async move { work_queue::complete(conn, &item).await })
            }
        )
        .await
        .expect("complete")
    );
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM work_queue")
        .fetch_one(db.pool())
        .await
        .expect("rows");
    assert_eq!(n, 0);

    // Two claimers at once take disjoint rows (SKIP LOCKED).
    for k in ["a", "b", "c", "d", "e", "f"] {
        enqueue(k).await;
    }
    let mut one = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    let mut two = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut one).await.expect("begin");
    sqlx::query("BEGIN").execute(&mut two).await.expect("begin");
    let first = work_queue::claim(
        &mut one,
        work_queue::WorkKind::Reservation,
        &all_shards,
        3,
        Duration::from_secs(60),
    )
    .await
    .expect("claim");
    let second = work_queue::claim(
        &mut two,
        work_queue::WorkKind::Reservation,
        &all_shards,
        10,
        Duration::from_secs(60),
    )
    .await
    .expect("claim");
    assert_eq!(first.len() + second.len(), 6);
    assert!(
        first.iter().all(|a| second.iter().all(|b| a.key != b.key)),
        "disjoint"
    );
}

/// A run's finish racing an enqueue of the same key (the enqueue holds the row, uncommitted,
/// while the finish waits for it): the item ends unclaimed at the enqueue's generation, whether
/// the run asked to be deleted or to wake again later. A finish that named `gen` in its
/// condition skipped the row (its snapshot did not see the bump) and left it claimed until the
/// claim expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_racing_an_enqueue_leaves_the_item_unclaimed() {
    let t = test_db().await;
    t.use_sim_clock("2031-01-01T00:00:00Z").await;
    let db = t.db.clone();
    let later: chrono::DateTime<chrono::Utc> = "2031-01-01T02:00:00Z".parse().expect("time");
    for (key, next) in [("rsv_race_deleted", None), ("rsv_race_later", Some(later))] {
        let mut enqueuer = sqlx::PgConnection::connect(&t.url).await.expect("connect");
        work_queue::enqueue(
            &mut enqueuer,
            work_queue::WorkKind::Reservation,
            key,
            4,
            Duration::ZERO,
        )
        .await
        .expect("enqueue");
        let item = db
            .tx("race", TxKind::Maintenance, |conn| {
                Box::pin(async move {
                    work_queue::claim(
                        conn,
                        work_queue::WorkKind::Reservation,
                        &[0, 1, 2, 3],
                        10,
                        Duration::from_secs(60),
                    )
                    .await
                })
            })
            .await
            .expect("claim")
            .into_iter()
            .find(|i| i.key == key)
            .expect("claimed");
        // Enqueued again while it runs, in a transaction that holds the row.
        sqlx::query("BEGIN")
            .execute(&mut enqueuer)
            .await
            .expect("begin");
        work_queue::enqueue(
            &mut enqueuer,
            work_queue::WorkKind::Reservation,
            key,
            4,
            Duration::ZERO,
        )
        .await
        .expect("enqueue again");
        let finishing = tokio::spawn({
            let (db, item) = (db.clone(), item.clone());
            async move {
                db.tx("race", TxKind::Maintenance, |conn| {
                    let item = item.clone();
                    Box::pin(async move { work_queue::finish(conn, &item, next).await })
                })
                .await
            }
        });
        compute_tests::eventually("the finish waits for the enqueue's row", Duration::from_secs(10), || async {
            let (n,): (i64,) = sqlx::query_as(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(db.pool())
            .await
            .expect("activity");
            (n > 0).then_some(())
        })
        .await;
        sqlx::query("COMMIT")
            .execute(&mut enqueuer)
            .await
            .expect("commit");
        let last = finishing.await.expect("task").expect("finish");
        assert!(!last, "{key}: the claimed generation was not the last");
        let (generation, claimed, not_before): (
            i64,
            Option<chrono::DateTime<chrono::Utc>>,
            chrono::DateTime<chrono::Utc>,
        ) = sqlx::query_as("SELECT gen, claimed_until, not_before FROM work_queue WHERE key = $1")
            .bind(key)
            .fetch_one(db.pool())
            .await
            .expect("the item stays");
        assert_eq!(generation, item.generation + 1, "{key}");
        assert_eq!(claimed, None, "{key}: unclaimed, so it runs again at once");
        assert!(
            not_before < later,
            "{key}: due now, not at the run's next wake-up"
        );
    }
}

/// Only the lease families the code takes exist (migration 0023): a `pool:` or `site:` lease,
/// which no process takes, or a name of no family, is refused by the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_families_in_use_can_be_taken() {
    let db = compute_tests::test_db().await;
    let ttl = std::time::Duration::from_secs(15);
    for refused in [
        format!("pool:pool_{}", "0".repeat(32)),
        format!("site:site_{}", "0".repeat(32)),
        "anything".to_owned(),
    ] {
        assert!(
            compute_domain::leases::acquire(&db.db, &refused, "test", ttl)
                .await
                .is_err(),
            "{refused} was taken"
        );
    }
    for taken in [
        "shard:reservation:3".to_owned(),
        compute_domain::leases::name::RESERVATIONS.to_owned(),
        compute_domain::leases::name::presence("worker", "w1"),
        compute_domain::leases::name::outbox_dispatch(&format!("snk_{}", "0".repeat(32))),
        compute_domain::leases::name::gateway(
            &compute_domain::ids::GatewayId::parse("gateway", "g-1.a").expect("id"),
        ),
    ] {
        assert!(
            compute_domain::leases::acquire(&db.db, &taken, "test", ttl)
                .await
                .expect("acquire")
                .is_some(),
            "{taken}"
        );
    }
}
