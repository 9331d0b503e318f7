//! GraphQL over Server-Sent Events: the distinct connections mode of the graphql-sse protocol,
//! on `/graphql/stream` (GET or POST), and on `/graphql` when `Accept` asks for
//! `text/event-stream`.
//!
//! One request, one operation, one event stream. Each result is a `next` event whose data is the
//! execution result; a subscription item also has an `id:` line holding its outbox cursor, so an
//! `EventSource` that reconnects sends it back as `Last-Event-ID` and the subscription resumes
//! after it, with nothing lost or doubled. The stream ends with a `complete` event. As the
//! protocol asks, a document that does not parse or validate is reported in a `next` event on an
//! accepted stream, not with a `400`. A bad bearer token is `401` (an `EventSource` must not
//! retry it), with the same events in the body. A token that expires while the stream is open
//! ends it with an `UNAUTHENTICATED` error; shutdown ends it with `complete`. A comment line
//! keeps idle streams alive.

use std::convert::Infallible;

use async_graphql::parser::types::OperationType;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use compute_domain::ErrorCode;
use compute_domain::outbox::Cursor;
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::auth::Viewer;
use crate::graph::admission::{Peer, identity_key};
use crate::graph::events::{ResumeAfter, Streaming};
use crate::limits::StreamGuard;
use crate::state::AppState;
use crate::transport::{BAD_REQUEST, PARSE_FAILED, operation_type, prepare};

/// `POST /graphql/stream`, and `POST /graphql` with `Accept: text/event-stream`.
pub async fn post(State(app): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let peer = crate::transport::peer_of(&parts.extensions);
    match crate::transport::read_body(&app, body).await {
        Ok(body) => respond_to_post(app, peer, &parts.headers, &body).await,
        Err(e) => e.finish(failed(e.status(), e.code(), e.message())),
    }
}

/// A POST whose body has been read: only a JSON body is a GraphQL request.
pub async fn respond_to_post(
    app: AppState,
    peer: Option<Peer>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    if !crate::transport::has_json_body(headers) {
        return failed(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            BAD_REQUEST,
            "a POST takes a JSON body: Content-Type: application/json",
        );
    }
    let request = crate::transport::request_from_body(&app.persisted, body);
    respond(app, peer, headers, request, false).await
}

/// `GET /graphql/stream`, and `GET /graphql` with `Accept: text/event-stream`.
pub async fn get(State(app): State<AppState>, req: Request) -> Response {
    let (parts, _) = req.into_parts();
    let peer = crate::transport::peer_of(&parts.extensions);
    let request = crate::transport::GetParams::from_uri(&parts.uri)
        .map_err(crate::transport::Refused::Malformed)
        .and_then(|p| p.into_request(&app.persisted));
    respond(app, peer, &parts.headers, request, true).await
}

/// An event stream of one `next` with `errors`, then `complete`.
fn failed(status: StatusCode, code: &str, message: &str) -> Response {
    let errors = json!({ "errors": [{ "message": message, "extensions": { "code": code } }] });
    let events = futures_util::stream::iter([
        Ok::<_, Infallible>(SseEvent::default().event("next").data(errors.to_string())),
        Ok(SseEvent::default().event("complete").data("")),
    ]);
    (status, Sse::new(events)).into_response()
}

pub(crate) async fn respond(
    app: AppState,
    peer: Option<Peer>,
    headers: &HeaderMap,
    request: Result<async_graphql::Request, crate::transport::Refused>,
    is_get: bool,
) -> Response {
    let viewer = match crate::transport::authenticate(&app, headers) {
        Ok(v) => v,
        Err(why) => {
            return failed(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthenticated.as_str(),
                &why,
            );
        }
    };
    let mut request = match request {
        Ok(r) => r,
        Err(crate::transport::Refused::Malformed(message)) => {
            return failed(StatusCode::OK, BAD_REQUEST, &message);
        }
        Err(crate::transport::Refused::Persisted(r)) => {
            return failed(StatusCode::OK, r.code, &r.message);
        }
    };
    match operation_type(&app, &mut request) {
        Err(e) => {
            let code = crate::transport::code_of(&e);
            return failed(
                StatusCode::OK,
                code.as_deref().unwrap_or(PARSE_FAILED),
                &e.message,
            );
        }
        Ok(Some(OperationType::Mutation)) if is_get => {
            // As on every GET (the GraphQL-over-HTTP specification): 405 with `Allow: POST`.
            let mut refused = failed(
                StatusCode::METHOD_NOT_ALLOWED,
                BAD_REQUEST,
                "mutations are not allowed over GET; use POST",
            );
            refused.headers_mut().insert(
                axum::http::header::ALLOW,
                axum::http::HeaderValue::from_static("POST"),
            );
            return refused;
        }
        Ok(_) => {}
    }
    if let Some(last) = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.trim().is_empty())
    {
        match Cursor::decode("Last-Event-ID", last.trim()) {
            Ok(c) => request = request.data(ResumeAfter(c)),
            Err(e) => {
                return failed(
                    StatusCode::OK,
                    ErrorCode::BadUserInput.as_str(),
                    &e.to_string(),
                );
            }
        }
    }
    let max = app.limits.max_streams_per_identity;
    let Some(place) = app.streams.open(identity_key(viewer.as_ref(), peer), max) else {
        app.metrics.record_refusal("streams");
        return failed(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::RateLimited.as_str(),
            &format!("too many streams: at most {max} per identity"),
        );
    };
    let keep_alive = app.tailer.config().keep_alive;
    let (tx, mut rx) = mpsc::channel::<SseEvent>(16);
    let trace = crate::trace::current().unwrap_or_else(|| crate::trace::Trace::continuing(None));
    tokio::spawn(run(app, request, viewer, peer, tx, place, trace));
    let events = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok::<_, Infallible>);
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// Runs the operation, turning its results into events, until it ends, the client goes away,
/// the token expires or the server shuts down; in the request's span.
async fn run(
    app: AppState,
    request: async_graphql::Request,
    viewer: Option<Viewer>,
    peer: Option<Peer>,
    tx: mpsc::Sender<SseEvent>,
    place: StreamGuard,
    trace: crate::trace::Trace,
) {
    let (span, trace) = super::request_span("sse", &request, viewer.as_ref(), None, trace);
    crate::trace::scope(trace, stream_events(app, request, viewer, peer, tx))
        .instrument(span)
        .await;
    drop(place);
}

async fn stream_events(
    app: AppState,
    request: async_graphql::Request,
    viewer: Option<Viewer>,
    peer: Option<Peer>,
    tx: mpsc::Sender<SseEvent>,
) {
    // The stream ends when the token expires, by business time.
    let expires = viewer.as_ref().map(|v| app.clock.after(v.valid_for()));
    let revoked = app.authz.shrinks(viewer.as_ref());
    let mut request = crate::graph::with_loaders(request, &app.db);
    let admitted = app.admission.admit(&mut request, viewer.as_ref(), peer);
    let (request, streaming) = Streaming::attach(request, viewer, app.tailer.frames(), false);
    let mut responses = crate::transport::execute_streaming(&app, request, admitted);
    let expiry = {
        let clock = app.clock.clone();
        async move {
            match expires {
                Some(until) => clock.sleep_until(until).await,
                None => std::future::pending().await,
            }
        }
    };
    tokio::pin!(expiry);
    tokio::pin!(revoked);
    let mut shutdown = app.shutdown.clone();
    let stopping = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    tokio::pin!(stopping);
    loop {
        let response = tokio::select! {
            r = responses.next() => r,
            () = tx.closed() => return,
            () = &mut expiry => {
                let errors = json!({ "errors": [{ "message": "the bearer token has expired", "extensions": { "code": ErrorCode::Unauthenticated.as_str() } }] });
                let _ = tx.send(SseEvent::default().event("next").data(errors.to_string())).await;
                break;
            }
            () = &mut revoked => {
                let errors = json!({ "errors": [{ "message": "your access was revoked", "extensions": { "code": ErrorCode::Forbidden.as_str() } }] });
                let _ = tx.send(SseEvent::default().event("next").data(errors.to_string())).await;
                break;
            }
            // Ended without `complete`, which would tell the client the operation is over:
            // an `EventSource` reconnects with `Last-Event-ID`, graphql-sse's client retries.
            () = &mut stopping => return,
        };
        let Some(mut response) = response else {
            // The tailer stops when the server begins to shut down, which ends the stream: that
            // is a shutdown, not the operation's end, so no `complete` (the race with
            // `stopping` above sent one now and then).
            if *app.shutdown.borrow() {
                return;
            }
            break;
        };
        let request_error = prepare(&app, &mut response);
        let mut event = SseEvent::default().event("next");
        if let Some(cursor) = streaming.decorate(&mut response) {
            event = event.id(cursor.encode());
        }
        let data = streaming.payload(&response, || {
            crate::transport::response_json(&response, request_error).text()
        });
        if tx.send(event.data(&*data)).await.is_err() {
            return;
        }
    }
    let _ = tx
        .send(SseEvent::default().event("complete").data(""))
        .await;
}
