use compute_domain::db::TxKind;
use compute_domain::outbox::{self, NewEvent};
use compute_domain::{Error, ErrorCode};
use compute_tests::test_db;
use serde_json::json;

async fn count(db: &compute_tests::TestDb) -> i64 {
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM outbox")
        .fetch_one(db.db.pool())
        .await
        .expect("count");
    n
}

#[tokio::test]
async fn an_event_exists_exactly_when_its_transaction_commits() {
    let db = test_db().await;
    db.use_sim_clock("2030-03-01T08:00:00Z").await;

    let failed: Result<String, Error> = db
        .db
        .tx(
            "an_event_exists_exactly_when_its_transaction_commits",
            TxKind::Write,
            |conn| {
                Box::pin(async move {
                    outbox::emit(
                        conn,
                        NewEvent {
                            event_type: compute_domain::events::EventType::SiteCreated,
                            tenant_id: None,
                            subject: "site_x",
                            data: json!({ "id": "site_x" }),
                        },
                    )
                    .await?;
                    Err(Error::bad_input(
                        "name",
                        "refused after the event was written",
                    ))
                })
            },
        )
        .await;
    assert_eq!(
        failed.expect_err("rolled back").code(),
        ErrorCode::BadUserInput
    );
    assert_eq!(count(&db).await, 0, "a rolled-back change leaves no event");

    let id = db
        .db
        .tx(
            "an_event_exists_exactly_when_its_transaction_commits",
            TxKind::Write,
            |conn| {
                Box::pin(async move {
                    outbox::emit(
                        conn,
                        NewEvent {
                            event_type: compute_domain::events::EventType::ReservationScheduled,
                            tenant_id: Some(&compute_tests::tenant("acme")),
                            subject: "rsv_1",
                            data: json!({ "id": "rsv_1", "state": "SCHEDULED" }),
                        },
                    )
                    .await
                })
            },
        )
        .await
        .expect("commit");
    assert!(
        id.as_str().starts_with("evt_") && id.as_str().len() == 4 + 32,
        "{id}"
    );

    let (kind, tenant, subject, data, time, same_tx): (
        String,
        Option<String>,
        String,
        serde_json::Value,
        chrono::DateTime<chrono::Utc>,
        bool,
    ) = sqlx::query_as(
        "SELECT type, tenant_id, subject, data, time, txid IS NOT NULL FROM outbox WHERE id = $1",
    )
    .bind(&id)
    .fetch_one(db.db.pool())
    .await
    .expect("row");
    assert_eq!(kind, "reservation.scheduled");
    assert_eq!(tenant.as_deref(), Some("acme"));
    assert_eq!(subject, "rsv_1");
    assert_eq!(data["state"], "SCHEDULED");
    assert_eq!(
        time.to_rfc3339(),
        "2030-03-01T08:00:00+00:00",
        "time comes from compute_now()"
    );
    assert!(same_tx);
}

#[tokio::test]
async fn event_types_must_be_dotted_names() {
    // Rust writes only `EventType`s; the table's CHECK is the backstop for SQL that calls
    // `compute_emit` directly.
    let db = test_db().await;
    let err = sqlx::query("SELECT compute_emit('NotDotted', NULL, 'site_x', '{}')")
        .execute(db.db.pool())
        .await
        .expect_err("the CHECK refuses it");
    assert_eq!(
        Error::from(err).code(),
        ErrorCode::Internal,
        "a bug of ours, not a client's"
    );
    assert_eq!(count(&db).await, 0);
}
