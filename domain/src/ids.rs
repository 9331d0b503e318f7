//! Identifiers: one type per entity, holding a type prefix and a time-ordered body, such as
//! `site_0193a4c1d2e3…`.
//!
//! The body is a UUIDv7 in simple form (48 bits of milliseconds first), so ids sort by creation
//! time and `node(id:)` can route on the prefix. The SQL function `compute_new_id(prefix)` makes
//! ids of the same shape. A value of an id type was either made here, parsed from input (prefix
//! and shape checked), or read from a row (the table's `CHECK` holds the shape), so holding a
//! `NodeId` is proof that it names a node, not a pool.

use crate::error::{Error, Result};

/// The prefixes of the system's entities.
pub const PREFIXES: [&str; 13] = [
    "site", "pool", "node", "dev", "rsv", "alc", "cmd", "ins", "evt", "snk", "njt", "grt", "sa",
];

/// A new id with `prefix`, time-ordered by the wall clock of this process.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
}

/// The prefix of an id, if it has a known one.
pub fn prefix_of(id: &str) -> Option<&'static str> {
    let (prefix, body) = id.split_once('_')?;
    if body.len() != 32 || !body.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    PREFIXES.iter().copied().find(|p| *p == prefix)
}

/// What every entity id type can do, for code generic over them (the API's id arguments).
pub trait EntityId: Sized + Clone + std::fmt::Display {
    /// The prefix of every id of this type.
    const PREFIX: &'static str;

    /// Parses input; `field` names it in the error.
    fn parse(field: &str, s: &str) -> Result<Self>;

    fn as_str(&self) -> &str;
}

macro_rules! entity_id {
    ($(#[$meta:meta])* $name:ident = $prefix:literal, $what:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, sqlx::Type)]
        #[sqlx(transparent)]
        #[serde(transparent)]
        pub struct $name(String);

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                $name::from_trusted(&s).ok_or_else(|| {
                    serde::de::Error::custom(format!("`{s}` is not a {} id", $what))
                })
            }
        }

        impl $name {
            /// The prefix of every id of this type.
            pub const PREFIX: &'static str = $prefix;

            /// A new id, time-ordered by this process's wall clock.
            pub fn generate() -> Self {
                $name(new_id($prefix))
            }

            /// Parses input; `field` names it in the error.
            pub fn parse(field: &str, s: &str) -> Result<Self> {
                if prefix_of(s) == Some($prefix) {
                    Ok($name(s.to_owned()))
                } else {
                    Err(Error::bad_input(
                        field,
                        format!(
                            "`{s}` is not a {} id (expected {}_ and 32 hex digits)",
                            $what, $prefix
                        ),
                    ))
                }
            }

            /// Parses a value this process wrote or read itself (a work-queue key, a stored
            /// reference); `None` when it is not of this type.
            pub fn from_trusted(s: &str) -> Option<Self> {
                (prefix_of(s) == Some($prefix)).then(|| $name(s.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl EntityId for $name {
            const PREFIX: &'static str = $prefix;

            fn parse(field: &str, s: &str) -> Result<Self> {
                $name::parse(field, s)
            }

            fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

entity_id!(
    /// A site's id, `site_…`.
    SiteId = "site", "site"
);
entity_id!(
    /// A pool's id, `pool_…`.
    PoolId = "pool", "pool"
);
entity_id!(
    /// A node's id, `node_…`.
    NodeId = "node", "node"
);
entity_id!(
    /// A GPU's id, `dev_…`.
    DeviceId = "dev", "device"
);
entity_id!(
    /// A reservation's id, `rsv_…`.
    ReservationId = "rsv", "reservation"
);
entity_id!(
    /// An allocation's id, `alc_…`.
    AllocationId = "alc", "allocation"
);
entity_id!(
    /// A command's id, `cmd_…`.
    CommandId = "cmd", "command"
);
entity_id!(
    /// An instance's id, `ins_…`.
    InstanceId = "ins", "instance"
);
entity_id!(
    /// An outbox event's id, `evt_…`.
    EventId = "evt", "event"
);
entity_id!(
    /// An event sink's id, `snk_…`.
    SinkId = "snk", "sink"
);
entity_id!(
    /// A node join token's id, `njt_…` (not its secret).
    JoinTokenId = "njt", "join token"
);
entity_id!(
    /// A grant's id, `grt_…`.
    GrantId = "grt", "grant"
);
entity_id!(
    /// A service account's id, `sa_…` (not its token).
    ServiceAccountId = "sa", "service account"
);

/// A tenant's id: 1 to 63 of letters, digits, `_`, `.`, `-`, starting with a letter or digit.
/// Tenants are named by the identity provider, not made here, so it has no prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, sqlx::Type)]
#[sqlx(transparent)]
#[serde(transparent)]
pub struct TenantId(String);

impl<'de> serde::Deserialize<'de> for TenantId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        TenantId::parse("tenantId", &s).map_err(serde::de::Error::custom)
    }
}

impl TenantId {
    /// Parses input; `field` names it in the error.
    pub fn parse(field: &str, s: &str) -> Result<TenantId> {
        let ok = !s.is_empty()
            && s.len() <= 63
            && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if ok {
            Ok(TenantId(s.to_owned()))
        } else {
            Err(Error::bad_input(field, format!("`{s}` is not a tenant id")))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::borrow::Borrow<str> for TenantId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<TenantId> for String {
    fn from(id: TenantId) -> String {
        id.0
    }
}

/// A gateway's id: 1 to 100 of letters, digits, `-`, `_` and `.`; its lease is `gateway:<id>`
/// ([`crate::leases::name::gateway`]) and sessions and dispatched commands name it. Given by the
/// operator (`--gateway-id`) or made for the process ([`GatewayId::for_process`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, sqlx::Type)]
#[sqlx(transparent)]
#[serde(transparent)]
pub struct GatewayId(String);

impl GatewayId {
    /// The largest id, in bytes.
    pub const MAX_LEN: usize = 100;

    fn allowed(c: char) -> bool {
        c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
    }

    /// Parses input; `field` names it in the error.
    pub fn parse(field: &str, s: &str) -> Result<GatewayId> {
        if !s.is_empty() && s.len() <= Self::MAX_LEN && s.chars().all(Self::allowed) {
            Ok(GatewayId(s.to_owned()))
        } else {
            Err(Error::bad_input(
                field,
                format!("`{s}` is not a gateway id: 1 to 100 of letters, digits, `-`, `_` and `.`"),
            ))
        }
    }

    /// An id unique to this process: the host name (its other characters made `-`), the process
    /// id and `suffix` (random hex), cut to [`GatewayId::MAX_LEN`].
    pub fn for_process(host: &str, pid: u32, suffix: &str) -> GatewayId {
        let host: String = host
            .chars()
            .map(|c| if Self::allowed(c) { c } else { '-' })
            .collect();
        let tail = format!("-{pid}-{suffix}");
        let mut host = if host.is_empty() {
            "gateway".to_owned()
        } else {
            host
        };
        host.truncate(Self::MAX_LEN.saturating_sub(tail.len()));
        GatewayId(host + &tail)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for GatewayId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A bookable atom's name: its GPU's hardware id, then `/mig/<k>` for a MIG instance or `/s<k>`
/// for a slot (the atom rule, `fleet::model::Layout::atoms`, makes them).
#[derive(
    Debug,
    Clone,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
    sqlx::Type,
)]
#[sqlx(transparent)]
#[serde(transparent)]
pub struct AtomName(String);

impl AtomName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for AtomName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a quota or a capacity figure is about: a pool, or a site (all its pools).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScopeId {
    Pool(PoolId),
    Site(SiteId),
}

impl ScopeId {
    /// Parses a pool or site id; `field` names it in the error.
    pub fn parse(field: &str, s: &str) -> Result<ScopeId> {
        match prefix_of(s) {
            Some(PoolId::PREFIX) => Ok(ScopeId::Pool(PoolId(s.to_owned()))),
            Some(SiteId::PREFIX) => Ok(ScopeId::Site(SiteId(s.to_owned()))),
            _ => Err(Error::bad_input(
                field,
                format!("`{s}` is not a pool or site id"),
            )),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            ScopeId::Pool(p) => p.as_str(),
            ScopeId::Site(s) => s.as_str(),
        }
    }

    /// `pool` or `site`, as stored in `quota_usage.scope_kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            ScopeId::Pool(_) => "pool",
            ScopeId::Site(_) => "site",
        }
    }
}

impl std::fmt::Display for ScopeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for ScopeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for ScopeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ScopeId::parse("scope_id", &s).map_err(serde::de::Error::custom)
    }
}

impl sqlx::Type<sqlx::Postgres> for ScopeId {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <&str as sqlx::Type<sqlx::Postgres>>::type_info()
    }
    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for ScopeId {
    fn decode(
        value: sqlx::postgres::PgValueRef<'r>,
    ) -> std::result::Result<Self, sqlx::error::BoxDynError> {
        let s = <&str as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?;
        ScopeId::parse("scope_id", s).map_err(|e| e.to_string().into())
    }
}

impl sqlx::Encode<'_, sqlx::Postgres> for ScopeId {
    fn encode_by_ref(
        &self,
        buf: &mut sqlx::postgres::PgArgumentBuffer,
    ) -> std::result::Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <&str as sqlx::Encode<'_, sqlx::Postgres>>::encode_by_ref(&self.as_str(), buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix_and_sort_by_time() {
        let a = SiteId::generate();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = SiteId::generate();
        assert!(a < b, "{a} should sort before {b}");
        assert_eq!(prefix_of(a.as_str()), Some("site"));
        assert_eq!(prefix_of("site_xyz"), None);
        assert_eq!(prefix_of(&new_id("nope")), None);
    }

    #[test]
    fn an_id_of_one_type_is_refused_as_another() {
        let pool = PoolId::generate();
        assert!(PoolId::parse("id", pool.as_str()).is_ok());
        let Err(err) = NodeId::parse("nodeId", pool.as_str()) else {
            panic!("a pool id parsed as a node id");
        };
        assert_eq!(err.code(), crate::ErrorCode::BadUserInput);
        assert!(err.to_string().contains("not a node id"), "{err}");
        assert_eq!(NodeId::from_trusted(pool.as_str()), None);
    }

    #[test]
    fn tenant_ids_are_checked() {
        for ok in ["t1", "acme.prod", "A-b_c"] {
            assert!(TenantId::parse("tenant", ok).is_ok(), "{ok}");
        }
        for bad in ["", "-x", "a b", "a\0b", &"x".repeat(64)] {
            assert!(TenantId::parse("tenant", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gateway_ids_are_checked_and_made_valid() {
        for ok in ["g1", "host-1.example-42-ab12", &"x".repeat(100)] {
            assert!(GatewayId::parse("gateway-id", ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a/b", "a:b", &"x".repeat(101)] {
            assert!(GatewayId::parse("gateway-id", bad).is_err(), "{bad:?}");
        }
        let made = GatewayId::for_process("héte:01", 42, "beef");
        assert_eq!(made.as_str(), "h-te-01-42-beef");
        let long = GatewayId::for_process(&"h".repeat(300), 7, "ab");
        assert_eq!(long.as_str().len(), GatewayId::MAX_LEN);
        assert!(long.as_str().ends_with("-7-ab"));
        assert!(GatewayId::parse("id", long.as_str()).is_ok());
        assert_eq!(GatewayId::for_process("", 1, "c").as_str(), "gateway-1-c");
    }
}
