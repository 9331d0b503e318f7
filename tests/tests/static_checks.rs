//! Checks that need no database: the committed schema and the wall-clock rule.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
}

#[test]
fn schema_graphql_is_the_printed_schema() {
    let committed = std::fs::read_to_string(root().join("schema.graphql")).expect("schema.graphql");
    let printed = compute_api::graph::sdl();
    assert!(
        committed == printed,
        "schema.graphql differs from the schema the code prints; regenerate it with\n  \
         cargo run -p compute-api -- schema > schema.graphql"
    );
}

/// Every SQL string in the crates and migrations reads time through compute_now(). The only
/// exceptions: the migration that defines compute_now(), the scanner's own examples, and lines
/// marked `check-sql-now: allow`.
#[test]
fn no_sql_reads_the_wall_clock() {
    let findings = compute_tests::sqlscan::scan_tree(
        root(),
        &[
            "api/src",
            "domain/src",
            "workers/src",
            "tests/src",
            "tests/tests",
            "migrations",
            "domain/sql",
        ],
        // The definition of compute_now() itself, in its migration and in its current text.
        &[
            "migrations/0001_clock.sql",
            "domain/sql/compute_now.sql",
            "tests/src/sqlscan.rs",
        ],
    );
    let list: Vec<String> = findings.iter().map(ToString::to_string).collect();
    assert!(
        list.is_empty(),
        "SQL that reads the wall clock (use compute_now(), or mark the line \
         `check-sql-now: allow` with the reason):\n{}",
        list.join("\n")
    );
}

/// No writing transaction notifies: a notifying commit waits for PostgreSQL's one cluster-wide
/// notify lock, which put every commit in one line (migration 0015, issue 36). Every `NOTIFY`
/// goes out after the commit, from the debouncer in `domain/src/db/poke.rs`
/// (`Db::poke_after_commit`); SQL in the migrations since 0015 and in the code sends none.
#[test]
fn only_the_after_commit_poker_notifies() {
    let mut files = vec![];
    for dir in [
        "api/src",
        "domain/src",
        "workers/src",
        "agent/src",
        "sim/src",
        "domain/sql",
    ] {
        let dir = root().join(dir);
        if dir.is_dir() {
            sources_under(&dir, &mut files);
        }
    }
    for m in std::fs::read_dir(root().join("migrations"))
        .expect("migrations")
        .flatten()
    {
        let name = m.file_name().to_string_lossy().into_owned();
        if name.as_str() >= "0015" {
            files.push(m.path());
        }
    }
    let mut found = vec![];
    for f in files {
        if f.ends_with("domain/src/db/poke.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read");
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let code = code.split("--").next().unwrap_or("");
            let sql_notify = code
                .trim_start()
                .to_ascii_uppercase()
                .starts_with("NOTIFY ")
                || code.contains("\"NOTIFY ");
            if code.to_ascii_lowercase().contains("pg_notify(") || sql_notify {
                found.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "NOTIFY outside the after-commit poker (use Db::poke_after_commit):\n{}",
        found.join("\n")
    );
}

fn sources_under(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources_under(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs" || e == "sql") {
            out.push(path);
        }
    }
}

/// The rooms of `compute-api` and their layer: a module may use only rooms of a lower layer, so
/// the rooms' imports cannot form a cycle. `ARCHITECTURE.md` states the same rules.
const API_ROOMS: &[(&str, u8)] = &[
    ("codes", 0),
    ("share", 0),
    ("trace", 0),
    ("auth", 1),
    ("tailer", 1),
    ("limits", 1),
    ("persisted", 1),
    ("authz", 2),
    ("metrics", 2),
    ("graph", 2),
    ("gateway", 2),
    ("console", 2),
    ("state", 3),
    ("transport", 4),
    ("ops", 4),
    ("server", 5),
    ("cli", 6),
];

/// The rooms a line of Rust names through `crate::` (also inside `use crate::{…}` groups).
fn crate_rooms(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        // `$crate::` in a macro is the same crate.
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let body = group.split('}').next().unwrap_or_default();
            out.extend(
                body.split(',')
                    .map(|p| p.trim().split("::").next().unwrap_or_default().to_owned())
                    .filter(|p| !p.is_empty()),
            );
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::` import inside `compute-api` goes from a room to a room of a lower layer (so
/// none forms a cycle), every file belongs to a known room, and `graph/context.rs` and
/// `graph/common.rs` stay leaves of `graph`.
#[test]
fn api_rooms_form_no_cycle() {
    let src = root().join("api/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let layer = |room: &str| API_ROOMS.iter().find(|(r, _)| *r == room).map(|(_, l)| *l);
    let mut broken = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under api/src");
        let first = rel.components().next().expect("a component");
        let room = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if room == "lib" || room == "main" {
            continue;
        }
        let Some(own) = layer(&room) else {
            broken.push(format!(
                "{}: not in a known room (add it to API_ROOMS and ARCHITECTURE.md)",
                rel.display()
            ));
            continue;
        };
        let leaf = rel.ends_with("graph/context.rs") || rel.ends_with("graph/common.rs");
        let text = std::fs::read_to_string(file).expect("read");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for target in crate_rooms(line) {
                match layer(&target) {
                    Some(l) if target == room => {
                        if leaf && !line.contains("graph::context") {
                            broken.push(format!(
                                "{}:{}: a leaf of graph uses `{}`",
                                rel.display(),
                                n + 1,
                                line.trim()
                            ));
                        }
                        let _ = l;
                    }
                    Some(l) if l < own => {}
                    Some(_) => broken.push(format!(
                        "{}:{}: `{room}` uses `{target}`, which is not in a lower layer: {}",
                        rel.display(),
                        n + 1,
                        line.trim()
                    )),
                    None => broken.push(format!(
                        "{}:{}: `crate::{target}` is not a room",
                        rel.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(broken.is_empty(), "the api's rooms:\n{}", broken.join("\n"));
    // The check can fail: a use of a higher layer is found.
    assert_eq!(
        crate_rooms("use crate::{state::AppState, graph};"),
        vec!["state", "graph"]
    );
}

/// Every type, field, argument, input field and enum value of the schema says what it is: no
/// empty description, and none of a single word ("Key."), which says nothing a name does not.
#[test]
fn every_schema_element_has_a_real_description() {
    const QUERY: &str = "{ __schema { types { name kind description \
        fields(includeDeprecated: true) { name description args { name description } } \
        inputFields { name description } enumValues(includeDeprecated: true) { name description } } } }";
    let schema = compute_api::graph::build(None);
    let response = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(schema.execute(QUERY));
    assert!(response.errors.is_empty(), "{:?}", response.errors);
    let data = response.data.into_json().expect("json");
    let vague = |d: &serde_json::Value| {
        let text = d.as_str().unwrap_or("").trim();
        text.is_empty() || !text.contains(char::is_whitespace)
    };
    let mut missing = Vec::new();
    let builtin = ["String", "Int", "Float", "Boolean", "ID"];
    for t in data["__schema"]["types"].as_array().expect("types") {
        let name = t["name"].as_str().unwrap_or("");
        if name.starts_with("__") || builtin.contains(&name) {
            continue;
        }
        // Connection types included: async-graphql gives them none, `graph::build` does.
        if vague(&t["description"]) {
            missing.push(format!("type {name}: {}", t["description"]));
        }
        for f in t["fields"].as_array().into_iter().flatten() {
            let field = f["name"].as_str().unwrap_or("");
            if vague(&f["description"]) {
                missing.push(format!("{name}.{field}: {}", f["description"]));
            }
            for a in f["args"].as_array().into_iter().flatten() {
                if vague(&a["description"]) {
                    missing.push(format!(
                        "{name}.{field}({}): {}",
                        a["name"].as_str().unwrap_or(""),
                        a["description"]
                    ));
                }
            }
        }
        for f in t["inputFields"].as_array().into_iter().flatten() {
            if vague(&f["description"]) {
                missing.push(format!(
                    "{name}.{}: {}",
                    f["name"].as_str().unwrap_or(""),
                    f["description"]
                ));
            }
        }
        for v in t["enumValues"].as_array().into_iter().flatten() {
            if vague(&v["description"]) {
                missing.push(format!(
                    "{name}.{}: {}",
                    v["name"].as_str().unwrap_or(""),
                    v["description"]
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "{} schema elements without a real description:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn every_event_type_is_documented() {
    let doc = std::fs::read_to_string(root().join("docs/webhooks.md")).expect("docs/webhooks.md");
    let missing: Vec<&str> = compute_domain::events::EventType::ALL
        .iter()
        .map(|t| t.as_str())
        .filter(|t| !doc.contains(&format!("`{t}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/webhooks.md does not document {missing:?}"
    );
}

/// The crates only `compute-api dev` needs, and the one file of the API that may name them.
const DEV_CRATES: [&str; 3] = ["compute-workers", "compute-sim", "compute-embedded-pg"];

#[test]
fn the_server_depends_on_its_dev_crates_only_through_the_dev_feature() {
    let manifest = std::fs::read_to_string(root().join("api/Cargo.toml")).expect("api/Cargo.toml");
    let mut broken = Vec::new();
    for krate in DEV_CRATES {
        // Each is an optional dependency that only the `dev` feature turns on.
        let line = manifest
            .lines()
            .find(|l| l.starts_with(&format!("{krate} ")) || l.starts_with(&format!("{krate}.")));
        match line {
            Some(l) if l.contains("optional = true") => {}
            Some(l) => broken.push(format!("api/Cargo.toml: `{l}` is not optional")),
            None => {}
        }
        let dev_feature = manifest
            .lines()
            .find(|l| l.starts_with("dev = ["))
            .unwrap_or_default();
        if line.is_some() && !dev_feature.contains(&format!("\"dep:{krate}\"")) {
            broken.push(format!(
                "api/Cargo.toml: the `dev` feature does not name dep:{krate}"
            ));
        }
    }
    let mut files = Vec::new();
    let src = root().join("api/src");
    rust_files(&src, &mut files);
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under api/src");
        if rel == Path::new("cli/dev.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read");
        for (n, line) in text.lines().enumerate() {
            for krate in DEV_CRATES {
                let path = krate.replace('-', "_");
                if line.contains(&format!("{path}::")) && !line.trim_start().starts_with("//") {
                    broken.push(format!(
                        "api/src/{}:{}: names `{path}` outside cli/dev.rs",
                        rel.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "`compute-api --no-default-features` must leave the dev crates out:\n{}",
        broken.join("\n")
    );
}

/// The domain's modules that are leaves of their aggregate: they hold the enums and value
/// types other modules (the event contract above all) name, and import nothing of their
/// aggregate, so they count as modules of their own in the import graph.
const DOMAIN_LEAVES: &[&str] = &[
    "fleet::model",
    "fleet::state",
    "reservations::model",
    "reservations::state",
    "instances::state",
    "node_commands::state",
    "quota::model",
    "sinks::model",
];

/// The module path of a file under `domain/src` (`fleet/mod.rs` is `fleet`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The graph node of a module path: its leaf (`fleet::model`) when it is in one, else its
/// top-level module.
fn domain_node(path: &[String]) -> String {
    if path.len() >= 2 {
        let two = format!("{}::{}", path[0], path[1]);
        if DOMAIN_LEAVES.contains(&two.as_str()) {
            return two;
        }
    }
    path.first().cloned().unwrap_or_default()
}

/// The paths a use tree names, from `text` just after `crate::` or `super::` (groups nest, and
/// may span lines): `fleet::{model::Labels, Node}` gives `fleet::model::Labels` and `fleet::Node`.
fn use_tree(text: &str) -> Vec<Vec<String>> {
    fn tree(s: &[u8], i: &mut usize) -> Vec<Vec<String>> {
        let skip = |i: &mut usize| {
            while *i < s.len() && s[*i].is_ascii_whitespace() {
                *i += 1;
            }
        };
        skip(i);
        if *i < s.len() && s[*i] == b'{' {
            *i += 1;
            let mut out = Vec::new();
            loop {
                out.extend(tree(s, i));
                skip(i);
                match s.get(*i) {
                    Some(b',') => *i += 1,
                    Some(b'}') => {
                        *i += 1;
                        return out;
                    }
                    _ => return out,
                }
                skip(i);
                if s.get(*i) == Some(&b'}') {
                    *i += 1;
                    return out;
                }
            }
        }
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_' || s[*i] == b'*') {
            *i += 1;
        }
        let name = String::from_utf8_lossy(&s[start..*i]).into_owned();
        if name.is_empty() {
            return vec![Vec::new()];
        }
        if s[*i..].starts_with(b"::") {
            *i += 2;
            return tree(s, i)
                .into_iter()
                .map(|mut rest| {
                    rest.insert(0, name.clone());
                    rest
                })
                .collect();
        }
        vec![vec![name]]
    }
    let mut i = 0;
    tree(text.as_bytes(), &mut i)
}

/// The domain's import graph: for each node, the nodes it names through `crate::` or `super::`
/// (code after a file's `#[cfg(test)]` and comments left out).
fn domain_graph() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let src = root().join("domain/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under domain/src");
        if rel == Path::new("lib.rs") {
            continue;
        }
        let path = module_path(rel);
        let me = domain_node(&path);
        let text: String = std::fs::read_to_string(file)
            .expect("read")
            .lines()
            .take_while(|l| l.trim() != "#[cfg(test)]")
            .map(|l| l.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n");
        let edges = graph.entry(me.clone()).or_default();
        for (keyword, base) in [
            ("crate::", Vec::new()),
            ("super::", path[..path.len() - 1].to_vec()),
        ] {
            let mut rest = text.as_str();
            while let Some(at) = rest.find(keyword) {
                let before = rest[..at].chars().next_back();
                rest = &rest[at + keyword.len()..];
                if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
                    continue;
                }
                for named in use_tree(rest) {
                    let full: Vec<String> = base.iter().cloned().chain(named).collect();
                    let target = domain_node(&full);
                    if !target.is_empty() && target != me {
                        edges.insert(target);
                    }
                }
            }
        }
    }
    let known: std::collections::BTreeSet<String> = graph.keys().cloned().collect();
    for edges in graph.values_mut() {
        edges.retain(|t| known.contains(t));
    }
    graph
}

/// The domain's modules (with the aggregates' `model`/`state` leaves as modules of their own)
/// import each other without a circle: `db` knows no module above it, the event contract only
/// the leaves. The layers are written down in `ARCHITECTURE.md`.
#[test]
fn domain_modules_form_no_cycle() {
    let graph = domain_graph();
    // Depth-first search; a grey node met again closes a circle.
    fn visit(
        n: &str,
        graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        colour: &mut std::collections::BTreeMap<String, u8>,
        stack: &mut Vec<String>,
        circles: &mut Vec<String>,
    ) {
        colour.insert(n.to_owned(), 1);
        stack.push(n.to_owned());
        for t in &graph[n] {
            match colour.get(t.as_str()).copied().unwrap_or(0) {
                0 => visit(t, graph, colour, stack, circles),
                1 => {
                    let from = stack.iter().position(|s| s == t).unwrap_or(0);
                    circles.push(format!("{} -> {t}", stack[from..].join(" -> ")));
                }
                _ => {}
            }
        }
        stack.pop();
        colour.insert(n.to_owned(), 2);
    }
    let mut colour = std::collections::BTreeMap::new();
    let mut circles = Vec::new();
    for n in graph.keys() {
        if !colour.contains_key(n) {
            visit(n, &graph, &mut colour, &mut Vec::new(), &mut circles);
        }
    }
    assert!(
        circles.is_empty(),
        "the domain's modules import each other in a circle:\n{}",
        circles.join("\n")
    );
    // The graph is what the test thinks it is: the contract and the rows' aggregates meet only
    // through the leaves, and `db` names nothing above it.
    assert!(graph["fleet"].contains("events"), "fleet emits events");
    assert!(
        graph["events"].contains("fleet::model"),
        "the contract names fleet's enums"
    );
    for low in ["db", "events"] {
        for high in ["fleet", "reservations", "outbox", "leases", "instances"] {
            assert!(!graph[low].contains(high), "`{low}` imports `{high}`");
        }
    }
    // ARCHITECTURE.md names every module of the graph in its table of layers.
    let arch = std::fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let layers = arch
        .split("The domain's layers")
        .nth(1)
        .and_then(|s| s.split("\n\n").nth(1))
        .unwrap_or_default();
    let missing: Vec<&String> = graph
        .keys()
        .filter(|n| !layers.contains(&format!("`{n}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's \"The domain's layers\" leaves out {missing:?}"
    );
}

/// Every public async function of the domain that opens a transaction (`.tx(`) carries a span
/// (`#[tracing::instrument]`) naming what it works on, so a trace shows which command a
/// transaction served.
#[test]
fn every_public_domain_function_that_opens_a_transaction_has_a_span() {
    let src = root().join("domain/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut bare = Vec::new();
    let mut seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let lines: Vec<&str> = text
            .lines()
            .take_while(|l| l.trim() != "#[cfg(test)]")
            .collect();
        let mut i = 0;
        while i < lines.len() {
            let Some(rest) = lines[i].strip_prefix("pub async fn ") else {
                i += 1;
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // The body ends at the first `}` in column 0.
            let end = (i + 1..lines.len())
                .find(|&j| lines[j] == "}")
                .unwrap_or(lines.len());
            let opens = lines[i..end].iter().any(|l| l.contains(".tx("));
            // The attributes and doc comments right above the signature.
            let spanned = lines[..i]
                .iter()
                .rev()
                .take_while(|l| {
                    l.starts_with("#[")
                        || l.starts_with("///")
                        || l.starts_with("    ")
                        || l.starts_with(")]")
                })
                .any(|l| l.contains("tracing::instrument"));
            if opens {
                seen += 1;
                if !spanned {
                    bare.push(format!(
                        "{}:{}: {name}",
                        file.strip_prefix(root())
                            .expect("in the workspace")
                            .display(),
                        i + 1
                    ));
                }
            }
            i = end;
        }
    }
    assert!(
        seen >= 40,
        "the check found only {seen} functions: it no longer reads the code"
    );
    assert!(
        bare.is_empty(),
        "public domain functions that open a transaction without a span \
         (`#[tracing::instrument(level = \"debug\", skip_all, fields(…))]`):\n{}",
        bare.join("\n")
    );
}

/// Where the domain assembles SQL text with `format!`, and how many statements each file builds
/// so: only statements whose shape varies at run time (the listings' filters, built on the
/// `*_COLS` constants, the guarded updates of `fleet/changes/` whose `SET` varies, and the
/// availability node read, with one expression per allocation of the request). Static
/// statements are `sqlx::query!` macros, checked against the migrations. This list may only
/// shrink: a new `format!` statement, or a file not listed, fails; converting one fails until its
/// count here is lowered.
const FORMAT_SQL: &[(&str, usize)] = &[
    ("fleet/changes/devices.rs", 1),
    ("fleet/changes/mod.rs", 1),
    ("fleet/changes/nodes.rs", 1),
    ("fleet/enrollment/mod.rs", 1),
    ("fleet/mod.rs", 8),
    ("instances/mod.rs", 1),
    ("node_commands/mod.rs", 1),
    ("reservations/availability.rs", 1),
    ("reservations/mod.rs", 1),
];

/// How many `format!` calls in `text` start with an SQL statement's first keyword.
fn format_sql_count(text: &str) -> usize {
    let mut n = 0;
    let mut rest = text;
    while let Some(at) = rest.find("format!(") {
        rest = &rest[at + "format!(".len()..];
        let s = rest
            .trim_start()
            .trim_start_matches('r')
            .trim_start_matches('#');
        if let Some(body) = s.strip_prefix('"') {
            let first: String = body
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphabetic())
                .collect();
            if ["SELECT", "INSERT", "UPDATE", "WITH", "DELETE"].contains(&first.as_str()) {
                n += 1;
            }
        }
    }
    n
}

#[test]
fn sql_is_assembled_with_format_only_where_listed() {
    let src = root().join("domain/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken = Vec::new();
    let mut found = std::collections::BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let code = text.split("\n#[cfg(test)]").next().unwrap_or_default();
        let n = format_sql_count(code);
        if n > 0 {
            let rel = file.strip_prefix(&src).expect("under domain/src");
            found.insert(rel.display().to_string(), n);
        }
    }
    for (file, n) in &found {
        match FORMAT_SQL.iter().find(|(f, _)| f == file) {
            None => broken.push(format!(
                "domain/src/{file}: {n} statements assembled with format!: write them as \
                 sqlx::query! (or, for a statement whose shape varies, list the file)"
            )),
            Some((_, budget)) if n > budget => broken.push(format!(
                "domain/src/{file}: {n} statements assembled with format!, {budget} allowed"
            )),
            Some((_, budget)) if n < budget => broken.push(format!(
                "domain/src/{file}: {n} statements assembled with format! now, lower its count \
                 in FORMAT_SQL from {budget}"
            )),
            Some(_) => {}
        }
    }
    for (file, _) in FORMAT_SQL {
        if !found.contains_key(*file) {
            broken.push(format!(
                "domain/src/{file}: no format! statement left: take it out of FORMAT_SQL"
            ));
        }
    }
    assert_eq!(
        format_sql_count("let q = format!(\n    \"SELECT {COLS} FROM x\");"),
        1,
        "the scanner finds a statement on the next line"
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// A named column list: (constant or macro name, table alias, the columns as written).
type ColumnList = (String, String, String);

/// The column lists of a file: `const …COLS: &str = "…"` (for the dynamic builders) and the raw
/// column text of each `macro_rules! query_… { … r#"…"# … }` (for the checked statements), each
/// keyed by its table alias (`c` for `c.id, …`).
fn column_lists(text: &str) -> (Vec<ColumnList>, Vec<ColumnList>) {
    let alias = |cols: &str| {
        cols.trim_start()
            .split('.')
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let mut consts = Vec::new();
    for (at, _) in text.match_indices("const ") {
        let rest = &text[at + "const ".len()..];
        let Some((name, after)) = rest.split_once(':') else {
            continue;
        };
        if !name.ends_with("COLS") || name.contains(char::is_whitespace) {
            continue;
        }
        let Some(open) = after.find('"') else {
            continue;
        };
        let body = &after[open + 1..];
        let Some(close) = body.find("\";") else {
            continue;
        };
        // Rust's `\` line continuation: the newline and the next line's indentation go.
        let mut value = String::new();
        let mut lines = body[..close].split("\\\n");
        value.push_str(lines.next().unwrap_or_default());
        for l in lines {
            value.push_str(l.trim_start());
        }
        consts.push((name.to_owned(), alias(&value), value));
    }
    let mut macros = Vec::new();
    for (at, _) in text.match_indices("macro_rules! query_") {
        let rest = &text[at + "macro_rules! ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let end = rest.find("\n}\n").unwrap_or(rest.len());
        let Some(open) = rest[..end].find("r#\"") else {
            continue;
        };
        let body = &rest[open + 3..end];
        let Some(close) = body.find("\"#") else {
            continue;
        };
        let value = body[..close].to_owned();
        macros.push((name, alias(&value), value));
    }
    (consts, macros)
}

/// A column list as (expression, output name) pairs: top-level commas split it, whitespace is
/// one space, and `AS "name!: _"` (sqlx's annotations) names the column `name` as `AS name` does.
fn columns(list: &str) -> Vec<(String, String)> {
    let mut items = Vec::new();
    let (mut depth, mut cur) = (0i32, String::new());
    for c in list.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    items.push(cur);
    items
        .iter()
        .map(|item| item.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|item| !item.is_empty())
        .map(|item| {
            let (expr, name) = match item.rfind(" AS ") {
                Some(at) if !item[at + 4..].contains(' ') || item[at + 4..].starts_with('"') => {
                    let name: String = item[at + 4..]
                        .trim_matches('"')
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    (item[..at].to_owned(), name)
                }
                _ => {
                    let name = item.rsplit('.').next().unwrap_or_default().to_owned();
                    (item.clone(), name)
                }
            };
            (expr, name)
        })
        .collect()
}

/// Column-list constants with no checked macro beside them: no static statement reads the row.
const COLS_WITHOUT_MACRO: &[&str] = &["ATOM_COLS"];

#[test]
fn each_column_list_constant_names_the_columns_of_its_query_macro() {
    let src = root().join("domain/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken = Vec::new();
    let mut pairs = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let (consts, macros) = column_lists(&text);
        let rel = file.strip_prefix(root()).expect("under the root").display();
        for (name, alias, value) in &consts {
            let matching: Vec<_> = macros.iter().filter(|(_, a, _)| a == alias).collect();
            match matching.as_slice() {
                [] if COLS_WITHOUT_MACRO.contains(&name.as_str()) => {}
                [] => broken.push(format!(
                    "{rel}: {name} (columns of `{alias}`) has no query_…! macro over the same \
                     alias in its file: write the static statements with one, or list the \
                     constant in COLS_WITHOUT_MACRO"
                )),
                [(mac, _, cols)] => {
                    pairs += 1;
                    let (a, b) = (columns(value), columns(cols));
                    if a != b {
                        broken.push(format!(
                            "{rel}: {name} and {mac}! name other columns:\n  {name}: {a:?}\n  {mac}!: {b:?}"
                        ));
                    }
                }
                more => broken.push(format!(
                    "{rel}: {name}: {} macros over alias `{alias}`",
                    more.len()
                )),
            }
        }
    }
    // The comparison can fail: a column left out, or renamed, is seen.
    assert_ne!(
        columns("c.id, c.state AS \"state: _\", c.version"),
        columns("c.id, c.state, c.version, c.created_at")
    );
    assert_ne!(
        columns("x.a::float8 AS \"b!\""),
        columns("x.a::float8 AS c")
    );
    assert_eq!(
        columns("f(r.a, r.b) AS s, r.c"),
        columns("f(r.a,\n  r.b) AS \"s!: _\", r.c AS \"c: _\"")
    );
    assert!(
        pairs >= 8,
        "only {pairs} constant/macro pairs found: is the scanner broken?"
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The statements of an SQL script, split at `;` outside comments, quotes and dollar quotes;
/// each without the comments and blank lines that lead it.
fn sql_statements(script: &str) -> Vec<String> {
    let b = script.as_bytes();
    let (mut out, mut start, mut i) = (Vec::new(), 0, 0);
    while i < b.len() {
        match b[i] {
            b'-' if b.get(i + 1) == Some(&b'-') => {
                i = script[i..].find('\n').map_or(b.len(), |n| i + n);
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i = script[i + 2..]
                    .find("*/")
                    .map_or(b.len(), |n| i + 2 + n + 2);
            }
            q @ (b'\'' | b'"') => {
                i += 1;
                while i < b.len() && b[i] != q {
                    i += 1;
                }
                i += 1;
            }
            b'$' => {
                let tag_len = script[i + 1..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(0);
                if b.get(i + 1 + tag_len) == Some(&b'$') && !b[i + 1].is_ascii_digit() {
                    let tag = &script[i..i + tag_len + 2];
                    let body = i + tag.len();
                    i = script[body..]
                        .find(tag)
                        .map_or(b.len(), |n| body + n + tag.len());
                } else {
                    i += 1;
                }
            }
            b';' => {
                out.push(script[start..=i].to_owned());
                start = i + 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    out.into_iter()
        .map(|s| {
            let mut s = s.as_str();
            loop {
                s = s.trim_start();
                if s.starts_with("--") {
                    s = s.split_once('\n').map_or("", |(_, rest)| rest);
                } else {
                    break;
                }
            }
            s.to_owned()
        })
        .filter(|s| !s.is_empty())
        .collect()
}

/// The function a `CREATE [OR REPLACE] FUNCTION` or `ALTER FUNCTION` statement names.
fn function_statement(stmt: &str) -> Option<(bool, String)> {
    let words: Vec<&str> = stmt.split_whitespace().take(5).collect();
    let (create, name) = match words.as_slice() {
        ["CREATE", "FUNCTION", name, ..] | ["CREATE", "OR", "REPLACE", "FUNCTION", name, ..] => {
            (true, *name)
        }
        ["ALTER", "FUNCTION", name, ..] => (false, *name),
        _ => return None,
    };
    Some((create, name.split('(').next().unwrap_or(name).to_owned()))
}

/// Each SQL function's current definition from the migrations: its last `CREATE`, and the
/// `ALTER FUNCTION … SET` statements after it (a `CREATE OR REPLACE` clears them), with the
/// migration that last created it.
fn current_sql_functions() -> std::collections::BTreeMap<String, (String, String)> {
    let mut migrations: Vec<_> = std::fs::read_dir(root().join("migrations"))
        .expect("migrations/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    migrations.sort();
    let mut current = std::collections::BTreeMap::<String, (String, String)>::new();
    for path in &migrations {
        let file = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(path).expect("read");
        for stmt in sql_statements(&text) {
            // A dropped function has no current definition (and so no file).
            if let Some(rest) = stmt.trim_start().strip_prefix("DROP FUNCTION ") {
                let name = rest
                    .trim_start_matches("IF EXISTS ")
                    .split(['(', ' ', ';'])
                    .next()
                    .unwrap_or("")
                    .to_owned();
                assert!(
                    current.remove(&name).is_some(),
                    "{file}: DROP FUNCTION {name}, which no migration defined"
                );
                continue;
            }
            match function_statement(&stmt) {
                Some((true, name)) => {
                    current.insert(name, (file.clone(), stmt + "\n"));
                }
                Some((false, name)) => {
                    let entry = current.get_mut(&name).unwrap_or_else(|| {
                        panic!("{file}: ALTER FUNCTION {name} before it exists")
                    });
                    entry.1.push_str(&stmt);
                    entry.1.push('\n');
                }
                None => {}
            }
        }
    }
    current
}

/// The first line of each `domain/sql/<function>.sql`: which migration defined it last.
fn sql_file_header(migration: &str) -> String {
    format!(
        "-- The current definition, as migrations/{migration} left it. Change it with a new migration\n\
         -- that redefines it, then this file (COMPUTE_BLESS_SQL=1 cargo test --test static_checks\n\
         -- writes it); `each_sql_function_is_its_last_migration` keeps the two the same.\n\n"
    )
}

#[test]
fn each_sql_function_is_its_last_migration() {
    let dir = root().join("domain/sql");
    let current = current_sql_functions();
    let bless = std::env::var_os("COMPUTE_BLESS_SQL").is_some();
    let mut broken = Vec::new();
    for (name, (migration, text)) in &current {
        let path = dir.join(format!("{name}.sql"));
        let want = sql_file_header(migration) + text;
        if bless {
            std::fs::create_dir_all(&dir).expect("domain/sql");
            std::fs::write(&path, &want).expect("write");
        }
        match std::fs::read_to_string(&path) {
            Ok(have) if have == want => {}
            Ok(_) => broken.push(format!(
                "domain/sql/{name}.sql differs from its definition in migrations/{migration} \
                 (and the ALTER FUNCTIONs after it): a migration changed it without the file, or \
                 the file was edited without a migration"
            )),
            Err(_) => broken.push(format!(
                "domain/sql/{name}.sql is missing (defined by migrations/{migration})"
            )),
        }
    }
    for entry in std::fs::read_dir(&dir).expect("domain/sql") {
        let path = entry.expect("entry").path();
        let stem = path
            .file_stem()
            .expect("stem")
            .to_string_lossy()
            .into_owned();
        if !current.contains_key(&stem) {
            broken.push(format!("{}: no migration defines {stem}", path.display()));
        }
    }
    // The splitter sees through what hides a `;`.
    assert_eq!(
        sql_statements(
            "-- a; comment\nCREATE FUNCTION f() RETURNS int AS $x$ SELECT 1; $x$ LANGUAGE sql;\n\
             /* b; */ SELECT 'c;d', \"e;\" ; ALTER FUNCTION f() SET a = b;"
        ),
        [
            "CREATE FUNCTION f() RETURNS int AS $x$ SELECT 1; $x$ LANGUAGE sql;",
            "/* b; */ SELECT 'c;d', \"e;\" ;",
            "ALTER FUNCTION f() SET a = b;"
        ]
    );
    assert!(
        current.len() >= 30,
        "only {} functions found",
        current.len()
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The names in a manifest's `[dependencies]` (not dev- or build-dependencies).
fn normal_dependencies(manifest: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(manifest)).expect("manifest");
    let mut in_deps = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && line.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) {
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            out.push(name);
        }
    }
    out
}

/// The crate boundaries of `ARCHITECTURE.md`, kept by the manifests: only `domain` may run SQL
/// (`sqlx`), and it knows no HTTP, WebSocket or GraphQL; the workers know no GraphQL; the
/// protocol, the agent and the simulator know neither SQL nor the domain.
#[test]
fn each_crate_depends_only_on_what_its_place_may_know() {
    let forbidden: &[(&str, &[&str])] = &[
        (
            "domain/Cargo.toml",
            &[
                "axum",
                "async-graphql",
                "async-graphql-value",
                "hyper",
                "tokio-tungstenite",
                "reqwest",
            ],
        ),
        ("api/Cargo.toml", &["sqlx"]),
        (
            "workers/Cargo.toml",
            &["sqlx", "async-graphql", "async-graphql-value"],
        ),
        (
            "protocol/Cargo.toml",
            &["sqlx", "async-graphql", "compute-domain"],
        ),
        (
            "agent/Cargo.toml",
            &["sqlx", "async-graphql", "compute-domain"],
        ),
        (
            "sim/Cargo.toml",
            &["sqlx", "async-graphql", "compute-domain"],
        ),
    ];
    let mut broken = Vec::new();
    for (manifest, names) in forbidden {
        let deps = normal_dependencies(manifest);
        assert!(!deps.is_empty(), "{manifest}: no [dependencies] read");
        for name in *names {
            if deps.iter().any(|d| d == name) {
                broken.push(format!("{manifest} depends on {name}"));
            }
        }
    }
    assert!(
        normal_dependencies("domain/Cargo.toml").contains(&"sqlx".to_owned()),
        "the scanner reads the domain's sqlx"
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The SQL texts of the domain: its Rust string literals, its functions (`domain/sql/`) and the
/// migrations, each with where it comes from.
fn domain_sql_texts() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut files = Vec::new();
    rust_files(&root().join("domain/src"), &mut files);
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let rel = file
            .strip_prefix(root())
            .expect("under the root")
            .display()
            .to_string();
        // One text per file: its literals' lines (a statement may span several literals).
        let lines: Vec<String> = compute_tests::sqlscan::rust_string_literals(&text)
            .into_iter()
            .map(|(_, lit)| lit)
            .collect();
        out.push((rel, lines.join("\n")));
    }
    for dir in ["domain/sql", "migrations"] {
        let mut paths: Vec<_> = std::fs::read_dir(root().join(dir))
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .collect();
        paths.sort();
        for p in paths {
            let rel = p
                .strip_prefix(root())
                .expect("under the root")
                .display()
                .to_string();
            out.push((rel, std::fs::read_to_string(&p).expect("read")));
        }
    }
    out
}

/// The states and the transitions (from, to) of one state table, as stored.
struct StateTable {
    table: &'static str,
    states: Vec<&'static str>,
    transitions: Vec<(&'static str, &'static str)>,
}

fn state_tables() -> Vec<StateTable> {
    use compute_domain::{instances, node_commands, reservations};
    vec![
        StateTable {
            table: "reservations",
            states: reservations::state::State::ALL
                .iter()
                .map(|s| s.as_str())
                .collect(),
            transitions: reservations::state::TRANSITIONS
                .iter()
                .map(|(_, f, t)| (f.as_str(), t.as_str()))
                .collect(),
        },
        StateTable {
            table: "commands",
            states: node_commands::state::State::ALL
                .iter()
                .map(|s| s.as_str())
                .collect(),
            transitions: node_commands::state::TRANSITIONS
                .iter()
                .map(|(_, f, t)| (f.as_str(), t.as_str()))
                .collect(),
        },
        StateTable {
            table: "instances",
            states: instances::state::State::ALL
                .iter()
                .map(|s| s.as_str())
                .collect(),
            transitions: instances::state::TRANSITIONS
                .iter()
                .map(|(_, f, t)| (f.as_str(), t.as_str()))
                .collect(),
        },
    ]
}

/// The quoted words of `list` (`'a', 'b'`).
fn quoted(list: &str) -> Vec<String> {
    regex::Regex::new(r"'([a-z_]+)'")
        .expect("regex")
        .captures_iter(list)
        .map(|c| c[1].to_owned())
        .collect()
}

/// What `text` (from `src`) says of the state tables' states that they do not allow, and how
/// many guarded updates between literal states it holds.
fn state_literal_findings(src: &str, text: &str, tables: &[StateTable]) -> (Vec<String>, usize) {
    let update = regex::Regex::new(
        r"(?is)UPDATE\s+(\w+)(?:\s+AS)?\s+(\w+)?\s*SET\s+(.*?)\bWHERE\b(.*?)(?:RETURNING|\z|;|\bUPDATE\b|\bINSERT\b|\bDELETE\b)",
    )
    .expect("regex");
    let set_state = regex::Regex::new(r"(?i)(?:^|[\s,])state\s*=\s*'([a-z_]+)'").expect("regex");
    let compared = regex::Regex::new(
        r"(?i)(?:(\w+)\.)?state\s*(?:=|<>|!=)\s*'([a-z_]+)'|(?:(\w+)\.)?state\s+(?:NOT\s+)?IN\s*\(([^)]*)\)",
    )
    .expect("regex");
    let alias =
        regex::Regex::new(r"(?i)\b(reservations|commands|instances)\s+(?:AS\s+)?([a-z]\w*)\b")
            .expect("regex");
    let table = |name: &str| tables.iter().find(|t| t.table == name);
    let mut broken = Vec::new();
    let mut updates_checked = 0;
    {
        // Which state table each alias (and the bare name) of this text means.
        let mut aliases: std::collections::BTreeMap<String, &str> = Default::default();
        let mut named = std::collections::BTreeSet::new();
        for c in alias.captures_iter(text) {
            let name = c[1].to_ascii_lowercase();
            let Some(t) = table(&name) else { continue };
            named.insert(t.table);
            let a = c[2].to_ascii_lowercase();
            if ![
                "where",
                "set",
                "on",
                "using",
                "join",
                "order",
                "group",
                "returning",
            ]
            .contains(&a.as_str())
            {
                aliases.insert(a, t.table);
            }
            aliases.insert(name, t.table);
        }
        if named.is_empty() {
            return (broken, updates_checked);
        }
        // 2. Every state compared with a row of a state table is one of its states.
        for c in compared.captures_iter(text) {
            let (qualifier, words) = match (c.get(2), c.get(4)) {
                (Some(w), _) => (c.get(1), vec![w.as_str().to_owned()]),
                (None, Some(list)) => (c.get(3), quoted(list.as_str())),
                _ => continue,
            };
            let t = match qualifier {
                Some(q) => aliases.get(&q.as_str().to_ascii_lowercase()).copied(),
                None if named.len() == 1 => named.iter().next().copied(),
                None => None,
            };
            let Some(t) = t.and_then(table) else { continue };
            for w in words {
                if !t.states.contains(&w.as_str()) {
                    broken.push(format!(
                        "{src}: `{w}` is not a state of {} ({:?})",
                        t.table, t.states
                    ));
                }
            }
        }
        // 3. Guarded updates between literal states are transitions of the table.
        for c in update.captures_iter(text) {
            let Some(t) = table(&c[1].to_ascii_lowercase()) else {
                continue;
            };
            let Some(to) = set_state.captures(&c[3]).map(|s| s[1].to_owned()) else {
                continue;
            };
            let from: Vec<String> = compared
                .captures_iter(&c[4])
                .flat_map(|f| match (f.get(2), f.get(4)) {
                    (Some(w), _) => vec![w.as_str().to_owned()],
                    (None, Some(list)) if !f[0].to_ascii_uppercase().contains("NOT IN") => {
                        quoted(list.as_str())
                    }
                    _ => vec![],
                })
                .collect();
            for f in &from {
                updates_checked += 1;
                if !t.transitions.contains(&(f.as_str(), to.as_str())) {
                    broken.push(format!(
                        "{src}: an UPDATE of {} moves `{f}` to `{to}`, which no transition of its table allows",
                        t.table
                    ));
                }
            }
        }
    }
    (broken, updates_checked)
}

/// State rules in one place: what the SQL says of a state table's states agrees with the Rust
/// state table. Its `CHECK` (the last migration's) lists exactly the table's states; every state
/// a statement compares a row of the table with is one of them; and every guarded update that
/// moves a row from literal states to a literal state (`UPDATE … SET state = 'to' … WHERE …
/// state = 'from'`) is a transition of the table. A state added to one and not the other, or a
/// transition written in SQL that the table does not allow, fails here.
#[test]
fn sql_state_literals_agree_with_the_state_tables() {
    let texts = domain_sql_texts();
    let mut broken = Vec::new();
    let check = regex::Regex::new(r"(?s)CONSTRAINT (\w+)_state\s+CHECK\s*\(state IN\s*\(([^)]*)\)")
        .expect("regex");
    for t in state_tables() {
        // 1. The CHECK of the last migration that defines it.
        let last = texts
            .iter()
            .filter(|(src, _)| src.starts_with("migrations/"))
            .flat_map(|(src, text)| {
                check
                    .captures_iter(text)
                    .filter(|c| &c[1] == t.table)
                    .map(|c| (src.clone(), quoted(&c[2])))
                    .collect::<Vec<_>>()
            })
            .last();
        match last {
            Some((src, mut listed)) => {
                listed.sort();
                let mut states: Vec<String> = t.states.iter().map(|s| (*s).to_owned()).collect();
                states.sort();
                if listed != states {
                    broken.push(format!(
                        "{src}: {}_state lists {listed:?}; the state table has {states:?}",
                        t.table
                    ));
                }
            }
            None => broken.push(format!("no CHECK lists the states of {}", t.table)),
        }
    }
    let tables = state_tables();
    for (src, text) in &texts {
        // The migrations are read for their CHECKs above; the current statements are the Rust
        // literals and the functions' current text.
        if src.starts_with("migrations/") {
            continue;
        }
        let (found, _) = state_literal_findings(src, text, &tables);
        broken.extend(found);
    }
    // The scan can fail: an illegal move, and a state no table has, are both seen; a legal move
    // is not.
    let (found, n) = state_literal_findings(
        "example",
        "UPDATE reservations r SET state = 'active' WHERE r.id = $1 AND r.state = 'released'",
        &tables,
    );
    assert_eq!((found.len(), n), (1, 1), "{found:?}");
    let (found, n) = state_literal_findings(
        "example",
        "UPDATE reservations AS r SET state = 'active' WHERE r.state IN ('scheduled') RETURNING",
        &tables,
    );
    assert_eq!((found.len(), n), (0, 1), "{found:?}");
    let (found, _) = state_literal_findings(
        "example",
        "SELECT 1 FROM commands c WHERE c.state = 'parked'",
        &tables,
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// Parse, don't validate: no domain type has a public `check(&self)` that a caller may forget
/// to call. Input types are made by a `parse` constructor that checks them (`CommandRequest`,
/// `InstanceRequest`, `Report`, `ReportedExit`, `node_sessions::Label`), or hold checked types
/// and leave only cross-field rules to the one domain entry that takes them (`NewNode`, whose
/// GPU count and distinct UUIDs `register_node` and `join` check).
#[test]
fn domain_input_is_parsed_not_checked_after_the_fact() {
    let mut files = Vec::new();
    rust_files(&root().join("domain/src"), &mut files);
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("pub fn check(&self") {
                found.push(format!("{}:{}", file.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "public validators that validate and forget; make the type's constructor parse instead:\n{}",
        found.join("\n")
    );
}
