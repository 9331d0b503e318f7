//! What this machine has, and how its GPUs are: discovered through NVML (`nvml-wrapper`, the
//! library loaded at run time) and the operating system, or read from `--inventory FILE`, a
//! small TOML file that lists the GPUs as Slurm's `gres.conf` does (hosts without NVML, and
//! the tests). Both sources give the same [`Discovered`]: the [`Inventory`] sent to the
//! control plane and each GPU's health, judged by one rule ([`judge`]) from what the driver
//! says (XID errors, double-bit ECC errors, pages pending retirement, a GPU off the bus).
//!
//! ```toml
//! # All four are optional: the operating system's values by default.
//! hostname = "gpu-7"
//! vcpu = 64
//! memory_mib = 515000
//! disk_gib = 3500
//!
//! [[gpu]]
//! uuid = "GPU-6b2c…"
//! model = "H100"            # as placement's `model` selects it
//! memory_mib = 81559
//! pci_bus_id = "00000000:17:00.0"
//! numa_node = 0             # where placement's `sameNumaNode` looks
//! nvlink_domain = "nvl-a"   # GPUs joined by NVLink share it (`sameNvlinkDomain`)
//! mig = [{ uuid = "MIG-…", profile = "3g.40gb" }, { uuid = "MIG-…", profile = "4g.40gb" }]
//! # What the driver would say, for a GPU that is not well (all optional):
//! xid = [79]
//! ecc_double_bit = 0
//! pages_pending_retirement = false
//! lost = false
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use compute_protocol::{GpuHealth, GpuInventory, Inventory, MigInstance};
use serde::Deserialize;

/// A GPU's health as the agent judged it, with the reason when it is not healthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    pub health: GpuHealth,
    pub reason: Option<String>,
}

/// What one read of the machine found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    pub inventory: Inventory,
    /// Each GPU's health, by UUID.
    pub health: BTreeMap<String, Health>,
    /// Where the GPUs came from: `nvml`, `file`, or why there are none (`no NVML: …`).
    pub source: String,
}

/// What the driver says of a GPU that bears on its health.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observations {
    /// Critical XID errors seen since the agent started (or listed in the file).
    pub xid: Vec<u64>,
    /// Uncorrected (double-bit) ECC errors, volatile count.
    pub ecc_double_bit: u64,
    /// Retired pages waiting for a reset to take effect.
    pub pages_pending_retirement: bool,
    /// The GPU has fallen off the bus (NVML answers `GPU_IS_LOST`).
    pub lost: bool,
}

/// XID errors that mean the GPU cannot be trusted with work until it is reset or repaired
/// (NVIDIA's XID catalogue); others (13, 31, 43, …: a program's own faults) do not.
const FATAL_XIDS: &[(u64, &str)] = &[
    (48, "double-bit ECC error"),
    (62, "internal micro-controller halt"),
    (63, "ECC page retirement or row remapping recorded"),
    (64, "ECC page retirement or row remapping failed"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (92, "high single-bit ECC error rate"),
    (94, "contained ECC error"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
];

/// The one rule: unhealthy when the GPU is lost, has a fatal XID, a double-bit ECC error or
/// pages pending retirement; healthy otherwise.
pub fn judge(o: &Observations) -> Health {
    let unhealthy = |reason: String| Health {
        health: GpuHealth::Unhealthy,
        reason: Some(reason),
    };
    if o.lost {
        return unhealthy("the GPU has fallen off the bus (NVML: GPU is lost)".into());
    }
    if let Some((xid, what)) = o
        .xid
        .iter()
        .find_map(|x| FATAL_XIDS.iter().find(|(f, _)| f == x))
    {
        return unhealthy(format!("XID {xid}: {what}"));
    }
    if o.ecc_double_bit > 0 {
        return unhealthy(format!(
            "{} uncorrected (double-bit) ECC error{}",
            o.ecc_double_bit,
            if o.ecc_double_bit == 1 { "" } else { "s" }
        ));
    }
    if o.pages_pending_retirement {
        return unhealthy("memory pages are pending retirement: reset the GPU".into());
    }
    Health {
        health: GpuHealth::Healthy,
        reason: None,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    hostname: Option<String>,
    vcpu: Option<i64>,
    memory_mib: Option<i64>,
    disk_gib: Option<i64>,
    #[serde(default)]
    gpu: Vec<FileGpu>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGpu {
    uuid: String,
    #[serde(default = "nvidia")]
    vendor: String,
    model: String,
    memory_mib: i64,
    pci_bus_id: Option<String>,
    numa_node: Option<i32>,
    nvlink_domain: Option<String>,
    #[serde(default)]
    mig: Vec<FileMig>,
    #[serde(default)]
    xid: Vec<u64>,
    #[serde(default)]
    ecc_double_bit: u64,
    #[serde(default)]
    pages_pending_retirement: bool,
    #[serde(default)]
    lost: bool,
}

fn nvidia() -> String {
    "nvidia".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileMig {
    uuid: String,
    profile: String,
}

/// Reads the machine: from `file` when given, otherwise through NVML (`nvidia_smi` lists the
/// MIG instances). `state_dir`'s file system is the disk.
pub fn discover(
    file: Option<&Path>,
    nvidia_smi: &Path,
    state_dir: &Path,
    xids: &BTreeMap<String, Vec<u64>>,
) -> Result<Discovered, String> {
    let os = Os::read(state_dir);
    match file {
        Some(path) => from_file(path, &os),
        None => Ok(crate::nvml::discover(nvidia_smi, xids).map_or_else(
            |why| Discovered {
                inventory: os.inventory(None, None, None, None, vec![]),
                health: BTreeMap::new(),
                source: format!("no NVIDIA GPU found: {why}"),
            },
            |(gpus, health)| Discovered {
                inventory: os.inventory(None, None, None, None, gpus),
                health,
                source: "nvml".into(),
            },
        )),
    }
}

fn from_file(path: &Path, os: &Os) -> Result<Discovered, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("the inventory file {}: {e}", path.display()))?;
    let file: File =
        toml::from_str(&text).map_err(|e| format!("the inventory file {}: {e}", path.display()))?;
    let mut health = BTreeMap::new();
    let gpus = file
        .gpu
        .into_iter()
        .map(|g| {
            let seen = Observations {
                xid: g.xid,
                ecc_double_bit: g.ecc_double_bit,
                pages_pending_retirement: g.pages_pending_retirement,
                lost: g.lost,
            };
            health.insert(g.uuid.clone(), judge(&seen));
            GpuInventory {
                uuid: g.uuid,
                vendor: g.vendor,
                model: g.model,
                memory_mib: g.memory_mib,
                pci_bus_id: g.pci_bus_id,
                numa_node: g.numa_node,
                nvlink_domain: g.nvlink_domain,
                mig_enabled: !g.mig.is_empty(),
                mig: g
                    .mig
                    .into_iter()
                    .map(|m| MigInstance {
                        uuid: m.uuid,
                        profile: m.profile,
                    })
                    .collect(),
            }
        })
        .collect();
    Ok(Discovered {
        inventory: os.inventory(
            file.hostname,
            file.vcpu,
            file.memory_mib,
            file.disk_gib,
            gpus,
        ),
        health,
        source: format!("file {}", path.display()),
    })
}

/// The operating system's view: hostname, online CPUs, memory, the state directory's disk.
struct Os {
    hostname: String,
    vcpu: i64,
    memory_mib: i64,
    disk_gib: i64,
}

impl Os {
    fn read(state_dir: &Path) -> Os {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_ascii_lowercase())
            .unwrap_or_else(|_| "localhost".into());
        let vcpu = std::thread::available_parallelism().map_or(1, |n| n.get() as i64);
        let memory_mib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<i64>().ok())
            })
            .map_or(0, |kib| kib / 1024);
        Os {
            hostname,
            vcpu,
            memory_mib,
            disk_gib: crate::sys::disk_gib(state_dir).unwrap_or(0),
        }
    }

    fn inventory(
        &self,
        hostname: Option<String>,
        vcpu: Option<i64>,
        memory_mib: Option<i64>,
        disk_gib: Option<i64>,
        gpus: Vec<GpuInventory>,
    ) -> Inventory {
        Inventory {
            hostname: hostname.unwrap_or_else(|| self.hostname.clone()),
            vcpu: vcpu.unwrap_or(self.vcpu),
            memory_mib: memory_mib.unwrap_or(self.memory_mib),
            disk_gib: disk_gib.unwrap_or(self.disk_gib),
            gpus,
        }
    }
}

/// The MIG instances `nvidia-smi -L` lists, by the UUID of their GPU:
///
/// ```text
/// GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5a4c…)
///   MIG 3g.20gb     Device  0: (UUID: MIG-1b2e…)
/// ```
pub fn parse_smi_list(text: &str) -> BTreeMap<String, Vec<MigInstance>> {
    fn uuid_of(line: &str) -> Option<&str> {
        let start = line.find("(UUID: ")? + "(UUID: ".len();
        let rest = &line[start..];
        Some(&rest[..rest.find(')')?])
    }
    let mut out: BTreeMap<String, Vec<MigInstance>> = BTreeMap::new();
    let mut gpu: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("GPU ") {
            gpu = uuid_of(t).map(str::to_owned);
            if let Some(g) = &gpu {
                out.entry(g.clone()).or_default();
            }
        } else if let Some(rest) = t.strip_prefix("MIG ")
            && let (Some(g), Some(uuid)) = (&gpu, uuid_of(t))
            && let Some(profile) = rest.split_whitespace().next()
        {
            out.entry(g.clone()).or_default().push(MigInstance {
                uuid: uuid.to_owned(),
                profile: profile.to_owned(),
            });
        }
    }
    out
}

/// The NVLink domains of a machine's GPUs: `links[i]` is GPU `i`'s PCI bus id and the bus ids
/// at the far end of its active NVLinks. GPUs linked to each other, directly or through the same
/// NVSwitch (a far end that is no GPU of this machine), share a domain, named `nvl-` and the
/// lowest bus id among its GPUs; a GPU without an active link has none (placement then counts
/// it as a domain of its own).
pub fn nvlink_domains(links: &[(String, Vec<String>)]) -> Vec<Option<String>> {
    let norm = |b: &str| b.trim().to_ascii_lowercase();
    // Union-find over the GPUs and the far ends that are not GPUs (switches).
    let mut index: BTreeMap<String, usize> = links
        .iter()
        .enumerate()
        .map(|(i, (bus, _))| (norm(bus), i))
        .collect();
    let mut parent: Vec<usize> = (0..links.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    for (i, (_, remotes)) in links.iter().enumerate() {
        for r in remotes {
            let key = norm(r);
            let j = *index.entry(key).or_insert_with(|| {
                parent.push(parent.len());
                parent.len() - 1
            });
            let (a, b) = (root(&mut parent, i), root(&mut parent, j));
            parent[a.max(b)] = a.min(b);
        }
    }
    let mut names: BTreeMap<usize, String> = BTreeMap::new();
    for (i, (bus, _)) in links.iter().enumerate() {
        let r = root(&mut parent, i);
        let name = names.entry(r).or_insert_with(|| norm(bus));
        if norm(bus) < *name {
            *name = norm(bus);
        }
    }
    links
        .iter()
        .enumerate()
        .map(|(i, (_, remotes))| {
            (!remotes.is_empty()).then(|| format!("nvl-{}", names[&root(&mut parent, i)]))
        })
        .collect()
}

/// The NUMA node of the PCI device `bus_id` (NVML's `00000000:17:00.0`) as Linux says it under
/// `sysfs` (`/sys`): `bus/pci/devices/0000:17:00.0/numa_node`; `None` when unknown (`-1`, or
/// no such file).
pub fn numa_node_of(sysfs: &Path, bus_id: &str) -> Option<i32> {
    let bus = bus_id.trim().to_ascii_lowercase();
    // sysfs writes the PCI domain with 4 digits, NVML with 8.
    let (domain, rest) = bus.split_once(':')?;
    let domain = format!("{:0>4}", domain.trim_start_matches('0'));
    let path = sysfs
        .join("bus/pci/devices")
        .join(format!("{domain}:{rest}"))
        .join("numa_node");
    let n: i32 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (n >= 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_linked_directly_or_through_a_switch_share_a_domain() {
        let links = vec![
            (
                "00000000:17:00.0".to_owned(),
                vec!["00000000:2A:00.0".to_owned()],
            ),
            (
                "00000000:2A:00.0".to_owned(),
                vec!["00000000:17:00.0".to_owned()],
            ),
            // Two GPUs on one NVSwitch (its bus id is no GPU's), a third on none.
            (
                "00000000:9A:00.0".to_owned(),
                vec!["00000000:E0:00.0".to_owned()],
            ),
            (
                "00000000:AB:00.0".to_owned(),
                vec!["00000000:e0:00.0".to_owned()],
            ),
            ("00000000:CB:00.0".to_owned(), vec![]),
        ];
        assert_eq!(
            nvlink_domains(&links),
            vec![
                Some("nvl-00000000:17:00.0".to_owned()),
                Some("nvl-00000000:17:00.0".to_owned()),
                Some("nvl-00000000:9a:00.0".to_owned()),
                Some("nvl-00000000:9a:00.0".to_owned()),
                None,
            ]
        );
    }

    #[test]
    fn the_numa_node_is_read_where_linux_writes_it() {
        let sys = std::env::temp_dir().join(format!("compute-sysfs-{}", std::process::id()));
        let dev = sys.join("bus/pci/devices/0000:17:00.0");
        std::fs::create_dir_all(&dev).expect("dir");
        std::fs::write(dev.join("numa_node"), "1\n").expect("write");
        let none = sys.join("bus/pci/devices/0000:2a:00.0");
        std::fs::create_dir_all(&none).expect("dir");
        std::fs::write(none.join("numa_node"), "-1\n").expect("write");
        assert_eq!(numa_node_of(&sys, "00000000:17:00.0"), Some(1));
        assert_eq!(numa_node_of(&sys, "00000000:2A:00.0"), None);
        assert_eq!(numa_node_of(&sys, "00000000:99:00.0"), None);
        let _ = std::fs::remove_dir_all(&sys);
    }

    #[test]
    fn the_health_rule_names_its_reason() {
        assert_eq!(judge(&Observations::default()).health, GpuHealth::Healthy);
        let xid = |x: u64| {
            judge(&Observations {
                xid: vec![13, x],
                ..Default::default()
            })
        };
        assert_eq!(
            xid(79).reason.as_deref(),
            Some("XID 79: GPU has fallen off the bus")
        );
        assert_eq!(xid(31).health, GpuHealth::Healthy, "a program's fault");
        let ecc = judge(&Observations {
            ecc_double_bit: 2,
            ..Default::default()
        });
        assert_eq!(
            ecc.reason.as_deref(),
            Some("2 uncorrected (double-bit) ECC errors")
        );
        assert!(
            judge(&Observations {
                lost: true,
                xid: vec![48],
                ..Default::default()
            })
            .reason
            .is_some_and(|r| r.contains("fallen off the bus"))
        );
        assert_eq!(
            judge(&Observations {
                pages_pending_retirement: true,
                ..Default::default()
            })
            .health,
            GpuHealth::Unhealthy
        );
    }

    #[test]
    fn nvidia_smi_lists_mig_instances_under_their_gpu() {
        let text = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)\n  MIG 3g.20gb     Device  0: (UUID: MIG-1111)\n  MIG 1g.5gb      Device  1: (UUID: MIG-2222)\nGPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbbb)\n";
        let m = parse_smi_list(text);
        assert_eq!(m["GPU-aaaa"].len(), 2);
        assert_eq!(m["GPU-aaaa"][1].profile, "1g.5gb");
        assert_eq!(m["GPU-aaaa"][1].uuid, "MIG-2222");
        assert!(m["GPU-bbbb"].is_empty());
    }

    #[test]
    fn a_file_lists_gpus_and_their_observations() {
        let dir = std::env::temp_dir().join(format!("inv-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("inventory.toml");
        std::fs::write(
            &path,
            "hostname = \"gpu-7\"\nvcpu = 8\n[[gpu]]\nuuid = \"GPU-x\"\nmodel = \"H100\"\nmemory_mib = 81559\nxid = [79]\n[[gpu]]\nuuid = \"GPU-y\"\nmodel = \"A100\"\nmemory_mib = 40960\nmig = [{ uuid = \"MIG-1\", profile = \"3g.20gb\" }]\n",
        )
        .expect("write");
        let d = discover(
            Some(&path),
            Path::new("/nonexistent"),
            &dir,
            &BTreeMap::new(),
        )
        .expect("reads");
        assert_eq!(d.inventory.hostname, "gpu-7");
        assert_eq!(d.inventory.vcpu, 8);
        assert!(d.inventory.memory_mib > 0, "the OS's memory by default");
        assert_eq!(d.inventory.gpus.len(), 2);
        assert!(d.inventory.gpus[1].mig_enabled);
        assert_eq!(d.health["GPU-x"].health, GpuHealth::Unhealthy);
        assert_eq!(d.health["GPU-y"].health, GpuHealth::Healthy);
        std::fs::write(
            &path,
            "[[gpu]]\nuuid = \"GPU-x\"\nmodel = \"H100\"\nmemory_mib = 1\ncolour = \"red\"\n",
        )
        .expect("write");
        let e = discover(
            Some(&path),
            Path::new("/nonexistent"),
            &dir,
            &BTreeMap::new(),
        )
        .expect_err("an unknown key is refused");
        assert!(e.contains("inventory.toml"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
