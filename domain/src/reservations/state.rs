//! The reservation state table: the one place that says which transitions are legal.

use crate::text_enum::text_enum;

text_enum!(
    /// Where a reservation is in its life.
    State {
        /// Holds its quota; not placed yet (retried every 30 s).
        Pending = "pending",
        /// Booked; its window has not started.
        Scheduled = "scheduled",
        /// Booked; its window is running.
        Active = "active",
        /// Ended early by its tenant; bookings end at the release.
        Released = "released",
        /// Its window ended.
        Expired = "expired",
        /// Withdrawn before it started.
        Cancelled = "cancelled",
        /// Could not be honoured (the node was lost).
        Failed = "failed",
    }
);

impl State {
    /// A terminal state holds nothing: no quota, no booking after its end, no scalars.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            State::Released | State::Expired | State::Cancelled | State::Failed
        )
    }
}

/// What moves a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Placement succeeded (at creation or on a retry).
    Place,
    /// The window started (workers).
    Start,
    /// The end moves later.
    Extend,
    /// The tenant ends it now.
    Release,
    /// The tenant withdraws it before it starts.
    Cancel,
    /// The window ended (workers).
    Expire,
    /// Its node was lost (workers).
    Fail,
}

impl Action {
    /// The action's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Action::Place => "Place",
            Action::Start => "Start",
            Action::Extend => "Extend",
            Action::Release => "Release",
            Action::Cancel => "Cancel",
            Action::Expire => "Expire",
            Action::Fail => "Fail",
        }
    }
}

use State::*;

/// The legal transitions: (action, from, to).
pub const TRANSITIONS: &[(Action, State, State)] = &[
    (Action::Place, Pending, Scheduled),
    (Action::Place, Pending, Active),
    (Action::Start, Scheduled, Active),
    (Action::Extend, Scheduled, Scheduled),
    (Action::Extend, Active, Active),
    (Action::Release, Scheduled, Released),
    (Action::Release, Active, Released),
    (Action::Cancel, Pending, Cancelled),
    (Action::Cancel, Scheduled, Cancelled),
    (Action::Expire, Active, Expired),
    (Action::Expire, Scheduled, Expired),
    (Action::Expire, Pending, Expired),
    (Action::Fail, Scheduled, Failed),
    (Action::Fail, Active, Failed),
];

/// The states `action` may start from, as stored.
pub fn allowed_from(action: Action) -> Vec<State> {
    let mut v: Vec<State> = TRANSITIONS
        .iter()
        .filter(|(a, _, _)| *a == action)
        .map(|(_, from, _)| *from)
        .collect();
    v.dedup();
    v
}

/// Whether `action` may move a reservation from `from` to `to`.
pub fn allowed(action: Action, from: State, to: State) -> bool {
    TRANSITIONS.contains(&(action, from, to))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_way_out() {
        for (_, from, _) in TRANSITIONS {
            assert!(
                !from.is_terminal(),
                "{from:?} is terminal but has a transition out"
            );
        }
        assert_eq!(allowed_from(Action::Cancel), vec![Pending, Scheduled]);
        assert!(allowed(Action::Release, Active, Released));
        assert!(!allowed(Action::Release, Pending, Released));
    }
}
