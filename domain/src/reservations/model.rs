//! A reservation request, parsed so that only valid requests reach placement.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fleet::model::{self as m, AtomKind, Labels, MIG_COMPUTE_SLICES, TaintEffect};
use crate::ids::PoolId;

/// A toleration: matches taints with its key, and its value and effect when given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Toleration {
    pub key: String,
    pub value: Option<String>,
    pub effect: Option<TaintEffect>,
}

/// What one allocation asks for, on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocationRequest {
    pub gpu_kind: AtomKind,
    pub gpu_count: i32,
    pub model: Option<String>,
    /// MIG instances: the profile.
    pub profile: Option<String>,
    /// Slots: of a GPU divided in this many.
    pub slots_per_gpu: Option<i32>,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub node_selector: Labels,
    pub tolerations: Vec<Toleration>,
    /// All its GPUs on one NVLink domain (left out of the fingerprint when false, so keys
    /// stored before the field existed replay).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub same_nvlink_domain: bool,
    /// All its GPUs on one NUMA node.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub same_numa_node: bool,
}

impl AllocationRequest {
    /// The share of whole GPUs this allocation holds, as an exact fraction `(numerator,
    /// denominator)`: 1 per whole GPU, compute slices / 7 per MIG instance, 1 / slots per slot.
    pub fn gpu_fraction(&self) -> (u64, u64) {
        let count = u64::try_from(self.gpu_count).unwrap_or(0);
        match self.gpu_kind {
            AtomKind::Gpu => (count, 1),
            AtomKind::Mig => {
                let slices = self
                    .profile
                    .as_deref()
                    .and_then(|p| p.split('g').next())
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(u64::from(MIG_COMPUTE_SLICES));
                (slices * count, u64::from(MIG_COMPUTE_SLICES))
            }
            AtomKind::Slot => {
                let slots = u64::try_from(self.slots_per_gpu.unwrap_or(1))
                    .unwrap_or(1)
                    .max(1);
                (count, slots)
            }
        }
    }

    /// In words, for conditions and errors: "4 H100 GPUs", "2 MIG 1g.10gb instances", "8 GPUs
    /// on one NVLink domain".
    pub fn describe(&self) -> String {
        let model = self
            .model
            .as_deref()
            .map(|m| format!("{m} "))
            .unwrap_or_default();
        let together = match (self.same_nvlink_domain, self.same_numa_node) {
            (true, true) => " on one NVLink domain and one NUMA node",
            (true, false) => " on one NVLink domain",
            (false, true) => " on one NUMA node",
            (false, false) => "",
        };
        let what = match self.gpu_kind {
            AtomKind::Gpu => format!("{} {model}GPU{}", self.gpu_count, plural(self.gpu_count)),
            AtomKind::Mig => format!(
                "{} {model}MIG {} instance{}",
                self.gpu_count,
                self.profile.as_deref().unwrap_or("?"),
                plural(self.gpu_count)
            ),
            AtomKind::Slot => format!(
                "{} {model}slot{} of {}-way shared GPUs",
                self.gpu_count,
                plural(self.gpu_count),
                self.slots_per_gpu.unwrap_or(0)
            ),
        };
        format!("{what}{together}")
    }
}

fn plural(n: i32) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The raw input of one allocation.
#[derive(Debug, Clone, Default)]
pub struct AllocationInput {
    pub gpu_kind: Option<AtomKind>,
    pub gpu_count: i64,
    pub model: Option<String>,
    pub profile: Option<String>,
    pub slots_per_gpu: Option<i64>,
    pub vcpu: i64,
    pub memory_mib: i64,
    pub disk_gib: i64,
    pub node_selector: Vec<(String, String)>,
    pub tolerations: Vec<(String, Option<String>, Option<TaintEffect>)>,
    pub same_nvlink_domain: bool,
    pub same_numa_node: bool,
}

/// Where a gang's allocations go together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Colocate {
    /// All on one node.
    Node,
    /// All on nodes sharing one value of a label (one rack, one fabric).
    Label,
}

/// A gang: the rule a reservation's allocations are placed under, all of them or none
/// (`compute_place` tries group by group).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gang {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub colocate: Option<Colocate>,
    /// The label whose value the nodes share, with [`Colocate::Label`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Every allocation on a node of its own.
    pub spread: bool,
}

impl Gang {
    /// The rule in words, for messages: "on one node", "on nodes of one rack, each on a node of
    /// its own".
    pub fn describe(&self) -> String {
        let together = match (self.colocate, &self.label) {
            (Some(Colocate::Node), _) => "on one node".to_owned(),
            (Some(Colocate::Label), Some(l)) => format!("on nodes of one {l}"),
            _ => String::new(),
        };
        match (together.is_empty(), self.spread) {
            (true, true) => "each on a node of its own".into(),
            (false, true) => format!("{together}, each on a node of its own"),
            _ => together,
        }
    }
}

/// The raw input of a gang.
#[derive(Debug, Clone, Default)]
pub struct GangInput {
    pub colocate: Option<Colocate>,
    pub label: Option<String>,
    pub spread: Option<bool>,
}

/// Parses a gang: a rule to colocate (on one node, or on one value of `label`), to spread, or
/// to do both (one rack, distinct nodes); on one node and spread contradict each other.
pub fn parse_gang(field: &str, g: &GangInput) -> Result<Gang> {
    let spread = g.spread.unwrap_or(false);
    let label = match (g.colocate, &g.label) {
        (Some(Colocate::Label), Some(l)) => Some(m::parse_key(&format!("{field}.label"), l)?),
        (Some(Colocate::Label), None) => {
            return Err(Error::bad_input(
                format!("{field}.label"),
                "`colocate: LABEL` needs the `label` whose value the nodes share (such as `rack`)",
            ));
        }
        (_, Some(_)) => {
            return Err(Error::bad_input(
                format!("{field}.label"),
                "`label` goes with `colocate: LABEL` only",
            ));
        }
        (_, None) => None,
    };
    if g.colocate == Some(Colocate::Node) && spread {
        return Err(Error::bad_input(
            format!("{field}.spread"),
            "a gang on one node cannot also spread over distinct nodes",
        ));
    }
    if g.colocate.is_none() && !spread {
        return Err(Error::bad_input(
            field,
            "a gang states its rule: `colocate` (NODE or LABEL), `spread: true`, or both",
        ));
    }
    Ok(Gang {
        colocate: g.colocate,
        label,
        spread,
    })
}

/// A whole reservation request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReservationRequest {
    pub pool_id: PoolId,
    /// `None`: now.
    pub starts_at: Option<DateTime<Utc>>,
    pub ends_at: DateTime<Utc>,
    pub allocations: Vec<AllocationRequest>,
    /// The gang's rule, when its allocations go together or apart.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gang: Option<Gang>,
}

/// The most allocations one reservation may have.
pub const MAX_ALLOCATIONS: usize = 16;

/// Parses one allocation; `field` prefixes the field names of errors (`allocations[0]`).
pub fn parse_allocation(field: &str, a: &AllocationInput) -> Result<AllocationRequest> {
    let f = |name: &str| format!("{field}.{name}");
    let gpu_kind = a.gpu_kind.unwrap_or(AtomKind::Gpu);
    let gpu_count = m::parse_count(&f("gpuCount"), a.gpu_count, 1, 64)? as i32;
    let model = a
        .model
        .as_deref()
        .map(|s| m::parse_name(&f("model"), s))
        .transpose()?;
    let profile = match (gpu_kind, &a.profile) {
        (AtomKind::Mig, Some(p)) => {
            let known = m::mig_profiles(40 * 1024)
                .into_iter()
                .chain(m::mig_profiles(80 * 1024))
                .flatten()
                .any(|k| k.name == p);
            if !known {
                return Err(Error::bad_input(
                    f("profile"),
                    format!("unknown MIG profile `{p}`"),
                ));
            }
            Some(p.clone())
        }
        (AtomKind::Mig, None) => {
            return Err(Error::bad_input(
                f("profile"),
                "MIG instances need a `profile`",
            ));
        }
        (_, Some(_)) => {
            return Err(Error::bad_input(
                f("profile"),
                "only MIG instances take a `profile`",
            ));
        }
        (_, None) => None,
    };
    let slots_per_gpu = match (gpu_kind, a.slots_per_gpu) {
        (AtomKind::Slot, Some(n)) => {
            Some(m::parse_count(&f("slotsPerGpu"), n, 2, i64::from(m::MAX_SLOTS))? as i32)
        }
        (AtomKind::Slot, None) => {
            return Err(Error::bad_input(
                f("slotsPerGpu"),
                "slots need `slotsPerGpu`, the number of slots of the GPU",
            ));
        }
        (_, Some(_)) => {
            return Err(Error::bad_input(
                f("slotsPerGpu"),
                "only slots take `slotsPerGpu`",
            ));
        }
        (_, None) => None,
    };
    let tolerations = a
        .tolerations
        .iter()
        .map(|(k, v, e)| {
            Ok(Toleration {
                key: m::parse_key(&f("tolerations"), k)?,
                value: v
                    .as_deref()
                    .map(|v| m::parse_value(&f("tolerations"), v))
                    .transpose()?,
                effect: *e,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(AllocationRequest {
        gpu_kind,
        gpu_count,
        model,
        profile,
        slots_per_gpu,
        vcpu: m::parse_count(&f("vcpu"), a.vcpu, 0, 4096)?,
        memory_mib: m::parse_count(&f("memoryMib"), a.memory_mib, 0, 1 << 32)?,
        disk_gib: m::parse_count(&f("diskGib"), a.disk_gib, 0, 1 << 24)?,
        node_selector: m::parse_labels(&f("nodeSelector"), &a.node_selector)?,
        tolerations,
        same_nvlink_domain: a.same_nvlink_domain,
        same_numa_node: a.same_numa_node,
    })
}

/// The GPU quota a reservation charges: the exact sum of its allocations' shares
/// ([`AllocationRequest::gpu_fraction`]), rounded once, half up, to six decimals. Two `4g.40gb`
/// instances are 8/7 = 1.142857142… GPUs, charged 1.142857 (not 2 × 0.571429 = 1.142858).
pub fn gpu_charge(allocations: &[AllocationRequest]) -> f64 {
    fn gcd(a: u128, b: u128) -> u128 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let (num, den) = allocations
        .iter()
        .map(AllocationRequest::gpu_fraction)
        .fold((0u128, 1u128), |(n, d), (an, ad)| {
            let (an, ad) = (u128::from(an), u128::from(ad));
            let (n, d) = (n * ad + an * d, d * ad);
            let g = gcd(n, d).max(1);
            (n / g, d / g)
        });
    let micro = (num * 2_000_000 + den) / (2 * den);
    micro as f64 / 1_000_000.0
}

/// The longest window a reservation may have.
pub const MAX_DAYS: i64 = 366;

/// Parses a request.
pub fn parse_request(
    pool_id: &str,
    starts_at: Option<DateTime<Utc>>,
    ends_at: DateTime<Utc>,
    allocations: &[AllocationInput],
    gang: Option<&GangInput>,
) -> Result<ReservationRequest> {
    let pool_id = PoolId::parse("poolId", pool_id)?;
    let starts_at = starts_at
        .map(|t| m::parse_time("startsAt", t))
        .transpose()?;
    let ends_at = m::parse_time("endsAt", ends_at)?;
    if allocations.is_empty() || allocations.len() > MAX_ALLOCATIONS {
        return Err(Error::bad_input(
            "allocations",
            format!("a reservation has 1 to {MAX_ALLOCATIONS} allocations"),
        ));
    }
    if let Some(start) = starts_at {
        if ends_at <= start {
            return Err(Error::bad_input(
                "endsAt",
                "`endsAt` must be after `startsAt`",
            ));
        }
        if ends_at - start > chrono::Duration::days(MAX_DAYS) {
            return Err(Error::bad_input(
                "endsAt",
                format!("a reservation lasts at most {MAX_DAYS} days"),
            ));
        }
    }
    let allocations = allocations
        .iter()
        .enumerate()
        .map(|(i, a)| parse_allocation(&format!("allocations[{i}]"), a))
        .collect::<Result<Vec<_>>>()?;
    Ok(ReservationRequest {
        pool_id,
        starts_at,
        ends_at,
        allocations,
        gang: gang.map(|g| parse_gang("gang", g)).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_the_atom_rule() {
        let mut a = parse_allocation(
            "a",
            &AllocationInput {
                gpu_kind: Some(AtomKind::Mig),
                gpu_count: 2,
                profile: Some("3g.40gb".into()),
                ..Default::default()
            },
        )
        .expect("valid");
        assert_eq!(a.gpu_fraction(), (6, 7));
        assert_eq!(gpu_charge(std::slice::from_ref(&a)), 0.857143);
        let mut four = a.clone();
        four.gpu_count = 1;
        four.profile = Some("4g.40gb".into());
        // Rounded once on the sum: 8/7, not 2 × round(4/7).
        assert_eq!(gpu_charge(&[four.clone(), four.clone()]), 1.142857);
        // 1/7 + 1/7 + 1/7 + 4/7 = 1 exactly.
        let mut one = four.clone();
        one.profile = Some("1g.10gb".into());
        assert_eq!(gpu_charge(&[one.clone(), one.clone(), one, four]), 1.0);
        a.gpu_kind = AtomKind::Gpu;
        a.profile = None;
        assert_eq!(a.gpu_fraction(), (2, 1));
        let s = parse_allocation(
            "a",
            &AllocationInput {
                gpu_kind: Some(AtomKind::Slot),
                gpu_count: 3,
                slots_per_gpu: Some(4),
                ..Default::default()
            },
        )
        .expect("valid");
        assert_eq!(gpu_charge(&[s.clone(), a]), 2.75);
        // Thirds: 1/3 + 1/3 + 1/3 is 1, where rounding each would give 0.999999.
        let mut third = s;
        third.gpu_count = 1;
        third.slots_per_gpu = Some(3);
        assert_eq!(gpu_charge(&[third.clone(), third.clone(), third]), 1.0);
        let err = parse_allocation(
            "allocations[1]",
            &AllocationInput {
                gpu_count: 0,
                ..Default::default()
            },
        )
        .expect_err("zero");
        assert!(
            matches!(err, Error::BadUserInput { field: Some(ref f), .. } if f == "allocations[1].gpuCount")
        );
    }
}
