//! `GET /usage.csv`: the usage records of the windows that start in `[from, to)`, as CSV for
//! finance tools (`docs/usage.md`). The same bearer token and tenant rule as the `usage` query:
//! a member gets its tenant's records, an operator `tenantId`'s or every tenant's. The body is
//! streamed page by page in `(windowStart, key)` order, so an export of millions of records never
//! sits in memory.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use compute_domain::events::UsageView;
use compute_domain::usage::{self, ReportQuery};
use compute_domain::{Error, ErrorCode};
use serde::Deserialize;

use crate::state::AppState;
use crate::transport::authenticate;

/// Records read from the database per page of the body.
const PAGE: i64 = 2000;

/// The columns, in order.
pub const HEADER: &str = "key,kind,tenant_id,pool_id,reservation_id,allocation_id,window_start,window_end,model,gpu_kind,profile,atoms,booked_seconds,gpu_seconds,vcpu_seconds,memory_mib_seconds,disk_gib_seconds,created_at\n";

/// The query string.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Params {
    from: Option<String>,
    to: Option<String>,
    tenant_id: Option<String>,
}

/// `GET /usage.csv?from=…&to=…[&tenantId=…]`.
pub async fn get(
    State(app): State<AppState>,
    headers: HeaderMap,
    params: Result<Query<Params>, axum::extract::rejection::QueryRejection>,
) -> Response {
    match export(&app, &headers, params).await {
        Ok(body) => (
            StatusCode::OK,
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/csv; charset=utf-8"),
                ),
                (
                    header::CONTENT_DISPOSITION,
                    HeaderValue::from_static("attachment; filename=\"usage.csv\""),
                ),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            ],
            body,
        )
            .into_response(),
        Err(e) => error(e),
    }
}

async fn export(
    app: &AppState,
    headers: &HeaderMap,
    params: Result<Query<Params>, axum::extract::rejection::QueryRejection>,
) -> Result<Body, Error> {
    let viewer = authenticate(app, headers)
        .map_err(Error::Unauthenticated)?
        .ok_or_else(|| {
            Error::Unauthenticated(
                "the usage export needs a bearer token (Authorization: Bearer <jwt>)".into(),
            )
        })?;
    let actor = viewer
        .actor()
        .ok_or_else(|| Error::Forbidden("this needs the member or operator role".into()))?;
    // An export is a stream: it takes one of the identity's stream places, as an SSE or
    // WebSocket subscription does, for as long as its body is read (any number of 90-day
    // exports at once, each paging through the records, was the one unbounded read).
    let max = app.limits.max_streams_per_identity;
    let place = app
        .streams
        .open(
            crate::graph::admission::identity_key(Some(&viewer), None),
            max,
        )
        .ok_or_else(|| {
            app.metrics.record_refusal("streams");
            Error::RateLimited(format!("too many streams: at most {max} per identity"))
        })?;
    let Query(params) =
        params.map_err(|e| Error::bad_input("query", format!("a bad query string: {e}")))?;
    let time = |field: &str, v: Option<String>| -> Result<DateTime<Utc>, Error> {
        let v = v.ok_or_else(|| Error::bad_input(field, format!("`{field}` is required")))?;
        DateTime::parse_from_rfc3339(&v)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|_| {
                Error::bad_input(
                    field,
                    format!("`{field}` must be an RFC 3339 time, such as 2026-12-01T00:00:00Z"),
                )
            })
    };
    let (from, to) = (time("from", params.from)?, time("to", params.to)?);
    let tenant = match actor.visible_tenant() {
        Ok(Some(own)) => Some(own.clone()),
        Ok(None) => params
            .tenant_id
            .map(|t| compute_domain::ids::TenantId::parse("tenantId", &t))
            .transpose()?,
        Err(_) => return Err(Error::Forbidden("your token names no tenant".into())),
    };
    let q = ReportQuery::new(tenant, from, to, vec![])?;
    // The first page is read before the answer starts, so an error is still a status code.
    let first = usage::records(&app.db, &q, None, PAGE).await?;
    let db = app.db.clone();
    // As an SSE or WebSocket stream, an export stops when its caller's access shrinks (a
    // revocation) or its token expires, by business time: checked before each page, so no page
    // is read for a caller who may no longer read it.
    let expires = app.clock.after(viewer.valid_for());
    let clock = app.clock.clone();
    let revoked = app.authz.shrinks(Some(&viewer));
    let stop: std::pin::Pin<Box<dyn std::future::Future<Output = &'static str> + Send>> =
        Box::pin(async move {
            tokio::select! {
                () = clock.sleep_until(expires) => "the bearer token expired",
                () = revoked => "your access was revoked",
            }
        });
    let pages = futures_util::stream::unfold(
        (Some(first), false, q, None::<(DateTime<Utc>, String)>, stop),
        move |(page, done, q, after, mut stop)| {
            let db = db.clone();
            async move {
                if done {
                    return None;
                }
                let stopped = std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(match stop.as_mut().poll(cx) {
                        std::task::Poll::Ready(why) => Some(why),
                        std::task::Poll::Pending => None,
                    })
                })
                .await;
                if let Some(why) = stopped {
                    // Cut short, as on a database error below: the client sees a transfer
                    // that did not finish, never a file that looks whole.
                    tracing::info!(reason = why, "the usage export stopped part-way");
                    return Some((Err(std::io::Error::other(why)), (None, true, q, None, stop)));
                }
                let rows = match page {
                    Some(rows) => rows,
                    None => match usage::records(&db, &q, after, PAGE).await {
                        Ok(rows) => rows,
                        Err(e) => {
                            // The status is sent; cutting the body short is all that is left,
                            // and a CSV that ends without its last line is visibly cut.
                            tracing::warn!(error = %e, "the usage export stopped part-way");
                            return Some((
                                Err(std::io::Error::other(e.to_string())),
                                (None, true, q, None, stop),
                            ));
                        }
                    },
                };
                let last = rows.len() < PAGE as usize;
                let next = rows.last().map(|r| (r.window_start, r.key.clone()));

                let mut text = String::with_capacity(rows.len() * 200);
                for r in &rows {
                    line(&mut text, r);
                }
                Some((Ok::<_, std::io::Error>(text), (None, last, q, next, stop)))
            }
        },
    );
    let header = futures_util::stream::once(async { Ok::<_, std::io::Error>(HEADER.to_owned()) });
    // The place is held until the last page is out, or the client went away (the body dropped).
    let release = futures_util::stream::once(async move {
        drop(place);
        Ok::<_, std::io::Error>(String::new())
    });
    Ok(Body::from_stream(futures_util::StreamExt::chain(
        futures_util::StreamExt::chain(header, pages),
        release,
    )))
}

/// A free-text cell as a spreadsheet cannot take it for a formula: one that starts with `=`,
/// `+`, `-`, `@`, a tab or a carriage return gets a leading `'` (OWASP's CSV injection advice).
/// The GPU model and profile are the only free text here (an operator's, or a joining
/// machine's inventory); numbers keep their sign.
fn inert(text: &str) -> std::borrow::Cow<'_, str> {
    if text.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        std::borrow::Cow::Owned(format!("'{text}"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// One record as a CSV line (RFC 4180: a field with a comma, quote or line break is quoted).
fn line(out: &mut String, r: &UsageView) {
    let time = |t: &DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
    let (model, profile) = (inert(&r.model), inert(r.profile.as_deref().unwrap_or("")));
    let fields: [&str; 18] = [
        &r.key,
        &r.kind,
        r.tenant_id.as_str(),
        r.pool_id.as_str(),
        r.reservation_id.as_str(),
        r.allocation_id.as_str(),
        &time(&r.window_start),
        &time(&r.window_end),
        &model,
        r.gpu_kind.as_str(),
        &profile,
        &r.atoms.to_string(),
        &r.booked_seconds,
        &r.gpu_seconds,
        &r.vcpu_seconds,
        &r.memory_mib_seconds,
        &r.disk_gib_seconds,
        &time(&r.created_at),
    ];
    for (i, f) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        if f.contains([',', '"', '\n', '\r']) {
            out.push('"');
            out.push_str(&f.replace('"', "\"\""));
            out.push('"');
        } else {
            out.push_str(f);
        }
    }
    out.push('\n');
}

/// An error as the GraphQL transports write one: `{"errors": [{message, extensions: {code}}]}`,
/// with the status its code calls for.
fn error(e: Error) -> Response {
    let status = match e.code() {
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::Forbidden => StatusCode::FORBIDDEN,
        ErrorCode::BadUserInput => StatusCode::BAD_REQUEST,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        // Retryable: a concurrent change held the rows, or the database went away.
        ErrorCode::LockTimeout | ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let server_error = async_graphql::Error::from(crate::graph::gql_error(e))
        .into_server_error(async_graphql::Pos::default());
    let body = serde_json::json!({ "errors": [{
        "message": server_error.message,
        "extensions": server_error.extensions,
    }] });
    (
        status,
        [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::inert;

    #[test]
    fn a_cell_a_spreadsheet_would_run_is_made_text() {
        for (cell, shown) in [
            (
                "=HYPERLINK(\"http://x\",\"H100\")",
                "'=HYPERLINK(\"http://x\",\"H100\")",
            ),
            ("+1", "'+1"),
            ("-cmd", "'-cmd"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\t=1", "'\t=1"),
            ("H100", "H100"),
            ("", ""),
            ("1g.10gb", "1g.10gb"),
        ] {
            assert_eq!(inert(cell), shown, "{cell:?}");
        }
    }
}
