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
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

/// The sink's last error when its target is not a public address.
pub const REFUSED: &str = "refused: the target is not a public address";
/// The sink's last error when no connection or answer came.
pub const UNREACHABLE: &str = "unreachable";
/// The sink's last error when the receiver did not answer in time.
pub const TIMEOUT: &str = "timeout";

/// Whether `ip` is an address on the public internet: not loopback, private, link-local,
/// shared (CGNAT), unspecified, multicast, broadcast, documentation, benchmarking or reserved,
/// in either family (an IPv4-mapped IPv6 address is judged as its IPv4 address).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (18..20).contains(&b)) // benchmarking
        || a >= 240) // reserved
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local
        || (first & 0xffc0) == 0xfe80 // link-local
        || first == 0x2001 && ip.segments()[1] == 0x0db8 // documentation
        || first == 0x0064 && ip.segments()[1] == 0xff9b) // NAT64, which maps to IPv4
}

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

/// Why `url` may not be posted to before anything is resolved: credentials in it, or a literal
/// address the policy does not allow.
pub fn refusal(url: &reqwest::Url, allow_private: bool) -> Option<&'static str> {
    if !url.username().is_empty() || url.password().is_some() {
        return Some("refused: the URL carries credentials");
    }
    // The URL parser has already read any decimal, octal, hex or short IPv4 form as the address
    // it names, and writes it back canonically.
    let host = url.host_str()?;
    let literal: IpAddr = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()?;
    (!allow_private && !is_public(literal)).then_some(REFUSED)
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
    fn only_public_addresses_are_public() {
        let table: [(&str, bool); 20] = [
            ("8.8.8.8", true),
            ("1.1.1.1", true),
            ("127.0.0.1", false),
            ("10.1.2.3", false),
            ("172.16.0.1", false),
            ("192.168.1.1", false),
            ("169.254.169.254", false),
            ("100.64.0.1", false),
            ("0.0.0.0", false),
            ("255.255.255.255", false),
            ("224.0.0.1", false),
            ("198.18.0.1", false),
            ("240.0.0.1", false),
            ("2606:4700::1111", true),
            ("::1", false),
            ("::", false),
            ("fe80::1", false),
            ("fd00::1", false),
            ("::ffff:127.0.0.1", false),
            ("::ffff:8.8.8.8", true),
        ];
        for (ip, public) in table {
            let parsed: IpAddr = ip.parse().expect("an address");
            assert_eq!(is_public(parsed), public, "{ip}");
        }
    }

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
