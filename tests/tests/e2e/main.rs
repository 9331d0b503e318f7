//! End-to-end tests: the real server, through real HTTP and WebSocket, on a real PostgreSQL.

mod auth;
mod clock;
mod embedded;
mod fleet;
mod graphql_http;
mod health;
mod outbox;
mod statements;
mod transactions;
mod websocket;
