//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::JoinToken;
use crate::events::{JoinTokenPayload, JoinTokenView};

impl JoinTokenPayload {
    pub fn of(t: &JoinToken) -> JoinTokenPayload {
        JoinTokenPayload {
            join_token: JoinTokenView {
                id: t.id.clone(),
                pool_id: t.pool_id.clone(),
                labels: t.labels.0.clone(),
                state: t.state.clone(),
                expires_at: t.expires_at,
                created_by: t.created_by.clone(),
                created_at: t.created_at,
                used_at: t.used_at,
                compute_node_id: t.node_id.clone(),
                revoked_at: t.revoked_at,
                revoked_by: t.revoked_by.clone(),
            },
        }
    }
}
