//! The events the system writes, as a public contract: every type, and one payload type per
//! family, camelCase, with no internal field. Webhook bodies (`data`) and the `events`
//! subscription's `data` are these types serialized, whichever code path made the change (a
//! command, a reconciler's batch). `docs/webhooks.md` documents each; the snapshot test
//! `every_event_payload_keeps_its_documented_shape` pins their shapes, so renaming a row field
//! cannot change a webhook body silently.
//!
//! Row structs (`fleet::Node`, `reservations::Reservation`, …) do not derive `Serialize`: a
//! payload is built from a row here, field by field.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::condition::Condition;
use crate::enrollment::JoinToken;
use crate::fleet::model::{
    AtomKind, DeviceMode, Health, Labels, PoolKind, Reachability, Taint, TaintEffect,
};
use crate::fleet::state::NodeLifecycle;
use crate::fleet::{Device, Node, Pool, Site, commands::Holder};
use crate::ids::{
    AllocationId, AtomName, CommandId, DeviceId, InstanceId, JoinTokenId, NodeId, PoolId,
    ReservationId, ScopeId, SinkId, SiteId, TenantId,
};
use crate::instances::{Instance, State as InstanceState};
use crate::node_commands::{Command, Kind as CommandKind, State as CommandState};
use crate::quota::{Quota, QuotaResource};
use crate::reservations::model::Toleration;
use crate::reservations::state::State;
use crate::reservations::{Allocation, Reservation};
use crate::sinks::{Sink, SinkState};
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

impl From<&Site> for SiteView {
    fn from(s: &Site) -> Self {
        SiteView {
            id: s.id.clone(),
            name: s.name.clone(),
            region: s.region.clone(),
            version: s.version,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
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

impl From<&Pool> for PoolView {
    fn from(p: &Pool) -> Self {
        PoolView {
            id: p.id.clone(),
            site_id: p.site_id.clone(),
            name: p.name.clone(),
            kind: p.kind,
            lost_after_seconds: p.lost_after_seconds.map(|s| s as i64),
            overcommit: Overcommit {
                vcpu: p.vcpu_ratio,
                memory: p.memory_ratio,
                disk: p.disk_ratio,
            },
            version: p.version,
            created_at: p.created_at,
            updated_at: p.updated_at,
        }
    }
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

impl From<&Node> for NodeView {
    fn from(n: &Node) -> Self {
        NodeView {
            id: n.id.clone(),
            pool_id: n.pool_id.clone(),
            hostname: n.hostname.clone(),
            labels: n.labels.0.clone(),
            taints: n.taints.iter().map(TaintView::from).collect(),
            cordoned: n.cordoned,
            cordon_reason: n.cordon_reason.clone(),
            lifecycle: n.lifecycle,
            reachability: n.reachability,
            conditions: n.conditions.iter().map(ConditionView::from).collect(),
            generation: n.generation,
            observed_generation: n.observed_generation,
            joined_at: n.joined_at,
            retired_at: n.retired_at,
            version: n.version,
            updated_at: n.updated_at,
        }
    }
}

impl NodePayload {
    pub fn of(node: &Node) -> NodePayload {
        NodePayload {
            node: node.into(),
            devices: None,
            remaining: None,
            differences: None,
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

impl From<&Holder> for HolderView {
    fn from(h: &Holder) -> Self {
        HolderView {
            allocation_id: h.allocation_id.clone(),
            reason: h.reason,
            atoms: h.atoms.clone(),
            until: h.until,
        }
    }
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
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl From<&Device> for DeviceView {
    fn from(d: &Device) -> Self {
        let layout = d.layout.as_ref().map(|l| &l.0);
        DeviceView {
            id: d.id.clone(),
            compute_node_id: d.node_id.clone(),
            uuid: d.uuid.clone(),
            vendor: d.vendor.clone(),
            model: d.model.clone(),
            memory_mib: d.memory_mib,
            mode: d.mode,
            mig_profiles: layout.and_then(|l| l.profiles.clone()),
            slots: layout.and_then(|l| l.slots),
            health: d.health,
            health_reason: d.health_reason.clone(),
            health_since: d.health_since,
            quarantined: d.quarantined,
            quarantine_reason: d.quarantine_reason.clone(),
            inventory_mismatch: d.inventory_mismatch.clone(),
            retired_at: d.retired_at,
            version: d.version,
            created_at: d.created_at,
            updated_at: d.updated_at,
        }
    }
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
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
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

impl ReservationPayload {
    pub fn of(r: &Reservation, allocations: &[Allocation]) -> ReservationPayload {
        ReservationPayload {
            reservation: ReservationView {
                id: r.id.clone(),
                tenant_id: r.tenant_id.clone(),
                created_by: r.created_by.clone(),
                pool_id: r.pool_id.clone(),
                state: r.state,
                starts_at: r.starts_at,
                ends_at: r.ends_at,
                ended_at: r.ended_at,
                conditions: r.conditions.iter().map(ConditionView::from).collect(),
                gpu_charge: r.charge_gpu,
                vcpu_charge: r.charge_vcpu,
                memory_mib_charge: r.charge_memory_mib,
                next_attempt_at: r.next_attempt_at,
                version: r.version,
                created_at: r.created_at,
                updated_at: r.updated_at,
            },
            allocations: allocations
                .iter()
                .map(|a| AllocationView {
                    id: a.id.clone(),
                    ordinal: a.ordinal,
                    gpu_kind: a.gpu_kind,
                    gpu_count: a.gpu_count,
                    model: a.model.clone(),
                    profile: a.profile.clone(),
                    slots_per_gpu: a.slots_per_gpu,
                    vcpu: a.vcpu,
                    memory_mib: a.memory_mib,
                    disk_gib: a.disk_gib,
                    node_selector: a.node_selector.0.clone(),
                    tolerations: a.tolerations.iter().map(TolerationView::from).collect(),
                    compute_node_id: a.node_id.clone(),
                    atoms: a.atoms.clone(),
                })
                .collect(),
        }
    }
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
    pub state: SinkState,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl From<&Sink> for EventSinkView {
    fn from(s: &Sink) -> Self {
        EventSinkView {
            id: s.id.clone(),
            tenant_id: s.tenant_id.clone(),
            url: s.url.clone(),
            types: s.types.clone(),
            active: s.active,
            state: s.state,
            version: s.version,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

/// What an event is about, for readers that follow a pool or a node (the tailer's subscribers),
/// read from its typed payload instead of probing JSON keys.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Concerns {
    pub pool: Option<PoolId>,
    pub node: Option<NodeId>,
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

impl CommandPayload {
    pub fn of(c: &Command) -> CommandPayload {
        CommandPayload {
            command: CommandView {
                id: c.id.clone(),
                node_id: c.node_id.clone(),
                kind: c.kind,
                args: c.args.0.clone(),
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

impl InstancePayload {
    pub fn of(i: &Instance) -> InstancePayload {
        InstancePayload {
            instance: InstanceView {
                id: i.id.clone(),
                tenant_id: i.tenant_id.clone(),
                reservation_id: i.reservation_id.clone(),
                allocation_id: i.allocation_id.clone(),
                compute_node_id: i.node_id.clone(),
                image: i.image.clone(),
                command: i.command.clone(),
                env_names: i.env.0.keys().cloned().collect(),
                state: i.state,
                stop_requested: i.stop_requested,
                reason: i.reason.clone(),
                created_by: i.created_by.clone(),
                version: i.version,
                created_at: i.created_at,
                updated_at: i.updated_at,
                started_at: i.started_at,
                stopped_at: i.stopped_at,
                exit_code: i.exit_code,
                exit_signal: i.exit_signal,
                exited_at: i.exited_at,
            },
        }
    }
}

/// [`Concerns`] of an event of type `event_type` with payload `data`. An event of a type this
/// process does not know (written by a newer version) concerns nothing it follows.
pub fn concerns(event_type: &str, data: &serde_json::Value) -> Concerns {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct PoolRef {
        id: PoolId,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct NodeRef {
        id: NodeId,
        pool_id: PoolId,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct DeviceRef {
        compute_node_id: NodeId,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ReservationRef {
        pool_id: PoolId,
    }
    #[derive(Deserialize)]
    struct Of<T> {
        #[serde(
            alias = "pool",
            alias = "node",
            alias = "device",
            alias = "reservation"
        )]
        inner: T,
    }
    fn read<T: for<'de> Deserialize<'de>>(data: &serde_json::Value) -> Option<T> {
        serde_json::from_value::<Of<T>>(data.clone())
            .ok()
            .map(|o| o.inner)
    }
    let Some(t) = EventType::parse(event_type) else {
        return Concerns::default();
    };
    match t.family() {
        Family::Pool => Concerns {
            pool: read::<PoolRef>(data).map(|p| p.id),
            node: None,
        },
        Family::Node => read::<NodeRef>(data)
            .map(|n| Concerns {
                pool: Some(n.pool_id),
                node: Some(n.id),
            })
            .unwrap_or_default(),
        Family::Device => Concerns {
            pool: None,
            node: read::<DeviceRef>(data).map(|d| d.compute_node_id),
        },
        Family::Reservation => Concerns {
            pool: read::<ReservationRef>(data).map(|r| r.pool_id),
            node: None,
        },
        Family::JoinToken => Concerns {
            pool: data
                .pointer("/joinToken/poolId")
                .and_then(|p| p.as_str())
                .and_then(PoolId::from_trusted),
            node: None,
        },
        Family::Site
        | Family::Quota
        | Family::EventSink
        | Family::Command
        | Family::Instance
        | Family::Usage => Concerns::default(),
    }
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
