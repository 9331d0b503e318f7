//! The sharded work-queue loop: each worker process holds the leases of a fair share of the
//! shards of each kind, claims due rows of those shards, runs the kind's reconciler for each key,
//! and finishes the rows, every database step in a transaction fenced by the shard's lease.
//!
//! Fair share: every worker holds a presence lease `singleton:worker:<owner>`; with `w` live
//! workers, each takes up to `ceil(SHARDS / w)` shards of a kind and gives back any above that,
//! so shards spread when a worker joins and move when one dies (its leases expire after their
//! TTL). A run cut short by a lost lease is dropped at once; its rows stay claimed until
//! `claim_for` passes and the shard's next holder runs them (reconcilers are level-triggered, so
//! running a key twice is harmless).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use compute_domain::db::{Db, TxKind};
use compute_domain::ids::{PoolId, ReservationId};
use compute_domain::work_queue::{self, Item, SHARDS, WorkKind};
use compute_domain::{Error, Result};
use futures_util::StreamExt;
use tracing::{Instrument, debug, info, warn};

use compute_domain::leases::{Bound, HeldLease};

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct QueueStats {
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub rescheduled: AtomicU64,
    pub lease_losses: AtomicU64,
    /// Times the loop found nothing due and began an idle wait.
    pub idle_waits: AtomicU64,
}

/// The kinds a reconcile worker runs.
pub const KINDS: [WorkKind; 3] = [
    WorkKind::Reservation,
    WorkKind::PoolCapacity,
    WorkKind::Instance,
];

/// How many reservation reconciles of one claimed batch run at once.
pub const ITEMS_AT_ONCE: usize = 8;

/// The kinds a dispatch worker runs (`compute-worker --role dispatch`).
pub const DISPATCH_KINDS: [WorkKind; 1] = [WorkKind::NodeCommands];

/// Every kind a worker can run (`noop` only for the benchmark).
pub const ALL_KINDS: &[WorkKind] = WorkKind::ALL;

/// One worker process's share of the queue.
pub struct QueueWorker {
    db: Db,
    owner: String,
    kinds: Vec<WorkKind>,
    /// The family whose live members share the shards (`worker`, `dispatch`): each process
    /// takes a fair share among the processes of its family only.
    family: &'static str,
    presence: Option<HeldLease>,
    shards: BTreeMap<(WorkKind, i32), HeldLease>,
    /// How many due rows one claim takes.
    pub batch: i64,
    /// How long a claim keeps other claimers off a row.
    pub claim_for: Duration,
    stats: Arc<QueueStats>,
    /// Pokes that end an idle wait early ([`crate::wake`]); without, the loop only polls.
    woken: Option<Arc<tokio::sync::Notify>>,
}

/// The presence lease of `owner` among the processes of `family` (`worker` for the queue,
/// `dispatcher` for webhooks): `singleton:<family>:<owner>`.
pub fn presence_lease(family: &str, owner: &str) -> String {
    compute_domain::leases::name::presence(family, owner)
}

/// Runs the reconciler of `kind` for `key`; returns when the key is due again, if ever.
#[tracing::instrument(level = "debug", skip(db), fields(kind = %kind))]
pub async fn run_item(
    db: &Db,
    kind: WorkKind,
    key: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>> {
    // A key this kind cannot name is a bug of the enqueuer: it fails, and stays for operators.
    let bad_key = || {
        Error::internal(format!(
            "work of kind `{kind}` has a key that is not its subject's id: `{key}`"
        ))
    };
    match kind {
        WorkKind::Reservation => {
            let id = ReservationId::from_trusted(key).ok_or_else(bad_key)?;
            let (step, next) =
                compute_domain::reservations::reconcile::reconcile_one(db, &id).await?;
            if step != compute_domain::reservations::reconcile::Step::Nothing {
                debug!(reservation = key, ?step, "reservation reconciled");
            }
            Ok(next)
        }
        WorkKind::PoolCapacity => {
            let id = PoolId::from_trusted(key).ok_or_else(bad_key)?;
            let fixed = compute_domain::fleet::changes::recompute_rollup(db, &id).await?;
            if fixed > 0 {
                warn!(
                    pool = key,
                    rows = fixed,
                    "pool capacity rollup had drifted from the atoms; corrected"
                );
            }
            Ok(None)
        }
        WorkKind::NodeCommands => {
            let id = compute_domain::ids::NodeId::from_trusted(key).ok_or_else(bad_key)?;
            let done = compute_domain::node_commands::dispatch_node(db, &id).await?;
            if !done.commands.is_empty() || done.abandoned > 0 {
                debug!(
                    node = key,
                    dispatched = done.commands.len(),
                    abandoned = done.abandoned,
                    "node commands dispatched"
                );
            }
            // A full batch: the rest at once (due since the epoch, whatever the clock says).
            Ok(done.more.then_some(chrono::DateTime::UNIX_EPOCH))
        }
        WorkKind::Instance => {
            let id = compute_domain::ids::InstanceId::from_trusted(key).ok_or_else(bad_key)?;
            let step = compute_domain::instances::reconcile(db, &id).await?;
            if !step.moved.is_empty() {
                info!(instance = key, moved = ?step.moved, "instance workflow stepped");
            }
            Ok(step.next)
        }
        WorkKind::Noop => Ok(None),
    }
}

impl QueueWorker {
    pub fn new(db: Db, owner: impl Into<String>, kinds: &[WorkKind]) -> Self {
        QueueWorker {
            db,
            owner: owner.into(),
            kinds: kinds.to_vec(),
            family: "worker",
            presence: None,
            shards: BTreeMap::new(),
            batch: 100,
            claim_for: Duration::from_secs(60),
            stats: Arc::default(),
            woken: None,
        }
    }

    /// This worker sharing its shards among the processes of `family` (`dispatch` for the
    /// command dispatchers) instead of `worker`.
    pub fn in_family(mut self, family: &'static str) -> Self {
        self.family = family;
        self
    }

    /// This worker's idle waits ended early by `waker`'s pokes.
    pub fn woken_by(mut self, waker: &crate::wake::Waker) -> Self {
        self.woken = Some(waker.subscribe());
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<QueueStats> {
        self.stats.clone()
    }

    /// The shards held now, as `(kind, n)`.
    pub fn held(&self) -> Vec<(WorkKind, i32)> {
        self.shards.keys().copied().collect()
    }

    /// Keeps the presence lease, drops lost shards, and takes or gives back shards to hold a
    /// fair share of each kind.
    pub async fn rebalance(&mut self) -> Result<()> {
        let present = match &self.presence {
            Some(p) => p.refresh(&self.db).await?,
            None => false,
        };
        if !present {
            self.presence = HeldLease::acquire(
                &self.db,
                &presence_lease(self.family, &self.owner),
                &self.owner,
            )
            .await?;
        }
        let mut lost = Vec::new();
        for (k, lease) in &self.shards {
            if !lease.refresh(&self.db).await? {
                lost.push(*k);
            }
        }
        for k in lost {
            self.shards.remove(&k);
            self.stats.lease_losses.fetch_add(1, Ordering::Relaxed);
        }
        let live = compute_domain::leases::count_live(
            &self.db,
            &compute_domain::leases::name::presence_prefix(self.family),
        )
        .await?;
        let live = live.max(1) as i32;
        let share = (SHARDS + live - 1) / live;
        // Start looking at a place that depends on the owner, so workers do not all race for
        // shard 0 first.
        let offset =
            self.owner
                .bytes()
                .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) as i32;
        for kind in self.kinds.clone() {
            let mine: Vec<i32> = self
                .shards
                .keys()
                .filter(|(k, _)| *k == kind)
                .map(|(_, n)| *n)
                .collect();
            if mine.len() as i32 > share {
                for n in mine.iter().rev().take(mine.len() - share as usize) {
                    if let Some(lease) = self.shards.remove(&(kind, *n)) {
                        info!(
                            lease.name = lease.name(),
                            share, live, "giving a shard back to spread the work"
                        );
                        lease.release(&self.db).await;
                    }
                }
                continue;
            }
            let mut held = mine.len() as i32;
            for i in 0..SHARDS {
                if held >= share {
                    break;
                }
                let n = (offset.rem_euclid(SHARDS) + i) % SHARDS;
                if self.shards.contains_key(&(kind, n)) {
                    continue;
                }
                let name = compute_domain::leases::name::shard(kind.as_str(), n);
                if let Some(lease) = HeldLease::acquire(&self.db, &name, &self.owner).await? {
                    self.shards.insert((kind, n), lease);
                    held += 1;
                }
            }
        }
        Ok(())
    }

    /// One pass over the held shards: claims a batch of due rows of each, runs them, and
    /// finishes them. Returns how many rows it ran.
    pub async fn step(&mut self) -> Result<usize> {
        let mut ran = 0;
        let held: Vec<_> = self.shards.keys().copied().collect();
        // Only the shards with something due (one read), not a fenced claim in each.
        let keys = match work_queue::due_shards(&self.db, &held).await {
            Ok(due) => due,
            Err(e) => {
                warn!(error = %e, "work queue: reading the due shards failed; claiming in every held shard");
                held
            }
        };
        for key in keys {
            let Some(lease) = self.shards.get(&key) else {
                continue;
            };
            match run_shard(
                &self.db,
                lease,
                key,
                self.batch,
                self.claim_for,
                &self.stats,
            )
            .await
            {
                Ok(n) => ran += n,
                Err(Error::LeaseLost(why)) => {
                    warn!(shard = %lease.name(), %why, "shard lease lost during a run; its rows wait for the next holder");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(ran)
    }

    /// Gives every lease back (on shutdown).
    pub async fn release_all(&mut self) {
        for (_, lease) in std::mem::take(&mut self.shards) {
            lease.release(&self.db).await;
        }
        if let Some(p) = self.presence.take() {
            p.release(&self.db).await;
        }
    }

    /// Rebalances every renewal period and steps until `stop` resolves; idles `idle` when
    /// nothing is due.
    pub async fn run(mut self, idle: Duration, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut last_rebalance: Option<tokio::time::Instant> = None;
        loop {
            if last_rebalance.is_none_or(|t| t.elapsed() >= compute_domain::leases::RENEW_EVERY) {
                last_rebalance = Some(tokio::time::Instant::now());
                if let Err(e) = self.rebalance().await {
                    warn!(error = %e, "work queue: rebalancing shards failed");
                }
            }
            let ran = tokio::select! {
                () = &mut stop => break,
                r = self.step() => r,
            };
            let wait = match ran {
                Ok(0) => {
                    self.stats.idle_waits.fetch_add(1, Ordering::Relaxed);
                    idle
                }
                Ok(_) => Duration::ZERO,
                Err(e) => {
                    warn!(error = %e, "work queue pass failed");
                    idle.max(Duration::from_secs(1))
                }
            };
            if !wait.is_zero() {
                tokio::select! {
                    () = &mut stop => break,
                    () = crate::wake::idle(wait, self.woken.as_deref()) => {}
                }
            }
        }
        self.release_all().await;
        info!("work queue stopped");
    }
}

/// The span of one item's run: a consumer of the work queue, the child of the transaction that
/// enqueued it when that one was traced (its `traceparent`), so a request's trace goes on into
/// its reconcile. An item without one is not traced on its own (`compute_telemetry`'s sampler).
fn item_span(item: &Item) -> tracing::Span {
    let span = tracing::info_span!(
        "reconcile",
        otel.name = %format_args!(
            "{} {}",
            if item.kind == WorkKind::NodeCommands { "dispatch" } else { "reconcile" },
            item.kind
        ),
        otel.kind = "consumer",
        work.kind = %item.kind,
        work.key = %item.key,
        work.attempt = item.attempts + 1,
    );
    if let Some(parent) = item
        .traceparent
        .as_deref()
        .and_then(compute_telemetry::TraceParent::parse)
    {
        compute_telemetry::context::continue_from(&span, &parent);
    }
    span
}

/// The span of a batch expiry, which serves several traces at once: the child of the first
/// traced item's, linked to every other's (docs/operations.md, "Traces").
fn batch_span(items: &[Item]) -> tracing::Span {
    let span = tracing::info_span!(
        "expire reservations",
        otel.kind = "consumer",
        work.kind = "reservation",
        work.items = items.len(),
    );
    let mut traced = items
        .iter()
        .filter_map(|i| i.traceparent.as_deref())
        .filter_map(compute_telemetry::TraceParent::parse);
    if let Some(first) = traced.next() {
        compute_telemetry::context::continue_from(&span, &first);
        for other in traced {
            compute_telemetry::context::link(&span, &other);
        }
    }
    span
}

/// Claims, runs and finishes one batch of one shard under its lease.
#[tracing::instrument(level = "debug", skip_all, fields(kind = %kind, shard, lease = %lease.fence().name, epoch = lease.fence().epoch))]
async fn run_shard(
    db: &Db,
    lease: &HeldLease,
    (kind, shard): (WorkKind, i32),
    batch: i64,
    claim_for: Duration,
    stats: &QueueStats,
) -> Result<usize> {
    let items: Vec<Item> = db
        .fenced_tx("claim_work", lease.fence(), TxKind::Maintenance, |conn| {
            Box::pin(async move { work_queue::claim(conn, kind, &[shard], batch, claim_for).await })
        })
        .await?;
    if items.is_empty() {
        return Ok(0);
    }
    debug!(kind = %kind, shard, items = ?items.iter().map(|i| (&i.key, i.generation)).collect::<Vec<_>>(), "work claimed");
    let mut outcomes = Vec::with_capacity(items.len());
    // Every transaction of the items checks the lease first: a shard lost mid-item writes
    // nothing more, even before `bound` notices.
    let fenced = db.fenced(lease.fence());
    // The batch's reservations due to expire go in one transaction (issue 36, goal 4): their
    // reconcile is done (expired is terminal, nothing is due again). The others, and all of
    // them if the batch call fails, are reconciled one by one below.
    let expired: std::collections::HashSet<String> = if kind == WorkKind::Reservation {
        let ids: Vec<ReservationId> = items
            .iter()
            .filter_map(|i| ReservationId::from_trusted(&i.key))
            .collect();
        match lease
            .bound(compute_domain::reservations::reconcile::expire_batch(
                &fenced, &ids,
            ))
            .instrument(batch_span(&items))
            .await
        {
            Bound::Done(Ok(done)) => done.iter().map(|id| id.as_str().to_owned()).collect(),
            Bound::Done(Err(e)) if matches!(e, Error::LeaseLost(_)) => return Err(e),
            Bound::Done(Err(e)) => {
                warn!(error = %e, "expiring a batch failed; its reservations are reconciled one by one");
                Default::default()
            }
            Bound::LeaseLost => {
                stats.lease_losses.fetch_add(1, Ordering::Relaxed);
                return Err(Error::LeaseLost(format!("{} lost mid-batch", lease.name())));
            }
        }
    } else {
        Default::default()
    };
    // A batch's keys are distinct subjects, so its items run a few at a time, as items of
    // several worker processes do: each is its own transactions, taking its locks in the one
    // lock order (docs/database-locks.md). Their round trips to the database overlap.
    type ItemRun<'a> = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Bound<Result<Option<chrono::DateTime<chrono::Utc>>>>>
                + Send
                + 'a,
        >,
    >;
    let runs: Vec<ItemRun<'_>> = items
        .iter()
        .map(|item| {
            if expired.contains(&item.key) {
                Box::pin(std::future::ready(Bound::Done(Ok(None)))) as ItemRun<'_>
            } else {
                let span = item_span(item);
                Box::pin(
                    lease
                        .bound(run_item(&fenced, kind, &item.key))
                        .instrument(span),
                ) as ItemRun<'_>
            }
        })
        .collect();
    // Reservation reconciles and node command dispatches overlap (each item is its own
    // reservation or node). Dispatches overlapping once showed a command's `command.dispatched`
    // ordered before its `command.created`: a dispatch that took its xid at its fence and then
    // dispatched a command committed a moment later wrote its event under the smaller xid.
    // Migration 0028 keys each event at least at the latest event of its subject, so a
    // subject's events follow causality (docs/consistency.md, "The outbox").
    let at_once = if kind == WorkKind::Reservation || kind == WorkKind::NodeCommands {
        ITEMS_AT_ONCE
    } else {
        1
    };
    let mut running = futures_util::stream::iter(runs).buffered(at_once);
    while let Some(bound) = running.next().await {
        match bound {
            Bound::Done(r) => outcomes.push(r.map_err(|e| e.to_string())),
            Bound::LeaseLost => {
                stats.lease_losses.fetch_add(1, Ordering::Relaxed);
                return Err(Error::LeaseLost(format!("{} lost mid-batch", lease.name())));
            }
        }
    }
    drop(running);
    let n = items.len();
    // Finished in key order, the order every multi-key enqueue takes the same rows in.
    let mut done: Vec<(Item, std::result::Result<_, String>)> = items
        .iter()
        .cloned()
        .zip(outcomes.iter().cloned())
        .collect();
    done.sort_by(|a, b| a.0.key.cmp(&b.0.key));
    db.fenced_tx("finish_work", lease.fence(), TxKind::Maintenance, |conn| {
        let done = done.clone();
        Box::pin(async move {
            for (item, outcome) in done.iter().map(|(i, o)| (i, o.clone())) {
                match outcome {
                    Ok(next) => {
                        work_queue::finish(conn, item, next).await?;
                    }
                    Err(why) => work_queue::fail(conn, item, &why).await?,
                }
            }
            Ok(())
        })
    })
    .await?;
    debug!(kind = %kind, shard, items = n, "work finished");
    for outcome in &outcomes {
        match outcome {
            Ok(Some(_)) => stats.rescheduled.fetch_add(1, Ordering::Relaxed),
            Ok(None) => stats.succeeded.fetch_add(1, Ordering::Relaxed),
            Err(why) => {
                warn!(kind = %kind, why = %why, "work item failed; retried after its backoff");
                stats.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
    Ok(n)
}
