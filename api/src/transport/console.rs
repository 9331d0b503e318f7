//! `GET /` (the console), `GET /graphiql`, `GET /console/<file>` and, under `compute-api dev`
//! only, `GET /console/dev-token`: the embedded files of `crate::console`, with their caching
//! validators and a strict Content-Security-Policy.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::console::{self, Asset};
use crate::state::AppState;

/// `GET /`: the console's page.
pub async fn index(headers: HeaderMap) -> Response {
    page("index.html", console::CONSOLE_CSP, &headers)
}

/// `GET /graphiql` (and `GET /graphql` from a browser): GraphiQL, served from the binary.
pub async fn graphiql(headers: HeaderMap) -> Response {
    page("graphiql.html", console::GRAPHIQL_CSP, &headers)
}

/// `GET /console/<file>`: a script, a stylesheet or a vendored file.
pub async fn file(Path(path): Path<String>, headers: HeaderMap) -> Response {
    match console::asset(&path).filter(|a| !a.path.ends_with(".html")) {
        Some(asset) => serve(asset, None, &headers),
        None => (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("no such console file: {path}\n"),
        )
            .into_response(),
    }
}

/// `GET /console/dev-token`: the development token, for the console's one-click sign-in under
/// `compute-api dev` (which prints the same token at start). `204 No Content` from `serve`: there
/// is none, which the page asks about on every sign-in, so it is not an error.
pub async fn dev_token(State(app): State<AppState>, headers: HeaderMap) -> Response {
    match &app.dev_token {
        // Only to a page of this machine's loopback name: a page of any site whose name was
        // made to resolve to 127.0.0.1 (DNS rebinding) is same-origin with this server, and
        // would read the operator's token.
        Some(_) if !loopback_host(&headers) => (
            StatusCode::FORBIDDEN,
            [(header::CACHE_CONTROL, "no-store")],
            "the development token is given only to a loopback Host (localhost, 127.0.0.1, [::1])\n",
        )
            .into_response(),
        Some(token) => (
            [(header::CACHE_CONTROL, "no-store")],
            axum::Json(serde_json::json!({ "token": token.as_ref() })),
        )
            .into_response(),
        None => (
            StatusCode::NO_CONTENT,
            [(header::CACHE_CONTROL, "no-store")],
        )
            .into_response(),
    }
}

/// Whether the request's `Host` names this machine's loopback (any port).
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    matches!(
        name.to_ascii_lowercase().as_str(),
        "localhost" | "127.0.0.1" | "::1"
    )
}

fn page(path: &str, csp: &'static str, headers: &HeaderMap) -> Response {
    match console::asset(path) {
        Some(asset) => serve(asset, Some(csp), headers),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The file, or `304 Not Modified` when the browser's `If-None-Match` names its ETag.
fn serve(asset: &'static Asset, csp: Option<&'static str>, headers: &HeaderMap) -> Response {
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|tag| tag.trim().trim_start_matches("W/") == asset.etag)
        });
    let mut response = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, asset.content_type)], asset.body).into_response()
    };
    let h = response.headers_mut();
    if let Ok(etag) = HeaderValue::from_str(&asset.etag) {
        h.insert(header::ETAG, etag);
    }
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static(asset.cache_control),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if let Some(csp) = csp {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(csp),
        );
        h.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        );
        h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    }
    response
}
