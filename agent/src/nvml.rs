//! GPUs through NVIDIA's NVML (`nvml-wrapper`): the library is loaded at run time
//! (`libnvidia-ml.so.1`), so the agent starts on hosts without the driver and says so.
//!
//! Discovery reads each GPU's UUID, name, memory, PCI bus id and MIG mode, its NVLink domain
//! (the far ends of its active links, [`nvlink_domains`]) and its NUMA node (from `/sys`); NVML 0.11's safe
//! wrapper has no MIG-device enumeration, so the MIG instances (UUID and profile) come from
//! `nvidia-smi -L`. Health reads the volatile uncorrected ECC count, pages pending retirement
//! and `GPU_IS_LOST`; XID errors arrive as NVML events, which [`watch_xids`] collects on a
//! thread of its own.
//!
//! No machine of this project's CI has an NVIDIA GPU: these paths are written against the
//! library's API and are not exercised by a test (`docs/agent.md` says so).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use compute_protocol::GpuInventory;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::error::NvmlError;

use crate::inventory::{Health, Observations, judge, numa_node_of, nvlink_domains, parse_smi_list};

/// NVML's `NVML_NVLINK_MAX_LINKS` (nvml-wrapper-sys 0.9, not re-exported by the wrapper): the
/// links asked of each GPU; a link a GPU does not have answers an error and is skipped.
const NVLINK_MAX_LINKS: u32 = 18;

/// XID errors seen per GPU UUID since the agent started.
pub type Xids = Arc<Mutex<BTreeMap<String, Vec<u64>>>>;

/// The GPUs and their health, or why NVML cannot say.
#[allow(clippy::type_complexity, reason = "a pair read once")]
pub fn discover(
    nvidia_smi: &Path,
    xids: &BTreeMap<String, Vec<u64>>,
) -> Result<(Vec<GpuInventory>, BTreeMap<String, Health>), String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML is not available ({e})"))?;
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML cannot count the GPUs ({e})"))?;
    let mut mig_lists = None;
    let mut gpus = Vec::new();
    // Per GPU: its bus id and the far ends of its active NVLinks.
    let mut links: Vec<(String, Vec<String>)> = Vec::new();
    let mut health = BTreeMap::new();
    for i in 0..count {
        let device = match nvml.device_by_index(i) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(index = i, error = %e, "NVML cannot open a GPU; it is left out");
                continue;
            }
        };
        let Ok(uuid) = device.uuid() else { continue };
        let name = device.name().unwrap_or_else(|_| "unknown".into());
        let model = name.strip_prefix("NVIDIA ").unwrap_or(&name).to_owned();
        let memory_mib = device
            .memory_info()
            .map(|m| (m.total / (1024 * 1024)) as i64)
            .unwrap_or(0);
        let pci_bus_id = device.pci_info().ok().map(|p| p.bus_id);
        let remotes: Vec<String> = (0..NVLINK_MAX_LINKS)
            .filter_map(|l| {
                let link = device.link_wrapper_for(l);
                link.is_active()
                    .ok()
                    .filter(|a| *a)
                    .and_then(|_| link.remote_pci_info().ok())
                    .map(|p| p.bus_id)
            })
            .collect();
        links.push((pci_bus_id.clone().unwrap_or_default(), remotes));
        let mig_enabled = device.mig_mode().is_ok_and(|m| m.current == 1);
        let mig = if mig_enabled {
            mig_lists
                .get_or_insert_with(|| {
                    std::process::Command::new(nvidia_smi)
                        .arg("-L")
                        .output()
                        .ok()
                        .map(|o| parse_smi_list(&String::from_utf8_lossy(&o.stdout)))
                        .unwrap_or_default()
                })
                .get(&uuid)
                .cloned()
                .unwrap_or_default()
        } else {
            vec![]
        };
        let ecc = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile);
        let pending = device.are_pages_pending_retired();
        let seen = Observations {
            xid: xids.get(&uuid).cloned().unwrap_or_default(),
            ecc_double_bit: *ecc.as_ref().unwrap_or(&0),
            pages_pending_retirement: *pending.as_ref().unwrap_or(&false),
            lost: matches!(ecc, Err(NvmlError::GpuLost))
                || matches!(pending, Err(NvmlError::GpuLost)),
        };
        health.insert(uuid.clone(), judge(&seen));
        gpus.push(GpuInventory {
            uuid,
            vendor: "nvidia".into(),
            model,
            memory_mib,
            numa_node: pci_bus_id
                .as_deref()
                .and_then(|b| numa_node_of(Path::new("/sys"), b)),
            pci_bus_id,
            nvlink_domain: None,
            mig_enabled,
            mig,
        });
    }
    for (gpu, domain) in gpus.iter_mut().zip(nvlink_domains(&links)) {
        gpu.nvlink_domain = domain;
    }
    Ok((gpus, health))
}

/// Collects critical XID events into `xids` and calls `changed` after each, until the process
/// ends; returns at once when NVML is not available.
pub fn watch_xids(xids: Xids, changed: impl Fn() + Send + 'static) {
    std::thread::spawn(move || {
        let Ok(nvml) = Nvml::init() else { return };
        let Ok(mut set) = nvml.create_event_set() else {
            return;
        };
        let count = nvml.device_count().unwrap_or(0);
        for i in 0..count {
            let Ok(device) = nvml.device_by_index(i) else {
                continue;
            };
            set = match device.register_events(
                nvml_wrapper::bitmasks::event::EventTypes::CRITICAL_XID_ERROR,
                set,
            ) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(index = i, error = %e.error, "NVML cannot watch XID errors; health reads ECC and retirement only");
                    return;
                }
            };
        }
        loop {
            match set.wait(5_000) {
                Ok(event) => {
                    let xid = match event.event_data {
                        Some(nvml_wrapper::enums::event::XidError::Value(x)) => x,
                        _ => continue,
                    };
                    let Ok(uuid) = event.device.uuid() else {
                        continue;
                    };
                    tracing::warn!(%uuid, xid, "XID error");
                    if let Ok(mut m) = xids.lock() {
                        m.entry(uuid).or_default().push(xid);
                    }
                    changed();
                }
                Err(NvmlError::Timeout) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "NVML's event wait failed; XID errors are no longer watched");
                    return;
                }
            }
        }
    });
}
