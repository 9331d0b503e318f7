//! The GraphQL API of Better Compute: schema, auth, transports (HTTP, WebSocket, SSE), the outbox tailer, health and
//! metrics, and the `compute-api` command line.
//!
//! Architecture invariant: no SQL text here. Every statement lives in `compute-domain`; this
//! crate maps domain types and errors to GraphQL.

pub mod auth;
pub mod cli;
pub mod events;
pub mod fleet;
pub mod fleet_mutations;
pub mod graphql_http;
pub mod health;
pub mod loaders;
pub mod metrics;
pub mod reservations;
pub mod schema;
pub mod server;
pub mod sinks;
pub mod sse;
pub mod tailer;
pub mod ws;
