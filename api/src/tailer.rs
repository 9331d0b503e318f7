//! The outbox tailer: one reader of the outbox per API process, fanning events out in memory.
//!
//! The tailer polls the outbox from its cursor (every [`StreamConfig::poll`], and at once when a
//! writer's `NOTIFY compute_outbox` poke arrives; a lost poke only delays), keeps the most
//! recent events in a ring, and publishes each event on the channels of its *topics*: every
//! event goes to [`Topic::All`], a tenant's events also to [`Topic::Tenant`], and every event
//! to [`Topic::Subject`] of the id it is about. A subscriber joins the one topic that covers
//! it, so an event wakes only the subscribers it may concern, and the database work per tick is
//! one query however many subscribers there are.
//!
//! A [`Feed`] is one subscriber's ordered, gap-free stream after its cursor. It starts from the
//! ring when the ring still holds everything after the cursor, otherwise from the database, then
//! follows its topic's channel. A subscriber that falls more than a channel's capacity behind
//! (its client reads slowly) is told so by the channel, drops back to reading the database from
//! its own cursor, and rejoins the live channel when it has caught up: it never blocks the
//! others and never loses an event. Events are deduplicated by cursor at every seam.

use compute_domain::ids::TenantId;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use compute_domain::db::Db;
use compute_domain::outbox::{self, Cursor, Event, EventFilter};
use tokio::sync::{Notify, broadcast, watch};
use tracing::{debug, info, warn};

/// How the tailer and the streaming transports behave.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// How often the tailer polls the outbox without a poke.
    pub poll: Duration,
    /// How many recent events the ring keeps for subscribers that join behind the tailer.
    pub ring: usize,
    /// How many events a topic's channel holds for a subscriber that has not read them yet;
    /// one that falls further behind reads the database until it catches up.
    pub channel_capacity: usize,
    /// How long a WebSocket client has to send `connection_init`.
    pub init_timeout: Duration,
    /// How often the server pings WebSocket clients and sends SSE keep-alive comments.
    pub keep_alive: Duration,
    /// How many subscriptions one WebSocket connection may run at once.
    pub max_operations: usize,
    /// The shortest interval between two items of a `poolCapacity` stream that is not an
    /// operator's of the pool: each item is the pool after every change of its interval.
    pub pool_capacity_pace: Duration,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            poll: Duration::from_millis(250),
            ring: 4096,
            channel_capacity: 1024,
            init_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(15),
            max_operations: 100,
            pool_capacity_pace: Duration::from_secs(1),
        }
    }
}

/// What a subscriber listens to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Topic {
    /// Every event (operators).
    All,
    /// One tenant's events.
    Tenant(TenantId),
    /// Events about one subject (a reservation, a node).
    Subject(String),
}

impl Topic {
    /// The narrowest topic that holds every event `filter` passes.
    pub fn for_filter(filter: &EventFilter) -> Topic {
        match (&filter.subjects[..], &filter.tenant_id) {
            ([one], _) => Topic::Subject(one.clone()),
            (_, Some(t)) => Topic::Tenant(t.clone()),
            (_, None) => Topic::All,
        }
    }
}

/// Figures for `/metrics`.
#[derive(Debug, Default)]
pub struct StreamStats {
    /// Subscriptions open now.
    pub open: AtomicI64,
    /// Events handed to subscribers.
    pub delivered: AtomicU64,
    /// Times a subscriber fell behind its channel and read the database to catch up.
    pub fallbacks: AtomicU64,
    /// Outbox reads the tailer made.
    pub polls: AtomicU64,
    /// Writers' pokes the tailer heard (`LISTEN`); none behind a transaction pooler without a
    /// direct `LISTEN` connection (`--listen-database-url`), where only its polls read.
    pub pokes: AtomicU64,
    /// Events the tailer read.
    pub read: AtomicU64,
    /// `compute_now()` minus the time of the newest event the tailer has read, in
    /// milliseconds, while it still had more to read; 0 when it is caught up.
    pub lag_ms: AtomicI64,
}

struct State {
    /// After the last event published.
    cursor: Cursor,
    /// The most recent events, oldest first.
    ring: VecDeque<Arc<Event>>,
    /// The ring holds every event after this cursor.
    ring_floor: Cursor,
    /// The outbox's pruned front at the last read: a cursor before it is expired.
    front: Cursor,
    channels: HashMap<Topic, broadcast::Sender<Arc<Event>>>,
}

/// The process's one outbox reader. Cheap to clone.
#[derive(Clone)]
pub struct Tailer(Arc<Inner>);

struct Inner {
    db: Db,
    config: StreamConfig,
    state: Mutex<State>,
    poke: Notify,
    stats: StreamStats,
    /// The `events` subscription's rendered payloads ([`crate::share`]).
    frames: Arc<crate::share::Frames>,
    /// Turns `true` once the tailer has its starting cursor.
    started: watch::Sender<bool>,
}

impl Tailer {
    /// A tailer that has not read anything yet; [`Tailer::run`] starts it.
    pub fn new(db: Db, config: StreamConfig) -> Tailer {
        Tailer(Arc::new(Inner {
            db,
            config,
            state: Mutex::new(State {
                cursor: Cursor::START,
                ring: VecDeque::new(),
                ring_floor: Cursor::START,
                front: Cursor::START,
                channels: HashMap::new(),
            }),
            poke: Notify::new(),
            stats: StreamStats::default(),
            frames: Arc::default(),
            started: watch::channel(false).0,
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The figures for `/metrics`.
    pub fn stats(&self) -> &StreamStats {
        &self.0.stats
    }

    /// The `events` subscription's rendered payloads, shared by its subscriptions.
    pub fn frames(&self) -> &Arc<crate::share::Frames> {
        &self.0.frames
    }

    /// The settings.
    pub fn config(&self) -> &StreamConfig {
        &self.0.config
    }

    /// The database it reads.
    pub fn db(&self) -> &Db {
        &self.0.db
    }

    /// After the last event the tailer has published: where a subscription without `after`
    /// starts. Waits until the tailer has its starting point.
    pub async fn present(&self) -> Cursor {
        let mut started = self.0.started.subscribe();
        let _ = started.wait_for(|s| *s).await;
        self.lock().cursor
    }

    /// Reads the outbox until `stop` resolves: from the present when it starts, then every
    /// poll interval or poke.
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let start = loop {
            let read = async {
                let head = outbox::head(&self.0.db).await?;
                let front = outbox::pruned_through(&self.0.db).await?;
                Ok::<_, compute_domain::Error>((head, front))
            };
            match read.await {
                Ok((head, front)) => {
                    self.lock().front = front;
                    break head;
                }
                Err(e) => {
                    warn!(error = %e, "outbox tailer: cannot read the head of the outbox; retrying in 1 s");
                    tokio::select! {
                        () = &mut stop => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        };
        {
            let mut s = self.lock();
            s.cursor = start;
            s.ring_floor = start;
        }
        self.0.started.send_replace(true);
        info!(cursor = %start.encode(), "outbox tailer started");
        let listener = tokio::spawn(listen(self.0.db.clone(), self.clone()));
        const BATCH: i64 = 1000;
        // After a poke that found nothing (an older transaction still running holds the rows
        // back), look again soon rather than a whole poll interval later.
        let mut retry_soon = 0u32;
        loop {
            let cursor = self.lock().cursor;
            self.0.stats.polls.fetch_add(1, Ordering::Relaxed);
            let wait = match outbox::read_all_after(&self.0.db, cursor, BATCH).await {
                Ok((events, front)) => {
                    self.lock().front = front;
                    let full = events.len() as i64 == BATCH;
                    let n = events.len();
                    if let Some(last) = events.last() {
                        let lag = if full {
                            (chrono::Utc::now() - last.time).num_milliseconds().max(0)
                        } else {
                            0
                        };
                        self.0.stats.lag_ms.store(lag, Ordering::Relaxed);
                    } else {
                        self.0.stats.lag_ms.store(0, Ordering::Relaxed);
                    }
                    self.publish(events);
                    if full {
                        Duration::ZERO
                    } else if n == 0 && retry_soon > 0 {
                        retry_soon -= 1;
                        Duration::from_millis(10)
                    } else {
                        retry_soon = 0;
                        self.0.config.poll
                    }
                }
                Err(e) => {
                    warn!(error = %e, "outbox tailer: reading the outbox failed; retrying");
                    self.0.config.poll.max(Duration::from_millis(500))
                }
            };
            if wait.is_zero() {
                continue;
            }
            tokio::select! {
                () = &mut stop => break,
                () = self.0.poke.notified() => retry_soon = 5,
                () = tokio::time::sleep(wait) => {}
            }
        }
        listener.abort();
        // Dropping the channels ends every feed that is waiting on them.
        self.lock().channels.clear();
        info!("outbox tailer stopped");
    }

    fn publish(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        self.0
            .stats
            .read
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        let ring = self.0.config.ring;
        let mut s = self.lock();
        for event in events {
            let Some(cursor) = event.cursor else { continue };
            let event = Arc::new(event);
            s.ring.push_back(event.clone());
            while s.ring.len() > ring {
                if let Some(old) = s.ring.pop_front() {
                    s.ring_floor = old.cursor.unwrap_or(s.ring_floor);
                }
            }
            s.cursor = cursor;
            let mut topics = vec![Topic::All, Topic::Subject(event.subject.clone())];
            if let Some(t) = &event.tenant_id {
                topics.push(Topic::Tenant(t.clone()));
            }
            for topic in topics {
                if let Some(tx) = s.channels.get(&topic) {
                    // An error means nobody listens any more.
                    if tx.send(event.clone()).is_err() {
                        s.channels.remove(&topic);
                    }
                }
            }
        }
    }

    /// Joins `topic` after `after`: the live receiver, and the events after `after` the ring
    /// still holds, or `None` when the ring no longer reaches back to `after` (read the
    /// database first). Atomic with publishing, so nothing falls between the two.
    fn join(
        &self,
        topic: &Topic,
        after: Cursor,
        filter: &EventFilter,
    ) -> (broadcast::Receiver<Arc<Event>>, Option<Vec<Arc<Event>>>) {
        let capacity = self.0.config.channel_capacity;
        let mut s = self.lock();
        let rx = s
            .channels
            .entry(topic.clone())
            .or_insert_with(|| broadcast::channel(capacity).0)
            .subscribe();
        let backlog = (after >= s.ring_floor).then(|| {
            s.ring
                .iter()
                .filter(|e| e.cursor.is_some_and(|c| c > after) && filter.matches(e))
                .cloned()
                .collect()
        });
        (rx, backlog)
    }

    /// `CURSOR_EXPIRED` when `after` is before the pruned front the tailer saw at its last read
    /// (at most a poll interval old; a feed that must read the database checks again there).
    pub fn check_not_expired(&self, after: Cursor) -> compute_domain::Result<()> {
        outbox::check_against(self.lock().front, after)
    }

    /// Wakes the tailer now.
    pub fn poke(&self) {
        self.0.poke.notify_one();
    }

    /// A subscriber's stream of the events `filter` passes after `after`.
    pub fn feed(&self, after: Cursor, filter: EventFilter) -> Feed {
        let topic = Topic::for_filter(&filter);
        let (rx, backlog) = self.join(&topic, after, &filter);
        self.0.stats.open.fetch_add(1, Ordering::Relaxed);
        Feed {
            tailer: self.clone(),
            topic,
            filter,
            cursor: after,
            catching_up: backlog.is_none(),
            check_front: backlog.is_none(),
            backlog: backlog.unwrap_or_default().into(),
            rx,
        }
    }
}

/// Listens for the writers' pokes and wakes the tailer; reconnects after a failure.
async fn listen(db: Db, tailer: Tailer) {
    loop {
        let heard = || {
            tailer.0.stats.pokes.fetch_add(1, Ordering::Relaxed);
            tailer.poke();
        };
        if let Err(e) = outbox::listen_for_pokes(&db, heard).await {
            warn!(error = %e, "outbox tailer: lost the LISTEN connection; polling only until it is back");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One subscriber's events after its cursor, in order, each once.
pub struct Feed {
    tailer: Tailer,
    topic: Topic,
    filter: EventFilter,
    /// After the last event this feed has passed (delivered or filtered out).
    cursor: Cursor,
    /// Reading the database: the channel may have dropped events this feed needs.
    catching_up: bool,
    /// The cursor must be checked against the pruned front before the next database read.
    check_front: bool,
    backlog: VecDeque<Arc<Event>>,
    rx: broadcast::Receiver<Arc<Event>>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.tailer.0.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How many events a catching-up feed reads from the database at a time.
const CATCH_UP_BATCH: i64 = 500;

impl Feed {
    /// The next event, or an error when the database cannot be read; `Ok(None)` when the
    /// server is shutting down.
    pub async fn next(&mut self) -> compute_domain::Result<Option<Arc<Event>>> {
        loop {
            if let Some(event) = self.backlog.pop_front() {
                let Some(c) = event.cursor else { continue };
                if c <= self.cursor {
                    continue;
                }
                self.cursor = c;
                if self.filter.matches(&event) {
                    self.tailer
                        .0
                        .stats
                        .delivered
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(Some(event));
                }
                continue;
            }
            if self.catching_up {
                // Only a feed that must read the database can find events pruned: one whose
                // cursor the ring still covers gets everything from memory. Once per catch-up:
                // the pages after the first start past the cursor just checked.
                if self.check_front {
                    // Boxed, as the read below: the database's futures are large, and a feed
                    // that keeps up (nearly all of them) should not carry their room in every
                    // wait for the next event.
                    Box::pin(outbox::check_not_expired(self.tailer.db(), self.cursor)).await?;
                    self.check_front = false;
                }
                let events = Box::pin(outbox::read_after(
                    self.tailer.db(),
                    self.cursor,
                    &self.filter,
                    CATCH_UP_BATCH,
                ))
                .await?;
                // A short page means the database had nothing more below its horizon, which is
                // at or past everything the tailer has published: the channel has the rest.
                self.catching_up = events.len() as i64 == CATCH_UP_BATCH;
                self.backlog.extend(events.into_iter().map(Arc::new));
                continue;
            }
            match self.rx.recv().await {
                Ok(event) => self.backlog.push_back(event),
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    self.tailer
                        .0
                        .stats
                        .fallbacks
                        .fetch_add(1, Ordering::Relaxed);
                    debug!(missed, cursor = %self.cursor.encode(), "a subscriber fell behind; reading the outbox to catch up");
                    let (rx, backlog) = self.tailer.join(&self.topic, self.cursor, &self.filter);
                    self.rx = rx;
                    self.catching_up = backlog.is_none();
                    self.check_front = backlog.is_none();
                    self.backlog = backlog.unwrap_or_default().into();
                    // Events published while falling behind may also be in `rx`; the cursor
                    // check above drops the doubles.
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(None),
            }
        }
    }
}
