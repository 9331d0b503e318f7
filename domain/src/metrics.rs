//! One metrics registry per process (`prometheus-client`), shared by everything that measures:
//! the database's transactions (here), the API's requests and subscriptions, the workers' queue
//! and webhooks. Each metric is declared once, with its help text, where it is measured, and
//! registered into the process's [`Registry`]; `/metrics` encodes the registry in the OpenMetrics
//! text format. `compute-api dev`, which runs the workers in-process, serves both sets on one
//! endpoint.

use std::sync::{Arc, Mutex};

pub use prometheus_client;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

/// The content type of [`Registry::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of latency buckets, in seconds: 1 ms to 10 s.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A latency histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// The process's registry: cheap to clone, registered into at start-up, encoded on each scrape.
#[derive(Clone, Default)]
pub struct Registry(Arc<Mutex<prometheus_client::registry::Registry>>);

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registry")
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, prometheus_client::registry::Registry> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `metric` (a clone of the handle its owner keeps) as `name` with `help`. A
    /// counter's name is given without `_total`, which the encoding adds.
    pub fn register(
        &self,
        name: &str,
        help: &str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        self.lock().register(name, help, metric);
    }

    /// Declares a value read at each scrape (a counter or gauge its owner keeps in atomics, or a
    /// reading such as the pool's connections): `series` gives, for each label value of `label`
    /// (none when `label` is `None`), the current value.
    pub fn sample<L>(
        &self,
        name: &'static str,
        help: &'static str,
        kind: Sampled,
        label: Option<&'static str>,
        series: impl Fn() -> Vec<(L, f64)> + Send + Sync + 'static,
    ) where
        L: Into<std::borrow::Cow<'static, str>>,
    {
        self.lock().register_collector(Box::new(SampledCollector {
            name,
            help,
            kind,
            label,
            series: Box::new(move || {
                series()
                    .into_iter()
                    .map(|(label, value)| (label.into(), value))
                    .collect()
            }),
        }));
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.lock());
        out
    }
}

/// Registers the process's trace export (`compute_telemetry::stats`):
/// `compute_trace_spans_exported_total` and `compute_trace_spans_dropped_total{reason}`
/// (`queue_full`: the collector was slower than the process; `export_failed`: it was down or
/// refused). Both stay 0 when tracing is off.
pub fn register_trace_metrics(registry: &Registry) {
    registry.sample(
        "compute_trace_spans_exported",
        "Spans the OpenTelemetry collector accepted from this process",
        Sampled::Counter,
        None,
        || vec![("", compute_telemetry::stats().exported as f64)],
    );
    registry.sample(
        "compute_trace_spans_dropped",
        "Spans this process dropped instead of exporting, by reason: queue_full (the collector slower than the process) or export_failed (the collector down or refusing)",
        Sampled::Counter,
        Some("reason"),
        || {
            let s = compute_telemetry::stats();
            vec![
                ("queue_full", s.dropped_queue_full as f64),
                ("export_failed", s.dropped_export_failed as f64),
            ]
        },
    );
}

/// What a sampled value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampled {
    /// Only grows (its name is given without `_total`).
    Counter,
    /// Goes up and down.
    Gauge,
}

/// A sampled family's series: each label value (static, or made at the scrape) and its value.
type Series = Box<dyn Fn() -> Vec<(std::borrow::Cow<'static, str>, f64)> + Send + Sync>;

struct SampledCollector {
    name: &'static str,
    help: &'static str,
    kind: Sampled,
    label: Option<&'static str>,
    series: Series,
}

impl std::fmt::Debug for SampledCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl prometheus_client::collector::Collector for SampledCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let metric_type = match self.kind {
            Sampled::Counter => ConstCounter::new(0.0_f64).metric_type(),
            Sampled::Gauge => ConstGauge::new(0.0_f64).metric_type(),
        };
        let mut family = encoder.encode_descriptor(self.name, self.help, None, metric_type)?;
        let encode =
            |series: prometheus_client::encoding::MetricEncoder<'_>, value: f64| match self.kind {
                // Counters count whole events; an integer reads as one.
                Sampled::Counter => ConstCounter::new(value.max(0.0) as u64).encode(series),
                Sampled::Gauge => ConstGauge::new(value).encode(series),
            };
        let values = (self.series)();
        match self.label {
            None => {
                if let Some((_, value)) = values.first() {
                    encode(family, *value)?;
                }
            }
            Some(label) => {
                for (value_label, value) in values {
                    let labels = [(label, value_label.as_ref())];
                    encode(family.encode_family(&labels)?, value)?;
                }
            }
        }
        Ok(())
    }
}

/// Labels of a transaction's metrics: its name (`Db::tx`'s first argument) and kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TxLabels {
    pub transaction: &'static str,
    pub kind: &'static str,
}

/// Labels of a failed transaction: its name and the error's code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TxErrorLabels {
    pub transaction: &'static str,
    pub code: &'static str,
}

/// Labels of a reservation create's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// The metrics of `Db::tx`: every transaction's latency, and its failures by code; and what
/// the reservation creates made of their requests (placement's outcomes).
#[derive(Clone, Debug)]
pub struct TxMetrics {
    pub seconds: Family<TxLabels, Histogram, fn() -> Histogram>,
    pub errors: Family<TxErrorLabels, Counter>,
    pub creates: Family<OutcomeLabels, Counter>,
}

impl Default for TxMetrics {
    fn default() -> Self {
        TxMetrics {
            seconds: Family::new_with_constructor(latency_histogram),
            errors: Family::default(),
            creates: Family::default(),
        }
    }
}

impl TxMetrics {
    /// Registers both families.
    pub fn register(&self, registry: &Registry) {
        registry.register(
            "compute_db_transaction_seconds",
            "Latency of each named database transaction (Db::tx), from BEGIN to COMMIT or ROLLBACK, retries included.",
            self.seconds.clone(),
        );
        registry.register(
            "compute_db_transaction_errors",
            "Named database transactions that ended in an error, by the error's code.",
            self.errors.clone(),
        );
        registry.register(
            "compute_reservation_creates",
            "createReservation calls by outcome: placed (scheduled or active), pending (no \
             capacity now: Unschedulable), replayed (an idempotency key's stored answer), \
             quota_exceeded, or refused (any other error).",
            self.creates.clone(),
        );
    }
}
