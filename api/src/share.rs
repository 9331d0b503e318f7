//! Frames rendered once per event and shape: the `events` subscription's fan-out.
//!
//! An event that reaches a thousand subscribers would otherwise be resolved and serialized a
//! thousand times, once per subscription. Its rendering (the `next` payload: the item's fields,
//! and `extensions.cursor`) depends only on the event and the subscription's *shape*: the root
//! field's name and alias, its selection set and the fragments the document defines, the values
//! of the variables those use, and what the caller may see (its tenant and roles). The root
//! field's own arguments (`after`, `types`, `subjects`) choose which events arrive, not how one
//! reads, so two clients resuming from different cursors share a shape.
//!
//! [`Shape::of`] computes the shape once, when a subscription starts, as a SHA-256 of all of
//! that (no two shapes can be made to collide); [`Frames`] keeps the payloads of the latest
//! events by `(shape, cursor)`. The `events` resolver looks each event up before it yields it:
//! a hit yields an item that resolves to nothing and hands the stored text to the transport
//! ([`Slot`]), which sends it as it is; a miss resolves as usual, and the transport stores what
//! it serialized when the response has no errors. Only the `events` field reads or writes
//! frames: the object subscriptions (`reservation`, `computeNode` …) read their object from
//! the database for each change, so two of their renderings of one cursor may differ.
//!
//! Tenant isolation does not rest on this cache: a tenant's feed only ever receives its own
//! events (`crate::tailer`), and the shape includes the tenant besides.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_graphql::Positioned;
use async_graphql::parser::types::{
    DocumentOperations, ExecutableDocument, OperationType, Selection, SelectionSet,
};
use async_graphql_value::Value as Raw;
use compute_domain::outbox::Cursor;

/// How many rendered payloads a process keeps: at 100 events a second with 10 shapes each,
/// some 10 seconds' worth, far more than a live subscriber can lag before its channel drops it
/// back to the database.
pub const CAPACITY: usize = 8192;

/// A subscription's shape: equal shapes render an event to equal text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape([u8; 32]);

impl Shape {
    /// The shape of a subscription `request` by a caller who sees `visibility` (its tenant and
    /// roles; `None` for an anonymous one); `None` for anything else, or a document whose
    /// operation does not have one root field (nothing is shared then).
    pub fn of(
        request: &mut async_graphql::Request,
        visibility: Option<(Option<&str>, Vec<String>)>,
    ) -> Option<Shape> {
        let variables = request.variables.clone();
        let name = request.operation_name.clone();
        let doc = request.parsed_query().ok()?;
        let op = match &doc.operations {
            DocumentOperations::Single(op) => op,
            DocumentOperations::Multiple(ops) => match &name {
                Some(n) => ops.get(n.as_str())?,
                None if ops.len() == 1 => ops.values().next()?,
                None => return None,
            },
        };
        if op.node.ty != OperationType::Subscription {
            return None;
        }
        let [root] = &op.node.selection_set.node.items[..] else {
            return None;
        };
        let Selection::Field(field) = &root.node else {
            return None;
        };
        let mut used = Vec::new();
        for d in &field.node.directives {
            for (_, v) in &d.node.arguments {
                variables_in(&v.node, &mut used);
            }
        }
        variables_in_set(&field.node.selection_set, &mut used);
        for f in doc.fragments.values() {
            for d in &f.node.directives {
                for (_, v) in &d.node.arguments {
                    variables_in(&v.node, &mut used);
                }
            }
            variables_in_set(&f.node.selection_set, &mut used);
        }
        used.sort();
        used.dedup();

        let mut h = ring::digest::Context::new(&ring::digest::SHA256);
        let mut part = |bytes: &[u8]| {
            // Length-prefixed, so no two sequences of parts hash alike.
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        part(field.node.name.node.as_bytes());
        part(
            field
                .node
                .alias
                .as_ref()
                .map(|a| a.node.as_str())
                .unwrap_or("")
                .as_bytes(),
        );
        part(json(&field.node.directives).as_bytes());
        part(json(&field.node.selection_set).as_bytes());
        part(fragments(doc).as_bytes());
        part(json(&op.node.variable_definitions).as_bytes());
        for v in &used {
            part(v.as_bytes());
            part(json(&variables.get(v.as_str())).as_bytes());
        }
        match visibility {
            None => part(b"anonymous"),
            Some((tenant, mut roles)) => {
                part(tenant.unwrap_or("").as_bytes());
                roles.sort();
                part(roles.join(",").as_bytes());
            }
        }
        let digest = h.finish();
        let mut key = [0u8; 32];
        key.copy_from_slice(digest.as_ref());
        Some(Shape(key))
    }
}

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// The document's fragments, in name order.
fn fragments(doc: &ExecutableDocument) -> String {
    let mut names: Vec<_> = doc.fragments.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|n| format!("{n}:{}", json(&doc.fragments[n])))
        .collect::<Vec<_>>()
        .join(";")
}

fn variables_in_set(set: &Positioned<SelectionSet>, out: &mut Vec<String>) {
    for item in &set.node.items {
        let (directives, inner) = match &item.node {
            Selection::Field(f) => {
                for (_, v) in &f.node.arguments {
                    variables_in(&v.node, out);
                }
                (&f.node.directives, Some(&f.node.selection_set))
            }
            Selection::FragmentSpread(s) => (&s.node.directives, None),
            Selection::InlineFragment(i) => (&i.node.directives, Some(&i.node.selection_set)),
        };
        for d in directives {
            for (_, v) in &d.node.arguments {
                variables_in(&v.node, out);
            }
        }
        if let Some(inner) = inner {
            variables_in_set(inner, out);
        }
    }
}

fn variables_in(value: &Raw, out: &mut Vec<String>) {
    match value {
        Raw::Variable(name) => out.push(name.to_string()),
        Raw::List(items) => items.iter().for_each(|v| variables_in(v, out)),
        Raw::Object(fields) => fields.values().for_each(|v| variables_in(v, out)),
        _ => {}
    }
}

/// The rendered payloads of recent events, by shape and cursor.
#[derive(Default)]
pub struct Frames {
    inner: Mutex<Kept>,
    /// Payloads rendered by a subscription and stored for others.
    pub rendered: AtomicU64,
    /// Payloads a subscription sent from the store instead of rendering them.
    pub shared: AtomicU64,
}

#[derive(Default)]
struct Kept {
    frames: HashMap<(Shape, Cursor), Arc<str>>,
    order: VecDeque<(Shape, Cursor)>,
}

impl Frames {
    /// The payload stored for `shape` at `cursor`.
    pub fn get(&self, shape: Shape, cursor: Cursor) -> Option<Arc<str>> {
        let kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        kept.frames.get(&(shape, cursor)).cloned()
    }

    /// Stores a payload, forgetting the oldest beyond [`CAPACITY`].
    pub fn put(&self, shape: Shape, cursor: Cursor, text: Arc<str>) {
        let mut kept = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if kept.frames.insert((shape, cursor), text).is_none() {
            kept.order.push_back((shape, cursor));
            while kept.order.len() > CAPACITY {
                if let Some(old) = kept.order.pop_front() {
                    kept.frames.remove(&old);
                }
            }
        }
        self.rendered.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the `events` resolver says of the item it yielded last, for the transport.
#[derive(Default)]
enum Served {
    /// Not an `events` item: render it, store nothing.
    #[default]
    Unshared,
    /// An event the store did not have: render it and store the payload.
    Fresh(Cursor),
    /// The stored payload: send it as it is.
    Stored(Arc<str>),
}

/// A subscription's shape and its last item's fate, shared by the resolver and the transport.
pub struct Slot {
    shape: Shape,
    frames: Arc<Frames>,
    served: Mutex<Served>,
}

impl Slot {
    pub fn new(shape: Shape, frames: Arc<Frames>) -> Slot {
        Slot {
            shape,
            frames,
            served: Mutex::new(Served::Unshared),
        }
    }

    /// Looks `cursor` up for the resolver: `true` when the payload is stored (the item then
    /// need not be resolved).
    pub fn lookup(&self, cursor: Option<Cursor>) -> bool {
        let served = match cursor {
            None => Served::Unshared,
            Some(c) => match self.frames.get(self.shape, c) {
                Some(text) => Served::Stored(text),
                None => Served::Fresh(c),
            },
        };
        let hit = matches!(served, Served::Stored(_));
        *self.served.lock().unwrap_or_else(|p| p.into_inner()) = served;
        hit
    }

    /// The payload stored for this shape at `cursor`, counted as shared when there is one.
    pub fn stored(&self, cursor: Cursor) -> Option<Arc<str>> {
        let text = self.frames.get(self.shape, cursor)?;
        self.frames.shared.fetch_add(1, Ordering::Relaxed);
        Some(text)
    }

    /// The payload of a prepared `response` to this subscription's last item: the stored one,
    /// or `render()`'s, stored for the others when the item was an event and the response has
    /// no errors.
    pub fn payload(
        &self,
        response: &async_graphql::Response,
        render: impl FnOnce() -> String,
    ) -> Arc<str> {
        let served = std::mem::take(&mut *self.served.lock().unwrap_or_else(|p| p.into_inner()));
        match served {
            Served::Stored(text) => {
                self.frames.shared.fetch_add(1, Ordering::Relaxed);
                text
            }
            Served::Fresh(cursor) if response.errors.is_empty() => {
                let text: Arc<str> = render().into();
                self.frames.put(self.shape, cursor, text.clone());
                text
            }
            Served::Fresh(_) | Served::Unshared => render().into(),
        }
    }
}
