//! Identifiers: a type prefix and a time-ordered body, such as `site_0193a4c1d2e3…`.
//!
//! The body is a UUIDv7 in simple form (48 bits of milliseconds first), so ids sort by creation
//! time and `node(id:)` can route on the prefix. The SQL function `compute_new_id(prefix)` makes
//! ids of the same shape.

/// The prefixes of the system's entities.
pub const PREFIXES: [&str; 9] = [
    "site", "pool", "node", "dev", "rsv", "alc", "cmd", "evt", "snk",
];

/// A new id with `prefix`, time-ordered by the wall clock of this process.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::now_v7().simple())
}

/// The prefix of an id, if it has a known one.
pub fn prefix_of(id: &str) -> Option<&'static str> {
    let (prefix, body) = id.split_once('_')?;
    if body.len() != 32 || !body.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    PREFIXES.iter().copied().find(|p| *p == prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix_and_sort_by_time() {
        let a = new_id("site");
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_id("site");
        assert!(a < b, "{a} should sort before {b}");
        assert_eq!(prefix_of(&a), Some("site"));
        assert_eq!(prefix_of("site_xyz"), None);
        assert_eq!(prefix_of(&new_id("nope")), None);
    }
}
