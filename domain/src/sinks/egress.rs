//! Where a sink may post: the address rule that sink creation and changes apply to a URL's
//! literal host (and `localhost`), and that the dispatcher applies again to every address a
//! host name resolves to when it delivers (`compute-workers`' `egress`). One rule, one place.
//!
//! `--webhooks-allow-private` (on `serve` and on the workers: set it on both, or through
//! `COMPUTE_WEBHOOKS_ALLOW_PRIVATE` for both) lifts it for operators with on-premises receivers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

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
    let s = ip.segments();
    let first = s[0];
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || s[..6] == [0; 6] // IPv4-compatible (::a.b.c.d, deprecated), which maps to IPv4
        || (first & 0xfe00) == 0xfc00 // unique local
        || (first & 0xffc0) == 0xfe80 // link-local
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated, still routed by some stacks)
        || first == 0x2001 && s[1] == 0x0db8 // documentation
        || first == 0x2001 && s[1] < 0x0200 // IETF protocol assignments (2001::/23), Teredo's 2001::/32 among them
        || first == 0x3fff && s[1] < 0x1000 // documentation (3fff::/20)
        || first == 0x5f00 // segment routing SIDs (5f00::/16)
        || first == 0x2002 && !is_public_v4(Ipv4Addr::from((u32::from(s[1]) << 16) | u32::from(s[2]))) // 6to4, judged as the IPv4 address it embeds
        || first == 0x0100 && s[1..4] == [0; 3] // discard-only (100::/64)
        || first == 0x0064 && s[1] == 0xff9b) // NAT64, which maps to IPv4
}

/// Refuses a sink URL whose host is a literal address that is not public, in any spelling the
/// URL parser reads as an address (decimal, octal, hex, short IPv4 forms, IPv4-mapped IPv6), or
/// `localhost` and its subdomains (RFC 6761), unless private targets are allowed. Other names
/// are resolved when delivered to, and judged then, address by address.
pub fn check_target(url: &str, allow_private: bool) -> Result<()> {
    if allow_private {
        return Ok(());
    }
    let refused = |what: &str| {
        Error::bad_input(
            "url",
            format!(
                "`url` names {what}: a sink posts to public addresses only, unless the operator \
                 allows private targets (`--webhooks-allow-private` on the API and the workers)"
            ),
        )
    };
    let Ok(parsed) = url::Url::parse(url) else {
        return Err(Error::bad_input(
            "url",
            "`url` is not a URL this server can POST to (http or https, a host, at most 2000 characters)",
        ));
    };
    match parsed.host() {
        Some(url::Host::Ipv4(v4)) if !is_public(IpAddr::V4(v4)) => Err(refused(
            "a loopback, private, link-local or otherwise internal address",
        )),
        Some(url::Host::Ipv6(v6)) if !is_public(IpAddr::V6(v6)) => Err(refused(
            "a loopback, private, link-local or otherwise internal address",
        )),
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if name == "localhost" || name.ends_with(".localhost") {
                Err(refused("`localhost`"))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_are_public() {
        let table: [(&str, bool); 31] = [
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
            ("::127.0.0.1", false),
            ("fec0::1", false),
            ("2002:7f00:1::1", false),
            ("2002:808:808::1", true),
            ("100::1", false),
            ("2001:4860:4860::8888", true),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", false),
            ("2001:1ff::1", false),
            ("3fff:1::1", false),
            ("3fff:1000::1", true),
            ("5f00::1", false),
        ];
        for (ip, public) in table {
            let parsed: IpAddr = ip.parse().expect("an address");
            assert_eq!(is_public(parsed), public, "{ip}");
        }
    }

    #[test]
    fn a_sink_url_naming_an_internal_address_is_refused_in_any_spelling() {
        for url in [
            "http://127.0.0.1:8080/",
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://0x7f.1/",
            "http://127.1/",
            "http://[::1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://169.254.169.254/latest/meta-data/",
            "https://10.0.0.8/hook",
            "https://localhost/hook",
            "https://api.LOCALHOST./hook",
        ] {
            let e = check_target(url, false).expect_err(url);
            assert_eq!(e.code(), crate::ErrorCode::BadUserInput, "{url}");
            assert!(
                check_target(url, true).is_ok(),
                "{url} with private targets allowed"
            );
        }
        for url in [
            "https://example.com/hook",
            "http://8.8.8.8/",
            "https://[2606:4700::1111]/",
        ] {
            assert!(check_target(url, false).is_ok(), "{url}");
        }
    }
}
