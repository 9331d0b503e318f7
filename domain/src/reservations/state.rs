//! The reservation state table: the one place that says which transitions are legal.

/// Where a reservation is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Holds its quota; not placed yet (retried every 30 s).
    Pending,
    /// Booked; its window has not started.
    Scheduled,
    /// Booked; its window is running.
    Active,
    /// Ended early by its tenant; bookings end at the release.
    Released,
    /// Its window ended.
    Expired,
    /// Withdrawn before it started.
    Cancelled,
    /// Could not be honoured (the node was lost).
    Failed,
}

impl State {
    pub const ALL: [State; 7] = [
        State::Pending,
        State::Scheduled,
        State::Active,
        State::Released,
        State::Expired,
        State::Cancelled,
        State::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Scheduled => "scheduled",
            State::Active => "active",
            State::Released => "released",
            State::Expired => "expired",
            State::Cancelled => "cancelled",
            State::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }

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
pub fn allowed_from(action: Action) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = TRANSITIONS
        .iter()
        .filter(|(a, _, _)| *a == action)
        .map(|(_, from, _)| from.as_str())
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
        assert_eq!(allowed_from(Action::Cancel), vec!["pending", "scheduled"]);
        assert!(allowed(Action::Release, Active, Released));
        assert!(!allowed(Action::Release, Pending, Released));
    }
}
