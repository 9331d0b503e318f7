//! End-to-end tests: the real server, through real HTTP and WebSocket, on a real PostgreSQL.

mod auth;
mod clock;
mod embedded;
mod graphql_http;
mod health;
mod outbox;
mod transactions;
mod websocket;
