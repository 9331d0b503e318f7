//! The core of Better Compute: model types, state tables, errors with stable codes, the clock,
//! transaction kinds, and every SQL statement, one module per aggregate or mechanism.
//!
//! Architecture invariant: this crate knows nothing of HTTP, WebSocket or GraphQL. The API and
//! the workers call it; it calls PostgreSQL.

pub mod actor;
pub mod authz;
pub mod clock;
pub mod condition;
pub mod db;
pub mod error;
pub mod events;
pub mod fleet;
pub mod idempotency;
pub mod ids;
pub mod instances;
pub mod leases;
pub mod metrics;
pub mod node_commands;
pub mod node_sessions;
pub mod outbox;
pub mod page;
pub mod process;
pub mod quota;
pub mod reservations;
pub mod secrets;
pub mod sinks;
pub mod task;
mod text_enum;
pub mod usage;
pub mod work_queue;

pub use error::{Error, ErrorCode, Result};
