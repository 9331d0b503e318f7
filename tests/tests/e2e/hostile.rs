//! Hostile input, tried as an attacker would: generated values in every argument of every root
//! field, documents built to explode, budgets run dry, slow and oversized connections. Each
//! class is refused with a coded error; `INTERNAL` appears in no response here.

use std::collections::HashMap;
use std::time::Duration;

use compute_api::auth::Role;
use compute_api::limits::Limits;
use compute_tests::spawn_app;
use serde_json::{Value, json};

const INTROSPECT: &str = r#"
query {
  __schema {
    queryType { name }
    mutationType { name }
    types {
      name kind
      fields { name args { name type { ...T } } type { ...T } }
      inputFields { name type { ...T } }
      enumValues { name }
    }
  }
}
fragment T on __Type { kind name ofType { kind name ofType { kind name ofType { kind name } } } }
"#;

/// A GraphQL type reference from introspection.
#[derive(Debug, Clone)]
enum Ty {
    NonNull(Box<Ty>),
    List(Box<Ty>),
    Named(String, String),
}

impl Ty {
    fn from(v: &Value) -> Ty {
        match v["kind"].as_str() {
            Some("NON_NULL") => Ty::NonNull(Box::new(Ty::from(&v["ofType"]))),
            Some("LIST") => Ty::List(Box::new(Ty::from(&v["ofType"]))),
            Some(kind) => Ty::Named(
                kind.to_owned(),
                v["name"].as_str().unwrap_or_default().to_owned(),
            ),
            None => panic!("a type reference without a kind: {v}"),
        }
    }

    fn sdl(&self) -> String {
        match self {
            Ty::NonNull(t) => format!("{}!", t.sdl()),
            Ty::List(t) => format!("[{}]", t.sdl()),
            Ty::Named(_, n) => n.clone(),
        }
    }

    fn named(&self) -> (&str, &str) {
        match self {
            Ty::NonNull(t) | Ty::List(t) => t.named(),
            Ty::Named(k, n) => (k, n),
        }
    }
}

struct Schema {
    types: HashMap<String, Value>,
}

impl Schema {
    /// A plausible value of `ty`: every required input field filled, optional ones left out.
    fn sample(&self, ty: &Ty) -> Value {
        match ty {
            Ty::NonNull(t) => self.sample(t),
            Ty::List(t) => json!([self.sample(t)]),
            Ty::Named(kind, name) => match (kind.as_str(), name.as_str()) {
                ("SCALAR", "Int") => json!(1),
                ("SCALAR", "Float") => json!(1.5),
                ("SCALAR", "Boolean") => json!(false),
                ("SCALAR", "DateTime") => json!("2030-01-01T00:00:00Z"),
                ("SCALAR", "ID") => json!(format!("pool_{}", "0".repeat(32))),
                ("SCALAR", _) => json!("x1"),
                ("ENUM", _) => self.types[name]["enumValues"][0]["name"].clone(),
                ("INPUT_OBJECT", _) => {
                    let mut o = serde_json::Map::new();
                    for f in self.types[name]["inputFields"]
                        .as_array()
                        .into_iter()
                        .flatten()
                    {
                        let t = Ty::from(&f["type"]);
                        if matches!(t, Ty::NonNull(_)) {
                            o.insert(
                                f["name"].as_str().expect("a name").to_owned(),
                                self.sample(&t),
                            );
                        }
                    }
                    Value::Object(o)
                }
                _ => Value::Null,
            },
        }
    }

    /// Every scalar leaf below `ty` (through input objects, two levels down), as a path of
    /// input field names and the leaf's scalar name.
    fn leaves(&self, ty: &Ty, path: Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
        let (kind, name) = ty.named();
        match kind {
            "SCALAR" => out.push((path, name.to_owned())),
            "INPUT_OBJECT" if path.len() < 3 => {
                for f in self.types[name]["inputFields"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let mut p = path.clone();
                    p.push(f["name"].as_str().expect("a name").to_owned());
                    self.leaves(&Ty::from(&f["type"]), p, out);
                }
            }
            _ => {}
        }
    }

    /// `{ __typename }` for a composite result, nothing for a leaf.
    fn selection(&self, ty: &Ty) -> &'static str {
        match ty.named().0 {
            "OBJECT" | "INTERFACE" | "UNION" => "{ __typename }",
            _ => "",
        }
    }
}

/// Values an attacker would try for each scalar.
fn hostile(scalar: &str) -> Vec<Value> {
    let text = vec![
        json!("a\u{0}b"),
        json!("x".repeat(100_000)),
        json!("\u{202e}\u{7}\r\n"),
        json!(""),
    ];
    match scalar {
        "Int" => vec![json!(i32::MAX), json!(i32::MIN), json!(-1)],
        "Float" => vec![json!(1e308), json!(-1e308), json!(9_007_199_254_740_991i64)],
        "Boolean" => vec![],
        "DateTime" => vec![
            json!("-262143-01-01T00:00:00Z"),
            json!("+275760-09-13T00:00:00Z"),
            json!("9999-12-31T23:59:59Z"),
            json!("0000-01-01T00:00:00Z"),
        ],
        _ => text,
    }
}

fn set(root: &mut Value, path: &[String], v: Value) {
    match path.split_first() {
        None => *root = v,
        Some((head, rest)) => {
            if !root.is_object() {
                *root = json!({});
            }
            let child = root
                .as_object_mut()
                .expect("an object")
                .entry(head.clone())
                .or_insert(Value::Null);
            set(child, rest, v);
        }
    }
}

fn codes(body: &Value) -> Vec<String> {
    body["errors"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            e["extensions"]["code"]
                .as_str()
                .unwrap_or("<none>")
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn hostile_values_in_every_argument_get_coded_errors_never_internal() {
    // Generated from the schema itself: for every root query and mutation field and every
    // scalar it takes (directly or inside its input objects), each value an attacker would
    // send: NUL bytes, 100 kB strings, control characters, empty strings, the ends of Int,
    // huge floats, dates outside PostgreSQL's range. Every answer is data or a coded error of
    // the caller's; none is INTERNAL, none is uncoded.
    let app = spawn_app().await;
    let token = app.token("mallory", Some("evil"), &[Role::Operator, Role::Member]);
    let (_, intro) = app.graphql(INTROSPECT, json!({}), Some(&token)).await;
    let schema = &intro["data"]["__schema"];
    let types: HashMap<String, Value> = schema["types"]
        .as_array()
        .expect("types")
        .iter()
        .map(|t| (t["name"].as_str().expect("a name").to_owned(), t.clone()))
        .collect();
    let s = Schema { types };
    let mut tried = 0;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (op, root) in [
        (
            "query",
            schema["queryType"]["name"].as_str().expect("a name"),
        ),
        (
            "mutation",
            schema["mutationType"]["name"].as_str().expect("a name"),
        ),
    ] {
        for field in s.types[root]["fields"].as_array().expect("fields") {
            let name = field["name"].as_str().expect("a name");
            let args: Vec<(String, Ty)> = field["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|a| {
                    (
                        a["name"].as_str().expect("a name").to_owned(),
                        Ty::from(&a["type"]),
                    )
                })
                .collect();
            if args.is_empty() {
                continue;
            }
            let decl: Vec<String> = args
                .iter()
                .map(|(n, t)| format!("${n}: {}", t.sdl()))
                .collect();
            let pass: Vec<String> = args.iter().map(|(n, _)| format!("{n}: ${n}")).collect();
            let doc = format!(
                "{op}({}) {{ {name}({}) {} }}",
                decl.join(", "),
                pass.join(", "),
                s.selection(&Ty::from(&field["type"]))
            );
            let base: serde_json::Map<String, Value> = args
                .iter()
                .filter(|(_, t)| matches!(t, Ty::NonNull(_)))
                .map(|(n, t)| (n.clone(), s.sample(t)))
                .collect();
            for (arg, ty) in &args {
                let mut leaves = Vec::new();
                s.leaves(ty, vec![], &mut leaves);
                for (path, scalar) in leaves {
                    for bad in hostile(&scalar) {
                        let mut vars = Value::Object(base.clone());
                        let mut full = vec![arg.clone()];
                        full.extend(path.iter().cloned());
                        // A list argument gets the value as its one item.
                        let bad = if matches!(ty, Ty::List(_))
                            || matches!(ty, Ty::NonNull(t) if matches!(**t, Ty::List(_)))
                        {
                            if path.is_empty() {
                                json!([bad])
                            } else {
                                let mut item = s.sample(ty)[0].clone();
                                set(&mut item, &path, bad);
                                full.truncate(1);
                                json!([item])
                            }
                        } else {
                            bad
                        };
                        set(&mut vars, &full, bad);
                        let (status, body) = app.graphql(&doc, vars.clone(), Some(&token)).await;
                        tried += 1;
                        let cs = codes(&body);
                        assert!(
                            status == 200 || status == 400,
                            "{doc} {vars}: status {status}"
                        );
                        assert!(
                            !cs.iter().any(|c| c == "INTERNAL" || c == "<none>"),
                            "{doc}\nwith {}: {body}",
                            vars.to_string().chars().take(300).collect::<String>()
                        );
                        for c in cs {
                            *seen.entry(c).or_default() += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(
        tried > 300,
        "the generator reached the schema: {tried} requests"
    );
    assert!(
        seen.get("BAD_USER_INPUT").copied().unwrap_or(0) > 100,
        "most hostile values are refused as the caller's input: {seen:?}"
    );
    eprintln!("{tried} hostile requests; codes seen: {seen:?}");
}

/// The peak resident memory of this process (the server runs in it), in KiB.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[tokio::test]
async fn documents_built_to_explode_are_refused_before_they_cost_anything() {
    let app = spawn_app().await;
    let token = app.operator();
    let before = peak_rss_kib();
    // 1. Nested fragment spreads: 2^40 fields once expanded, in under 2 kB.
    let mut bomb = String::from("query { viewer { ...F0 } }\n");
    for i in 0..40 {
        bomb.push_str(&format!(
            "fragment F{i} on ViewerInfo {{ ...F{n} ...F{n} }}\n",
            n = i + 1
        ));
    }
    bomb.push_str("fragment F40 on ViewerInfo { subject }\n");
    // 2. 5,000 aliases of a connection's totalCount (10,000 would be refused by size).
    let aliases: String = (0..5_000).map(|i| format!("a{i}: totalCount ")).collect();
    let aliased = format!("{{ sites(first: 1) {{ {aliases} }} }}");
    // 3. Duplicate directives: 150 of them, and 100,000 (which no parser sees: 1.9 MB).
    let directives = format!("{{ serverTime {} }}", "@include(if: true) ".repeat(150));
    let huge = format!("{{ serverTime {} }}", "@include(if: true) ".repeat(100_000));
    // 4. pools → site → pools, six deep: millions of objects by the page sizes.
    let deep = "{ pools(first: 100) { edges { node { site { pools(first: 100) { edges { node { site { pools(first: 100) { edges { node { id } } } } } } } } } } } }";
    // 5. A thousand root fields.
    let roots: String = (0..1_000).map(|i| format!("r{i}: serverTime ")).collect();
    let roots = format!("{{ {roots} }}");
    let cases = [
        ("fragment bomb", bomb.as_str(), "selections"),
        ("aliases", aliased.as_str(), "aliases"),
        ("directives", directives.as_str(), "directives"),
        ("100,000 directives", huge.as_str(), "document_bytes"),
        ("nested connections", deep, "cost"),
        ("root fields", roots.as_str(), "root_fields"),
    ];
    for (case, doc, limit) in cases {
        let started = std::time::Instant::now();
        let (status, body) = app.graphql(doc, json!({}), Some(&token)).await;
        let took = started.elapsed();
        assert_eq!(status, 400, "{case}: a request error: {body}");
        let code = if limit == "cost" {
            "QUERY_TOO_COSTLY"
        } else {
            "LIMIT_EXCEEDED"
        };
        assert_eq!(
            body["errors"][0]["extensions"]["code"], code,
            "{case}: {body}"
        );
        assert_eq!(body["errors"][0]["extensions"]["limit"], limit, "{case}");
        assert!(body.get("data").is_none(), "{case}: nothing ran");
        assert!(
            body["errors"].as_array().map_or(0, Vec::len) == 1,
            "{case}: one error, not one per offence"
        );
        eprintln!("{case}: refused in {took:?}");
    }
    let grown = peak_rss_kib().saturating_sub(before);
    eprintln!("peak memory grew by {} MiB", grown / 1024);
    assert!(
        grown < 256 * 1024,
        "refusing them took {} MiB at peak",
        grown / 1024
    );
    let metrics = app.metrics().await;
    for reason in [
        "selections",
        "aliases",
        "directives",
        "document_bytes",
        "cost",
        "root_fields",
    ] {
        assert!(
            metrics.contains(&format!(
                "compute_api_refusals_total{{reason=\"{reason}\"}} 1"
            )),
            "/metrics counts the {reason} refusal"
        );
    }
}

#[tokio::test]
async fn each_request_reports_its_cost_and_an_identity_spends_a_budget() {
    let app = compute_tests::TestApp::builder()
        .limits(Limits {
            budget_per_minute: 120,
            ..Limits::default()
        })
        .start()
        .await;
    let alice = app.member("acme");
    // The bucket refills continuously, 2 points a second at 120 a minute: a remainder may be
    // above the exact figure by what the time since the first request refilled, never below.
    let first = std::time::Instant::now();
    let refilled = |remaining: &Value, exact: u64| {
        let remaining = remaining.as_u64().expect("a remainder");
        let refill = (first.elapsed().as_secs_f64() * 2.0).floor() as u64;
        assert!(
            (exact..=exact + refill).contains(&remaining),
            "remaining {remaining}: {exact} plus at most {refill} refilled"
        );
    };
    // 50 sites by default, one field each: 1 + 50 × 1.
    let q = "{ sites { totalCount } }";
    let (_, body) = app.graphql(q, json!({}), Some(&alice)).await;
    assert_eq!(
        body["extensions"]["cost"],
        json!({ "requested": 51, "limit": 25_000, "remaining": 69 }),
        "{body}"
    );
    let (_, body) = app
        .graphql(
            "{ sites(first: 10) { totalCount } }",
            json!({}),
            Some(&alice),
        )
        .await;
    assert_eq!(
        body["extensions"]["cost"]["requested"], 11,
        "first: 10 costs 11"
    );
    refilled(&body["extensions"]["cost"]["remaining"], 58);
    let (_, body) = app.graphql(q, json!({}), Some(&alice)).await;
    refilled(&body["extensions"]["cost"]["remaining"], 7);
    let (status, body) = app.graphql(q, json!({}), Some(&alice)).await;
    assert_eq!(status, 429, "{body}");
    let e = &body["errors"][0]["extensions"];
    assert_eq!(e["code"], "RATE_LIMITED", "{body}");
    assert_eq!(e["cost"], 51);
    refilled(&e["remaining"], 7);
    assert!(
        e["retryAfterSeconds"].as_u64().is_some_and(|s| s >= 1),
        "{body}"
    );
    // Another identity has a budget of its own; README's first query costs what README says.
    let bob = app.token("bob@acme", Some("acme"), &[Role::Member]);
    let (_, body) = app.graphql(q, json!({}), Some(&bob)).await;
    assert!(body.get("errors").is_none(), "{body}");
    // A document async-graphql refuses costs nothing: the door priced it (41) before validation
    // and gives the points back. Charged, Bob would have 69 - 41 - 11 = 17 left, not 58.
    let (_, body) = app
        .graphql(
            "{ sites(first: 40) { totalCountt } }",
            json!({}),
            Some(&bob),
        )
        .await;
    assert_eq!(
        body["errors"][0]["extensions"]["code"], "GRAPHQL_VALIDATION_FAILED",
        "{body}"
    );
    assert!(body["extensions"].get("cost").is_none(), "{body}");
    let (_, body) = app
        .graphql("{ sites(first: 10) { totalCount } }", json!({}), Some(&bob))
        .await;
    refilled(&body["extensions"]["cost"]["remaining"], 58);
    let readme = "{ sites(first: 5) { edges { node { name pools(first: 5) { edges { node { name kind \
        capacity { model kind profile total free } \
        computeNodes(first: 10) { edges { node { hostname devices { model mode atoms { name } } } } } } } } } } } }";
    let carol = app.token("carol@ops", None, &[Role::Operator]);
    let (status, body) = app.graphql(readme, json!({}), Some(&carol)).await;
    assert_eq!(status, 429, "over a budget of 120: {body}");
    assert_eq!(body["errors"][0]["extensions"]["cost"], 23_296, "{body}");
}

#[tokio::test]
async fn anonymous_callers_get_introspection_and_nothing_expensive() {
    let app = spawn_app().await;
    let (status, body) = app.graphql(INTROSPECT, json!({}), None).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body["data"]["__schema"]["types"]
            .as_array()
            .is_some_and(|t| t.len() > 20)
    );
    let cost = body["extensions"]["cost"]["requested"]
        .as_u64()
        .expect("a cost");
    eprintln!("the introspection query costs {cost}");
    assert!(cost < 1_000, "{cost}");
    let (status, body) = app
        .graphql(
            "{ sites(first: 100) { edges { node { pools(first: 100) { totalCount } } } } }",
            json!({}),
            None,
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["errors"][0]["extensions"]["code"], "QUERY_TOO_COSTLY");
    assert_eq!(body["errors"][0]["extensions"]["max"], 1_000);
}

#[tokio::test]
async fn a_request_past_its_deadline_stops_and_keeps_nothing() {
    // The site row is locked by someone else; a createPool on it waits for the lock longer than
    // the request may run. The request ends with TIMEOUT, and once the lock is released no pool
    // appears: the transaction was dropped with the request.
    let app = compute_tests::TestApp::builder()
        .limits(Limits {
            request_timeout: Duration::from_millis(700),
            ..Limits::default()
        })
        .start()
        .await;
    let op = app.operator();
    let site = app
        .ok(
            &op,
            crate::fleet::CREATE_SITE,
            json!({ "i": { "name": "slow" } }),
        )
        .await["createSite"]["site"]["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let mut holder = app.db.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM sites WHERE id = $1 FOR UPDATE")
        .bind(&site)
        .execute(&mut *holder)
        .await
        .expect("lock the site");
    let (status, body) = app
        .graphql(
            crate::fleet::CREATE_POOL,
            json!({ "i": { "siteId": site, "name": "p", "kind": "BARE_METAL" } }),
            Some(&op),
        )
        .await;
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["errors"][0]["extensions"]["code"], "TIMEOUT", "{body}");
    holder.rollback().await.expect("release");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.count("pools").await,
        0,
        "nothing of the request was kept"
    );
    assert_eq!(app.count("outbox").await, 1, "only the site's event");
}

#[tokio::test]
async fn the_event_filter_is_bounded_and_checked() {
    let app = spawn_app().await;
    let token = app.member("acme");
    let many: Vec<String> = (0..101).map(|i| format!("rsv_{i:032x}")).collect();
    // 50,000 subjects (1.9 MiB): refused at the door, before any resolver or stream starts.
    let flood: Vec<String> = (0..50_000).map(|i| format!("rsv_{i:032x}")).collect();
    for (case, variables, expect) in [
        (
            "101 subjects",
            json!({ "s": many, "t": [] }),
            "`subjects` holds 101 items; a list in an argument holds at most 100",
        ),
        (
            "50,000 subjects",
            json!({ "s": flood, "t": [] }),
            "`subjects` holds 50000 items",
        ),
        (
            "a subject that is no id",
            json!({ "s": ["x".repeat(10_000)], "t": [] }),
            "is not an id of this API",
        ),
        (
            "a type that is no event type",
            json!({ "s": [], "t": ["Not A Type"] }),
            "",
        ),
    ] {
        let res = app
            .http
            .post(app.url("/graphql/stream"))
            .header("Accept", "text/event-stream")
            .bearer_auth(&token)
            .json(&json!({
                "query": "subscription($s: [String!], $t: [String!]) { events(subjects: $s, types: $t) { id } }",
                "variables": variables,
            }))
            .send()
            .await
            .expect("POST");
        let text = res.text().await.expect("events");
        assert!(text.contains("BAD_USER_INPUT"), "{case}: {text}");
        assert!(text.contains(expect), "{case}: {text}");
        assert!(
            text.len() < 2_000,
            "{case}: the error does not echo the input"
        );
    }
}

/// Every list in an argument is bounded at the door (100 items), whatever the field, however
/// deep in an input object, written in the document or sent in the variables; nothing runs and
/// nothing is written. A list within the bound costs one point per item.
#[tokio::test]
async fn every_list_argument_is_bounded_and_counts_in_the_cost() {
    let app = spawn_app().await;
    let ops = app.operator();
    let ids = |n: usize| -> Vec<String> { (0..n).map(|i| format!("node_{i:032x}")).collect() };
    let gpu = |i: usize| json!({ "uuid": format!("GPU-{i}"), "model": "H100", "memoryMib": 81559 });
    let site = app
        .ok(
            &ops,
            "mutation { createSite(input: { name: \"s\" }) { site { id } } }",
            json!({}),
        )
        .await["createSite"]["site"]["id"]
        .clone();
    let pool = app
        .ok(
            &ops,
            "mutation($i: CreatePoolInput!) { createPool(input: $i) { pool { id } } }",
            json!({ "i": { "siteId": site, "name": "p", "kind": "BARE_METAL" } }),
        )
        .await["createPool"]["pool"]["id"]
        .clone();
    let register =
        "mutation($i: RegisterNodeInput!) { registerNode(input: $i) { computeNode { id } } }";
    let node = |devices: Vec<Value>| {
        json!({ "i": { "poolId": pool, "hostname": "n1",
            "resources": { "vcpu": 8, "memoryMib": 65536, "diskGib": 100 }, "devices": devices } })
    };
    let literal_ids = format!(
        "{{ nodes(ids: [{}]) {{ id }} }}",
        ids(101)
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (case, query, variables, field) in [
        (
            "a query's ids, in the variables",
            "query($ids: [ID!]!) { nodes(ids: $ids) { id } }".to_owned(),
            json!({ "ids": ids(101) }),
            "ids",
        ),
        (
            "a query's ids, written in the document",
            literal_ids,
            json!({}),
            "ids",
        ),
        (
            "a list deep in a mutation's input",
            register.to_owned(),
            node((0..101).map(gpu).collect()),
            "devices",
        ),
    ] {
        let (status, body) = app.graphql(&query, variables, Some(&ops)).await;
        assert_eq!(status, 400, "{case}: {body}");
        let e = &body["errors"][0];
        assert_eq!(e["extensions"]["code"], "BAD_USER_INPUT", "{case}: {body}");
        assert_eq!(e["extensions"]["limit"], "list_items", "{case}: {body}");
        assert_eq!(e["extensions"]["field"], field, "{case}: {body}");
        assert_eq!(e["extensions"]["max"], 100, "{case}: {body}");
        assert!(body.get("data").is_none(), "{case}: {body}");
    }
    assert_eq!(
        app.count("nodes").await,
        0,
        "a refused registration wrote nothing"
    );
    // Within the bound, each item costs a point as input, on top of what the list selects
    // where it sets a result's length: `nodes` costs 1, each of 100 ids selects one `id` (100)
    // and is an item of input (100).
    let q = "query($ids: [ID!]!) { nodes(ids: $ids) { id } }";
    let (_, hundred) = app.graphql(q, json!({ "ids": ids(100) }), Some(&ops)).await;
    assert!(hundred.get("errors").is_none(), "{hundred}");
    assert_eq!(hundred["extensions"]["cost"]["requested"], 201, "{hundred}");
    // And a registration of 8 GPUs is taken: the bound is per list, not a total.
    let body = app
        .ok(&ops, register, node((0..8).map(gpu).collect()))
        .await;
    assert!(
        body["registerNode"]["computeNode"]["id"].is_string(),
        "{body}"
    );
    // The refusals are counted by reason.
    let metrics = app.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("reason=\"list_items\"") && !l.ends_with(" 0")),
        "list_items refusals counted"
    );
}

/// Reads from `stream` until the peer closes it; `true` if it did within `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn a_body_sent_slowly_is_cut_at_the_request_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = compute_tests::TestApp::builder()
        .limits(Limits {
            request_timeout: Duration::from_secs(2),
            ..Limits::default()
        })
        .start()
        .await;
    let token = app.member("acme");
    for path in ["/graphql", "/graphql/stream"] {
        // Headers at once, then a byte of the body every 300 ms: the request never completes.
        let mut slow = tokio::net::TcpStream::connect(app.addr)
            .await
            .expect("connect");
        let started = std::time::Instant::now();
        slow.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
                 Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n\
                 Content-Length: 1000\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .expect("headers");
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            tokio::select! {
                read = slow.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => answer.extend_from_slice(&buf[..n]),
                },
                () = tokio::time::sleep(Duration::from_millis(300)) => {
                    if slow.write_all(b" ").await.is_err() {
                        break;
                    }
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(8),
                "{path}: still open after 8 s: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        let elapsed = started.elapsed();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{path}: {answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{path}: {answer}"
        );
        assert!(answer.contains("TIMEOUT"), "{path}: {answer}");
        assert!(
            elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(4),
            "{path}: cut after {elapsed:?}, the deadline is 2 s"
        );
    }
    // The server serves the next caller as ever.
    let (status, body) = app.graphql("{ serverTime }", json!({}), Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    let metrics = app.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("reason=\"body_timeout\"") && l.ends_with(" 2")),
        "both counted"
    );
}

#[tokio::test]
async fn connections_and_streams_are_bounded() {
    use tokio::io::AsyncWriteExt;
    let app = compute_tests::TestApp::builder()
        .limits(Limits {
            header_timeout: Duration::from_millis(500),
            max_streams_per_identity: 2,
            max_ws_message: 64 * 1024,
            ..Limits::default()
        })
        .start()
        .await;
    // A slowloris client that never finishes its headers is cut off.
    let mut slow = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    assert!(
        closed_within(&mut slow, Duration::from_secs(10)).await,
        "a connection that never finishes its headers is closed"
    );
    // An SSE POST must be JSON.
    let res = app
        .http
        .post(app.url("/graphql/stream"))
        .header("Accept", "text/event-stream")
        .header("Content-Type", "text/plain")
        .body(r#"{"query":"{ serverTime }"}"#)
        .send()
        .await
        .expect("POST");
    assert_eq!(res.status().as_u16(), 415);
    // An identity holds at most two streams.
    let token = app.member("acme");
    let open = || {
        app.http
            .post(app.url("/graphql/stream"))
            .header("Accept", "text/event-stream")
            .bearer_auth(&token)
            .json(&json!({ "query": "subscription { events { id } }" }))
            .send()
    };
    let a = open().await.expect("first");
    let b = open().await.expect("second");
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let c = open().await.expect("third");
    assert_eq!(c.status().as_u16(), 429);
    assert!(c.text().await.expect("body").contains("RATE_LIMITED"));
    // A usage export is a stream too: it takes a place, and gets none while both are held.
    let export = app
        .http
        .get(app.url("/usage.csv?from=2031-01-01T00:00:00Z&to=2031-01-02T00:00:00Z"))
        .bearer_auth(&token)
        .send()
        .await
        .expect("GET");
    assert_eq!(export.status().as_u16(), 429);
    assert!(export.text().await.expect("body").contains("RATE_LIMITED"));
    drop(a);
    compute_tests::eventually(
        "a closed stream frees its place",
        Duration::from_secs(10),
        || async { open().await.ok().filter(|r| r.status().as_u16() == 200) },
    )
    .await;
    drop(b);
    // A WebSocket without a token is refused at connection_init; a huge message is refused.
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let ws = || async {
        let mut req = format!("ws://{}/graphql", app.addr)
            .into_client_request()
            .expect("request");
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "graphql-transport-ws".parse().expect("header"),
        );
        tokio_tungstenite::connect_async(req)
            .await
            .expect("upgrade")
            .0
    };
    let close_of = |s: tokio_tungstenite::WebSocketStream<_>| async move {
        close_frame_of(s).await.map(|(code, _)| code)
    };
    let mut anon = ws().await;
    anon.send(Message::Text(
        json!({ "type": "connection_init" }).to_string().into(),
    ))
    .await
    .expect("send");
    assert_eq!(close_of(anon).await, Some(4403));
    // A WebSocket past the identity's streams is closed with 1013 (Try Again Later), which
    // graphql-ws's client retries; 4429 (its "too many initialisation requests") it never does.
    let (a, b) = (open().await.expect("first"), open().await.expect("second"));
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let mut third = ws().await;
    third
        .send(Message::Text(
            json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
                .to_string()
                .into(),
        ))
        .await
        .expect("init");
    let (code, reason) = close_frame_of(third).await.expect("a close frame");
    assert_eq!(code, 1013, "{reason}");
    assert!(reason.contains("at most 2"), "{reason}");
    drop((a, b));
    // An oversized message is refused with 1009 and a reason, not a dropped connection (1006),
    // whatever it is: a 1 MiB text, a 10 MB `connection_init`, a 1.9 MiB `subscribe` of 50,000
    // subjects after an accepted init. The client writes while it reads, as clients do.
    let init = json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {}", app.member("acme")), "pad": "x".repeat(10_000_000) } });
    let subjects: Vec<String> = (0..50_000).map(|i| format!("rsv_{i:032x}")).collect();
    let subscribe = json!({ "id": "1", "type": "subscribe", "payload": {
        "query": "subscription($s: [String!]) { events(subjects: $s) { id } }", "variables": { "s": subjects } } });
    let token = app.member("acme");
    for (case, after_init, message) in [
        ("a 1 MiB message", false, "x".repeat(1024 * 1024)),
        ("a 10 MB connection_init", false, init.to_string()),
        ("a 1.9 MiB subscribe", true, subscribe.to_string()),
    ] {
        let mut s = ws().await;
        if after_init {
            s.send(Message::Text(
                json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })
                    .to_string()
                    .into(),
            ))
            .await
            .expect("init");
            match s.next().await {
                Some(Ok(Message::Text(t))) => assert!(t.contains("connection_ack"), "{t}"),
                other => panic!("{case}: no ack: {other:?}"),
            }
        }
        let (mut tx, rx) = s.split();
        let writer = tokio::spawn(async move {
            let _ = tx.send(Message::Text(message.into())).await;
        });
        let frame = close_frame_of(rx).await;
        writer.abort();
        let (code, reason) =
            frame.unwrap_or_else(|| panic!("{case}: dropped without a close frame"));
        assert_eq!(code, 1009, "{case}: {reason}");
        assert!(reason.contains("at most 65536 bytes"), "{case}: {reason}");
    }
    let metrics = app.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("reason=\"ws_message_bytes\"") && l.ends_with(" 3")),
        "three oversized messages counted: {}",
        metrics
            .lines()
            .filter(|l| l.contains("refusals"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The close frame a WebSocket ends with: its code and reason, or `None` when it ended without
/// one (a reset, an abrupt end).
async fn close_frame_of<S, E>(mut s: S) -> Option<(u16, String)>
where
    S: futures_util::Stream<Item = Result<tokio_tungstenite::tungstenite::Message, E>> + Unpin,
{
    use futures_util::StreamExt;
    use tokio_tungstenite::tungstenite::Message;
    loop {
        match s.next().await {
            Some(Ok(Message::Close(f))) => {
                return f.map(|f| (u16::from(f.code), f.reason.to_string()));
            }
            Some(Ok(_)) => continue,
            _ => return None,
        }
    }
}

#[tokio::test]
async fn tokens_valid_for_years_and_odd_subjects_are_refused() {
    let app = spawn_app().await;
    let long = compute_tests::mint(compute_tests::claims(
        "alice",
        Some("acme"),
        &[Role::Member],
        10 * 365 * 86_400,
    ));
    let (status, body) = app
        .graphql("{ viewer { subject } }", json!({}), Some(&long))
        .await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("longer than this server accepts")),
        "{body}"
    );
    let odd = compute_tests::mint(compute_tests::claims(
        "al\u{0}ice",
        Some("acme"),
        &[Role::Member],
        600,
    ));
    let (status, _) = app
        .graphql("{ viewer { subject } }", json!({}), Some(&odd))
        .await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn the_runtime_role_runs_the_api_but_cannot_change_the_schema() {
    // The owner migrates and grants; the API runs as a role that reads and writes rows only.
    let owner = compute_tests::test_db().await;
    let role = format!("rt_{}_{}", std::process::id(), rand_suffix());
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN PASSWORD 'runtime-pw'"))
        .execute(owner.db.pool())
        .await
        .expect("create the role (the embedded superuser may)");
    owner.db.grant_runtime(&role).await.expect("grant");
    // On the server itself: a pooler in front knows only the users of its own list.
    let (scheme_user, rest) = owner.direct_url.split_once('@').expect("user@host");
    let scheme = scheme_user.split("//").next().expect("scheme");
    let url = format!("{scheme}//{role}:runtime-pw@{rest}");
    // Simulated time is a test harness's switch (it redefines compute_now()): the owner's.
    owner.use_sim_clock("2031-01-01T00:00:00Z").await;
    let runtime = compute_tests::test_db_at(&url, &owner.name, false).await;
    let app = compute_tests::TestApp::builder().on(runtime).start().await;

    // The whole path of a reservation works as the runtime role.
    let p = crate::reservations::pool(&app).await;
    let member = app.member("acme");
    let d = app
        .ok(
            &member,
            crate::reservations::CREATE,
            crate::reservations::input(&p.pool, "rt", json!([{ "gpuCount": 1 }])),
        )
        .await;
    assert_eq!(
        d["createReservation"]["reservation"]["state"], "ACTIVE",
        "{d}"
    );
    let (status, ready) = {
        let res = app
            .http
            .get(app.url("/readyz"))
            .send()
            .await
            .expect("readyz");
        (res.status().as_u16(), res.text().await.unwrap_or_default())
    };
    assert_eq!(
        status, 200,
        "the runtime role reads the migrations' table: {ready}"
    );

    // Nothing that changes the schema, the migrations or whole tables.
    for statement in [
        "CREATE TABLE intruder (a int)",
        "DROP TABLE reservations",
        "ALTER TABLE reservations ADD COLUMN x int",
        "TRUNCATE outbox",
        "DELETE FROM _sqlx_migrations",
        "CREATE FUNCTION evil() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    ] {
        let e = sqlx::raw_sql(statement)
            .execute(app.db.db.pool())
            .await
            .expect_err(statement);
        let code = e
            .as_database_error()
            .and_then(|d| d.code())
            .map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{statement}: {e}");
    }
}

/// A suffix that keeps role names of concurrent test runs apart.
fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Values a check at the door let through to a database check (an `INTERNAL` error) or past
/// every check (an effect nobody wanted): each is now refused where it enters, with the field
/// it is about, and nothing is written.
#[tokio::test]
async fn values_only_the_database_refused_are_refused_where_they_enter() {
    let app = spawn_app().await;
    app.db.use_sim_clock("2031-01-01T00:00:00Z").await;
    let p = crate::reservations::pool(&app).await;
    let (op, member) = (app.operator(), app.member("acme"));
    let field_of = |e: &Value| {
        e["extensions"]["field"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    // A reservation that starts now (no `startsAt`) and ends 400 days later: it held GPUs and
    // quota for as long as `endsAt` said. 365 days is a reservation.
    let create = "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id } } }";
    let long = |key: &str, ends: &str| json!({ "i": { "poolId": p.pool, "endsAt": ends, "idempotencyKey": key, "allocations": [{ "gpuCount": 1 }] } });
    let (code, error) = app
        .fails(&member, create, long("long", "2032-02-05T00:00:00Z"))
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "endsAt"),
        "{error}"
    );
    assert!(
        error["message"]
            .as_str()
            .unwrap_or_default()
            .contains("366 days"),
        "{error}"
    );
    assert_eq!(app.count("reservations").await, 0);
    assert_eq!(app.count("idempotency_keys").await, 0, "no key kept");
    let placed = app.ok(&member, "mutation($i: CreateReservationInput!) { createReservation(input: $i) { reservation { id allocations { id } } } }", long("year", "2031-12-31T00:00:00Z"))
        .await;
    assert_eq!(app.count("reservations").await, 1);

    // A pool's `lostAfterSeconds` past PostgreSQL's interval (it wrapped to a negative one).
    let (code, error) = app
        .fails(
            &op,
            crate::fleet::CREATE_POOL,
            json!({ "i": { "siteId": p.site, "name": "far", "kind": "PROVIDER", "lostAfterSeconds": 10_000_000_000_000_i64 } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "lostAfterSeconds"),
        "{error}"
    );

    // A GPU vendor of 60 characters (the column holds 50).
    let (code, error) = app
        .fails(
            &op,
            crate::fleet::REGISTER,
            json!({ "i": { "poolId": p.pool, "hostname": "vendor-node", "resources": { "vcpu": 8, "memoryMib": 65536, "diskGib": 100 },
                "devices": [{ "uuid": "GPU-vendor-0", "vendor": "v".repeat(60), "model": "H100", "memoryMib": 81559 }] } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "devices[0].vendor"),
        "{error}"
    );

    // Command arguments of 16,301 bytes as compact JSON and 16,500 as PostgreSQL prints them:
    // the database's check measures the latter.
    let args: serde_json::Map<String, Value> = (0..100)
        .map(|i| (format!("k{i:02}"), Value::String("x".repeat(154))))
        .collect();
    let commands = app.count("commands").await;
    // And 60 numbers of 6 characters each that PostgreSQL prints with 325 digits.
    let tiny: Vec<Value> = (0..60).map(|_| json!(1e-323)).collect();
    for (case, args) in [
        ("16,500 bytes", Value::Object(args)),
        ("numbers in full", json!({ "a": tiny })),
    ] {
        let (code, error) = app
            .fails(
                &op,
                "mutation($i: RunCommandInput!) { runCommand(input: $i) { command { id } } }",
                json!({ "i": { "computeNodeId": p.nodes[0], "kind": "NOOP", "args": args, "idempotencyKey": format!("args-{case}") } }),
            )
            .await;
        assert_eq!(
            (code.as_str(), field_of(&error).as_str()),
            ("BAD_USER_INPUT", "args"),
            "{case}: {error}"
        );
    }
    assert_eq!(app.count("commands").await, commands);

    // An instance whose command fits argument by argument but not in its run command.
    let (code, error) = app
        .fails(
            &member,
            "mutation($i: CreateInstanceInput!) { createInstance(input: $i) { instance { id } } }",
            json!({ "i": { "allocationId": placed["createReservation"]["reservation"]["allocations"][0]["id"], "image": "busybox",
                "idempotencyKey": "long-command", "command": vec!["y".repeat(4000); 5] } }),
        )
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "command"),
        "{error}"
    );
    assert_eq!(app.count("instances").await, 0);

    // A usage page cursor made by hand (offset -4), and a range before the year 1970.
    let groups = "query($a: String, $f: DateTime!, $t: DateTime!) { usage(from: $f, to: $t) { groups(first: 1, after: $a) { edges { cursor } } } }";
    let (code, error) = app
        .fails(
            &op,
            groups,
            json!({ "a": compute_domain::page::encode_cursor("-5"), "f": "2031-01-01T00:00:00Z", "t": "2031-01-02T00:00:00Z" }),
        )
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "after"),
        "{error}"
    );
    let (code, error) = app
        .fails(
            &op,
            groups,
            json!({ "a": null, "f": "-5000-01-01T00:00:00Z", "t": "-5000-02-01T00:00:00Z" }),
        )
        .await;
    assert_eq!(
        (code.as_str(), field_of(&error).as_str()),
        ("BAD_USER_INPUT", "from"),
        "{error}"
    );

    // An event cursor past every event this database can hold: the stream waited for ever.
    let ahead = compute_domain::outbox::Cursor {
        txid: i64::MAX / 2,
        seq: 0,
    }
    .encode();
    let res = app
        .http
        .post(app.url("/graphql/stream"))
        .header("Accept", "text/event-stream")
        .bearer_auth(&member)
        .json(&json!({
            "query": "subscription($a: String) { events(after: $a) { id } }",
            "variables": { "a": ahead },
        }))
        .send()
        .await
        .expect("POST");
    let text = tokio::time::timeout(Duration::from_secs(10), res.text())
        .await
        .expect("the stream ends with its error")
        .expect("body");
    assert!(
        text.contains("BAD_USER_INPUT") && text.contains("ahead of every event"),
        "{text}"
    );
}

/// Values, selections and types nested tens of thousands deep (each fits in the 128 KiB a
/// document may have, and needs no token) are refused with a coded error; the process that
/// parsed them serves the next request (a recursion without a bound would overflow its stack
/// and abort it, and every request with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_nested_deeper_than_any_stack_are_refused_and_the_server_lives() {
    let app = spawn_app().await;
    for depth in [1_000usize, 10_000, 60_000] {
        let list = format!(
            "{{ serverTime(x: {}1{}) }}",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        let object = format!(
            "{{ serverTime(x: {}1{}) }}",
            "{a: ".repeat(depth.min(25_000)),
            "}".repeat(depth.min(25_000))
        );
        let selection = format!(
            "{{ {}serverTime{} }}",
            "a { ".repeat(depth.min(30_000)),
            " }".repeat(depth.min(30_000))
        );
        let types = format!(
            "query($v: {}Int{}) {{ serverTime }}",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        for (case, doc) in [
            ("list", &list),
            ("object", &object),
            ("selection", &selection),
            ("type", &types),
        ] {
            let (status, body) = app.graphql(doc, json!({}), None).await;
            assert_eq!(status, 400, "{case} {depth}: {body}");
            let code = body["errors"][0]["extensions"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(
                [
                    "LIMIT_EXCEEDED",
                    "GRAPHQL_PARSE_FAILED",
                    "GRAPHQL_VALIDATION_FAILED"
                ]
                .contains(&code.as_str()),
                "{case} {depth}: {body}"
            );
            let (status, body) = app.graphql("{ serverTime }", json!({}), None).await;
            assert_eq!(status, 200, "served after {case} {depth}: {body}");
        }
    }
}

/// A body whose chunked encoding breaks off is a bad request (`400`, `BAD_REQUEST`, the
/// connection closed), not "larger than 2 MiB" (`413`, which any error of the read was).
#[tokio::test]
async fn a_malformed_chunked_body_is_a_bad_request_not_a_large_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = spawn_app().await;
    let token = app.member("acme");
    let mut s = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    s.write_all(
        format!(
            "POST /graphql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n\
             5\r\n{{\"que\r\nzz\r\n"
        )
        .as_bytes(),
    )
    .await
    .expect("request");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("BAD_REQUEST"), "{answer}");
    assert!(!answer.contains("larger than"), "{answer}");
}

/// The `connections` refusal counts a connection that waits for a slot, not the last slot
/// taken: with two slots, a stream holding one and the request for `/metrics` the other, no
/// connection waited (it counted one). A third connection then waits, is counted, and is served
/// once a slot is free.
#[tokio::test]
async fn a_connection_is_counted_when_it_waits_for_a_slot_not_when_the_last_is_taken() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let app = compute_tests::TestApp::builder()
        .limits(Limits {
            max_connections: 2,
            header_timeout: Duration::from_secs(1),
            ..Limits::default()
        })
        .start()
        .await;
    // Any idle keep-alive connection of the test's own HTTP client is closed by now.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let token = app.member("acme");
    let stream = reqwest::Client::new()
        .post(app.url("/graphql/stream"))
        .header("Accept", "text/event-stream")
        .bearer_auth(&token)
        .json(&json!({ "query": "subscription { events { id } }" }))
        .send()
        .await
        .expect("a stream");
    assert_eq!(stream.status().as_u16(), 200);
    let refused = |metrics: &str| {
        metrics
            .lines()
            .find(|l| l.contains("reason=\"connections\""))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let metrics = reqwest::Client::new()
        .get(app.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body");
    assert_eq!(refused(&metrics), 0, "nobody waited");
    // Both slots held (the stream, and a connection kept open): a third waits.
    let mut held = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    held.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut third = tokio::net::TcpStream::connect(app.addr)
        .await
        .expect("connect");
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    drop(stream);
    drop(held);
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), third.read_to_end(&mut answer)).await;
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
        "served once a slot was free"
    );
    let metrics = app.metrics().await;
    // (The connection held open may have waited too, for the slot of the first `/metrics`
    // request's client until its server side closed.)
    assert!(refused(&metrics) >= 1, "the one that waited is counted");
}
