//! Quota limits in the graph, with what is used of them.

use super::*;

/// A quota limit of a tenant on a pool or site, with what is used of it.
#[derive(SimpleObject)]
#[graphql(complex)]
pub struct Quota {
    /// The tenant.
    tenant_id: String,
    /// The pool or site id it applies to.
    scope_id: ID,
    /// `GPUS` (whole GPUs; MIG instances and slots count as fractions), `VCPU` or `MEMORY_MIB`.
    resource: QuotaResource,
    /// The limit.
    max: f64,
    /// What reservations hold.
    used: f64,
    /// Optimistic-concurrency version.
    version: i64,
    #[graphql(skip)]
    scope_kind: String,
}

#[ComplexObject]
impl Quota {
    /// Whether the scope is a `POOL` or a `SITE`.
    async fn scope_kind(&self) -> &str {
        &self.scope_kind
    }
}

/// A resource a quota limits.
#[derive(Enum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum QuotaResource {
    /// GPUs, fractions for MIG instances and slots.
    Gpus,
    /// Virtual CPUs.
    Vcpu,
    /// Memory in MiB.
    MemoryMib,
}

pub fn quota_obj(q: compute_domain::quota::Quota) -> Quota {
    Quota {
        tenant_id: q.tenant_id.to_string(),
        scope_id: ID(q.scope.to_string()),
        resource: match q.resource {
            compute_domain::quota::QuotaResource::Gpu => QuotaResource::Gpus,
            compute_domain::quota::QuotaResource::Vcpu => QuotaResource::Vcpu,
            compute_domain::quota::QuotaResource::MemoryMib => QuotaResource::MemoryMib,
        },
        max: q.max_amount,
        used: q.used,
        version: q.version,
        scope_kind: q.scope.kind().to_uppercase(),
    }
}
