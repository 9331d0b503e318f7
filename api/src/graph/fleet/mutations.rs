//! Operator mutations on the fleet. Input is parsed into domain types first: bad input is
//! `BAD_USER_INPUT` naming the field, and changes nothing.

use async_graphql::{Context, ID, InputObject, Object, SimpleObject};
use chrono::{DateTime, Utc};
use compute_domain::fleet::changes::{
    self as cmd, LayoutRequest, NewDevice, NewNode, NewPool, NewSite, PoolChanges,
};
use compute_domain::fleet::model::{self as m, Layout};

use compute_domain::ids::{ScopeId, TenantId};
use compute_domain::{Error, quota};

use crate::graph::common::*;
use crate::graph::fleet::*;
use crate::graph::{
    GqlResult, db, gql_error, operator_actor, require_operator, require_operator_on,
};
use compute_domain::authz::Target;

fn bad<T>(e: Error) -> GqlResult<T> {
    Err(gql_error(e))
}

fn name(field: &str, s: &str) -> GqlResult<String> {
    Ok(m::parse_name(field, s)?)
}

/// Input of `createSite`.
#[derive(InputObject)]
pub struct CreateSiteInput {
    /// Unique name.
    pub name: String,
    /// Free-form region.
    pub region: Option<String>,
    /// Makes the call safe to retry: the same key and input give the same site.
    pub idempotency_key: Option<String>,
}

/// Result of `createSite`.
#[derive(SimpleObject)]
pub struct CreateSitePayload {
    /// The site.
    pub site: SiteObj,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    pub idempotent_replay: bool,
}

/// Input of `updateSite`.
#[derive(InputObject)]
pub struct UpdateSiteInput {
    /// The site.
    pub id: ID,
    /// The version you read.
    pub version: i64,
    /// New name.
    pub name: Option<String>,
    /// New region.
    pub region: Option<String>,
}

/// Result of `updateSite`.
#[derive(SimpleObject)]
pub struct UpdateSitePayload {
    /// The site after the change.
    pub site: SiteObj,
}

/// Overcommit ratios, 1 to 100; unset ones stay (or default to 1 on creation).
#[derive(InputObject, Default)]
pub struct OvercommitInput {
    /// vCPU ratio.
    pub vcpu: Option<f64>,
    /// Memory ratio.
    pub memory: Option<f64>,
    /// Disk ratio.
    pub disk: Option<f64>,
}

fn ratio(field: &str, r: Option<f64>) -> GqlResult<Option<f64>> {
    Ok(r.map(|r| m::parse_ratio(field, r)).transpose()?)
}

/// Input of `createPool`.
#[derive(InputObject)]
pub struct CreatePoolInput {
    /// The site to create it in.
    pub site_id: ID,
    /// Name, unique in the site.
    pub name: String,
    /// What kind of machines it holds.
    pub kind: PoolKind,
    /// After how long unreachable a node counts as lost; provider and VPS pools only.
    pub lost_after_seconds: Option<i64>,
    /// Overcommit ratios.
    pub overcommit: Option<OvercommitInput>,
    /// Makes the call safe to retry: the same key and input give the same pool.
    pub idempotency_key: Option<String>,
}

/// Result of `createPool`.
#[derive(SimpleObject)]
pub struct CreatePoolPayload {
    /// The pool.
    pub pool: PoolObj,
    /// Whether this is the stored answer to an earlier request with the same idempotency key.
    pub idempotent_replay: bool,
}

/// Input of `updatePool`.
#[derive(InputObject)]
pub struct UpdatePoolInput {
    /// The pool.
    pub id: ID,
    /// The version you read.
    pub version: i64,
    /// New name.
    pub name: Option<String>,
    /// New `lostAfterSeconds`.
    pub lost_after_seconds: Option<i64>,
    /// Clear `lostAfterSeconds`.
    #[graphql(default = false)]
    pub clear_lost_after: bool,
    /// New ratios; lowering one below what a node already holds is `CONFLICT`.
    pub overcommit: Option<OvercommitInput>,
    /// New rules against hoarding, all at once: a rule left out (or null) no longer applies.
    /// Existing reservations are not touched.
    pub rules: Option<PoolRulesInput>,
}

/// A pool's rules against hoarding; leave a rule out for no limit.
#[derive(InputObject, Default)]
pub struct PoolRulesInput {
    /// The longest a reservation may last, in seconds (1 to ten years).
    pub max_duration_seconds: Option<i64>,
    /// How far ahead of now a reservation may start, in seconds (1 to ten years).
    pub max_lead_seconds: Option<i64>,
    /// The most GPU-hours one tenant may hold booked on the pool from now on.
    pub max_future_gpu_hours: Option<f64>,
    /// `false` forbids extending a reservation once its window has started (default `true`).
    pub extend_after_start: Option<bool>,
    /// After how long without a live instance an active reservation is idle, in seconds.
    pub idle_grace_seconds: Option<i64>,
    /// `true` releases an idle reservation rather than only reporting it (needs
    /// `idleGraceSeconds`; default `false`).
    pub release_idle: Option<bool>,
}

/// Result of `updatePool`.
#[derive(SimpleObject)]
pub struct UpdatePoolPayload {
    /// The pool after the change.
    pub pool: PoolObj,
}

/// A label.
#[derive(InputObject)]
pub struct LabelInput {
    /// Key: 1 to 63 of letters, digits, `.`, `_`, `/`, `-`.
    pub key: String,
    /// Value: up to 63 of letters, digits, `.`, `_`, `-`.
    pub value: String,
}

/// A taint.
#[derive(InputObject)]
pub struct TaintInput {
    /// The taint key, such as `dedicated`.
    pub key: String,
    /// Value; empty when unset.
    #[graphql(default)]
    pub value: String,
    /// What the taint does to placement.
    pub effect: TaintEffect,
}

/// A node's scalar resources.
#[derive(InputObject)]
pub struct ResourcesInput {
    /// vCPUs (1 to 4096).
    pub vcpu: i64,
    /// Memory in MiB.
    pub memory_mib: i64,
    /// Disk in GiB.
    pub disk_gib: i64,
}

/// How a GPU is divided.
#[derive(InputObject, Default)]
pub struct LayoutInput {
    /// MIG mode: the profiles of its instances, such as `["3g.40gb", "2g.20gb"]`.
    pub mig_profiles: Option<Vec<String>>,
    /// Time-slice and MPS modes: the number of slots (2 to 64).
    pub slots: Option<i64>,
}

/// A GPU of a node to register.
#[derive(InputObject)]
pub struct DeviceInput {
    /// Hardware UUID, unique in the fleet.
    pub uuid: String,
    /// The GPU vendor, such as `nvidia`.
    #[graphql(default_with = "\"nvidia\".to_string()")]
    pub vendor: String,
    /// The GPU model, such as `H100`.
    pub model: String,
    /// Memory in MiB.
    pub memory_mib: i64,
    /// How it is shared.
    #[graphql(default_with = "DeviceMode::Exclusive")]
    pub mode: DeviceMode,
    /// Its layout, for MIG, time-slice and MPS modes.
    pub layout: Option<LayoutInput>,
    /// Its PCI bus id (`00000000:17:00.0`). The node daemon's inventory reports it too, and
    /// its report wins.
    pub pci_bus_id: Option<String>,
    /// The NUMA node it is attached to (0 to 1023), for `sameNumaNode`.
    pub numa_node: Option<i32>,
    /// Its NVLink domain: GPUs joined by NVLink share one name, for `sameNvlinkDomain`.
    pub nvlink_domain: Option<String>,
}

/// Input of `registerNode`.
#[derive(InputObject)]
pub struct RegisterNodeInput {
    /// The pool it joins.
    pub pool_id: ID,
    /// Host name, unique in the fleet.
    pub hostname: String,
    /// The node labels that selectors match.
    #[graphql(default)]
    pub labels: Vec<LabelInput>,
    /// The node taints that allocations must tolerate.
    #[graphql(default)]
    pub taints: Vec<TaintInput>,
    /// vCPU, memory and disk.
    pub resources: ResourcesInput,
    /// Its GPUs.
    #[graphql(default)]
    pub devices: Vec<DeviceInput>,
}

/// A compute node after a change.
#[derive(SimpleObject)]
pub struct ComputeNodePayload {
    /// The node after the change.
    pub compute_node: ComputeNodeObj,
}

/// Input of `updateNode`.
#[derive(InputObject)]
pub struct UpdateNodeInput {
    /// The node.
    pub id: ID,
    /// The version you read.
    pub version: i64,
    /// The node's labels, replacing the current ones.
    pub labels: Vec<LabelInput>,
}

/// Input of `cordonNode`.
#[derive(InputObject)]
pub struct CordonNodeInput {
    /// The node.
    pub id: ID,
    /// The version you read; when given, a newer node is `CONFLICT`.
    pub version: Option<i64>,
    /// Why the node is cordoned, for people (at most 500 characters).
    pub reason: Option<String>,
}

/// Input of the node actions that need only the node (`uncordonNode`, `drainNode`, `retireNode`).
#[derive(InputObject)]
pub struct NodeActionInput {
    /// The node.
    pub id: ID,
    /// The version you read; when given, a newer node is `CONFLICT`.
    pub version: Option<i64>,
}

/// Input of `taintNode`.
#[derive(InputObject)]
pub struct TaintNodeInput {
    /// The node.
    pub id: ID,
    /// The version you read.
    pub version: Option<i64>,
    /// The taint; it replaces one with the same key and effect.
    pub taint: TaintInput,
}

/// Input of `untaintNode`.
#[derive(InputObject)]
pub struct UntaintNodeInput {
    /// The node.
    pub id: ID,
    /// The version you read.
    pub version: Option<i64>,
    /// The key of the taints to remove.
    pub key: String,
    /// Only the taint with this effect.
    pub effect: Option<TaintEffect>,
}

/// A booking that still holds GPUs of a node.
#[derive(SimpleObject)]
pub struct BookingHolder {
    /// The allocation; null for a maintenance hold such as a mode change.
    pub allocation_id: Option<ID>,
    /// `allocation` or `mode_change`.
    pub reason: String,
    /// The atoms it holds.
    pub atoms: Vec<String>,
    /// When its last booking ends; null when open-ended.
    pub until: Option<DateTime<Utc>>,
}

/// Result of `drainNode`.
#[derive(SimpleObject)]
pub struct DrainNodePayload {
    /// The node, now cordoned.
    pub compute_node: ComputeNodeObj,
    /// What still holds its GPUs.
    pub remaining: Vec<BookingHolder>,
}

/// Input of `setDeviceHealth`.
#[derive(InputObject)]
pub struct SetDeviceHealthInput {
    /// The GPU.
    pub id: ID,
    /// The version you read.
    pub version: Option<i64>,
    /// Its health.
    pub health: DeviceHealth,
    /// Why the health changed, for people (at most 500 characters).
    pub reason: Option<String>,
}

/// A GPU after a change.
#[derive(SimpleObject)]
pub struct DevicePayload {
    /// The GPU after the change.
    pub device: DeviceObj,
}

/// Input of `quarantineDevice`.
#[derive(InputObject)]
pub struct QuarantineDeviceInput {
    /// The GPU.
    pub id: ID,
    /// The version you read.
    pub version: Option<i64>,
    /// Why the GPU is quarantined, for people (at most 500 characters).
    pub reason: String,
}

/// Input of `unquarantineDevice`.
#[derive(InputObject)]
pub struct UnquarantineDeviceInput {
    /// The GPU.
    pub id: ID,
    /// The version you read.
    pub version: Option<i64>,
}

/// Input of `retireDevice`.
#[derive(InputObject)]
pub struct RetireDeviceInput {
    /// The GPU.
    pub id: ID,
    /// The version you read; when given, a newer device is `CONFLICT`.
    pub version: Option<i64>,
}

/// Input of `changeDeviceMode`.
#[derive(InputObject)]
pub struct ChangeDeviceModeInput {
    /// The GPU.
    pub id: ID,
    /// The version you read.
    pub version: i64,
    /// The new mode.
    pub mode: DeviceMode,
    /// The new layout (MIG profiles or slots).
    pub layout: Option<LayoutInput>,
    /// How long the GPU stays held while the node applies the change (0 to 86400, default 300).
    #[graphql(default = 300)]
    pub change_window_seconds: i64,
}

/// Input of `setQuota`.
#[derive(InputObject)]
pub struct SetQuotaInput {
    /// The tenant.
    pub tenant_id: String,
    /// A pool or site id.
    pub scope_id: ID,
    /// GPU limit (MIG instances and slots count as fractions).
    pub gpus: Option<f64>,
    /// vCPU limit.
    pub vcpu: Option<i64>,
    /// Memory limit in MiB.
    pub memory_mib: Option<i64>,
}

/// Result of `setQuota`.
#[derive(SimpleObject)]
pub struct SetQuotaPayload {
    /// The limits set, with their usage.
    pub quotas: Vec<Quota>,
}

pub(crate) fn labels(field: &str, input: &[LabelInput]) -> GqlResult<m::Labels> {
    let pairs: Vec<(String, String)> = input
        .iter()
        .map(|l| (l.key.clone(), l.value.clone()))
        .collect();
    Ok(m::parse_labels(field, &pairs)?)
}

fn taint(field: &str, t: &TaintInput) -> GqlResult<m::Taint> {
    Ok(m::Taint::new(field, &t.key, &t.value, t.effect.into())?)
}

fn optional_reason(field: &str, r: Option<String>) -> GqlResult<Option<m::Reason>> {
    Ok(m::Reason::parse_optional(field, r.as_deref())?)
}

/// The fleet's mutations; all need the operator role.
#[derive(Default)]
pub struct FleetMutation;

/// The fleet's mutations; all need the operator role.
#[Object]
impl FleetMutation {
    /// Creates a site.
    async fn create_site(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createSite`.")] input: CreateSiteInput,
    ) -> GqlResult<CreateSitePayload> {
        require_operator(ctx)?;
        let new = NewSite {
            name: name("name", &input.name)?,
            region: input
                .region
                .as_deref()
                .map(|r| name("region", r))
                .transpose()?,
        };
        let outcome =
            cmd::create_site(db(ctx)?, &operator_actor(ctx)?, new, input.idempotency_key).await?;
        if outcome.replayed {
            crate::graph::ReplayFlag::mark(ctx);
        }
        Ok(CreateSitePayload {
            site: SiteObj(outcome.value),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Renames a site or changes its region.
    async fn update_site(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `updateSite`.")] input: UpdateSiteInput,
    ) -> GqlResult<UpdateSitePayload> {
        let id = parse_id::<SiteId>("id", &input.id)?;
        require_operator_on(ctx, Target::Site(id.clone())).await?;
        let new_name = input.name.as_deref().map(|n| name("name", n)).transpose()?;
        let region = input
            .region
            .as_deref()
            .map(|r| name("region", r))
            .transpose()?;
        let site = cmd::update_site(db(ctx)?, &id, input.version, new_name, region).await?;
        Ok(UpdateSitePayload {
            site: SiteObj(site),
        })
    }

    /// Creates a pool in a site.
    async fn create_pool(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `createPool`.")] input: CreatePoolInput,
    ) -> GqlResult<CreatePoolPayload> {
        let site_id = parse_id::<SiteId>("siteId", &input.site_id)?;
        require_operator_on(ctx, Target::Site(site_id.clone())).await?;
        let oc = input.overcommit.unwrap_or_default();
        let new = NewPool {
            site_id,
            name: name("name", &input.name)?,
            kind: input.kind.into(),
            lost_after_seconds: input.lost_after_seconds,
            vcpu_ratio: ratio("overcommit.vcpu", oc.vcpu)?.unwrap_or(1.0),
            memory_ratio: ratio("overcommit.memory", oc.memory)?.unwrap_or(1.0),
            disk_ratio: ratio("overcommit.disk", oc.disk)?.unwrap_or(1.0),
        };
        let outcome =
            cmd::create_pool(db(ctx)?, &operator_actor(ctx)?, new, input.idempotency_key).await?;
        if outcome.replayed {
            crate::graph::ReplayFlag::mark(ctx);
        }
        Ok(CreatePoolPayload {
            pool: PoolObj(outcome.value),
            idempotent_replay: outcome.replayed,
        })
    }

    /// Changes a pool; new ratios apply to its nodes at once.
    async fn update_pool(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `updatePool`.")] input: UpdatePoolInput,
    ) -> GqlResult<UpdatePoolPayload> {
        let id = parse_id::<PoolId>("id", &input.id)?;
        require_operator_on(ctx, Target::Pool(id.clone())).await?;
        if input.clear_lost_after && input.lost_after_seconds.is_some() {
            return bad(Error::bad_input(
                "lostAfterSeconds",
                "give `lostAfterSeconds` or `clearLostAfter`, not both",
            ));
        }
        let lost_after = input
            .lost_after_seconds
            .map(|s| m::parse_lost_after("lostAfterSeconds", s))
            .transpose()?;
        let oc = input.overcommit.unwrap_or_default();
        let changes = PoolChanges {
            name: input.name.as_deref().map(|n| name("name", n)).transpose()?,
            lost_after_seconds: if input.clear_lost_after {
                Some(None)
            } else {
                lost_after.map(Some)
            },
            vcpu_ratio: ratio("overcommit.vcpu", oc.vcpu)?,
            memory_ratio: ratio("overcommit.memory", oc.memory)?,
            disk_ratio: ratio("overcommit.disk", oc.disk)?,
            rules: input
                .rules
                .map(|r| {
                    compute_domain::fleet::PoolRules::parse(
                        r.max_duration_seconds,
                        r.max_lead_seconds,
                        r.max_future_gpu_hours,
                        r.extend_after_start,
                        r.idle_grace_seconds,
                        r.release_idle,
                    )
                })
                .transpose()?,
        };
        let pool = cmd::update_pool(db(ctx)?, &id, input.version, changes).await?;
        Ok(UpdatePoolPayload {
            pool: PoolObj(pool),
        })
    }

    /// Registers a machine with its resources and GPUs; its atoms follow the atom rule.
    async fn register_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `registerNode`.")] input: RegisterNodeInput,
    ) -> GqlResult<ComputeNodePayload> {
        let pool_id = parse_id::<PoolId>("poolId", &input.pool_id)?;
        require_operator_on(ctx, Target::Pool(pool_id.clone())).await?;
        let mut devices = Vec::with_capacity(input.devices.len());
        if input.devices.len() > m::MAX_GPUS_PER_NODE {
            return bad(Error::bad_input(
                "devices",
                format!("at most {} GPUs per node", m::MAX_GPUS_PER_NODE),
            ));
        }
        for (i, d) in input.devices.iter().enumerate() {
            let field = format!("devices[{i}]");
            let memory = m::parse_count(&format!("{field}.memoryMib"), d.memory_mib, 1, 1 << 24)?;
            let layout = d.layout.as_ref();
            devices.push(NewDevice {
                uuid: m::GpuUuid::parse(&format!("{field}.uuid"), &d.uuid)?,
                vendor: m::parse_vendor(&format!("{field}.vendor"), &d.vendor)?,
                model: name(&format!("{field}.model"), &d.model)?,
                memory_mib: memory,
                layout: Layout::parse(
                    &format!("{field}.layout"),
                    d.mode.into(),
                    layout.and_then(|l| l.mig_profiles.as_deref()),
                    layout.and_then(|l| l.slots),
                    memory,
                )?,
                topology: m::parse_topology(
                    &field,
                    d.pci_bus_id.as_deref(),
                    d.numa_node.map(i64::from),
                    d.nvlink_domain.as_deref(),
                )?,
            });
        }
        let new = NewNode {
            pool_id,
            hostname: m::parse_hostname("hostname", &input.hostname)?,
            labels: labels("labels", &input.labels)?,
            taints: input
                .taints
                .iter()
                .map(|t| taint("taints", t))
                .collect::<GqlResult<_>>()?,
            vcpu: m::parse_count("resources.vcpu", input.resources.vcpu, 1, 4096)?,
            memory_mib: m::parse_count(
                "resources.memoryMib",
                input.resources.memory_mib,
                1,
                1 << 32,
            )?,
            disk_gib: m::parse_count("resources.diskGib", input.resources.disk_gib, 0, 1 << 24)?,
            devices,
        };
        let registered = cmd::register_node(db(ctx)?, new).await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(registered.node),
        })
    }

    /// Replaces a node's labels.
    async fn update_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `updateNode`.")] input: UpdateNodeInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let node = cmd::update_node(
            db(ctx)?,
            &id,
            input.version,
            labels("labels", &input.labels)?,
        )
        .await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Stops placing new work on a node.
    async fn cordon_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `cordonNode`.")] input: CordonNodeInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let reason = optional_reason("reason", input.reason)?;
        let node = cmd::cordon_node(db(ctx)?, &id, input.version, reason).await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Lets placement use a node again.
    async fn uncordon_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `uncordonNode`.")] input: NodeActionInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let node = cmd::uncordon_node(db(ctx)?, &id, input.version).await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Adds a taint to a node.
    async fn taint_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `taintNode`.")] input: TaintNodeInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let t = taint("taint", &input.taint)?;
        let node = cmd::taint_node(db(ctx)?, &id, input.version, t).await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Removes taints from a node; `NOT_FOUND` when it has none with that key.
    async fn untaint_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `untaintNode`.")] input: UntaintNodeInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let key = m::parse_key("key", &input.key)?;
        let node = cmd::untaint_node(
            db(ctx)?,
            &id,
            input.version,
            &key,
            input.effect.map(Into::into),
        )
        .await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Cordons a node and reports what still holds its GPUs.
    async fn drain_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `drainNode`.")] input: NodeActionInput,
    ) -> GqlResult<DrainNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let (node, remaining) = cmd::drain_node(db(ctx)?, &id, input.version).await?;
        Ok(DrainNodePayload {
            compute_node: ComputeNodeObj::new(node),
            remaining: remaining
                .into_iter()
                .map(|h| BookingHolder {
                    allocation_id: h.allocation_id.as_ref().map(gql_id),
                    reason: h.reason.as_str().to_owned(),
                    atoms: h.atoms.iter().map(|a| a.as_str().to_owned()).collect(),
                    until: h.until,
                })
                .collect(),
        })
    }

    /// Retires a node for good; refused while bookings on its GPUs remain.
    async fn retire_node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `retireNode`.")] input: NodeActionInput,
    ) -> GqlResult<ComputeNodePayload> {
        let id = parse_id::<NodeId>("id", &input.id)?;
        require_operator_on(ctx, Target::Node(id.clone())).await?;
        let node = cmd::retire_node(db(ctx)?, &id, input.version).await?;
        Ok(ComputeNodePayload {
            compute_node: ComputeNodeObj::new(node),
        })
    }

    /// Sets a GPU's health; unhealthy GPUs leave placement.
    async fn set_device_health(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `setDeviceHealth`.")] input: SetDeviceHealthInput,
    ) -> GqlResult<DevicePayload> {
        let id = parse_id::<DeviceId>("id", &input.id)?;
        require_operator_on(ctx, Target::Device(id.clone())).await?;
        let reason = optional_reason("reason", input.reason)?;
        let device =
            cmd::set_device_health(db(ctx)?, &id, input.version, input.health.into(), reason)
                .await?;
        Ok(DevicePayload {
            device: DeviceObj::new(device),
        })
    }

    /// Keeps a GPU out of placement.
    async fn quarantine_device(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `quarantineDevice`.")] input: QuarantineDeviceInput,
    ) -> GqlResult<DevicePayload> {
        let id = parse_id::<DeviceId>("id", &input.id)?;
        require_operator_on(ctx, Target::Device(id.clone())).await?;
        let reason = m::Reason::parse("reason", &input.reason)?;
        let device = cmd::quarantine_device(db(ctx)?, &id, input.version, reason).await?;
        Ok(DevicePayload {
            device: DeviceObj::new(device),
        })
    }

    /// Returns a quarantined GPU to placement.
    async fn unquarantine_device(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `unquarantineDevice`.")] input: UnquarantineDeviceInput,
    ) -> GqlResult<DevicePayload> {
        let id = parse_id::<DeviceId>("id", &input.id)?;
        require_operator_on(ctx, Target::Device(id.clone())).await?;
        let device = cmd::release_quarantine(db(ctx)?, &id, input.version).await?;
        Ok(DevicePayload {
            device: DeviceObj::new(device),
        })
    }

    /// Takes a GPU out of its node's registration for good (one the machine no longer has):
    /// refused with `CONFLICT` while a booking on it ends after now. Its atoms leave the pool's
    /// capacity; the node's inventory check is made again without it.
    async fn retire_device(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `retireDevice`.")] input: RetireDeviceInput,
    ) -> GqlResult<DevicePayload> {
        let id = parse_id::<DeviceId>("id", &input.id)?;
        require_operator_on(ctx, Target::Device(id.clone())).await?;
        let device = cmd::retire_device(db(ctx)?, &id, input.version).await?;
        Ok(DevicePayload {
            device: DeviceObj::new(device),
        })
    }

    /// Changes a GPU's mode and layout. Commits only when nothing on the GPU is booked; otherwise
    /// `CONFLICT` naming what blocks it. The GPU is then held for `changeWindowSeconds`.
    async fn change_device_mode(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `changeDeviceMode`.")] input: ChangeDeviceModeInput,
    ) -> GqlResult<DevicePayload> {
        let id = parse_id::<DeviceId>("id", &input.id)?;
        require_operator_on(ctx, Target::Device(id.clone())).await?;
        let layout = input.layout.unwrap_or_default();
        let request = LayoutRequest {
            mode: input.mode.into(),
            mig_profiles: layout.mig_profiles,
            slots: layout.slots,
        };
        let device = cmd::change_device_mode(
            db(ctx)?,
            &id,
            input.version,
            request,
            input.change_window_seconds,
        )
        .await?;
        Ok(DevicePayload {
            device: DeviceObj::new(device),
        })
    }

    /// Sets a tenant's limits on a pool or site.
    async fn set_quota(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The arguments of `setQuota`.")] input: SetQuotaInput,
    ) -> GqlResult<SetQuotaPayload> {
        let tenant = TenantId::parse("tenantId", &input.tenant_id)?;
        let scope = ScopeId::parse("scopeId", input.scope_id.as_str())?;
        require_operator_on(
            ctx,
            match &scope {
                ScopeId::Pool(p) => Target::Pool(p.clone()),
                ScopeId::Site(s) => Target::Site(s.clone()),
            },
        )
        .await?;
        let limits = quota::QuotaLimits {
            gpus: input.gpus,
            vcpu: input.vcpu,
            memory_mib: input.memory_mib,
        };
        let quotas =
            quota::set_quota(db(ctx)?, &operator_actor(ctx)?, &tenant, &scope, limits).await?;
        Ok(SetQuotaPayload {
            quotas: quotas.into_iter().map(quota_obj).collect(),
        })
    }
}
