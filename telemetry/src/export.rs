//! Sending finished spans to the collector without ever holding up the process: a bounded
//! queue, one exporting thread, and every span that could not be sent counted by why.
//!
//! The SDK's own batch processor drops spans when its queue is full but only logs the count at
//! shutdown; this one counts every loss as it happens ([`stats`]), which is what an operator
//! alerts on (`compute_trace_spans_dropped_total`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

static EXPORTED: AtomicU64 = AtomicU64::new(0);
static DROPPED_QUEUE_FULL: AtomicU64 = AtomicU64::new(0);
static DROPPED_EXPORT_FAILED: AtomicU64 = AtomicU64::new(0);

/// What the exporter did since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans dropped because the queue was full (the collector slower than the process).
    pub dropped_queue_full: u64,
    /// Spans dropped because their batch could not be sent (the collector down or refusing),
    /// after the exporter's retries within `OTEL_EXPORTER_OTLP_TIMEOUT`.
    pub dropped_export_failed: u64,
}

/// The exporter's counters ([`Stats`]).
pub fn stats() -> Stats {
    Stats {
        exported: EXPORTED.load(Ordering::Relaxed),
        dropped_queue_full: DROPPED_QUEUE_FULL.load(Ordering::Relaxed),
        dropped_export_failed: DROPPED_EXPORT_FAILED.load(Ordering::Relaxed),
    }
}

/// The queue's settings, from the standard `OTEL_BSP_*` variables.
#[derive(Debug, Clone, Copy)]
pub struct QueueSettings {
    /// `OTEL_BSP_MAX_QUEUE_SIZE`, default 2048: spans waiting; one more is dropped.
    pub max_queue: usize,
    /// `OTEL_BSP_SCHEDULE_DELAY` in milliseconds, default 5000: the longest a span waits.
    pub delay: Duration,
    /// `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, default 512: spans per request.
    pub max_batch: usize,
}

impl QueueSettings {
    pub fn from_env() -> QueueSettings {
        let number = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|n| *n > 0)
                .unwrap_or(default)
        };
        let max_queue = number("OTEL_BSP_MAX_QUEUE_SIZE", 2048) as usize;
        QueueSettings {
            max_queue,
            delay: Duration::from_millis(number("OTEL_BSP_SCHEDULE_DELAY", 5000)),
            max_batch: (number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512) as usize).min(max_queue),
        }
    }
}

enum Message {
    Span(Box<SpanData>),
    Flush(mpsc::Sender<OTelSdkResult>),
    Shutdown(mpsc::Sender<OTelSdkResult>),
}

/// The span processor: `on_end` only tries to queue (never waits); a thread of its own batches
/// and exports, on the process's Tokio runtime ([`tokio::runtime::Handle::block_on`]) so the
/// HTTP client is the workspace's.
#[derive(Debug)]
pub struct Batcher {
    queue: SyncSender<Message>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Batcher {
    pub fn start<E: SpanExporter + 'static>(
        mut exporter: E,
        resource: &Resource,
        settings: QueueSettings,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Batcher> {
        exporter.set_resource(resource);
        let (queue, received) = mpsc::sync_channel(settings.max_queue);
        let thread = std::thread::Builder::new()
            .name("otel-export".into())
            .spawn(move || run(exporter, received, settings, runtime))?;
        Ok(Batcher {
            queue,
            thread: Mutex::new(Some(thread)),
        })
    }

    fn ask(&self, make: impl FnOnce(mpsc::Sender<OTelSdkResult>) -> Message) -> OTelSdkResult {
        let (tx, rx) = mpsc::channel();
        self.queue
            .send(make(tx))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        rx.recv().map_err(|_| OTelSdkError::AlreadyShutdown)?
    }
}

impl SpanProcessor for Batcher {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        match self.queue.try_send(Message::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                DROPPED_QUEUE_FULL.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.ask(Message::Flush)
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) else {
            return Ok(());
        };
        let result = self.ask(Message::Shutdown);
        let _ = thread.join();
        result
    }

    fn set_resource(&mut self, _resource: &Resource) {}
}

/// The exporting thread: a batch goes out when it is full, when its oldest span waited the
/// delay, and on a flush or the shutdown.
fn run<E: SpanExporter>(
    exporter: E,
    received: mpsc::Receiver<Message>,
    settings: QueueSettings,
    runtime: tokio::runtime::Handle,
) {
    let mut batch: Vec<SpanData> = Vec::with_capacity(settings.max_batch);
    let mut failures = FailureLog::default();
    let mut send = |batch: &mut Vec<SpanData>| -> OTelSdkResult {
        if batch.is_empty() {
            return Ok(());
        }
        let spans = std::mem::take(batch);
        let count = spans.len() as u64;
        let result = runtime.block_on(exporter.export(spans));
        match &result {
            Ok(()) => {
                EXPORTED.fetch_add(count, Ordering::Relaxed);
                failures.recovered();
            }
            Err(e) => {
                DROPPED_EXPORT_FAILED.fetch_add(count, Ordering::Relaxed);
                failures.failed(count, e);
            }
        }
        result
    };
    let mut due = Instant::now() + settings.delay;
    loop {
        let wait = due.saturating_duration_since(Instant::now());
        match received.recv_timeout(wait) {
            Ok(Message::Span(span)) => {
                if batch.is_empty() {
                    due = Instant::now() + settings.delay;
                }
                batch.push(*span);
                if batch.len() >= settings.max_batch {
                    let _ = send(&mut batch);
                }
            }
            Ok(Message::Flush(reply)) => {
                let _ = reply.send(send(&mut batch));
            }
            Ok(Message::Shutdown(reply)) => {
                let result = send(&mut batch);
                let _ = exporter.shutdown();
                let _ = reply.send(result);
                return;
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = send(&mut batch);
                due = Instant::now() + settings.delay;
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = send(&mut batch);
                return;
            }
        }
    }
}

/// Says that exports fail once, then at most once a minute with how many spans were lost, and
/// once when they work again: a collector that is down must not flood the log.
#[derive(Default)]
struct FailureLog {
    failing_since: Option<Instant>,
    last_said: Option<Instant>,
    lost: u64,
}

impl FailureLog {
    fn failed(&mut self, count: u64, error: &OTelSdkError) {
        self.lost += count;
        let now = Instant::now();
        self.failing_since.get_or_insert(now);
        if self
            .last_said
            .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60))
        {
            tracing::warn!(
                target: "compute_telemetry",
                spans_lost = self.lost,
                error = %error,
                "traces could not be sent to the collector; spans are dropped (compute_trace_spans_dropped_total)"
            );
            self.last_said = Some(now);
            self.lost = 0;
        }
    }

    fn recovered(&mut self) {
        if let Some(since) = self.failing_since.take() {
            tracing::info!(
                target: "compute_telemetry",
                failed_for_seconds = since.elapsed().as_secs(),
                "traces reach the collector again"
            );
            self.last_said = None;
            self.lost = 0;
        }
    }
}

/// The OTLP exporter's HTTP client: the workspace's reqwest, run on the process's runtime by
/// the exporting thread, with the exporter's timeout.
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
}

impl Client {
    pub fn new(timeout: Duration) -> Result<Client, reqwest::Error> {
        Ok(Client {
            http: reqwest::Client::builder().timeout(timeout).build()?,
        })
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let response = self.http.execute(request).await?;
        let mut answer = http::Response::builder().status(response.status().as_u16());
        for (name, value) in response.headers() {
            answer = answer.header(name.as_str(), value.as_bytes());
        }
        // The collector's answer is small (a partial-success message at most); bounded anyway.
        let body = response.bytes().await?;
        let body = body.slice(..body.len().min(64 * 1024));
        Ok(answer.body(body)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Span as _, Tracer, TracerProvider};

    /// An exporter that holds every export until it is let go, then fails or succeeds.
    #[derive(Debug)]
    struct Gate {
        open: Arc<(Mutex<bool>, std::sync::Condvar)>,
        fail: bool,
    }

    impl SpanExporter for Gate {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            let (lock, cv) = &*self.open;
            let mut open = lock.lock().unwrap_or_else(|p| p.into_inner());
            while !*open {
                open = cv.wait(open).unwrap_or_else(|p| p.into_inner());
            }
            if self.fail {
                Err(OTelSdkError::InternalFailure(
                    "the collector is down".into(),
                ))
            } else {
                Ok(())
            }
        }
    }

    use std::sync::Arc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_full_queue_and_a_failed_export_drop_spans_and_count_them() {
        let before = stats();
        let open = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        let batcher = Batcher::start(
            Gate {
                open: open.clone(),
                fail: true,
            },
            &Resource::builder_empty().build(),
            QueueSettings {
                max_queue: 4,
                delay: Duration::from_millis(10),
                max_batch: 1,
            },
            tokio::runtime::Handle::current(),
        )
        .expect("start");
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_span_processor(batcher)
            .build();
        let tracer = provider.tracer("test");
        // The thread takes the first span and waits at the gate, which stays closed: an `on_end`
        // that waited for room would never return. Four more fill the queue; the other fifteen
        // are dropped at once.
        tracer.start("first").end();
        std::thread::sleep(Duration::from_millis(100));
        for _ in 0..19 {
            tracer.start("span").end();
        }
        let after = stats();
        assert_eq!(after.dropped_queue_full - before.dropped_queue_full, 15);
        // The collector answers: every span that was queued fails to export and is counted.
        {
            let (lock, cv) = &*open;
            *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
            cv.notify_all();
        }
        tokio::task::spawn_blocking(move || provider.shutdown())
            .await
            .expect("join")
            .expect("shutdown");
        let after = stats();
        assert_eq!(
            after.dropped_export_failed - before.dropped_export_failed,
            5
        );
        assert_eq!(after.exported, before.exported);
    }
}
