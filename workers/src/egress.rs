//! Where webhooks may go. A sink's URL is a tenant's input, and the dispatcher runs inside the
//! operator's network, so by default it connects only to public addresses:
//!
//! - host names are resolved by [`GuardedResolver`], which drops every address that is not
//!   public; reqwest connects only to the addresses it returns, so a name that resolves to a
//!   public address when checked and a private one when used (DNS rebinding) cannot get through:
//!   the check is the resolution the connection uses;
//! - a literal IP host is checked before the request ([`refusal`]);
//! - redirects are not followed (a `3xx` is a failed delivery), and no proxy from the
//!   environment is used (it would resolve the host itself);
//! - failures are reported in coarse categories ([`category`]): a tenant learns "unreachable",
//!   never which ports of which host are open.
//!
//! `--webhooks-allow-private` (operators with on-premises receivers, and `dev`) lifts the
//! address rule; the rest stays.

use std::error::Error as StdError;
use std::fmt;
use std::net::SocketAddr;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// The sink's last error when its target is not a public address.
pub const REFUSED: &str = "refused: the target is not a public address";
/// The sink's last error when no connection or answer came.
pub const UNREACHABLE: &str = "unreachable";
/// The sink's last error when the receiver did not answer in time.
pub const TIMEOUT: &str = "timeout";

pub use compute_domain::sinks::egress::is_public;

/// Why a target was refused; found again in a reqwest error's sources by [`category`].
#[derive(Debug)]
pub struct Refused;

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REFUSED)
    }
}

impl StdError for Refused {}

/// Resolves host names for the webhook client, keeping only the addresses the policy allows.
#[derive(Debug, Clone, Copy)]
pub struct GuardedResolver {
    pub allow_private: bool,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let allow_private = self.allow_private;
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await
                .map_err(|e| Box::new(e) as Box<dyn StdError + Send + Sync>)?
                .collect();
            let allowed: Vec<SocketAddr> = found
                .into_iter()
                .filter(|a| allow_private || is_public(a.ip()))
                .collect();
            if allowed.is_empty() {
                return Err(Box::new(Refused) as Box<dyn StdError + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

/// Why `url` may not be posted to before anything is resolved: credentials in it, or a host the
/// address rule refuses as written (a literal address that is not public, in any spelling, or
/// `localhost`: `compute_domain::sinks::egress::check_target`, the rule sink creation applies).
pub fn refusal(url: &reqwest::Url, allow_private: bool) -> Option<&'static str> {
    if !url.username().is_empty() || url.password().is_some() {
        return Some("refused: the URL carries credentials");
    }
    compute_domain::sinks::egress::check_target(url.as_str(), allow_private)
        .err()
        .map(|_| REFUSED)
}

/// The coarse category of a failed request, for the sink's `lastError`.
pub fn category(e: &reqwest::Error) -> &'static str {
    let mut source: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(s) = source {
        // The resolver's error may come back boxed, so its text is compared too.
        if s.is::<Refused>() || s.to_string() == REFUSED {
            return REFUSED;
        }
        source = s.source();
    }
    if e.is_timeout() { TIMEOUT } else { UNREACHABLE }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_hosts_in_any_spelling_are_judged_as_addresses() {
        // The URL parser reads decimal, octal, hex and short forms as the address they name.
        for url in [
            "http://127.0.0.1:8080/",
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f.1/",
            "http://127.1/",
            "http://[::1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://169.254.169.254/latest/meta-data/",
        ] {
            let u = reqwest::Url::parse(url).expect("a URL");
            assert_eq!(refusal(&u, false), Some(REFUSED), "{url}");
            assert_eq!(
                refusal(&u, true),
                None,
                "{url} with private targets allowed"
            );
        }
        let creds = reqwest::Url::parse("https://user:pw@example.com/").expect("a URL");
        assert!(
            refusal(&creds, true).is_some(),
            "credentials are refused always"
        );
        let public = reqwest::Url::parse("https://example.com/hook").expect("a URL");
        assert_eq!(refusal(&public, false), None);
    }
}
