//! The agent's own metrics (`/metrics` on `--listen`), in the `compute_agent_` vocabulary.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use compute_protocol::CommandKind;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    pub kind: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// The metrics, registered once.
pub struct Metrics {
    pub registry: Registry,
    pub commands: Family<CommandLabels, Counter>,
    pub workloads: Family<StateLabels, Gauge>,
    pub connected: Gauge,
    pub sessions: Counter,
    pub exits: Counter,
    pub journal_errors: Counter,
    /// The trace exporter's counters (`compute_telemetry::stats`), brought up to date at each
    /// scrape ([`Metrics::sample_traces`]).
    pub spans_exported: Counter,
    pub spans_dropped: Family<ReasonLabels, Counter>,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("compute_agent");
        let commands = Family::<CommandLabels, Counter>::default();
        registry.register(
            "commands",
            "Commands finished by this agent, by kind and outcome",
            commands.clone(),
        );
        let workloads = Family::<StateLabels, Gauge>::default();
        registry.register(
            "workloads",
            "Workloads in the journal, by state",
            workloads.clone(),
        );
        let connected = Gauge::default();
        registry.register(
            "connected",
            "1 while a session with the gateway is open",
            connected.clone(),
        );
        let sessions = Counter::default();
        registry.register(
            "sessions",
            "Sessions opened with a gateway",
            sessions.clone(),
        );
        let exits = Counter::default();
        registry.register(
            "workload_exits",
            "Workloads that ended on their own",
            exits.clone(),
        );
        let journal_errors = Counter::default();
        registry.register(
            "journal_errors",
            "Journal reads or writes that failed (a full or broken disk)",
            journal_errors.clone(),
        );
        let spans_exported = Counter::default();
        registry.register(
            "trace_spans_exported",
            "Spans the OpenTelemetry collector accepted from this agent",
            spans_exported.clone(),
        );
        let spans_dropped = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "trace_spans_dropped",
            "Spans this agent dropped instead of exporting, by reason: queue_full or export_failed",
            spans_dropped.clone(),
        );
        Metrics {
            registry,
            commands,
            workloads,
            connected,
            sessions,
            exits,
            journal_errors,
            spans_exported,
            spans_dropped,
        }
    }

    /// Brings the trace counters up to the exporter's.
    pub fn sample_traces(&self) {
        let s = compute_telemetry::stats();
        let catch_up = |c: &Counter, to: u64| {
            let now = c.get();
            if to > now {
                c.inc_by(to - now);
            }
        };
        catch_up(&self.spans_exported, s.exported);
        for (reason, n) in [
            ("queue_full", s.dropped_queue_full),
            ("export_failed", s.dropped_export_failed),
        ] {
            catch_up(
                &self.spans_dropped.get_or_create(&ReasonLabels { reason }),
                n,
            );
        }
    }

    /// Counts a finished command.
    pub fn finished(&self, kind: CommandKind, succeeded: bool) {
        self.commands
            .get_or_create(&CommandLabels {
                kind: kind.as_str(),
                outcome: if succeeded { "succeeded" } else { "failed" },
            })
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
