//! The one error type of the system, with the stable codes clients see in `extensions.code`.
//!
//! Every variant maps to exactly one [`ErrorCode`]; the API turns the code into
//! `extensions.code` and never adds another. The text of [`Error::Internal`] is logged with an
//! error id and never returned to a client (see `docs/errors.md`).

use std::fmt;

/// The stable, `SCREAMING_SNAKE` code of an error, as clients see it in `extensions.code`.
///
/// Adding a code is a change to the public contract: list it in `docs/errors.md` in the same
/// change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// No credentials, or credentials that are invalid, expired or signed the wrong way.
    Unauthenticated,
    /// Valid credentials without the role the operation needs.
    Forbidden,
    /// The object does not exist, or belongs to another tenant.
    NotFound,
    /// The input is malformed or out of range; `extensions.field` names the field when known.
    BadUserInput,
    /// A stale `version`, or a transition the state table does not allow.
    Conflict,
    /// The tenant's quota does not allow the request.
    QuotaExceeded,
    /// A rule of the pool does not allow the request; `extensions.rule` names it and
    /// `extensions.limit` gives its limit.
    PolicyViolation,
    /// No capacity satisfies the request now.
    Unschedulable,
    /// An idempotency key was reused with a different request.
    IdempotencyKeyReused,
    /// The first request with this idempotency key is still running.
    IdempotencyInProgress,
    /// A concurrent change holds the rows this one needs: retry.
    LockTimeout,
    /// The database could not be reached or went away mid-request: retry (with the same
    /// idempotency key for a mutation).
    Unavailable,
    /// An event cursor older than the retention window.
    CursorExpired,
    /// Too many requests.
    RateLimited,
    /// A fault of the server; the response carries an error id, the log has the detail.
    Internal,
}

impl ErrorCode {
    /// Every code, in the order `docs/errors.md` lists them.
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::BadUserInput,
        ErrorCode::Conflict,
        ErrorCode::QuotaExceeded,
        ErrorCode::PolicyViolation,
        ErrorCode::Unschedulable,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::IdempotencyInProgress,
        ErrorCode::LockTimeout,
        ErrorCode::Unavailable,
        ErrorCode::CursorExpired,
        ErrorCode::RateLimited,
        ErrorCode::Internal,
    ];

    /// The code as it appears on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::BadUserInput => "BAD_USER_INPUT",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::PolicyViolation => "POLICY_VIOLATION",
            ErrorCode::Unschedulable => "UNSCHEDULABLE",
            ErrorCode::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            ErrorCode::IdempotencyInProgress => "IDEMPOTENCY_IN_PROGRESS",
            ErrorCode::LockTimeout => "LOCK_TIMEOUT",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::CursorExpired => "CURSOR_EXPIRED",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::Internal => "INTERNAL",
        }
    }

    /// Whether sending the same request again, unchanged, can succeed.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::IdempotencyInProgress
                | ErrorCode::LockTimeout
                | ErrorCode::Unavailable
                | ErrorCode::RateLimited
                | ErrorCode::Unschedulable
                | ErrorCode::Internal
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A boxed error source for [`Error::Internal`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Every failure the domain reports. The message of each variant is what a client reads, except
/// for [`Error::Internal`], whose text only reaches the log.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{}", not_found_message(kind, id))]
    NotFound { kind: &'static str, id: String },
    #[error("{message}")]
    BadUserInput {
        field: Option<String>,
        message: String,
    },
    #[error("{message}")]
    Conflict {
        message: String,
        current_version: Option<i64>,
    },
    /// A guarded update found a newer version of the row than the caller read.
    #[error("{kind} {id} has version {current}, not {expected}: it changed since you read it")]
    StaleVersion {
        kind: &'static str,
        id: String,
        expected: i64,
        current: i64,
    },
    /// The state table does not allow `action` from `state`; `hint` says what would.
    #[error(
        "{kind} {id} is {state}: {action} is not allowed from that state{}",
        hint.as_deref().map(|h| format!("; {h}")).unwrap_or_default()
    )]
    IllegalTransition {
        kind: &'static str,
        id: String,
        state: &'static str,
        action: &'static str,
        current_version: Option<i64>,
        hint: Option<Box<str>>,
    },
    /// A guarded update's other conditions did not hold on a row that exists at the version
    /// given (the caller explains what is missing).
    #[error("{kind} {id} cannot change now")]
    PreconditionFailed {
        kind: &'static str,
        id: String,
        current_version: i64,
    },
    #[error("{0}")]
    QuotaExceeded(String),
    /// A rule of the pool (`rule`, such as `maxDurationSeconds`) with its `limit` refuses the
    /// request.
    #[error("{message}")]
    PolicyViolation {
        rule: String,
        limit: serde_json::Value,
        message: String,
    },
    #[error("{0}")]
    Unschedulable(String),
    #[error("{0}")]
    IdempotencyKeyReused(String),
    #[error("{0}")]
    IdempotencyInProgress(String),
    /// SQLSTATE 55P03: a lock wait passed the transaction kind's `lock_timeout`.
    #[error("another change to the same records is in progress; retry the request")]
    LockTimeout,
    /// Deadlocks (40P01) or serialization failures (40001) that outlasted the bounded retries.
    #[error(
        "the change kept colliding with concurrent changes ({attempts} attempts); retry the request"
    )]
    Contention { sqlstate: String, attempts: u32 },
    #[error("{0}")]
    CursorExpired(String),
    /// A fenced transaction found its lease taken over or expired; nothing was written.
    #[error("{0}")]
    LeaseLost(String),
    #[error("{0}")]
    RateLimited(String),
    /// The database could not be reached, or ended the connection (a restart, a failover); the
    /// transaction did not commit, or its commit is unknown: a retry with the same idempotency
    /// key settles it.
    #[error("the database is unavailable; retry the request")]
    Unavailable(#[source] BoxError),
    #[error("internal error: {0}")]
    Internal(#[source] BoxError),
}

fn not_found_message(kind: &str, id: &str) -> String {
    // A replayed NOT_FOUND carries its whole message in `id`.
    if kind == "object" && id.contains(' ') {
        id.to_owned()
    } else {
        format!("{kind} {id} not found")
    }
}

/// The result type of the domain.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The stable code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::Unauthenticated(_) => ErrorCode::Unauthenticated,
            Error::Forbidden(_) => ErrorCode::Forbidden,
            Error::NotFound { .. } => ErrorCode::NotFound,
            Error::BadUserInput { .. } => ErrorCode::BadUserInput,
            Error::Conflict { .. }
            | Error::StaleVersion { .. }
            | Error::IllegalTransition { .. }
            | Error::PreconditionFailed { .. } => ErrorCode::Conflict,
            Error::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
            Error::PolicyViolation { .. } => ErrorCode::PolicyViolation,
            Error::Unschedulable(_) => ErrorCode::Unschedulable,
            Error::IdempotencyKeyReused(_) => ErrorCode::IdempotencyKeyReused,
            Error::IdempotencyInProgress(_) => ErrorCode::IdempotencyInProgress,
            Error::LockTimeout | Error::Contention { .. } => ErrorCode::LockTimeout,
            Error::LeaseLost(_) => ErrorCode::Conflict,
            Error::CursorExpired(_) => ErrorCode::CursorExpired,
            Error::RateLimited(_) => ErrorCode::RateLimited,
            Error::Unavailable(_) => ErrorCode::Unavailable,
            Error::Internal(_) => ErrorCode::Internal,
        }
    }

    /// The version the row has now, for a `CONFLICT` (`extensions.currentVersion`).
    pub fn current_version(&self) -> Option<i64> {
        match self {
            Error::Conflict {
                current_version, ..
            }
            | Error::IllegalTransition {
                current_version, ..
            } => *current_version,
            Error::StaleVersion { current, .. } => Some(*current),
            Error::PreconditionFailed {
                current_version, ..
            } => Some(*current_version),
            _ => None,
        }
    }

    /// A bad-input error about one field.
    pub fn bad_input(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::BadUserInput {
            field: Some(field.into()),
            message: bounded(&message.into()),
        }
    }

    /// An internal error from any source; its text goes to the log only.
    pub fn internal(source: impl Into<BoxError>) -> Self {
        Error::Internal(source.into())
    }

    /// Rebuilds a client-facing error from its code and message (a replayed idempotent
    /// response). Unknown codes become `INTERNAL`.
    pub fn from_code(code: &str, message: String) -> Self {
        match code {
            "UNAUTHENTICATED" => Error::Unauthenticated(message),
            "FORBIDDEN" => Error::Forbidden(message),
            "NOT_FOUND" => Error::NotFound {
                kind: "object",
                id: message,
            },
            "BAD_USER_INPUT" => Error::BadUserInput {
                field: None,
                message,
            },
            "CONFLICT" => Error::Conflict {
                message,
                current_version: None,
            },
            "QUOTA_EXCEEDED" => Error::QuotaExceeded(message),
            "UNSCHEDULABLE" => Error::Unschedulable(message),
            "IDEMPOTENCY_KEY_REUSED" => Error::IdempotencyKeyReused(message),
            "IDEMPOTENCY_IN_PROGRESS" => Error::IdempotencyInProgress(message),
            "CURSOR_EXPIRED" => Error::CursorExpired(message),
            "RATE_LIMITED" => Error::RateLimited(message),
            "UNAVAILABLE" => Error::Unavailable(message.into()),
            _ => Error::internal(message),
        }
    }

    /// The SQLSTATE of a database error inside this error, if any.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            Error::Contention { sqlstate, .. } => Some(sqlstate.clone()),
            Error::Internal(source) => source
                .downcast_ref::<sqlx::Error>()
                .and_then(|e| e.as_database_error())
                .and_then(|e| e.code())
                .map(|c| c.into_owned()),
            _ => None,
        }
    }
}

/// SQLSTATE of `lock_not_available`, raised when `lock_timeout` expires.
pub const SQLSTATE_LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATE of `serialization_failure`.
pub const SQLSTATE_SERIALIZATION_FAILURE: &str = "40001";
/// SQLSTATE of `deadlock_detected`.
pub const SQLSTATE_DEADLOCK_DETECTED: &str = "40P01";

impl From<sqlx::Error> for Error {
    fn from(err: sqlx::Error) -> Self {
        let code = err
            .as_database_error()
            .and_then(|e| e.code())
            .map(|c| c.into_owned());
        let unreachable = matches!(
            err,
            sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::WorkerCrashed
        );
        // Class 08 (connection exception) and 57P01-57P03 (the server shutting down or
        // starting): the database went away, not the request.
        let gone = code
            .as_deref()
            .is_some_and(|c| c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03"));
        if unreachable || gone {
            return Error::Unavailable(Box::new(err));
        }
        if let Some(e) = code.as_deref().and_then(|c| raised_by_our_sql(c, &err)) {
            return e;
        }
        match code.as_deref() {
            Some(SQLSTATE_LOCK_NOT_AVAILABLE) => Error::LockTimeout,
            Some(state @ (SQLSTATE_SERIALIZATION_FAILURE | SQLSTATE_DEADLOCK_DETECTED)) => {
                Error::Contention {
                    sqlstate: state.to_owned(),
                    attempts: 1,
                }
            }
            _ => Error::Internal(Box::new(err)),
        }
    }
}

/// The client-facing error a SQL function of ours raised with a SQLSTATE of class `CP`
/// (migration 0015): `CP400` bad input (`DETAIL` names the field), `CP404` not found, `CPQE0`
/// quota exceeded, `CPKR0` an idempotency key reused, `CPIP0` one still in progress. The
/// message is the function's, written for the client.
fn raised_by_our_sql(code: &str, err: &sqlx::Error) -> Option<Error> {
    if !code.starts_with("CP") {
        return None;
    }
    let db = err.as_database_error()?;
    let message = db.message().to_owned();
    let pg = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>();
    Some(match code {
        "CP400" => Error::bad_input(
            pg.and_then(|p| p.detail()).unwrap_or("input").to_owned(),
            message,
        ),
        "CP404" => Error::from_code("NOT_FOUND", message),
        "CPQE0" => Error::QuotaExceeded(message),
        "CPPV0" => Error::PolicyViolation {
            rule: pg.and_then(|p| p.detail()).unwrap_or("rule").to_owned(),
            limit: pg
                .and_then(|p| p.hint())
                .and_then(|h| serde_json::from_str(h).ok())
                .unwrap_or(serde_json::Value::Null),
            message,
        },
        "CPKR0" => Error::IdempotencyKeyReused(message),
        "CPIP0" => Error::IdempotencyInProgress(message),
        _ => return None,
    })
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Error::Internal(Box::new(err))
    }
}

/// The longest quoted input a message shows, in characters.
const MAX_QUOTED: usize = 64;
/// The longest message, in characters.
const MAX_MESSAGE: usize = 400;

/// A message fit to send back: each `quoted` piece of input is cut to [`MAX_QUOTED`] characters
/// (then `…`), control characters are shown escaped, and the whole is at most [`MAX_MESSAGE`]
/// characters. Every `BAD_USER_INPUT` message passes here ([`Error::bad_input`]), so no error
/// echoes unbounded or unprintable input, whichever parser wrote it.
pub fn bounded(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE + 8));
    let mut quoted = false;
    let mut run = 0usize;
    for c in message.chars() {
        if out.chars().count() >= MAX_MESSAGE {
            out.push('…');
            break;
        }
        if c == '`' {
            quoted = !quoted;
            run = 0;
            out.push(c);
            continue;
        }
        if quoted {
            run += 1;
            if run == MAX_QUOTED + 1 {
                out.push('…');
            }
            if run > MAX_QUOTED {
                continue;
            }
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Maps a violated constraint, by name, to a domain error; anything else passes through.
pub(crate) fn on_constraint(err: sqlx::Error, map: &[(&str, &dyn Fn() -> Error)]) -> Error {
    if let Some(name) = err.as_database_error().and_then(|e| e.constraint())
        && let Some((_, make)) = map.iter().find(|(c, _)| *c == name)
    {
        return make();
    }
    Error::from(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_code_is_stored_as_clients_see_it() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).expect("serializes");
            assert_eq!(json, serde_json::json!(code.as_str()));
            assert_eq!(
                serde_json::from_value::<ErrorCode>(json).expect("reads back"),
                code
            );
        }
    }

    #[test]
    fn a_message_never_echoes_unbounded_or_unprintable_input() {
        let long = "x".repeat(1_000_000);
        let e = Error::bad_input("id", format!("`{long}` is not an id of this API"));
        let Error::BadUserInput { message, .. } = e else {
            panic!("bad input")
        };
        assert_eq!(
            message,
            format!("`{}…` is not an id of this API", "x".repeat(MAX_QUOTED))
        );
        let e = Error::bad_input("name", "`a\u{0}b\nc` is odd");
        let Error::BadUserInput { message, .. } = e else {
            panic!("bad input")
        };
        assert_eq!(message, "`a\\u{0}b\\nc` is odd");
        assert!(bounded(&"y ".repeat(10_000)).chars().count() <= MAX_MESSAGE + 1);
    }

    #[test]
    fn codes_are_unique_screaming_snake() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let s = code.as_str();
            assert!(seen.insert(s), "duplicate code {s}");
            assert!(
                s.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{s} is not SCREAMING_SNAKE"
            );
        }
        assert_eq!(seen.len(), 15);
    }

    #[test]
    fn structured_conflicts_word_their_message_once_and_carry_the_version() {
        let cases = [
            (
                Error::StaleVersion {
                    kind: "pool",
                    id: "pool_1".into(),
                    expected: 3,
                    current: 4,
                },
                "pool pool_1 has version 4, not 3: it changed since you read it",
                Some(4),
            ),
            (
                Error::IllegalTransition {
                    kind: "reservation",
                    id: "rsv_1".into(),
                    state: "active",
                    action: "Cancel",
                    current_version: Some(2),
                    hint: Some("release it to end it now".into()),
                },
                "reservation rsv_1 is active: Cancel is not allowed from that state; release it to end it now",
                Some(2),
            ),
            (
                Error::PreconditionFailed {
                    kind: "compute node",
                    id: "node_1".into(),
                    current_version: 7,
                },
                "compute node node_1 cannot change now",
                Some(7),
            ),
        ];
        for (err, message, version) in cases {
            assert_eq!(err.code(), ErrorCode::Conflict, "{err}");
            assert_eq!(err.to_string(), message);
            assert_eq!(err.current_version(), version, "{err}");
        }
    }

    #[test]
    fn contention_is_reported_as_lock_timeout() {
        let e = Error::Contention {
            sqlstate: "40P01".into(),
            attempts: 3,
        };
        assert_eq!(e.code(), ErrorCode::LockTimeout);
        assert!(e.to_string().contains("3 attempts"));
    }
}
