//! The background side of Better Compute: the lease keeper, the work-queue loop, the reconcilers
//! and outbox delivery, run by the `compute-worker` binary (and in-process by `compute-api dev`).
//!
//! Architecture invariant: no GraphQL here, and no SQL text: statements live in
//! `compute-domain`.
//!
//! Status: the foundation only. Leases, the work queue and the reconcilers are issue 6; until
//! they land, `compute-worker` refuses to start rather than pretend to work.

/// The roles a worker process can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Reconcilers: reservations, capacity rollups, pruning.
    Reconcile,
    /// Webhook delivery from the outbox.
    Outbox,
    /// Every role.
    All,
}

impl Role {
    /// Parses `reconcile`, `outbox` or `all`.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "reconcile" => Some(Role::Reconcile),
            "outbox" => Some(Role::Outbox),
            "all" => Some(Role::All),
            _ => None,
        }
    }
}
