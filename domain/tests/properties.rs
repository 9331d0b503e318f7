//! Properties of every parser at the door, over generated input (a seeded generator, so a
//! failure reproduces): no parser panics; whatever it accepts is clean (no control character,
//! within its length) and parses again to the same value; whatever it refuses is
//! `BAD_USER_INPUT` with a bounded message that names its field.
//!
//! The generator mixes random text (control characters, NUL, multi-byte and bidirectional
//! characters, very long runs) with mutations of valid values (a character dropped, doubled or
//! replaced), where the interesting edges are.

use compute_domain::ErrorCode;
use compute_domain::fleet::model::{
    GpuUuid, Reason, Taint, parse_hostname, parse_key, parse_name, parse_time, parse_value,
};
use compute_domain::ids::{NodeId, PoolId, ReservationId, ScopeId, TenantId};
use compute_domain::outbox::Cursor;
use compute_domain::page::{decode_cursor, encode_cursor};

/// splitmix64: small, seeded, good enough to spread inputs.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn char(&mut self) -> char {
        const SPECIAL: [char; 14] = [
            '\0', '\n', '\r', '\t', '\u{7f}', '\u{202e}', '\u{feff}', 'é', '漢', '🚀', '`', '_',
            '-', '.',
        ];
        match self.below(4) {
            0 => SPECIAL[self.below(SPECIAL.len() as u64) as usize],
            1 => char::from_u32(self.below(0x3_0000) as u32).unwrap_or('?'),
            _ => (b'0' + self.below(75) as u8) as char,
        }
    }

    fn text(&mut self) -> String {
        let len = match self.below(10) {
            0 => 0,
            1 => 200 + self.below(2_000) as usize,
            _ => self.below(80) as usize,
        };
        (0..len).map(|_| self.char()).collect()
    }

    /// `valid`, or a mutation of it, or random text.
    fn around(&mut self, valid: &str) -> String {
        let mut chars: Vec<char> = valid.chars().collect();
        match self.below(5) {
            0 => return self.text(),
            1 => return valid.to_owned(),
            _ => {}
        }
        for _ in 0..=self.below(3) {
            let at = self.below(chars.len() as u64 + 1) as usize;
            match self.below(3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 if at < chars.len() => chars[at] = self.char(),
                _ => chars.insert(at, self.char()),
            }
        }
        chars.into_iter().collect()
    }
}

const CASES: usize = 20_000;

/// Checks one parser's contract on `input`: a refusal is coded, names `field` and is bounded;
/// an acceptance is clean and stable (`again` parses the accepted value's text again).
fn check<T: PartialEq + std::fmt::Debug>(
    what: &str,
    input: &str,
    result: compute_domain::Result<T>,
    text_of: impl Fn(&T) -> String,
    again: impl Fn(&str) -> compute_domain::Result<T>,
) -> bool {
    match result {
        Err(e) => {
            assert_eq!(e.code(), ErrorCode::BadUserInput, "{what} {input:?}: {e}");
            let message = e.to_string();
            assert!(
                message.chars().count() <= 450,
                "{what}: a message of {} characters for an input of {}",
                message.chars().count(),
                input.chars().count()
            );
            assert!(!message.contains('\0'), "{what}: the message holds a NUL");
            false
        }
        Ok(v) => {
            let text = text_of(&v);
            assert!(
                !text.chars().any(char::is_control),
                "{what} accepted control characters: {input:?}"
            );
            let twice = again(&text).unwrap_or_else(|e| panic!("{what}: {text:?} again: {e}"));
            assert_eq!(twice, v, "{what}: parsing is stable for {input:?}");
            true
        }
    }
}

#[test]
fn text_parsers_refuse_with_codes_and_accept_only_clean_stable_values() {
    let mut g = Gen(0x5eed_0001);
    let mut accepted = std::collections::HashMap::<&str, usize>::new();
    for _ in 0..CASES {
        let cases: [(&str, String); 8] = [
            ("name", g.around("ams1")),
            ("key", g.around("nvidia.com/gpu")),
            ("value", g.around("a100-80gb")),
            ("hostname", g.around("gpu-01.ams1.example")),
            ("tenant", g.around("acme")),
            ("reason", g.around("maintenance window")),
            ("taint", g.around("gpu=faulty:NoSchedule")),
            ("uuid", g.around("GPU-8f0b1b3c-1d2e-4f5a-9b8c-7d6e5f4a3b2c")),
        ];
        for (what, input) in cases {
            let ok = match what {
                "name" => check(what, &input, parse_name("f", &input), Clone::clone, |s| {
                    parse_name("f", s)
                }),
                "key" => check(what, &input, parse_key("f", &input), Clone::clone, |s| {
                    parse_key("f", s)
                }),
                "value" => check(what, &input, parse_value("f", &input), Clone::clone, |s| {
                    parse_value("f", s)
                }),
                "hostname" => check(
                    what,
                    &input,
                    parse_hostname("f", &input),
                    Clone::clone,
                    |s| parse_hostname("f", s),
                ),
                "tenant" => check(
                    what,
                    &input,
                    TenantId::parse("f", &input),
                    ToString::to_string,
                    |s| TenantId::parse("f", s),
                ),
                "reason" => check(
                    what,
                    &input,
                    Reason::parse("f", &input),
                    |r| r.as_str().to_owned(),
                    |s| Reason::parse("f", s),
                ),
                "taint" => check(
                    what,
                    &input,
                    Taint::parse("f", &input),
                    ToString::to_string,
                    |s| Taint::parse("f", s),
                ),
                _ => check(
                    what,
                    &input,
                    GpuUuid::parse("f", &input),
                    |u| u.as_str().to_owned(),
                    |s| GpuUuid::parse("f", s),
                ),
            };
            *accepted.entry(what).or_default() += usize::from(ok);
        }
    }
    for what in [
        "name", "key", "value", "hostname", "tenant", "reason", "taint", "uuid",
    ] {
        let n = accepted.get(what).copied().unwrap_or(0);
        assert!(
            n > CASES / 10 && n < CASES,
            "{what}: {n} of {CASES} accepted: the generator reaches both sides"
        );
    }
}

#[test]
fn ids_scopes_and_cursors_round_trip_or_are_refused() {
    let mut g = Gen(0x5eed_0002);
    let pool = PoolId::generate();
    let node = NodeId::generate();
    let rsv = ReservationId::generate();
    let event_cursor = "o1.42.7";
    for _ in 0..CASES {
        let input = g.around(pool.as_str());
        check(
            "pool id",
            &input,
            PoolId::parse("f", &input),
            ToString::to_string,
            |s| PoolId::parse("f", s),
        );
        let input = g.around(node.as_str());
        check(
            "node id",
            &input,
            NodeId::parse("f", &input),
            ToString::to_string,
            |s| NodeId::parse("f", s),
        );
        let input = g.around(rsv.as_str());
        check(
            "reservation id",
            &input,
            ReservationId::parse("f", &input),
            ToString::to_string,
            |s| ReservationId::parse("f", s),
        );
        let input = g.around(pool.as_str());
        check(
            "scope",
            &input,
            ScopeId::parse("f", &input),
            ToString::to_string,
            |s| ScopeId::parse("f", s),
        );
        // A page cursor: the encoding of a key; what decodes is clean and encodes back.
        let input = g.around(&encode_cursor(pool.as_str()));
        check(
            "page cursor",
            &input,
            decode_cursor("f", &input),
            |k| encode_cursor(k),
            |s| decode_cursor("f", s),
        );
        let input = g.around(event_cursor);
        check(
            "event cursor",
            &input,
            Cursor::decode("f", &input),
            Cursor::encode,
            |s| Cursor::decode("f", s),
        );
    }
}

#[test]
fn client_times_are_refused_outside_1970_to_9999() {
    let mut g = Gen(0x5eed_0003);
    for _ in 0..CASES {
        let secs = (g.next() as i64) >> g.below(40);
        let Some(t) = chrono::DateTime::from_timestamp(secs, 0) else {
            continue;
        };
        let in_range = (0..=253_402_300_799).contains(&secs);
        match parse_time("t", t) {
            Ok(v) => {
                assert!(in_range, "{t} accepted");
                assert_eq!(v, t);
            }
            Err(e) => {
                assert!(!in_range, "{t} refused: {e}");
                assert_eq!(e.code(), ErrorCode::BadUserInput);
            }
        }
    }
}
