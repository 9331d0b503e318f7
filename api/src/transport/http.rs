//! GraphQL over HTTP, per the GraphQL-over-HTTP specification.
//!
//! * `POST /graphql` takes `application/json` bodies; `GET /graphql` takes the parameters in the
//!   query string and runs queries only (a mutation over GET is `405` with `Allow: POST`).
//! * The response media type follows `Accept`: `application/graphql-response+json` (preferred
//!   on a tie) or `application/json`; no `Accept`, and a wildcard (`*/*`, `application/*`), count
//!   as `application/json`, which the specification asks of a server for legacy clients; neither
//!   acceptable is `406`.
//! * With `application/graphql-response+json`, a request error (the document does not parse or
//!   validate, so there is no `data`) is `400`; with `application/json` it is `200`, as the
//!   specification asks for legacy clients. A malformed HTTP request (not JSON, no `query`) is
//!   `400` with either.
//! * A subscription needs a streaming transport: over plain HTTP it is a request error
//!   (`BAD_REQUEST`) that names the WebSocket and SSE endpoints. With
//!   `Accept: text/event-stream` the request goes to `sse` instead.
//! * A bad bearer token is `401` with `UNAUTHENTICATED`; no token is an anonymous caller, who may
//!   introspect but reads nothing else.
//! * `GET /graphql` from a browser (HTML accepted, no `query`) serves GraphiQL (the vendored page
//!   of `/graphiql`, see `console`), and a WebSocket
//!   upgrade on it serves subscriptions (see `ws`).

use async_graphql::parser::types::OperationType;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use compute_domain::ErrorCode;
use serde_json::json;
use tracing::Instrument;

use crate::auth::Viewer;
use crate::state::AppState;
use crate::transport::{
    BAD_REQUEST, GetParams, PARSE_FAILED, Refused, authenticate, has_json_body, operation_type,
    peer_of, prepare, read_body, request_from_body, response_json, set_code,
};

/// The two response media types of the specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaType {
    GraphqlResponseJson,
    Json,
}

impl MediaType {
    /// The `Content-Type` of a response: a static header value (a `&str` would be checked and
    /// copied into a new value for every response).
    fn content_type(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            MediaType::GraphqlResponseJson => "application/graphql-response+json; charset=utf-8",
            MediaType::Json => "application/json; charset=utf-8",
        })
    }
}

/// The media ranges of an `Accept` header: each essence with its quality (1 when it names
/// none), in the order given.
fn media_ranges(accept: &str) -> impl Iterator<Item = (&str, f32)> {
    accept.split(',').map(|range| {
        let mut parts = range.split(';');
        let essence = parts.next().unwrap_or("").trim();
        // `q` is case-insensitive (RFC 9110, 12.4.2) and a weight is 0 to 1: one out of range
        // or not a number (`q=inf`, `q=NaN`) counts as the default.
        let q = parts
            .filter_map(|p| {
                let (name, value) = p.trim().split_once('=')?;
                name.trim().eq_ignore_ascii_case("q").then_some(value)
            })
            .find_map(|q| q.trim().parse::<f32>().ok())
            .filter(|q| (0.0..=1.0).contains(q))
            .unwrap_or(1.0);
        (essence, q)
    })
}

/// The quality `accept` gives `name` (`type/subtype`), from the most specific range that
/// matches it (RFC 9110, 12.5.1: `application/json;q=0, */*` refuses JSON); with `wildcards`
/// false, only a range naming it counts. `None` when no range matches.
fn quality(accept: &str, name: &str, wildcards: bool) -> Option<f32> {
    let top = name.split('/').next().unwrap_or(name);
    let mut best: Option<(u8, f32)> = None;
    for (essence, q) in media_ranges(accept) {
        // Media types compare without regard to case, here without a lowered copy per range.
        let specificity = if essence.eq_ignore_ascii_case(name) {
            2
        } else if wildcards
            && essence
                .strip_suffix("/*")
                .is_some_and(|t| t.eq_ignore_ascii_case(top))
        {
            1
        } else if wildcards && essence == "*/*" {
            0
        } else {
            continue;
        };
        if best.is_none_or(|(s, _)| specificity > s) {
            best = Some((specificity, q));
        }
    }
    best.map(|(_, q)| q)
}

/// Picks the response media type from `Accept`, by quality, preferring
/// `application/graphql-response+json` on a tie. `None` when neither is acceptable. A client
/// that takes anything (`*/*`, `application/*`) is a legacy client and gets `application/json`
/// (the specification's SHOULD), unless it refused `application/json` by name.
pub fn negotiate(accept: Option<&HeaderValue>) -> Option<MediaType> {
    let Some(accept) = accept.and_then(|v| v.to_str().ok()) else {
        return Some(MediaType::Json);
    };
    if accept.trim().is_empty() {
        return Some(MediaType::Json);
    }
    let json = quality(accept, "application/json", true).filter(|q| *q > 0.0);
    let named = quality(accept, "application/graphql-response+json", false);
    let graphql = match named {
        Some(q) => Some(q),
        // JSON refused by name; what takes anything takes the specification's own type.
        None if json.is_none() => quality(accept, "application/graphql-response+json", true),
        None => None,
    }
    .filter(|q| *q > 0.0);
    match (graphql, json) {
        (Some(g), Some(j)) if j > g => Some(MediaType::Json),
        (Some(_), _) => Some(MediaType::GraphqlResponseJson),
        (None, Some(_)) => Some(MediaType::Json),
        (None, None) => None,
    }
}

/// What `Accept` asks of a request that could be answered by an event stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// `text/event-stream` is not acceptable, or a JSON type is preferred to it.
    No,
    /// `text/event-stream` is preferred (by quality), or the only acceptable type.
    Yes,
    /// `text/event-stream` and a JSON type at the same quality (urql's default `Accept` lists
    /// both): a subscription streams, a query or mutation is answered in JSON.
    Either,
}

/// Whether `Accept` asks for an event stream: only a range naming `text/event-stream` counts
/// (a client that takes anything is a JSON client), weighed against the JSON types by quality.
pub fn wants_event_stream(headers: &HeaderMap) -> Stream {
    let Some(accept) = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()) else {
        return Stream::No;
    };
    let Some(sse) = quality(accept, "text/event-stream", false).filter(|q| *q > 0.0) else {
        return Stream::No;
    };
    let json = [
        quality(accept, "application/json", true),
        quality(accept, "application/graphql-response+json", true),
    ]
    .into_iter()
    .flatten()
    .fold(0.0f32, f32::max);
    if sse > json {
        Stream::Yes
    } else if sse == json {
        Stream::Either
    } else {
        Stream::No
    }
}

fn accepts_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

/// A response carrying only errors, with one `extensions.code` (and the request's
/// `extensions.traceId`).
fn error_response(status: StatusCode, media: MediaType, code: &str, message: &str) -> Response {
    let mut extensions = json!({ "code": code });
    if let Some(trace) = crate::trace::current() {
        extensions["traceId"] = trace.hex().into();
    }
    let body = json!({ "errors": [{ "message": message, "extensions": extensions }] });
    (
        status,
        [(header::CONTENT_TYPE, media.content_type())],
        body.to_string(),
    )
        .into_response()
}

/// A request refused before it parsed: a malformed one is `400` with `BAD_REQUEST`; a persisted
/// query that cannot run is a GraphQL request error with its code (`400` with
/// `application/graphql-response+json`, `200` with `application/json`, as for any request error).
fn refusal(media: MediaType, refused: Refused) -> Response {
    match refused {
        Refused::Malformed(message) => {
            error_response(StatusCode::BAD_REQUEST, media, BAD_REQUEST, &message)
        }
        Refused::Persisted(r) => {
            let status = match media {
                MediaType::GraphqlResponseJson => StatusCode::BAD_REQUEST,
                MediaType::Json => StatusCode::OK,
            };
            error_response(status, media, r.code, &r.message)
        }
    }
}

fn unauthorized(media: MediaType, message: &str) -> Response {
    let mut response = error_response(
        StatusCode::UNAUTHORIZED,
        media,
        ErrorCode::Unauthenticated.as_str(),
        message,
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer error=\"invalid_token\""),
    );
    response
}

/// `POST /graphql`.
pub async fn post(State(app): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let peer = peer_of(&parts.extensions);
    let headers = parts.headers;
    let body = match read_body(&app, body).await {
        Ok(b) => b,
        Err(e) => {
            return e.finish(error_response(
                e.status(),
                MediaType::Json,
                e.code(),
                e.message(),
            ));
        }
    };
    let stream = wants_event_stream(&headers);
    if stream == Stream::Yes {
        return crate::transport::sse::respond_to_post(app, peer, &headers, &body).await;
    }
    let Some(media) = negotiate(headers.get(header::ACCEPT)) else {
        return not_acceptable();
    };
    if !has_json_body(&headers) {
        return error_response(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            media,
            BAD_REQUEST,
            "POST /graphql takes a JSON body: Content-Type: application/json",
        );
    }
    let mut request = match request_from_body(&app.persisted, &body) {
        Ok(r) => r,
        Err(refused) => return refusal(media, refused),
    };
    if streams_as_subscription(&app, stream, &mut request) {
        return crate::transport::sse::respond(app, peer, &headers, Ok(request), false).await;
    }
    let viewer = match authenticate(&app, &headers) {
        Ok(v) => v,
        Err(why) => return unauthorized(media, &why),
    };
    execute(&app, media, viewer, peer, request, false).await
}

/// Whether a request whose `Accept` takes an event stream and JSON alike is a subscription,
/// which only the stream can answer.
fn streams_as_subscription(
    app: &AppState,
    stream: Stream,
    request: &mut async_graphql::Request,
) -> bool {
    stream == Stream::Either
        && matches!(
            operation_type(app, request),
            Ok(Some(OperationType::Subscription))
        )
}

/// `GET /graphql`: GraphiQL for browsers, the WebSocket upgrade, or a query in the query string.
pub async fn get(State(app): State<AppState>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    if crate::transport::ws::is_upgrade(&parts.headers) {
        return crate::transport::ws::upgrade(app, &mut parts).await;
    }
    let stream = wants_event_stream(&parts.headers);
    if stream == Stream::Yes {
        return crate::transport::sse::get(State(app), Request::from_parts(parts, body)).await;
    }
    let params = match GetParams::from_uri(&parts.uri) {
        Ok(p) => p,
        Err(message) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                MediaType::Json,
                BAD_REQUEST,
                &message,
            );
        }
    };
    if params.query.is_none() && accepts_html(&parts.headers) {
        return crate::transport::console::graphiql(parts.headers).await;
    }
    let Some(media) = negotiate(parts.headers.get(header::ACCEPT)) else {
        return not_acceptable();
    };
    let mut request = match params.into_request(&app.persisted) {
        Ok(r) => r,
        Err(refused) => return refusal(media, refused),
    };
    let peer = peer_of(&parts.extensions);
    if streams_as_subscription(&app, stream, &mut request) {
        return crate::transport::sse::respond(app, peer, &parts.headers, Ok(request), true).await;
    }
    let viewer = match authenticate(&app, &parts.headers) {
        Ok(v) => v,
        Err(why) => return unauthorized(media, &why),
    };
    execute(&app, media, viewer, peer, request, true).await
}

fn not_acceptable() -> Response {
    error_response(
        StatusCode::NOT_ACCEPTABLE,
        MediaType::Json,
        BAD_REQUEST,
        "Accept must allow application/graphql-response+json or application/json",
    )
}

async fn execute(
    app: &AppState,
    media: MediaType,
    viewer: Option<Viewer>,
    peer: Option<crate::graph::admission::Peer>,
    mut request: async_graphql::Request,
    is_get: bool,
) -> Response {
    let kind = match operation_type(app, &mut request) {
        Err(mut e) => {
            // A document over the size limit comes coded; anything else did not parse.
            if crate::transport::code_of(&e).is_none() {
                set_code(&mut e, PARSE_FAILED);
            }
            crate::trace::stamp(
                std::slice::from_mut(&mut e),
                crate::trace::current().as_ref(),
            );
            let code = crate::transport::code_of(&e).unwrap_or_default();
            app.metrics
                .record_graphql_error(crate::transport::static_code(Some(&code)));
            let status = match media {
                MediaType::GraphqlResponseJson => StatusCode::BAD_REQUEST,
                MediaType::Json => StatusCode::OK,
            };
            let body = json!({ "errors": [e] });
            return (
                status,
                [(header::CONTENT_TYPE, media.content_type())],
                body.to_string(),
            )
                .into_response();
        }
        Ok(Some(OperationType::Mutation)) if is_get => {
            let mut r = error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                media,
                BAD_REQUEST,
                "mutations are not allowed over GET; use POST",
            );
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
            return r;
        }
        Ok(Some(OperationType::Subscription)) => {
            let status = match media {
                MediaType::GraphqlResponseJson => StatusCode::BAD_REQUEST,
                MediaType::Json => StatusCode::OK,
            };
            return error_response(
                status,
                media,
                BAD_REQUEST,
                "a subscription needs a streaming transport: a WebSocket on /graphql \
                 (graphql-transport-ws or graphql-ws), or Server-Sent Events \
                 (Accept: text/event-stream, or /graphql/stream)",
            );
        }
        Ok(Some(OperationType::Query)) => Some("query"),
        Ok(Some(OperationType::Mutation)) => Some("mutation"),
        Ok(None) => None,
    };
    let admission = match app.admission.admit(&mut request, viewer.as_ref(), peer) {
        Ok(a) => a,
        Err(e) => return render(app, media, async_graphql::Response::from_errors(vec![e])),
    };
    let trace = crate::trace::current().unwrap_or_else(|| crate::trace::Trace::continuing(None));
    let (span, _) = super::request_span("http", &request, viewer.as_ref(), kind, trace);
    if let Some(viewer) = viewer {
        request = request.data(viewer);
    }
    let replay = crate::graph::ReplayFlag::default();
    request = crate::graph::with_loaders(request.data(replay.clone()), &app.db);
    let mut response = app
        .admission
        .within_deadline(app.schema.execute(request))
        .instrument(span)
        .await;
    app.admission.finish(&admission, &mut response);
    if replay.is_set() {
        response.extensions.insert(
            "idempotentReplay".into(),
            async_graphql::Value::Boolean(true),
        );
    }
    render(app, media, response)
}

/// The status of a request error: `429` when the caller's budget is spent, `504` when the
/// request ran past its deadline, `400` otherwise (the document or the request was wrong).
fn request_error_status(response: &async_graphql::Response) -> StatusCode {
    let code = |e: &async_graphql::ServerError| {
        e.extensions
            .as_ref()
            .and_then(|x| x.get("code"))
            .and_then(|v| match v {
                async_graphql::Value::String(s) => Some(s.clone()),
                _ => None,
            })
    };
    response
        .errors
        .first()
        .and_then(code)
        .and_then(|c| crate::codes::Code::parse(&c))
        .map_or(StatusCode::BAD_REQUEST, crate::codes::Code::request_status)
}

/// Serializes a response per the specification, giving every error a code.
fn render(app: &AppState, media: MediaType, mut response: async_graphql::Response) -> Response {
    let request_error = prepare(app, &mut response);
    let body = response_json(&response, request_error).text();
    let status = if request_error && media == MediaType::GraphqlResponseJson {
        request_error_status(&response)
    } else {
        StatusCode::OK
    };
    (status, [(header::CONTENT_TYPE, media.content_type())], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).expect("header")
    }

    #[test]
    fn negotiation_follows_the_specification() {
        use MediaType::{GraphqlResponseJson as Gql, Json};
        let table: [(Option<&str>, Option<MediaType>); 16] = [
            (None, Some(Json)),
            (Some("Application/GraphQL-Response+JSON"), Some(Gql)),
            (Some(""), Some(Json)),
            (Some("application/json"), Some(Json)),
            (Some("application/graphql-response+json"), Some(Gql)),
            (
                Some("application/graphql-response+json, application/json;q=0.9"),
                Some(Gql),
            ),
            (
                Some("application/graphql-response+json;q=0.5, application/json"),
                Some(Json),
            ),
            (
                Some("application/json, application/graphql-response+json"),
                Some(Gql),
            ),
            (Some("*/*"), Some(Json)),
            (Some("application/*"), Some(Json)),
            (Some("*/*, application/graphql-response+json"), Some(Gql)),
            (Some("text/html"), None),
            (Some("application/json;q=0"), None),
            (Some("application/json;q=0, */*"), Some(Gql)),
            (Some("application/json;q=0.5, application/*"), Some(Json)),
            (Some("application/json, text/event-stream"), Some(Json)),
        ];
        for (accept, expected) in table {
            let header = accept.map(hv);
            assert_eq!(negotiate(header.as_ref()), expected, "Accept: {accept:?}");
        }
    }

    #[test]
    fn an_event_stream_is_chosen_by_quality_never_by_a_mention() {
        let urql = "application/graphql-response+json, application/graphql+json, application/json, text/event-stream, multipart/mixed";
        let table = [
            ("text/event-stream", Stream::Yes),
            ("Text/Event-Stream;q=0.5", Stream::Yes),
            ("text/event-stream, application/json;q=0.9", Stream::Yes),
            (urql, Stream::Either),
            ("application/json, text/event-stream;q=0", Stream::No),
            ("application/json, text/event-stream;Q=0", Stream::No),
            (
                "application/json;q=0.5, text/event-stream;q=inf",
                Stream::Yes,
            ),
            ("application/json, text/event-stream;q=inf", Stream::Either),
            ("application/json, text/event-stream;q=0.5", Stream::No),
            ("*/*", Stream::No),
            ("text/*", Stream::No),
            ("application/json", Stream::No),
        ];
        for (accept, expected) in table {
            let mut headers = HeaderMap::new();
            headers.insert(header::ACCEPT, hv(accept));
            assert_eq!(wants_event_stream(&headers), expected, "Accept: {accept}");
        }
        assert_eq!(wants_event_stream(&HeaderMap::new()), Stream::No);
    }
}
