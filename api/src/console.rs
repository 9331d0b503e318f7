//! The web console and GraphiQL, embedded in the binary (`docs/console.md`).
//!
//! Every file under `api/console/` that a page loads is compiled in with `include_bytes!`, so
//! `compute-api` serves the console at `/` and GraphiQL at `/graphiql` with no internet and no
//! build step: the console is plain ES modules, GraphiQL and React are their vendored release
//! files (`api/console/vendor/README.md`). This room only knows the files, their headers and the
//! console's GraphQL operations; `transport::console` answers the requests.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use crate::persisted::sha256_hex;

/// One file the console or GraphiQL loads.
#[derive(Debug)]
pub struct Asset {
    /// Its path under `/console/` (or the page's own path for the two pages).
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
    /// The strong validator of `body`: `"<first 32 hex digits of its SHA-256>"`.
    pub etag: String,
    /// The value of `Cache-Control`. A versioned vendor file never changes under its path and
    /// is cached for a year; the pages and the console's own modules keep their paths across
    /// releases, so a browser revalidates them (`no-cache`: a `304` while the ETag holds).
    pub cache_control: &'static str,
}

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const HTML: &str = "text/html; charset=utf-8";
const REVALIDATE: &str = "no-cache";
const IMMUTABLE: &str = "public, max-age=31536000, immutable";

/// The console's Content-Security-Policy: its own scripts, styles, images and connections
/// (`'self'` covers the WebSocket of the same host), nothing inline, no frames, no plugins.
pub const CONSOLE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; font-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// GraphiQL's: the same, except that its editor (CodeMirror) and its React components set
/// inline styles, and its stylesheet inlines its fonts and icons as `data:` URIs.
pub const GRAPHIQL_CSP: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

macro_rules! asset {
    ($path:literal, $file:literal, $type:expr, $cache:expr) => {
        (
            $path,
            $type,
            include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/console/", $file)).as_slice(),
            $cache,
        )
    };
}

static ASSETS: LazyLock<BTreeMap<&'static str, Asset>> = LazyLock::new(|| {
    let files: [(&str, &str, &[u8], &str); 15] = [
        asset!("index.html", "index.html", HTML, REVALIDATE),
        asset!("graphiql.html", "graphiql.html", HTML, REVALIDATE),
        asset!("app.js", "app.js", JS, REVALIDATE),
        asset!("api.js", "api.js", JS, REVALIDATE),
        asset!("fleet.js", "fleet.js", JS, REVALIDATE),
        asset!("timeline.js", "timeline.js", JS, REVALIDATE),
        asset!("ui.js", "ui.js", JS, REVALIDATE),
        asset!("graphiql.js", "graphiql.js", JS, REVALIDATE),
        asset!("style.css", "style.css", CSS, REVALIDATE),
        asset!("icon.svg", "icon.svg", "image/svg+xml", REVALIDATE),
        asset!(
            "vendor/graphiql-3.8.3/graphiql.min.js",
            "vendor/graphiql-3.8.3/graphiql.min.js",
            JS,
            IMMUTABLE
        ),
        asset!(
            "vendor/graphiql-3.8.3/graphiql.min.css",
            "vendor/graphiql-3.8.3/graphiql.min.css",
            CSS,
            IMMUTABLE
        ),
        asset!(
            "vendor/react-18.3.1/react.production.min.js",
            "vendor/react-18.3.1/react.production.min.js",
            JS,
            IMMUTABLE
        ),
        asset!(
            "vendor/react-dom-18.3.1/react-dom.production.min.js",
            "vendor/react-dom-18.3.1/react-dom.production.min.js",
            JS,
            IMMUTABLE
        ),
        (
            "operations.js",
            JS,
            OPERATIONS_MODULE.as_bytes(),
            REVALIDATE,
        ),
    ];
    files
        .into_iter()
        .map(|(path, content_type, body, cache_control)| {
            let etag = format!("\"{}\"", &sha256_hex_bytes(body)[..32]);
            (
                path,
                Asset {
                    path,
                    content_type,
                    body,
                    etag,
                    cache_control,
                },
            )
        })
        .collect()
});

fn sha256_hex_bytes(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The file at `path` (relative to `/console/`), if the binary has it.
pub fn asset(path: &str) -> Option<&'static Asset> {
    ASSETS.get(path)
}

/// The text of `api/console/operations.graphql`.
pub const OPERATIONS: &str = include_str!("../console/operations.graphql");

/// One of the console's operations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub name: String,
    /// `query`, `mutation` or `subscription`.
    pub kind: &'static str,
    /// Its document, exactly as the console sends it and as it is hashed.
    pub body: String,
    /// The lowercase hex SHA-256 of `body`.
    pub hash: String,
}

/// The console's operations, in the order of the file: each starts at a line beginning with
/// `query `, `mutation ` or `subscription ` and runs to the next (comments and blank lines at
/// its end dropped).
pub fn operations() -> &'static [Operation] {
    static OPS: LazyLock<Vec<Operation>> = LazyLock::new(|| split(OPERATIONS));
    &OPS
}

fn split(text: &str) -> Vec<Operation> {
    let mut out = Vec::new();
    let mut current: Option<(&'static str, Vec<&str>)> = None;
    let finish = |current: Option<(&'static str, Vec<&str>)>, out: &mut Vec<Operation>| {
        if let Some((kind, lines)) = current {
            let body = lines
                .iter()
                .copied()
                .filter(|l| !l.trim_start().starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
                .trim()
                .to_owned();
            let name = body[kind.len()..]
                .trim_start()
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default()
                .to_owned();
            let hash = sha256_hex(&body);
            out.push(Operation {
                name,
                kind,
                body,
                hash,
            });
        }
    };
    for line in text.lines() {
        let starts = ["query", "mutation", "subscription"]
            .into_iter()
            .find(|k| line.starts_with(&format!("{k} ")));
        if let Some(kind) = starts {
            finish(current.take(), &mut out);
            current = Some((kind, vec![line]));
        } else if let Some((_, lines)) = current.as_mut() {
            lines.push(line);
        }
    }
    finish(current.take(), &mut out);
    out
}

/// `/console/operations.js`: the operations as an ES module the console imports
/// (`export default { Name: { hash, kind, query } }`), generated from the same text the server
/// trusts, so the hashes cannot drift.
static OPERATIONS_MODULE: LazyLock<String> = LazyLock::new(|| {
    let map: serde_json::Map<String, serde_json::Value> = operations()
        .iter()
        .map(|op| {
            (
                op.name.clone(),
                serde_json::json!({ "hash": op.hash, "kind": op.kind, "query": op.body }),
            )
        })
        .collect();
    format!(
        "// Generated by compute-api from api/console/operations.graphql.\nexport default {};\n",
        serde_json::Value::Object(map)
    )
});

/// The console's documents, which the server trusts as persisted operations in every mode.
pub fn documents() -> impl Iterator<Item = String> {
    operations().iter().map(|op| op.body.clone())
}

/// The console's operations as Apollo's persisted query manifest (`compute-api
/// console-manifest`), the format `--persisted-manifest` reads.
pub fn manifest() -> serde_json::Value {
    serde_json::json!({
        "format": "apollo-persisted-query-manifest",
        "version": 1,
        "operations": operations().iter().map(|op| serde_json::json!({
            "id": op.hash,
            "name": op.name,
            "type": op.kind,
            "body": op.body,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_parses_alone_and_is_named_once() {
        let ops = operations();
        assert!(ops.len() >= 15, "{} operations", ops.len());
        let mut names = std::collections::HashSet::new();
        for op in ops {
            assert!(names.insert(op.name.clone()), "{} twice", op.name);
            assert!(op.name.starts_with("Console"), "{}", op.name);
            let doc = async_graphql::parser::parse_query(&op.body)
                .unwrap_or_else(|e| panic!("{}: {e}", op.name));
            let named: Vec<_> = doc.operations.iter().map(|(n, _)| n).collect();
            assert_eq!(named.len(), 1, "{}: one operation each", op.name);
            assert_eq!(op.hash, sha256_hex(&op.body));
        }
    }

    #[test]
    fn every_page_file_is_embedded_with_a_validator() {
        for path in ["index.html", "app.js", "operations.js", "graphiql.html"] {
            let a = asset(path).unwrap_or_else(|| panic!("{path}"));
            assert!(!a.body.is_empty());
            assert_eq!(a.etag.len(), 34);
        }
        assert!(asset("../Cargo.toml").is_none());
    }
}
