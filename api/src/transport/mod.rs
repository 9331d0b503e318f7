//! The transports of the schema: GraphQL over HTTP (`http`), over WebSocket (`ws`) and over
//! Server-Sent Events (`sse`). `http` serves `/graphql` and hands a request to `ws` or `sse` when
//! it asks for them. What the three share is here, once: the bearer token, the request's body and
//! query string, and the checks of a GraphQL request's fields.

pub mod agent;
pub mod console;
pub mod csv;
pub mod http;
pub mod sse;
pub mod ws;

use async_graphql::parser::types::{DocumentOperations, OperationType};
use async_graphql::{ServerError, Variables};
use axum::extract::Query;
use axum::http::{HeaderMap, Uri, header};
use serde::Deserialize;
use serde_json::Value;

use compute_domain::ErrorCode;

use crate::auth::{Viewer, bearer};
use crate::state::AppState;

/// `extensions.code` of a document that does not parse.
pub const PARSE_FAILED: &str = crate::codes::TransportCode::GraphqlParseFailed.as_str();
/// `extensions.code` of a document that does not validate against the schema.
pub const VALIDATION_FAILED: &str = crate::codes::TransportCode::GraphqlValidationFailed.as_str();
/// `extensions.code` of an HTTP request that is not a GraphQL-over-HTTP request.
pub const BAD_REQUEST: &str = crate::codes::TransportCode::BadRequest.as_str();

/// Verifies the `Authorization` header: `Ok(None)` without one, `Err` with the reason for the
/// `401` otherwise.
pub fn authenticate(app: &AppState, headers: &HeaderMap) -> Result<Option<Viewer>, String> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let token = value
        .to_str()
        .ok()
        .and_then(bearer)
        .ok_or("the Authorization header must be `Bearer <jwt>`")?;
    app.identify(token).map(Some)
}

/// A close reason that fits a WebSocket close frame (at most 123 bytes), for every WebSocket
/// transport (`ws.rs`, `agent.rs`).
pub fn fit_reason(reason: &str) -> String {
    let mut end = reason.len().min(123);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_owned()
}

/// Whether the request's body is declared JSON (`Content-Type: application/json`, any
/// parameters): the only body a GraphQL POST takes, on every transport.
pub fn has_json_body(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| {
            ct.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("application/json")
        })
        .unwrap_or(false)
}

/// The largest request body any transport reads.
pub const MAX_BODY: usize = 2 * 1024 * 1024;

/// Why a request body was not read.
#[derive(Debug)]
pub enum BodyError {
    /// Over [`MAX_BODY`]: `413`, `BAD_REQUEST`.
    TooLarge(String),
    /// Not all there within the request deadline: `408`, `TIMEOUT`, and the connection closes.
    TooSlow(String),
    /// Broken off or malformed (a reset stream, bad chunked encoding): `400`, `BAD_REQUEST`,
    /// and the connection closes.
    Broken(String),
}

impl BodyError {
    /// The HTTP status of the refusal.
    pub fn status(&self) -> axum::http::StatusCode {
        match self {
            BodyError::TooLarge(_) => axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TooSlow(_) => axum::http::StatusCode::REQUEST_TIMEOUT,
            BodyError::Broken(_) => axum::http::StatusCode::BAD_REQUEST,
        }
    }

    /// Its `extensions.code`.
    pub fn code(&self) -> &'static str {
        match self {
            BodyError::TooLarge(_) | BodyError::Broken(_) => BAD_REQUEST,
            BodyError::TooSlow(_) => crate::codes::TransportCode::Timeout.as_str(),
        }
    }

    /// What it says.
    pub fn message(&self) -> &str {
        match self {
            BodyError::TooLarge(m) | BodyError::TooSlow(m) | BodyError::Broken(m) => m,
        }
    }

    /// `response` with `Connection: close` when the body was too slow: the rest of it is not
    /// read, and the connection is not kept for another request.
    pub fn finish(&self, mut response: axum::response::Response) -> axum::response::Response {
        if matches!(self, BodyError::TooSlow(_) | BodyError::Broken(_)) {
            response.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

/// Reads a request body of at most [`MAX_BODY`] bytes within the request deadline
/// ([`crate::limits::Limits::request_timeout`], counted from the end of the headers, which
/// [`crate::limits::Limits::header_timeout`] bounds), or says why not. A body sent a byte at a
/// time cannot hold a connection longer than that.
pub async fn read_body(
    app: &AppState,
    body: axum::body::Body,
) -> Result<axum::body::Bytes, BodyError> {
    let deadline = app.limits.request_timeout;
    // Read frame by frame, so that a body over the limit and a body that breaks off (a reset
    // stream, malformed chunked encoding) get their own answers.
    let read = async {
        use futures_util::StreamExt;
        let mut stream = body.into_data_stream();
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| BodyError::Broken(format!("the body could not be read: {e}")))?;
            if buf.len() + chunk.len() > MAX_BODY {
                return Err(BodyError::TooLarge(format!(
                    "the body is larger than {} MiB",
                    MAX_BODY / (1024 * 1024)
                )));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(axum::body::Bytes::from(buf))
    };
    match tokio::time::timeout(deadline, read).await {
        Ok(read) => read,
        Err(_) => {
            app.metrics.record_refusal("body_timeout");
            Err(BodyError::TooSlow(format!(
                "the request body did not arrive within {} s",
                deadline.as_secs_f64()
            )))
        }
    }
}

/// The peer address the server put in the request, if it did.
pub fn peer_of(extensions: &axum::http::Extensions) -> Option<crate::graph::admission::Peer> {
    extensions.get::<crate::graph::admission::Peer>().copied()
}

/// The JSON body of a POST request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PostBody {
    query: Option<Value>,
    operation_name: Option<Value>,
    variables: Option<Value>,
    extensions: Option<Value>,
}

/// Why a request cannot run before it is parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// Not a GraphQL request (`BAD_REQUEST`): a malformed body or field.
    Malformed(String),
    /// A GraphQL request whose persisted query cannot run: a request error with its code.
    Persisted(crate::persisted::Refusal),
}

impl From<String> for Refused {
    fn from(message: String) -> Refused {
        Refused::Malformed(message)
    }
}

/// The GraphQL request in a POST body, or why it is not one.
pub fn request_from_body(
    persisted: &crate::persisted::Persisted,
    body: &[u8],
) -> Result<async_graphql::Request, Refused> {
    let body: PostBody = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not a GraphQL request object: {e}"))?;
    build_request(
        persisted,
        body.query,
        body.operation_name,
        body.variables,
        body.extensions,
    )
}

/// The query-string parameters of a GET request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GetParams {
    pub query: Option<String>,
    operation_name: Option<String>,
    variables: Option<String>,
    extensions: Option<String>,
}

impl GetParams {
    /// The parameters of `uri`'s query string, or why they do not parse.
    pub fn from_uri(uri: &Uri) -> Result<GetParams, String> {
        Query::<GetParams>::try_from_uri(uri)
            .map(|Query(p)| p)
            .map_err(|e| e.body_text())
    }

    /// The GraphQL request they hold (`variables` and `extensions` are JSON texts).
    pub fn into_request(
        self,
        persisted: &crate::persisted::Persisted,
    ) -> Result<async_graphql::Request, Refused> {
        let json = |name: &str, raw: Option<String>| -> Result<Option<Value>, String> {
            raw.map(|s| {
                serde_json::from_str::<Value>(&s).map_err(|e| format!("`{name}` is not JSON: {e}"))
            })
            .transpose()
        };
        let variables = json("variables", self.variables)?;
        let extensions = json("extensions", self.extensions)?;
        build_request(
            persisted,
            self.query.map(Value::String),
            self.operation_name.map(Value::String),
            variables,
            extensions,
        )
    }
}

/// A GraphQL request from its four fields, each checked for its JSON type; a persisted query
/// (`extensions.persistedQuery`) is resolved here, on every transport (`crate::persisted`).
pub fn build_request(
    persisted: &crate::persisted::Persisted,
    query: Option<Value>,
    operation_name: Option<Value>,
    variables: Option<Value>,
    extensions: Option<Value>,
) -> Result<async_graphql::Request, Refused> {
    let query = match query {
        Some(Value::String(q)) => Some(q),
        Some(Value::Null) | None => None,
        Some(_) => return Err(Refused::Malformed("`query` must be a string".into())),
    };
    let extensions = match extensions {
        Some(e @ Value::Object(_)) => Some(e),
        Some(Value::Null) | None => None,
        Some(_) => {
            return Err(Refused::Malformed("`extensions` must be an object".into()));
        }
    };
    let resolved = persisted
        .resolve(query.as_deref(), extensions.as_ref())
        .map_err(|e| match e {
            crate::persisted::Unresolved::Malformed(why) => Refused::Malformed(why),
            crate::persisted::Unresolved::Refused(r) => Refused::Persisted(r),
        })?;
    let query = match resolved {
        Some(document) => document.to_string(),
        None => query.ok_or_else(|| Refused::Malformed("the request has no `query`".into()))?,
    };
    let mut request = async_graphql::Request::new(query);
    match operation_name {
        Some(Value::String(name)) => request = request.operation_name(name),
        Some(Value::Null) | None => {}
        Some(_) => {
            return Err(Refused::Malformed(
                "`operationName` must be a string".into(),
            ));
        }
    }
    match variables {
        Some(v @ Value::Object(_)) => request = request.variables(Variables::from_json(v)),
        Some(Value::Null) | None => {}
        Some(_) => return Err(Refused::Malformed("`variables` must be an object".into())),
    }
    Ok(request)
}

/// The type of the operation the request selects, when the document parses and names one,
/// the document parsed into the request ([`crate::graph::admission::AdmissionControl::parse`]: one longer than the
/// published limit is refused before anything parses it).
pub fn operation_type(
    app: &AppState,
    request: &mut async_graphql::Request,
) -> Result<Option<OperationType>, ServerError> {
    app.admission.parse(request)?;
    selected_type(request)
}

/// The type of the operation a parsed request selects (`operation_type` of a request whose
/// document is already in it: nothing is parsed again).
fn selected_type(
    request: &mut async_graphql::Request,
) -> Result<Option<OperationType>, ServerError> {
    let name = request.operation_name.clone();
    let doc = request.parsed_query()?;
    Ok(match &doc.operations {
        DocumentOperations::Single(op) => Some(op.node.ty),
        DocumentOperations::Multiple(ops) => match name {
            Some(name) => ops.get(name.as_str()).map(|op| op.node.ty),
            None if ops.len() == 1 => ops.values().next().map(|op| op.node.ty),
            None => None,
        },
    })
}

/// The responses of a request on a streaming transport (WebSocket, SSE), given what the door
/// said of it ([`crate::graph::admission::AdmissionControl::admit`], called before the request's viewer moved
/// into its stream): its refusal as the one response; a query or mutation's one response within
/// the request deadline; a subscription's responses as long as it runs. A request async-graphql
/// refuses is refunded ([`crate::graph::admission::AdmissionControl::settle`]).
pub fn execute_streaming(
    app: &AppState,
    mut request: async_graphql::Request,
    admitted: async_graphql::ServerResult<crate::graph::admission::Admission>,
) -> futures_util::stream::BoxStream<'static, async_graphql::Response> {
    use futures_util::StreamExt;
    let admission = match admitted {
        Ok(a) => a,
        Err(e) => {
            return futures_util::stream::once(std::future::ready(
                async_graphql::Response::from_errors(vec![e]),
            ))
            .boxed();
        }
    };
    let subscription = matches!(
        selected_type(&mut request),
        Ok(Some(OperationType::Subscription))
    );
    let door = app.admission.clone();
    let mut responses = app.schema.execute_stream(request);
    if subscription {
        let mut first = true;
        responses
            .map(move |mut r| {
                door.cap_errors(&mut r);
                if std::mem::take(&mut first) {
                    door.settle(&admission, &mut r);
                }
                r
            })
            .boxed()
    } else {
        // A query or mutation's one response, finished as over HTTP: its errors capped, its
        // cost in `extensions.cost`.
        futures_util::stream::once(async move {
            let mut r = door
                .within_deadline(async move { responses.next().await.unwrap_or_default() })
                .await;
            door.finish(&admission, &mut r);
            r
        })
        .boxed()
    }
}

/// The span of one GraphQL request on `transport`: a request id, the operation's name and the
/// caller. Every log line of the request (an `INTERNAL` error's included) carries it.
///
/// The subscriber formats a span's fields once, when the span is made, for every request: so
/// `operation` and `subject` are left out when there is none (an `Option` field records only its
/// value; an anonymous caller's span has no empty `subject=""`), every field is given at
/// creation (a field recorded later makes the JSON formatter parse and rewrite what it wrote),
/// and the id is written as one string ([`RequestId`]).
///
/// It belongs to `trace` (its parent is the trace's, when there is one) and names the trace's id
/// (`trace_id`), so a quoted id finds the request's log lines. With tracing on, its attributes
/// follow OpenTelemetry's GraphQL conventions (`graphql.operation.name`, `.type`). A trace with
/// no parent (a WebSocket operation whose client sent no `traceparent`) takes the span's own
/// trace id when tracing is on; the trace the operation belongs to is returned.
pub fn request_span(
    transport: &'static str,
    request: &async_graphql::Request,
    viewer: Option<&crate::auth::Viewer>,
    operation_type: Option<&'static str>,
    mut trace: crate::trace::Trace,
) -> (tracing::Span, crate::trace::Trace) {
    if !compute_telemetry::enabled() {
        // Only what the log lines show: no OpenTelemetry field is formatted for every request.
        let span = tracing::info_span!(
            "graphql",
            request.id = %RequestId::next(),
            trace_id = %trace.hex(),
            transport,
            operation = request.operation_name.as_deref(),
            subject = viewer.map(|v| v.subject.as_str()),
        );
        return (span, trace);
    }
    let started_anew = trace.parent.is_none();
    let span = tracing::info_span!(
        "graphql",
        otel.name = %format_args!("{} {}", operation_type.unwrap_or("graphql"), request.operation_name.as_deref().unwrap_or("anonymous")),
        // A WebSocket operation is where its request enters.
        otel.kind = if transport == "websocket" { "server" } else { "internal" },
        request.id = %RequestId::next(),
        trace_id = (!started_anew).then(|| trace.hex()),
        transport,
        graphql.operation.name = request.operation_name.as_deref(),
        graphql.operation.type = operation_type,
        subject = viewer.map(|v| v.subject.as_str()),
    );
    if let Some(parent) = &trace.parent {
        compute_telemetry::context::continue_from(&span, parent);
    } else if let Some(own) = compute_telemetry::context::of_span(&span) {
        trace = crate::trace::Trace::continuing(Some(own));
        span.record("trace_id", trace.hex());
    }
    (span, trace)
}

/// A request's id in the logs: `req_` and 32 hex digits, this process's random 64 bits then a
/// counter. Unique across processes (the prefix) and within one (the counter), for an atomic
/// increment: a UUIDv7 per request asked the kernel for random bytes every time.
struct RequestId(u64);

/// This process's half of every request id, drawn once.
static PROCESS_NONCE: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    use std::hash::BuildHasher;
    // The standard library seeds `RandomState` from the operating system's randomness.
    std::collections::hash_map::RandomState::new()
        .hash_one((std::process::id(), std::time::SystemTime::now()))
});

impl RequestId {
    fn next() -> Self {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        RequestId(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Written into a buffer and handed over once: `{:016x}` goes through the formatter's
        // padding path digit by digit, and this runs for every request.
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = *b"req_00000000000000000000000000000000";
        for (half, value) in [*PROCESS_NONCE, self.0].into_iter().enumerate() {
            for (i, byte) in text[4 + 16 * half..][..16].iter_mut().enumerate() {
                *byte = HEX[((value >> (60 - 4 * i)) & 0xf) as usize];
            }
        }
        // Only ASCII was written.
        f.write_str(std::str::from_utf8(&text).map_err(|_| std::fmt::Error)?)
    }
}

/// Sets `extensions.code` of an error.
pub fn set_code(e: &mut ServerError, code: &str) {
    let ext = e.extensions.get_or_insert_with(Default::default);
    ext.set("code", code);
}

fn has_code(e: &ServerError) -> bool {
    code_of(e).is_some()
}

/// The `extensions.code` of an error, if it has one.
pub fn code_of(e: &ServerError) -> Option<String> {
    match e.extensions.as_ref()?.get("code")? {
        async_graphql::Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// Gives every error of `response` a code and the request's trace id (`extensions.traceId`),
/// counts them, and says whether it is a request error: no `data`, because the document did not
/// parse or validate or the operation could not start.
pub fn prepare(app: &AppState, response: &mut async_graphql::Response) -> bool {
    let request_error = crate::graph::admission::is_request_error(response);
    crate::trace::stamp(&mut response.errors, crate::trace::current().as_ref());
    for e in &mut response.errors {
        if !has_code(e) {
            if request_error {
                set_code(e, VALIDATION_FAILED);
            } else {
                // Every resolver error is coded (`graph::GqlError` cannot hold an uncoded one),
                // so an uncoded field error is async-graphql's own: an argument or variable it
                // could not coerce to its input type. The caller's input, whatever the wording.
                set_code(e, ErrorCode::BadUserInput.as_str());
            }
        }
        let code = e
            .extensions
            .as_ref()
            .and_then(|x| x.get("code"))
            .map(|v| v.to_string());
        app.metrics
            .record_graphql_error(static_code(code.as_deref()));
    }
    request_error
}

/// The JSON of a prepared response: `data` unless it is a request error, `errors` and
/// `extensions` when there are any. It borrows the response and serializes it where it lies:
/// a page of thousands of fields is written once, not copied into a `serde_json::Value` first.
pub fn response_json(response: &async_graphql::Response, request_error: bool) -> ResponseJson<'_> {
    ResponseJson {
        data: (!request_error).then_some(&response.data),
        errors: &response.errors,
        extensions: &response.extensions,
    }
}

/// A prepared response as the specification shapes it ([`response_json`]); its keys in the
/// order `data`, `errors`, `extensions`.
#[derive(serde::Serialize)]
pub struct ResponseJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<&'a async_graphql::Value>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    errors: &'a [ServerError],
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    extensions: &'a std::collections::BTreeMap<String, async_graphql::Value>,
}

impl ResponseJson<'_> {
    /// The response as JSON text.
    pub fn text(&self) -> String {
        // Serializing these types cannot fail: their maps have string keys.
        serde_json::to_string(self).unwrap_or_else(|e| {
            tracing::error!(error = %e, "a GraphQL response did not serialize");
            r#"{"errors":[{"message":"the response could not be serialized","extensions":{"code":"INTERNAL"}}]}"#.to_owned()
        })
    }
}

/// Maps a code seen in a response back to its static name, for the metrics label.
/// (`crate::codes::Code::label`: every code the API answers has its own label.)
pub fn static_code(code: Option<&str>) -> &'static str {
    crate::codes::Code::label(code)
}

#[cfg(test)]
mod tests {
    use super::RequestId;

    #[test]
    fn request_ids_share_the_process_half_and_never_repeat() {
        let (a, b) = (RequestId::next().to_string(), RequestId::next().to_string());
        for id in [&a, &b] {
            let body = id.strip_prefix("req_").expect("the prefix");
            assert_eq!(body.len(), 32, "{id}");
            assert!(body.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        assert_eq!(a[..20], b[..20], "one process, one random half");
        assert_ne!(a, b);
    }

    #[test]
    fn a_request_id_is_its_two_halves_in_hex() {
        for n in [0, 1, 0xabc, u64::MAX - 1, u64::MAX] {
            assert_eq!(
                RequestId(n).to_string(),
                format!("req_{:016x}{:016x}", *super::PROCESS_NONCE, n)
            );
        }
    }
}
