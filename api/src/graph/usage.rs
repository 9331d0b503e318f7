//! Usage for billing in the graph: `usage(tenantId, from, to, groupBy)`, summed from the usage
//! records of closed windows (`compute_domain::usage`, `docs/usage.md`). Members see their
//! tenant's; operators any tenant's, or every tenant's.

use async_graphql::connection::{Connection, Edge};
use async_graphql::{
    Context, Enum, InputValueError, InputValueResult, Object, Scalar, ScalarType, SimpleObject,
    Value,
};
use chrono::{DateTime, Utc};
use compute_domain::Error;
use compute_domain::page::{MAX_PAGE, decode_cursor, encode_cursor};
use compute_domain::usage::{self, Amounts, GroupBy, Meter, ReportQuery};

use crate::graph::common::AtomKind;
use crate::graph::context::listing_tenant;
use crate::graph::{GqlResult, db, gql_error};

/// An exact decimal number, as a string such as `"1542.857143"` (at most six decimals): amounts
/// that must add up exactly, which a float would not carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decimal(pub String);

/// An exact decimal number, as a string such as `"1542.857143"` (at most six decimals): amounts
/// that must add up exactly, which a float would not carry.
#[Scalar(name = "Decimal")]
impl ScalarType for Decimal {
    fn parse(value: Value) -> InputValueResult<Self> {
        match value {
            Value::String(s)
                if !s.is_empty()
                    && s.trim_start_matches('-').split('.').count() <= 2
                    && s.trim_start_matches('-')
                        .chars()
                        .all(|c| c.is_ascii_digit() || c == '.') =>
            {
                Ok(Decimal(s))
            }
            other => Err(InputValueError::expected_type(other)),
        }
    }

    fn to_value(&self) -> Value {
        Value::String(self.0.clone())
    }
}

/// What a usage report's groups are made by.
#[derive(Enum, Clone, Copy, PartialEq, Eq)]
pub enum UsageGroupBy {
    /// One group per tenant.
    Tenant,
    /// One group per pool.
    Pool,
    /// One group per GPU model, kind of atom and MIG profile.
    Model,
    /// One group per reservation.
    Reservation,
}

impl From<UsageGroupBy> for GroupBy {
    fn from(g: UsageGroupBy) -> GroupBy {
        match g {
            UsageGroupBy::Tenant => GroupBy::Tenant,
            UsageGroupBy::Pool => GroupBy::Pool,
            UsageGroupBy::Model => GroupBy::Model,
            UsageGroupBy::Reservation => GroupBy::Reservation,
        }
    }
}

/// Sums of usage records: reserved time, prorated to the microsecond.
#[derive(SimpleObject)]
pub struct UsageAmounts {
    /// How many records were summed (window records and adjustments).
    records: i64,
    /// Seconds the allocations held devices.
    booked_seconds: Decimal,
    /// GPU-seconds, weighted as quotas weigh GPUs: 1 per whole GPU, compute slices / 7 per MIG
    /// instance, 1 / slots per time-slice slot.
    gpu_seconds: Decimal,
    /// vCPU-seconds: the allocations' vCPU times the seconds they held them.
    vcpu_seconds: Decimal,
    /// MiB-seconds of memory: the allocations' memory times the seconds they held it.
    memory_mib_seconds: Decimal,
    /// GiB-seconds of disk: the allocations' disk times the seconds they held it.
    disk_gib_seconds: Decimal,
}

impl From<Amounts> for UsageAmounts {
    fn from(a: Amounts) -> UsageAmounts {
        UsageAmounts {
            records: a.records,
            booked_seconds: Decimal(a.booked_seconds),
            gpu_seconds: Decimal(a.gpu_seconds),
            vcpu_seconds: Decimal(a.vcpu_seconds),
            memory_mib_seconds: Decimal(a.memory_mib_seconds),
            disk_gib_seconds: Decimal(a.disk_gib_seconds),
        }
    }
}

/// One group of a usage report: the values it is grouped by (null for the others) and its sums.
#[derive(SimpleObject)]
pub struct UsageGroup {
    /// The tenant (grouped by `TENANT`).
    tenant_id: Option<String>,
    /// The pool (grouped by `POOL`).
    pool_id: Option<String>,
    /// The GPUs' model (grouped by `MODEL`); `A100+H100` for an allocation holding GPUs of
    /// several models.
    model: Option<String>,
    /// The kind of atom (grouped by `MODEL`).
    gpu_kind: Option<AtomKind>,
    /// The MIG profile (grouped by `MODEL`; null for whole GPUs and slots).
    profile: Option<String>,
    /// The reservation (grouped by `RESERVATION`).
    reservation_id: Option<String>,
    /// The group's sums.
    amounts: UsageAmounts,
}

/// Usage summed from the records of the windows that start in `[from, to)`.
pub struct UsageReport {
    q: ReportQuery,
    meter: Meter,
}

/// Usage summed from the records of the windows that start in `[from, to)`.
#[Object]
impl UsageReport {
    /// The tenant reported on; null for every tenant (operators).
    async fn tenant_id(&self) -> Option<&str> {
        self.q.tenant_id.as_ref().map(|t| t.as_str())
    }
    /// The range's start: windows starting at or after it are in the report.
    async fn from(&self) -> DateTime<Utc> {
        self.q.from
    }
    /// The range's end: windows starting before it are in the report.
    async fn to(&self) -> DateTime<Utc> {
        self.q.to
    }
    /// Every window before this time is closed; later windows are not billed yet (null before
    /// the meter first ran).
    async fn closed_through(&self) -> Option<DateTime<Utc>> {
        self.meter.closed_through
    }
    /// The length of the windows the meter opens now, in seconds.
    async fn window_seconds(&self) -> i32 {
        self.meter.window_seconds
    }
    /// The sums of every record in the range; the groups add up to it exactly.
    async fn total(&self, ctx: &Context<'_>) -> GqlResult<UsageAmounts> {
        Ok(usage::totals(db(ctx)?, &self.q).await?.into())
    }
    /// The groups, in order of the values they are grouped by; one group of everything when
    /// `groupBy` is empty.
    async fn groups(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "At most this many groups (0 to 100; 100 when not given).")] first: Option<
            i32,
        >,
        #[graphql(desc = "After this group's cursor.")] after: Option<String>,
    ) -> GqlResult<Connection<String, UsageGroup>> {
        let limit = i64::from(first.unwrap_or(MAX_PAGE as i32));
        if !(0..=MAX_PAGE).contains(&limit) {
            return Err(gql_error(Error::bad_input(
                "first",
                format!("`first` must be between 0 and {MAX_PAGE}"),
            )));
        }
        // The cursor is the group's key (its six grouping values): keyset paging, so a group
        // that appears between two pages (a window closing) repeats or hides none of the others.
        let bad = || gql_error(Error::bad_input("after", "not a cursor of this connection"));
        let after = after
            .map(|c| {
                let key = decode_cursor("after", &c)?;
                serde_json::from_str::<[String; 6]>(&key).map_err(|_| bad())
            })
            .transpose()?;
        let mut rows = usage::groups(db(ctx)?, &self.q, limit + 1, after.as_ref()).await?;
        let has_next = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let mut c = Connection::new(after.is_some(), has_next);
        c.edges.extend(rows.into_iter().map(|g| {
            let cursor = serde_json::to_string(&g.key()).unwrap_or_default();
            Edge::new(
                encode_cursor(&cursor),
                UsageGroup {
                    tenant_id: g.tenant_id,
                    pool_id: g.pool_id,
                    model: g.model,
                    gpu_kind: g
                        .gpu_kind
                        .as_deref()
                        .and_then(compute_domain::fleet::model::AtomKind::parse)
                        .map(AtomKind::from),
                    profile: g.profile,
                    reservation_id: g.reservation_id,
                    amounts: g.amounts.into(),
                },
            )
        }));
        Ok(c)
    }
}

/// The usage queries.
#[derive(Default)]
pub struct UsageQuery;

/// The usage queries.
#[Object]
impl UsageQuery {
    /// Reserved time billed in the windows that start in `[from, to)` (at most 400 days), from
    /// the usage records the meter wrote for closed windows: for a member, its tenant's; for an
    /// operator, `tenantId`'s, or every tenant's when it is not given. The same records are sent
    /// as `usage.window_closed` and `usage.window_adjusted` events and exported as CSV at
    /// `GET /usage.csv` (`docs/usage.md`).
    async fn usage(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The tenant (operators only; a member's is its own).")] tenant_id: Option<
            String,
        >,
        #[graphql(desc = "Windows starting at or after this time.")] from: DateTime<Utc>,
        #[graphql(desc = "Windows starting before this time.")] to: DateTime<Utc>,
        #[graphql(desc = "What the groups are made by (one group of everything when empty).")]
        group_by: Option<Vec<UsageGroupBy>>,
    ) -> GqlResult<UsageReport> {
        let tenant = listing_tenant(ctx, tenant_id)?;
        let group_by = group_by
            .unwrap_or_default()
            .into_iter()
            .map(GroupBy::from)
            .collect();
        let q = ReportQuery::new(tenant, from, to, group_by)?;
        let meter = usage::meter(db(ctx)?).await?;
        Ok(UsageReport { q, meter })
    }
}
