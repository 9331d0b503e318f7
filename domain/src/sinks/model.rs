//! How a sink's deliveries are going: a leaf of `sinks` (the event contract names it).

use crate::text_enum::text_enum;

text_enum!(
    /// How a sink's deliveries are going.
    SinkState {
        /// Deliveries succeed (or have not failed often enough to say otherwise).
        Healthy = "healthy",
        /// The last deliveries failed; it is retried with backoff.
        Failing = "failing",
        /// It fell behind the outbox's retention and skipped events.
        Behind = "behind",
    }
);
