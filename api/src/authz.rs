//! The authorization projection: this process's copy of the grants (issue 40).
//!
//! PostgreSQL holds who may do what (`compute_domain::authz`); each API process keeps every
//! managed principal's rows in memory, loaded at start and kept current by tailing
//! `authz_changes` (every [`POLL`]). A request's
//! [`Viewer`] comes from its token and is then *resolved* here ([`Authz::resolve`]): a managed
//! principal's roles, tenant and scopes are its grants', whatever its claims say; a principal
//! that is not managed keeps its claims, unless the process runs with [`Source::GrantsOnly`].
//!
//! Decisions are made from the projection on every request, so a change is felt by the next
//! request after the projection reads it: there is no other decision cache to expire. The
//! projection is trusted for [`TRUST`] after its last successful read; past that (the database
//! unreachable), every decision is refused with the retryable `UNAVAILABLE`, never allowed.
//! Streams follow [`Authz::changes`]: a WebSocket or SSE subscription whose caller's access
//! shrank is closed (`transport/ws.rs`, `transport/sse.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use compute_domain::authz::{self, FeedCursor, GrantRole, Principal, PrincipalRows};
use compute_domain::clock::Clock;
use compute_domain::db::Db;
use tokio::sync::broadcast;
use tracing::{info, warn};

use crate::auth::{Claimed, Role, Viewer};

/// How often the projection reads the feed.
pub const POLL: Duration = Duration::from_millis(100);
/// How long the projection is trusted after its last successful read.
pub const TRUST: Duration = Duration::from_secs(10);

/// Where roles come from for a principal without grants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Source {
    /// Its token's claims (the default: a deployment that grants nothing works as before).
    #[default]
    ClaimsThenGrants,
    /// Nowhere: only grants give roles (`serve --authz grants`).
    GrantsOnly,
}

/// Figures for `/metrics`.
#[derive(Debug, Default)]
pub struct AuthzStats {
    /// Reads of the feed.
    pub reads: AtomicU64,
    /// Principals re-read because a change named them.
    pub reloads: AtomicU64,
    /// Requests refused because the projection was older than [`TRUST`].
    pub stale: AtomicU64,
}

struct State {
    cursor: FeedCursor,
    principals: HashMap<Principal, PrincipalRows>,
    /// Service accounts by the SHA-256 of their token.
    tokens: HashMap<[u8; 32], Principal>,
}

struct Inner {
    db: Db,
    clock: Clock,
    grants_only: AtomicBool,
    /// How long the projection is trusted after a read, in milliseconds ([`TRUST`]).
    trust_ms: AtomicU64,
    state: RwLock<State>,
    /// When the feed was last read successfully.
    fresh: Mutex<Instant>,
    changes: broadcast::Sender<Principal>,
    stats: AuthzStats,
}

/// The process's projection. Cheap to clone.
#[derive(Clone)]
pub struct Authz(Arc<Inner>);

impl Authz {
    /// Loads every principal's rows; the projection is current when this returns.
    pub async fn load(db: Db, clock: Clock) -> compute_domain::Result<Authz> {
        // The head first: the rows read after it are at least as new.
        let cursor = authz::head(&db).await?;
        let principals = authz::load(&db, None).await?;
        let mut state = State {
            cursor,
            principals: HashMap::new(),
            tokens: HashMap::new(),
        };
        for (p, rows) in principals {
            state.put(p, rows);
        }
        info!(
            principals = state.principals.len(),
            "authorization projection loaded"
        );
        Ok(Authz(Arc::new(Inner {
            db,
            clock,
            grants_only: AtomicBool::new(false),
            trust_ms: AtomicU64::new(TRUST.as_millis() as u64),
            state: RwLock::new(state),
            fresh: Mutex::new(Instant::now()),
            changes: broadcast::channel(1024).0,
            stats: AuthzStats::default(),
        })))
    }

    /// Where roles come from for a principal without grants.
    pub fn source(&self) -> Source {
        if self.0.grants_only.load(Ordering::Relaxed) {
            Source::GrantsOnly
        } else {
            Source::ClaimsThenGrants
        }
    }

    /// Trusts the projection for `trust` after each read instead of [`TRUST`] (tests of an
    /// outage).
    pub fn set_trust(&self, trust: Duration) {
        self.0
            .trust_ms
            .store(trust.as_millis() as u64, Ordering::Relaxed);
    }

    /// Sets where roles come from for a principal without grants (`serve --authz`).
    pub fn set_source(&self, source: Source) {
        self.0
            .grants_only
            .store(source == Source::GrantsOnly, Ordering::Relaxed);
    }

    /// The figures of `/metrics`.
    pub fn stats(&self) -> &AuthzStats {
        &self.0.stats
    }

    /// Principals whose rows changed, as the projection reads them.
    pub fn changes(&self) -> broadcast::Receiver<Principal> {
        self.0.changes.subscribe()
    }

    /// Follows the feed until `stop` resolves: every [`POLL`] (each read is one index range
    /// scan of `authz_changes`, so a revocation is felt within a poll everywhere without a
    /// `LISTEN` connection of its own), and after a failed read with backoff (the projection
    /// stays trusted for [`TRUST`] meanwhile).
    pub async fn run(self, stop: impl std::future::Future<Output = ()>) {
        let follow = async {
            let mut wait = POLL;
            loop {
                tokio::time::sleep(wait).await;
                match self.step().await {
                    Ok(()) => wait = POLL,
                    Err(e) => {
                        warn!(error = %e, "reading the authorization feed failed");
                        wait = (wait * 2).min(Duration::from_secs(2));
                    }
                }
            }
        };
        tokio::select! {
            () = stop => {}
            () = follow => {}
        }
    }

    /// One read of the feed: re-reads the principals it names and tells the streams. After a
    /// spell without a successful read (past the trust), it reads every principal again from
    /// the head instead: the feed keeps a day (`authz::prune`), and a process cut off that long
    /// may have missed rows pruned since.
    pub async fn step(&self) -> compute_domain::Result<()> {
        if !self.trusted() {
            return self.reload().await;
        }
        let after = self.read().cursor;
        self.0.stats.reads.fetch_add(1, Ordering::Relaxed);
        let (changed, next) = authz::changes_after(&self.0.db, after).await?;
        if !changed.is_empty() {
            let mut rows = authz::load(&self.0.db, Some(&changed)).await?;
            self.0
                .stats
                .reloads
                .fetch_add(changed.len() as u64, Ordering::Relaxed);
            let mut state = self.0.state.write().unwrap_or_else(|p| p.into_inner());
            for p in &changed {
                let r = rows.remove(p).unwrap_or_default();
                state.put(p.clone(), r);
            }
            state.cursor = state.cursor.max(next);
        } else {
            let mut state = self.0.state.write().unwrap_or_else(|p| p.into_inner());
            state.cursor = state.cursor.max(next);
        }
        *self.0.fresh.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        for p in changed {
            let _ = self.0.changes.send(p);
        }
        Ok(())
    }

    /// Reads every principal again, from the feed's head (as at start), and tells the streams
    /// of every principal whose rows it held or now holds.
    async fn reload(&self) -> compute_domain::Result<()> {
        let cursor = authz::head(&self.0.db).await?;
        let principals = authz::load(&self.0.db, None).await?;
        self.0.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.0
            .stats
            .reloads
            .fetch_add(principals.len() as u64, Ordering::Relaxed);
        let touched: Vec<Principal> = {
            let mut state = self.0.state.write().unwrap_or_else(|p| p.into_inner());
            let mut touched: Vec<Principal> = state.principals.keys().cloned().collect();
            touched.extend(principals.keys().cloned());
            state.principals.clear();
            state.tokens.clear();
            for (p, rows) in principals {
                state.put(p, rows);
            }
            state.cursor = state.cursor.max(cursor);
            touched
        };
        *self.0.fresh.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        info!(
            principals = touched.len(),
            "authorization projection read again in full after a spell without reads"
        );
        for p in touched {
            let _ = self.0.changes.send(p);
        }
        Ok(())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.0.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// How long ago the feed was last read successfully.
    pub fn age(&self) -> Duration {
        self.0
            .fresh
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Declares the projection's figures in `registry`, read at each scrape.
    pub fn register_metrics(&self, registry: &compute_domain::metrics::Registry) {
        use compute_domain::metrics::Sampled;
        type Reading = fn(&Authz) -> f64;
        let figures: [(&'static str, &'static str, Sampled, Reading); 4] = [
            (
                "compute_authz_feed_reads",
                "Reads of the authz_changes feed by this process's projection.",
                Sampled::Counter,
                |a| a.stats().reads.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_authz_principal_reloads",
                "Principals the projection re-read because a change named them.",
                Sampled::Counter,
                |a| a.stats().reloads.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_authz_stale_refusals",
                "Requests answered UNAVAILABLE because the projection had not been read for longer \
                 than it is trusted (10 s).",
                Sampled::Counter,
                |a| a.stats().stale.load(Ordering::Relaxed) as f64,
            ),
            (
                "compute_authz_projection_age_seconds",
                "Seconds since the projection last read the authz_changes feed (about 0.1 normally; \
                 past 10 every decision is UNAVAILABLE).",
                Sampled::Gauge,
                |a| a.age().as_secs_f64(),
            ),
        ];
        for (name, help, kind, read) in figures {
            let authz = self.clone();
            registry.sample(name, help, kind, None, move || vec![("", read(&authz))]);
        }
    }

    fn trusted(&self) -> bool {
        let trust = Duration::from_millis(self.0.trust_ms.load(Ordering::Relaxed));
        self.0
            .fresh
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
            <= trust
    }

    /// The caller as the grants make it: `viewer` as its token made it, with its roles, tenant
    /// and scopes replaced by its grants' when it is managed (or dropped when the process takes
    /// roles from grants only). A node daemon's `node` role is its token's, always. Past
    /// [`TRUST`] the viewer comes back with [`Viewer::unavailable`] set and no role. A viewer
    /// resolved before is resolved again from what its token claimed.
    pub fn resolve(&self, mut viewer: Viewer) -> Viewer {
        let claimed = viewer
            .claimed
            .get_or_insert_with(|| Claimed {
                roles: viewer.roles.clone(),
                tenant: viewer.tenant.clone(),
            })
            .clone();
        viewer.roles = claimed.roles;
        viewer.tenant = claimed.tenant;
        viewer.scopes.clear();
        viewer.unavailable = false;
        let node = viewer.has_role(Role::Node);
        if !self.trusted() {
            self.0.stats.stale.fetch_add(1, Ordering::Relaxed);
            viewer.roles.clear();
            viewer.tenant = None;
            viewer.unavailable = true;
            return viewer;
        }
        let key = principal_of(&viewer);
        let state = self.read();
        let rows = state.principals.get(&key).filter(|r| r.managed);
        if key.issuer == authz::SERVICE_ACCOUNT_ISSUER {
            // A service account is as good as its token: revoked or expired, it holds nothing.
            let live = rows
                .and_then(|r| r.account.as_ref())
                .is_some_and(|a| !a.revoked && a.expires_at > self.0.clock.now());
            if !live {
                viewer.roles.clear();
                viewer.tenant = None;
                return viewer;
            }
        }
        match rows {
            Some(rows) => {
                apply(&mut viewer, rows);
                if node {
                    viewer.roles.push(Role::Node);
                }
            }
            None if self.source() == Source::GrantsOnly => {
                viewer.roles.retain(|r| *r == Role::Node);
                viewer.tenant = None;
            }
            None => {
                // Claims as they are; an `admin` claim is also an operator of the fleet.
                if viewer.has_role(Role::Admin) && !viewer.has_role(Role::Operator) {
                    viewer.roles.push(Role::Operator);
                }
            }
        }
        viewer
    }

    /// Resolves when `viewer`'s access shrinks (a change to its grants leaves it less than
    /// it had: [`covers`]); never without a viewer. Streams close on it. It listens from the
    /// call and looks once at its first poll: a change applied after `viewer` was resolved
    /// and before the call (a connection opened as its subject was revoked) is not missed.
    pub fn shrinks(
        &self,
        viewer: Option<&Viewer>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let Some(before) = viewer.cloned() else {
            return Box::pin(std::future::pending());
        };
        let me = self.clone();
        let mut rx = self.changes();
        Box::pin(async move {
            if !covers(&me.resolve(before.clone()), &before) {
                return;
            }
            let own = principal_of(&before);
            loop {
                match rx.recv().await {
                    Ok(p) if p == own => {}
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                }
                let now = me.resolve(before.clone());
                if !covers(&now, &before) {
                    return;
                }
            }
        })
    }

    /// The caller of a service account's token: `None` when `token` is not one (a JWT);
    /// otherwise the account's viewer, or why it is refused.
    pub fn service_account(&self, token: &str) -> Option<Result<Viewer, String>> {
        if !token.starts_with(authz::SERVICE_ACCOUNT_TOKEN_PREFIX) {
            return None;
        }
        let unknown = || "the service account token is unknown or revoked".to_owned();
        let hash = authz::token_hash(token);
        let viewer = {
            let state = self.read();
            let Some(p) = state.tokens.get(&hash) else {
                return Some(Err(unknown()));
            };
            let Some(account) = state.principals.get(p).and_then(|r| r.account.as_ref()) else {
                return Some(Err(unknown()));
            };
            if account.revoked {
                return Some(Err(unknown()));
            }
            let now = self.0.clock.now();
            if account.expires_at <= now {
                return Some(Err("the service account token has expired".to_owned()));
            }
            Viewer {
                subject: p.subject.clone(),
                issuer: p.issuer.clone(),
                tenant: None,
                roles: Vec::new(),
                node: None,
                scopes: Vec::new(),
                unavailable: false,
                claimed: None,
                expires_at: account.expires_at.timestamp(),
                valid_for: (account.expires_at - now).to_std().unwrap_or_default(),
            }
        };
        Some(Ok(self.resolve(viewer)))
    }
}

impl State {
    fn put(&mut self, p: Principal, rows: PrincipalRows) {
        self.tokens.retain(|_, q| *q != p);
        if let Some(account) = &rows.account
            && account.token_hash.len() == 32
        {
            let mut key = [0u8; 32];
            key.copy_from_slice(&account.token_hash);
            self.tokens.insert(key, p.clone());
        }
        if rows.managed {
            self.principals.insert(p, rows);
        } else {
            self.principals.remove(&p);
        }
    }
}

/// A managed principal's grants as a viewer's roles, tenant and scopes.
fn apply(viewer: &mut Viewer, rows: &PrincipalRows) {
    viewer.roles.clear();
    viewer.tenant = None;
    viewer.scopes.clear();
    let mut fleet_operator = false;
    for g in &rows.grants {
        match g.role {
            GrantRole::Admin => {
                viewer.roles.push(Role::Admin);
                fleet_operator = true;
            }
            GrantRole::Operator => match &g.scope_id {
                None => fleet_operator = true,
                Some(scope) => viewer.scopes.push(scope.clone()),
            },
            GrantRole::Member => {
                viewer.roles.push(Role::Member);
                viewer.tenant = g.tenant_id.clone();
            }
        }
    }
    if fleet_operator {
        viewer.roles.push(Role::Operator);
        // The fleet covers every scope.
        viewer.scopes.clear();
    }
    viewer.scopes.sort();
    viewer.scopes.dedup();
}

/// Whether `now` still grants everything `before` did: the same tenant (when `before` had one
/// as a member), every role, and every scope (an operator of the fleet covers all of them). A
/// stream opened with `before` stays open only while this holds.
pub fn covers(now: &Viewer, before: &Viewer) -> bool {
    if now.unavailable {
        return true; // Not known to have shrunk: the requests are refused meanwhile.
    }
    // An operator of the fleet sees every tenant's objects: it covers a member's access.
    let fleet = now.has_role(Role::Operator);
    let roles = before
        .roles
        .iter()
        .all(|r| now.roles.contains(r) || (*r == Role::Member && fleet));
    let tenant = !before.has_role(Role::Member) || fleet || now.tenant == before.tenant;
    let scopes = fleet
        || before
            .scopes
            .iter()
            .all(|s| now.scopes.iter().any(|n| n == s));
    roles && tenant && scopes
}

/// `id`'s principal, for the stream checks and tests.
pub fn principal_of(viewer: &Viewer) -> Principal {
    Principal {
        issuer: viewer.issuer.clone(),
        subject: viewer.subject.clone(),
    }
}
