//! A reservation request, parsed so that only valid requests reach placement.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fleet::model::{self as m, AtomKind, Labels, MIG_COMPUTE_SLICES, TaintEffect};

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
}

impl AllocationRequest {
    /// The GPU share this allocation charges against quota, as a decimal with six places:
    /// 1 per whole GPU, compute slices / 7 per MIG instance, 1 / slots per slot.
    pub fn gpu_share(&self) -> f64 {
        let per = match self.gpu_kind {
            AtomKind::Gpu => 1.0,
            AtomKind::Mig => {
                let slices = self
                    .profile
                    .as_deref()
                    .and_then(|p| p.split('g').next())
                    .and_then(|n| n.parse::<u32>().ok())
                    .unwrap_or(MIG_COMPUTE_SLICES);
                f64::from(slices) / f64::from(MIG_COMPUTE_SLICES)
            }
            AtomKind::Slot => 1.0 / f64::from(self.slots_per_gpu.unwrap_or(1).max(1)),
        };
        let share = per * f64::from(self.gpu_count);
        (share * 1_000_000.0).round() / 1_000_000.0
    }

    /// In words, for conditions and errors: "4 H100 GPUs", "2 MIG 1g.10gb instances".
    pub fn describe(&self) -> String {
        let model = self
            .model
            .as_deref()
            .map(|m| format!("{m} "))
            .unwrap_or_default();
        match self.gpu_kind {
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
        }
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
}

/// A whole reservation request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReservationRequest {
    pub pool_id: String,
    /// `None`: now.
    pub starts_at: Option<DateTime<Utc>>,
    pub ends_at: DateTime<Utc>,
    pub allocations: Vec<AllocationRequest>,
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
    })
}

/// The longest window a reservation may have.
pub const MAX_DAYS: i64 = 366;

/// Parses a request.
pub fn parse_request(
    pool_id: &str,
    starts_at: Option<DateTime<Utc>>,
    ends_at: DateTime<Utc>,
    allocations: &[AllocationInput],
) -> Result<ReservationRequest> {
    let pool_id = m::parse_id("poolId", "pool", pool_id)?;
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
        assert_eq!(a.gpu_share(), 0.857143);
        a.gpu_kind = AtomKind::Gpu;
        a.profile = None;
        assert_eq!(a.gpu_share(), 2.0);
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
        assert_eq!(s.gpu_share(), 0.75);
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
