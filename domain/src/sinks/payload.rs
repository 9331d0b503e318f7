//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::Sink;
use crate::events::EventSinkView;

impl From<&Sink> for EventSinkView {
    fn from(s: &Sink) -> Self {
        EventSinkView {
            id: s.id.clone(),
            tenant_id: s.tenant_id.clone(),
            url: s.url.clone(),
            types: s.types.clone(),
            active: s.active,
            batch_size: s.batch_size,
            state: s.state,
            version: s.version,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}
