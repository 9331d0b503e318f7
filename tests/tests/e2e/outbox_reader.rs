//! The outbox reader: rows only below the oldest running transaction, in `(txid, seq)` order.

use compute_domain::outbox::{self, Cursor, EventFilter};
use compute_tests::test_db;
use sqlx::Connection;

#[tokio::test]
async fn a_late_commit_with_a_lower_seq_is_neither_skipped_nor_overtaken() {
    let t = test_db().await;
    let all = EventFilter::default();
    let start = outbox::head(&t.db).await.expect("head");
    assert_eq!(start, Cursor::START);

    // Transaction A takes the lower seq and stays open.
    let mut a = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("BEGIN").execute(&mut a).await.expect("begin");
    sqlx::query("SELECT compute_emit('test.first', 'acme', 'thing_a', '{}')")
        .execute(&mut a)
        .await
        .expect("emit a");
    // Transaction B takes a higher seq and commits first.
    let mut b = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("SELECT compute_emit('test.second', 'acme', 'thing_b', '{}')")
        .execute(&mut b)
        .await
        .expect("emit b");

    let seen = outbox::read_after(&t.db, start, &all, 100)
        .await
        .expect("read");
    assert!(
        seen.is_empty(),
        "B is held back while the older A runs: {seen:?}"
    );

    sqlx::query("COMMIT")
        .execute(&mut a)
        .await
        .expect("commit a");
    // xmin is cluster-wide: other tests' transactions on this server may hold the rows back a
    // little longer. The reader only ever delays; poll until both are visible.
    let seen = compute_tests::eventually(
        "both events visible to the reader",
        std::time::Duration::from_secs(20),
        || async {
            let seen = outbox::read_after(&t.db, start, &all, 100)
                .await
                .expect("read");
            (seen.len() >= 2).then_some(seen)
        },
    )
    .await;
    let types: Vec<&str> = seen.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        vec!["test.first", "test.second"],
        "both, the earlier transaction first"
    );
    let last = seen[1].cursor.expect("cursor");
    assert!(
        outbox::read_after(&t.db, last, &all, 100)
            .await
            .expect("read")
            .is_empty(),
        "nothing twice"
    );
    assert_eq!(outbox::head(&t.db).await.expect("head"), last);

    // Cursors are opaque and round-trip; filters apply.
    let encoded = last.encode();
    assert_eq!(Cursor::decode("after", &encoded).expect("decode"), last);
    assert!(Cursor::decode("after", "evt_123").is_err());
    let mine = EventFilter {
        tenant_id: Some(compute_tests::tenant("globex")),
        ..EventFilter::default()
    };
    assert!(
        outbox::read_after(&t.db, start, &mine, 100)
            .await
            .expect("read")
            .is_empty(),
        "another tenant's events"
    );
    let typed = EventFilter {
        types: vec!["test.second".into()],
        ..EventFilter::default()
    };
    assert_eq!(
        outbox::read_after(&t.db, start, &typed, 100)
            .await
            .expect("read")
            .len(),
        1
    );
}

/// A transaction that took its xid early and then acts on what another, younger transaction just
/// committed (a dispatcher fencing before it dispatches a command created a moment ago) writes
/// its event after that transaction's event of the same subject, not under its own smaller xid.
#[tokio::test]
async fn a_subjects_events_follow_causality_when_the_later_writer_took_its_xid_first() {
    let t = test_db().await;
    let all = EventFilter::default();
    let start = outbox::head(&t.db).await.expect("head");

    // The later writer takes its xid first and stays open.
    let mut later = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut later)
        .await
        .expect("begin");
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut later)
        .await
        .expect("an early xid");
    // The earlier event: a younger transaction writes it and commits.
    let mut earlier = sqlx::PgConnection::connect(&t.url).await.expect("connect");
    sqlx::query("SELECT compute_emit('test.created', 'acme', 'thing_c', '{}')")
        .execute(&mut earlier)
        .await
        .expect("created");
    // The later writer, having seen it, writes the next event of the subject, and one of
    // another subject (whose order stays its own xid's).
    sqlx::query("SELECT compute_emit('test.dispatched', 'acme', 'thing_c', '{}')")
        .execute(&mut later)
        .await
        .expect("dispatched");
    sqlx::query("SELECT compute_emit('test.other', 'acme', 'thing_d', '{}')")
        .execute(&mut later)
        .await
        .expect("other");
    sqlx::query("COMMIT")
        .execute(&mut later)
        .await
        .expect("commit");

    let seen = compute_tests::eventually(
        "the three events visible to the reader",
        std::time::Duration::from_secs(20),
        || async {
            let seen = outbox::read_after(&t.db, start, &all, 100)
                .await
                .expect("read");
            (seen.len() >= 3).then_some(seen)
        },
    )
    .await;
    let types: Vec<&str> = seen.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        vec!["test.other", "test.created", "test.dispatched"],
        "thing_c's events in causal order; thing_d's keeps the writer's own (older) xid"
    );
    // Read one at a time from each cursor, nothing is skipped or repeated.
    let mut cursor = start;
    let mut one_by_one = vec![];
    for _ in 0..3 {
        let next = outbox::read_after(&t.db, cursor, &all, 1)
            .await
            .expect("read");
        let e = next.into_iter().next().expect("one more");
        cursor = e.cursor.expect("cursor");
        one_by_one.push(e.event_type);
    }
    assert_eq!(one_by_one, types);
    assert!(
        outbox::read_after(&t.db, cursor, &all, 1)
            .await
            .expect("read")
            .is_empty(),
        "nothing after the last"
    );
}
