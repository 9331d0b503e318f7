//! What every process of the system takes from its host, in one place for both binaries
//! (`compute-api`, `compute-worker`): its host name, its stop signal, random bytes, its logging
//! and the secrets its configuration holds.

use std::fmt;

use crate::error::{Error, Result};

/// A secret from the configuration (a database URL with its password, a key): it never prints.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> std::result::Result<Secret, Self::Err> {
        Ok(Secret::new(s))
    }
}

pub use compute_telemetry::LogFormat;

/// Sets up logging once for the process, the same way in every binary: to stderr, filtered by
/// `RUST_LOG` (default `info,sqlx=warn`), colours only for a person at a terminal. Logs only:
/// a serving process calls [`init_telemetry`] instead.
pub fn init_logging(format: LogFormat) {
    compute_telemetry::init_logs(format, DEFAULT_LOG);
}

/// The log filter when `RUST_LOG` is not set.
pub const DEFAULT_LOG: &str = "info,sqlx=warn";

/// Sets up logging and, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, trace export for a serving
/// process named `service` (`compute_telemetry::init`). A configuration it cannot honour (a
/// gRPC endpoint, say) is an error to stop on.
pub fn init_telemetry(
    service: &'static str,
    format: LogFormat,
) -> std::result::Result<compute_telemetry::Telemetry, String> {
    compute_telemetry::init(service, format, DEFAULT_LOG)
}

/// This machine's host name (`/etc/hostname`), or `unknown`: part of the names processes take
/// in leases (workers, gateways).
pub fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM, and logs which: the one stop signal of both
/// binaries. A worker then releases its leases, so another takes over at once instead of after
/// the leases' TTL; the API stops accepting and drains.
pub async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("received SIGINT"),
        () = term => tracing::info!("received SIGTERM"),
    }
}

/// `bytes` random bytes from the operating system, as lowercase hex (secrets, names).
pub fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| Error::internal(format!("getrandom: {e}")))?;
    Ok(hex(&buf))
}

/// `bytes` as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_hex_has_two_digits_a_byte_and_differs_each_time() {
        let a = random_hex(16).expect("random");
        let b = random_hex(16).expect("random");
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
        assert_eq!(hex(&[0x00, 0x0f, 0xa5]), "000fa5");
    }
}
