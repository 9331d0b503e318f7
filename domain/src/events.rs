//! The events the system writes, as a public contract: every type, and one payload type per
//! family, camelCase, with no internal field. Webhook bodies (`data`) and the `events`
//! subscription's `data` are these types serialized, whichever code path made the change (a
//! command, a reconciler's batch). `docs/webhooks.md` documents each; the snapshot test
//! `every_event_payload_keeps_its_documented_shape` pins their shapes, so renaming a row field
//! cannot change a webhook body silently.
//!
//! Row structs (`fleet::Node`, `reservations::Reservation`, …) do not derive `Serialize`: a
//! payload is built from a row field by field, in the aggregate's `payload.rs`, beside the row.
//! This module is a leaf of the domain: it names only the aggregates' `model` and `state`
//! leaves (the enums a payload holds), never their rows, so no aggregate's import of the
//! contract closes a circle (`domain_modules_form_no_cycle`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::condition::Condition;
use crate::fleet::model::{
    AtomKind, DeviceMode, Health, Labels, PoolKind, Reachability, Taint, TaintEffect,
};
use crate::fleet::state::NodeLifecycle;
use crate::ids::{
    AllocationId, AtomName, CommandId, DeviceId, GrantId, InstanceId, JoinTokenId, NodeId, PoolId,
    ReservationId, ScopeId, SinkId, SiteId, TenantId,
};
use crate::instances::state::State as InstanceState;
use crate::node_commands::state::{Kind as CommandKind, State as CommandState};
use crate::quota::model::QuotaResource;
use crate::reservations::model::{Colocate, Toleration};
use crate::reservations::state::State;
use crate::sinks::model::SinkState;
use crate::text_enum::text_enum;

text_enum!(
    /// Every event type the system writes (`outbox.type`).
    EventType {
        SiteCreated = "site.created",
        SiteUpdated = "site.updated",
        PoolCreated = "pool.created",
        PoolUpdated = "pool.updated",
        NodeRegistered = "node.registered",
        NodeUpdated = "node.updated",
        NodeCordoned = "node.cordoned",
        NodeUncordoned = "node.uncordoned",
        NodeTainted = "node.tainted",
        NodeUntainted = "node.untainted",
        NodeDrained = "node.drained",
        NodeRetired = "node.retired",
        NodeConnected = "node.connected",
        NodeDisconnected = "node.disconnected",
        NodeUnreachable = "node.unreachable",
        NodeLost = "node.lost",
        NodeCredentialRevoked = "node.credential_revoked",
        NodeInventoryMismatch = "node.inventory_mismatch",
        NodeInventoryMatched = "node.inventory_matched",
        JoinTokenCreated = "join_token.created",
        JoinTokenRevoked = "join_token.revoked",
        JoinTokenUsed = "join_token.used",
        DeviceHealthChanged = "device.health_changed",
        DeviceQuarantined = "device.quarantined",
        DeviceUnquarantined = "device.unquarantined",
        DeviceModeChanged = "device.mode_changed",
        DeviceRetired = "device.retired",
        ReservationPending = "reservation.pending",
        ReservationScheduled = "reservation.scheduled",
        ReservationActive = "reservation.active",
        ReservationExtended = "reservation.extended",
        ReservationIdle = "reservation.idle",
        ReservationConditionsChanged = "reservation.conditions_changed",
        ReservationReleased = "reservation.released",
        ReservationCancelled = "reservation.cancelled",
        ReservationExpired = "reservation.expired",
        ReservationFailed = "reservation.failed",
        QuotaSet = "quota.set",
        EventSinkCreated = "event_sink.created",
        EventSinkUpdated = "event_sink.updated",
        EventSinkDeleted = "event_sink.deleted",
        CommandCreated = "command.created",
        CommandDispatched = "command.dispatched",
        CommandRunning = "command.running",
        CommandProgress = "command.progress",
        CommandSucceeded = "command.succeeded",
        CommandFailed = "command.failed",
        CommandCancelled = "command.cancelled",
        CommandRequeued = "command.requeued",
        InstanceProvisioning = "instance.provisioning",
        InstanceRunning = "instance.running",
        InstanceStopping = "instance.stopping",
        InstanceStopped = "instance.stopped",
        InstanceFailed = "instance.failed",
        InstanceExited = "instance.exited",
        UsageWindowClosed = "usage.window_closed",
        UsageWindowAdjusted = "usage.window_adjusted",
        AuthzGranted = "authz.granted",
        AuthzRevoked = "authz.revoked",
    }
);

/// The payload family of an event type: each family has one payload type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Site,
    Pool,
    Node,
    Device,
    Reservation,
    Quota,
    EventSink,
    Command,
    Instance,
    Usage,
    JoinToken,
    Authz,
}

impl EventType {
    pub fn family(self) -> Family {
        match self.as_str().split('.').next() {
            Some("site") => Family::Site,
            Some("pool") => Family::Pool,
            Some("node") => Family::Node,
            Some("device") => Family::Device,
            Some("reservation") => Family::Reservation,
            Some("quota") => Family::Quota,
            Some("command") => Family::Command,
            Some("instance") => Family::Instance,
            Some("usage") => Family::Usage,
            Some("join_token") => Family::JoinToken,
            Some("authz") => Family::Authz,
            _ => Family::EventSink,
        }
    }

    /// The event a reservation's move to `state` writes.
    pub fn of_reservation(state: State) -> EventType {
        match state {
            State::Pending => EventType::ReservationPending,
            State::Scheduled => EventType::ReservationScheduled,
            State::Active => EventType::ReservationActive,
            State::Released => EventType::ReservationReleased,
            State::Expired => EventType::ReservationExpired,
            State::Cancelled => EventType::ReservationCancelled,
            State::Failed => EventType::ReservationFailed,
        }
    }
}

/// `site.*`: the site after the change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SitePayload {
    pub site: SiteView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SiteView {
    pub id: SiteId,
    pub name: String,
    pub region: Option<String>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// `pool.*`: the pool after the change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolPayload {
    pub pool: PoolView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolView {
    pub id: PoolId,
    pub site_id: SiteId,
    pub name: String,
    pub kind: PoolKind,
    pub lost_after_seconds: Option<i64>,
    pub overcommit: Overcommit,
    /// Its rules against hoarding (`{}` when it has none; absent from events written before
    /// migration 0034).
    #[serde(default)]
    pub rules: crate::fleet::model::PoolRules,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Overcommit {
    pub vcpu: f64,
    pub memory: f64,
    pub disk: f64,
}

/// `node.*`: the node after the change; `devices` in `node.registered`, `remaining` (what
/// still holds its GPUs) in `node.drained`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodePayload {
    pub node: NodeView,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<DeviceView>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<Vec<HolderView>>,
    /// `node.inventory_mismatch`: how what the node reports differs from its registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differences: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeView {
    pub id: NodeId,
    pub pool_id: PoolId,
    pub hostname: String,
    pub labels: Labels,
    pub taints: Vec<TaintView>,
    pub cordoned: bool,
    pub cordon_reason: Option<String>,
    pub lifecycle: NodeLifecycle,
    pub reachability: Reachability,
    pub conditions: Vec<ConditionView>,
    pub generation: i64,
    pub observed_generation: i64,
    pub joined_at: DateTime<Utc>,
    pub retired_at: Option<DateTime<Utc>>,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TaintView {
    pub key: String,
    pub value: String,
    pub effect: TaintEffect,
}

impl From<&Taint> for TaintView {
    fn from(t: &Taint) -> Self {
        TaintView {
            key: t.key.clone(),
            value: t.value.clone(),
            effect: t.effect,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConditionView {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: crate::condition::ConditionStatus,
    pub reason: Option<String>,
    pub message: Option<String>,
    pub since: Option<DateTime<Utc>>,
    /// For `Unschedulable`: nodes ruled out per reason; absent when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counts: Vec<crate::condition::ReasonCount>,
}

impl From<&Condition> for ConditionView {
    fn from(c: &Condition) -> Self {
        ConditionView {
            kind: c.kind.clone(),
            status: c.status,
            reason: c.reason.clone(),
            message: c.message.clone(),
            since: c.since,
            counts: c.counts.clone(),
        }
    }
}

/// A booking that still holds atoms of a drained node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HolderView {
    /// `null` for a maintenance hold (a mode change).
    pub allocation_id: Option<AllocationId>,
    pub reason: crate::fleet::model::BookingReason,
    pub atoms: Vec<AtomName>,
    pub until: Option<DateTime<Utc>>,
}

/// `device.*`: the GPU after the change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DevicePayload {
    pub device: DeviceView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceView {
    pub id: DeviceId,
    pub compute_node_id: NodeId,
    pub uuid: String,
    pub vendor: String,
    pub model: String,
    pub memory_mib: i64,
    pub mode: DeviceMode,
    /// MIG mode: the profiles of its instances, in order.
    pub mig_profiles: Option<Vec<String>>,
    /// Time-slice and MPS modes: the slot count.
    pub slots: Option<u32>,
    pub health: Health,
    pub health_reason: Option<String>,
    pub health_since: Option<DateTime<Utc>>,
    pub quarantined: bool,
    pub quarantine_reason: Option<String>,
    pub inventory_mismatch: Option<String>,
    pub retired_at: Option<DateTime<Utc>>,
    /// Topology (migration 0036), as the node's daemon reported it or the operator registered it.
    pub pci_bus_id: Option<String>,
    pub numa_node: Option<i32>,
    pub nvlink_domain: Option<String>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// `join_token.*`: the token after the change (never its secret).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenPayload {
    pub join_token: JoinTokenView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenView {
    pub id: JoinTokenId,
    pub pool_id: PoolId,
    pub labels: Labels,
    pub state: String,
    pub expires_at: DateTime<Utc>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub used_at: Option<DateTime<Utc>>,
    pub compute_node_id: Option<NodeId>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub revoked_by: Option<String>,
}

/// `reservation.*`: the reservation after the change, with its allocations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationPayload {
    pub reservation: ReservationView,
    pub allocations: Vec<AllocationView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationView {
    pub id: ReservationId,
    pub tenant_id: TenantId,
    pub created_by: String,
    pub pool_id: PoolId,
    /// As time says when the event was written (`docs/reservations.md`).
    pub state: State,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
    pub conditions: Vec<ConditionView>,
    pub gpu_charge: f64,
    pub vcpu_charge: i64,
    pub memory_mib_charge: i64,
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The gang's rule it was placed under; `null` for a reservation that is not a gang.
    pub gang: Option<GangView>,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A gang's rule: its allocations on one node or on nodes sharing one value of `label`
/// (`colocate`), and/or each on a node of its own (`spread`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GangView {
    pub colocate: Option<Colocate>,
    pub label: Option<String>,
    pub spread: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocationView {
    pub id: AllocationId,
    pub ordinal: i32,
    pub gpu_kind: AtomKind,
    pub gpu_count: i32,
    pub model: Option<String>,
    pub profile: Option<String>,
    pub slots_per_gpu: Option<i32>,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub node_selector: Labels,
    pub tolerations: Vec<TolerationView>,
    /// Its GPUs on one NVLink domain, on one NUMA node (migration 0036).
    pub same_nvlink_domain: bool,
    pub same_numa_node: bool,
    /// Where it was placed; `null` while pending.
    pub compute_node_id: Option<NodeId>,
    pub atoms: Vec<AtomName>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TolerationView {
    pub key: String,
    pub value: Option<String>,
    pub effect: Option<TaintEffect>,
}

impl From<&Toleration> for TolerationView {
    fn from(t: &Toleration) -> Self {
        TolerationView {
            key: t.key.clone(),
            value: t.value.clone(),
            effect: t.effect,
        }
    }
}

/// `authz.granted` and `authz.revoked`: a principal's grant given or taken away.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthzPayload {
    /// The principal's issuer (`compute:service-account` for a service account).
    pub issuer: String,
    /// The principal's subject: a token's `sub`, or a service account's id.
    pub subject: String,
    /// The grant given or taken; null when a revocation found none and only made the principal
    /// managed (its token's claims stopped counting).
    pub grant: Option<GrantView>,
    /// Who made the change.
    pub by: String,
}

/// A grant as events carry it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantView {
    pub id: GrantId,
    pub issuer: String,
    pub subject: String,
    /// `admin`, `operator` or `member`.
    pub role: String,
    pub tenant_id: Option<TenantId>,
    pub scope_id: Option<ScopeId>,
    pub granted_by: String,
    pub granted_at: DateTime<Utc>,
}

/// `quota.set`: the tenant's limits on one pool or site after the change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaPayload {
    pub tenant_id: TenantId,
    pub scope_id: ScopeId,
    pub quotas: Vec<QuotaView>,
    /// The subject of the operator's token.
    pub set_by: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaView {
    pub resource: QuotaResource,
    pub max: f64,
    pub used: f64,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
}

/// `event_sink.*`: the sink after the change (before it, for `event_sink.deleted`). Never its
/// secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventSinkPayload {
    pub event_sink: EventSinkView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventSinkView {
    pub id: SinkId,
    pub tenant_id: Option<TenantId>,
    pub url: String,
    pub types: Vec<String>,
    pub active: bool,
    /// Events per POST (1: each alone).
    pub batch_size: i32,
    pub state: SinkState,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// `command.*`: the command after the change (its arguments, result and error included; the
/// session it was dispatched under as epoch and journal).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandPayload {
    pub command: CommandView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandView {
    pub id: CommandId,
    pub node_id: NodeId,
    pub kind: CommandKind,
    pub args: serde_json::Value,
    pub min_generation: i64,
    pub retry_safe: bool,
    pub state: CommandState,
    pub attempts: i32,
    pub progress: Option<serde_json::Value>,
    pub result: Option<serde_json::Value>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub session_epoch: Option<i64>,
    pub journal_id: Option<String>,
    pub created_by: String,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// `instance.*`: the instance after the change. Never its `env` (it may hold the tenant's
/// secrets): only the variables' names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstancePayload {
    pub instance: InstanceView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceView {
    pub id: InstanceId,
    pub tenant_id: TenantId,
    pub reservation_id: ReservationId,
    pub allocation_id: AllocationId,
    pub compute_node_id: NodeId,
    pub image: String,
    pub command: Vec<String>,
    pub env_names: Vec<String>,
    pub state: InstanceState,
    pub stop_requested: bool,
    pub reason: Option<String>,
    pub created_by: String,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub started_at: Option<DateTime<Utc>>,
    pub stopped_at: Option<DateTime<Utc>>,
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    pub exited_at: Option<DateTime<Utc>>,
}

/// `usage.*`: one usage record of a window (`usage.window_closed`: the window's record;
/// `usage.window_adjusted`: a difference found after it closed). Built in SQL
/// (`compute_usage_payload`, migration 0016), read back with this type by the contract test.
/// Amounts are exact decimal strings (at most six decimals), never floats; `key` is the record's
/// idempotency key (`cmp:<allocationId>:<windowStart>`, `…:adj:<n>` for an adjustment).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsagePayload {
    pub usage: UsageView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageView {
    pub key: String,
    /// `window` or `adjustment`.
    pub kind: String,
    pub allocation_id: AllocationId,
    pub reservation_id: ReservationId,
    pub tenant_id: TenantId,
    pub pool_id: PoolId,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub model: String,
    pub gpu_kind: AtomKind,
    pub profile: Option<String>,
    pub atoms: i32,
    pub booked_seconds: String,
    pub gpu_seconds: String,
    pub vcpu_seconds: String,
    pub memory_mib_seconds: String,
    pub disk_gib_seconds: String,
    pub created_at: DateTime<Utc>,
}

/// A payload as the JSON an event stores.
pub fn to_data(payload: &impl Serialize) -> crate::Result<serde_json::Value> {
    serde_json::to_value(payload).map_err(crate::Error::internal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_type_has_a_family_named_by_its_prefix() {
        for t in EventType::ALL {
            let prefix = t.as_str().split('.').next().unwrap_or_default();
            let family = format!("{:?}", t.family()).to_lowercase();
            assert_eq!(
                family
                    .replace("eventsink", "event_sink")
                    .replace("jointoken", "join_token"),
                prefix,
                "{t}"
            );
        }
    }
}
