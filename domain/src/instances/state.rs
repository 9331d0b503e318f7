//! The instance state table: the one place that says which transitions are legal and who makes
//! them (`docs/instances.md`).

use crate::text_enum::text_enum;

text_enum!(
    /// Where an instance is in its life.
    State {
        /// Its `run_instance` command is on its way (or waits for its reservation's start).
        Provisioning = "provisioning",
        /// The daemon started its workload.
        Running = "running",
        /// Its reservation ended or it was asked to stop: its `stop_instance` command is on
        /// its way.
        Stopping = "stopping",
        /// Its workload stopped (or never started, when it stopped while provisioning).
        Stopped = "stopped",
        /// Its workload could not start, or could not be stopped cleanly (`reason`).
        Failed = "failed",
        /// Its workload ended on its own (`exit_code` or `exit_signal`, `exited_at`); it is
        /// not started again.
        Exited = "exited",
    }
);

impl State {
    /// A terminal state has no way out.
    pub fn is_terminal(self) -> bool {
        matches!(self, State::Stopped | State::Failed | State::Exited)
    }
}

/// What moves an instance. Every move is the workflow's (the `instance` work-queue item), from
/// what its commands and its reservation say; `stopInstance` only asks for `Stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Its `run_instance` command succeeded.
    Start,
    /// Its reservation ended, or `stopInstance` asked.
    Stop,
    /// Nothing runs any more: the `stop_instance` command succeeded, or the workload never
    /// started.
    Finish,
    /// `run_instance` or `stop_instance` failed.
    Fail,
    /// The daemon reported that the workload ended on its own.
    Exit,
}

use State::*;

/// The legal transitions: (action, from, to).
pub const TRANSITIONS: &[(Action, State, State)] = &[
    (Action::Start, Provisioning, Running),
    (Action::Stop, Provisioning, Stopping),
    (Action::Stop, Running, Stopping),
    (Action::Finish, Stopping, Stopped),
    (Action::Fail, Provisioning, Failed),
    (Action::Fail, Stopping, Failed),
    (Action::Exit, Running, Exited),
];

/// Whether `action` may move an instance from `from` to `to`.
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
                "{from:?} is terminal but has a way out"
            );
        }
        assert!(allowed(Action::Stop, Running, Stopping));
        assert!(!allowed(Action::Start, Stopping, Running));
    }
}
