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
