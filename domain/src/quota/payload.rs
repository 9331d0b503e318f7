//! The event payloads of this aggregate's rows (the views of `crate::events`, the event
//! contract), built field by field: the contract stays in one file, its conversions live
//! beside the rows they read.

use super::Quota;
use crate::events::QuotaView;

impl From<&Quota> for QuotaView {
    fn from(q: &Quota) -> Self {
        QuotaView {
            resource: q.resource,
            max: q.max_amount,
            used: q.used,
            version: q.version,
            updated_at: q.updated_at,
        }
    }
}
