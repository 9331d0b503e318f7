//! End-to-end tests: the real server, through real HTTP, WebSocket and SSE, on a real PostgreSQL.

mod agent;
mod auth;
mod clock;
mod command_torture;
mod commands;
mod crash;
mod embedded;
mod event_contract;
mod fleet;
mod graphql_http;
mod health;
mod hostile;
mod instances;
mod leases;
mod outbox;
mod outbox_reader;
mod reservations;
mod restart;
mod scale_out;
mod statements;
mod subscriptions;
mod torture;
mod transactions;
mod usage;
mod websocket;
mod workers;
