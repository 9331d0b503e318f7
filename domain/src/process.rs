//! What every process of the system takes from its host, in one place for both binaries
//! (`compute-api`, `compute-worker`): its host name, its stop signal, and random bytes.

use crate::error::{Error, Result};

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
