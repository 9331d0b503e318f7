//! The GraphQL API of Better Compute: schema, auth, transports (HTTP, WebSocket, SSE), the outbox
//! tailer, health and metrics, and the `compute-api` command line.
//!
//! Architecture invariant: no SQL text here. Every statement lives in `compute-domain`; this
//! crate maps domain types and errors to GraphQL.
//!
//! Rooms, each importing only the rooms before it (checked by the `api_rooms_form_no_cycle`
//! static test; `ARCHITECTURE.md` states the rules):
//! `auth`, `limits`, `tailer`, `persisted` (leaves) → `metrics`, `graph`, `gateway`, `console` →
//! `state` → `transport`, `ops` → `server` → `cli`.

pub mod auth;
pub mod authz;
pub mod cli;
pub mod codes;
pub mod console;
pub mod gateway;
pub mod graph;
pub mod limits;
pub mod metrics;
pub mod ops;
pub mod persisted;
pub mod server;
pub mod share;
pub mod state;
pub mod tailer;
pub mod trace;
pub mod transport;
