//! Webhook delivery: every active sink is delivered by the worker holding its lease
//! `singleton:outbox-dispatch:<sink id>`, in order, at least once.
//!
//! A sink's task reads up to [`BATCH`] events after the sink's saved cursor, POSTs them one by
//! one, then saves the cursor of the last one delivered in a transaction fenced by the lease. A
//! crash between a POST and the save re-sends at most that batch (receivers deduplicate by the
//! `Compute-Event-Id` header). A failed POST stops the batch there: the cursor saved covers only
//! what was delivered, the failure is recorded and the sink backs off (2, 4 … 300 s) without
//! holding up any other sink. A lost lease stops the task at once.
//!
//! Each request: `POST <url>` with the event as JSON (`id`, `type`, `tenantId`, `subject`,
//! `time`, `data`), and the headers `Compute-Event-Id`, `Compute-Event-Type`,
//! `Idempotency-Key` (what a receiver deduplicates on: a usage record's key
//! `cmp:<allocationId>:<windowStart>…` for `usage.*` events, the event id for every other),
//! `Compute-Timestamp` (seconds since the epoch) and `Compute-Signature: v1=<hex>`, the
//! HMAC-SHA256 of `<timestamp>.<body>` under the sink's secret. A 2xx answer is a delivery.
//!
//! A sink with a `batch_size` above 1 gets up to that many events per POST instead, in order:
//! the body `{"deliveries": [{"idempotencyKey", "event"}, …]}`, the headers
//! `Compute-Batch-Size`, `Idempotency-Key: batch:<first event id>:<last event id>`, and the
//! same timestamp and signature. A slow receiver then costs one round trip per batch, not per
//! event (`docs/webhooks.md`).

use compute_domain::ids::SinkId;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use compute_domain::db::{Db, TxKind};
use compute_domain::outbox::{self, Cursor, Event};
use compute_domain::sinks;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::watch;
use tracing::{Instrument, debug, info, warn};

use compute_domain::leases::{Bound, HeldLease};

/// Events read and delivered between two saves of a sink's cursor.
pub const BATCH: i64 = 100;
/// How long one POST may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct DispatchStats {
    pub delivered: AtomicU64,
    pub failed: AtomicU64,
    pub batches: AtomicU64,
    /// Times a caught-up sink began an idle wait.
    pub idle_waits: AtomicU64,
    /// Looks that found events held back behind a running transaction (looked at again soon).
    pub held_back: AtomicU64,
}

/// The signature header's value for `body` sent at `timestamp` with `secret`.
pub fn signature(secret: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        unreachable!("HMAC takes keys of any length")
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("v1={hex}")
}

/// An event as a delivery carries it.
fn event_json(event: &Event) -> serde_json::Value {
    serde_json::json!({
        "id": event.id,
        "type": event.event_type,
        "tenantId": event.tenant_id,
        "subject": event.subject,
        "time": event.time,
        "data": event.data,
    })
}

/// The JSON body of an event's delivery.
pub fn body_of(event: &Event) -> Vec<u8> {
    event_json(event).to_string().into_bytes()
}

/// The JSON body of a batch's delivery: `{"deliveries": [{"idempotencyKey", "event"}, …]}`, in
/// order.
pub fn batch_body_of(events: &[Event]) -> Vec<u8> {
    let deliveries: Vec<serde_json::Value> = events
        .iter()
        .map(
            |e| serde_json::json!({ "idempotencyKey": idempotency_key(e), "event": event_json(e) }),
        )
        .collect();
    serde_json::json!({ "deliveries": deliveries })
        .to_string()
        .into_bytes()
}

/// The `Idempotency-Key` of a batch: the first and last events' ids. A batch sent again after
/// a failure starts at the same event; it may end later, if more events arrived meanwhile.
pub fn batch_key(events: &[Event]) -> String {
    let first = events.first().map(|e| e.id.as_str()).unwrap_or("");
    let last = events.last().map(|e| e.id.as_str()).unwrap_or("");
    format!("batch:{first}:{last}")
}

/// A sink being delivered, and the switch that asks its task to stop after its current batch.
struct SinkTask {
    handle: tokio::task::JoinHandle<()>,
    stop: watch::Sender<bool>,
}

/// The dispatchers of one worker process.
pub struct Dispatcher {
    db: Db,
    owner: String,
    http: Webhooks,
    tasks: HashMap<SinkId, SinkTask>,
    /// Tasks asked to hand their sink over, until they end: such a sink is not taken again
    /// meanwhile (the same owner would renew the lease at the same epoch, a second task would
    /// deliver beside the first's last batch, and the first's release would end the second's
    /// lease).
    handing_over: HashMap<SinkId, SinkTask>,
    presence: Option<HeldLease>,
    stats: Arc<DispatchStats>,
    /// How long a caught-up sink waits before it looks for new events (less when poked).
    pub idle: Duration,
    /// Pokes that end a caught-up sink's wait early ([`crate::wake`]).
    waker: Option<crate::wake::Waker>,
}

/// The webhook client and the egress policy it was built with.
#[derive(Clone)]
struct Webhooks {
    client: reqwest::Client,
    /// Whether sinks may target private, loopback and link-local addresses.
    allow_private: bool,
}

/// The webhook client: the egress policy's resolver, no redirects, no proxy from the
/// environment ([`crate::egress`]).
fn client(allow_private: bool) -> Webhooks {
    let client = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .user_agent(concat!(
            "better-compute-webhooks/",
            env!("CARGO_PKG_VERSION")
        ))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(std::sync::Arc::new(crate::egress::GuardedResolver {
            allow_private,
        }))
        .build()
        .unwrap_or_else(|e| panic!("the webhook client's fixed configuration builds: {e}"));
    Webhooks {
        client,
        allow_private,
    }
}

impl Dispatcher {
    /// A dispatcher that posts only to public addresses.
    pub fn new(db: Db, owner: impl Into<String>) -> Self {
        Dispatcher {
            db,
            owner: owner.into(),
            http: client(false),
            tasks: HashMap::new(),
            handing_over: HashMap::new(),
            presence: None,
            stats: Arc::default(),
            idle: Duration::from_millis(250),
            waker: None,
        }
    }

    /// This dispatcher's sinks woken early by `waker`'s pokes (each sink task subscribes).
    pub fn woken_by(mut self, waker: &crate::wake::Waker) -> Self {
        self.waker = Some(waker.clone());
        self
    }

    /// This dispatcher, allowed (or not) to post to private, loopback and link-local addresses
    /// (`--webhooks-allow-private`: on-premises receivers, and `dev`).
    pub fn allowing_private_targets(mut self, allow: bool) -> Self {
        self.http = client(allow);
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<DispatchStats> {
        self.stats.clone()
    }

    /// How many sinks this process delivers now.
    pub fn sinks_held(&self) -> usize {
        self.tasks
            .values()
            .filter(|t| !t.handle.is_finished())
            .count()
    }

    /// Keeps this process's presence, then takes the leases of due sinks nobody holds, up to a
    /// fair share (`ceil(active sinks / live dispatchers)`), and asks the tasks above it to stop
    /// after their current batch, so sinks spread when a dispatcher joins.
    pub async fn rebalance(&mut self) -> compute_domain::Result<()> {
        self.tasks.retain(|_, t| !t.handle.is_finished());
        self.handing_over.retain(|_, t| !t.handle.is_finished());
        let present = match &self.presence {
            Some(p) => p.refresh(&self.db).await?,
            None => false,
        };
        if !present {
            self.presence = HeldLease::acquire(
                &self.db,
                &crate::queue::presence_lease("dispatcher", &self.owner),
                &self.owner,
            )
            .await?;
        }
        let live = compute_domain::leases::count_live(
            &self.db,
            &compute_domain::leases::name::presence_prefix("dispatcher"),
        )
        .await?
        .max(1) as usize;
        let share = (sinks::count_active(&self.db).await? as usize)
            .div_ceil(live)
            .max(1);
        while self.tasks.len() > share {
            let Some(id) = self.tasks.keys().max().cloned() else {
                break;
            };
            if let Some(task) = self.tasks.remove(&id) {
                info!(sink = %id, share, live, "handing a sink over to spread the work");
                let _ = task.stop.send(true);
                self.handing_over.insert(id, task);
            }
        }
        for id in sinks::due(&self.db).await? {
            if self.tasks.len() >= share {
                break;
            }
            if self.tasks.contains_key(&id) || self.handing_over.contains_key(&id) {
                continue;
            }
            let name = compute_domain::leases::name::outbox_dispatch(id.as_str());
            if let Some(lease) = HeldLease::acquire(&self.db, &name, &self.owner).await? {
                info!(sink = %id, "delivering an event sink");
                let (stop, stopped) = watch::channel(false);
                let handle = tokio::spawn(deliver_sink(
                    self.db.clone(),
                    self.http.clone(),
                    lease,
                    id.clone(),
                    self.stats.clone(),
                    Pace {
                        idle: self.idle,
                        woken: self.waker.as_ref().map(crate::wake::Waker::subscribe),
                    },
                    stopped,
                ));
                self.tasks.insert(id, SinkTask { handle, stop });
            }
        }
        Ok(())
    }

    /// Rebalances every few seconds until `stop` resolves, then stops every sink's task and
    /// lets their leases go.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        loop {
            if let Err(e) = self.rebalance().await {
                warn!(error = %e, "webhook dispatch: looking for sinks failed");
            }
            tokio::select! {
                () = &mut stop => break,
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
        // Each task finishes its batch and lets its lease go, so another process takes over at
        // once; one that takes too long is dropped.
        let handing_over: Vec<SinkTask> = self.handing_over.drain().map(|(_, t)| t).collect();
        for task in self.tasks.drain().map(|(_, t)| t).chain(handing_over) {
            let _ = task.stop.send(true);
            let abort = task.handle.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task.handle)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        if let Some(p) = self.presence.take() {
            p.release(&self.db).await;
        }
        info!("webhook dispatch stopped");
    }
}

/// What one look at a sink's events did.
enum Pass {
    /// Delivered some (a 2xx for each), the cursor saved past them.
    Delivered,
    /// Nothing after the cursor: the sink is caught up.
    CaughtUp,
    /// Nothing readable yet, but events lie after the cursor behind a transaction still
    /// running ([`outbox::held_back`]): look again soon.
    HeldBack,
}

/// The first wait after a look that found events held back; it doubles up to the idle.
const HELD_BACK_WAIT: Duration = Duration::from_millis(20);

/// Why a sink's task ends.
enum Stop {
    Deleted,
    Inactive,
}

/// How a caught-up sink waits: `idle`, or less when poked.
struct Pace {
    idle: Duration,
    woken: Option<Arc<tokio::sync::Notify>>,
}

/// Delivers one sink while its lease holds.
async fn deliver_sink(
    db: Db,
    http: Webhooks,
    lease: HeldLease,
    id: SinkId,
    stats: Arc<DispatchStats>,
    pace: Pace,
    mut stop: watch::Receiver<bool>,
) {
    let Pace { idle, woken } = pace;
    let mut held_wait = HELD_BACK_WAIT;
    loop {
        if *stop.borrow() {
            info!(sink = %id, "sink handed over");
            lease.release(&db).await;
            return;
        }
        let outcome = lease
            .bound(deliver_batch(&db, &http, &lease, &id, &stats))
            .await;
        let wait = match outcome {
            Bound::LeaseLost => {
                warn!(sink = %id, "sink lease lost; another worker resumes from the saved cursor");
                return;
            }
            Bound::Done(Ok(Ok(Pass::CaughtUp))) => {
                held_wait = HELD_BACK_WAIT;
                stats.idle_waits.fetch_add(1, Ordering::Relaxed);
                idle
            }
            Bound::Done(Ok(Ok(Pass::HeldBack))) => {
                stats.held_back.fetch_add(1, Ordering::Relaxed);
                let wait = held_wait.min(idle);
                held_wait = (held_wait * 2).min(idle);
                wait
            }
            Bound::Done(Ok(Ok(Pass::Delivered))) => {
                held_wait = HELD_BACK_WAIT;
                Duration::ZERO
            }
            Bound::Done(Ok(Err(Stop::Deleted))) => {
                info!(sink = %id, "sink deleted; delivery stops");
                lease.release(&db).await;
                return;
            }
            Bound::Done(Ok(Err(Stop::Inactive))) => {
                info!(sink = %id, "sink deactivated or backing off; delivery pauses");
                lease.release(&db).await;
                return;
            }
            Bound::Done(Err(compute_domain::Error::LeaseLost(why))) => {
                warn!(sink = %id, %why, "sink lease lost at the save; another worker resumes from the saved cursor");
                return;
            }
            Bound::Done(Err(e)) => {
                warn!(sink = %id, error = %e, "sink delivery failed");
                Duration::from_secs(1)
            }
        };
        if !wait.is_zero() {
            tokio::select! {
                () = lease.lost() => return,
                _ = stop.changed() => {}
                () = crate::wake::idle(wait, woken.as_deref()) => {}
            }
        }
    }
}

/// A sink's `lastError` when no key of the worker opens its signing secret.
pub const SECRET_UNOPENED: &str = "secret: cannot be opened with the worker's keys";

/// Delivers one batch, or says why it delivered nothing.
#[tracing::instrument(level = "debug", skip_all, fields(sink = %id, lease = %lease.fence().name, epoch = lease.fence().epoch))]
async fn deliver_batch(
    db: &Db,
    http: &Webhooks,
    lease: &HeldLease,
    id: &SinkId,
    stats: &DispatchStats,
) -> compute_domain::Result<Result<Pass, Stop>> {
    let mut conn = db.pool().acquire().await?;
    let Some(sink) = sinks::delivery(&mut conn, id).await? else {
        return Ok(Err(Stop::Deleted));
    };
    drop(conn);
    if !sink.active {
        return Ok(Err(Stop::Inactive));
    }
    if let Some(at) = sink.next_attempt_at
        && at > db.compute_now().await?
    {
        return Ok(Err(Stop::Inactive));
    }
    let (cursor, filter) = (sink.cursor(), sink.filter());
    let events = outbox::read_after(db, cursor, &filter, BATCH).await?;
    if events.is_empty() {
        if outbox::held_back(db, cursor, &filter).await? {
            return Ok(Ok(Pass::HeldBack));
        }
        // Caught up: past events its filter does not take, the cursor moves to the present
        // once a minute at most (sinks::advance_caught_up), so a quiet sink holds no events back.
        if !sink.cursor_quiet {
            return Ok(Ok(Pass::CaughtUp));
        }
        let moved = db
            .fenced_tx(
                "advance_caught_up_sink",
                lease.fence(),
                TxKind::Maintenance,
                |conn| {
                    let (id, filter) = (id.clone(), filter.clone());
                    Box::pin(async move { sinks::advance_caught_up(conn, &id, &filter).await })
                },
            )
            .await?;
        if moved {
            debug!(sink = %id, "a caught-up sink's cursor moved past events it does not take");
        }
        return Ok(Ok(Pass::CaughtUp));
    }
    let secret = match compute_domain::secrets::open(db.keyring(), &sink.secret, sink.id.as_str()) {
        Ok(secret) => secret,
        Err(e) => {
            // No key of this worker opens it (it was sealed under a key not configured here):
            // a failure the sink shows and backs off from, like an endpoint's, where it was
            // retried every second while the sink said HEALTHY.
            warn!(sink = %id, error = %e, "a sink's signing secret cannot be opened with this worker's keys; the sink backs off");
            db.fenced_tx(
                "record_webhook_failure",
                lease.fence(),
                TxKind::Maintenance,
                |conn| {
                    let id = id.clone();
                    Box::pin(async move {
                        sinks::record_failure(conn, &id, SECRET_UNOPENED).await?;
                        Ok(())
                    })
                },
            )
            .await?;
            stats.failed.fetch_add(1, Ordering::Relaxed);
            return Ok(Err(Stop::Inactive));
        }
    };
    stats.batches.fetch_add(1, Ordering::Relaxed);
    let mut last: Option<Cursor> = None;
    let mut delivered = 0i64;
    let mut failure: Option<String> = None;
    // One event per POST, or batches of up to the sink's size, each its own POST in order: a
    // failed one stops the rest, and the cursor saved covers what was answered with a 2xx.
    let size = usize::try_from(sink.batch_size).unwrap_or(1).max(1);
    for (n, chunk) in events.chunks(size).enumerate() {
        // A sink paused (by its tenant, or by the revocation of its creator's role), deleted or
        // moved to another URL while its batch goes out gets none of the rest of it.
        if n > 0 && !matches!(sinks::still_delivering(db, id, &sink.url).await, Ok(true)) {
            debug!(sink = %id, delivered, "the sink was paused, deleted or moved during its batch: the rest waits");
            break;
        }
        let sent = match chunk {
            [event] if size == 1 => post(http, &sink.url, &secret, event).await,
            _ => post_batch(http, &sink.url, &secret, chunk).await,
        };
        match sent {
            Ok(()) => {
                last = chunk.last().and_then(|e| e.cursor);
                delivered += chunk.len() as i64;
            }
            Err(why) => {
                failure = Some(why);
                break;
            }
        }
    }
    stats
        .delivered
        .fetch_add(delivered as u64, Ordering::Relaxed);
    db.fenced_tx(
        "save_webhook_progress",
        lease.fence(),
        TxKind::Maintenance,
        |conn| {
            let (failure, id) = (failure.clone(), id.clone());
            Box::pin(async move {
                if let Some(cursor) = last {
                    sinks::save_progress(conn, &id, cursor, delivered).await?;
                }
                if let Some(why) = &failure {
                    match sinks::record_failure(conn, &id, why).await? {
                        Some(wait) => debug!(sink = %id, wait, "sink backs off"),
                        None => debug!(sink = %id, "the sink was deleted while it was posted to"),
                    }
                }
                Ok(())
            })
        },
    )
    .await?;
    if let Some(why) = failure {
        stats.failed.fetch_add(1, Ordering::Relaxed);
        warn!(sink = %id, error = %why, delivered, "a webhook delivery failed; the sink backs off");
        return Ok(Err(Stop::Inactive));
    }
    Ok(Ok(Pass::Delivered))
}

/// What a receiver deduplicates `event` on: a usage record's key (billing systems key on the
/// window, which one record describes however often it is delivered), else the event's id.
pub fn idempotency_key(event: &Event) -> &str {
    event
        .event_type
        .starts_with("usage.")
        .then(|| event.data["usage"]["key"].as_str())
        .flatten()
        .unwrap_or(event.id.as_str())
}

/// The URL to POST to, if the egress policy lets it through.
fn target(http: &Webhooks, url: &str) -> Result<reqwest::Url, String> {
    let target = reqwest::Url::parse(url).map_err(|_| crate::egress::UNREACHABLE.to_owned())?;
    if let Some(why) = crate::egress::refusal(&target, http.allow_private) {
        return Err(why.to_owned());
    }
    Ok(target)
}

async fn post(http: &Webhooks, url: &str, secret: &str, event: &Event) -> Result<(), String> {
    let target = target(http, url)?;
    let (span, traceparent) = post_span(&target, std::slice::from_ref(event));
    let mut request = http
        .client
        .post(target)
        .header("Compute-Event-Id", event.id.as_str())
        .header("Compute-Event-Type", &event.event_type)
        .header("Idempotency-Key", idempotency_key(event));
    if let Some(tp) = traceparent {
        request = request.header("traceparent", tp);
    }
    send(request, secret, body_of(event), &span)
        .instrument(span.clone())
        .await
}

/// The span of one delivery POST (an HTTP client span, OpenTelemetry's conventions): the child
/// of the first delivered event's trace, linked to the others' of a batch; and the
/// `traceparent` the receiver gets (the span's, or, when this worker does not trace, the
/// event's own, so the receiver still joins the trace).
fn post_span(target: &reqwest::Url, events: &[Event]) -> (tracing::Span, Option<String>) {
    let span = tracing::info_span!(
        "webhook POST",
        otel.name = "POST",
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        http.request.method = "POST",
        server.address = target.host_str().unwrap_or(""),
        server.port = target.port_or_known_default().unwrap_or(0),
        http.response.status_code = tracing::field::Empty,
        events = events.len(),
    );
    let mut traced = events
        .iter()
        .filter_map(|e| e.traceparent.as_deref())
        .filter_map(compute_telemetry::TraceParent::parse);
    let first = traced.next();
    if let Some(first) = &first {
        compute_telemetry::context::continue_from(&span, first);
        for other in traced {
            compute_telemetry::context::link(&span, &other);
        }
    }
    let header = compute_telemetry::context::of_span(&span)
        .or(first)
        .map(|t| t.to_string());
    (span, header)
}

async fn post_batch(
    http: &Webhooks,
    url: &str,
    secret: &str,
    events: &[Event],
) -> Result<(), String> {
    let target = target(http, url)?;
    let (span, traceparent) = post_span(&target, events);
    let mut request = http
        .client
        .post(target)
        .header("Compute-Batch-Size", events.len().to_string())
        .header("Idempotency-Key", batch_key(events));
    if let Some(tp) = traceparent {
        request = request.header("traceparent", tp);
    }
    send(request, secret, batch_body_of(events), &span)
        .instrument(span.clone())
        .await
}

/// Signs and sends a delivery: `Ok` on a 2xx answer, else what went wrong in words; the answer's
/// status is recorded on `span`.
async fn send(
    request: reqwest::RequestBuilder,
    secret: &str,
    body: Vec<u8>,
    span: &tracing::Span,
) -> Result<(), String> {
    let timestamp = chrono::Utc::now().timestamp();
    let response = request
        .header("Content-Type", "application/json")
        .header("Compute-Timestamp", timestamp.to_string())
        .header("Compute-Signature", signature(secret, timestamp, &body))
        .body(body)
        .send()
        .await
        .map_err(|e| {
            debug!(error = %e, "a webhook request failed");
            span.record("otel.status_code", "ERROR");
            crate::egress::category(&e).to_owned()
        })?;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if !status.is_success() {
        span.record("otel.status_code", "ERROR");
    }
    if status.is_success() {
        Ok(())
    } else {
        // A redirect is not followed: it is the receiver's answer, like any other status.
        Err(format!("HTTP {}", status.as_u16()))
    }
}
