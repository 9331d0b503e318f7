//! What a quota limits: a leaf of `quota` (the event contract names it).

use crate::text_enum::text_enum;

text_enum!(
    /// What a quota limits.
    QuotaResource {
        /// GPUs, in whole-GPU equivalents (a MIG instance or a slot is a fraction).
        Gpu = "gpu",
        Vcpu = "vcpu",
        MemoryMib = "memory_mib",
    }
);
