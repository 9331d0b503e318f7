//! The command's kinds ([`Kind`]) and its state table: the one place that says which transitions are legal and who makes
//! them (`docs/commands.md`). Guarded updates test `commands.state = ANY(allowed_from(action))`
//! under the row lock, so two writers racing for one command cannot both move it.

use crate::text_enum::text_enum;

text_enum!(
    /// Where a command is in its life.
    State {
        /// Waiting for the node's session (and its `min_generation`).
        Pending = "pending",
        /// Sent to the node's current session; the daemon has not acknowledged it.
        Dispatched = "dispatched",
        /// The daemon acknowledged it and was told to proceed: it runs.
        Running = "running",
        /// The daemon reported success.
        Succeeded = "succeeded",
        /// The daemon reported a failure, or the control plane failed it (`JOURNAL_RESET`).
        Failed = "failed",
        /// An operator withdrew it before it ran.
        Cancelled = "cancelled",
    }
);

impl State {
    /// A terminal state has no way out.
    pub fn is_terminal(self) -> bool {
        matches!(self, State::Succeeded | State::Failed | State::Cancelled)
    }
}

/// What moves a command, and who does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The dispatcher (`compute-worker --role dispatch`, under the node's shard lease) sends it
    /// to the node's open session.
    Dispatch,
    /// The daemon acknowledges it (through its gateway, with its session's epoch) and is told
    /// to proceed.
    Ack,
    /// The daemon reports its outcome (`running`, or straight from `dispatched` when the daemon
    /// answers from its journal a command it finished in an earlier session).
    Finish,
    /// An operator withdraws it (`cancelCommand`) before the daemon runs it.
    Cancel,
    /// A new session of the node takes it back to be dispatched again: the daemon kept its
    /// journal (it answers from it what it already ran), or lost it and the command is
    /// retry-safe.
    Requeue,
    /// A new session whose daemon lost its journal fails what was in flight and is not
    /// retry-safe (`JOURNAL_RESET`), and what was sent to the lost journal and put back to
    /// `pending` by an earlier reconnection.
    JournalReset,
    /// The node was retired (`NODE_RETIRED`).
    Abandon,
}

impl Action {
    /// The action's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Action::Dispatch => "Dispatch",
            Action::Ack => "Ack",
            Action::Finish => "Finish",
            Action::Cancel => "Cancel",
            Action::Requeue => "Requeue",
            Action::JournalReset => "JournalReset",
            Action::Abandon => "Abandon",
        }
    }
}

use State::*;

/// The legal transitions: (action, from, to).
pub const TRANSITIONS: &[(Action, State, State)] = &[
    (Action::Dispatch, Pending, Dispatched),
    (Action::Ack, Dispatched, Running),
    (Action::Finish, Dispatched, Succeeded),
    (Action::Finish, Dispatched, Failed),
    (Action::Finish, Running, Succeeded),
    (Action::Finish, Running, Failed),
    (Action::Cancel, Pending, Cancelled),
    (Action::Cancel, Dispatched, Cancelled),
    (Action::Requeue, Dispatched, Pending),
    (Action::Requeue, Running, Pending),
    (Action::JournalReset, Pending, Failed),
    (Action::JournalReset, Dispatched, Failed),
    (Action::JournalReset, Running, Failed),
    (Action::Abandon, Pending, Failed),
    (Action::Abandon, Dispatched, Failed),
    (Action::Abandon, Running, Failed),
];

/// The states `action` may start from.
pub fn allowed_from(action: Action) -> Vec<State> {
    let mut v: Vec<State> = TRANSITIONS
        .iter()
        .filter(|(a, _, _)| *a == action)
        .map(|(_, from, _)| *from)
        .collect();
    v.dedup();
    v
}

/// [`allowed_from`] as stored text, for `= ANY($n)`.
pub fn stored_from(action: Action) -> Vec<&'static str> {
    allowed_from(action)
        .into_iter()
        .map(State::as_str)
        .collect()
}

/// Whether `action` may move a command from `from` to `to`.
pub fn allowed(action: Action, from: State, to: State) -> bool {
    TRANSITIONS.contains(&(action, from, to))
}

text_enum!(
    /// What a command asks a daemon to do.
    Kind {
        /// Apply the node's spec at `args.generation` (made by the control plane when the
        /// generation moves), then report it as `observedGeneration`.
        ApplySpec = "apply_spec",
        /// Reset one GPU (`args.device`).
        ResetGpu = "reset_gpu",
        /// Repartition a GPU's MIG instances (`args.device`, `args.layout`).
        SetMigLayout = "set_mig_layout",
        /// Stop the workloads running on the node.
        DrainWorkloads = "drain_workloads",
        /// Start an instance's workload.
        RunInstance = "run_instance",
        /// Stop an instance's workload.
        StopInstance = "stop_instance",
        /// Does nothing (tests, and checking the path to a node).
        Noop = "noop",
    }
);

impl Kind {
    /// Whether running it twice is harmless, unless the request says otherwise.
    pub fn retry_safe_by_default(self) -> bool {
        matches!(
            self,
            Kind::ApplySpec | Kind::DrainWorkloads | Kind::StopInstance | Kind::Noop
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_way_out_and_running_cannot_be_cancelled() {
        for (_, from, _) in TRANSITIONS {
            assert!(
                !from.is_terminal(),
                "{from:?} is terminal but has a way out"
            );
        }
        assert_eq!(allowed_from(Action::Cancel), vec![Pending, Dispatched]);
        assert!(!allowed(Action::Cancel, Running, Cancelled));
        assert!(allowed(Action::Finish, Dispatched, Succeeded));
        assert!(!allowed(Action::Ack, Pending, Running));
    }
}
