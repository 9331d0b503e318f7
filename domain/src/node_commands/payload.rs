//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::Command;
use crate::events::{CommandPayload, CommandView};

impl CommandPayload {
    pub fn of(c: &Command) -> CommandPayload {
        CommandPayload {
            command: CommandView {
                id: c.id.clone(),
                node_id: c.node_id.clone(),
                kind: c.kind,
                args: c.shown_args(),
                min_generation: c.min_generation,
                retry_safe: c.retry_safe,
                state: c.state,
                attempts: c.attempts,
                progress: c.progress.as_ref().map(|p| p.0.clone()),
                result: c.result.as_ref().map(|r| r.0.clone()),
                error_code: c.error_code.clone(),
                error_message: c.error_message.clone(),
                session_epoch: c.session_epoch,
                journal_id: c.journal_id.clone(),
                created_by: c.created_by.clone(),
                version: c.version,
                created_at: c.created_at,
                updated_at: c.updated_at,
                finished_at: c.finished_at,
            },
        }
    }
}
