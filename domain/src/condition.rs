//! Conditions of a node or a reservation (`conditions jsonb`), in the shape Kubernetes made
//! familiar: a type, a status, a machine-readable reason, a message for people, and since when.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::text_enum::text_enum;

text_enum!(
    /// Whether a condition holds.
    ConditionStatus {
        True = "True",
        False = "False",
        Unknown = "Unknown",
    }
);

/// One condition, as stored in a `conditions` column.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    /// The condition's type, such as `Unschedulable` or `NodeLost` (an open set).
    #[serde(rename = "type")]
    pub kind: String,
    pub status: ConditionStatus,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub since: Option<DateTime<Utc>>,
    /// For `Unschedulable`: how many nodes of the pool each reason ruled out (placement counts
    /// them in the search that looked, `compute_place`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counts: Vec<ReasonCount>,
}

/// How many of something one reason accounts for, such as 12 nodes `NodeCordoned`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasonCount {
    /// A stable, machine-readable reason (`docs/reservations.md` lists placement's).
    pub reason: String,
    pub count: i64,
}

/// The `conditions` column of a row.
pub type Conditions = sqlx::types::Json<Vec<Condition>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_written_by_sql_and_by_rust_read_the_same() {
        // `jsonb_build_object` renders a timestamptz with an offset and microseconds; serde_json
        // renders chrono's RFC 3339. Both must decode.
        for stored in [
            r#"[{"type":"Unschedulable","status":"True","reason":"NoCapacity","message":"m","since":"2026-12-01T03:00:00.123456+00:00"}]"#,
            r#"[{"type":"Unschedulable","status":"True","reason":"NoCapacity","message":"m","since":"2026-12-01T03:00:00.123456Z"}]"#,
        ] {
            let c: Vec<Condition> = serde_json::from_str(stored).expect("decodes");
            assert_eq!(c[0].kind, "Unschedulable");
            assert_eq!(c[0].status, ConditionStatus::True);
            assert_eq!(
                c[0].since.map(|t| t.timestamp_micros()),
                Some(1_796_094_000_123_456)
            );
        }
    }
}
