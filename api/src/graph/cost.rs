//! What a request costs, computed by the door before async-graphql validates it (so the door
//! needs no async-graphql extension, whose presence sends every field of every response through
//! async-graphql's slow path: a registry lookup, a boxed future and, per list item, two
//! formatted type names).
//!
//! The rule is async-graphql's complexity, priced the way the API publishes it
//! (`docs/security.md`): every selected field costs one plus what it selects (`__typename`
//! nothing), fragments expanded where they are spread, except
//!
//! - a **connection** (a field with a `first` argument) costs its page size (`first` or `last`,
//!   the field's default page when neither is given, never more than [`MAX_PAGE`]) times what
//!   each item selects, plus one ([`page_cost`]);
//! - a **bounded list** costs its bound times what each item selects, plus one ([`list_cost`]):
//!   the lists operators set the length of at their usual length ([`OPERATOR_LIST`]), the others
//!   at their bound, and `nodes(ids:)` at the number of ids it is given (at most 100).
//!
//! Like async-graphql's, the rules apply to fields selected on an object type (a concrete type,
//! through an inline fragment or a fragment on it), not to a field selected on an interface.
//! The types come from the schema's own SDL, read once when the server starts; the rules are
//! [`RULES`], checked against the schema by a test so none can name a field that is not there.

use std::collections::HashMap;

use async_graphql::parser::types::{
    BaseType, ExecutableDocument, FragmentDefinition, OperationType, Selection, SelectionSet,
    TypeKind, TypeSystemDefinition, VariableDefinition,
};
use async_graphql::{Name, Positioned, Variables};
use compute_domain::page::{DEFAULT_PAGE, MAX_PAGE};

/// The cost of a connection field: its page size (`first` or `last`, `default` when neither is
/// given, never more than [`MAX_PAGE`]) times what each item selects, plus one.
pub fn page_cost(
    first: Option<i64>,
    last: Option<i64>,
    default: i64,
    child_complexity: usize,
) -> usize {
    let n = first.or(last).unwrap_or(default).clamp(1, MAX_PAGE);
    list_cost(n as usize, child_complexity)
}

/// What a list whose length operators set (a node's devices, a device's atoms) is priced at:
/// its usual length, not its bound (64). Callers cannot make such lists longer, and pricing them
/// at 64 × 64 per node would refuse a console's page of ten nodes; the request deadline bounds
/// the rest. Lists a caller sets the length of are priced at their bound.
pub const OPERATOR_LIST: usize = 8;

/// The cost of a list of at most `n` objects: `n` times what each selects, plus one.
pub fn list_cost(n: usize, child_complexity: usize) -> usize {
    n.max(1).saturating_mul(child_complexity).saturating_add(1)
}

/// How a field is priced, beyond one plus what it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A connection: its page size, `default` when the caller gives none.
    Page { default: i64 },
    /// A list of at most this many objects.
    List(usize),
    /// A list as long as the named list argument (at most `max`).
    ArgumentLength { argument: &'static str, max: usize },
}

/// The rules that are not a connection's (a field with a `first` argument is priced as a page
/// of [`DEFAULT_PAGE`] unless it is listed here): `(type, field, rule)`.
pub const RULES: &[(&str, &str, Rule)] = &[
    (
        "Reservation",
        "allocations",
        Rule::List(compute_domain::reservations::model::MAX_ALLOCATIONS),
    ),
    (
        "AvailabilityWindow",
        "placements",
        Rule::List(compute_domain::reservations::model::MAX_ALLOCATIONS),
    ),
    (
        "CapacityTimeline",
        "steps",
        Rule::List(compute_domain::reservations::availability::MAX_STEPS as usize),
    ),
    ("ComputeNode", "devices", Rule::List(OPERATOR_LIST)),
    ("Device", "atoms", Rule::List(OPERATOR_LIST)),
    (
        "Query",
        "nodes",
        Rule::ArgumentLength {
            argument: "ids",
            max: 100,
        },
    ),
    // Its windows: 5 when `first` is not given.
    (
        "Query",
        "availability",
        Rule::Page {
            default: compute_domain::reservations::availability::DEFAULT_WINDOWS as i64,
        },
    ),
    // Its page is all the groups (100) when `first` is not given.
    ("UsageReport", "groups", Rule::Page { default: MAX_PAGE }),
];

/// One field of the schema: the named type it returns and its rule, if it has one.
#[derive(Debug, Clone)]
struct FieldInfo {
    returns: Name,
    rule: Option<Rule>,
}

/// One type of the schema: whether it is an object type (whose fields' rules apply) and its
/// fields.
#[derive(Debug, Clone, Default)]
struct TypeInfo {
    object: bool,
    fields: HashMap<Name, FieldInfo>,
}

/// The schema's types, as the cost walk needs them. The default knows no type: every field
/// costs one plus what it selects.
#[derive(Debug, Clone)]
pub struct CostModel {
    types: HashMap<Name, TypeInfo>,
    query: Name,
    mutation: Name,
    subscription: Name,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            types: HashMap::new(),
            query: Name::new("Query"),
            mutation: Name::new("Mutation"),
            subscription: Name::new("Subscription"),
        }
    }
}

/// Why a schema's SDL could not be read into a cost model (a bug of ours: the SDL is the
/// schema's own).
#[derive(Debug)]
pub struct ModelError(pub String);

impl std::fmt::Display for ModelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl CostModel {
    /// The model of the schema whose SDL is `sdl`.
    pub fn from_sdl(sdl: &str) -> Result<CostModel, ModelError> {
        let doc = async_graphql::parser::parse_schema(sdl)
            .map_err(|e| ModelError(format!("the schema's SDL does not parse: {e}")))?;
        let mut model = CostModel::default();
        for def in doc.definitions {
            match def {
                TypeSystemDefinition::Schema(s) => {
                    if let Some(q) = s.node.query {
                        model.query = q.node;
                    }
                    if let Some(m) = s.node.mutation {
                        model.mutation = m.node;
                    }
                    if let Some(s) = s.node.subscription {
                        model.subscription = s.node;
                    }
                }
                TypeSystemDefinition::Type(t) => {
                    let (object, fields) = match t.node.kind {
                        TypeKind::Object(o) => (true, o.fields),
                        TypeKind::Interface(i) => (false, i.fields),
                        _ => continue,
                    };
                    let type_name = t.node.name.node;
                    let fields = fields
                        .into_iter()
                        .map(|f| {
                            let f = f.node;
                            // The named type under the lists (`[Device!]!` returns `Device`).
                            let mut ty = &f.ty.node;
                            let returns = loop {
                                match &ty.base {
                                    BaseType::List(inner) => ty = inner,
                                    BaseType::Named(name) => break name.clone(),
                                }
                            };
                            let listed = RULES
                                .iter()
                                .find(|(t, n, _)| {
                                    *t == type_name.as_str() && *n == f.name.node.as_str()
                                })
                                .map(|(_, _, r)| *r);
                            let connection =
                                f.arguments.iter().any(|a| a.node.name.node == "first");
                            let rule = listed.or(connection.then_some(Rule::Page {
                                default: DEFAULT_PAGE,
                            }));
                            (f.name.node, FieldInfo { returns, rule })
                        })
                        .collect();
                    model.types.insert(type_name, TypeInfo { object, fields });
                }
                TypeSystemDefinition::Directive(_) => {}
            }
        }
        for (t, f, _) in RULES {
            let known = model
                .types
                .get(*t)
                .is_some_and(|info| info.fields.contains_key(*f));
            if !known {
                return Err(ModelError(format!(
                    "the cost rule of `{t}.{f}` names a field the schema does not have"
                )));
            }
        }
        Ok(model)
    }

    /// What `doc` costs with `variables` (every operation of it: the door has already reduced a
    /// document to the operation the request names). Fragments are expanded where they are
    /// spread; a fragment spread inside itself counts as nothing (validation refuses it). The
    /// door has bounded the expanded document's size before this walk, so it is linear in what
    /// that bound allows.
    ///
    /// A page size that is not an `Int` (a 32-bit integer) is the request's error, as GraphQL's
    /// coercion of variables makes it: the message to answer with, and where the argument is
    /// named in the document.
    pub fn cost(
        &self,
        doc: &ExecutableDocument,
        variables: &Variables,
    ) -> Result<u64, (String, async_graphql::Pos)> {
        let mut walk = Walk {
            model: self,
            fragments: &doc.fragments,
            variables,
            definitions: &[],
            open: Vec::new(),
            error: None,
        };
        let mut total = 0usize;
        for (_, op) in doc.operations.iter() {
            let root = match op.node.ty {
                OperationType::Query => &self.query,
                OperationType::Mutation => &self.mutation,
                OperationType::Subscription => &self.subscription,
            };
            walk.definitions = &op.node.variable_definitions;
            total = total.saturating_add(walk.set(Some(root), &op.node.selection_set));
        }
        match walk.error {
            Some(e) => Err(e),
            None => Ok(total as u64),
        }
    }
}

struct Walk<'a> {
    model: &'a CostModel,
    fragments: &'a HashMap<Name, Positioned<FragmentDefinition>>,
    variables: &'a Variables,
    definitions: &'a [Positioned<VariableDefinition>],
    open: Vec<&'a str>,
    error: Option<(String, async_graphql::Pos)>,
}

impl<'a> Walk<'a> {
    /// The cost of `set` selected on the type `on` (`None`: a type the model does not know, such
    /// as the introspection types, where every field costs one plus what it selects).
    fn set(&mut self, on: Option<&'a Name>, set: &'a Positioned<SelectionSet>) -> usize {
        let mut sum = 0usize;
        for item in &set.node.items {
            let cost = match &item.node {
                // `__typename` is free, as in async-graphql's complexity: it reads nothing.
                Selection::Field(f) if f.node.name.node == "__typename" => 0,
                Selection::Field(f) => {
                    let f = &f.node;
                    let info = on
                        .and_then(|t| self.model.types.get(t))
                        .map(|t| (t.object, t.fields.get(&f.name.node)));
                    let child_type = info.and_then(|(_, field)| field).map(|x| &x.returns);
                    let children = self.set(child_type, &f.selection_set);
                    match info {
                        Some((
                            true,
                            Some(FieldInfo {
                                rule: Some(rule), ..
                            }),
                        )) => self.priced(*rule, f, children),
                        _ => children.saturating_add(1),
                    }
                }
                Selection::InlineFragment(i) => {
                    let on = match &i.node.type_condition {
                        Some(c) => Some(&c.node.on.node),
                        None => on,
                    };
                    self.set(on, &i.node.selection_set)
                }
                Selection::FragmentSpread(s) => {
                    let name = s.node.fragment_name.node.as_str();
                    match self.fragments.get(name) {
                        Some(fragment) if !self.open.contains(&name) => {
                            self.open.push(name);
                            let cost = self.set(
                                Some(&fragment.node.type_condition.node.on.node),
                                &fragment.node.selection_set,
                            );
                            self.open.pop();
                            cost
                        }
                        _ => 0,
                    }
                }
            };
            sum = sum.saturating_add(cost);
        }
        sum
    }

    fn priced(
        &mut self,
        rule: Rule,
        field: &async_graphql::parser::types::Field,
        children: usize,
    ) -> usize {
        match rule {
            Rule::Page { default } => {
                let first = self.int_argument(field, "first");
                let last = self.int_argument(field, "last");
                page_cost(first, last, default, children)
            }
            Rule::List(n) => list_cost(n, children),
            Rule::ArgumentLength { argument, max } => {
                let n = match self.argument(field, argument).map(|(v, _)| v) {
                    Some(async_graphql::Value::List(items)) => items.len(),
                    Some(async_graphql::Value::Null) | None => 0,
                    // A single value is a list of one (input coercion).
                    Some(_) => 1,
                };
                list_cost(n.min(max), children)
            }
        }
    }

    /// The value of `field`'s argument `name`, variables substituted (a variable not given
    /// takes its default); `None` when it is absent.
    fn argument(
        &self,
        field: &async_graphql::parser::types::Field,
        name: &str,
    ) -> Option<(async_graphql::Value, async_graphql::Pos)> {
        let (at, value) = field.arguments.iter().find(|(n, _)| n.node == name)?;
        let value = value
            .node
            .clone()
            .into_const_with(|var| {
                self.variables
                    .get(&var)
                    .cloned()
                    .or_else(|| {
                        self.definitions
                            .iter()
                            .find(|d| d.node.name.node == var)
                            .and_then(|d| d.node.default_value.as_ref())
                            .map(|v| v.node.clone())
                    })
                    .ok_or(())
            })
            .ok()?;
        Some((value, at.pos))
    }

    /// An `Int` argument's value; `None` when it is absent or null. Anything else is the
    /// request's error (recorded; the walk goes on and the error is answered).
    fn int_argument(
        &mut self,
        field: &async_graphql::parser::types::Field,
        name: &str,
    ) -> Option<i64> {
        let (value, at) = self.argument(field, name)?;
        match value {
            async_graphql::Value::Null => None,
            async_graphql::Value::Number(n)
                if n.as_i64().is_some_and(|v| i32::try_from(v).is_ok()) =>
            {
                n.as_i64()
            }
            other => {
                self.error.get_or_insert_with(|| {
                    let message = format!(
                        "`{name}` of `{}` must be an Int (a 32-bit integer), not {other}",
                        field.name.node
                    );
                    (message, at)
                });
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel::from_sdl(&crate::graph::sdl()).expect("the schema's own SDL makes a model")
    }

    fn cost(query: &str, variables: serde_json::Value) -> u64 {
        let doc = async_graphql::parser::parse_query(query).expect("parses");
        model()
            .cost(&doc, &Variables::from_json(variables))
            .expect("a cost")
    }

    #[test]
    fn a_connection_costs_its_page_times_its_items() {
        assert_eq!(page_cost(Some(10), None, DEFAULT_PAGE, 3), 31);
        assert_eq!(page_cost(None, Some(5), DEFAULT_PAGE, 2), 11);
        assert_eq!(
            page_cost(None, None, DEFAULT_PAGE, 1),
            DEFAULT_PAGE as usize + 1
        );
        assert_eq!(
            page_cost(Some(1_000_000), None, DEFAULT_PAGE, 1),
            MAX_PAGE as usize + 1
        );
        assert_eq!(
            page_cost(Some(0), None, DEFAULT_PAGE, 4),
            5,
            "an empty page still costs its query"
        );
        // sites: 10 × (edges 1 + node 1 + id 1) + 1.
        let q = "{ sites(first: 10) { edges { node { id } } } }";
        assert_eq!(cost(q, serde_json::json!({})), 31);
        assert_eq!(
            cost("{ sites { totalCount } }", serde_json::json!({})),
            DEFAULT_PAGE as u64 + 1,
            "no page size: the default page"
        );
    }

    #[test]
    fn variables_and_their_defaults_set_the_page() {
        let q = "query($n: Int = 5) { sites(first: $n) { edges { node { id } } } }";
        assert_eq!(cost(q, serde_json::json!({})), 16, "the default, 5");
        assert_eq!(cost(q, serde_json::json!({ "n": 2 })), 7, "the variable, 2");
        for bad in [serde_json::json!("ten"), serde_json::json!(1u64 << 40)] {
            let doc = async_graphql::parser::parse_query(q).expect("parses");
            let e = model()
                .cost(&doc, &Variables::from_json(serde_json::json!({ "n": bad })))
                .expect_err("not an Int")
                .0;
            assert!(e.contains("`first` of `sites` must be an Int"), "{e}");
        }
        assert_eq!(
            cost(q, serde_json::json!({ "n": null })),
            DEFAULT_PAGE as u64 * 3 + 1,
            "null: the default page"
        );
    }

    #[test]
    fn rules_apply_on_object_types_through_fragments() {
        let inline =
            r#"{ node(id: "x") { ... on Pool { computeNodes(first: 100) { totalCount } } } }"#;
        assert_eq!(
            cost(inline, serde_json::json!({})),
            102,
            "node 1 + (100 × 1 + 1)"
        );
        let spread = r#"{ node(id: "x") { ...P } } fragment P on Pool { computeNodes(first: 100) { totalCount } }"#;
        assert_eq!(cost(spread, serde_json::json!({})), 102);
        assert_eq!(
            cost(r#"{ node(id: "x") { id } }"#, serde_json::json!({})),
            2
        );
        let nodes = r#"{ nodes(ids: ["a", "b", "c"]) { id } }"#;
        assert_eq!(cost(nodes, serde_json::json!({})), 4, "3 ids × 1 + 1");
        let by_variable = "query($ids: [ID!]!) { nodes(ids: $ids) { id } }";
        assert_eq!(
            cost(by_variable, serde_json::json!({ "ids": ["a", "b"] })),
            3
        );
        // A page of nodes with their devices (8 each) and the devices' atoms (8 each).
        let page = "{ computeNodes(first: 2) { edges { node { devices { atoms { name } } } } } }";
        // atoms: 8 × 1 + 1 = 9; devices: 8 × 9 + 1 = 73; node 74, edges 75; page 2 × 75 + 1.
        assert_eq!(cost(page, serde_json::json!({})), 151);
    }

    #[test]
    fn typename_is_free() {
        assert_eq!(cost("{ __typename }", serde_json::json!({})), 0);
        let q = "{ sites(first: 10) { __typename totalCount } }";
        assert_eq!(cost(q, serde_json::json!({})), 11, "10 × 1 + 1");
    }

    #[test]
    fn introspection_and_cycles_cost_what_they_select() {
        assert_eq!(
            cost("{ __schema { types { name } } }", serde_json::json!({})),
            3
        );
        let cycle = "{ ...A } fragment A on Query { serverTime ...B } fragment B on Query { ...A }";
        assert_eq!(
            cost(cycle, serde_json::json!({})),
            1,
            "a cycle counts nothing more"
        );
    }

    #[test]
    fn a_rule_for_a_field_the_schema_lacks_is_refused() {
        let sdl = "type Query { sites(first: Int): [String!]! }";
        let e = CostModel::from_sdl(sdl).expect_err("RULES name fields this schema lacks");
        assert!(
            e.0.contains("names a field the schema does not have"),
            "{e}"
        );
    }
}
