//! Parsed documents remembered by their text. Clients send the same few documents again and
//! again (the console's operations, a generated client's, a dashboard's poll), and parsing is
//! most of what a small request costs: async-graphql's parser took about a third of the
//! server's instructions for `{ __typename }` (callgrind, `bench-auth`). A document seen before
//! is cloned from here instead of parsed again.
//!
//! - **Keyed by the whole text**, compared for equality (not by a hash of it), in a map whose
//!   hasher is seeded per process: no document can be answered with another's parse, and no
//!   caller can aim collisions at one bucket.
//! - **Bounded.** Only documents of at most [`MAX_DOCUMENT_BYTES`] are kept, in two
//!   generations of at most [`GENERATION_ENTRIES`] documents and [`GENERATION_BYTES`] of text
//!   each: when the newer is full it becomes the older and the older is forgotten; a document
//!   found in the older moves to the newer. So what is used stays, a stream of new documents
//!   (a caller's or an attacker's) costs what it cost without the cache, and the memory held
//!   is at most two generations' documents and their parses.
//! - **Only parses that succeed are kept**; a document that does not parse is parsed again each
//!   time and refused with the same error.
//! - A clone is the parse: the same operations, fragments and positions, so every check after
//!   it (the door's bounds and cost, async-graphql's validation) sees what it would have seen.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_graphql::parser::types::ExecutableDocument;

/// The longest document kept, in bytes: the console's largest operation is a few kilobytes.
pub const MAX_DOCUMENT_BYTES: usize = 16 * 1024;
/// The most documents in one generation.
pub const GENERATION_ENTRIES: usize = 1_000;
/// The most text in one generation, in bytes.
pub const GENERATION_BYTES: usize = 256 * 1024;

/// The parsed documents of one server.
#[derive(Default)]
pub struct ParseCache {
    generations: Mutex<Generations>,
    /// ParseCache answered with a kept parse, and documents parsed (the metrics read both).
    reused: AtomicU64,
    parsed: AtomicU64,
}

#[derive(Default)]
struct Generations {
    newer: Generation,
    older: Generation,
}

#[derive(Default)]
struct Generation {
    documents: HashMap<Box<str>, Arc<ExecutableDocument>>,
    bytes: usize,
}

impl Generation {
    fn insert(&mut self, text: Box<str>, document: Arc<ExecutableDocument>) {
        let len = text.len();
        // Two requests of a new text may both parse it and both keep it: the second replaces
        // the first's parse under the same key, whose bytes are counted once.
        if self.documents.insert(text, document).is_none() {
            self.bytes += len;
        }
    }
}

impl Generations {
    /// Keeps `text`'s parse in the newer generation, turning the generations first when it is
    /// full.
    fn keep(&mut self, text: Box<str>, document: Arc<ExecutableDocument>) {
        if self.newer.documents.len() >= GENERATION_ENTRIES
            || self.newer.bytes + text.len() > GENERATION_BYTES
        {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(text, document);
    }
}

impl std::fmt::Debug for ParseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParseCache")
            .field("kept", &self.len())
            .finish()
    }
}

impl ParseCache {
    /// `text` parsed: a clone of its earlier parse when it was seen lately, else parsed now
    /// (and kept when it parsed and is short enough).
    pub fn parse(&self, text: &str) -> Result<ExecutableDocument, async_graphql::parser::Error> {
        if text.len() > MAX_DOCUMENT_BYTES {
            self.parsed.fetch_add(1, Ordering::Relaxed);
            return async_graphql::parser::parse_query(text);
        }
        if let Some(document) = self.lookup(text) {
            self.reused.fetch_add(1, Ordering::Relaxed);
            // Cloned outside the lock: a large document's clone holds no other request up.
            return Ok(ExecutableDocument::clone(&document));
        }
        self.parsed.fetch_add(1, Ordering::Relaxed);
        let document = async_graphql::parser::parse_query(text)?;
        self.lock().keep(text.into(), Arc::new(document.clone()));
        Ok(document)
    }

    /// ParseCache answered with a kept parse so far, and documents parsed.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.reused.load(Ordering::Relaxed),
            self.parsed.load(Ordering::Relaxed),
        )
    }

    /// How many documents are kept now.
    pub fn len(&self) -> usize {
        let g = self.lock();
        g.newer.documents.len() + g.older.documents.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kept parse of `text`, moved to the newer generation when it was in the older.
    fn lookup(&self, text: &str) -> Option<Arc<ExecutableDocument>> {
        let mut g = self.lock();
        if let Some(document) = g.newer.documents.get(text) {
            return Some(document.clone());
        }
        let (text, document) = g.older.documents.remove_entry(text)?;
        g.older.bytes -= text.len();
        g.keep(text, document.clone());
        Some(document)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        // A panic while holding the lock leaves the maps whole (no step can panic half-way
        // through an insert), so the poison is ignored.
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The document's operations and fragments as async-graphql prints them (`Debug`, every
    /// position included), in name order: a document of several operations keeps them in a
    /// hash map, whose order differs between two maps of the same keys.
    fn shape(d: &ExecutableDocument) -> String {
        let mut parts: Vec<String> = d
            .operations
            .iter()
            .map(|(name, op)| format!("operation {name:?}: {op:?}"))
            .chain(
                d.fragments
                    .iter()
                    .map(|(name, f)| format!("fragment {name}: {f:?}")),
            )
            .collect();
        parts.sort();
        parts.join("\n")
    }

    #[test]
    fn a_kept_document_is_its_own_parse() {
        let docs = ParseCache::default();
        let texts = [
            "{ __typename }",
            "query A { a: __typename } query B { b: __typename }",
            "\n\n  query Q($x: Int) { f(first: $x) { ...F } } fragment F on T { g }",
        ];
        for text in texts {
            let first = docs.parse(text).expect("parses");
            let again = docs.parse(text).expect("parses");
            let fresh = async_graphql::parser::parse_query(text).expect("parses");
            assert_eq!(shape(&again), shape(&fresh), "{text}");
            assert_eq!(shape(&first), shape(&fresh), "{text}");
        }
        assert_eq!(docs.len(), 3);
        assert_eq!(docs.counts(), (3, 3), "three reused, three parsed");
        // A text differing by one character is another document, with its own parse (here
        // its field on the second line).
        let other = docs.parse("{\n__typename }").expect("parses");
        assert_ne!(
            shape(&other),
            shape(&docs.parse("{ __typename }").expect("parses"))
        );
        assert_eq!(docs.len(), 4);
        // The same text kept twice (two requests that missed at once) is counted once.
        let mut g = docs.lock();
        let bytes = g.newer.bytes;
        let kept = Arc::new(async_graphql::parser::parse_query(texts[0]).expect("parses"));
        g.keep(texts[0].into(), kept);
        assert_eq!(g.newer.bytes, bytes);
    }

    #[test]
    fn errors_and_long_documents_are_not_kept() {
        let docs = ParseCache::default();
        let bad = "{ __typename";
        let first = docs.parse(bad).expect_err("does not parse").to_string();
        let again = docs.parse(bad).expect_err("does not parse").to_string();
        assert_eq!(first, again);
        let long = format!("{{ __typename {} }}", " ".repeat(MAX_DOCUMENT_BYTES));
        docs.parse(&long).expect("parses");
        assert!(docs.is_empty(), "kept {}", docs.len());
    }

    #[test]
    fn the_generations_bound_what_is_kept_and_keep_what_is_used() {
        let docs = ParseCache::default();
        let text = |i: usize| format!("{{ a{i}: __typename }}");
        docs.parse(&text(0)).expect("parses");
        for i in 1..5 * GENERATION_ENTRIES {
            docs.parse(&text(i)).expect("parses");
            // Document 0 is used all along: it moves to the newer generation each time it
            // is found in the older, so it is never forgotten.
            if i % (GENERATION_ENTRIES / 2) == 0 {
                docs.parse(&text(0)).expect("parses");
            }
            assert!(docs.len() <= 2 * GENERATION_ENTRIES, "{}", docs.len());
        }
        let g = docs.lock();
        assert!(
            g.newer.documents.contains_key(text(0).as_str())
                || g.older.documents.contains_key(text(0).as_str())
        );
        // Document 1, used once long ago, is gone.
        assert!(!g.newer.documents.contains_key(text(1).as_str()));
        assert!(!g.older.documents.contains_key(text(1).as_str()));
        // The byte bound holds as well as the count.
        assert!(g.newer.bytes <= GENERATION_BYTES && g.older.bytes <= GENERATION_BYTES);
        let counted: usize = g.newer.documents.keys().map(|k| k.len()).sum();
        assert_eq!(counted, g.newer.bytes);
    }

    #[test]
    fn the_byte_bound_turns_the_generations() {
        let docs = ParseCache::default();
        // ParseCache of 8 KiB: a generation holds 32 of them, not 1,000.
        let text = |i: usize| format!("{{ a{i}: __typename {} }}", " ".repeat(8 * 1024));
        for i in 0..100 {
            docs.parse(&text(i)).expect("parses");
        }
        let g = docs.lock();
        assert!(g.newer.bytes <= GENERATION_BYTES, "{}", g.newer.bytes);
        assert!(g.newer.documents.len() <= GENERATION_BYTES / (8 * 1024));
        drop(g);
        assert!(
            docs.len() <= 2 * GENERATION_BYTES / (8 * 1024),
            "{}",
            docs.len()
        );
    }
}
