//! Who is calling: decided once, at the door, from a verified token, and read by every rule
//! that depends on it (what a caller may see, whose quota it charges, which idempotency keys are
//! its own), instead of a `bool` passed along beside it.

use crate::ids::TenantId;

/// The authority a caller acts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Authority {
    /// Manages the fleet; sees and acts on every tenant's objects.
    Operator,
    /// Acts only within its own tenant.
    Member,
}

/// A caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// The token's subject, recorded on what it creates.
    pub subject: String,
    pub authority: Authority,
    /// The tenant the token names (checked by [`TenantId::parse`] at the door), if any.
    pub tenant: Option<TenantId>,
}

impl Actor {
    pub fn operator(subject: impl Into<String>) -> Actor {
        Actor {
            subject: subject.into(),
            authority: Authority::Operator,
            tenant: None,
        }
    }

    pub fn member(subject: impl Into<String>, tenant: TenantId) -> Actor {
        Actor {
            subject: subject.into(),
            authority: Authority::Member,
            tenant: Some(tenant),
        }
    }

    pub fn is_operator(&self) -> bool {
        self.authority == Authority::Operator
    }

    /// Whether the caller may see and act on an object of `tenant`.
    pub fn may_access(&self, tenant: &TenantId) -> bool {
        self.is_operator() || self.tenant.as_ref() == Some(tenant)
    }

    /// The tenant whose objects the caller may list: `None` for an operator (every tenant).
    /// A member without a tenant gets `Err`: it may list nothing.
    pub fn visible_tenant(&self) -> Result<Option<&TenantId>, NoTenant> {
        match (self.authority, &self.tenant) {
            (Authority::Operator, _) => Ok(None),
            (Authority::Member, Some(t)) => Ok(Some(t)),
            (Authority::Member, None) => Err(NoTenant),
        }
    }

    /// The scope of the caller's idempotency keys (`idempotency_keys.tenant_id`). A member's is
    /// its tenant; an operator's starts with `:`, which no tenant id can, so no token of one
    /// kind can ever reach a response stored for the other, and a missing tenant collides with
    /// nothing.
    pub(crate) fn idempotency_scope(&self) -> String {
        match (self.authority, &self.tenant) {
            (Authority::Member, Some(t)) => t.as_str().to_owned(),
            (Authority::Member, None) => ":member".to_owned(),
            (Authority::Operator, None) => ":operator".to_owned(),
            (Authority::Operator, Some(t)) => format!(":operator:{t}"),
        }
    }
}

/// A member token that names no tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoTenant;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_scopes_never_collide() {
        let t = TenantId::parse("tenant", "acme").expect("valid");
        let scopes = [
            Actor::member("s", t.clone()).idempotency_scope(),
            Actor {
                subject: "s".into(),
                authority: Authority::Member,
                tenant: None,
            }
            .idempotency_scope(),
            Actor::operator("s").idempotency_scope(),
            Actor {
                subject: "s".into(),
                authority: Authority::Operator,
                tenant: Some(t),
            }
            .idempotency_scope(),
        ];
        let distinct: std::collections::HashSet<_> = scopes.iter().collect();
        assert_eq!(distinct.len(), scopes.len(), "{scopes:?}");
        // No scope but a member's own can be read as a tenant id.
        assert_eq!(
            scopes
                .iter()
                .filter(|s| TenantId::parse("t", s).is_ok())
                .count(),
            1
        );
    }
}
