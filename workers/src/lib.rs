//! The background side of Better Compute, run by the `compute-worker` binary and in-process by
//! `compute-api dev`.
//!
//! - [`queue::QueueWorker`]: the sharded work-queue loop. Each process holds a fair share of the
//!   shard leases `shard:<kind>:<n>` and runs the reconcilers of the keys enqueued in them:
//!   `reservation` (start, expire, retry one reservation) and `pool_capacity` (keep one pool's
//!   rollup true).
//! - [`usage::UsageMeter`]: under `singleton:usage`, closes usage windows for billing and
//!   checks reservation changes against them (`docs/usage.md`).
//! - [`Reconciler`]: under `singleton:reservations`, the resync: every pass looks for any
//!   reservation whose time has come however it was missed (a lost queue row only costs time),
//!   every 5 minutes it enqueues every pool for its rollup check, every node with a waiting
//!   command for dispatch and every instance with a step to take for its workflow, and hourly
//!   it prunes idempotency keys, the outbox, the authorization feed (`authz_changes`, a day) and
//!   the leases no process will take again (presences, gateways, deleted sinks' deliveries).
//! - Command dispatch (`--role dispatch`): a second [`queue::QueueWorker`] over the
//!   `node_commands` shards, sharing them among the dispatch processes
//!   (`compute_domain::node_commands::dispatch_node`, `docs/commands.md`).
//! - [`dispatch::Dispatcher`]: webhook delivery, one task per sink under
//!   `singleton:outbox-dispatch:<sink id>`.
//! - [`compute_domain::leases::HeldLease`]: leases renewed in the background, whose loss cancels the work bound
//!   to them at once.
//!
//! Every step is level-triggered and safe to run twice (guarded updates of the state table's
//! transitions; fenced transactions for what a lease owns).
//!
//! Architecture invariant: no GraphQL here, and no SQL text: statements live in
//! `compute-domain`.

pub mod cli;
pub mod dispatch;
pub mod egress;
pub mod gauges;
pub mod http;
pub mod queue;
pub mod usage;
pub mod wake;

use std::future::Future;
use std::time::Duration;

use compute_domain::db::Db;
use compute_domain::leases::RENEW_EVERY;
use compute_domain::reservations::reconcile;
use compute_domain::{Result, idempotency};
use tracing::{info, warn};

/// The roles a worker process can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Reconcilers: reservations, capacity rollups, pruning.
    Reconcile,
    /// Webhook delivery from the outbox.
    Outbox,
    /// Commands to node daemons: the `node_commands` work-queue shards.
    Dispatch,
    /// Every role.
    All,
}

impl Role {
    /// Parses `reconcile`, `outbox`, `dispatch` or `all`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "reconcile" => Some(Role::Reconcile),
            "outbox" => Some(Role::Outbox),
            "dispatch" => Some(Role::Dispatch),
            "all" => Some(Role::All),
            _ => None,
        }
    }
}

/// Outbox events older than this are pruned even if a sink has not received them (the sink is
/// then marked `behind`).
pub const HARD_MAX_AGE: Duration = Duration::from_secs(30 * 24 * 3600);

/// How often the resync enqueues every pool for its rollup check, every node with a waiting
/// command for dispatch and every unsettled instance for its workflow, whatever was enqueued.
pub const ROLLUP_RESYNC_EVERY: Duration = compute_domain::work_queue::RESYNC_EVERY;

/// How long a dispatcher's claim keeps other claimers off a node's `node_commands` row.
pub const DISPATCH_CLAIM: Duration = Duration::from_secs(10);

/// The lease the reservation reconciler runs under.
pub const RESERVATIONS_LEASE: &str = compute_domain::leases::name::RESERVATIONS;

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pass {
    /// Whether this process held the lease (and so did the work).
    pub held: bool,
    pub placed: u64,
    pub started: u64,
    pub expired: u64,
    pub failed: u64,
    /// Reservations found idle (marked, or released where their rules say so).
    pub idle: u64,
    /// Event sinks of expired service accounts paused.
    pub sinks_paused: u64,
    /// The liveness reconciler's part of the pass (nodes disconnected, unreachable, lost).
    pub liveness: compute_domain::node_sessions::LivenessPass,
}

/// The reservation reconciler of one process.
#[derive(Debug, Clone)]
pub struct Reconciler {
    lease: compute_domain::leases::PassLease,
    last_rollup_resync: Option<tokio::time::Instant>,
}

impl Reconciler {
    /// A reconciler for this process; `owner` names it in the lease (host and pid, say).
    pub fn new(db: Db, owner: impl Into<String>) -> Self {
        Reconciler {
            lease: compute_domain::leases::PassLease::new(db, RESERVATIONS_LEASE, owner),
            last_rollup_resync: None,
        }
    }

    /// Acquires or renews the lease; returns whether this process holds it.
    pub async fn keep_lease(&mut self) -> Result<bool> {
        Ok(self.lease.keep().await?.is_some())
    }

    /// One pass: if this process holds the lease, retry pending reservations, start and expire
    /// them, fail those on lost nodes.
    pub async fn pass(&mut self) -> Result<Pass> {
        // Every transaction of the pass checks the lease first (`Db::fenced`): a reconciler
        // whose lease was taken mid-pass writes nothing more.
        let Some(fence) = self.lease.keep().await? else {
            return Ok(Pass::default());
        };
        let db = self.lease.db().fenced(&fence);
        if self
            .last_rollup_resync
            .is_none_or(|t| t.elapsed() >= ROLLUP_RESYNC_EVERY)
        {
            let pools = compute_domain::work_queue::enqueue_all_pools(&db).await?;
            let nodes = compute_domain::node_commands::enqueue_waiting(&db).await?;
            let instances = compute_domain::instances::enqueue_unsettled(&db).await?;
            self.last_rollup_resync = Some(tokio::time::Instant::now());
            tracing::debug!(
                pools,
                nodes,
                instances,
                "resync: every pool enqueued for its rollup check, every node with a waiting \
                 command for dispatch, every instance with a step to take for its workflow"
            );
        }
        // Liveness first: a node that becomes lost fails its reservations in the same pass.
        let liveness = compute_domain::node_sessions::liveness_pass(&db).await?;
        if let Some(gap) = liveness.outage_seconds {
            warn!(
                gap_seconds = gap,
                "no liveness pass ran for {gap:.0} s (a database or controller outage): \
                 disconnected nodes get the 5-minute grace"
            );
        }
        if liveness.disconnected + liveness.unreachable + liveness.lost > 0 {
            info!(
                nodes.disconnected = liveness.disconnected,
                nodes.unreachable = liveness.unreachable,
                nodes.lost = liveness.lost,
                "liveness pass"
            );
        }
        Ok(Pass {
            held: true,
            liveness,
            expired: reconcile::expire_due(&db).await?,
            failed: reconcile::fail_lost(&db).await? + reconcile::fail_overlapped(&db).await?,
            placed: reconcile::retry_pending(&db).await?,
            started: reconcile::activate_due(&db).await?,
            idle: reconcile::mark_idle(&db).await?,
            sinks_paused: compute_domain::authz::pause_sinks_of_expired_accounts(&db).await?,
        })
    }

    /// Gives the lease up (on shutdown).
    pub async fn release(&mut self) {
        self.lease.release().await;
    }

    /// Runs passes every `every` until `stop` resolves; prunes idempotency keys, outbox events
    /// past their retention, the authorization feed and the leases no process will take again
    /// ([`compute_domain::leases::prune`]) at its first pass that holds the lease and hourly after
    /// (never events an active sink or the usage meter still needs, unless they are past
    /// [`HARD_MAX_AGE`]). A pass
    /// that fails is logged and the loop goes on; a lost lease stops the work at the next pass.
    pub async fn run(mut self, every: Duration, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut ticker = tokio::time::interval(every.min(RENEW_EVERY));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first pass that holds the lease prunes, then hourly: a process restarted more
        // often than hourly (a deploy, a crash loop) still prunes.
        let mut last_prune: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                () = &mut stop => {
                    self.release().await;
                    info!("reconciler stopped");
                    return;
                }
                _ = ticker.tick() => {
                    // The pass itself is cancelled if `stop` comes first.
                    let pass = tokio::select! {
                        () = &mut stop => { self.release().await; return; }
                        pass = self.pass() => pass,
                    };
                    match pass {
                        Ok(p) if p.placed + p.started + p.expired + p.failed + p.idle + p.sinks_paused > 0 => info!(
                            reservations.placed = p.placed,
                            reservations.started = p.started,
                            reservations.expired = p.expired,
                            reservations.failed = p.failed,
                            reservations.idle = p.idle,
                            event_sinks.paused = p.sinks_paused,
                            "reconciler pass"
                        ),
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "reconciler pass failed"),
                    }
                    if self.lease.is_held()
                        && last_prune.is_none_or(|t| t.elapsed() > Duration::from_secs(3600))
                    {
                        last_prune = Some(tokio::time::Instant::now());
                        let db = self.lease.db();
                        match idempotency::prune(db, idempotency::RETENTION_HOURS).await {
                            Ok(n) => info!(idempotency.pruned = n, "idempotency keys pruned"),
                            Err(e) => warn!(error = %e, "pruning idempotency keys failed"),
                        }
                        match compute_domain::sinks::prune_outbox(db, compute_domain::outbox::RETENTION, HARD_MAX_AGE).await {
                            Ok(n) => info!(outbox.pruned = n, "outbox events past the retention window pruned"),
                            Err(e) => warn!(error = %e, "pruning the outbox failed"),
                        }
                        match compute_domain::authz::prune(db).await {
                            Ok(n) => info!(authz_changes.pruned = n, "authorization changes past a day pruned"),
                            Err(e) => warn!(error = %e, "pruning the authorization feed failed"),
                        }
                        match compute_domain::leases::prune(db, compute_domain::leases::PRUNE_AFTER).await {
                            Ok(n) => info!(leases.pruned = n, "leases no process will take again pruned"),
                            Err(e) => warn!(error = %e, "pruning leases failed"),
                        }
                    }
                }
            }
        }
    }
}

/// What a worker process runs, and how.
#[derive(Debug, Clone)]
pub struct Options {
    pub role: Role,
    /// The work-queue kinds to run ([`queue::KINDS`] normally).
    pub kinds: Vec<compute_domain::work_queue::WorkKind>,
    /// Names this process in every lease it takes.
    pub owner: String,
    /// How often the resync runs.
    pub resync_every: Duration,
    /// How long the queue loop idles when nothing is due.
    pub queue_idle: Duration,
    /// Where the worker's metrics are declared (the process's one registry), if anywhere.
    pub metrics: Option<compute_domain::metrics::Registry>,
    /// Whether webhooks may target private, loopback and link-local addresses ([`egress`]).
    pub webhooks_allow_private: bool,
    /// How often the usage meter looks for due windows.
    pub usage_every: Duration,
    /// The usage window length to set at start-up (the meter keeps its own otherwise).
    pub usage_window_seconds: Option<i32>,
    /// Business time, anchored to `compute_now()`: sampled again at every lease renewal
    /// ([`RENEW_EVERY`]), which logs `ClockSkew` past a second; `/healthz` reports its last
    /// reading (`clock.skew`).
    pub clock: Option<compute_domain::clock::Clock>,
    /// Whether to hold a `LISTEN` connection for the writers' pokes ([`wake`]); off behind a
    /// transaction pooler (`--db-pooled`), where `LISTEN` hears nothing: the loops then poll.
    pub listen_pokes: bool,
}

/// The counters of one worker process, for its `/metrics`.
#[derive(Clone)]
pub struct Stats {
    pub queue: std::sync::Arc<queue::QueueStats>,
    pub dispatch: std::sync::Arc<dispatch::DispatchStats>,
    pub usage: std::sync::Arc<usage::UsageStats>,
}

impl Stats {
    /// Declares the worker's metrics in `registry`, read from its counters at each scrape.
    pub fn register(&self, registry: &compute_domain::metrics::Registry) {
        use compute_domain::metrics::Sampled;
        use std::sync::atomic::Ordering::Relaxed;
        let q = self.queue.clone();
        registry.sample(
            "compute_work_items",
            "Work-queue items run, by outcome.",
            Sampled::Counter,
            Some("outcome"),
            move || {
                vec![
                    ("done", q.succeeded.load(Relaxed) as f64),
                    ("rescheduled", q.rescheduled.load(Relaxed) as f64),
                    ("failed", q.failed.load(Relaxed) as f64),
                ]
            },
        );
        let q = self.queue.clone();
        registry.sample(
            "compute_lease_losses",
            "Shard leases this process lost while holding them.",
            Sampled::Counter,
            None,
            move || vec![("", q.lease_losses.load(Relaxed) as f64)],
        );
        let d = self.dispatch.clone();
        registry.sample(
            "compute_webhook_deliveries",
            "Webhook POSTs answered 2xx.",
            Sampled::Counter,
            None,
            move || vec![("", d.delivered.load(Relaxed) as f64)],
        );
        let u = self.usage.clone();
        registry.sample(
            "compute_usage_windows_closed",
            "Usage windows this process closed (docs/usage.md).",
            Sampled::Counter,
            None,
            move || vec![("", u.windows_closed.load(Relaxed) as f64)],
        );
        let u = self.usage.clone();
        registry.sample(
            "compute_usage_records",
            "Usage records this process wrote, by how: closing a window, or checking a change against closed windows (adjustments).",
            Sampled::Counter,
            Some("by"),
            move || {
                vec![
                    ("window", u.records.load(Relaxed) as f64),
                    ("check", u.checked.load(Relaxed) as f64),
                ]
            },
        );
        let u = self.usage.clone();
        registry.sample(
            "compute_usage_lag_seconds",
            "Seconds from the end of the last closed usage window to now, at this process's last meter pass (-1 before one): above an hour plus a minute, billing is behind.",
            Sampled::Gauge,
            None,
            move || vec![("", u.lag_seconds.load(Relaxed) as f64)],
        );
        let d = self.dispatch.clone();
        registry.sample(
            "compute_webhook_failures",
            "Webhook POSTs that failed (the sink then backs off).",
            Sampled::Counter,
            None,
            move || vec![("", d.failed.load(Relaxed) as f64)],
        );
        let d = self.dispatch.clone();
        registry.sample(
            "compute_webhook_held_back_looks",
            "Looks at a sink's events that found them held back behind a transaction still running (looked at again within milliseconds); a steady rise means a long transaction in the cluster delays every outbox reader.",
            Sampled::Counter,
            None,
            move || vec![("", d.held_back.load(Relaxed) as f64)],
        );
    }
}

/// Runs the roles of `options` until `stop` resolves, then lets every lease go.
pub async fn run(db: Db, options: Options, stop: impl Future<Output = ()> + Send + 'static) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let reconcile = matches!(options.role, Role::Reconcile | Role::All);
    let outbox = matches!(options.role, Role::Outbox | Role::All);
    let commands = matches!(options.role, Role::Dispatch | Role::All);
    // One LISTEN connection for the writers' pokes, which end the loops' idle waits early.
    let waker = wake::Waker::default();
    let queue =
        queue::QueueWorker::new(db.clone(), options.owner.clone(), &options.kinds).woken_by(&waker);
    let dispatcher = dispatch::Dispatcher::new(db.clone(), options.owner.clone())
        .allowing_private_targets(options.webhooks_allow_private)
        .woken_by(&waker);
    let meter = usage::UsageMeter::new(db.clone(), options.owner.clone());
    if let Some(registry) = &options.metrics {
        Stats {
            queue: queue.stats(),
            dispatch: dispatcher.stats(),
            usage: meter.stats(),
        }
        .register(registry);
    }
    let mut tasks = Vec::new();
    if reconcile {
        tasks.push(tokio::spawn(
            queue.run(options.queue_idle, stopped(stop_rx.clone())),
        ));
        tasks.push(tokio::spawn(
            Reconciler::new(db.clone(), options.owner.clone())
                .run(options.resync_every, stopped(stop_rx.clone())),
        ));
        if let Some(seconds) = options.usage_window_seconds {
            match compute_domain::usage::set_window(&db, seconds).await {
                Ok(true) => info!(
                    usage.window_seconds = seconds,
                    "usage windows opened from now on last {seconds} s"
                ),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "the usage window length was not changed"),
            }
        }
        tasks.push(tokio::spawn(
            meter.run(options.usage_every, stopped(stop_rx.clone())),
        ));
        if let Some(registry) = &options.metrics {
            let gauges = gauges::FleetGauges::default();
            gauges.register(registry);
            tasks.push(tokio::spawn(
                gauges.run(db.clone(), stopped(stop_rx.clone())),
            ));
        }
    }
    if outbox {
        tasks.push(tokio::spawn(dispatcher.run(stopped(stop_rx.clone()))));
    }
    if commands {
        let mut commands =
            queue::QueueWorker::new(db.clone(), options.owner.clone(), &queue::DISPATCH_KINDS)
                .in_family("dispatch")
                .woken_by(&waker);
        // A dispatch takes milliseconds: a run cut short (a lost lease) holds its nodes back
        // for 10 s, not the reconcilers' 60 s.
        commands.claim_for = DISPATCH_CLAIM;
        tasks.push(tokio::spawn(
            commands.run(options.queue_idle, stopped(stop_rx.clone())),
        ));
    }
    if let Some(clock) = options.clock.clone() {
        let db = db.clone();
        let stop = stopped(stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            tokio::pin!(stop);
            let mut ticker = tokio::time::interval(RENEW_EVERY);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = &mut stop => return,
                    _ = ticker.tick() => {
                        // `sample` logs `ClockSkew` itself past a second.
                        if let Err(e) = clock.sample(&db).await {
                            warn!(error = %e, "sampling compute_now() failed");
                        }
                    }
                }
            }
        }));
    }
    if options.listen_pokes {
        tasks.push(tokio::spawn(
            waker.clone().listen(db.clone(), stopped(stop_rx.clone())),
        ));
    }
    info!(role = ?options.role, owner = %options.owner, "worker running");
    stop.await;
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
}
