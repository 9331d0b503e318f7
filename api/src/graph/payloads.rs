//! `Event.payload`: the event's data as a typed union, one member per event family, so code
//! generators (graphql-codegen, the Relay compiler, Apollo's, graphql_client) produce types
//! for subscribers. Each member holds what `Event.data` holds, field for field: the payload
//! types of `compute_domain::events`, which the webhook bodies also are (`docs/webhooks.md`).
//! A snapshot is the subject as the event saw it, not as it is now: these types resolve
//! nothing from the database.

use async_graphql::{ID, Json, SimpleObject, Union};
use chrono::{DateTime, Utc};
use compute_domain::events::{self as ev, EventType, Family};

use crate::graph::commands::{CommandKind, CommandState};
use crate::graph::common::{AtomKind, Condition, conditions_of_views};
use crate::graph::fleet::{
    DeviceHealth, DeviceMode, Label, NodeLifecycle, PoolKind, QuotaResource, Reachability, Taint,
    labels_of, taint,
};
use crate::graph::instances::InstanceState;
use crate::graph::reservations::ReservationState;
use crate::graph::sinks::EventSinkState;

/// What an event carries, typed by its family (`site.*`, `pool.*`, `node.*`, …). Select the
/// members you need with `... on ReservationEventPayload { reservation { state } }`.
#[derive(Union)]
pub enum EventPayload {
    Site(SiteEventPayload),
    Pool(PoolEventPayload),
    Node(NodeEventPayload),
    Device(DeviceEventPayload),
    Reservation(ReservationEventPayload),
    Quota(QuotaEventPayload),
    EventSink(EventSinkEventPayload),
    Command(CommandEventPayload),
    Instance(InstanceEventPayload),
    Usage(UsageEventPayload),
    JoinToken(NodeJoinTokenEventPayload),
    Authz(AuthzEventPayload),
}

/// The typed payload of an event of `event_type` whose data is `data`: `None` for a type this
/// build does not know; `Err` says why the data is not its type's payload (a bug of ours:
/// every event is written from these types).
pub fn payload(event_type: &str, data: &serde_json::Value) -> Result<Option<EventPayload>, String> {
    let Some(kind) = EventType::parse(event_type) else {
        return Ok(None);
    };
    fn de<T: serde::de::DeserializeOwned>(data: &serde_json::Value) -> Result<T, String> {
        serde_json::from_value(data.clone()).map_err(|e| e.to_string())
    }
    Ok(Some(match kind.family() {
        Family::Site => EventPayload::Site(de::<ev::SitePayload>(data)?.into()),
        Family::Pool => EventPayload::Pool(de::<ev::PoolPayload>(data)?.into()),
        Family::Node => EventPayload::Node(de::<ev::NodePayload>(data)?.into()),
        Family::Device => EventPayload::Device(de::<ev::DevicePayload>(data)?.into()),
        Family::Reservation => {
            EventPayload::Reservation(de::<ev::ReservationPayload>(data)?.into())
        }
        Family::Quota => EventPayload::Quota(de::<ev::QuotaPayload>(data)?.into()),
        Family::EventSink => EventPayload::EventSink(de::<ev::EventSinkPayload>(data)?.into()),
        Family::Command => EventPayload::Command(de::<ev::CommandPayload>(data)?.into()),
        Family::Instance => EventPayload::Instance(de::<ev::InstancePayload>(data)?.into()),
        Family::Usage => EventPayload::Usage(de::<ev::UsagePayload>(data)?.into()),
        Family::JoinToken => EventPayload::JoinToken(de::<ev::JoinTokenPayload>(data)?.into()),
        Family::Authz => EventPayload::Authz(de::<ev::AuthzPayload>(data)?.into()),
    }))
}

fn id(v: &impl std::fmt::Display) -> ID {
    ID(v.to_string())
}

/// `site.*`: the site after the change.
#[derive(SimpleObject)]
pub struct SiteEventPayload {
    /// The site.
    site: SiteSnapshot,
}

/// A site as an event saw it.
#[derive(SimpleObject)]
pub struct SiteSnapshot {
    /// The site's id (`site_…`).
    id: ID,
    /// Its name.
    name: String,
    /// Its region, if any.
    region: Option<String>,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

impl From<ev::SitePayload> for SiteEventPayload {
    fn from(p: ev::SitePayload) -> Self {
        let s = p.site;
        SiteEventPayload {
            site: SiteSnapshot {
                id: id(&s.id),
                name: s.name,
                region: s.region,
                version: s.version,
                created_at: s.created_at,
                updated_at: s.updated_at,
            },
        }
    }
}

/// `pool.*`: the pool after the change.
#[derive(SimpleObject)]
pub struct PoolEventPayload {
    /// The pool.
    pool: PoolSnapshot,
}

/// A pool as an event saw it.
#[derive(SimpleObject)]
pub struct PoolSnapshot {
    /// The pool's id (`pool_…`).
    id: ID,
    /// Its site's id.
    site_id: ID,
    /// Its name.
    name: String,
    /// What its machines are.
    kind: PoolKind,
    /// Seconds after which an unreachable node of the pool is lost, if set.
    lost_after_seconds: Option<i64>,
    /// vCPU overcommit ratio.
    vcpu_ratio: f64,
    /// Memory overcommit ratio.
    memory_ratio: f64,
    /// Disk overcommit ratio.
    disk_ratio: f64,
    /// Its rules against hoarding after the change.
    rules: crate::graph::fleet::PoolRulesObj,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

impl From<ev::PoolPayload> for PoolEventPayload {
    fn from(p: ev::PoolPayload) -> Self {
        let s = p.pool;
        PoolEventPayload {
            pool: PoolSnapshot {
                id: id(&s.id),
                site_id: id(&s.site_id),
                name: s.name,
                kind: s.kind.into(),
                lost_after_seconds: s.lost_after_seconds,
                vcpu_ratio: s.overcommit.vcpu,
                memory_ratio: s.overcommit.memory,
                disk_ratio: s.overcommit.disk,
                rules: (&s.rules).into(),
                version: s.version,
                created_at: s.created_at,
                updated_at: s.updated_at,
            },
        }
    }
}

/// `node.*`: the node after the change; `node.registered` and the `node.updated` of an
/// accepted inventory also carry its devices, `node.drained` what still holds it.
#[derive(SimpleObject)]
pub struct NodeEventPayload {
    /// The node.
    node: NodeSnapshot,
    /// Its devices: all of them on `node.registered` and on the `node.updated` of an accepted
    /// inventory (`acceptNodeInventory`); on `node.inventory_mismatch` and
    /// `node.inventory_matched`, those whose mismatch changed (null when none did); null
    /// otherwise.
    devices: Option<Vec<DeviceSnapshot>>,
    /// What still holds its atoms (`node.drained` only; null otherwise).
    remaining: Option<Vec<HolderSnapshot>>,
    /// How what the node reports differs from its registration (`node.inventory_mismatch`
    /// and `node.inventory_matched`, empty then; null otherwise).
    differences: Option<Vec<String>>,
}

/// A compute node as an event saw it.
#[derive(SimpleObject)]
pub struct NodeSnapshot {
    /// The node's id (`node_…`).
    id: ID,
    /// Its pool's id.
    pool_id: ID,
    /// Host name.
    hostname: String,
    /// Labels, sorted by key.
    labels: Vec<Label>,
    /// Its taints: placement avoids them unless tolerated.
    taints: Vec<Taint>,
    /// Whether it takes no new work.
    cordoned: bool,
    /// Why it was cordoned.
    cordon_reason: Option<String>,
    /// Its lifecycle.
    lifecycle: NodeLifecycle,
    /// Whether its daemon is connected.
    reachability: Reachability,
    /// Its conditions.
    conditions: Vec<Condition>,
    /// The generation of its spec.
    generation: i64,
    /// The generation its daemon last reported applied.
    observed_generation: i64,
    /// When it joined.
    joined_at: DateTime<Utc>,
    /// When it was retired, if it was.
    retired_at: Option<DateTime<Utc>>,
    /// Its version after the change.
    version: i64,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

/// What holds atoms of a draining node.
#[derive(SimpleObject)]
pub struct HolderSnapshot {
    /// The allocation holding them, if an allocation does.
    allocation_id: Option<ID>,
    /// `allocation` or `mode_change`.
    reason: String,
    /// The atoms held.
    atoms: Vec<String>,
    /// Until when, if bounded.
    until: Option<DateTime<Utc>>,
}

impl From<ev::NodePayload> for NodeEventPayload {
    fn from(p: ev::NodePayload) -> Self {
        let n = p.node;
        NodeEventPayload {
            node: NodeSnapshot {
                id: id(&n.id),
                pool_id: id(&n.pool_id),
                hostname: n.hostname,
                labels: labels_of(&n.labels),
                taints: n
                    .taints
                    .into_iter()
                    .map(|t| taint(t.key, t.value, t.effect.into()))
                    .collect(),
                cordoned: n.cordoned,
                cordon_reason: n.cordon_reason,
                lifecycle: n.lifecycle.into(),
                reachability: n.reachability.into(),
                conditions: conditions_of_views(&n.conditions),
                generation: n.generation,
                observed_generation: n.observed_generation,
                joined_at: n.joined_at,
                retired_at: n.retired_at,
                version: n.version,
                updated_at: n.updated_at,
            },
            devices: p
                .devices
                .map(|d| d.into_iter().map(DeviceSnapshot::from).collect()),
            remaining: p.remaining.map(|r| {
                r.into_iter()
                    .map(|h| HolderSnapshot {
                        allocation_id: h.allocation_id.as_ref().map(id),
                        reason: h.reason.as_str().to_owned(),
                        atoms: h.atoms.iter().map(ToString::to_string).collect(),
                        until: h.until,
                    })
                    .collect()
            }),
            differences: p.differences,
        }
    }
}

/// `device.*`: the device after the change.
#[derive(SimpleObject)]
pub struct DeviceEventPayload {
    /// The device.
    device: DeviceSnapshot,
}

/// A GPU as an event saw it.
#[derive(SimpleObject)]
pub struct DeviceSnapshot {
    /// The device's id (`dev_…`).
    id: ID,
    /// Its node's id.
    compute_node_id: ID,
    /// The vendor's UUID of the GPU.
    uuid: String,
    /// The vendor.
    vendor: String,
    /// The model.
    model: String,
    /// Its memory in MiB.
    memory_mib: i64,
    /// How it is shared.
    mode: DeviceMode,
    /// Its MIG profiles, in MIG mode.
    mig_profiles: Option<Vec<String>>,
    /// Its time-slice slots, in time-slice mode.
    slots: Option<u32>,
    /// Its health.
    health: DeviceHealth,
    /// Why it has that health.
    health_reason: Option<String>,
    /// Since when it has that health.
    health_since: Option<DateTime<Utc>>,
    /// Whether it is out of placement: an operator's quarantine or an inventory mismatch.
    quarantined: bool,
    /// Why an operator quarantined it, while they do.
    quarantine_reason: Option<String>,
    /// How what its node reports differs from its registration, while it does.
    inventory_mismatch: Option<String>,
    /// When an operator took it out of the registration.
    retired_at: Option<DateTime<Utc>>,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

impl From<ev::DeviceView> for DeviceSnapshot {
    fn from(d: ev::DeviceView) -> Self {
        DeviceSnapshot {
            id: id(&d.id),
            compute_node_id: id(&d.compute_node_id),
            uuid: d.uuid,
            vendor: d.vendor,
            model: d.model,
            memory_mib: d.memory_mib,
            mode: d.mode.into(),
            mig_profiles: d.mig_profiles,
            slots: d.slots,
            health: d.health.into(),
            health_reason: d.health_reason,
            health_since: d.health_since,
            quarantined: d.quarantined,
            quarantine_reason: d.quarantine_reason,
            inventory_mismatch: d.inventory_mismatch,
            retired_at: d.retired_at,
            version: d.version,
            created_at: d.created_at,
            updated_at: d.updated_at,
        }
    }
}

impl From<ev::DevicePayload> for DeviceEventPayload {
    fn from(p: ev::DevicePayload) -> Self {
        DeviceEventPayload {
            device: p.device.into(),
        }
    }
}

/// `reservation.*`: the reservation after the change, with its allocations.
#[derive(SimpleObject)]
pub struct ReservationEventPayload {
    /// The reservation.
    reservation: ReservationSnapshot,
    /// Its allocations, in order.
    allocations: Vec<AllocationSnapshot>,
}

/// A reservation as an event saw it.
#[derive(SimpleObject)]
pub struct ReservationSnapshot {
    /// The reservation's id (`rsv_…`).
    id: ID,
    /// Its tenant.
    tenant_id: String,
    /// Who made it (the token's subject).
    created_by: String,
    /// Its pool's id.
    pool_id: ID,
    /// Its state when the event was written.
    state: ReservationState,
    /// When it starts.
    starts_at: DateTime<Utc>,
    /// When it ends.
    ends_at: DateTime<Utc>,
    /// When it ended, if it has.
    ended_at: Option<DateTime<Utc>>,
    /// Its conditions (`Unschedulable` with its counts while pending).
    conditions: Vec<Condition>,
    /// GPUs it charges to quota.
    gpu_charge: f64,
    /// vCPUs it charges to quota.
    vcpu_charge: i64,
    /// Memory (MiB) it charges to quota.
    memory_mib_charge: i64,
    /// When placement tries again, while pending.
    next_attempt_at: Option<DateTime<Utc>>,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

/// An allocation of a reservation as an event saw it.
#[derive(SimpleObject)]
pub struct AllocationSnapshot {
    /// The allocation's id (`alc_…`).
    id: ID,
    /// Its place in the reservation, from 0.
    ordinal: i32,
    /// What it books.
    gpu_kind: AtomKind,
    /// How many.
    gpu_count: i32,
    /// The GPU model asked for.
    model: Option<String>,
    /// The MIG profile asked for.
    profile: Option<String>,
    /// Slots per GPU asked for.
    slots_per_gpu: Option<i32>,
    /// The vCPUs it asked for on its node.
    vcpu: i64,
    /// Memory in MiB.
    memory_mib: i64,
    /// Disk in GiB.
    disk_gib: i64,
    /// The labels a node must have.
    node_selector: Vec<Label>,
    /// The taints it tolerates.
    tolerations: Vec<TolerationSnapshot>,
    /// Where it was placed; null while pending.
    compute_node_id: Option<ID>,
    /// The atoms it holds.
    atoms: Vec<String>,
}

/// A toleration of an allocation.
#[derive(SimpleObject)]
pub struct TolerationSnapshot {
    /// The taint key tolerated.
    key: String,
    /// Its value; null tolerates any.
    value: Option<String>,
    /// Its effect; null tolerates any.
    effect: Option<crate::graph::common::TaintEffect>,
}

impl From<ev::ReservationPayload> for ReservationEventPayload {
    fn from(p: ev::ReservationPayload) -> Self {
        let r = p.reservation;
        ReservationEventPayload {
            reservation: ReservationSnapshot {
                id: id(&r.id),
                tenant_id: r.tenant_id.to_string(),
                created_by: r.created_by,
                pool_id: id(&r.pool_id),
                state: r.state.into(),
                starts_at: r.starts_at,
                ends_at: r.ends_at,
                ended_at: r.ended_at,
                conditions: conditions_of_views(&r.conditions),
                gpu_charge: r.gpu_charge,
                vcpu_charge: r.vcpu_charge,
                memory_mib_charge: r.memory_mib_charge,
                next_attempt_at: r.next_attempt_at,
                version: r.version,
                created_at: r.created_at,
                updated_at: r.updated_at,
            },
            allocations: p
                .allocations
                .into_iter()
                .map(|a| AllocationSnapshot {
                    id: id(&a.id),
                    ordinal: a.ordinal,
                    gpu_kind: a.gpu_kind.into(),
                    gpu_count: a.gpu_count,
                    model: a.model,
                    profile: a.profile,
                    slots_per_gpu: a.slots_per_gpu,
                    vcpu: a.vcpu,
                    memory_mib: a.memory_mib,
                    disk_gib: a.disk_gib,
                    node_selector: labels_of(&a.node_selector),
                    tolerations: a
                        .tolerations
                        .into_iter()
                        .map(|t| TolerationSnapshot {
                            key: t.key,
                            value: t.value,
                            effect: t.effect.map(Into::into),
                        })
                        .collect(),
                    compute_node_id: a.compute_node_id.as_ref().map(id),
                    atoms: a.atoms.iter().map(ToString::to_string).collect(),
                })
                .collect(),
        }
    }
}

/// `quota.set`: a tenant's quotas in one scope after the change.
#[derive(SimpleObject)]
pub struct QuotaEventPayload {
    /// The tenant.
    tenant_id: String,
    /// The pool or site the quotas apply in.
    scope_id: ID,
    /// Each resource's limit and use.
    quotas: Vec<QuotaSnapshot>,
    /// Who set them.
    set_by: String,
}

/// `authz.granted`, `authz.revoked`: a principal's grant given or taken away.
#[derive(SimpleObject)]
pub struct AuthzEventPayload {
    /// The principal's issuer (`compute:service-account` for a service account).
    issuer: String,
    /// The principal's subject: a token's `sub`, or a service account's id.
    subject: String,
    /// The grant given or taken; null when a revocation found none and only made the
    /// principal managed (its token's claims stopped counting).
    grant: Option<GrantSnapshot>,
    /// Who made the change.
    by: String,
}

/// A grant as an event saw it.
#[derive(SimpleObject)]
pub struct GrantSnapshot {
    /// The grant's id.
    id: ID,
    /// The role: `admin`, `operator` or `member`.
    role: String,
    /// The tenant of a member grant.
    tenant_id: Option<String>,
    /// The site or pool an operator grant is limited to.
    scope_id: Option<ID>,
    /// Who granted it.
    granted_by: String,
    /// When it was granted.
    granted_at: DateTime<Utc>,
}

impl From<ev::AuthzPayload> for AuthzEventPayload {
    fn from(p: ev::AuthzPayload) -> Self {
        AuthzEventPayload {
            issuer: p.issuer,
            subject: p.subject,
            grant: p.grant.map(|g| GrantSnapshot {
                id: id(&g.id),
                role: g.role,
                tenant_id: g.tenant_id.map(|t| t.to_string()),
                scope_id: g.scope_id.map(|s| id(&s)),
                granted_by: g.granted_by,
                granted_at: g.granted_at,
            }),
            by: p.by,
        }
    }
}

/// One quota as an event saw it.
#[derive(SimpleObject)]
pub struct QuotaSnapshot {
    /// The resource.
    resource: QuotaResource,
    /// The limit.
    max: f64,
    /// What is charged.
    used: f64,
    /// Its version after the change.
    version: i64,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

impl From<ev::QuotaPayload> for QuotaEventPayload {
    fn from(p: ev::QuotaPayload) -> Self {
        use compute_domain::quota::QuotaResource as Q;
        QuotaEventPayload {
            tenant_id: p.tenant_id.to_string(),
            scope_id: id(&p.scope_id),
            quotas: p
                .quotas
                .into_iter()
                .map(|q| QuotaSnapshot {
                    resource: match q.resource {
                        Q::Gpu => QuotaResource::Gpus,
                        Q::Vcpu => QuotaResource::Vcpu,
                        Q::MemoryMib => QuotaResource::MemoryMib,
                    },
                    max: q.max,
                    used: q.used,
                    version: q.version,
                    updated_at: q.updated_at,
                })
                .collect(),
            set_by: p.set_by,
        }
    }
}

/// `event_sink.*`: the sink after the change (never its secret).
#[derive(SimpleObject)]
pub struct EventSinkEventPayload {
    /// The sink.
    event_sink: EventSinkSnapshot,
}

/// An event sink as an event saw it.
#[derive(SimpleObject)]
pub struct EventSinkSnapshot {
    /// The sink's id (`snk_…`).
    id: ID,
    /// Its tenant; null for a fleet sink.
    tenant_id: Option<String>,
    /// Where it delivers.
    url: String,
    /// The event types it takes (all when empty).
    types: Vec<String>,
    /// Whether it delivers.
    active: bool,
    /// How its delivery is going.
    state: EventSinkState,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
}

impl From<ev::EventSinkPayload> for EventSinkEventPayload {
    fn from(p: ev::EventSinkPayload) -> Self {
        use compute_domain::sinks::SinkState as S;
        let s = p.event_sink;
        EventSinkEventPayload {
            event_sink: EventSinkSnapshot {
                id: id(&s.id),
                tenant_id: s.tenant_id.map(|t| t.to_string()),
                url: s.url,
                types: s.types,
                active: s.active,
                state: match s.state {
                    S::Healthy => EventSinkState::Healthy,
                    S::Failing => EventSinkState::Failing,
                    S::Behind => EventSinkState::Behind,
                },
                version: s.version,
                created_at: s.created_at,
                updated_at: s.updated_at,
            },
        }
    }
}

/// `command.*`: the command after the change.
#[derive(SimpleObject)]
pub struct CommandEventPayload {
    /// The command.
    command: CommandSnapshot,
}

/// A command to a node daemon as an event saw it.
#[derive(SimpleObject)]
pub struct CommandSnapshot {
    /// The command's id (`cmd_…`).
    id: ID,
    /// The node it runs on.
    compute_node_id: ID,
    /// What it asks.
    kind: CommandKind,
    /// Its arguments.
    args: Json<serde_json::Value>,
    /// The spec generation the daemon must have applied first.
    min_generation: i64,
    /// Whether running it twice is harmless.
    retry_safe: bool,
    /// Its state when the event was written.
    state: CommandState,
    /// How many times it was sent.
    attempts: i32,
    /// Its last progress report.
    progress: Option<Json<serde_json::Value>>,
    /// Its result, once it succeeded.
    result: Option<Json<serde_json::Value>>,
    /// Its error's code, once it failed.
    error_code: Option<String>,
    /// Its error's message.
    error_message: Option<String>,
    /// The session epoch it was dispatched in.
    session_epoch: Option<i64>,
    /// The daemon journal it was dispatched to.
    journal_id: Option<String>,
    /// Who made it.
    created_by: String,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
    /// When it finished, if it has.
    finished_at: Option<DateTime<Utc>>,
}

impl From<ev::CommandPayload> for CommandEventPayload {
    fn from(p: ev::CommandPayload) -> Self {
        let c = p.command;
        CommandEventPayload {
            command: CommandSnapshot {
                id: id(&c.id),
                compute_node_id: id(&c.node_id),
                kind: c.kind.into(),
                args: Json(c.args),
                min_generation: c.min_generation,
                retry_safe: c.retry_safe,
                state: c.state.into(),
                attempts: c.attempts,
                progress: c.progress.map(Json),
                result: c.result.map(Json),
                error_code: c.error_code,
                error_message: c.error_message,
                session_epoch: c.session_epoch,
                journal_id: c.journal_id,
                created_by: c.created_by,
                version: c.version,
                created_at: c.created_at,
                updated_at: c.updated_at,
                finished_at: c.finished_at,
            },
        }
    }
}

/// `instance.*`: the instance after the change.
#[derive(SimpleObject)]
pub struct InstanceEventPayload {
    /// The instance.
    instance: InstanceSnapshot,
}

/// A tenant's workload as an event saw it.
#[derive(SimpleObject)]
pub struct InstanceSnapshot {
    /// The instance's id (`ins_…`).
    id: ID,
    /// Its tenant.
    tenant_id: String,
    /// Its reservation.
    reservation_id: ID,
    /// The allocation it runs on.
    allocation_id: ID,
    /// The node it runs on.
    compute_node_id: ID,
    /// Its image.
    image: String,
    /// Its command.
    command: Vec<String>,
    /// The names of its environment variables (never their values).
    env_names: Vec<String>,
    /// Its state when the event was written.
    state: InstanceState,
    /// Whether a stop was asked for.
    stop_requested: bool,
    /// Why it is in that state.
    reason: Option<String>,
    /// Who made it.
    created_by: String,
    /// Its version after the change.
    version: i64,
    /// When it was created.
    created_at: DateTime<Utc>,
    /// When it last changed.
    updated_at: DateTime<Utc>,
    /// When it started, if it has.
    started_at: Option<DateTime<Utc>>,
    /// When it stopped, if it has.
    stopped_at: Option<DateTime<Utc>>,
    /// Its workload's exit code, when it exited on its own.
    exit_code: Option<i32>,
    /// The signal that ended its workload, when one did without being asked to.
    exit_signal: Option<i32>,
    /// When its workload ended on its own.
    exited_at: Option<DateTime<Utc>>,
}

impl From<ev::InstancePayload> for InstanceEventPayload {
    fn from(p: ev::InstancePayload) -> Self {
        let i = p.instance;
        InstanceEventPayload {
            instance: InstanceSnapshot {
                id: id(&i.id),
                tenant_id: i.tenant_id.to_string(),
                reservation_id: id(&i.reservation_id),
                allocation_id: id(&i.allocation_id),
                compute_node_id: id(&i.compute_node_id),
                image: i.image,
                command: i.command,
                env_names: i.env_names,
                state: i.state.into(),
                stop_requested: i.stop_requested,
                reason: i.reason,
                created_by: i.created_by,
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

/// `usage.*`: the usage record written (a window closed, or an adjustment).
#[derive(SimpleObject)]
pub struct UsageEventPayload {
    /// The record.
    usage: UsageRecordSnapshot,
}

/// A usage record as an event saw it (`docs/usage.md`). The amounts are decimal strings,
/// exact to the microsecond.
#[derive(SimpleObject)]
pub struct UsageRecordSnapshot {
    /// Its idempotency key, `cmp:<allocationId>:<windowStart>[:adj:<n>]`.
    key: String,
    /// `window` or `adjustment`.
    kind: String,
    /// The allocation metered.
    allocation_id: ID,
    /// Its reservation.
    reservation_id: ID,
    /// Its tenant.
    tenant_id: String,
    /// Its pool.
    pool_id: ID,
    /// The window's start.
    window_start: DateTime<Utc>,
    /// The window's end.
    window_end: DateTime<Utc>,
    /// The GPU model.
    model: String,
    /// The kind of atom.
    gpu_kind: AtomKind,
    /// The MIG profile, for MIG.
    profile: Option<String>,
    /// Atoms held.
    atoms: i32,
    /// Seconds booked in the window.
    booked_seconds: String,
    /// GPU-seconds, weighted as quotas weigh GPUs.
    gpu_seconds: String,
    /// vCPU-seconds in the window.
    vcpu_seconds: String,
    /// Memory MiB-seconds.
    memory_mib_seconds: String,
    /// Disk GiB-seconds.
    disk_gib_seconds: String,
    /// When the record was written.
    created_at: DateTime<Utc>,
}

impl From<ev::UsagePayload> for UsageEventPayload {
    fn from(p: ev::UsagePayload) -> Self {
        let u = p.usage;
        UsageEventPayload {
            usage: UsageRecordSnapshot {
                key: u.key,
                kind: u.kind,
                allocation_id: id(&u.allocation_id),
                reservation_id: id(&u.reservation_id),
                tenant_id: u.tenant_id.to_string(),
                pool_id: id(&u.pool_id),
                window_start: u.window_start,
                window_end: u.window_end,
                model: u.model,
                gpu_kind: u.gpu_kind.into(),
                profile: u.profile,
                atoms: u.atoms,
                booked_seconds: u.booked_seconds,
                gpu_seconds: u.gpu_seconds,
                vcpu_seconds: u.vcpu_seconds,
                memory_mib_seconds: u.memory_mib_seconds,
                disk_gib_seconds: u.disk_gib_seconds,
                created_at: u.created_at,
            },
        }
    }
}

/// `join_token.*`: the node join token after the change (never its secret).
#[derive(SimpleObject)]
pub struct NodeJoinTokenEventPayload {
    /// The token.
    join_token: NodeJoinTokenSnapshot,
}

/// A node join token as an event saw it.
#[derive(SimpleObject)]
pub struct NodeJoinTokenSnapshot {
    /// The token's id (`njt_…`).
    id: ID,
    /// The pool it joins machines to.
    pool_id: ID,
    /// The labels the joining node gets.
    labels: Vec<Label>,
    /// `active`, `used`, `revoked` or `expired`.
    state: String,
    /// Until when it can be used.
    expires_at: DateTime<Utc>,
    /// Who made it.
    created_by: String,
    /// When it was made.
    created_at: DateTime<Utc>,
    /// When a machine joined with it.
    used_at: Option<DateTime<Utc>>,
    /// The node that joined with it.
    compute_node_id: Option<ID>,
    /// When it was revoked.
    revoked_at: Option<DateTime<Utc>>,
    /// Who revoked it.
    revoked_by: Option<String>,
}

impl From<ev::JoinTokenPayload> for NodeJoinTokenEventPayload {
    fn from(p: ev::JoinTokenPayload) -> Self {
        let t = p.join_token;
        NodeJoinTokenEventPayload {
            join_token: NodeJoinTokenSnapshot {
                id: id(&t.id),
                pool_id: id(&t.pool_id),
                labels: labels_of(&t.labels),
                state: t.state,
                expires_at: t.expires_at,
                created_by: t.created_by,
                created_at: t.created_at,
                used_at: t.used_at,
                compute_node_id: t.compute_node_id.as_ref().map(id),
                revoked_at: t.revoked_at,
                revoked_by: t.revoked_by,
            },
        }
    }
}
