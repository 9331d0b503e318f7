//! W3C trace context (`traceparent`, <https://www.w3.org/TR/trace-context/>): read from a caller,
//! written to a receiver and stored with the rows that carry work across processes, and the
//! helpers that tie a `tracing` span to one.

use std::fmt;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// One `traceparent`: a trace, the span that is the parent of the next hop, and whether the
/// trace is sampled. Written as `00-<32 hex>-<16 hex>-<2 hex>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

fn hex_bytes<const N: usize>(text: &str) -> Option<[u8; N]> {
    let bytes = text.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn write_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 0xf) as usize] as char);
    }
}

impl TraceParent {
    /// Parses a `traceparent` header's value as the specification says a receiver must: version
    /// `00` exactly as long as it is written, a later version by its first four fields (and
    /// `ff` never), lowercase hex only, and neither id all zeros. Anything else is `None`: the
    /// request starts a trace of its own.
    pub fn parse(text: &str) -> Option<TraceParent> {
        let text = text.trim_matches([' ', '\t']);
        let mut parts = text.splitn(5, '-');
        let version = hex_bytes::<1>(parts.next()?)?[0];
        let trace_id = hex_bytes::<16>(parts.next()?)?;
        let span_id = hex_bytes::<8>(parts.next()?)?;
        let flags = parts.next()?;
        let rest = parts.next();
        if version == 0xff || (version == 0 && rest.is_some()) {
            return None;
        }
        let flags = hex_bytes::<1>(flags)?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The trace id as 32 lowercase hex digits: what a response names and a user quotes.
    pub fn trace_id_hex(&self) -> String {
        let mut out = String::with_capacity(32);
        write_hex(&mut out, &self.trace_id);
        out
    }

    fn span_context(&self) -> SpanContext {
        SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            if self.sampled {
                TraceFlags::SAMPLED
            } else {
                TraceFlags::default()
            },
            true,
            TraceState::default(),
        )
    }

    fn from_span_context(cx: &SpanContext) -> Option<TraceParent> {
        cx.is_valid().then(|| TraceParent {
            trace_id: cx.trace_id().to_bytes(),
            span_id: cx.span_id().to_bytes(),
            sampled: cx.is_sampled(),
        })
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        write_hex(&mut out, &self.trace_id);
        out.push('-');
        write_hex(&mut out, &self.span_id);
        out.push_str(if self.sampled { "-01" } else { "-00" });
        f.write_str(&out)
    }
}

/// The trace context of `span` when traces are exported and the span is recorded: what the
/// next hop continues (a header, a row's `traceparent`). `None` when tracing is off.
pub fn of_span(span: &tracing::Span) -> Option<TraceParent> {
    if !crate::enabled() || span.is_disabled() {
        return None;
    }
    TraceParent::from_span_context(span.context().span().span_context())
}

/// [`of_span`] of the current span.
pub fn current() -> Option<TraceParent> {
    of_span(&tracing::Span::current())
}

/// Makes `span` a child of the remote `parent` (a caller's header, a stored row's context).
/// Call it before the span is first entered. Nothing when tracing is off.
pub fn continue_from(span: &tracing::Span, parent: &TraceParent) {
    if !crate::enabled() || span.is_disabled() {
        return;
    }
    let cx = opentelemetry::Context::new().with_remote_span_context(parent.span_context());
    // Fails only for a span already started, which callers do not pass.
    let _ = span.set_parent(cx);
}

/// Links `span` to `other`: a span that serves several traces at once (a batch) names each.
pub fn link(span: &tracing::Span, other: &TraceParent) {
    if !crate::enabled() || span.is_disabled() {
        return;
    }
    span.add_link(other.span_context());
}

/// A trace id for a response when no span has one (tracing off, the caller sent none): this
/// process's random 64 bits then a counter, so the id a user quotes finds the request's log
/// lines (its span's `trace_id`).
pub fn fresh_trace_id() -> [u8; 16] {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NONCE: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new()
            .hash_one((std::process::id(), std::time::SystemTime::now()))
    });
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&NONCE.to_be_bytes());
    id[8..].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_be_bytes());
    id
}

/// 16 bytes as 32 lowercase hex digits.
pub fn trace_id_hex(id: &[u8; 16]) -> String {
    let mut out = String::with_capacity(32);
    write_hex(&mut out, id);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let tp = TraceParent::parse(GOOD).expect("valid");
        assert!(tp.sampled);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.to_string(), GOOD);
        let unsampled = TraceParent::parse(&GOOD.replace("-01", "-00")).expect("valid");
        assert!(!unsampled.sampled);
    }

    #[test]
    fn what_the_specification_refuses_is_refused() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A later version is read by its first four fields.
        assert!(
            TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what")
                .is_some()
        );
    }

    #[test]
    fn fresh_trace_ids_differ() {
        assert_ne!(fresh_trace_id(), fresh_trace_id());
        assert_eq!(trace_id_hex(&[0xab; 16]).len(), 32);
    }
}
