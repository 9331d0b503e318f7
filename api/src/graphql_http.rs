//! GraphQL over HTTP, per the GraphQL-over-HTTP specification.
//!
//! * `POST /graphql` takes `application/json` bodies; `GET /graphql` takes the parameters in the
//!   query string and runs queries only (a mutation over GET is `405` with `Allow: POST`).
//! * The response media type follows `Accept`: `application/graphql-response+json` (preferred
//!   on a tie) or `application/json`; no `Accept` counts as `application/json`; neither
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
//! * `GET /graphql` from a browser (HTML accepted, no `query`) serves GraphiQL, and a WebSocket
//!   upgrade on it serves subscriptions (see `ws`).

use async_graphql::http::GraphiQLSource;
use async_graphql::parser::types::{DocumentOperations, OperationType};
use async_graphql::{ServerError, Variables};
use axum::body::Bytes;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use compute_domain::ErrorCode;
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::error;

use crate::auth::{Viewer, bearer};
use crate::server::AppState;

/// `extensions.code` of a document that does not parse.
pub const PARSE_FAILED: &str = "GRAPHQL_PARSE_FAILED";
/// `extensions.code` of a document that does not validate against the schema.
pub const VALIDATION_FAILED: &str = "GRAPHQL_VALIDATION_FAILED";
/// `extensions.code` of an HTTP request that is not a GraphQL-over-HTTP request.
pub const BAD_REQUEST: &str = "BAD_REQUEST";

/// The two response media types of the specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaType {
    GraphqlResponseJson,
    Json,
}

impl MediaType {
    fn content_type(self) -> &'static str {
        match self {
            MediaType::GraphqlResponseJson => "application/graphql-response+json; charset=utf-8",
            MediaType::Json => "application/json; charset=utf-8",
        }
    }
}

/// Picks the response media type from `Accept`, by quality, preferring
/// `application/graphql-response+json` on a tie. `None` when neither is acceptable.
pub fn negotiate(accept: Option<&HeaderValue>) -> Option<MediaType> {
    let Some(accept) = accept.and_then(|v| v.to_str().ok()) else {
        return Some(MediaType::Json);
    };
    if accept.trim().is_empty() {
        return Some(MediaType::Json);
    }
    let mut best: Option<(f32, MediaType)> = None;
    for range in accept.split(',') {
        let mut parts = range.split(';');
        let essence = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.trim().strip_prefix("q="))
            .find_map(|q| q.trim().parse::<f32>().ok())
            .unwrap_or(1.0);
        if q <= 0.0 {
            continue;
        }
        let candidates: &[MediaType] = match essence.as_str() {
            "application/graphql-response+json" => &[MediaType::GraphqlResponseJson],
            "application/json" => &[MediaType::Json],
            "*/*" | "application/*" => &[MediaType::GraphqlResponseJson],
            _ => &[],
        };
        for &m in candidates {
            let better = match best {
                None => true,
                Some((bq, bm)) => {
                    q > bq || (q == bq && m == MediaType::GraphqlResponseJson && bm != m)
                }
            };
            if better {
                best = Some((q, m));
            }
        }
    }
    best.map(|(_, m)| m)
}

fn accepts_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

/// A response carrying only errors, with one `extensions.code`.
fn error_response(status: StatusCode, media: MediaType, code: &str, message: &str) -> Response {
    let body = json!({ "errors": [{ "message": message, "extensions": { "code": code } }] });
    (
        status,
        [(header::CONTENT_TYPE, media.content_type())],
        body.to_string(),
    )
        .into_response()
}

/// Verifies the `Authorization` header: `Ok(None)` without one, `Err` with the reason for the
/// `401` otherwise.
fn authenticate(app: &AppState, headers: &HeaderMap) -> Result<Option<Viewer>, String> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let token = value
        .to_str()
        .ok()
        .and_then(bearer)
        .ok_or("the Authorization header must be `Bearer <jwt>`")?;
    app.verifier
        .verify(token)
        .map(Some)
        .map_err(|e| e.to_string())
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

/// The JSON body of a POST request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PostBody {
    query: Option<Value>,
    operation_name: Option<Value>,
    variables: Option<Value>,
    extensions: Option<Value>,
}

/// The query-string parameters of a GET request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GetParams {
    query: Option<String>,
    operation_name: Option<String>,
    variables: Option<String>,
    extensions: Option<String>,
}

/// `POST /graphql`.
pub async fn post(State(app): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if crate::sse::wants_event_stream(&headers) {
        return crate::sse::post(State(app), headers, body).await;
    }
    let Some(media) = negotiate(headers.get(header::ACCEPT)) else {
        return not_acceptable();
    };
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| {
            ct.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .eq_ignore_ascii_case("application/json")
        })
        .unwrap_or(false);
    if !json_body {
        return error_response(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            media,
            BAD_REQUEST,
            "POST /graphql takes a JSON body: Content-Type: application/json",
        );
    }
    let body: PostBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                media,
                BAD_REQUEST,
                &format!("the body is not a GraphQL request object: {e}"),
            );
        }
    };
    let request = match build_request(
        body.query,
        body.operation_name,
        body.variables,
        body.extensions,
    ) {
        Ok(r) => r,
        Err(message) => {
            return error_response(StatusCode::BAD_REQUEST, media, BAD_REQUEST, &message);
        }
    };
    let viewer = match authenticate(&app, &headers) {
        Ok(v) => v,
        Err(why) => return unauthorized(media, &why),
    };
    execute(&app, media, viewer, request, false).await
}

/// `GET /graphql`: GraphiQL for browsers, the WebSocket upgrade, or a query in the query string.
pub async fn get(State(app): State<AppState>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    if crate::ws::is_upgrade(&parts.headers) {
        return crate::ws::upgrade(app, &mut parts).await;
    }
    if crate::sse::wants_event_stream(&parts.headers) {
        return crate::sse::get(State(app), Request::from_parts(parts, body)).await;
    }
    let params = match Query::<GetParams>::try_from_uri(&parts.uri) {
        Ok(Query(p)) => p,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                MediaType::Json,
                BAD_REQUEST,
                &e.body_text(),
            );
        }
    };
    if params.query.is_none() && accepts_html(&parts.headers) {
        return Html(
            GraphiQLSource::build()
                .endpoint("/graphql")
                .subscription_endpoint("/graphql")
                .title("Better Compute")
                .finish(),
        )
        .into_response();
    }
    let Some(media) = negotiate(parts.headers.get(header::ACCEPT)) else {
        return not_acceptable();
    };
    let parse_json = |name: &str, raw: Option<String>| -> Result<Option<Value>, String> {
        raw.map(|s| {
            serde_json::from_str::<Value>(&s).map_err(|e| format!("`{name}` is not JSON: {e}"))
        })
        .transpose()
    };
    let request = parse_json("variables", params.variables).and_then(|variables| {
        let extensions = parse_json("extensions", params.extensions)?;
        build_request(
            params.query.map(Value::String),
            params.operation_name.map(Value::String),
            variables,
            extensions,
        )
    });
    let request = match request {
        Ok(r) => r,
        Err(message) => {
            return error_response(StatusCode::BAD_REQUEST, media, BAD_REQUEST, &message);
        }
    };
    let viewer = match authenticate(&app, &parts.headers) {
        Ok(v) => v,
        Err(why) => return unauthorized(media, &why),
    };
    execute(&app, media, viewer, request, true).await
}

fn not_acceptable() -> Response {
    error_response(
        StatusCode::NOT_ACCEPTABLE,
        MediaType::Json,
        BAD_REQUEST,
        "Accept must allow application/graphql-response+json or application/json",
    )
}

pub(crate) fn build_request(
    query: Option<Value>,
    operation_name: Option<Value>,
    variables: Option<Value>,
    extensions: Option<Value>,
) -> Result<async_graphql::Request, String> {
    let query = match query {
        Some(Value::String(q)) => q,
        Some(_) => return Err("`query` must be a string".into()),
        None => return Err("the request has no `query`".into()),
    };
    let mut request = async_graphql::Request::new(query);
    match operation_name {
        Some(Value::String(name)) => request = request.operation_name(name),
        Some(Value::Null) | None => {}
        Some(_) => return Err("`operationName` must be a string".into()),
    }
    match variables {
        Some(v @ Value::Object(_)) => request = request.variables(Variables::from_json(v)),
        Some(Value::Null) | None => {}
        Some(_) => return Err("`variables` must be an object".into()),
    }
    match extensions {
        Some(Value::Object(_)) | Some(Value::Null) | None => {}
        Some(_) => return Err("`extensions` must be an object".into()),
    }
    Ok(request)
}

/// The type of the operation the request selects, when the document parses and names one.
pub(crate) fn operation_type(
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

async fn execute(
    app: &AppState,
    media: MediaType,
    viewer: Option<Viewer>,
    mut request: async_graphql::Request,
    is_get: bool,
) -> Response {
    match operation_type(&mut request) {
        Err(e) => {
            app.metrics.record_graphql_error(PARSE_FAILED);
            let status = match media {
                MediaType::GraphqlResponseJson => StatusCode::BAD_REQUEST,
                MediaType::Json => StatusCode::OK,
            };
            let mut e = e;
            set_code(&mut e, PARSE_FAILED);
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
        Ok(_) => {}
    }
    if let Some(viewer) = viewer {
        request = request.data(viewer);
    }
    let replay = crate::schema::ReplayFlag::default();
    request = request.data(replay.clone());
    let mut response = app.schema.execute(request).await;
    if replay.is_set() {
        response.extensions.insert(
            "idempotentReplay".into(),
            async_graphql::Value::Boolean(true),
        );
    }
    render(app, media, response)
}

pub(crate) fn set_code(e: &mut ServerError, code: &str) {
    let ext = e.extensions.get_or_insert_with(Default::default);
    ext.set("code", code);
}

fn has_code(e: &ServerError) -> bool {
    e.extensions
        .as_ref()
        .is_some_and(|x| x.get("code").is_some())
}

/// Gives every error of `response` a code (and hides the text of uncoded resolver errors),
/// counts them, and says whether it is a request error: no `data`, because the document did not
/// parse or validate or the operation could not start.
pub fn prepare(app: &AppState, response: &mut async_graphql::Response) -> bool {
    let request_error = response.data == async_graphql::Value::Null
        && !response.errors.is_empty()
        && response.errors.iter().all(|e| e.path.is_empty());
    for e in &mut response.errors {
        if !has_code(e) {
            if request_error {
                set_code(e, VALIDATION_FAILED);
            } else if is_input_error(&e.message) {
                // async-graphql could not coerce an argument or variable: the caller's input.
                set_code(e, ErrorCode::BadUserInput.as_str());
            } else {
                // A resolver error that did not go through `gql_error`: never show its text.
                let error_id = compute_domain::ids::new_id("err");
                error!(error.id = %error_id, error = %e.message, "uncoded resolver error");
                e.message = format!("internal error (id {error_id})");
                set_code(e, ErrorCode::Internal.as_str());
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

/// Whether an uncoded error is async-graphql's report of an argument or variable it could not
/// coerce to its input type.
fn is_input_error(message: &str) -> bool {
    message.starts_with("Failed to parse ")
        || message.starts_with("Expected input type ")
        || message.starts_with("Invalid value for argument ")
}

/// The JSON of a prepared response: `data` unless it is a request error, `errors` and
/// `extensions` when there are any.
pub fn response_json(response: &async_graphql::Response, request_error: bool) -> Value {
    let mut body = serde_json::Map::new();
    if !request_error {
        body.insert("data".into(), json!(response.data));
    }
    if !response.errors.is_empty() {
        body.insert("errors".into(), json!(response.errors));
    }
    if !response.extensions.is_empty() {
        body.insert("extensions".into(), json!(response.extensions));
    }
    Value::Object(body)
}

/// Serializes a response per the specification, giving every error a code.
fn render(app: &AppState, media: MediaType, mut response: async_graphql::Response) -> Response {
    let request_error = prepare(app, &mut response);
    let body = response_json(&response, request_error);
    let status = if request_error && media == MediaType::GraphqlResponseJson {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::OK
    };
    (
        status,
        [(header::CONTENT_TYPE, media.content_type())],
        body.to_string(),
    )
        .into_response()
}

/// Maps a code seen in a response back to its static name, for the metrics label.
fn static_code(code: Option<&str>) -> &'static str {
    let code = code.map(|c| c.trim_matches('"'));
    ErrorCode::ALL
        .iter()
        .map(|c| c.as_str())
        .chain([PARSE_FAILED, VALIDATION_FAILED, BAD_REQUEST])
        .find(|c| Some(*c) == code)
        .unwrap_or("OTHER")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).expect("header")
    }

    #[test]
    fn negotiation_follows_the_specification() {
        assert_eq!(negotiate(None), Some(MediaType::Json));
        assert_eq!(
            negotiate(Some(&hv("application/json"))),
            Some(MediaType::Json)
        );
        assert_eq!(
            negotiate(Some(&hv(
                "application/graphql-response+json, application/json;q=0.9"
            ))),
            Some(MediaType::GraphqlResponseJson)
        );
        assert_eq!(
            negotiate(Some(&hv(
                "application/graphql-response+json;q=0.5, application/json"
            ))),
            Some(MediaType::Json)
        );
        assert_eq!(
            negotiate(Some(&hv("*/*"))),
            Some(MediaType::GraphqlResponseJson)
        );
        assert_eq!(negotiate(Some(&hv("text/html"))), None);
        assert_eq!(negotiate(Some(&hv("application/json;q=0"))), None);
    }
}
