//! Logs and traces, set up the same way by every binary (`compute-api`, `compute-worker`,
//! `compute-sim`, `compute-agent`).
//!
//! - Logs go to stderr, filtered by `RUST_LOG`, as text or JSON (`--log-format`).
//! - Traces go to an OpenTelemetry collector over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT`
//!   (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and nowhere otherwise. The standard
//!   variables configure them: `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, the default, or
//!   `http/json`), `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`,
//!   `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (and `_ARG`),
//!   `OTEL_BSP_*`, `OTEL_SDK_DISABLED`. Which spans are sent is `COMPUTE_TRACE_FILTER` (a
//!   `RUST_LOG`-style filter; by default this system's spans down to `debug`, others' from
//!   `warn`).
//! - Spans wait in a bounded queue and leave from a thread of their own: a collector that is
//!   slow or down never holds up a request, and every span lost is counted ([`stats`]).
//!
//! [`context`] reads and writes W3C `traceparent`, the one form trace context takes across
//! processes: HTTP headers, the WebSocket's `connection_init`, the rows of the outbox, the work
//! queue and the commands, the node protocol.

pub mod context;
mod export;

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use context::TraceParent;
pub use export::{Stats, stats};

/// How a process writes its log lines (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// For a person: one line an event, coloured at a terminal.
    Pretty,
    /// For a log shipper: one JSON object a line, the event's fields at the top level.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<LogFormat, String> {
        match s {
            "pretty" => Ok(LogFormat::Pretty),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format `{other}`: use pretty or json")),
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces (an endpoint was configured and the exporter started).
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The spans sent when `COMPUTE_TRACE_FILTER` is not set: this system's own down to `debug`
/// (transactions, domain steps), everything else's from `warn`.
pub const DEFAULT_TRACE_FILTER: &str = "warn,compute_api=debug,compute_domain=debug,compute_workers=debug,compute_agent=debug,compute_sim=debug";

/// The tracing of a running process; [`Telemetry::shutdown`] sends what is queued.
#[must_use = "keep it until the process ends, then call shutdown"]
pub struct Telemetry {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// No tracing (a short command).
    pub fn off() -> Telemetry {
        Telemetry { provider: None }
    }

    /// Sends the spans still queued (within the exporter's timeout) and stops the exporter.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// What tracing is configured to do, read from the standard environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceConfig {
    Off,
    Otlp { protocol: &'static str },
}

/// Reads the configuration; an unsupported protocol or exporter is an error to stop on, not a
/// silent loss of every trace.
pub fn trace_config() -> Result<TraceConfig, String> {
    let var = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(TraceConfig::Off);
    }
    match var("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return Ok(TraceConfig::Off),
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_EXPORTER={other} is not supported: use otlp or none"
            ));
        }
    }
    if var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
        && var("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
    {
        return Ok(TraceConfig::Off);
    }
    let protocol = var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "http/protobuf".into());
    match protocol.as_str() {
        "http/protobuf" => Ok(TraceConfig::Otlp {
            protocol: "http/protobuf",
        }),
        "http/json" => Ok(TraceConfig::Otlp {
            protocol: "http/json",
        }),
        other => Err(format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported: use http/protobuf or http/json \
             (a collector's OTLP/HTTP port, 4318 by default)"
        )),
    }
}

fn exporter_timeout() -> std::time::Duration {
    [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
    .map_or(
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis,
    )
}

/// Sets up logging and tracing once for the process. `service` names it to the collector unless
/// `OTEL_SERVICE_NAME` does. Call it inside the Tokio runtime (the exporter sends on it).
pub fn init(
    service: &'static str,
    format: LogFormat,
    default_log: &str,
) -> Result<Telemetry, String> {
    install(service, format, default_log, trace_config()?)
}

/// Sets up logging only, for a short command (a migration, a grant): no traces whatever the
/// environment says.
pub fn init_logs(format: LogFormat, default_log: &str) {
    let _ = install("compute", format, default_log, TraceConfig::Off);
}

fn install(
    service: &'static str,
    format: LogFormat,
    default_log: &str,
    config: TraceConfig,
) -> Result<Telemetry, String> {
    let log_filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_log));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let logs: Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync> = match format {
        LogFormat::Pretty => logs.with_filter(log_filter).boxed(),
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_filter(log_filter)
            .boxed(),
    };
    let (traces, provider) = match config {
        TraceConfig::Off => (None, None),
        TraceConfig::Otlp { protocol } => {
            let provider = provider(service, protocol)?;
            let tracer = provider.tracer("compute");
            let filter = std::env::var("COMPUTE_TRACE_FILTER")
                .ok()
                .filter(|v| !v.trim().is_empty())
                .unwrap_or_else(|| DEFAULT_TRACE_FILTER.into());
            let filter = tracing_subscriber::EnvFilter::try_new(&filter)
                .map_err(|e| format!("COMPUTE_TRACE_FILTER: {e}"))?;
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_tracked_inactivity(false)
                .with_threads(false)
                .with_filter(filter)
                .boxed();
            (Some(layer), Some(provider))
        }
    };
    let installed = tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()
        .is_ok();
    if installed && provider.is_some() {
        ENABLED.store(true, Ordering::Relaxed);
    }
    if let (true, TraceConfig::Otlp { protocol }) = (installed, &config) {
        tracing::info!(protocol, service, "exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}

/// Traces begin where a request enters: a span with no parent is sampled (by
/// `OTEL_TRACES_SAMPLER`, parent-based always-on by default) only when it serves a request
/// (`otel.kind = "server"`: the HTTP server span, a WebSocket operation). Everything else a
/// process does on its own (polls, lease renewals, maintenance transactions) is traced only as
/// part of a trace that a request began, continued from the trace context stored with the row
/// it works on; without one it is not recorded.
#[derive(Debug, Clone)]
struct EntrySampler {
    inner: Box<dyn opentelemetry_sdk::trace::ShouldSample>,
}

impl opentelemetry_sdk::trace::ShouldSample for EntrySampler {
    fn should_sample(
        &self,
        parent: Option<&opentelemetry::Context>,
        trace_id: opentelemetry::trace::TraceId,
        name: &str,
        kind: &opentelemetry::trace::SpanKind,
        attributes: &[opentelemetry::KeyValue],
        links: &[opentelemetry::trace::Link],
    ) -> opentelemetry_sdk::trace::SamplingResult {
        use opentelemetry::trace::TraceContextExt;
        let has_parent = parent.is_some_and(|cx| cx.span().span_context().is_valid());
        if !has_parent && *kind != opentelemetry::trace::SpanKind::Server {
            return opentelemetry_sdk::trace::SamplingResult {
                decision: opentelemetry_sdk::trace::SamplingDecision::Drop,
                attributes: Vec::new(),
                trace_state: Default::default(),
            };
        }
        self.inner
            .should_sample(parent, trace_id, name, kind, attributes, links)
    }
}

fn provider(
    service: &'static str,
    protocol: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, String> {
    let client = export::Client::new(exporter_timeout())
        .map_err(|e| format!("the trace exporter's HTTP client: {e}"))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(if protocol == "http/json" {
            Protocol::HttpJson
        } else {
            Protocol::HttpBinary
        })
        .with_http_client(client)
        .build()
        .map_err(|e| format!("the trace exporter: {e}"))?;
    let resource = if std::env::var_os("OTEL_SERVICE_NAME").is_some() {
        opentelemetry_sdk::Resource::builder().build()
    } else {
        opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build()
    };
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "tracing must be set up inside the Tokio runtime".to_owned())?;
    let batcher = export::Batcher::start(
        exporter,
        &resource,
        export::QueueSettings::from_env(),
        runtime,
    )
    .map_err(|e| format!("the trace exporter's thread: {e}"))?;
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_sampler(EntrySampler {
            inner: opentelemetry_sdk::trace::Config::default().sampler,
        })
        .with_span_processor(batcher)
        .with_resource(resource)
        .build())
}
