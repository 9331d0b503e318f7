//! Persisted operations: the automatic persisted queries protocol (APQ) clients already speak,
//! and trusted documents for production (`serve --persisted-only`), on every transport
//! (`docs/frontends.md`).
//!
//! A request names a document by `extensions.persistedQuery = { version: 1, sha256Hash }`, the
//! lowercase hex SHA-256 of the document's text:
//!
//! - with no `query`, the server runs the document it knows by that hash (from the manifest, or
//!   registered earlier by APQ), or answers `PERSISTED_QUERY_NOT_FOUND` (message
//!   `PersistedQueryNotFound`, which Apollo's and urql's clients look for) so the client sends the
//!   text once;
//! - with a `query`, the hash must be the text's (`PERSISTED_QUERY_HASH_MISMATCH` otherwise), and
//!   the text is remembered under it. The hash is checked, never trusted, so no request can make
//!   another request's hash run a document of its choosing.
//!
//! With `--persisted-only`, only the manifest's documents run: nothing is registered, and a
//! document that is not in the manifest (by hash, or by text) is `PERSISTED_QUERY_REQUIRED`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// `extensions.code` when a hash names no known document.
pub const NOT_FOUND: &str = crate::codes::TransportCode::PersistedQueryNotFound.as_str();
/// `extensions.code` when a request's hash is not its text's.
pub const HASH_MISMATCH: &str = crate::codes::TransportCode::PersistedQueryHashMismatch.as_str();
/// `extensions.code` when `--persisted-only` refuses a document outside the manifest.
pub const REQUIRED: &str = crate::codes::TransportCode::PersistedQueryRequired.as_str();

/// The most bytes of document text APQ remembers; the oldest go first.
pub const APQ_BYTES: usize = 8 * 1024 * 1024;

/// The largest document the cache keeps: the default of `--max-document-bytes` (a larger one
/// is refused by that limit anyway, or, under a raised limit, runs without being kept).
const MAX_REMEMBERED_BYTES: usize = 128 * 1024;

/// Why a request's persisted query cannot run: a coded GraphQL request error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub message: String,
}

/// What [`Persisted::resolve`] refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unresolved {
    /// `extensions.persistedQuery` is not `{ version: 1, sha256Hash: <64 hex digits> }`: not a
    /// well-formed request (the transports' `BAD_REQUEST`).
    Malformed(String),
    /// A well-formed request for a document that cannot run.
    Refused(Refusal),
}

impl From<Refusal> for Unresolved {
    fn from(r: Refusal) -> Unresolved {
        Unresolved::Refused(r)
    }
}

/// The documents this server knows by hash.
#[derive(Debug, Default)]
pub struct Persisted {
    /// The manifest's documents (trusted documents).
    manifest: HashMap<String, Arc<str>>,
    /// Only the manifest's documents run.
    only: bool,
    /// ParseCache registered by APQ.
    cache: Mutex<Cache>,
}

#[derive(Debug, Default)]
struct Cache {
    documents: HashMap<String, Arc<str>>,
    order: VecDeque<String>,
    bytes: usize,
}

/// The lowercase hex SHA-256 of `text`.
pub fn sha256_hex(text: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    let mut out = String::with_capacity(64);
    for b in digest.as_ref() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

impl Persisted {
    /// APQ only, no manifest.
    pub fn automatic() -> Persisted {
        Persisted::default()
    }

    /// The documents of a manifest: Apollo's persisted query manifest
    /// (`{"format": "apollo-persisted-query-manifest", "version": 1, "operations": [{"id", "body", …}]}`)
    /// or a plain object of hash → document. Every id must be its body's SHA-256. With `only`,
    /// nothing outside it runs.
    pub fn from_manifest(text: &str, only: bool) -> Result<Persisted, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("the manifest is not JSON: {e}"))?;
        let pairs: Vec<(String, String)> = match &v {
            Value::Object(o) if o.contains_key("operations") => o["operations"]
                .as_array()
                .ok_or("`operations` must be an array")?
                .iter()
                .map(|op| match (op["id"].as_str(), op["body"].as_str()) {
                    (Some(id), Some(body)) => Ok((id.to_owned(), body.to_owned())),
                    _ => Err(format!(
                        "an operation without a string `id` and `body`: {op}"
                    )),
                })
                .collect::<Result<_, String>>()?,
            Value::Object(o) => o
                .iter()
                .map(|(id, body)| {
                    body.as_str()
                        .map(|b| (id.clone(), b.to_owned()))
                        .ok_or_else(|| format!("the document of {id} is not a string"))
                })
                .collect::<Result<_, String>>()?,
            _ => return Err("the manifest must be a JSON object".into()),
        };
        let mut manifest = HashMap::new();
        for (id, body) in pairs {
            let hash = sha256_hex(&body);
            if id != hash {
                return Err(format!(
                    "the manifest's id {id} is not the SHA-256 of its document ({hash})"
                ));
            }
            manifest.insert(id, Arc::from(body));
        }
        Ok(Persisted {
            manifest,
            only,
            cache: Mutex::default(),
        })
    }

    /// This store with `documents` trusted as if they were in the manifest: the operations of
    /// the console the binary serves (`crate::console`), which run in `--persisted-only` mode too.
    pub fn with_trusted(mut self, documents: impl IntoIterator<Item = String>) -> Persisted {
        for body in documents {
            self.manifest.insert(sha256_hex(&body), Arc::from(body));
        }
        self
    }

    /// How many documents the manifest holds.
    pub fn manifest_len(&self) -> usize {
        self.manifest.len()
    }

    /// Whether only the manifest's documents run.
    pub fn only(&self) -> bool {
        self.only
    }

    /// The document a request runs, from its `query` and `extensions`: `Ok(None)` when the
    /// request does not use a persisted query and may run its text; `Ok(Some(text))` for the
    /// text to run.
    pub fn resolve(
        &self,
        query: Option<&str>,
        extensions: Option<&Value>,
    ) -> Result<Option<Arc<str>>, Unresolved> {
        let persisted = extensions.and_then(|e| e.get("persistedQuery"));
        let Some(p) = persisted.filter(|p| !p.is_null()) else {
            if self.only {
                let known = query.is_some_and(|q| self.manifest.contains_key(&sha256_hex(q)));
                if !known {
                    return Err(Unresolved::Refused(Refusal {
                        code: REQUIRED,
                        message: "this server runs registered operations only: send \
                                  `extensions.persistedQuery.sha256Hash` of a document in its \
                                  manifest"
                            .into(),
                    }));
                }
            }
            return Ok(None);
        };
        let bad = Unresolved::Malformed;
        if p.get("version").and_then(Value::as_i64) != Some(1) {
            return Err(bad("`extensions.persistedQuery.version` must be 1".into()));
        }
        let hash = p
            .get("sha256Hash")
            .and_then(Value::as_str)
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                bad("`extensions.persistedQuery.sha256Hash` must be 64 hex digits".into())
            })?
            .to_ascii_lowercase();
        match query {
            Some(text) => {
                if sha256_hex(text) != hash {
                    return Err(Unresolved::Refused(Refusal {
                        code: HASH_MISMATCH,
                        message: "provided sha does not match query: \
                                  `sha256Hash` must be the SHA-256 of `query`"
                            .into(),
                    }));
                }
                if let Some(doc) = self.manifest.get(&hash) {
                    return Ok(Some(doc.clone()));
                }
                if self.only {
                    return Err(Unresolved::Refused(Refusal {
                        code: REQUIRED,
                        message: "this document is not in the server's manifest of registered \
                                  operations"
                            .into(),
                    }));
                }
                let doc: Arc<str> = Arc::from(text);
                // A document past the default size limit is answered (or refused by that limit)
                // but not kept: four of 2 MiB, each with its right hash, flushed the whole cache.
                if doc.len() <= MAX_REMEMBERED_BYTES {
                    self.remember(hash, doc.clone());
                }
                Ok(Some(doc))
            }
            None => self
                .manifest
                .get(&hash)
                .cloned()
                .or_else(|| {
                    (!self.only)
                        .then(|| self.cache.lock().ok()?.documents.get(&hash).cloned())
                        .flatten()
                })
                .map(Some)
                .ok_or(Unresolved::Refused(Refusal {
                    code: NOT_FOUND,
                    message: "PersistedQueryNotFound".into(),
                })),
        }
    }

    /// Whether `hash`'s document is in the cache (tests).
    #[cfg(test)]
    fn cached(&self, hash: &str) -> bool {
        self.cache
            .lock()
            .is_ok_and(|c| c.documents.contains_key(hash))
    }

    fn remember(&self, hash: String, doc: Arc<str>) {
        let Ok(mut c) = self.cache.lock() else {
            return;
        };
        if doc.len() > APQ_BYTES || c.documents.contains_key(&hash) {
            return;
        }
        c.bytes += doc.len();
        c.order.push_back(hash.clone());
        c.documents.insert(hash, doc);
        while c.bytes > APQ_BYTES {
            let Some(old) = c.order.pop_front() else {
                break;
            };
            if let Some(d) = c.documents.remove(&old) {
                c.bytes -= d.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn code(r: Result<Option<Arc<str>>, Unresolved>) -> &'static str {
        match r {
            Err(Unresolved::Refused(r)) => r.code,
            Err(Unresolved::Malformed(_)) => "malformed",
            Ok(_) => "ran",
        }
    }

    fn ext(hash: &str) -> Value {
        json!({ "persistedQuery": { "version": 1, "sha256Hash": hash } })
    }

    #[test]
    fn apq_registers_then_runs_by_hash_and_checks_every_hash() {
        let p = Persisted::automatic();
        let q = "{ __typename }";
        let h = sha256_hex(q);
        assert_eq!(code(p.resolve(None, Some(&ext(&h)))), NOT_FOUND);
        assert_eq!(
            code(p.resolve(Some("{ viewer { subject } }"), Some(&ext(&h)))),
            HASH_MISMATCH,
            "a request cannot register another document under a hash"
        );
        assert_eq!(
            p.resolve(Some(q), Some(&ext(&h)))
                .expect("resolves")
                .as_deref(),
            Some(q)
        );
        assert_eq!(
            p.resolve(None, Some(&ext(&h)))
                .expect("resolves")
                .as_deref(),
            Some(q)
        );
        assert_eq!(p.resolve(Some(q), None).expect("resolves"), None);
        assert_eq!(
            code(p.resolve(
                None,
                Some(&json!({ "persistedQuery": { "version": 2, "sha256Hash": h } }))
            )),
            "malformed"
        );
    }

    #[test]
    fn a_document_past_the_size_limit_is_not_kept() {
        let p = Persisted::automatic();
        let small = "{ __typename }";
        p.resolve(Some(small), Some(&ext(&sha256_hex(small))))
            .expect("resolves");
        let big = format!("{{ __typename }}{}", " ".repeat(2 * 1024 * 1024));
        let h = sha256_hex(&big);
        p.resolve(Some(&big), Some(&ext(&h))).expect("resolves");
        assert!(!p.cached(&h), "the 2 MiB document is not kept");
        assert!(
            p.cached(&sha256_hex(small)),
            "and did not push the small one out"
        );
    }

    #[test]
    fn persisted_only_runs_the_manifest_and_nothing_else() {
        let q = "query Hello { __typename }";
        let h = sha256_hex(q);
        let manifest = json!({ "format": "apollo-persisted-query-manifest", "version": 1,
            "operations": [{ "id": h, "name": "Hello", "type": "query", "body": q }] });
        let p = Persisted::from_manifest(&manifest.to_string(), true).expect("manifest");
        assert_eq!(
            p.resolve(None, Some(&ext(&h)))
                .expect("resolves")
                .as_deref(),
            Some(q)
        );
        assert_eq!(
            p.resolve(Some(q), None).expect("resolves"),
            None,
            "its text runs too"
        );
        let other = "{ viewer { subject } }";
        assert_eq!(code(p.resolve(Some(other), None)), REQUIRED);
        assert_eq!(
            code(p.resolve(Some(other), Some(&ext(&sha256_hex(other))))),
            REQUIRED,
            "nothing is registered in persisted-only mode"
        );
        assert_eq!(
            code(p.resolve(None, Some(&ext(&sha256_hex(other))))),
            NOT_FOUND
        );
        let wrong =
            json!({ "0000000000000000000000000000000000000000000000000000000000000000": q });
        assert!(Persisted::from_manifest(&wrong.to_string(), true).is_err());
    }
}
