//! The state table of a node's lifecycle: which actions may start from which state, and where
//! they lead. Guarded updates test `nodes.lifecycle = ANY(allowed_from(action))`, so the rule lives
//! here once and the database enforces it under the row lock.

use crate::text_enum::text_enum;

text_enum!(
    /// Where a node is in its life (`nodes.lifecycle`, derived from `cordoned` and `retired_at`).
    NodeLifecycle {
        /// Takes new work.
        Active = "active",
        /// Keeps its work; takes no new work.
        Cordoned = "cordoned",
        /// Out of the fleet for good; kept for history.
        Retired = "retired",
    }
);

/// What an operator does to a node (or to a device on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeAction {
    Update,
    Cordon,
    Uncordon,
    Taint,
    Untaint,
    Drain,
    Retire,
    /// Health, quarantine or mode changes of one of its devices.
    ChangeDevice,
}

impl NodeAction {
    /// The action's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            NodeAction::Update => "Update",
            NodeAction::Cordon => "Cordon",
            NodeAction::Uncordon => "Uncordon",
            NodeAction::Taint => "Taint",
            NodeAction::Untaint => "Untaint",
            NodeAction::Drain => "Drain",
            NodeAction::Retire => "Retire",
            NodeAction::ChangeDevice => "ChangeDevice",
        }
    }
}

use NodeLifecycle::{Active, Cordoned, Retired};

/// The legal transitions: (action, states it may start from, state it leads to; `None` keeps
/// the state).
pub const NODE_TRANSITIONS: &[(NodeAction, &[NodeLifecycle], Option<NodeLifecycle>)] = &[
    (NodeAction::Update, &[Active, Cordoned], None),
    (NodeAction::Cordon, &[Active, Cordoned], Some(Cordoned)),
    (NodeAction::Uncordon, &[Active, Cordoned], Some(Active)),
    (NodeAction::Taint, &[Active, Cordoned], None),
    (NodeAction::Untaint, &[Active, Cordoned], None),
    (NodeAction::Drain, &[Active, Cordoned], Some(Cordoned)),
    (NodeAction::Retire, &[Active, Cordoned], Some(Retired)),
    (NodeAction::ChangeDevice, &[Active, Cordoned], None),
];

/// The states `action` may start from, as stored.
pub fn allowed_from(action: NodeAction) -> Vec<NodeLifecycle> {
    NODE_TRANSITIONS
        .iter()
        .filter(|(a, _, _)| *a == action)
        .flat_map(|(_, from, _)| from.iter().copied())
        .collect()
}

/// Where `action` leads from `from`, or `None` when it is not allowed.
pub fn next(action: NodeAction, from: NodeLifecycle) -> Option<NodeLifecycle> {
    NODE_TRANSITIONS
        .iter()
        .find(|(a, f, _)| *a == action && f.contains(&from))
        .map(|(_, _, to)| to.unwrap_or(from))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retired_node_accepts_nothing() {
        for (action, _, _) in NODE_TRANSITIONS {
            assert_eq!(next(*action, Retired), None, "{action:?}");
            assert!(!allowed_from(*action).contains(&Retired));
        }
        assert_eq!(next(NodeAction::Cordon, Active), Some(Cordoned));
        assert_eq!(next(NodeAction::Uncordon, Cordoned), Some(Active));
        assert_eq!(next(NodeAction::Retire, Active), Some(Retired));
    }
}
