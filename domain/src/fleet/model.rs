//! The fleet's types, parsed from input so that only valid values exist past this point.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

use crate::text_enum::text_enum;

text_enum!(
    /// What kind of machines a pool holds.
    PoolKind { BareMetal = "bare_metal", Provider = "provider", VpsHost = "vps_host" }
);
text_enum!(
    /// Whether the node's daemon is talking to the control plane.
    Reachability { Connected = "connected", Disconnected = "disconnected", Unreachable = "unreachable", Lost = "lost" }
);
text_enum!(
    /// How a GPU is shared.
    DeviceMode { Exclusive = "exclusive", Mig = "mig", TimeSlice = "time_slice", Mps = "mps" }
);
text_enum!(
    /// A GPU's health as reported or set by an operator.
    Health { Healthy = "healthy", Degraded = "degraded", Unhealthy = "unhealthy" }
);
text_enum!(
    /// What a taint does to placement.
    TaintEffect { NoSchedule = "NoSchedule", PreferNoSchedule = "PreferNoSchedule", NoExecute = "NoExecute" }
);
text_enum!(
    /// The kind of a bookable atom.
    AtomKind { Gpu = "gpu", Mig = "mig", Slot = "slot" }
);
text_enum!(
    /// A scalar resource of a node.
    Resource { Vcpu = "vcpu", MemoryMib = "memory_mib", DiskGib = "disk_gib" }
);
text_enum!(
    /// Why a booking holds an atom (`device_bookings.reason`): an allocation's, a mode change's
    /// hold, or the hold left after the node's daemon refused the allocation's devices
    /// (`DEVICE_OVERLAP`: something else runs on them), until the end of the reservation's window.
    BookingReason { Allocation = "allocation", ModeChange = "mode_change", OverlapHold = "overlap_hold" }
);

/// A name: trimmed, 1 to 100 characters, no control characters.
pub fn parse_name(field: &str, value: &str) -> Result<String> {
    parse_printable(field, value, 100)
}

/// A GPU's vendor: 1 to 50 printable characters (the `devices_vendor_length` check).
pub fn parse_vendor(field: &str, value: &str) -> Result<String> {
    parse_printable(field, value, 50)
}

/// 1 to `max` printable characters, trimmed.
fn parse_printable(field: &str, value: &str, max: usize) -> Result<String> {
    let v = value.trim();
    if v.is_empty() || v.chars().count() > max || v.chars().any(char::is_control) {
        return Err(Error::bad_input(
            field,
            format!("`{field}` must be 1 to {max} printable characters"),
        ));
    }
    Ok(v.to_owned())
}

/// A label or taint key: 1 to 63 of `[A-Za-z0-9._/-]`, starting with a letter or digit.
pub fn parse_key(field: &str, key: &str) -> Result<String> {
    let ok = !key.is_empty()
        && key.len() <= 63
        && key
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '/' | '-'));
    if ok {
        Ok(key.to_owned())
    } else {
        Err(Error::bad_input(
            field,
            format!("`{key}` is not a valid key: 1 to 63 of letters, digits, `.`, `_`, `/`, `-`"),
        ))
    }
}

/// A label or taint value: up to 63 of `[A-Za-z0-9._-]`, possibly empty.
pub fn parse_value(field: &str, value: &str) -> Result<String> {
    let ok = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(value.to_owned())
    } else {
        Err(Error::bad_input(
            field,
            format!("`{value}` is not a valid value: up to 63 of letters, digits, `.`, `_`, `-`"),
        ))
    }
}

/// Node labels, key to value.
pub type Labels = BTreeMap<String, String>;

/// Parses labels; a key given twice is refused.
pub fn parse_labels(field: &str, pairs: &[(String, String)]) -> Result<Labels> {
    let mut labels = Labels::new();
    for (k, v) in pairs {
        let key = parse_key(field, k)?;
        let value = parse_value(field, v)?;
        if labels.insert(key, value).is_some() {
            return Err(Error::bad_input(
                field,
                format!("label `{k}` is given twice"),
            ));
        }
    }
    Ok(labels)
}

/// A taint, `key=value:effect`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: TaintEffect,
}

impl Taint {
    /// Validates the parts of a taint.
    pub fn new(field: &str, key: &str, value: &str, effect: TaintEffect) -> Result<Taint> {
        Ok(Taint {
            key: parse_key(field, key)?,
            value: parse_value(field, value)?,
            effect,
        })
    }

    /// Parses `key=value:Effect` (or `key:Effect`).
    pub fn parse(field: &str, s: &str) -> Result<Taint> {
        let (kv, effect) = s.rsplit_once(':').ok_or_else(|| {
            Error::bad_input(field, format!("`{s}` is not a taint: use key=value:Effect"))
        })?;
        let effect = TaintEffect::parse(effect).ok_or_else(|| {
            Error::bad_input(
                field,
                format!("`{effect}` is not a taint effect: use NoSchedule, PreferNoSchedule or NoExecute"),
            )
        })?;
        let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
        Taint::new(field, key, value, effect)
    }
}

impl std::fmt::Display for Taint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}:{}", self.key, self.value, self.effect.as_str())
    }
}

/// Why an operator did something (a cordon, a health change, a quarantine): trimmed, 1 to 500
/// printable characters. Parsed at the door, so a command holds only a valid reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason(String);

impl Reason {
    /// Parses a required reason.
    pub fn parse(field: &str, s: &str) -> Result<Reason> {
        let r = s.trim();
        if r.is_empty() {
            return Err(Error::bad_input(field, format!("`{field}` must say why")));
        }
        if r.chars().count() > 500 || r.chars().any(char::is_control) {
            return Err(Error::bad_input(
                field,
                format!("`{field}` is at most 500 printable characters"),
            ));
        }
        Ok(Reason(r.to_owned()))
    }

    /// Parses an optional reason; an empty one is none.
    pub fn parse_optional(field: &str, s: Option<&str>) -> Result<Option<Reason>> {
        match s.map(str::trim) {
            None | Some("") => Ok(None),
            Some(r) => Reason::parse(field, r).map(Some),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A GPU's hardware id (`GPU-…` for NVIDIA): 4 to 80 letters, digits and `-`, starting with a
/// letter or digit. It names the GPU's whole-GPU atom.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuUuid(String);

impl GpuUuid {
    /// A new, random one in NVIDIA's shape (the demonstration fleet's GPUs).
    pub fn random() -> GpuUuid {
        GpuUuid(format!("GPU-{}", uuid::Uuid::now_v7()))
    }

    pub fn parse(field: &str, s: &str) -> Result<GpuUuid> {
        let ok = (4..=80).contains(&s.len())
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if ok {
            Ok(GpuUuid(s.to_owned()))
        } else {
            Err(Error::bad_input(field, format!("`{s}` is not a GPU UUID")))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The longest a node may be unreachable before it counts as lost: a year (366 days).
pub const MAX_LOST_AFTER_SECONDS: i64 = 366 * 86_400;

/// How long a node of a provider or VPS pool may be unreachable before it counts as lost: 1 to
/// [`MAX_LOST_AFTER_SECONDS`] seconds.
pub fn parse_lost_after(field: &str, seconds: i64) -> Result<i64> {
    if !(1..=MAX_LOST_AFTER_SECONDS).contains(&seconds) {
        return Err(Error::bad_input(
            field,
            format!("`{field}` must be 1 to {MAX_LOST_AFTER_SECONDS} seconds (366 days)"),
        ));
    }
    Ok(seconds)
}

/// The most GPUs one node registers with.
pub const MAX_GPUS_PER_NODE: usize = 64;

/// A host name: lowercase letters, digits, `.` and `-`, at most 253 characters.
pub fn parse_hostname(field: &str, s: &str) -> Result<String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
        && !s.starts_with(['.', '-'])
        && !s.ends_with(['.', '-']);
    if ok {
        Ok(s.to_owned())
    } else {
        Err(Error::bad_input(
            field,
            format!("`{s}` is not a host name: lowercase letters, digits, `.` and `-`"),
        ))
    }
}

/// An overcommit ratio: 1 to 100, at most three decimals.
pub fn parse_ratio(field: &str, r: f64) -> Result<f64> {
    if !(1.0..=100.0).contains(&r) || !r.is_finite() {
        return Err(Error::bad_input(
            field,
            format!("the overcommit ratio must be between 1 and 100 (got {r})"),
        ));
    }
    Ok((r * 1000.0).round() / 1000.0)
}

/// A non-negative count within `max`.
pub fn parse_count(field: &str, n: i64, min: i64, max: i64) -> Result<i64> {
    if n < min || n > max {
        return Err(Error::bad_input(
            field,
            format!("`{field}` must be between {min} and {max} (got {n})"),
        ));
    }
    Ok(n)
}

/// Where a GPU sits in its machine: what placement keeps together (`sameNvlinkDomain`,
/// `sameNumaNode`). Unknown parts are `None`: such a GPU is a group of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Topology {
    /// The PCI bus id, as NVML writes it (`00000000:17:00.0`).
    pub pci_bus_id: Option<String>,
    pub numa_node: Option<i32>,
    /// The GPUs joined by NVLink share a domain name.
    pub nvlink_domain: Option<String>,
}

/// A PCI bus id: 1 to 64 of `[0-9A-Fa-f:.]`, written upper-case as NVML writes it.
pub fn parse_pci_bus_id(field: &str, bus: &str) -> Result<String> {
    let b = bus.trim();
    if b.is_empty()
        || b.len() > 64
        || !b
            .chars()
            .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
    {
        return Err(Error::bad_input(
            field,
            "a PCI bus id is 1 to 64 of `0-9 A-F : .` (`00000000:17:00.0`)",
        ));
    }
    Ok(b.to_ascii_uppercase())
}

/// A NUMA node: 0 to 1023.
pub fn parse_numa_node(field: &str, n: i64) -> Result<i32> {
    parse_count(field, n, 0, 1023).map(|n| n as i32)
}

/// An NVLink domain's name: 1 to 128 printable characters.
pub fn parse_nvlink_domain(field: &str, domain: &str) -> Result<String> {
    let d = domain.trim();
    if d.is_empty() || d.chars().count() > 128 || d.chars().any(char::is_control) {
        return Err(Error::bad_input(
            field,
            "an NVLink domain is named by 1 to 128 printable characters",
        ));
    }
    Ok(d.to_owned())
}

/// Parses a GPU's topology ([`parse_pci_bus_id`], [`parse_numa_node`],
/// [`parse_nvlink_domain`]); `field` prefixes the errors' fields.
pub fn parse_topology(
    field: &str,
    pci_bus_id: Option<&str>,
    numa_node: Option<i64>,
    nvlink_domain: Option<&str>,
) -> Result<Topology> {
    Ok(Topology {
        pci_bus_id: pci_bus_id
            .map(|b| parse_pci_bus_id(&format!("{field}.pciBusId"), b))
            .transpose()?,
        numa_node: numa_node
            .map(|n| parse_numa_node(&format!("{field}.numaNode"), n))
            .transpose()?,
        nvlink_domain: nvlink_domain
            .map(|d| parse_nvlink_domain(&format!("{field}.nvlinkDomain"), d))
            .transpose()?,
    })
}

/// A time PostgreSQL can hold and this system can reason about: between the years 1970 and
/// 9999, to the microsecond (finer is cut). `field` names it in the error. Every time a client
/// sends passes through here.
pub fn parse_time(field: &str, t: DateTime<Utc>) -> Result<DateTime<Utc>> {
    use chrono::{Datelike, SubsecRound};
    if (1970..=9999).contains(&t.year()) {
        // PostgreSQL keeps microseconds: a time is compared as it will be stored, so an
        // extension by half a microsecond is no extension (it was accepted, stored as the old
        // end, and written as a change with its event).
        Ok(t.trunc_subsecs(6))
    } else {
        Err(Error::bad_input(
            field,
            format!("`{field}` must be between the years 1970 and 9999"),
        ))
    }
}

/// A time window, start before end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

impl Window {
    pub fn new(field: &str, start: DateTime<Utc>, end: DateTime<Utc>) -> Result<Window> {
        let start = parse_time(&format!("{field}.start"), start)?;
        let end = parse_time(&format!("{field}.end"), end)?;
        if start >= end {
            return Err(Error::bad_input(
                field,
                "the window must start before it ends",
            ));
        }
        Ok(Window { start, end })
    }
}

/// A MIG profile: `<compute slices>g.<memory>gb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfile {
    pub name: &'static str,
    pub compute_slices: u32,
    pub memory_slices: u32,
}

/// The MIG profiles of 40 GB GPUs (A100 40GB): 7 compute and 8 memory slices of 5 GB.
const MIG_40GB: &[MigProfile] = &[
    MigProfile {
        name: "1g.5gb",
        compute_slices: 1,
        memory_slices: 1,
    },
    MigProfile {
        name: "1g.10gb",
        compute_slices: 1,
        memory_slices: 2,
    },
    MigProfile {
        name: "2g.10gb",
        compute_slices: 2,
        memory_slices: 2,
    },
    MigProfile {
        name: "3g.20gb",
        compute_slices: 3,
        memory_slices: 4,
    },
    MigProfile {
        name: "4g.20gb",
        compute_slices: 4,
        memory_slices: 4,
    },
    MigProfile {
        name: "7g.40gb",
        compute_slices: 7,
        memory_slices: 8,
    },
];

/// The MIG profiles of 80 GB GPUs (A100 80GB, H100 80GB): 7 compute and 8 memory slices of 10 GB.
const MIG_80GB: &[MigProfile] = &[
    MigProfile {
        name: "1g.10gb",
        compute_slices: 1,
        memory_slices: 1,
    },
    MigProfile {
        name: "1g.20gb",
        compute_slices: 1,
        memory_slices: 2,
    },
    MigProfile {
        name: "2g.20gb",
        compute_slices: 2,
        memory_slices: 2,
    },
    MigProfile {
        name: "3g.40gb",
        compute_slices: 3,
        memory_slices: 4,
    },
    MigProfile {
        name: "4g.40gb",
        compute_slices: 4,
        memory_slices: 4,
    },
    MigProfile {
        name: "7g.80gb",
        compute_slices: 7,
        memory_slices: 8,
    },
];

/// Compute slices of a MIG-capable GPU.
pub const MIG_COMPUTE_SLICES: u32 = 7;
/// Memory slices of a MIG-capable GPU.
pub const MIG_MEMORY_SLICES: u32 = 8;

/// The MIG profiles a GPU with `memory_mib` of memory offers, by its memory class (40 or 80 GB).
pub fn mig_profiles(memory_mib: i64) -> Option<&'static [MigProfile]> {
    let gib = memory_mib as f64 / 1024.0;
    let class = (gib / 8.0).round() as i64 * 8;
    match class {
        40 => Some(MIG_40GB),
        80 => Some(MIG_80GB),
        _ => None,
    }
}

/// How a GPU is divided, validated against its mode and memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    Exclusive,
    Mig(Vec<MigProfile>),
    TimeSlice(u32),
    Mps(u32),
}

/// The most slots a time-sliced or MPS GPU may have.
pub const MAX_SLOTS: u32 = 64;

impl Layout {
    /// Validates `mode` with its layout input: MIG profiles or a slot count.
    pub fn parse(
        field: &str,
        mode: DeviceMode,
        mig_profiles_in: Option<&[String]>,
        slots: Option<i64>,
        memory_mib: i64,
    ) -> Result<Layout> {
        match mode {
            DeviceMode::Exclusive => {
                if mig_profiles_in.is_some_and(|p| !p.is_empty()) || slots.is_some() {
                    return Err(Error::bad_input(field, "an exclusive GPU takes no layout"));
                }
                Ok(Layout::Exclusive)
            }
            DeviceMode::Mig => {
                if slots.is_some() {
                    return Err(Error::bad_input(
                        field,
                        "a MIG layout lists profiles, not slots",
                    ));
                }
                let wanted = mig_profiles_in.unwrap_or(&[]);
                if wanted.is_empty() {
                    return Err(Error::bad_input(
                        field,
                        "a MIG layout needs at least one profile",
                    ));
                }
                let known = mig_profiles(memory_mib).ok_or_else(|| {
                    Error::bad_input(
                        field,
                        format!(
                            "MIG needs a 40 GB or 80 GB GPU; this one has {} MiB",
                            memory_mib
                        ),
                    )
                })?;
                let mut profiles = Vec::with_capacity(wanted.len());
                for name in wanted {
                    let p = known.iter().find(|p| p.name == name).ok_or_else(|| {
                        let names: Vec<&str> = known.iter().map(|p| p.name).collect();
                        Error::bad_input(
                            field,
                            format!(
                                "unknown MIG profile `{name}` for this GPU; known: {}",
                                names.join(", ")
                            ),
                        )
                    })?;
                    profiles.push(*p);
                }
                let compute: u32 = profiles.iter().map(|p| p.compute_slices).sum();
                let memory: u32 = profiles.iter().map(|p| p.memory_slices).sum();
                if compute > MIG_COMPUTE_SLICES || memory > MIG_MEMORY_SLICES {
                    return Err(Error::bad_input(
                        field,
                        format!(
                            "the MIG instances overlap: they need {compute} of {MIG_COMPUTE_SLICES} compute slices and {memory} of {MIG_MEMORY_SLICES} memory slices"
                        ),
                    ));
                }
                Ok(Layout::Mig(profiles))
            }
            DeviceMode::TimeSlice | DeviceMode::Mps => {
                if mig_profiles_in.is_some_and(|p| !p.is_empty()) {
                    return Err(Error::bad_input(
                        field,
                        "a time-slice or MPS layout gives slots, not profiles",
                    ));
                }
                let n = slots.ok_or_else(|| {
                    Error::bad_input(field, "a time-slice or MPS layout needs `slots`")
                })?;
                let n = parse_count(field, n, 2, i64::from(MAX_SLOTS))? as u32;
                Ok(if mode == DeviceMode::Mps {
                    Layout::Mps(n)
                } else {
                    Layout::TimeSlice(n)
                })
            }
        }
    }

    /// The mode of this layout.
    pub fn mode(&self) -> DeviceMode {
        match self {
            Layout::Exclusive => DeviceMode::Exclusive,
            Layout::Mig(_) => DeviceMode::Mig,
            Layout::TimeSlice(_) => DeviceMode::TimeSlice,
            Layout::Mps(_) => DeviceMode::Mps,
        }
    }

    /// The layout as stored in `devices.layout`.
    pub fn stored(&self) -> Option<StoredLayout> {
        match self {
            Layout::Exclusive => None,
            Layout::Mig(p) => Some(StoredLayout {
                profiles: Some(p.iter().map(|p| p.name.to_owned()).collect()),
                slots: None,
            }),
            Layout::TimeSlice(n) | Layout::Mps(n) => Some(StoredLayout {
                profiles: None,
                slots: Some(*n),
            }),
        }
    }

    /// The bookable atoms of a GPU with hardware id `uuid` in this layout: the atom rule.
    pub fn atoms(&self, uuid: &str) -> Vec<AtomSpec> {
        match self {
            Layout::Exclusive => vec![AtomSpec {
                name: uuid.to_owned(),
                kind: AtomKind::Gpu,
                ordinal: 0,
                profile: None,
                share_num: 1,
                share_den: 1,
            }],
            Layout::Mig(profiles) => profiles
                .iter()
                .enumerate()
                .map(|(k, p)| AtomSpec {
                    name: format!("{uuid}/mig/{k}"),
                    kind: AtomKind::Mig,
                    ordinal: k as i32,
                    profile: Some(p.name.to_owned()),
                    share_num: p.compute_slices as i32,
                    share_den: MIG_COMPUTE_SLICES as i32,
                })
                .collect(),
            Layout::TimeSlice(n) | Layout::Mps(n) => (0..*n)
                .map(|k| AtomSpec {
                    name: format!("{uuid}/s{k}"),
                    kind: AtomKind::Slot,
                    ordinal: k as i32,
                    profile: None,
                    share_num: 1,
                    share_den: *n as i32,
                })
                .collect(),
        }
    }
}

/// A layout as stored in `devices.layout`: `{"profiles": [...]}` for MIG, `{"slots": n}` for
/// time-slicing and MPS, `NULL` for an exclusive GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredLayout {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profiles: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
}

/// An atom to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtomSpec {
    pub name: String,
    pub kind: AtomKind,
    pub ordinal: i32,
    pub profile: Option<String>,
    pub share_num: i32,
    pub share_den: i32,
}

/// A pool's rules against hoarding (`pools.rules`, and each reservation's `admitted_under`):
/// each applies only where it is set. Checked where a reservation is created or extended
/// (`compute_create_reservation`, `extend_reservation`); a refusal is `POLICY_VIOLATION` with the
/// rule's name (the field's name here) and its limit.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolRules {
    /// The longest a reservation may last, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration_seconds: Option<i64>,
    /// How far ahead of now a reservation may start, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lead_seconds: Option<i64>,
    /// The most GPU-hours one tenant may hold booked on the pool from now on: each live
    /// reservation's GPU charge times what is left of its window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_future_gpu_hours: Option<f64>,
    /// `false`: a reservation may not be extended once its window has started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extend_after_start: Option<bool>,
    /// How long an active reservation may go without a live instance before it is idle: it
    /// gets the `Idle` condition and a `reservation.idle` event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_grace_seconds: Option<i64>,
    /// `true`: an idle reservation is released (with its `Idle` condition saying why), not only
    /// reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_idle: Option<bool>,
}

impl PoolRules {
    /// The longest any rule may say, in seconds: ten years.
    pub const MAX_SECONDS: i64 = 10 * 366 * 24 * 3600;

    /// Rules as they enter: durations positive and at most ten years, GPU-hours positive and
    /// finite; `extend_after_start` is kept only when it forbids (`Some(false)`), `release_idle`
    /// only when it releases, and only with a grace.
    pub fn parse(
        max_duration_seconds: Option<i64>,
        max_lead_seconds: Option<i64>,
        max_future_gpu_hours: Option<f64>,
        extend_after_start: Option<bool>,
        idle_grace_seconds: Option<i64>,
        release_idle: Option<bool>,
    ) -> Result<PoolRules> {
        for (field, v) in [
            ("rules.maxDurationSeconds", max_duration_seconds),
            ("rules.maxLeadSeconds", max_lead_seconds),
            ("rules.idleGraceSeconds", idle_grace_seconds),
        ] {
            if let Some(v) = v
                && !(1..=Self::MAX_SECONDS).contains(&v)
            {
                return Err(crate::Error::bad_input(
                    field,
                    format!(
                        "`{field}` must be between 1 and {} seconds",
                        Self::MAX_SECONDS
                    ),
                ));
            }
        }
        if let Some(h) = max_future_gpu_hours
            && !(h.is_finite() && h > 0.0 && h <= 1e12)
        {
            return Err(crate::Error::bad_input(
                "rules.maxFutureGpuHours",
                "`rules.maxFutureGpuHours` must be a positive number of GPU-hours (at most 10^12)",
            ));
        }
        let release_idle = release_idle.filter(|release| *release);
        if release_idle.is_some() && idle_grace_seconds.is_none() {
            return Err(crate::Error::bad_input(
                "rules.releaseIdle",
                "`rules.releaseIdle` needs `rules.idleGraceSeconds`: after how long idle to release",
            ));
        }
        Ok(PoolRules {
            max_duration_seconds,
            max_lead_seconds,
            max_future_gpu_hours,
            extend_after_start: extend_after_start.filter(|allowed| !allowed),
            idle_grace_seconds,
            release_idle,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_atom_rule_never_exposes_parent_and_children_together() {
        let uuid = "GPU-1234";
        let exclusive = Layout::Exclusive.atoms(uuid);
        assert_eq!(exclusive.len(), 1);
        assert_eq!(exclusive[0].name, uuid);

        let mig = Layout::parse(
            "layout",
            DeviceMode::Mig,
            Some(&[
                "3g.40gb".into(),
                "2g.20gb".into(),
                "1g.10gb".into(),
                "1g.10gb".into(),
            ]),
            None,
            81_920,
        )
        .expect("valid layout");
        let atoms = mig.atoms(uuid);
        let names: Vec<&str> = atoms.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "GPU-1234/mig/0",
                "GPU-1234/mig/1",
                "GPU-1234/mig/2",
                "GPU-1234/mig/3"
            ]
        );
        assert!(!names.contains(&uuid), "a MIG GPU's parent is not bookable");
        assert_eq!((atoms[0].share_num, atoms[0].share_den), (3, 7));

        let slots =
            Layout::parse("layout", DeviceMode::TimeSlice, None, Some(4), 81_920).expect("slots");
        let names: Vec<String> = slots.atoms(uuid).into_iter().map(|a| a.name).collect();
        assert_eq!(
            names,
            ["GPU-1234/s0", "GPU-1234/s1", "GPU-1234/s2", "GPU-1234/s3"]
        );
    }

    #[test]
    fn bad_layouts_name_the_problem() {
        let err = Layout::parse(
            "layout",
            DeviceMode::Mig,
            Some(&["9g.90gb".into()]),
            None,
            81_920,
        )
        .expect_err("unknown profile");
        assert!(
            err.to_string().contains("unknown MIG profile `9g.90gb`"),
            "{err}"
        );
        let err = Layout::parse(
            "layout",
            DeviceMode::Mig,
            Some(&["4g.40gb".into(), "4g.40gb".into()]),
            None,
            81_920,
        )
        .expect_err("overlap");
        assert!(err.to_string().contains("overlap"), "{err}");
        let err = Layout::parse(
            "layout",
            DeviceMode::Mig,
            Some(&["1g.10gb".into()]),
            None,
            24_576,
        )
        .expect_err("no MIG on a 24 GB GPU");
        assert!(err.to_string().contains("40 GB or 80 GB"), "{err}");
        assert!(Layout::parse("layout", DeviceMode::TimeSlice, None, Some(1), 24_576).is_err());
        assert!(Layout::parse("layout", DeviceMode::Exclusive, None, Some(2), 24_576).is_err());
    }

    #[test]
    fn taints_parse_and_print() {
        let t = Taint::parse("taints", "gpu=a100:NoSchedule").expect("taint");
        assert_eq!(t.to_string(), "gpu=a100:NoSchedule");
        assert!(Taint::parse("taints", "gpu=a100:Sometimes").is_err());
        assert!(Taint::parse("taints", "=x:NoSchedule").is_err());
    }
}
