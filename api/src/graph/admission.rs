//! The door of the GraphQL entry: every request, on every transport, passes here before
//! async-graphql validates it, and its response passes here on the way out. It is not an
//! async-graphql extension: with any extension installed, async-graphql sends every field of
//! every response through its slow path (a registry lookup and a boxed future per field, two
//! formatted type names per list item), which cost a fleet page of 2,000 objects a tenth of its
//! time. The transports call it: [`AdmissionControl::admit`] before execution, [`AdmissionControl::within_deadline`]
//! around it, [`AdmissionControl::finish`] (or [`AdmissionControl::settle`] for a stream) after it.
//!
//! - **Document bounds**, checked on the parsed document before validation walks it: root
//!   fields, aliases, directives and field selections, counted with fragments expanded (each
//!   fragment's size is computed once, so a document of nested spreads is measured in linear
//!   time and refused before anything expands it).
//! - **No NUL in any string**: PostgreSQL cannot store U+0000, so a string holding one is the
//!   caller's error wherever it appears (an argument, a default, a variable), never a failed
//!   statement.
//! - **Lists**: no list in an argument's value (nested in an input object too, written in the
//!   document or sent in the variables) holds more than [`Limits::max_list_items`]; each item
//!   costs a point.
//! - **Variables the schema refuses** are the caller's input: such an error is coded
//!   `BAD_USER_INPUT` ([`AdmissionControl::settle`]), a bad literal `GRAPHQL_VALIDATION_FAILED`.
//! - **Cost** ([`crate::graph::cost`]): a connection costs its page size times its children and
//!   bounded lists their bound times their children; a request costs at most
//!   [`Limits::max_cost`] (anonymous callers far less), and each identity spends from a budget
//!   refilled per minute. A request async-graphql then refuses (it does not validate) is
//!   refunded: a refused request costs nothing. The response's `extensions.cost` says what the
//!   request cost and what is left.
//! - **Errors** per response are capped; **time** per query or mutation is bounded (the
//!   execution is dropped, and with it its transaction, which rolls back).
//!
//! Every refusal has a stable code (`LIMIT_EXCEEDED`, `QUERY_TOO_COSTLY`, `RATE_LIMITED`, `BAD_USER_INPUT`,
//! `TIMEOUT`) and is counted by reason.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_graphql::parser::types::{
    Directive, DocumentOperations, ExecutableDocument, FragmentDefinition, Selection, SelectionSet,
};
use async_graphql::{Name, Positioned, Response, ServerError, ServerResult};

use crate::auth::Viewer;
use crate::codes::{Limit, TransportCode};
use crate::graph::cost::CostModel;
use crate::graph::parse_cache::ParseCache;
use crate::limits::Limits;

/// `extensions.code` of a request over a published limit (document bounds, cost).
pub const LIMIT_EXCEEDED: &str = TransportCode::LimitExceeded.as_str();
/// `extensions.code` of a request whose cost is over the per-request maximum (the name the
/// design's contract gives it).
pub const QUERY_TOO_COSTLY: &str = TransportCode::QueryTooCostly.as_str();
/// `extensions.code` of a query or mutation stopped at its deadline.
pub const TIMEOUT: &str = TransportCode::Timeout.as_str();

/// The peer address of the connection a request came on, when the transport knows it: the
/// budget key of anonymous callers.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub IpAddr);

/// Who a caller is for budgets and stream caps: the token's subject, or for a caller without
/// a token its peer address.
pub fn identity_key(viewer: Option<&Viewer>, peer: Option<Peer>) -> String {
    match (viewer, peer) {
        // Pushed, not formatted: this runs for every request with a token.
        (Some(v), _) => {
            let mut key = String::with_capacity(4 + v.subject.len());
            key.push_str("sub:");
            key.push_str(&v.subject);
            key
        }
        // An IPv6 caller by its /64 (a host is given a whole /64: one address each would be
        // a budget per address, and an attacker has 2^64 of them).
        (None, Some(Peer(IpAddr::V6(ip)))) if ip.to_ipv4_mapped().is_none() => {
            let s = ip.segments();
            format!("anon:{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
        }
        (None, Some(Peer(ip))) => format!("anon:{ip}"),
        (None, None) => "anon".to_owned(),
    }
}

/// Reports a refusal by reason (the metrics' `compute_api_refusals_total` counter).
pub type OnRefusal = Arc<dyn Fn(&'static str) + Send + Sync>;

/// The door: one per server, shared by every request.
#[derive(Clone)]
pub struct AdmissionControl {
    limits: Arc<Limits>,
    budgets: Arc<Budgets>,
    costs: Arc<CostModel>,
    documents: Arc<ParseCache>,
    on_refusal: OnRefusal,
}

impl AdmissionControl {
    /// A door enforcing `limits` with the cost model of the schema (`CostModel::from_sdl` of
    /// its SDL), reporting each refusal's reason to `on_refusal`.
    pub fn new(limits: Limits, costs: CostModel, on_refusal: OnRefusal) -> AdmissionControl {
        AdmissionControl {
            limits: Arc::new(limits),
            budgets: Arc::new(Budgets::default()),
            costs: Arc::new(costs),
            documents: Arc::new(ParseCache::default()),
            on_refusal,
        }
    }

    /// Parses `request`'s document into it, once, before anything reads it: one within
    /// [`Limits::max_document_bytes`] (a longer one is refused before any parsing), from the
    /// parsed documents seen lately ([`ParseCache`]) when it was among them. Every transport
    /// calls it first; [`AdmissionControl::admit`] then finds the document parsed.
    pub fn parse(&self, request: &mut async_graphql::Request) -> ServerResult<()> {
        if let Some(e) = oversized(&self.limits, &request.query) {
            (self.on_refusal)("document_bytes");
            return Err(e);
        }
        let document = self.documents.parse(&request.query)?;
        request.set_parsed_query(document);
        Ok(())
    }

    /// The parsed documents it keeps.
    pub fn documents(&self) -> &ParseCache {
        &self.documents
    }

    /// The limits it enforces.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    fn refuse(&self, limit: Limit, message: String, extra: &[(&str, u64)]) -> ServerError {
        (self.on_refusal)(limit.as_str());
        refusal(limit, message, extra)
    }

    /// Lets `request` in, or says why not (a coded request error, nothing charged): no NUL in
    /// its variables, its document within the bounds (parsed once, by [`AdmissionControl::parse`], which
    /// the transports call first, or here when none did, and handed on to async-graphql
    /// parsed), reduced to the operation it names, and its cost within the caller's limit and
    /// budget, which it is charged.
    pub fn admit(
        &self,
        request: &mut async_graphql::Request,
        viewer: Option<&Viewer>,
        peer: Option<Peer>,
    ) -> ServerResult<Admission> {
        if variables_hold_nul(&request.variables) {
            return Err(self.refuse(
                Limit::NulCharacter,
                "a variable holds the NUL character (U+0000), which no string may contain".into(),
                &[],
            ));
        }
        if let Some(e) = oversized(&self.limits, &request.query) {
            (self.on_refusal)("document_bytes");
            return Err(e);
        }
        // Parsed here, once, so the bounds are checked before async-graphql's own walks (depth,
        // directives, validation) expand any fragment; the parsed document is handed on.
        let name = request.operation_name.clone();
        let doc = request.parsed_query()?;
        self.check_document(doc)?;
        // A document of several operations runs the one `operationName` names; only that one
        // (and the fragments it reaches) is validated and costed, so the variables of the
        // others need no values. GraphiQL sends the whole editor, and generated clients
        // (graphql_client) a whole file, with the name of one operation.
        if let Some(selected) = selected_operation(doc, name.as_deref()) {
            request.set_parsed_query(selected);
        }
        let variables = std::mem::take(&mut request.variables);
        let mut variable_arguments = Vec::new();
        let mut lists = Lists {
            variables: &variables,
            max: self.limits.max_list_items,
            items: 0,
            too_long: None,
        };
        let cost = request.parsed_query().map(|doc| {
            each_argument(doc, &mut |name, value| {
                if holds_variable(&value.node) {
                    variable_arguments.push(name.pos);
                }
                // `input` is every mutation's one argument: its fields are named as the
                // resolvers name them (`devices`, not `input.devices`).
                let mut path = match name.node.as_str() {
                    "input" => String::new(),
                    other => other.to_owned(),
                };
                lists.value(&value.node, &mut path);
            });
            for (_, op) in doc.operations.iter() {
                for d in &op.node.variable_definitions {
                    if let Some(default) = &d.node.default_value {
                        lists.constant(&default.node, &mut d.node.name.node.to_string());
                    }
                }
            }
            self.costs.cost(doc, &variables)
        });
        let (list_items, too_long) = (lists.items, lists.too_long);
        request.variables = variables;
        if let Some((field, len)) = too_long {
            let max = self.limits.max_list_items;
            let mut e = self.refuse(
                Limit::ListItems,
                format!("`{field}` holds {len} items; a list in an argument holds at most {max}"),
                &[("max", max as u64)],
            );
            e.extensions
                .get_or_insert_with(Default::default)
                .set("field", field);
            return Err(e);
        }
        // A page size that is not an Int: a request error; the caller's input (`BAD_USER_INPUT`)
        // when a variable gave it, otherwise coded by the transport as any document
        // async-graphql does not validate.
        let cost = cost?.map_err(|(message, at)| {
            let mut e = ServerError::new(message, Some(at));
            if variable_arguments.contains(&at) {
                bad_user_input(&mut e);
            }
            e
        })?;
        // Each item of a list in an argument costs a point: a resolver does work per item.
        let cost = cost.saturating_add(list_items);
        let limits = &self.limits;
        let key = identity_key(viewer, peer);
        let (limit, budget) = match viewer {
            Some(_) => (limits.max_cost, limits.budget_per_minute),
            None => (
                limits.anonymous_max_cost,
                limits.anonymous_budget_per_minute,
            ),
        };
        if cost > limit {
            let who = if viewer.is_some() {
                ""
            } else {
                " without a token"
            };
            return Err(self.refuse(
                Limit::Cost,
                format!(
                    "this request costs {cost} points; a request{who} may cost at most {limit} \
                     (a connection costs its `first` or `last` times what each item selects)"
                ),
                &[("cost", cost), ("max", limit)],
            ));
        }
        match self.budgets.charge(&key, cost, budget, Instant::now()) {
            Ok(remaining) => Ok(Admission {
                key,
                budget,
                charge: Charge {
                    cost,
                    limit,
                    remaining,
                },
                variable_arguments,
            }),
            Err((remaining, retry_after)) => Err(self.refuse(
                Limit::RateLimited,
                format!(
                    "this request costs {cost} points and {remaining} of this caller's {budget} \
                     per minute are left: retry in {retry_after} s"
                ),
                &[
                    ("cost", cost),
                    ("remaining", remaining),
                    ("retryAfterSeconds", retry_after),
                ],
            )),
        }
    }

    /// Runs a query's or a mutation's execution within the request deadline; at the deadline the
    /// execution is dropped (its resolvers and their transactions with it: each rolls back) and
    /// the answer is a `TIMEOUT` request error.
    pub async fn within_deadline(&self, execution: impl Future<Output = Response>) -> Response {
        let timeout = self.limits.request_timeout;
        match tokio::time::timeout(timeout, execution).await {
            Ok(response) => response,
            Err(_) => Response::from_errors(vec![self.refuse(
                Limit::Timeout,
                format!(
                    "the request ran longer than {timeout:?} and was stopped; nothing it began \
                     was kept"
                ),
                &[("maxMilliseconds", timeout.as_millis() as u64)],
            )]),
        }
    }

    /// Cuts `response` to the errors one response carries, the last saying how many were left
    /// out: every response of every transport, a subscription's items included.
    pub fn cap_errors(&self, response: &mut Response) {
        let max = self.limits.max_errors;
        if response.errors.len() > max {
            let dropped = response.errors.len() - max;
            response.errors.truncate(max);
            response.errors.push(self.refuse(
                Limit::Errors,
                format!("{dropped} more errors were left out (at most {max} per response)"),
                &[("max", max as u64)],
            ));
        }
    }

    /// The response of an admitted request on its way out: its errors capped at
    /// [`Limits::max_errors`], and its `extensions.cost`; or, when async-graphql refused the
    /// request, the charge refunded ([`AdmissionControl::settle`]) and no cost reported.
    pub fn finish(&self, admission: &Admission, response: &mut Response) {
        self.cap_errors(response);
        if self.settle(admission, response) {
            return;
        }
        // The three keys are made once per process (a `Name` is shared, not copied, on clone).
        static KEYS: std::sync::LazyLock<[Name; 3]> = std::sync::LazyLock::new(|| {
            [
                Name::new("requested"),
                Name::new("limit"),
                Name::new("remaining"),
            ]
        });
        let c = admission.charge;
        let cost = KEYS
            .iter()
            .cloned()
            .zip([c.cost, c.limit, c.remaining].map(async_graphql::Value::from))
            .collect();
        response
            .extensions
            .insert("cost".into(), async_graphql::Value::Object(cost));
    }

    /// Refunds the charge of an admitted request that async-graphql refused (its first response
    /// has no data and only errors of the request, none of them the deadline's): a document
    /// that does not validate costs nothing. Whether it refunded.
    ///
    /// A value the caller sent in `variables` that its type refuses (an enum value that does not
    /// exist, a missing field of an input) is coded `BAD_USER_INPUT` here, as a resolver's
    /// refusal of an input is: it is the caller's data, not the document, that is wrong. A
    /// literal in the document that its type refuses stays `GRAPHQL_VALIDATION_FAILED`.
    pub fn settle(&self, admission: &Admission, response: &mut Response) -> bool {
        if is_request_error(response) {
            for e in &mut response.errors {
                let of_variable = e.message.starts_with("Invalid value for argument")
                    && e.extensions
                        .as_ref()
                        .is_none_or(|x| x.get("code").is_none())
                    && e.locations
                        .first()
                        .is_some_and(|at| admission.variable_arguments.contains(at));
                if of_variable {
                    bad_user_input(e);
                }
            }
        }
        let refused = is_request_error(response)
            && !response.errors.iter().any(|e| {
                e.extensions
                    .as_ref()
                    .and_then(|x| x.get("limit"))
                    .is_some_and(|l| *l == async_graphql::Value::from("timeout"))
            });
        if refused {
            self.budgets.refund(
                &admission.key,
                admission.charge.cost,
                admission.budget,
                Instant::now(),
            );
        }
        refused
    }
}

/// Whether `response` is a request error: no `data`, because the document did not parse or
/// validate or the operation could not start (every error is the request's, none a field's).
pub fn is_request_error(response: &Response) -> bool {
    response.data == async_graphql::Value::Null
        && !response.errors.is_empty()
        && response.errors.iter().all(|e| e.path.is_empty())
}

/// The coded error of a refusal at a published limit: `extensions.code` by reason,
/// `extensions.limit` the reason, and the figures in `extra`.
pub fn refusal(limit: Limit, message: String, extra: &[(&str, u64)]) -> ServerError {
    let mut e = ServerError::new(message, None);
    let ext = e.extensions.get_or_insert_with(Default::default);
    ext.set("code", limit.code().as_str());
    ext.set("limit", limit.as_str());
    for (k, v) in extra {
        ext.set(*k, *v);
    }
    e
}

/// The refusal of a document longer than `limits` allow, before anything parses it.
pub fn oversized(limits: &Limits, query: &str) -> Option<ServerError> {
    let max = limits.max_document_bytes;
    (query.len() > max).then(|| {
        refusal(
            Limit::DocumentBytes,
            format!(
                "the document is {} bytes; at most {max} are parsed",
                query.len()
            ),
            &[("max", max as u64)],
        )
    })
}

/// What one request was charged: its cost, its limit and the budget left.
#[derive(Debug, Clone, Copy)]
struct Charge {
    cost: u64,
    limit: u64,
    remaining: u64,
}

/// A request the door let in: who was charged, and what.
#[derive(Debug, Clone)]
pub struct Admission {
    key: String,
    budget: u64,
    charge: Charge,
    /// Where the arguments whose value holds a variable are named in the document: an
    /// argument async-graphql refuses at one of them was refused for a variable's value.
    variable_arguments: Vec<async_graphql::Pos>,
}

/// The document reduced to the operation `name` names and the fragments it reaches; `None` when
/// there is nothing to reduce (one operation, no name, or a name no operation has: async-graphql
/// then answers as the specification says).
fn selected_operation(doc: &ExecutableDocument, name: Option<&str>) -> Option<ExecutableDocument> {
    let DocumentOperations::Multiple(ops) = &doc.operations else {
        return None;
    };
    let name = name?;
    if ops.len() < 2 {
        return None;
    }
    let (key, op) = ops.iter().find(|(k, _)| k.as_str() == name)?;
    fn spreads(set: &SelectionSet, out: &mut Vec<Name>) {
        for item in &set.items {
            match &item.node {
                Selection::Field(f) => spreads(&f.node.selection_set.node, out),
                Selection::FragmentSpread(s) => out.push(s.node.fragment_name.node.clone()),
                Selection::InlineFragment(i) => spreads(&i.node.selection_set.node, out),
            }
        }
    }
    let mut todo = Vec::new();
    spreads(&op.node.selection_set.node, &mut todo);
    let mut fragments = HashMap::new();
    while let Some(f) = todo.pop() {
        if fragments.contains_key(&f) {
            continue;
        }
        if let Some(def) = doc.fragments.get(&f) {
            spreads(&def.node.selection_set.node, &mut todo);
            fragments.insert(f, def.clone());
        }
    }
    Some(ExecutableDocument {
        operations: DocumentOperations::Multiple(HashMap::from([(key.clone(), op.clone())])),
        fragments,
    })
}

impl AdmissionControl {
    fn check_document(&self, doc: &ExecutableDocument) -> ServerResult<()> {
        let limits = &self.limits;
        let mut sizes = Sizes::new(doc);
        let mut total = Size::default();
        for (_, op) in doc.operations.iter() {
            let root = sizes.of_set(&op.node.selection_set);
            let root_fields = sizes.root_fields(&op.node.selection_set);
            if root_fields > limits.max_root_fields as u64 {
                return Err(self.refuse(
                    Limit::RootFields,
                    format!(
                        "the operation selects {root_fields} root fields; at most {} are allowed",
                        limits.max_root_fields
                    ),
                    &[("max", limits.max_root_fields as u64)],
                ));
            }
            total = total.plus(root).plus(Size {
                directives: directives_in(&op.node.directives),
                ..Size::default()
            });
            if op
                .node
                .variable_definitions
                .iter()
                .filter_map(|d| d.node.default_value.as_ref())
                .any(|v| const_holds_nul(&v.node))
            {
                return Err(self.refuse(
                    Limit::NulCharacter,
                    "a default value holds the NUL character (U+0000), which no string may contain"
                        .into(),
                    &[],
                ));
            }
        }
        if sizes.nul {
            return Err(self.refuse(
                Limit::NulCharacter,
                "an argument holds the NUL character (U+0000), which no string may contain".into(),
                &[],
            ));
        }
        // The most specific bound first: 10,000 aliases are reported as aliases.
        let checks = [
            (Limit::Aliases, total.aliases, limits.max_aliases),
            (Limit::Directives, total.directives, limits.max_directives),
            (Limit::Selections, total.fields, limits.max_selections),
        ];
        for (limit, n, max) in checks {
            let what = limit.as_str();
            if n > max as u64 {
                return Err(self.refuse(
                    limit,
                    format!(
                        "the document has {} {what} once its fragments are expanded; at most \
                         {max} are allowed",
                        if n == u64::MAX {
                            "too many".to_owned()
                        } else {
                            n.to_string()
                        }
                    ),
                    &[("max", max as u64)],
                ));
            }
        }
        Ok(())
    }
}

/// What a selection set amounts to once its fragments are expanded.
#[derive(Debug, Clone, Copy, Default)]
struct Size {
    fields: u64,
    aliases: u64,
    directives: u64,
}

impl Size {
    fn plus(self, o: Size) -> Size {
        Size {
            fields: self.fields.saturating_add(o.fields),
            aliases: self.aliases.saturating_add(o.aliases),
            directives: self.directives.saturating_add(o.directives),
        }
    }
}

/// Sizes of selection sets, each fragment's computed once (a spread of a fragment being
/// computed is a cycle, which validation reports; it counts as nothing here).
struct Sizes<'a> {
    fragments: &'a HashMap<Name, Positioned<FragmentDefinition>>,
    done: HashMap<&'a str, Size>,
    roots_done: HashMap<&'a str, u64>,
    open: Vec<&'a str>,
    nul: bool,
}

impl<'a> Sizes<'a> {
    fn new(doc: &'a ExecutableDocument) -> Sizes<'a> {
        Sizes {
            fragments: &doc.fragments,
            done: HashMap::new(),
            roots_done: HashMap::new(),
            open: Vec::new(),
            nul: false,
        }
    }

    fn of_fragment(&mut self, name: &'a str) -> Size {
        if let Some(s) = self.done.get(name) {
            return *s;
        }
        if self.open.contains(&name) {
            return Size::default();
        }
        let Some(fragment) = self.fragments.get(name) else {
            return Size::default();
        };
        self.open.push(name);
        let size = self.of_set(&fragment.node.selection_set).plus(Size {
            directives: directives_in(&fragment.node.directives),
            ..Size::default()
        });
        if directives_hold_nul(&fragment.node.directives) {
            self.nul = true;
        }
        self.open.pop();
        self.done.insert(name, size);
        size
    }

    fn of_set(&mut self, set: &'a Positioned<SelectionSet>) -> Size {
        let mut size = Size::default();
        for item in &set.node.items {
            let s = match &item.node {
                Selection::Field(f) => {
                    let f = &f.node;
                    if f.arguments.iter().any(|(_, v)| value_holds_nul(&v.node))
                        || directives_hold_nul(&f.directives)
                    {
                        self.nul = true;
                    }
                    Size {
                        fields: 1,
                        aliases: u64::from(f.alias.is_some()),
                        directives: directives_in(&f.directives),
                    }
                    .plus(self.of_set(&f.selection_set))
                }
                Selection::FragmentSpread(s) => self
                    .of_fragment(s.node.fragment_name.node.as_str())
                    .plus(Size {
                        directives: directives_in(&s.node.directives),
                        ..Size::default()
                    }),
                Selection::InlineFragment(i) => self.of_set(&i.node.selection_set).plus(Size {
                    directives: directives_in(&i.node.directives),
                    ..Size::default()
                }),
            };
            size = size.plus(s);
        }
        size
    }

    /// Fields directly at the root, fragments expanded (not their children); each fragment's
    /// count is computed once, like its size.
    fn root_fields(&mut self, set: &'a Positioned<SelectionSet>) -> u64 {
        let mut n = 0u64;
        for item in &set.node.items {
            n = n.saturating_add(match &item.node {
                Selection::Field(_) => 1,
                Selection::InlineFragment(i) => self.root_fields(&i.node.selection_set),
                Selection::FragmentSpread(s) => {
                    let name = s.node.fragment_name.node.as_str();
                    if let Some(k) = self.roots_done.get(name) {
                        *k
                    } else if self.open.contains(&name) {
                        0 // a cycle: validation reports it
                    } else if let Some(f) = self.fragments.get(name) {
                        self.open.push(name);
                        let k = self.root_fields(&f.node.selection_set);
                        self.open.pop();
                        self.roots_done.insert(name, k);
                        k
                    } else {
                        0
                    }
                }
            });
        }
        n
    }
}

/// Codes `e` as the caller's input (`BAD_USER_INPUT`).
fn bad_user_input(e: &mut ServerError) {
    e.extensions
        .get_or_insert_with(Default::default)
        .set("code", compute_domain::ErrorCode::BadUserInput.as_str());
}

/// Calls `f` with the name and value of every argument in `doc`: of every field and directive,
/// in every operation and fragment.
fn each_argument<'a>(
    doc: &'a ExecutableDocument,
    f: &mut dyn FnMut(&'a Positioned<Name>, &'a Positioned<async_graphql_value::Value>),
) {
    type Visit<'v, 'a> =
        &'v mut dyn FnMut(&'a Positioned<Name>, &'a Positioned<async_graphql_value::Value>);
    fn of_directives<'a>(d: &'a [Positioned<Directive>], f: Visit<'_, 'a>) {
        for d in d {
            for (name, value) in &d.node.arguments {
                f(name, value);
            }
        }
    }
    fn of_set<'a>(set: &'a SelectionSet, f: Visit<'_, 'a>) {
        for item in &set.items {
            match &item.node {
                Selection::Field(field) => {
                    for (name, value) in &field.node.arguments {
                        f(name, value);
                    }
                    of_directives(&field.node.directives, f);
                    of_set(&field.node.selection_set.node, f);
                }
                Selection::FragmentSpread(s) => of_directives(&s.node.directives, f),
                Selection::InlineFragment(i) => {
                    of_directives(&i.node.directives, f);
                    of_set(&i.node.selection_set.node, f);
                }
            }
        }
    }
    for (_, op) in doc.operations.iter() {
        of_directives(&op.node.directives, f);
        of_set(&op.node.selection_set.node, f);
    }
    for fragment in doc.fragments.values() {
        of_directives(&fragment.node.directives, f);
        of_set(&fragment.node.selection_set.node, f);
    }
}

/// Whether an argument's value holds a variable anywhere in it.
fn holds_variable(v: &async_graphql_value::Value) -> bool {
    use async_graphql_value::Value;
    match v {
        Value::Variable(_) => true,
        Value::List(items) => items.iter().any(holds_variable),
        Value::Object(fields) => fields.values().any(holds_variable),
        _ => false,
    }
}

/// The lists in a request's argument values, with its variables' values put in: how many items
/// they hold in all (each costs a point) and the first one longer than the limit.
struct Lists<'v> {
    variables: &'v async_graphql::Variables,
    max: usize,
    items: u64,
    too_long: Option<(String, usize)>,
}

impl Lists<'_> {
    fn list(&mut self, path: &str, len: usize) {
        self.items = self.items.saturating_add(len as u64);
        if len > self.max && self.too_long.is_none() {
            self.too_long = Some((path.to_owned(), len));
        }
    }

    fn value(&mut self, v: &async_graphql_value::Value, path: &mut String) {
        use async_graphql_value::Value;
        match v {
            Value::Variable(name) => {
                if let Some(c) = self.variables.get(name) {
                    self.constant(c, path);
                }
            }
            Value::List(items) => {
                self.list(path, items.len());
                for item in items {
                    self.value(item, path);
                }
            }
            Value::Object(fields) => {
                for (k, v) in fields {
                    let at = path.len();
                    push_field(path, k);
                    self.value(v, path);
                    path.truncate(at);
                }
            }
            _ => {}
        }
    }

    fn constant(&mut self, v: &async_graphql::Value, path: &mut String) {
        use async_graphql::Value;
        match v {
            Value::List(items) => {
                self.list(path, items.len());
                for item in items {
                    self.constant(item, path);
                }
            }
            Value::Object(fields) => {
                for (k, v) in fields {
                    let at = path.len();
                    push_field(path, k);
                    self.constant(v, path);
                    path.truncate(at);
                }
            }
            _ => {}
        }
    }
}

fn push_field(path: &mut String, name: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(name);
}

fn directives_in(d: &[Positioned<Directive>]) -> u64 {
    d.len() as u64
}

fn directives_hold_nul(d: &[Positioned<Directive>]) -> bool {
    d.iter().any(|d| {
        d.node
            .arguments
            .iter()
            .any(|(_, v)| value_holds_nul(&v.node))
    })
}

fn value_holds_nul(v: &async_graphql_value::Value) -> bool {
    use async_graphql_value::Value;
    match v {
        Value::String(s) => s.contains('\0'),
        Value::List(items) => items.iter().any(value_holds_nul),
        Value::Object(fields) => fields
            .iter()
            .any(|(k, v)| k.contains('\0') || value_holds_nul(v)),
        _ => false,
    }
}

fn const_holds_nul(v: &async_graphql::Value) -> bool {
    use async_graphql::Value;
    match v {
        Value::String(s) => s.contains('\0'),
        Value::List(items) => items.iter().any(const_holds_nul),
        Value::Object(fields) => fields
            .iter()
            .any(|(k, v)| k.contains('\0') || const_holds_nul(v)),
        _ => false,
    }
}

fn variables_hold_nul(vars: &async_graphql::Variables) -> bool {
    vars.iter()
        .any(|(k, v)| k.contains('\0') || const_holds_nul(v))
}

/// Each identity's budget: a bucket of points refilled continuously at its per-minute rate.
#[derive(Default)]
struct Budgets {
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    points: f64,
    at: Instant,
}

/// Buckets kept before full ones are forgotten (a full bucket is the same as none).
const MAX_BUCKETS: usize = 10_000;

impl Budgets {
    /// Takes `cost` from `key`'s bucket of `per_minute`: the points left, or (the points left,
    /// seconds until `cost` is available) when there are not enough.
    fn charge(
        &self,
        key: &str,
        cost: u64,
        per_minute: u64,
        now: Instant,
    ) -> Result<u64, (u64, u64)> {
        let capacity = per_minute as f64;
        let rate = capacity / 60.0;
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(key) {
            buckets
                .retain(|_, b| b.points + now.duration_since(b.at).as_secs_f64() * rate < capacity);
        }
        // Looked up by `&str` first: a known identity's request allocates no key.
        if !buckets.contains_key(key) {
            buckets.insert(
                key.to_owned(),
                Bucket {
                    points: capacity,
                    at: now,
                },
            );
        }
        let bucket = buckets.get_mut(key).expect("inserted above");
        let refilled =
            (bucket.points + now.duration_since(bucket.at).as_secs_f64() * rate).min(capacity);
        let cost = cost as f64;
        if refilled >= cost {
            *bucket = Bucket {
                points: refilled - cost,
                at: now,
            };
            Ok(bucket.points as u64)
        } else {
            *bucket = Bucket {
                points: refilled,
                at: now,
            };
            let wait = if rate > 0.0 {
                ((cost - refilled) / rate).ceil() as u64
            } else {
                u64::MAX
            };
            Err((refilled as u64, wait.max(1)))
        }
    }
}

impl Budgets {
    /// Gives `cost` back to `key`'s bucket of `per_minute` (never above its capacity).
    fn refund(&self, key: &str, cost: u64, per_minute: u64, now: Instant) {
        let capacity = per_minute as f64;
        let rate = capacity / 60.0;
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bucket) = buckets.get_mut(key) {
            let refilled =
                bucket.points + now.duration_since(bucket.at).as_secs_f64() * rate + cost as f64;
            *bucket = Bucket {
                points: refilled.min(capacity),
                at: now,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_callers_are_one_identity_per_ipv6_64() {
        let key = |ip: &str| identity_key(None, Some(Peer(ip.parse().expect("ip"))));
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("192.0.2.7"), "anon:192.0.2.7");
        assert_ne!(key("::ffff:192.0.2.7"), key("::ffff:192.0.2.8"));
    }

    #[test]
    fn a_budget_refills_per_minute_and_refuses_what_it_cannot_pay() {
        let b = Budgets::default();
        let t0 = Instant::now();
        assert_eq!(b.charge("a", 40, 100, t0), Ok(60));
        assert_eq!(b.charge("a", 40, 100, t0), Ok(20));
        // 20 left, 40 asked: 20 more points take 12 s at 100 per minute.
        assert_eq!(b.charge("a", 40, 100, t0), Err((20, 12)));
        assert_eq!(b.charge("b", 40, 100, t0), Ok(60), "another identity's own");
        let later = t0 + std::time::Duration::from_secs(12);
        assert_eq!(b.charge("a", 40, 100, later), Ok(0));
        b.refund("a", 30, 100, later);
        assert_eq!(
            b.charge("a", 30, 100, later),
            Ok(0),
            "a refund gives the points back"
        );
        b.refund("a", 500, 100, later);
        assert_eq!(
            b.charge("a", 0, 100, later),
            Ok(100),
            "never above the capacity"
        );
    }

    fn door_size(query: &str) -> Result<(), String> {
        let door = AdmissionControl::new(Limits::default(), CostModel::default(), Arc::new(|_| {}));
        let doc = async_graphql::parser::parse_query(query).expect("parses");
        door.check_document(&doc)
            .map_err(|e| format!("{:?}", e.extensions.and_then(|x| x.get("limit").cloned())))
    }

    #[test]
    fn nested_fragment_spreads_are_measured_without_expanding_them() {
        // Each fragment spreads the one below it twice: 2^40 fields once expanded.
        let mut q = String::from("query { ...F0 }\n");
        for i in 0..40 {
            q.push_str(&format!(
                "fragment F{i} on Query {{ ...F{n} ...F{n} }}\n",
                n = i + 1
            ));
        }
        q.push_str("fragment F40 on Query { viewer { subject } }\n");
        let started = Instant::now();
        let verdict = door_size(&q);
        assert!(
            started.elapsed().as_millis() < 1_000,
            "linear, not exponential"
        );
        assert!(verdict.is_err(), "{verdict:?}");
    }

    #[test]
    fn aliases_root_fields_and_directives_are_bounded() {
        let aliases: String = (0..300).map(|i| format!("a{i}: serverTime ")).collect();
        assert_eq!(
            door_size(&format!("{{ viewer {{ subject }} {aliases} }}"))
                .err()
                .as_deref(),
            Some("Some(String(\"root_fields\"))")
        );
        let nested: String = (0..300).map(|i| format!("a{i}: subject ")).collect();
        assert_eq!(
            door_size(&format!("{{ viewer {{ {nested} }} }}"))
                .err()
                .as_deref(),
            Some("Some(String(\"aliases\"))")
        );
        let directives = "@include(if: true) ".repeat(150);
        assert_eq!(
            door_size(&format!("{{ serverTime {directives} }}"))
                .err()
                .as_deref(),
            Some("Some(String(\"directives\"))")
        );
        assert_eq!(door_size("{ viewer { subject } serverTime }"), Ok(()));
        assert_eq!(
            door_size("{ sites(after: \"a\\u0000b\") { totalCount } }")
                .err()
                .as_deref(),
            Some("Some(String(\"nul_character\"))")
        );
    }
}
