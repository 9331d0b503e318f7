//! Availability search: the earliest windows in which a whole request fits, read from the
//! calendar that placement books into.
//!
//! After the checks that do not depend on the window (the pool, its rules, the tenant's quota:
//! [`admit`]), the calendar is read by two statements at once, on two connections: the pool's
//! nodes with the static reasons that rule each one out for each allocation (the same SQL facts
//! placement filters on: `compute_node_schedulable`, the selector, `compute_taints_tolerated`),
//! their free vCPU, memory and disk, and every schedulable atom that matches an allocation
//! ([`read_nodes`]); and the pool's bookings that overlap the searched range, one scan of
//! `device_bookings_pool_during` ([`read_bookings`]; never the fleet's history nor another
//! pool's). The search itself ([`search`]) is a sweep over time in memory.
//!
//! **What a window is.** An atom can take a window `[s, s + d)` when no booking of it overlaps it
//! and it existed at `s`; so the starts it can take form closed intervals, one per gap between its
//! bookings. A request fits at `s` when every allocation finds a node with enough such atoms (and
//! the vCPU, memory and disk it asks), allocations of one request never sharing an atom. The set
//! of starts at which the request fits is a union of stretches; a [`Window`] is one stretch: its
//! earliest start, where the search also says which node each allocation would take and how many
//! atoms it would find there, and its latest start. Windows are returned earliest first.
//!
//! Allocations are assigned greedily in their order, tightest node first, as placement does, so a
//! `createReservation` for a returned window finds the same fit unless someone books first.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Duration, Utc};
use serde_json::json;
use sqlx::PgConnection;
use tracing::Instrument;

use crate::actor::Actor;
use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::fleet::PoolRules;
use crate::fleet::model as m;
use crate::ids::{NodeId, PoolId};
use crate::task::AbortOnDrop;

use super::model::{
    AllocationInput, AllocationRequest, Colocate, Gang, GangInput, MAX_ALLOCATIONS, MAX_DAYS,
    gpu_charge, parse_gang,
};

/// How many windows `first` may ask for, and its default.
pub const MAX_WINDOWS: usize = 20;
pub const DEFAULT_WINDOWS: usize = 5;
/// How far past `notBefore` the search looks when `notAfter` is not given.
pub const DEFAULT_HORIZON_DAYS: i64 = 14;

/// A parsed availability question.
#[derive(Debug, Clone)]
pub struct AvailabilityRequest {
    pub pool_id: PoolId,
    pub allocations: Vec<AllocationRequest>,
    pub duration: Duration,
    /// The earliest start wanted; now when unset or past.
    pub not_before: Option<DateTime<Utc>>,
    /// The latest start wanted; `DEFAULT_HORIZON_DAYS` after `not_before` when unset.
    pub not_after: Option<DateTime<Utc>>,
    pub first: usize,
    /// The gang's rule, as `createReservation` takes it.
    pub gang: Option<Gang>,
}

/// Parses the arguments of `availability`; field names are the GraphQL ones.
pub fn parse_availability(
    pool_id: &str,
    allocations: &[AllocationInput],
    duration_seconds: i64,
    not_before: Option<DateTime<Utc>>,
    not_after: Option<DateTime<Utc>>,
    first: Option<i64>,
    gang: Option<&GangInput>,
) -> Result<AvailabilityRequest> {
    let pool_id = PoolId::parse("poolId", pool_id)?;
    let duration_seconds =
        m::parse_count("durationSeconds", duration_seconds, 1, MAX_DAYS * 86_400)?;
    let not_before = not_before
        .map(|t| m::parse_time("notBefore", t))
        .transpose()?;
    let not_after = not_after
        .map(|t| m::parse_time("notAfter", t))
        .transpose()?;
    if let (Some(a), Some(b)) = (not_before, not_after) {
        if b < a {
            return Err(Error::bad_input(
                "notAfter",
                "`notAfter` (the latest start) must not be before `notBefore`",
            ));
        }
        if b - a > Duration::days(MAX_DAYS) {
            return Err(Error::bad_input(
                "notAfter",
                format!("the search spans at most {MAX_DAYS} days of starts"),
            ));
        }
    }
    let first = match first {
        None => DEFAULT_WINDOWS,
        Some(n) => m::parse_count("first", n, 1, MAX_WINDOWS as i64)? as usize,
    };
    if allocations.is_empty() || allocations.len() > MAX_ALLOCATIONS {
        return Err(Error::bad_input(
            "allocations",
            format!("a request has 1 to {MAX_ALLOCATIONS} allocations"),
        ));
    }
    let allocations = allocations
        .iter()
        .enumerate()
        .map(|(i, a)| super::model::parse_allocation(&format!("allocations[{i}]"), a))
        .collect::<Result<Vec<_>>>()?;
    Ok(AvailabilityRequest {
        pool_id,
        allocations,
        duration: Duration::seconds(duration_seconds),
        not_before,
        not_after,
        first,
        gang: gang.map(|g| parse_gang("gang", g)).transpose()?,
    })
}

/// One atom of the calendar: which allocations it could serve (bit `i` for allocation `i`),
/// since when it exists, and its bookings as `[from, to)` in microseconds since the epoch.
#[derive(Debug, Clone)]
pub struct CalAtom {
    pub serves: u32,
    pub created: i64,
    pub busy: Vec<(i64, i64)>,
    /// Per allocation, the group of GPUs of its node the atom belongs to for that allocation's
    /// `sameNvlinkDomain` / `sameNumaNode` (an allocation's atoms come from one group); empty,
    /// or 0 for an allocation that keeps nothing together: one group per node.
    pub group: Vec<u32>,
}

impl CalAtom {
    fn group_of(&self, i: usize) -> u32 {
        self.group.get(i).copied().unwrap_or(0)
    }
}

/// One node of the calendar.
#[derive(Debug, Clone)]
pub struct CalNode {
    pub id: NodeId,
    /// Per allocation: the reason that rules this node out whatever the time
    /// (`NodeCordoned`, `NodeSelectorMismatch`…), or `None`.
    pub ruled_out: Vec<Option<String>>,
    /// What is left of each scalar; `None`: the node does not count it.
    pub free_vcpu: Option<i64>,
    pub free_memory_mib: Option<i64>,
    pub free_disk_gib: Option<i64>,
    pub atoms: Vec<CalAtom>,
    /// The value of the gang's label on this node (`colocate: LABEL`), when it has one.
    pub label: Option<String>,
}

/// What one allocation needs of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    pub atoms: usize,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
}

impl Need {
    fn plus(self, other: &Need) -> Need {
        Need {
            atoms: self.atoms + other.atoms,
            vcpu: self.vcpu + other.vcpu,
            memory_mib: self.memory_mib + other.memory_mib,
            disk_gib: self.disk_gib + other.disk_gib,
        }
    }

    pub fn of(a: &AllocationRequest) -> Need {
        Need {
            atoms: a.gpu_count.max(1) as usize,
            vcpu: a.vcpu,
            memory_mib: a.memory_mib,
            disk_gib: a.disk_gib,
        }
    }
}

/// Where one allocation would go at a window's earliest start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub node: NodeId,
    /// How many matching atoms that node has free over the window (at least the count asked).
    pub free_atoms: usize,
}

/// A stretch of starts at which the whole request fits (microseconds since the epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stretch {
    pub earliest: i64,
    pub latest: i64,
    pub picks: Vec<Pick>,
}

/// Why no node takes an allocation, node by node: the first reason that rules each out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The allocation the counts are about.
    pub allocation: usize,
    pub counts: Vec<(String, i64)>,
}

/// The answer of the sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Stretches(Vec<Stretch>),
    Nothing(Refusal),
    /// The joint assignments of several allocations or a gang examined more atoms than the
    /// budget ([`SEARCH_BUDGET`]) before an answer: refused rather than searched without a bound.
    TooLarge,
}

/// The most atoms the joint assignments of one search may examine: a gang that never fits in a
/// busy pool was a search of every node at every booking's edge (10^12 steps for
/// `colocate: NODE` with 16 allocations on 1,250 nodes), on a runtime worker. A single
/// allocation without a gang never spends it (its fit is a set's emptiness).
pub const SEARCH_BUDGET: u64 = 50_000_000;

/// The starts (closed, in microseconds) at which `atom` can take `[s, s + d)`, within
/// `[from, to]`.
fn start_intervals(atom: &CalAtom, d: i64, from: i64, to: i64) -> Vec<(i64, i64)> {
    let mut busy = atom.busy.clone();
    busy.sort_unstable();
    let mut out = Vec::new();
    let mut gap_from = from.max(atom.created);
    for &(b_from, b_to) in &busy {
        // Free from `gap_from` until this booking begins: starts up to `b_from - d`.
        let last = (b_from - d).min(to);
        if last >= gap_from {
            out.push((gap_from, last));
        }
        gap_from = gap_from.max(b_to);
        if gap_from > to {
            return out;
        }
    }
    if gap_from <= to {
        out.push((gap_from, to));
    }
    out
}

/// The sweep: every atom's start intervals become `+1` and `-1` events; between two event times
/// nothing changes, so the request's fit is decided once per event time. Per allocation, the
/// atoms are counted per unit (a node, or a group of GPUs of a node for an allocation that keeps
/// its GPUs on one NVLink domain or NUMA node) and the nodes with a unit of enough atoms
/// (`qualified`) are kept as counts change; a single allocation without a gang fits when that set
/// is not empty, anything else when the greedy assignment of placement succeeds under the gang's
/// rule ([`assign_gang`]).
#[expect(
    clippy::too_many_arguments,
    reason = "the calendar, the request and its bounds, each a plain value the tests vary"
)]
pub fn search(
    nodes: &[CalNode],
    needs: &[Need],
    gang: Option<&Gang>,
    duration_us: i64,
    from: i64,
    to: i64,
    first: usize,
    budget: u64,
) -> Found {
    let n_alloc = needs.len();
    // Which allocations each node can take, whatever the time (static reasons and scalars).
    let open: Vec<u32> = nodes
        .iter()
        .map(|n| {
            (0..n_alloc)
                .filter(|&i| {
                    n.ruled_out.get(i).is_none_or(Option::is_none) && scalars_fit(n, &needs[i])
                })
                .fold(0u32, |m, i| m | (1 << i))
        })
        .collect();
    // Atoms flattened: (node, atom) with the allocations it can serve there, and per allocation
    // its unit (node and group), numbered per allocation.
    let mut cal = Flat::default();
    let mut unit_of: Vec<Vec<usize>> = vec![Vec::new(); n_alloc];
    let mut unit_node: Vec<Vec<usize>> = vec![Vec::new(); n_alloc];
    let mut unit_ids: Vec<HashMap<(usize, u32), usize>> = vec![HashMap::new(); n_alloc];
    let mut events: Vec<(i64, i32, usize)> = Vec::new();
    for (ni, node) in nodes.iter().enumerate() {
        for (k, atom) in node.atoms.iter().enumerate() {
            let serves = atom.serves & open[ni];
            if serves == 0 {
                continue;
            }
            let idx = cal.atom.len();
            cal.atom.push((ni, k));
            cal.serves.push(serves);
            for i in 0..n_alloc {
                let u = if serves & (1 << i) == 0 {
                    usize::MAX
                } else {
                    let units = &mut unit_node[i];
                    *unit_ids[i]
                        .entry((ni, atom.group_of(i)))
                        .or_insert_with(|| {
                            units.push(ni);
                            units.len() - 1
                        })
                };
                unit_of[i].push(u);
            }
            for (a, b) in start_intervals(atom, duration_us, from, to) {
                events.push((a, 1, idx));
                events.push((b.saturating_add(1), -1, idx));
            }
        }
    }
    events.sort_unstable();

    cal.valid = vec![false; cal.atom.len()];
    // count[i][unit]: atoms of the unit valid now that allocation i could use; units_ok[i][node]:
    // the node's units with enough for allocation i.
    let mut count: Vec<Vec<usize>> = unit_node.iter().map(|u| vec![0; u.len()]).collect();
    let mut units_ok = vec![vec![0usize; nodes.len()]; n_alloc];
    let mut best = vec![vec![0usize; nodes.len()]; n_alloc];
    let mut qualified: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n_alloc];
    // Per node, its flattened atoms, for the joint check.
    cal.node_atoms = vec![Vec::new(); nodes.len()];
    for (idx, &(ni, _)) in cal.atom.iter().enumerate() {
        cal.node_atoms[ni].push(idx);
    }
    let alone = n_alloc == 1 && gang.is_none();
    // A gang on one node needs a node with as many atoms serving it as the gang asks: when
    // none has, no start fits, whatever is booked.
    let gang_possible = match gang {
        Some(g) if g.colocate == Some(Colocate::Node) => {
            let total: usize = needs.iter().map(|n| n.atoms).sum();
            cal.node_atoms.iter().any(|a| a.len() >= total)
        }
        _ => true,
    };
    // Whether the last joint check fit, and whether an atom became free since. For allocations
    // that are all alike (the same need, served by the same atoms in the same groups), fewer
    // free atoms never make the request fit (the greedy assignment places as many alike
    // allocations as the units hold), so one that did not fit is checked again only when an
    // atom became free. Allocations that differ can fit after an atom is taken (the tightest
    // node for the first changes, and the second gets the node it needed): checked at every
    // event, within the budget.
    let full: u32 = if n_alloc >= 32 {
        u32::MAX
    } else {
        (1u32 << n_alloc) - 1
    };
    let alike = needs.iter().all(|n| *n == needs[0])
        && cal.serves.iter().all(|&m| m == 0 || m == full)
        && nodes.iter().all(|n| {
            n.atoms
                .iter()
                .all(|a| (0..n_alloc).all(|i| a.group_of(i) == a.group_of(0)))
        });
    let mut last_fit = false;

    let mut out: Vec<Stretch> = Vec::new();
    let mut open_stretch: Option<Stretch> = None;
    let mut e = 0;
    while e < events.len() {
        let t = events[e].0;
        if t > to {
            break;
        }
        let mut freed = false;
        while e < events.len() && events[e].0 == t {
            let (_, delta, idx) = events[e];
            cal.valid[idx] = delta > 0;
            freed |= delta > 0;
            for (i, need) in needs.iter().enumerate() {
                let u = unit_of[i][idx];
                if u == usize::MAX {
                    continue;
                }
                let ni = unit_node[i][u];
                let c = &mut count[i][u];
                let was = *c >= need.atoms;
                *c = if delta > 0 { *c + 1 } else { *c - 1 };
                best[i][ni] = best[i][ni].max(*c);
                let now = *c >= need.atoms;
                if now != was {
                    let ok = &mut units_ok[i][ni];
                    if now {
                        *ok += 1;
                        qualified[i].insert(ni);
                    } else {
                        *ok -= 1;
                        if *ok == 0 {
                            qualified[i].remove(&ni);
                        }
                    }
                }
            }
            e += 1;
        }
        let fits = qualified.iter().all(|q| !q.is_empty())
            && (alone
                || (gang_possible
                    && (last_fit || freed || !alike)
                    && assign_gang(nodes, needs, gang, &qualified, &cal).is_some()));
        last_fit = fits;
        match (&mut open_stretch, fits) {
            (None, true) => {
                let picks = assign_gang(nodes, needs, gang, &qualified, &cal).unwrap_or_default();
                open_stretch = Some(Stretch {
                    earliest: t,
                    latest: to,
                    picks,
                });
            }
            (Some(s), false) => {
                s.latest = t - 1;
                out.extend(open_stretch.take());
                if out.len() >= first {
                    return Found::Stretches(out);
                }
            }
            _ => {}
        }
        if cal.work.get() > budget {
            // The windows found so far are answers (an open one known to hold up to now);
            // without any, the search is refused.
            out.extend(open_stretch.take().map(|mut s| {
                s.latest = t;
                s
            }));
            if out.is_empty() {
                return Found::TooLarge;
            }
            return Found::Stretches(out);
        }
    }
    out.extend(open_stretch);
    if !out.is_empty() {
        out.truncate(first);
        return Found::Stretches(out);
    }
    Found::Nothing(refusal(nodes, needs, &open, &best))
}

/// The calendar's atoms flattened for the sweep.
#[derive(Default)]
struct Flat {
    /// Per flattened atom: its node and its index there.
    atom: Vec<(usize, usize)>,
    /// The allocations it can serve.
    serves: Vec<u32>,
    /// Whether it is free over the window at the current start.
    valid: Vec<bool>,
    /// Per node, its flattened atoms.
    node_atoms: Vec<Vec<usize>>,
    /// Atoms the joint assignments examined (against [`SEARCH_BUDGET`]).
    work: std::cell::Cell<u64>,
}

fn scalars_fit(n: &CalNode, need: &Need) -> bool {
    let fits = |free: Option<i64>, asked: i64| asked == 0 || free.is_none_or(|f| asked <= f);
    fits(n.free_vcpu, need.vcpu)
        && fits(n.free_memory_mib, need.memory_mib)
        && fits(n.free_disk_gib, need.disk_gib)
}

/// The request assigned under the gang's rule, as placement tries it: colocated on one node, the
/// nodes one by one; on one value of a label, the values one by one (with distinct nodes inside
/// when it also spreads); spread alone, distinct nodes; no gang, anywhere.
fn assign_gang(
    nodes: &[CalNode],
    needs: &[Need],
    gang: Option<&Gang>,
    qualified: &[BTreeSet<usize>],
    cal: &Flat,
) -> Option<Vec<Pick>> {
    let Some(g) = gang else {
        return assign(nodes, needs, qualified, cal, &|_| true, false);
    };
    match g.colocate {
        None => assign(nodes, needs, qualified, cal, &|_| true, g.spread),
        Some(Colocate::Node) => qualified[0]
            .iter()
            .filter(|ni| qualified.iter().all(|q| q.contains(ni)))
            .find_map(|&only| assign(nodes, needs, qualified, cal, &|ni| ni == only, false)),
        Some(Colocate::Label) => {
            let values: BTreeSet<&str> = qualified[0]
                .iter()
                .filter_map(|&ni| nodes[ni].label.as_deref())
                .collect();
            values.into_iter().find_map(|v| {
                assign(
                    nodes,
                    needs,
                    qualified,
                    cal,
                    &|ni| nodes[ni].label.as_deref() == Some(v),
                    g.spread,
                )
            })
        }
    }
}

/// Allocations in order, each on the qualified node (that `allowed` lets through, and one no
/// earlier allocation took when `spread`) with the fewest free atoms in its best unit (ties by
/// node id), among those with enough that earlier allocations did not take and with the scalars
/// they left: placement's rule (placement picks the tightest of a sample of the nodes that fit).
/// An allocation keeping its GPUs together takes them from the group with the fewest free that
/// has enough, as `compute_free_atoms` does.
fn assign(
    nodes: &[CalNode],
    needs: &[Need],
    qualified: &[BTreeSet<usize>],
    cal: &Flat,
    allowed: &dyn Fn(usize) -> bool,
    spread: bool,
) -> Option<Vec<Pick>> {
    let mut taken: Vec<usize> = Vec::new(); // flattened atoms taken by earlier allocations
    let mut used: Vec<(usize, Need)> = Vec::new();
    let mut picks = Vec::with_capacity(needs.len());
    for (i, need) in needs.iter().enumerate() {
        let mut chosen: Option<(usize, Vec<usize>)> = None;
        for &ni in &qualified[i] {
            if !allowed(ni) || (spread && used.iter().any(|(un, _)| *un == ni)) {
                continue;
            }
            let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
            cal.work
                .set(cal.work.get() + cal.node_atoms[ni].len() as u64 + 1);
            for &a in &cal.node_atoms[ni] {
                if cal.valid[a] && cal.serves[a] & (1 << i) != 0 && !taken.contains(&a) {
                    let (n, k) = cal.atom[a];
                    groups
                        .entry(nodes[n].atoms[k].group_of(i))
                        .or_default()
                        .push(a);
                }
            }
            let Some(free) = groups
                .into_values()
                .filter(|g| g.len() >= need.atoms)
                .min_by_key(Vec::len)
            else {
                continue;
            };
            // This allocation's scalars with those of earlier ones on the same node.
            let together = used
                .iter()
                .filter(|(un, _)| *un == ni)
                .fold(*need, |sum, (_, u)| sum.plus(u));
            if !scalars_fit(&nodes[ni], &together) {
                continue;
            }
            let better = chosen.as_ref().is_none_or(|(cn, cf)| {
                (free.len(), &nodes[ni].id.as_str()) < (cf.len(), &nodes[*cn].id.as_str())
            });
            if better {
                chosen = Some((ni, free));
            }
        }
        let (ni, free) = chosen?;
        picks.push(Pick {
            node: nodes[ni].id.clone(),
            free_atoms: free.len(),
        });
        taken.extend(free.iter().take(need.atoms));
        used.push((ni, *need));
    }
    Some(picks)
}

/// Counts for the first allocation that no node could take on its own at any start; when each
/// could but never all together, `AllocationsConflict` for every node.
fn refusal(nodes: &[CalNode], needs: &[Need], open: &[u32], best: &[Vec<usize>]) -> Refusal {
    let alone = (0..needs.len()).find(|&i| best[i].iter().all(|&b| b < needs[i].atoms));
    let Some(i) = alone else {
        return Refusal {
            allocation: needs.len().saturating_sub(1),
            counts: vec![("AllocationsConflict".into(), nodes.len() as i64)],
        };
    };
    let mut counts: Vec<(String, i64)> = Vec::new();
    for (ni, node) in nodes.iter().enumerate() {
        let reason = if let Some(Some(r)) = node.ruled_out.get(i) {
            r.clone()
        } else if open[ni] & (1 << i) == 0 {
            let need = &needs[i];
            if need.vcpu > 0 && node.free_vcpu.is_some_and(|f| need.vcpu > f) {
                "InsufficientVcpu".into()
            } else if need.memory_mib > 0
                && node.free_memory_mib.is_some_and(|f| need.memory_mib > f)
            {
                "InsufficientMemory".into()
            } else {
                "InsufficientDisk".into()
            }
        } else {
            "InsufficientGpus".into()
        };
        match counts.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => counts.push((reason, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Refusal {
        allocation: i,
        counts,
    }
}

/// A window of the answer.
#[derive(Debug, Clone)]
pub struct Window {
    /// The earliest start of the stretch, and the window's end from it.
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    /// The latest start at which the request still fits, before something booked is in the way
    /// (or the search's last start).
    pub latest_start: DateTime<Utc>,
    /// Per allocation, in order: the node it would take at `starts_at`.
    pub picks: Vec<Pick>,
}

/// Why nothing fits, as an `Unschedulable` condition would say it.
#[derive(Debug, Clone)]
pub struct Unfit {
    pub allocation: usize,
    pub counts: Vec<(String, i64)>,
    pub message: String,
}

/// The answer of `availability`.
#[derive(Debug, Clone)]
pub struct Availability {
    /// The starts searched: from `notBefore` (or now) to `notAfter`, narrowed by the pool's
    /// `maxLeadSeconds`.
    pub searched_from: DateTime<Utc>,
    pub searched_to: DateTime<Utc>,
    pub windows: Vec<Window>,
    /// Set when no window was found.
    pub unfit: Option<Unfit>,
}

/// What decides whether the request may be searched at all: the pool's rules and the caller's
/// tenant's booked GPU-hours on it, read with the time.
#[derive(sqlx::FromRow)]
struct Gate {
    now: DateTime<Utc>,
    site_id: String,
    rules: Option<sqlx::types::Json<PoolRules>>,
    held_gpu_hours: f64,
}

/// The earliest windows in which `req` fits for the caller (its tenant's quota and the pool's
/// rules applied as `createReservation` applies them: a request they refuse is refused here with
/// the same code, rule and limit).
#[tracing::instrument(level = "debug", skip_all, fields(pool = %req.pool_id))]
pub async fn availability(
    db: &Db,
    actor: &Actor,
    req: &AvailabilityRequest,
) -> Result<Availability> {
    let tenant = actor.tenant.as_ref().map(|t| t.as_str().to_owned());
    let (from, to) = {
        let (tenant, req) = (tenant.clone(), req.clone());
        db.tx("availability", TxKind::Read, move |conn| {
            let (tenant, req) = (tenant.clone(), req.clone());
            Box::pin(async move { admit(conn, tenant.as_deref(), &req).await })
        })
        .await?
    };
    let until = to + req.duration;
    let started = std::time::Instant::now();
    // The nodes and the bookings in two read transactions at once, on two connections: the
    // database works on both (and this process decodes the bookings while the nodes are read).
    // A booking committed between the two snapshots can only make the answer fresher; one of an
    // atom the first did not read is dropped.
    let timed = |f: std::time::Instant| f.elapsed().as_secs_f64() * 1000.0;
    // The bookings on a task of their own, so that decoding them runs beside decoding the
    // nodes (on another core) rather than in turn with it; aborted if this request is dropped.
    let bookings = {
        let (db, pool) = (db.clone(), req.pool_id.clone());
        AbortOnDrop::spawn(
            async move {
                let r = db
                    .tx("availability_bookings", TxKind::Read, move |conn| {
                        let pool = pool.clone();
                        Box::pin(async move { read_bookings(conn, &pool, from, until).await })
                    })
                    .await;
                r.map(|r| (r, timed(started)))
            }
            .in_current_span(),
        )
    };
    let (nodes, nodes_ms) = {
        let req = req.clone();
        let r = db
            .tx("availability_nodes", TxKind::Read, move |conn| {
                let req = req.clone();
                Box::pin(async move { read_nodes(conn, &req, until).await })
            })
            .await?;
        (r, timed(started))
    };
    let (bookings, bookings_ms) = match bookings.join().await {
        Ok(read) => read?,
        // A panic in the task is this process's bug: it goes on as a panic here.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled by the runtime's shutdown: the process is going away; the caller may ask
        // again.
        Err(e) => return Err(Error::Unavailable(Box::new(e))),
    };
    tracing::debug!(nodes_ms, bookings_ms, "availability read");
    let nodes = with_bookings(nodes, bookings);
    let read = started.elapsed();
    // The sweep is CPU without an await: on a blocking thread, so it holds none of the
    // runtime's workers (the request's deadline cannot stop it; its budget does).
    let req = req.clone();
    let span = tracing::Span::current();
    match tokio::task::spawn_blocking(move || {
        span.in_scope(|| found_to_answer(&req, from, to, nodes, read, started))
    })
    .await
    {
        Ok(answer) => answer,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::Unavailable(Box::new(e))),
    }
}

/// The checks a create would make that do not depend on the window (the pool, its rules, the
/// tenant's quota), and the starts to search: `[from, to]`.
async fn admit(
    conn: &mut PgConnection,
    tenant: Option<&str>,
    req: &AvailabilityRequest,
) -> Result<(DateTime<Utc>, DateTime<Utc>)> {
    let gate: Option<Gate> = sqlx::query_as(
        "SELECT compute_now() AS now, p.site_id, p.rules,
                CASE WHEN $2::text IS NULL OR p.rules->>'maxFutureGpuHours' IS NULL THEN 0
                     ELSE compute_future_gpu_hours($2, p.id, NULL, compute_now()) END::float8 AS held_gpu_hours
           FROM pools p WHERE p.id = $1",
    )
    .bind(req.pool_id.as_str())
    .bind(tenant)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(gate) = gate else {
        return Err(Error::NotFound {
            kind: "pool",
            id: req.pool_id.to_string(),
        });
    };
    let rules = gate.rules.as_ref().map(|r| r.0.clone()).unwrap_or_default();
    let secs = req.duration.num_seconds();
    let from = req.not_before.map_or(gate.now, |t| t.max(gate.now));
    let mut to = req
        .not_after
        .unwrap_or(from + Duration::days(DEFAULT_HORIZON_DAYS));
    if let Some(max) = rules.max_duration_seconds
        && secs > max
    {
        return Err(Error::PolicyViolation {
            rule: "maxDurationSeconds".into(),
            limit: json!(max),
            message: format!(
                "pool {} allows reservations of at most {max} seconds; {secs} seconds were asked",
                req.pool_id
            ),
        });
    }
    if let Some(max) = rules.max_lead_seconds {
        let last = gate.now + Duration::seconds(max);
        if from > last {
            return Err(Error::PolicyViolation {
                rule: "maxLeadSeconds".into(),
                limit: json!(max),
                message: format!(
                    "pool {} allows a reservation to start at most {max} seconds ahead; `notBefore` is {} seconds ahead",
                    req.pool_id,
                    (from - gate.now).num_seconds()
                ),
            });
        }
        to = to.min(last);
    }
    // A create starts at most 366 days ahead whatever the pool says (migration 0043): no window
    // is offered past that.
    let furthest = gate.now + Duration::days(super::model::MAX_DAYS);
    if from > furthest {
        return Err(Error::bad_input(
            "notBefore",
            format!(
                "a reservation starts at most {} days ahead; `notBefore` is later",
                super::model::MAX_DAYS
            ),
        ));
    }
    to = to.min(furthest);
    if to < from {
        return Err(Error::bad_input(
            "notAfter",
            "`notAfter` (the latest start) is before now",
        ));
    }
    let gpu = gpu_charge(&req.allocations);
    if let (Some(max), Some(t)) = (rules.max_future_gpu_hours, tenant) {
        let asked = gpu * secs as f64 / 3600.0;
        if gate.held_gpu_hours + asked > max + 1e-9 {
            return Err(Error::PolicyViolation {
                rule: "maxFutureGpuHours".into(),
                limit: json!(max),
                message: format!(
                    "pool {} allows a tenant at most {max} GPU-hours booked ahead; tenant {t} holds {:.3} and asks {asked:.3}",
                    req.pool_id, gate.held_gpu_hours
                ),
            });
        }
    }
    if let Some(t) = tenant {
        check_quota(conn, t, req, &gate, gpu).await?;
    }
    Ok((from, to))
}

fn found_to_answer(
    req: &AvailabilityRequest,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    nodes: Vec<CalNode>,
    read: std::time::Duration,
    started: std::time::Instant,
) -> Result<Availability> {
    let secs = req.duration.num_seconds();
    let d = req.duration.num_microseconds().unwrap_or(i64::MAX / 4);
    let needs: Vec<Need> = req.allocations.iter().map(Need::of).collect();
    let from_us = from.timestamp_micros();
    let to_us = to.timestamp_micros();
    let at = |us: i64| DateTime::<Utc>::from_timestamp_micros(us).unwrap_or(from);
    let found = search(
        &nodes,
        &needs,
        req.gang.as_ref(),
        d,
        from_us,
        to_us,
        req.first,
        SEARCH_BUDGET,
    );
    tracing::debug!(
        nodes = nodes.len(),
        atoms = nodes.iter().map(|n| n.atoms.len()).sum::<usize>(),
        bookings = nodes
            .iter()
            .flat_map(|n| &n.atoms)
            .map(|a| a.busy.len())
            .sum::<usize>(),
        read_ms = read.as_secs_f64() * 1000.0,
        search_ms = (started.elapsed() - read).as_secs_f64() * 1000.0,
        "availability searched"
    );
    let (windows, unfit) = match found {
        Found::TooLarge => {
            return Err(Error::bad_input(
                "allocations",
                format!(
                    "this search examined more than {SEARCH_BUDGET} placements of its allocations \
                     together without an answer; search a shorter range (`notAfter`), fewer \
                     allocations, or a gang that fits the pool's nodes"
                ),
            ));
        }
        Found::Stretches(s) => (
            s.into_iter()
                .map(|s| Window {
                    starts_at: at(s.earliest),
                    ends_at: at(s.earliest) + req.duration,
                    latest_start: at(s.latest),
                    picks: s.picks,
                })
                .collect(),
            None,
        ),
        Found::Nothing(r) => {
            let what = req.allocations[r.allocation].describe();
            let total: i64 = r.counts.iter().map(|c| c.1).sum();
            let detail = r
                .counts
                .iter()
                .map(|(reason, n)| format!("{n} {}", reason_words(reason, &what)))
                .collect::<Vec<_>>()
                .join(", ");
            let message = format!(
                "{}no start from {} to {} in pool {} gives {} for {} seconds{}: 0/{total} nodes fit{}",
                if req.allocations.len() > 1 {
                    format!("allocation {}: ", r.allocation)
                } else {
                    String::new()
                },
                from.to_rfc3339(),
                to.to_rfc3339(),
                req.pool_id,
                what,
                secs,
                req.gang
                    .as_ref()
                    .map(|g| format!(" with the gang {}", g.describe()))
                    .unwrap_or_default(),
                if detail.is_empty() {
                    String::new()
                } else {
                    format!(" ({detail})")
                }
            );
            (
                Vec::new(),
                Some(Unfit {
                    allocation: r.allocation,
                    counts: r.counts,
                    message,
                }),
            )
        }
    };
    Ok(Availability {
        searched_from: from,
        searched_to: to,
        windows,
        unfit,
    })
}

fn reason_words(reason: &str, what: &str) -> String {
    match reason {
        "NodeRetired" => "retired".into(),
        "NodeCordoned" => "cordoned".into(),
        "NodeUnreachable" => "unreachable".into(),
        "NodeLost" => "lost".into(),
        "NodeSelectorMismatch" => "without the labels asked for".into(),
        "TaintNotTolerated" => "with an untolerated taint".into(),
        "InsufficientGpus" => format!("never with {what} free for the whole window"),
        "InsufficientVcpu" => "short of vCPU".into(),
        "InsufficientMemory" => "short of memory".into(),
        "InsufficientDisk" => "short of disk".into(),
        "AllocationsConflict" => "able to take each allocation alone, never all together".into(),
        other => other.to_owned(),
    }
}

/// The tenant's quota rows on the pool and its site, as `createReservation` charges them: a row
/// that this request would take past its limit refuses it now, whatever the window.
async fn check_quota(
    conn: &mut PgConnection,
    tenant: &str,
    req: &AvailabilityRequest,
    gate: &Gate,
    gpu: f64,
) -> Result<()> {
    let vcpu: i64 = req.allocations.iter().map(|a| a.vcpu).sum();
    let memory: i64 = req.allocations.iter().map(|a| a.memory_mib).sum();
    let rows: Vec<(String, String, String, f64, f64)> = sqlx::query_as(
        "SELECT q.scope_kind, q.scope_id, q.resource, q.used::float8, q.max_amount::float8
           FROM quota_usage q
          WHERE q.tenant_id = $1 AND ((q.scope_kind = 'pool' AND q.scope_id = $2) OR (q.scope_kind = 'site' AND q.scope_id = $3))
          ORDER BY q.scope_kind, q.scope_id, q.resource",
    )
    .bind(tenant)
    .bind(req.pool_id.as_str())
    .bind(&gate.site_id)
    .fetch_all(&mut *conn)
    .await?;
    for (kind, scope, resource, used, max) in rows {
        let (asked, words) = match resource.as_str() {
            "gpu" => (gpu, "GPUs"),
            "vcpu" => (vcpu as f64, "vCPU"),
            _ => (memory as f64, "MiB of memory"),
        };
        if asked > 0.0 && used + asked > max + 1e-9 {
            return Err(Error::QuotaExceeded(format!(
                "quota exceeded: tenant {tenant} would hold {} of its {} {words} on {kind} {scope} (holds {}, asks {})",
                amount(used + asked),
                amount(max),
                amount(used),
                amount(asked)
            )));
        }
    }
    Ok(())
}

fn amount(x: f64) -> String {
    let s = format!("{:.6}", x);
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// A node of the calendar as read: its id, reasons, free scalars, the gang label's value, and its
/// atoms as parallel arrays (names, allocations served, creation; with a grouping allocation,
/// each atom's device, NVLink domain and NUMA node).
#[derive(sqlx::FromRow)]
struct CalRow {
    id: NodeId,
    ruled_out: Vec<String>,
    vcpu: Option<i64>,
    memory: Option<i64>,
    disk: Option<i64>,
    label: Option<String>,
    names: Option<Vec<String>>,
    serves: Option<Vec<i32>>,
    created: Option<Vec<DateTime<Utc>>>,
    devs: Option<Vec<String>>,
    nvls: Option<Vec<Option<String>>>,
    numas: Option<Vec<Option<i32>>>,
}

/// The node read for `n` allocations (1 to [`MAX_ALLOCATIONS`]), built once per count: `$1` the
/// pool, `$2` the end of the searched range, `$3` the gang's label (or null), `$4` whether atoms
/// carry their device's topology; then, for allocation `i`, `$5 + 6i` … `$10 + 6i`: its kind,
/// model, MIG profile, slots per GPU, node selector and tolerations. Each test is an expression
/// of the row (an atom's `serves` bit `i`, a node's reason at `i`), not a subquery per row over
/// the allocations, which cost the read a third of its time at 10,000 atoms.
fn node_read_sql(n: usize) -> &'static str {
    static SQL: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let all = SQL.get_or_init(|| (1..=MAX_ALLOCATIONS).map(build_node_read_sql).collect());
    &all[n.clamp(1, MAX_ALLOCATIONS) - 1]
}

fn build_node_read_sql(n: usize) -> String {
    let p = |i: usize, k: usize| 5 + 6 * i + k;
    let serves = (0..n)
        .map(|i| {
            format!(
                "CASE WHEN a.kind = ${kind} AND (${model}::text IS NULL OR d.model = ${model}) \
                 AND (${profile}::text IS NULL OR a.profile = ${profile}) \
                 AND (${slots}::integer IS NULL OR (d.layout->>'slots')::integer = ${slots}) THEN {bit} ELSE 0 END",
                kind = p(i, 0),
                model = p(i, 1),
                profile = p(i, 2),
                slots = p(i, 3),
                bit = 1u32 << i,
            )
        })
        .collect::<Vec<_>>()
        .join(" | ");
    let reasons = (0..n)
        .map(|i| {
            format!(
                "CASE WHEN n.lifecycle = 'retired' THEN 'NodeRetired' \
                      WHEN n.lifecycle = 'cordoned' THEN 'NodeCordoned' \
                      WHEN n.reachability = 'unreachable' THEN 'NodeUnreachable' \
                      WHEN n.reachability = 'lost' THEN 'NodeLost' \
                      WHEN NOT compute_node_schedulable(n.lifecycle, n.reachability) THEN 'NodeUnschedulable' \
                      WHEN NOT n.labels @> ${sel}::jsonb THEN 'NodeSelectorMismatch' \
                      WHEN NOT (n.taints = '[]'::jsonb OR compute_taints_tolerated(n.taints, ${tol}::jsonb)) THEN 'TaintNotTolerated' \
                      ELSE '' END",
                sel = p(i, 4),
                tol = p(i, 5),
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
WITH res AS MATERIALIZED (
    SELECT r.node_id,
           max(floor(r.allocatable * r.ratio)::bigint - r.allocated) FILTER (WHERE r.resource = 'vcpu') AS vcpu,
           max(floor(r.allocatable * r.ratio)::bigint - r.allocated) FILTER (WHERE r.resource = 'memory_mib') AS memory,
           max(floor(r.allocatable * r.ratio)::bigint - r.allocated) FILTER (WHERE r.resource = 'disk_gib') AS disk
      FROM node_resources r JOIN nodes n ON n.id = r.node_id
     WHERE n.pool_id = $1
     GROUP BY r.node_id),
g AS MATERIALIZED (
    SELECT d.node_id, array_agg(a.name) AS names, array_agg(x.serves) AS serves, array_agg(a.created_at) AS created,
           array_agg(d.id) FILTER (WHERE $4) AS devs, array_agg(d.nvlink_domain) FILTER (WHERE $4) AS nvls,
           array_agg(d.numa_node) FILTER (WHERE $4) AS numas
      FROM nodes n JOIN devices d ON d.node_id = n.id JOIN device_atoms a ON a.device_id = d.id,
           LATERAL (SELECT ({serves})::integer AS serves) x
     WHERE n.pool_id = $1 AND compute_device_schedulable(d.health, d.quarantined)
       AND a.created_at < $2 AND x.serves <> 0
     GROUP BY d.node_id)
SELECT n.id, ARRAY[{reasons}]::text[] AS ruled_out, res.vcpu, res.memory, res.disk, n.labels->>$3 AS label,
       g.names, g.serves, g.created, g.devs, g.nvls, g.numas
  FROM nodes n LEFT JOIN res ON res.node_id = n.id LEFT JOIN g ON g.node_id = n.id
 WHERE n.pool_id = $1
 ORDER BY n.id"#
    )
}

/// The pool's nodes for `req`'s allocations, each with the reasons that rule it out, its free
/// scalars and the atoms that could serve an allocation (existing before `until`), in one
/// statement of hash joins over the pool's rows, and an index from atom name to (node, atom).
///
/// An atom serves allocation `i` under the conditions `compute_free_atoms` places with (kind,
/// model, MIG profile, slots of the GPU), on a device `compute_device_schedulable` lets through;
/// a node's reasons are those `compute_place` counts, in its order.
async fn read_nodes(
    conn: &mut PgConnection,
    req: &AvailabilityRequest,
    until: DateTime<Utc>,
) -> Result<(Vec<CalNode>, AtomIndex)> {
    let grouped = req
        .allocations
        .iter()
        .any(|a| a.same_nvlink_domain || a.same_numa_node);
    let mut query = sqlx::query_as::<_, CalRow>(node_read_sql(req.allocations.len()))
        .bind(req.pool_id.as_str())
        .bind(until)
        .bind(match &req.gang {
            Some(Gang {
                colocate: Some(Colocate::Label),
                label,
                ..
            }) => label.clone(),
            _ => None,
        })
        .bind(grouped);
    for a in &req.allocations {
        query = query
            .bind(a.gpu_kind.as_str())
            .bind(a.model.as_deref())
            .bind(a.profile.as_deref())
            .bind(a.slots_per_gpu)
            .bind(serde_json::to_value(&a.node_selector).unwrap_or_default())
            .bind(serde_json::to_value(&a.tolerations).unwrap_or_default());
    }
    let rows: Vec<CalRow> = query.fetch_all(&mut *conn).await?;
    let mut nodes: Vec<CalNode> = Vec::with_capacity(rows.len());
    let mut index: AtomIndex = AtomIndex::with_capacity(rows.len() * 8);
    for row in rows {
        let mut atoms = Vec::new();
        if let (Some(names), Some(serves), Some(created)) = (row.names, row.serves, row.created) {
            let devs = row.devs.unwrap_or_default();
            let nvls = row.nvls.unwrap_or_default();
            let numas = row.numas.unwrap_or_default();
            // Group numbers per node, in the order the groups are met.
            let mut groups: HashMap<String, u32> = HashMap::new();
            for (k, ((name, serves), created)) in
                names.into_iter().zip(serves).zip(created).enumerate()
            {
                let group = if grouped {
                    let dev = devs.get(k).map(String::as_str).unwrap_or("");
                    req.allocations
                        .iter()
                        .map(|a| {
                            let key = group_key(
                                a,
                                dev,
                                nvls.get(k).cloned().flatten().as_deref(),
                                numas.get(k).copied().flatten(),
                            );
                            let n = groups.len() as u32;
                            *groups.entry(key).or_insert(n)
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                index.insert(name, (nodes.len(), k));
                atoms.push(CalAtom {
                    serves: serves as u32,
                    created: created.timestamp_micros(),
                    busy: Vec::new(),
                    group,
                });
            }
        }
        nodes.push(CalNode {
            id: row.id,
            ruled_out: row
                .ruled_out
                .into_iter()
                .map(|r| (!r.is_empty()).then_some(r))
                .collect(),
            free_vcpu: row.vcpu,
            free_memory_mib: row.memory,
            free_disk_gib: row.disk,
            atoms,
            label: row.label,
        });
    }
    Ok((nodes, index))
}

/// The group an atom of device `dev` belongs to for allocation `a`, as `compute_free_atoms`
/// keys it: the NVLink domain and/or the NUMA node kept together, a device of unknown topology a
/// group of its own; one group for an allocation that keeps nothing together.
fn group_key(a: &AllocationRequest, dev: &str, nvl: Option<&str>, numa: Option<i32>) -> String {
    let own = || format!("gpu:{dev}");
    let mut parts = Vec::new();
    if a.same_nvlink_domain {
        parts.push(nvl.map_or_else(own, |d| format!("nvl:{d}")));
    }
    if a.same_numa_node {
        parts.push(numa.map_or_else(own, |n| format!("numa:{n}")));
    }
    parts.join("/")
}

type AtomIndex = std::collections::HashMap<String, (usize, usize)>;
type Booking = (String, DateTime<Utc>, Option<DateTime<Utc>>);

/// The statement that reads a pool's bookings overlapping `[$2, $3)` (`$1` the pool); public
/// so that `bench-availability` prints its plan at scale.
pub const POOL_BOOKINGS: &str =
    "SELECT b.atom, lower(b.during), upper(b.during) FROM device_bookings b
  WHERE b.pool_id = $1 AND b.during && tstzrange($2, $3)";

/// The pool's bookings that overlap `[from, until)`: by `device_bookings_pool_during`
/// (migration 0035) when they are a small part of the table, so neither the fleet's history nor
/// another pool's bookings are read; a table scan when they are most of it.
async fn read_bookings(
    conn: &mut PgConnection,
    pool: &PoolId,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<Vec<Booking>> {
    Ok(sqlx::query_as(POOL_BOOKINGS)
        .bind(pool.as_str())
        .bind(from)
        .bind(until)
        .fetch_all(&mut *conn)
        .await?)
}

/// Each booking on its atom, in microseconds; those of atoms the request cannot use are dropped.
fn with_bookings(
    (mut nodes, index): (Vec<CalNode>, AtomIndex),
    bookings: Vec<Booking>,
) -> Vec<CalNode> {
    for (atom, lower, upper) in bookings {
        if let Some(&(n, a)) = index.get(&atom) {
            nodes[n].atoms[a].busy.push((
                lower.timestamp_micros(),
                upper.map_or(i64::MAX, |u| u.timestamp_micros()),
            ));
        }
    }
    nodes
}

/// The most steps a capacity timeline has.
pub const MAX_STEPS: i64 = 1_000;

/// A parsed `capacityTimeline` question.
#[derive(Debug, Clone)]
pub struct TimelineRequest {
    pub pool_id: PoolId,
    pub from: DateTime<Utc>,
    pub step: Duration,
    pub steps: i64,
    pub kind: m::AtomKind,
    pub model: Option<String>,
}

/// Parses the arguments of `capacityTimeline`: at most [`MAX_STEPS`] steps of at least a minute.
pub fn parse_timeline(
    pool_id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    step_seconds: i64,
    kind: Option<m::AtomKind>,
    model: Option<&str>,
) -> Result<TimelineRequest> {
    let pool_id = PoolId::parse("poolId", pool_id)?;
    let from = m::parse_time("from", from)?;
    let to = m::parse_time("to", to)?;
    if to <= from {
        return Err(Error::bad_input("to", "`to` must be after `from`"));
    }
    let step_seconds = m::parse_count("stepSeconds", step_seconds, 60, 31 * 86_400)?;
    // In microseconds, rounded up: the last step ends at or after `to`, also when the range
    // is not a whole number of seconds.
    let span_us = (to - from).num_microseconds().unwrap_or(i64::MAX);
    let step_us = step_seconds * 1_000_000;
    let steps = span_us / step_us + i64::from(span_us % step_us != 0);
    if steps > MAX_STEPS {
        return Err(Error::bad_input(
            "stepSeconds",
            format!(
                "{steps} steps of {step_seconds} seconds from `from` to `to`; a timeline has at most {MAX_STEPS}: take longer steps or a shorter range"
            ),
        ));
    }
    Ok(TimelineRequest {
        pool_id,
        from,
        step: Duration::seconds(step_seconds),
        steps,
        kind: kind.unwrap_or(m::AtomKind::Gpu),
        model: model.map(|s| m::parse_name("model", s)).transpose()?,
    })
}

/// One step of a capacity timeline: the pool's atoms of the kind (and model) asked for.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Step {
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    /// Atoms on the pool's nodes that are not retired.
    pub total: i64,
    /// Atoms with a booking that overlaps the step (an allocation or a maintenance hold).
    pub booked: i64,
    /// Atoms free for the whole step on a schedulable node and device.
    pub free: i64,
    /// Atoms not booked in the step but not schedulable now (a cordoned, unreachable or lost
    /// node, an unhealthy or quarantined device).
    pub unavailable: i64,
}

/// Free and booked atoms per step: one statement that reads the pool's atoms and the pool's
/// bookings that overlap the range (`device_bookings_pool_during`), each booking counted in the
/// steps it overlaps. Nobody's bookings are named.
#[tracing::instrument(level = "debug", skip_all, fields(pool = %req.pool_id))]
pub async fn capacity_timeline(db: &Db, req: &TimelineRequest) -> Result<Vec<Step>> {
    let req = req.clone();
    db.tx("capacity_timeline", TxKind::Read, move |conn| {
        let req = req.clone();
        Box::pin(async move {
            let found: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM pools WHERE id = $1")
                .bind(req.pool_id.as_str())
                .fetch_optional(&mut *conn)
                .await?;
            if found.is_none() {
                return Err(Error::NotFound {
                    kind: "pool",
                    id: req.pool_id.to_string(),
                });
            }
            let to = req.from + req.step * req.steps as i32;
            let steps: Vec<Step> = sqlx::query_as(
                r#"
WITH atoms AS MATERIALIZED (
    SELECT a.name, compute_node_schedulable(n.lifecycle, n.reachability) AND compute_device_schedulable(d.health, d.quarantined) AS usable
      FROM nodes n JOIN devices d ON d.node_id = n.id JOIN device_atoms a ON a.device_id = d.id
     WHERE n.pool_id = $1 AND n.lifecycle <> 'retired' AND a.kind = $2 AND ($3::text IS NULL OR d.model = $3)),
totals AS (SELECT count(*) AS total, count(*) FILTER (WHERE usable) AS usable FROM atoms),
-- Each booking's steps, first to last; an atom's bookings never overlap in time, so two of them
-- share at most the steps where one ends and the next begins.
bk AS (
    SELECT a.usable,
           greatest(0, floor(extract(epoch FROM lower(b.during) - $4) / $6))::integer AS i0,
           least($7 - 1, ceil(extract(epoch FROM least(coalesce(upper(b.during), $5), $5) - $4) / $6) - 1)::integer AS i1,
           lag(least($7 - 1, ceil(extract(epoch FROM least(coalesce(upper(b.during), $5), $5) - $4) / $6) - 1)::integer)
               OVER (PARTITION BY b.atom ORDER BY lower(b.during)) AS prev_i1
      FROM device_bookings b
      JOIN atoms a ON a.name = b.atom
     WHERE b.pool_id = $1 AND b.during && tstzrange($4, $5)),
-- Atoms booked per step as differences: +1 where a booking's steps begin, -1 after they end, and
-- the steps it shares with the atom's previous booking taken back once, so an atom counts once.
d AS (
    SELECT i0 AS i, 1 AS dv, usable FROM bk
    UNION ALL SELECT i1 + 1, -1, usable FROM bk
    UNION ALL SELECT i0, -1, usable FROM bk WHERE i0 <= prev_i1
    UNION ALL SELECT prev_i1 + 1, 1, usable FROM bk WHERE i0 <= prev_i1),
busy AS (
    SELECT i, coalesce(sum(dv) FILTER (WHERE usable), 0) AS usable, coalesce(sum(dv) FILTER (WHERE NOT usable), 0) AS unusable
      FROM d GROUP BY i),
series AS (
    SELECT s.i, sum(coalesce(b.usable, 0)) OVER w AS bu, sum(coalesce(b.unusable, 0)) OVER w AS bn
      FROM generate_series(0, $7 - 1) AS s(i) LEFT JOIN busy b ON b.i = s.i
    WINDOW w AS (ORDER BY s.i))
SELECT $4 + make_interval(secs => s.i * $6) AS starts_at, $4 + make_interval(secs => (s.i + 1) * $6) AS ends_at,
       t.total, (s.bu + s.bn)::bigint AS booked, (t.usable - s.bu)::bigint AS free,
       (t.total - t.usable - s.bn)::bigint AS unavailable
  FROM series s CROSS JOIN totals t
 ORDER BY s.i"#,
            )
            .bind(req.pool_id.as_str())
            .bind(req.kind.as_str())
            .bind(req.model.as_deref())
            .bind(req.from)
            .bind(to)
            .bind(req.step.num_seconds() as f64)
            .bind(req.steps as i32)
            .fetch_all(&mut *conn)
            .await?;
            Ok(steps)
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so a failing case can be run again.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> i64 {
            (self.next() % n) as i64
        }
    }

    const MIN: i64 = 60_000_000;

    fn node(i: usize, atoms: Vec<CalAtom>) -> CalNode {
        CalNode {
            id: NodeId::from_trusted(&format!("node_{i:032x}")).expect("id"),
            ruled_out: vec![None; MAX_ALLOCATIONS],
            free_vcpu: None,
            free_memory_mib: None,
            free_disk_gib: None,
            atoms,
            label: None,
        }
    }

    fn atom(busy: &[(i64, i64)]) -> CalAtom {
        CalAtom {
            serves: u32::MAX,
            created: 0,
            busy: busy.iter().map(|&(a, b)| (a * MIN, b * MIN)).collect(),
            group: vec![],
        }
    }

    fn gpus(n: usize) -> Need {
        Need {
            atoms: n,
            vcpu: 0,
            memory_mib: 0,
            disk_gib: 0,
        }
    }

    fn stretches(found: Found) -> Vec<(i64, i64)> {
        match found {
            Found::Stretches(s) => s
                .iter()
                .map(|s| (s.earliest / MIN, s.latest / MIN))
                .collect(),
            Found::Nothing(_) => Vec::new(),
            Found::TooLarge => panic!("a small calendar went past the search's budget"),
        }
    }

    /// A gang that never fits in a busy pool: refused at once when no node has as many atoms as
    /// it asks, and once its budget is spent otherwise; never a search of every node at every
    /// edge of the calendar (10^12 steps at 1,250 nodes).
    #[test]
    fn a_gang_that_never_fits_is_refused_within_the_budget() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        const SEC: i64 = 1_000_000;
        // 200 nodes of 8 atoms: 4 busy throughout, 4 with short bookings at odd seconds (each
        // edge its own time).
        let nodes: Vec<CalNode> = (0..200)
            .map(|i| {
                let atoms = (0..8)
                    .map(|k| {
                        let mut a = atom(&[]);
                        if k < 4 {
                            a.busy = vec![(0, 1_000_000 * SEC)];
                            return a;
                        }
                        let mut t = rng.below(1_200) * SEC;
                        while t < 100_000 * SEC {
                            let len = (60 + rng.below(1_800)) * SEC + rng.below(SEC as u64);
                            a.busy.push((t, t + len));
                            t += len + (1 + rng.below(1_800)) * SEC;
                        }
                        a
                    })
                    .collect();
                node(i, atoms)
            })
            .collect();
        let on_one_node = Gang {
            colocate: Some(Colocate::Node),
            label: None,
            spread: false,
        };
        let (from, to) = (0, 90_000 * SEC);
        // Sixteen single GPUs on one node of 8: no node can ever take them, nothing is tried.
        let found = search(
            &nodes,
            &vec![gpus(1); 16],
            Some(&on_one_node),
            60 * SEC,
            from,
            to,
            5,
            1,
        );
        assert!(
            matches!(&found, Found::Nothing(r) if r.counts == vec![("AllocationsConflict".to_owned(), 200)]),
            "{found:?}"
        );
        // Two of 4 on one node: each fits on some nodes at times, both never (4 are always
        // busy). Refused when the budget is spent, and answered in full with a budget that
        // covers the search.
        let found = search(
            &nodes,
            &[gpus(4), gpus(4)],
            Some(&on_one_node),
            60 * SEC,
            from,
            to,
            5,
            100_000,
        );
        assert_eq!(found, Found::TooLarge);
        let found = search(
            &nodes,
            &[gpus(4), gpus(4)],
            Some(&on_one_node),
            60 * SEC,
            from,
            to,
            5,
            SEARCH_BUDGET,
        );
        assert!(matches!(found, Found::Nothing(_)), "{found:?}");
    }

    #[test]
    fn a_window_opens_when_enough_atoms_are_free_for_the_whole_duration() {
        // Two atoms: one busy [10, 20), the other [15, 30). Two GPUs for 5 minutes fit at
        // starts 0..=5 (both free until 10) and from 30 on.
        let nodes = vec![node(0, vec![atom(&[(10, 20)]), atom(&[(15, 30)])])];
        let found = search(
            &nodes,
            &[gpus(2)],
            None,
            5 * MIN,
            0,
            100 * MIN,
            5,
            SEARCH_BUDGET,
        );
        assert_eq!(stretches(found), vec![(0, 5), (30, 100)]);
        // One GPU: 0..=10 on the second atom, 20.. on the first; a start between 10 and 20
        // meets a booking on each.
        let found = search(
            &nodes,
            &[gpus(1)],
            None,
            5 * MIN,
            0,
            100 * MIN,
            5,
            SEARCH_BUDGET,
        );
        assert_eq!(stretches(found), vec![(0, 10), (20, 100)]);
        // At most `first` windows.
        let found = search(
            &nodes,
            &[gpus(1)],
            None,
            5 * MIN,
            0,
            100 * MIN,
            1,
            SEARCH_BUDGET,
        );
        assert_eq!(stretches(found), vec![(0, 10)]);
        // Three GPUs never fit: the counts say why.
        match search(
            &nodes,
            &[gpus(3)],
            None,
            5 * MIN,
            0,
            100 * MIN,
            5,
            SEARCH_BUDGET,
        ) {
            Found::Nothing(r) => assert_eq!(r.counts, vec![("InsufficientGpus".to_owned(), 1)]),
            other => panic!("expected nothing, got {other:?}"),
        }
    }

    #[test]
    fn a_node_ruled_out_or_short_of_scalars_takes_nothing() {
        let mut cordoned = node(0, vec![atom(&[])]);
        cordoned.ruled_out[0] = Some("NodeCordoned".into());
        let mut small = node(1, vec![atom(&[])]);
        small.free_vcpu = Some(4);
        let need = Need {
            atoms: 1,
            vcpu: 8,
            memory_mib: 0,
            disk_gib: 0,
        };
        match search(
            &[cordoned, small.clone()],
            &[need],
            None,
            MIN,
            0,
            10 * MIN,
            5,
            SEARCH_BUDGET,
        ) {
            Found::Nothing(r) => assert_eq!(
                r.counts,
                vec![
                    ("InsufficientVcpu".to_owned(), 1),
                    ("NodeCordoned".to_owned(), 1)
                ]
            ),
            other => panic!("expected nothing, got {other:?}"),
        }
        small.free_vcpu = Some(8);
        assert_eq!(
            stretches(search(
                &[small],
                &[need],
                None,
                MIN,
                0,
                10 * MIN,
                5,
                SEARCH_BUDGET
            )),
            vec![(0, 10)]
        );
    }

    /// The whole request at `s`, by brute force: every way to put each allocation on a node,
    /// atoms counted per node and never shared.
    fn fits_brute(nodes: &[CalNode], needs: &[Need], s: i64, d: i64) -> bool {
        let free: Vec<usize> = nodes
            .iter()
            .map(|n| {
                n.atoms
                    .iter()
                    .filter(|a| {
                        a.created <= s && a.busy.iter().all(|&(b0, b1)| b1 <= s || s + d <= b0)
                    })
                    .count()
            })
            .collect();
        fn place(i: usize, needs: &[Need], left: &mut Vec<usize>) -> bool {
            if i == needs.len() {
                return true;
            }
            for n in 0..left.len() {
                if left[n] >= needs[i].atoms {
                    left[n] -= needs[i].atoms;
                    let ok = place(i + 1, needs, left);
                    left[n] += needs[i].atoms;
                    if ok {
                        return true;
                    }
                }
            }
            false
        }
        place(0, needs, &mut free.clone())
    }

    /// The stretches of starts in `[from, to]` at which `fits`, in minutes, the first 20: starts
    /// every half minute, as events fall on whole minutes (or a microsecond after), so the half
    /// minutes see every gap between two stretches.
    fn brute_stretches(from: i64, to: i64, fits: impl Fn(i64) -> bool) -> Vec<(i64, i64)> {
        const HALF: i64 = MIN / 2;
        let mut expected = Vec::new();
        let mut open: Option<i64> = None;
        let mut last = from;
        for k in from / HALF..=to / HALF {
            let s = k * HALF;
            match (open, fits(s)) {
                (None, true) => open = Some(s),
                (Some(o), false) => {
                    expected.push((o / MIN, last / MIN));
                    open = None;
                }
                _ => {}
            }
            last = s;
        }
        if let Some(o) = open {
            expected.push((o / MIN, to / MIN));
        }
        expected.truncate(20);
        expected
    }

    /// Against a brute force over every minute of small random calendars: the windows returned
    /// are exactly the stretches of minutes at which the request fits, earliest first. Bookings,
    /// creation times and durations are whole minutes, so checking each minute checks every start.
    #[test]
    fn the_windows_are_the_true_stretches_of_a_random_calendar() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..400 {
            let n_nodes = 1 + rng.below(4) as usize;
            let nodes: Vec<CalNode> = (0..n_nodes)
                .map(|i| {
                    let atoms = (0..1 + rng.below(4))
                        .map(|_| {
                            let mut t = rng.below(20);
                            let mut busy = Vec::new();
                            while t < 120 {
                                let len = 1 + rng.below(25);
                                busy.push((t, t + len));
                                t += len + rng.below(30);
                            }
                            let mut a = atom(&busy);
                            a.created = if rng.below(5) == 0 {
                                rng.below(60) * MIN
                            } else {
                                0
                            };
                            a
                        })
                        .collect();
                    node(i, atoms)
                })
                .collect();
            let n_alloc = if rng.below(3) == 0 { 2 } else { 1 };
            let needs: Vec<Need> = (0..n_alloc)
                .map(|_| gpus(1 + rng.below(3) as usize))
                .collect();
            let d = (1 + rng.below(30)) * MIN;
            let (from, to) = (rng.below(30) * MIN, (60 + rng.below(80)) * MIN);
            let expected = brute_stretches(from, to, |s| fits_brute(&nodes, &needs, s, d));
            let got = stretches(search(&nodes, &needs, None, d, from, to, 20, SEARCH_BUDGET));
            assert_eq!(got, expected, "case {case}: needs {needs:?}, d {}", d / MIN);
        }
    }

    /// Free atoms of `node` over `[s, s + d)`, per group for allocation 0.
    fn free_at(node: &CalNode, s: i64, d: i64) -> Vec<u32> {
        node.atoms
            .iter()
            .filter(|a| a.created <= s && a.busy.iter().all(|&(b0, b1)| b1 <= s || s + d <= b0))
            .map(|a| a.group.first().copied().unwrap_or(0))
            .collect()
    }

    /// The request at `s` by brute force: one allocation keeping its GPUs in one group, or
    /// several under a gang's rule, every way to put them on nodes.
    fn fits_gang_brute(
        nodes: &[CalNode],
        needs: &[Need],
        gang: Option<&Gang>,
        s: i64,
        d: i64,
    ) -> bool {
        let free: Vec<Vec<u32>> = nodes.iter().map(|n| free_at(n, s, d)).collect();
        if gang.is_none() {
            // One allocation: a group of one node with enough.
            return free.iter().any(|f| {
                let mut per: BTreeMap<u32, usize> = BTreeMap::new();
                for g in f {
                    *per.entry(*g).or_default() += 1;
                }
                per.values().any(|&n| n >= needs[0].atoms)
            });
        }
        let g = gang.expect("a gang");
        fn place(
            i: usize,
            needs: &[Need],
            left: &mut Vec<usize>,
            chosen: &mut Vec<usize>,
            ok: &dyn Fn(&[usize]) -> bool,
        ) -> bool {
            if i == needs.len() {
                return ok(chosen);
            }
            for n in 0..left.len() {
                if left[n] >= needs[i].atoms {
                    left[n] -= needs[i].atoms;
                    chosen.push(n);
                    let done = place(i + 1, needs, left, chosen, ok);
                    chosen.pop();
                    left[n] += needs[i].atoms;
                    if done {
                        return true;
                    }
                }
            }
            false
        }
        let rule = |chosen: &[usize]| {
            let distinct: BTreeSet<usize> = chosen.iter().copied().collect();
            let labels: BTreeSet<Option<&str>> =
                chosen.iter().map(|&n| nodes[n].label.as_deref()).collect();
            (!g.spread || distinct.len() == chosen.len())
                && match g.colocate {
                    Some(Colocate::Node) => distinct.len() == 1,
                    Some(Colocate::Label) => labels.len() == 1 && !labels.contains(&None),
                    None => true,
                }
        };
        let mut left: Vec<usize> = free.iter().map(Vec::len).collect();
        place(0, needs, &mut left, &mut Vec::new(), &rule)
    }

    /// As [`the_windows_are_the_true_stretches_of_a_random_calendar`], for an allocation that
    /// keeps its GPUs on one group (NVLink domain or NUMA node) and for gangs colocated on one
    /// node, on one label's value, or spread over distinct nodes (and both): the windows are the
    /// stretches a brute force finds.
    #[test]
    fn groups_and_gangs_find_the_true_stretches_of_a_random_calendar() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let gangs = [
            Gang {
                colocate: Some(Colocate::Node),
                label: None,
                spread: false,
            },
            Gang {
                colocate: None,
                label: None,
                spread: true,
            },
            Gang {
                colocate: Some(Colocate::Label),
                label: Some("rack".into()),
                spread: false,
            },
            Gang {
                colocate: Some(Colocate::Label),
                label: Some("rack".into()),
                spread: true,
            },
        ];
        for case in 0..600 {
            let n_nodes = 1 + rng.below(4) as usize;
            let nodes: Vec<CalNode> = (0..n_nodes)
                .map(|i| {
                    let atoms = (0..1 + rng.below(5))
                        .map(|_| {
                            let mut t = rng.below(20);
                            let mut busy = Vec::new();
                            while t < 120 {
                                let len = 1 + rng.below(25);
                                busy.push((t, t + len));
                                t += len + rng.below(30);
                            }
                            let mut a = atom(&busy);
                            a.group = vec![rng.below(3) as u32];
                            a
                        })
                        .collect();
                    let mut n = node(i, atoms);
                    n.label = (rng.below(4) != 0).then(|| format!("r{}", rng.below(2)));
                    n
                })
                .collect();
            let gang = (case % 2 == 1).then(|| gangs[(case / 2) % gangs.len()].clone());
            let needs: Vec<Need> = if gang.is_some() {
                (0..2 + rng.below(2))
                    .map(|_| gpus(1 + rng.below(2) as usize))
                    .collect()
            } else {
                vec![gpus(1 + rng.below(3) as usize)]
            };
            // Gangs here keep nothing together: one group per node for them.
            let nodes: Vec<CalNode> = if gang.is_some() {
                nodes
                    .into_iter()
                    .map(|mut n| {
                        n.atoms.iter_mut().for_each(|a| a.group.clear());
                        n
                    })
                    .collect()
            } else {
                nodes
            };
            let d = (1 + rng.below(30)) * MIN;
            let (from, to) = (rng.below(30) * MIN, (60 + rng.below(80)) * MIN);
            let expected = brute_stretches(from, to, |s| {
                fits_gang_brute(&nodes, &needs, gang.as_ref(), s, d)
            });
            let got = stretches(search(
                &nodes,
                &needs,
                gang.as_ref(),
                d,
                from,
                to,
                20,
                SEARCH_BUDGET,
            ));
            assert_eq!(
                got,
                expected,
                "case {case}: gang {gang:?}, needs {needs:?}, d {}",
                d / MIN
            );
        }
    }
}
