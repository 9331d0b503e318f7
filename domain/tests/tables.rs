//! The pure parts of the domain, table by table: the parsers that stand at the door, the atom
//! rule, and both state tables. Each row is an input and what a correct implementation says.

use compute_domain::ErrorCode;
use compute_domain::fleet::model::{
    DeviceMode, Layout, Taint, TaintEffect, parse_hostname, parse_key, parse_name, parse_ratio,
    parse_value,
};
use compute_domain::fleet::state::{NodeAction, NodeLifecycle, next};
use compute_domain::ids::{NodeId, PoolId, ScopeId, TenantId};
use compute_domain::reservations::state::{Action, State, allowed, allowed_from};

#[test]
fn names_keys_values_and_hosts_are_checked_at_the_door() {
    let long = "x".repeat(101);
    let names = [
        ("ams1", true),
        ("  padded  ", true),
        ("", false),
        ("   ", false),
        ("a\u{0}b", false),
        (long.as_str(), false),
    ];
    for (input, ok) in names {
        assert_eq!(parse_name("name", input).is_ok(), ok, "name {input:?}");
    }
    let keys = [
        ("rack", true),
        ("nvidia.com/gpu", true),
        ("a-b_c.d", true),
        ("", false),
        ("-x", false),
        ("a b", false),
        ("é", false),
    ];
    for (input, ok) in keys {
        assert_eq!(parse_key("key", input).is_ok(), ok, "key {input:?}");
    }
    let values = [
        ("", true),
        ("train", true),
        ("1.2-3_4", true),
        ("a/b", false),
        ("a b", false),
    ];
    for (input, ok) in values {
        assert_eq!(parse_value("value", input).is_ok(), ok, "value {input:?}");
    }
    let hosts = [
        ("h100-01", true),
        ("a.b.c", true),
        ("UPPER", false),
        ("-lead", false),
        ("trail.", false),
        ("", false),
        ("under_score", false),
    ];
    for (input, ok) in hosts {
        assert_eq!(
            parse_hostname("hostname", input).is_ok(),
            ok,
            "host {input:?}"
        );
    }
    for (ratio, expected) in [
        (1.0, Some(1.0)),
        (2.0004, Some(2.0)),
        (100.0, Some(100.0)),
        (0.5, None),
        (f64::NAN, None),
        (f64::INFINITY, None),
    ] {
        assert_eq!(parse_ratio("ratio", ratio).ok(), expected, "ratio {ratio}");
    }
}

#[test]
fn taints_parse_from_their_text() {
    type Row<'a> = (&'a str, Option<(&'a str, &'a str, TaintEffect)>);
    let table: [Row<'_>; 5] = [
        (
            "dedicated=train:NoSchedule",
            Some(("dedicated", "train", TaintEffect::NoSchedule)),
        ),
        (
            "gpu:PreferNoSchedule",
            Some(("gpu", "", TaintEffect::PreferNoSchedule)),
        ),
        ("a=b:NoExecute", Some(("a", "b", TaintEffect::NoExecute))),
        ("a=b", None),
        ("a=b:Sometimes", None),
    ];
    for (text, expected) in table {
        let parsed = Taint::parse("taint", text).ok();
        assert_eq!(
            parsed
                .as_ref()
                .map(|t| (t.key.as_str(), t.value.as_str(), t.effect)),
            expected,
            "{text}"
        );
        if let Some(t) = parsed {
            assert_eq!(
                Taint::parse("taint", &t.to_string()).ok(),
                Some(t),
                "round trip"
            );
        }
    }
}

#[test]
fn ids_and_scopes_name_what_they_are() {
    let pool = PoolId::generate();
    let node = NodeId::generate();
    assert!(PoolId::parse("id", pool.as_str()).is_ok());
    for (input, field) in [
        (node.as_str(), "poolId"),
        ("pool_xyz", "poolId"),
        ("", "poolId"),
    ] {
        let err = PoolId::parse(field, input).expect_err(input);
        assert_eq!(err.code(), ErrorCode::BadUserInput, "{input}");
    }
    assert!(matches!(
        ScopeId::parse("scopeId", pool.as_str()),
        Ok(ScopeId::Pool(_))
    ));
    assert!(ScopeId::parse("scopeId", node.as_str()).is_err());
    for (tenant, ok) in [
        ("acme", true),
        ("a.b-c_d", true),
        ("", false),
        (":operator", false),
        ("x y", false),
    ] {
        assert_eq!(TenantId::parse("tenant", tenant).is_ok(), ok, "{tenant:?}");
    }
}

#[test]
fn the_atom_rule_per_mode() {
    // (mode, MIG profiles, slots, memory) → the atoms' names and their share of the GPU.
    type Row<'a> = (
        DeviceMode,
        Option<Vec<String>>,
        Option<i64>,
        Vec<(&'a str, i32, i32)>,
    );
    let table: [Row<'_>; 4] = [
        (DeviceMode::Exclusive, None, None, vec![("G", 1, 1)]),
        (
            DeviceMode::Mig,
            Some(vec!["4g.40gb".into(), "3g.40gb".into()]),
            None,
            vec![("G/mig/0", 4, 7), ("G/mig/1", 3, 7)],
        ),
        (
            DeviceMode::TimeSlice,
            None,
            Some(2),
            vec![("G/s0", 1, 2), ("G/s1", 1, 2)],
        ),
        (
            DeviceMode::Mps,
            None,
            Some(3),
            vec![("G/s0", 1, 3), ("G/s1", 1, 3), ("G/s2", 1, 3)],
        ),
    ];
    for (mode, profiles, slots, expected) in table {
        let layout =
            Layout::parse("layout", mode, profiles.as_deref(), slots, 81_920).expect("valid");
        let atoms: Vec<(String, i32, i32)> = layout
            .atoms("G")
            .into_iter()
            .map(|a| (a.name, a.share_num, a.share_den))
            .collect();
        let expected: Vec<(String, i32, i32)> = expected
            .into_iter()
            .map(|(n, a, b)| (n.to_owned(), a, b))
            .collect();
        assert_eq!(atoms, expected, "{mode:?}");
        // Never the GPU and one of its parts at once.
        assert!(
            atoms.len() == 1 || atoms.iter().all(|(n, _, _)| n != "G"),
            "{mode:?} exposes the parent beside its parts"
        );
    }
    type Refused = (DeviceMode, Option<Vec<String>>, Option<i64>);
    let refused: [Refused; 4] = [
        (
            DeviceMode::Mig,
            Some(vec!["7g.80gb".into(), "1g.10gb".into()]),
            None,
        ),
        (DeviceMode::Mig, Some(vec![]), None),
        (DeviceMode::TimeSlice, None, Some(1)),
        (DeviceMode::Exclusive, None, Some(2)),
    ];
    for (mode, profiles, slots) in refused {
        assert!(
            Layout::parse("layout", mode, profiles.as_deref(), slots, 81_920).is_err(),
            "{mode:?} {profiles:?} {slots:?}"
        );
    }
}

#[test]
fn the_node_state_table() {
    use NodeAction::*;
    use NodeLifecycle::*;
    // (action, from, where it leads; None: refused)
    let table = [
        (Cordon, Active, Some(Cordoned)),
        (Cordon, Cordoned, Some(Cordoned)),
        (Uncordon, Cordoned, Some(Active)),
        (Drain, Active, Some(Cordoned)),
        (Retire, Cordoned, Some(Retired)),
        (Update, Active, Some(Active)),
        (ChangeDevice, Cordoned, Some(Cordoned)),
        (Uncordon, Retired, None),
        (Update, Retired, None),
        (ChangeDevice, Retired, None),
    ];
    for (action, from, to) in table {
        assert_eq!(next(action, from), to, "{action:?} from {from:?}");
    }
}

#[test]
fn the_reservation_state_table() {
    use State::*;
    let legal = [
        (Action::Place, Pending, Scheduled),
        (Action::Place, Pending, Active),
        (Action::Start, Scheduled, Active),
        (Action::Release, Active, Released),
        (Action::Cancel, Scheduled, Cancelled),
        (Action::Expire, Pending, Expired),
        (Action::Fail, Active, Failed),
    ];
    for (action, from, to) in legal {
        assert!(allowed(action, from, to), "{action:?}: {from:?} → {to:?}");
    }
    let illegal = [
        (Action::Cancel, Active, Cancelled),
        (Action::Release, Pending, Released),
        (Action::Start, Pending, Active),
        (Action::Extend, Expired, Expired),
        (Action::Fail, Pending, Failed),
    ];
    for (action, from, to) in illegal {
        assert!(!allowed(action, from, to), "{action:?}: {from:?} → {to:?}");
    }
    for state in State::ALL {
        let moves = [
            Action::Place,
            Action::Start,
            Action::Extend,
            Action::Release,
            Action::Cancel,
            Action::Expire,
            Action::Fail,
        ]
        .iter()
        .filter(|a| allowed_from(**a).contains(state))
        .count();
        assert_eq!(moves == 0, state.is_terminal(), "{state:?}");
    }
}
