//! The published limits of the API: what one request, one caller and one connection may ask of
//! the server. Every limit has a default here and a `serve` flag (`cli`); `docs/security.md`
//! lists them with the cost model and worked examples.
//!
//! Architecture invariant: a leaf (it imports nothing of this crate).

use std::time::Duration;

/// What one request, one caller and one connection may ask of the server.
#[derive(Debug, Clone)]
pub struct Limits {
    /// The largest cost of one request by an authenticated caller (see `graph::admission`).
    pub max_cost: u64,
    /// The largest cost of one request without a token: enough for introspection, not for data.
    pub anonymous_max_cost: u64,
    /// Points each authenticated identity may spend per minute (a bucket refilled continuously).
    pub budget_per_minute: u64,
    /// Points each anonymous peer address may spend per minute.
    pub anonymous_budget_per_minute: u64,
    /// The largest GraphQL document, in bytes: parsing is bounded before it begins.
    pub max_document_bytes: usize,
    /// Fields with an alias in one document, counted after fragments are expanded.
    pub max_aliases: usize,
    /// Fields at the root of the operation.
    pub max_root_fields: usize,
    /// Directives in one document, counted after fragments are expanded.
    pub max_directives: usize,
    /// Field selections in one document after fragments are expanded.
    pub max_selections: usize,
    /// Errors in one response; the rest are summarised in one last error.
    pub max_errors: usize,
    /// Items in any one list of an argument's value (nested in an input object too), whether
    /// written in the document or sent in its variables.
    pub max_list_items: usize,
    /// How long one query or mutation may run; then it stops and its transaction rolls back.
    pub request_timeout: Duration,
    /// How long a client has to send a request's headers (and how long an idle keep-alive
    /// connection stays open).
    pub header_timeout: Duration,
    /// Connections the server holds open at once; more wait in the listen queue.
    pub max_connections: usize,
    /// The largest WebSocket message or frame a client may send.
    pub max_ws_message: usize,
    /// Streams (WebSocket connections and SSE streams) one identity may hold open at once.
    pub max_streams_per_identity: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_cost: 25_000,
            anonymous_max_cost: 1_000,
            budget_per_minute: 250_000,
            anonymous_budget_per_minute: 10_000,
            max_document_bytes: 128 * 1024,
            max_aliases: 200,
            max_root_fields: 50,
            max_directives: 100,
            max_selections: 5_000,
            max_errors: 50,
            max_list_items: 100,
            request_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            max_connections: 1_024,
            max_ws_message: 256 * 1024,
            max_streams_per_identity: 20,
        }
    }
}

/// The streams each identity holds open (WebSocket connections and SSE streams), so that no one
/// identity can hold more than [`Limits::max_streams_per_identity`].
#[derive(Debug, Default, Clone)]
pub struct Streams(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

/// One open stream; dropping it closes its place.
#[derive(Debug)]
pub struct StreamGuard {
    streams: Streams,
    key: String,
}

impl Streams {
    /// Takes a place for `key` (a token's subject, or an anonymous peer's address), or `None`
    /// when it already holds `max`.
    pub fn open(&self, key: String, max: usize) -> Option<StreamGuard> {
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(key.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(StreamGuard {
            streams: self.clone(),
            key,
        })
    }

    /// Streams `key` holds open.
    pub fn held_by(&self, key: &str) -> usize {
        let open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        open.get(key).copied().unwrap_or(0)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut open = self.streams.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_holds_at_most_its_streams_and_gets_them_back() {
        let s = Streams::default();
        let a = s.open("a".into(), 2).expect("first");
        let _b = s.open("a".into(), 2).expect("second");
        assert!(s.open("a".into(), 2).is_none(), "a third is refused");
        assert!(
            s.open("z".into(), 2).is_some(),
            "another identity has its own"
        );
        drop(a);
        assert_eq!(s.held_by("a"), 1);
        assert!(
            s.open("a".into(), 2).is_some(),
            "a closed stream frees its place"
        );
    }
}
