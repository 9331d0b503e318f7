//! The graph's shared vocabulary: the enum mapping macro, the enums and inputs more than one area
//! uses, conditions, id and page arguments.
//!
//! Architecture invariant: a leaf of `graph` (it imports only `context`).

use async_graphql::{ID, InputObject, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::fleet::model::{self as m, Window};
use compute_domain::page::PageRequest;
use serde_json::Value;

use crate::graph::context::gql_error;

/// Defines a GraphQL enum mirroring a domain enum, both conversions, and `from_db` for values
/// read from a row (an unknown one is `INTERNAL`: the database holds what the domain wrote).
macro_rules! gql_enum {
    ($(#[$meta:meta])* $name:ident($gql:literal) <=> $domain:ty { $($(#[$vmeta:meta])* $variant:ident),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(async_graphql::Enum, Clone, Copy, PartialEq, Eq, Debug)]
        #[graphql(name = $gql)]
        pub enum $name { $($(#[$vmeta])* $variant),+ }

        impl From<$name> for $domain {
            fn from(v: $name) -> Self {
                match v { $($name::$variant => <$domain>::$variant),+ }
            }
        }
        impl From<$domain> for $name {
            fn from(v: $domain) -> Self {
                match v { $(<$domain>::$variant => $name::$variant),+ }
            }
        }
        impl $name {
            /// From the value stored in the database.
            pub fn from_db(s: &str) -> async_graphql::Result<Self> {
                <$domain>::parse(s).map(Self::from).ok_or_else(|| {
                    $crate::graph::context::gql_error(compute_domain::Error::internal(format!("unknown {} value `{s}` in the database", $gql)))
                })
            }
        }
    };
}
pub(crate) use gql_enum;

gql_enum!(
    /// What a taint does to placement.
    TaintEffect("TaintEffect") <=> m::TaintEffect {
        /// Only tolerating allocations are placed here.
        NoSchedule,
        /// Placement avoids the node when it can.
        PreferNoSchedule,
        /// Like NoSchedule, and running work without a toleration should leave.
        NoExecute,
    }
);
gql_enum!(
    /// The kind of a bookable atom.
    AtomKind("AtomKind") <=> m::AtomKind {
        /// A whole GPU.
        Gpu,
        /// A MIG instance.
        Mig,
        /// A time-slice or MPS slot.
        Slot,
    }
);
/// Page arguments of a Relay connection.
pub fn page_request(
    first: Option<i32>,
    after: Option<String>,
    last: Option<i32>,
    before: Option<String>,
) -> PageRequest {
    PageRequest {
        first: first.map(i64::from),
        after,
        last: last.map(i64::from),
        before,
    }
}

/// Parses a global id of the type with `prefix`; `field` names the argument in errors.
pub fn parse_id(field: &str, prefix: &'static str, id: &ID) -> async_graphql::Result<String> {
    m::parse_id(field, prefix, id.as_str()).map_err(gql_error)
}

/// [`parse_id`] of an optional argument.
pub fn opt_id(
    field: &str,
    prefix: &'static str,
    id: Option<&ID>,
) -> async_graphql::Result<Option<String>> {
    id.map(|id| parse_id(field, prefix, id)).transpose()
}

/// A time window.
#[derive(InputObject, Clone, Copy)]
pub struct WindowInput {
    /// Start, inclusive.
    pub start: DateTime<Utc>,
    /// End, exclusive.
    pub end: DateTime<Utc>,
}

/// A window input, checked.
pub fn window(w: Option<WindowInput>) -> async_graphql::Result<Option<Window>> {
    w.map(|w| Window::new("window", w.start, w.end).map_err(gql_error))
        .transpose()
}

/// A condition of a node or reservation, such as `NodeUnreachable` or `Unschedulable`.
#[derive(SimpleObject)]
pub struct Condition {
    /// The condition's type.
    r#type: String,
    /// `True`, `False` or `Unknown`.
    status: String,
    /// A machine-readable reason.
    reason: Option<String>,
    /// A message for people.
    message: Option<String>,
    /// Since when it holds.
    since: Option<DateTime<Utc>>,
}

/// Conditions as stored (`[{"type", "status", "reason", "message", "since"}]`).
pub fn conditions_of(stored: &Value) -> Vec<Condition> {
    stored
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| Condition {
                    r#type: c["type"].as_str().unwrap_or_default().to_owned(),
                    status: c["status"].as_str().unwrap_or("Unknown").to_owned(),
                    reason: c["reason"].as_str().map(str::to_owned),
                    message: c["message"].as_str().map(str::to_owned),
                    since: c["since"].as_str().and_then(|s| s.parse().ok()),
                })
                .collect()
        })
        .unwrap_or_default()
}
