//! `compute-agent`, the node daemon of Better Compute (`docs/agent.md`): a client of `/agent`
//! only (the protocol is `compute-protocol`), with no SQL and no domain types.
//!
//! - [`journal`]: the crash-safe record of commands and workloads (SQLite).
//! - [`agent`]: the protocol's daemon side: each command step journaled before the message
//!   that depends on it; workloads adopted after a restart, never run twice.
//! - [`runtime`]: the `process` and `podman` runtimes; [`nvidia`]: GPU resets and MIG layouts.
//! - [`inventory`] and [`nvml`]: what the machine has (NVML or `--inventory FILE`) and its
//!   GPUs' health.
//! - [`session`]: the connection, heartbeats and reconnects, and `join`; [`cli`]: flags,
//!   subcommands and start-up.

pub mod agent;
pub mod cli;
pub mod inventory;
pub mod journal;
pub mod metrics;
pub mod nvidia;
pub mod nvml;
pub mod ops;
pub mod runtime;
pub mod session;
pub mod sys;
