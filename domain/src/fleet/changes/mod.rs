//! Operator changes to the fleet. Each runs in one `Db::tx`, writes its outbox event in the same
//! transaction, and takes its locks in the order of `docs/database-locks.md`:
//! quota_usage, pools, nodes, devices, node_resources, pool_capacity_rollup (bookings after
//! devices). Updates are guarded (`WHERE version = $v`, `lifecycle = ANY(…)`); zero rows is
//! explained as `NOT_FOUND` or `CONFLICT` by a read that follows.

use serde_json::{Value, json};
use sqlx::PgConnection;
use sqlx::types::Json;

use super::model::{AtomSpec, Labels, Layout, PoolKind, Taint, TaintEffect};
use super::state::{NodeAction, NodeLifecycle, allowed_from};
use super::{
    DEVICE_COLS, Device, NODE_COLS, Node, Pool, PoolRules, Site, query_devices, query_nodes,
    query_pools, query_sites,
};
use crate::db::{Db, TxKind};
use crate::error::{Error, Result};
use crate::events::{
    self, DevicePayload, DeviceView, EventType, HolderView, NodePayload, PoolPayload, SitePayload,
};
use crate::idempotency::{self, Actor, Claim, Outcome};
use crate::ids::{AllocationId, AtomName, DeviceId, NodeId, PoolId, SiteId};
use crate::outbox::{self, NewEvent};

use crate::error::on_constraint;

fn conflict(message: impl Into<String>, current_version: Option<i64>) -> Error {
    Error::Conflict {
        message: message.into(),
        current_version,
    }
}

/// Writes a fleet event (operators only: no tenant) with its family's payload.
async fn emit(
    conn: &mut PgConnection,
    event_type: EventType,
    subject: &impl AsRef<str>,
    payload: &impl serde::Serialize,
) -> Result<()> {
    outbox::emit(
        conn,
        NewEvent {
            event_type,
            tenant_id: None,
            subject: subject.as_ref(),
            data: events::to_data(payload)?,
        },
    )
    .await?;
    Ok(())
}

/// Explains why a guarded update of `table` matched no row.
async fn explain_miss(
    conn: &mut PgConnection,
    table: &'static str,
    kind: &'static str,
    id: &str,
    expected_version: Option<i64>,
) -> Error {
    // Dynamic over the table (sites, pools, devices), so not a checked statement.
    let found: std::result::Result<Option<i64>, sqlx::Error> =
        sqlx::query_scalar(&format!("SELECT version FROM {table} WHERE id = $1"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await;
    match found {
        Err(e) => e.into(),
        Ok(None) => Error::NotFound {
            kind,
            id: id.to_owned(),
        },
        Ok(Some(current)) => match expected_version {
            Some(expected) if expected != current => Error::StaleVersion {
                kind,
                id: id.to_owned(),
                expected,
                current,
            },
            _ => Error::PreconditionFailed {
                kind,
                id: id.to_owned(),
                current_version: current,
            },
        },
    }
}

/// Explains why a guarded update of a node matched no row, naming an illegal transition.
async fn explain_node_miss(
    conn: &mut PgConnection,
    id: &str,
    expected_version: Option<i64>,
    action: NodeAction,
) -> Error {
    let found = sqlx::query!(
        r#"SELECT version, lifecycle AS "lifecycle: NodeLifecycle" FROM nodes WHERE id = $1"#,
        id,
    )
    .fetch_optional(&mut *conn)
    .await
    .map(|r| r.map(|r| (r.version, r.lifecycle)));
    match found {
        Ok(Some((current, lifecycle))) if !allowed_from(action).contains(&lifecycle) => {
            Error::IllegalTransition {
                kind: "compute node",
                id: id.to_owned(),
                state: lifecycle.as_str(),
                action: action.name(),
                current_version: Some(current),
                hint: None,
            }
        }
        _ => explain_miss(conn, "nodes", "compute node", id, expected_version).await,
    }
}

mod devices;
mod inventory;
mod nodes;
mod pools;
mod rollup;
mod sites;

pub use devices::*;
pub use inventory::{
    DEVICE_UNHEALTHY, INVENTORY_MISMATCH, accept_node_inventory, report_health, report_inventory,
};
pub use nodes::*;
pub use pools::*;
pub use rollup::recompute_rollup;
pub use sites::*;

use rollup::{Change, adjust_rollup, lock_pool_of_device, lock_pool_of_node, wake_rollup_check};
