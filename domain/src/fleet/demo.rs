//! The demonstration fleet `compute-api dev` creates on an empty database, so that the first
//! GraphiQL query shows something real. `serve` never calls this.

use crate::ids::{PoolId, ScopeId, SiteId, TenantId};
use tracing::info;

use super::changes::{self, NewDevice, NewNode, NewPool, NewSite};
use super::model::{DeviceMode, Labels, Layout, PoolKind, Taint, TaintEffect, Topology};
use crate::db::Db;
use crate::error::Result;
use crate::fleet::model::GpuUuid;
use crate::idempotency::Actor;
use crate::quota::{self, QuotaLimits};

/// A node's GPUs, with the topology of a typical server: half on each of two NUMA nodes, and
/// SXM GPUs all on one NVSwitch (one NVLink domain); PCIe cards have no NVLink.
fn gpus(model: &str, memory_mib: i64, layouts: Vec<Layout>) -> Vec<NewDevice> {
    let n = layouts.len();
    layouts
        .into_iter()
        .enumerate()
        .map(|(i, layout)| NewDevice {
            uuid: GpuUuid::random(),
            vendor: "nvidia".into(),
            model: model.into(),
            memory_mib,
            layout,
            topology: Topology {
                pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x17 + i)),
                numa_node: Some((2 * i / n.max(1)) as i32),
                nvlink_domain: model.contains("SXM").then(|| "nvl-0".to_owned()),
            },
        })
        .collect()
}

fn mig(profiles: &[&str], memory_mib: i64) -> Result<Layout> {
    let p: Vec<String> = profiles.iter().map(|s| (*s).to_owned()).collect();
    Layout::parse("layout", DeviceMode::Mig, Some(&p), None, memory_mib)
}

/// Creates the demonstration fleet when the database has no site; returns whether it did.
pub async fn seed_if_empty(db: &Db) -> Result<bool> {
    let sites = super::count_sites(db).await?;
    if sites > 0 {
        return Ok(false);
    }
    let actor = Actor::operator("demo-seed");
    let site = |name: &str, region: &str| NewSite {
        name: name.into(),
        region: Some(region.into()),
    };
    let ams = changes::create_site(
        db,
        &actor,
        site("ams1", "eu-west"),
        Some("demo:site:ams1".into()),
    )
    .await?
    .value;
    let iad = changes::create_site(
        db,
        &actor,
        site("iad1", "us-east"),
        Some("demo:site:iad1".into()),
    )
    .await?
    .value;
    let pool =
        |site_id: &SiteId, name: &str, kind: PoolKind, lost_after: Option<i64>, vcpu_ratio: f64| {
            NewPool {
                site_id: site_id.clone(),
                name: name.into(),
                kind,
                lost_after_seconds: lost_after,
                vcpu_ratio,
                memory_ratio: 1.0,
                disk_ratio: 1.0,
            }
        };
    let h100 = changes::create_pool(
        db,
        &actor,
        pool(&ams.id, "h100", PoolKind::BareMetal, None, 2.0),
        Some("demo:pool:h100".into()),
    )
    .await?
    .value;
    let a100 = changes::create_pool(
        db,
        &actor,
        pool(&ams.id, "a100-shared", PoolKind::BareMetal, None, 1.5),
        Some("demo:pool:a100".into()),
    )
    .await?
    .value;
    let l4 = changes::create_pool(
        db,
        &actor,
        pool(&iad.id, "l4-cloud", PoolKind::Provider, Some(3600), 1.0),
        Some("demo:pool:l4".into()),
    )
    .await?
    .value;

    const H100: i64 = 81_559;
    const A100: i64 = 81_920;
    const L4: i64 = 23_034;
    let node =
        |pool_id: &PoolId, host: &str, taints: Vec<Taint>, devices: Vec<NewDevice>| NewNode {
            pool_id: pool_id.clone(),
            hostname: host.into(),
            labels: Labels::from([(
                "rack".to_owned(),
                host.rsplit('-').next().unwrap_or("r1").to_owned(),
            )]),
            taints,
            vcpu: 192,
            memory_mib: 2_097_152,
            disk_gib: 30_000,
            devices,
        };
    let nodes = vec![
        node(
            &h100.id,
            "ams1-h100-01",
            vec![],
            gpus("H100-SXM5-80GB", H100, vec![Layout::Exclusive; 8]),
        ),
        node(
            &h100.id,
            "ams1-h100-02",
            vec![Taint::new(
                "taints",
                "dedicated",
                "training",
                TaintEffect::NoSchedule,
            )?],
            gpus("H100-SXM5-80GB", H100, vec![Layout::Exclusive; 8]),
        ),
        node(
            &a100.id,
            "ams1-a100-01",
            vec![],
            gpus(
                "A100-SXM4-80GB",
                A100,
                vec![
                    mig(&["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], A100)?,
                    mig(&["1g.10gb"; 7], A100)?,
                    Layout::TimeSlice(4),
                    Layout::Exclusive,
                ],
            ),
        ),
        node(
            &l4.id,
            "iad1-l4-01",
            vec![],
            gpus(
                "L4",
                L4,
                vec![
                    Layout::TimeSlice(4),
                    Layout::TimeSlice(4),
                    Layout::Mps(8),
                    Layout::Exclusive,
                ],
            ),
        ),
    ];
    for n in nodes {
        changes::register_node(db, n).await?;
    }
    quota::set_quota(
        db,
        &actor,
        &TenantId::parse("tenant", "dev")?,
        &ScopeId::Pool(h100.id.clone()),
        QuotaLimits {
            gpus: Some(8.0),
            vcpu: Some(128),
            memory_mib: Some(1_048_576),
        },
    )
    .await?;
    quota::set_quota(
        db,
        &actor,
        &TenantId::parse("tenant", "acme")?,
        &ScopeId::Site(iad.id.clone()),
        QuotaLimits {
            gpus: Some(4.0),
            vcpu: None,
            memory_mib: None,
        },
    )
    .await?;
    info!("created the demonstration fleet: sites ams1 and iad1, 3 pools, 4 nodes, 28 GPUs");
    Ok(true)
}
