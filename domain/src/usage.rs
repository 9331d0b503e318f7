//! Usage windows for billing: the meter that closes fixed windows of reserved time, exactly once
//! each, and the reports read from them (`docs/usage.md`).
//!
//! The meter is two SQL functions (migration 0016; `compute_usage_close_batch` as migration 0046
//! redefined it, `compute_usage_check` as 0050 did), each called in a transaction of its own (a
//! fenced one when a worker runs it under its lease):
//!
//! - `compute_usage_close_batch`: the open window's next [`BATCH`] allocations measured from
//!   their bookings and written as records keyed `cmp:<allocationId>:<windowStart>` (unique),
//!   with one `usage.window_closed` event each; the batch that finds fewer closes the window.
//!   The meter's row (`usage_meter`, locked `FOR UPDATE`) holds how far it has got, so a worker
//!   killed mid-batch rolls that batch back and its successor writes it, once.
//! - `compute_usage_check`: the reservation changes committed since the last check (read from
//!   the outbox in commit-safe order) measured again against the windows that already hold
//!   records; a difference is an adjustment record (`…:adj:<n>`, `usage.window_adjusted`), never
//!   a rewrite.

use chrono::{DateTime, Utc};

use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::ids::TenantId;

/// Allocations measured per batch (one transaction).
pub const BATCH: i64 = 500;
/// Reservation changes checked per transaction.
pub const CHECK_BATCH: i64 = 1000;
/// A window is closed once its end is this far in the past: a change made by a transaction that
/// began before the end has committed by then (any later one is caught as an adjustment).
pub const GRACE_SECONDS: i32 = 60;
/// The default window length (an hour), and the bounds of [`set_window`].
pub const DEFAULT_WINDOW_SECONDS: i32 = 3600;
pub const MIN_WINDOW_SECONDS: i32 = 60;
pub const MAX_WINDOW_SECONDS: i32 = 86_400;
/// The longest range a report may cover.
pub const MAX_REPORT_DAYS: i64 = 400;

/// What one call of [`meter_pass`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeterPass {
    /// Windows closed.
    pub windows_closed: u64,
    /// Window records written (by closing windows, and first records found by the check).
    pub records: u64,
    /// Records written by the check of reservation changes (adjustments and late first records).
    pub checked: u64,
    /// Transactions run.
    pub batches: u64,
    /// Whether more is due now (the pass stopped at its budget).
    pub more: bool,
}

/// One batch of closing: the window it worked on, and what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub written: i64,
    pub closed: bool,
    pub more: bool,
}

/// Runs one batch of closing in a transaction of its own.
#[tracing::instrument(level = "debug", skip_all, fields(limit = limit))]
pub async fn close_batch(db: &Db, limit: i64) -> Result<Batch> {
    db.tx("usage_close_batch", TxKind::Maintenance, |conn| {
        Box::pin(async move {
            let row: (DateTime<Utc>, DateTime<Utc>, i32, bool, bool) = sqlx::query_as(
                "SELECT window_start, window_end, written, closed, more FROM compute_usage_close_batch($1::integer, $2)",
            )
            .bind(limit)
            .bind(GRACE_SECONDS)
            .fetch_one(&mut *conn)
            .await?;
            Ok(Batch {
                window_start: row.0,
                window_end: row.1,
                written: i64::from(row.2),
                closed: row.3,
                more: row.4,
            })
        })
    })
    .await
}

/// Checks up to `limit` reservation changes against the windows that hold records, in a
/// transaction of its own; returns the records written and whether more changes wait.
#[tracing::instrument(level = "debug", skip_all, fields(limit = limit))]
pub async fn check_changes(db: &Db, limit: i64) -> Result<(i64, bool)> {
    db.tx("usage_check", TxKind::Maintenance, |conn| {
        Box::pin(async move {
            let (written, more): (i32, bool) =
                sqlx::query_as("SELECT written, more FROM compute_usage_check($1::integer)")
                    .bind(limit)
                    .fetch_one(&mut *conn)
                    .await?;
            Ok((i64::from(written), more))
        })
    })
    .await
}

/// Checks the reservation changes, then closes what is due, at most `budget` transactions in
/// all, then checks again (changes that committed while windows closed). Each step is safe to
/// run twice and in any process; under a lease, `db` is fenced.
pub async fn meter_pass(db: &Db, budget: u64) -> Result<MeterPass> {
    let mut pass = MeterPass::default();
    check_all(db, budget, &mut pass).await?;
    while pass.batches < budget {
        let b = close_batch(db, BATCH).await?;
        pass.batches += 1;
        pass.records += b.written as u64;
        if b.closed {
            pass.windows_closed += 1;
            tracing::debug!(
                usage.window_start = %b.window_start,
                usage.window_end = %b.window_end,
                "usage window closed"
            );
        }
        pass.more = b.more;
        if !b.more {
            break;
        }
    }
    if pass.records > 0 || pass.windows_closed > 0 {
        check_all(db, budget, &mut pass).await?;
    }
    Ok(pass)
}

/// Checks reservation changes until none wait or `pass` has used `budget` transactions.
async fn check_all(db: &Db, budget: u64, pass: &mut MeterPass) -> Result<()> {
    while pass.batches < budget {
        let (written, more) = check_changes(db, CHECK_BATCH).await?;
        pass.batches += 1;
        pass.checked += written as u64;
        if !more {
            return Ok(());
        }
    }
    pass.more = true;
    Ok(())
}

/// Reservation changes the meter reads (`compute_usage_reads`: those that can move bookings)
/// committed after its checked position: 0 once the check has caught up. (The check reads only
/// below the commit-safe horizon, so a change can wait there while any older transaction on the
/// server is still open.)
pub async fn unchecked_changes(db: &Db) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox o, usage_meter m
          WHERE m.checked_txid IS NOT NULL AND (o.txid, o.seq) > (m.checked_txid, m.checked_seq)
            AND compute_usage_reads(o.type)",
    )
    .fetch_one(db.pool())
    .await?)
}

/// Runs [`meter_pass`] until nothing is due and every committed reservation change has been
/// checked, waiting `poll` between passes that leave changes behind the horizon; gives up after
/// `within`. What all the passes did, summed.
pub async fn settle(
    db: &Db,
    poll: std::time::Duration,
    within: std::time::Duration,
) -> Result<MeterPass> {
    let deadline = std::time::Instant::now() + within;
    let mut total = MeterPass::default();
    loop {
        let p = meter_pass(db, 1000).await?;
        total.windows_closed += p.windows_closed;
        total.records += p.records;
        total.checked += p.checked;
        total.batches += p.batches;
        if !p.more && unchecked_changes(db).await? == 0 {
            return Ok(total);
        }
        if std::time::Instant::now() >= deadline {
            total.more = true;
            return Ok(total);
        }
        tokio::time::sleep(poll).await;
    }
}

/// The meter as it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    pub window_seconds: i32,
    /// Every window before this is closed; `None` before the meter first ran.
    pub closed_through: Option<DateTime<Utc>>,
}

/// Seconds from the end of the last closed window to now (`None` before the meter first ran).
pub async fn lag_seconds(db: &Db) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT extract(epoch FROM compute_now() - closed_through)::bigint FROM usage_meter",
    )
    .fetch_one(db.pool())
    .await?)
}

/// Reads the meter's row.
pub async fn meter(db: &Db) -> Result<Meter> {
    let (window_seconds, closed_through): (i32, Option<DateTime<Utc>>) =
        sqlx::query_as("SELECT window_seconds, closed_through FROM usage_meter")
            .fetch_one(db.pool())
            .await?;
    Ok(Meter {
        window_seconds,
        closed_through,
    })
}

/// Sets the length of the windows opened from now on (the open window keeps its length); returns
/// whether it changed. Between [`MIN_WINDOW_SECONDS`] and [`MAX_WINDOW_SECONDS`].
#[tracing::instrument(level = "debug", skip_all, fields(seconds = seconds))]
pub async fn set_window(db: &Db, seconds: i32) -> Result<bool> {
    if !(MIN_WINDOW_SECONDS..=MAX_WINDOW_SECONDS).contains(&seconds) {
        return Err(Error::bad_input(
            "windowSeconds",
            format!(
                "a usage window lasts {MIN_WINDOW_SECONDS} to {MAX_WINDOW_SECONDS} seconds, not {seconds}"
            ),
        ));
    }
    db.tx("usage_set_window", TxKind::Maintenance, |conn| {
        Box::pin(async move {
            let done = sqlx::query(
                "UPDATE usage_meter SET window_seconds = $1, updated_at = compute_now() WHERE id AND window_seconds <> $1",
            )
            .bind(seconds)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        })
    })
    .await
}

/// What a report groups its records by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupBy {
    Tenant,
    Pool,
    /// The GPUs' model, with the kind of atom and the MIG profile.
    Model,
    Reservation,
}

/// A report's question: the records of the windows that start in `[from, to)`, of one tenant or
/// of all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportQuery {
    pub tenant_id: Option<TenantId>,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub group_by: Vec<GroupBy>,
}

impl ReportQuery {
    /// Checks the range: `from` before `to`, at most [`MAX_REPORT_DAYS`] apart.
    pub fn new(
        tenant_id: Option<TenantId>,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        group_by: Vec<GroupBy>,
    ) -> Result<ReportQuery> {
        let from = crate::fleet::model::parse_time("from", from)?;
        let to = crate::fleet::model::parse_time("to", to)?;
        if to <= from {
            return Err(Error::bad_input("to", "`to` must be later than `from`"));
        }
        if to - from > chrono::Duration::days(MAX_REPORT_DAYS) {
            return Err(Error::bad_input(
                "to",
                format!("a usage report covers at most {MAX_REPORT_DAYS} days"),
            ));
        }
        Ok(ReportQuery {
            tenant_id,
            from,
            to,
            group_by,
        })
    }

    fn by(&self, g: GroupBy) -> bool {
        self.group_by.contains(&g)
    }
}

/// Sums of records. Amounts are exact decimals, as text (at most six decimals).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Amounts {
    pub records: i64,
    pub booked_seconds: String,
    pub gpu_seconds: String,
    pub vcpu_seconds: String,
    pub memory_mib_seconds: String,
    pub disk_gib_seconds: String,
}

/// One group of a report: the values of the columns it is grouped by (`None` for the others).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Group {
    pub tenant_id: Option<String>,
    pub pool_id: Option<String>,
    pub model: Option<String>,
    pub gpu_kind: Option<String>,
    pub profile: Option<String>,
    pub reservation_id: Option<String>,
    #[sqlx(flatten)]
    pub amounts: Amounts,
}

/// The one statement of reports: grouped by the columns flagged, in their order, one page after
/// a group's key (keyset paging: a group that appears between two pages, as a window closes,
/// neither repeats nor hides another). A group's key is its six values, NULL as `''` (no value
/// of these columns is empty, and `''` sorts first, as NULLS FIRST would).
const GROUPS: &str = "\
SELECT g.* FROM (
SELECT CASE WHEN $4 THEN u.tenant_id END AS tenant_id,
       CASE WHEN $5 THEN u.pool_id END AS pool_id,
       CASE WHEN $6 THEN u.model END AS model,
       CASE WHEN $6 THEN u.gpu_kind END AS gpu_kind,
       CASE WHEN $6 THEN u.profile END AS profile,
       CASE WHEN $7 THEN u.reservation_id END AS reservation_id,
       count(*) AS records,
       compute_amount_text(sum(u.booked_seconds)) AS booked_seconds,
       compute_amount_text(sum(u.gpu_seconds)) AS gpu_seconds,
       compute_amount_text(sum(u.vcpu_seconds)) AS vcpu_seconds,
       compute_amount_text(sum(u.memory_mib_seconds)) AS memory_mib_seconds,
       compute_amount_text(sum(u.disk_gib_seconds)) AS disk_gib_seconds
  FROM usage_records u
 WHERE u.window_start >= $1 AND u.window_start < $2 AND ($3::text IS NULL OR u.tenant_id = $3)
 GROUP BY 1, 2, 3, 4, 5, 6) g
 WHERE $9::text[] IS NULL
    OR (coalesce(g.tenant_id, ''), coalesce(g.pool_id, ''), coalesce(g.model, ''), coalesce(g.gpu_kind, ''),
        coalesce(g.profile, ''), coalesce(g.reservation_id, ''))
       > ($9[1], $9[2], $9[3], $9[4], $9[5], $9[6])
 ORDER BY coalesce(g.tenant_id, ''), coalesce(g.pool_id, ''), coalesce(g.model, ''), coalesce(g.gpu_kind, ''),
          coalesce(g.profile, ''), coalesce(g.reservation_id, '')
 LIMIT $8";

impl Group {
    /// The group's key, for the page after it ([`groups`]).
    pub fn key(&self) -> [String; 6] {
        let v = |x: &Option<String>| x.clone().unwrap_or_default();
        [
            v(&self.tenant_id),
            v(&self.pool_id),
            v(&self.model),
            v(&self.gpu_kind),
            v(&self.profile),
            v(&self.reservation_id),
        ]
    }
}

/// The totals of `q`'s records (grouping ignored): zero when there are none.
pub async fn totals(db: &Db, q: &ReportQuery) -> Result<Amounts> {
    let rows = fetch_groups(db, q, false, 1, None).await?;
    Ok(rows.into_iter().next().map_or_else(
        || Amounts {
            records: 0,
            booked_seconds: "0".into(),
            gpu_seconds: "0".into(),
            vcpu_seconds: "0".into(),
            memory_mib_seconds: "0".into(),
            disk_gib_seconds: "0".into(),
        },
        |g| g.amounts,
    ))
}

/// One page of `q`'s groups: at most `limit`, after the group whose key ([`Group::key`]) is
/// `after`.
pub async fn groups(
    db: &Db,
    q: &ReportQuery,
    limit: i64,
    after: Option<&[String; 6]>,
) -> Result<Vec<Group>> {
    fetch_groups(db, q, true, limit, after).await
}

async fn fetch_groups(
    db: &Db,
    q: &ReportQuery,
    grouped: bool,
    limit: i64,
    after: Option<&[String; 6]>,
) -> Result<Vec<Group>> {
    let by = |g| grouped && q.by(g);
    Ok(sqlx::query_as::<_, Group>(GROUPS)
        .bind(q.from)
        .bind(q.to)
        .bind(q.tenant_id.as_ref().map(TenantId::as_str))
        .bind(by(GroupBy::Tenant))
        .bind(by(GroupBy::Pool))
        .bind(by(GroupBy::Model))
        .bind(by(GroupBy::Reservation))
        .bind(limit)
        .bind(after.map(|k| k.to_vec()))
        .fetch_all(db.pool())
        .await?)
}

/// `q`'s records in `(window_start, key)` order, at most `limit` after `after` (the last record
/// of the previous page), each as its events carry it (`compute_usage_payload`, the one
/// definition of a record's public shape).
pub async fn records(
    db: &Db,
    q: &ReportQuery,
    after: Option<(DateTime<Utc>, String)>,
    limit: i64,
) -> Result<Vec<crate::events::UsageView>> {
    let (after_start, after_key) = after.unzip();
    let rows: Vec<sqlx::types::Json<crate::events::UsagePayload>> = sqlx::query_scalar(
        "SELECT compute_usage_payload(u) FROM usage_records u
          WHERE u.window_start >= $1 AND u.window_start < $2 AND ($3::text IS NULL OR u.tenant_id = $3)
            AND ($4::timestamptz IS NULL OR (u.window_start, u.key) > ($4, $5))
          ORDER BY u.window_start, u.key
          LIMIT $6",
    )
    .bind(q.from)
    .bind(q.to)
    .bind(q.tenant_id.as_ref().map(TenantId::as_str))
    .bind(after_start)
    .bind(after_key)
    .bind(limit)
    .fetch_all(db.pool())
    .await?;
    Ok(rows.into_iter().map(|r| r.0.usage).collect())
}
