//! Secrets at rest: a sink's signing secret is stored sealed with ChaCha20-Poly1305 under a key
//! from the configuration (`COMPUTE_SECRETS_KEY`), never in plain text when a key is set.
//!
//! - A sealed value reads `sealed:v1:<key id>:<nonce><ciphertext and tag>` (hex); the key id is
//!   the first 4 bytes of the key's SHA-256, so a reader knows which key opens it.
//! - The sink's id is the associated data: a sealed secret copied onto another row does not open.
//! - **Rotation**: set the new key as `COMPUTE_SECRETS_KEY` and the old one in
//!   `COMPUTE_SECRETS_OLD_KEYS` for every API and worker process, run `compute-api
//!   reseal-secrets` (it seals every secret under the new key), then drop the old key.
//! - A value without the prefix is a secret stored before encryption (or without a key): it is
//!   read as it is, and sealed by the next `reseal-secrets`.

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

use crate::error::{Error, Result};
use crate::process::hex;

const PREFIX: &str = "sealed:v1:";

struct Key {
    id: String,
    key: LessSafeKey,
}

impl Key {
    fn parse(what: &str, hex: &str) -> Result<Key> {
        let bytes = from_hex(hex.trim())
            .filter(|b| b.len() == 32)
            .ok_or_else(|| {
                Error::bad_input(what, format!("`{what}` must be 64 hex digits (32 bytes)"))
            })?;
        let digest = ring::digest::digest(&ring::digest::SHA256, &bytes);
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, &bytes)
            .map_err(|_| Error::internal("a 32-byte ChaCha20-Poly1305 key was refused"))?;
        Ok(Key {
            id: crate::process::hex(&digest.as_ref()[..4]),
            key: LessSafeKey::new(unbound),
        })
    }
}

/// The keys that seal and open secrets: the current one seals; any of them opens.
pub struct Keyring {
    current: Key,
    old: Vec<Key>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current.id)
            .field("old", &self.old.iter().map(|k| &k.id).collect::<Vec<_>>())
            .finish()
    }
}

impl Keyring {
    /// A keyring from the current key and the old ones still needed to open (hex, 32 bytes each).
    pub fn parse(current: &str, old: &[String]) -> Result<Keyring> {
        Ok(Keyring {
            current: Key::parse("secrets-key", current)?,
            old: old
                .iter()
                .filter(|k| !k.trim().is_empty())
                .map(|k| Key::parse("secrets-old-keys", k))
                .collect::<Result<_>>()?,
        })
    }

    /// The keyring a process's configuration names: `current` (hex) and `old` (comma-separated
    /// hex), or none when no key is set.
    pub fn from_config(
        current: Option<&str>,
        old: Option<&str>,
    ) -> Result<Option<std::sync::Arc<Keyring>>> {
        let old: Vec<String> = old
            .unwrap_or_default()
            .split(',')
            .map(|k| k.trim().to_owned())
            .filter(|k| !k.is_empty())
            .collect();
        match current.map(str::trim).filter(|k| !k.is_empty()) {
            Some(key) => Ok(Some(std::sync::Arc::new(Keyring::parse(key, &old)?))),
            None if !old.is_empty() => Err(Error::bad_input(
                "secrets-old-keys",
                "old keys are set without a current key (COMPUTE_SECRETS_KEY)",
            )),
            None => Ok(None),
        }
    }

    /// A fresh random key, hex (for `dev`'s data directory and for operators).
    pub fn generate_key() -> Result<String> {
        crate::process::random_hex(32)
    }

    /// The id of the key that seals.
    pub fn current_id(&self) -> &str {
        &self.current.id
    }

    /// Seals `plain`, bound to `context` (the row's id).
    pub fn seal(&self, plain: &str, context: &str) -> Result<String> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| Error::internal(format!("getrandom: {e}")))?;
        let mut data = plain.as_bytes().to_vec();
        self.current
            .key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(context.as_bytes()),
                &mut data,
            )
            .map_err(|_| Error::internal("sealing a secret failed"))?;
        Ok(format!(
            "{PREFIX}{}:{}{}",
            self.current.id,
            hex(&nonce),
            hex(&data)
        ))
    }

    /// Opens a stored value bound to `context`; a value stored unsealed is returned as it is.
    pub fn open(&self, stored: &str, context: &str) -> Result<String> {
        let Some(rest) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_owned());
        };
        let (id, body) = rest
            .split_once(':')
            .ok_or_else(|| Error::internal("a sealed secret without a key id"))?;
        let key = std::iter::once(&self.current)
            .chain(&self.old)
            .find(|k| k.id == id)
            .ok_or_else(|| {
                Error::bad_input(
                    "secrets-key",
                    format!(
                        "a secret is sealed under key {id}, which is not configured (current \
                         {}, {} old): add it to COMPUTE_SECRETS_OLD_KEYS",
                        self.current.id,
                        self.old.len()
                    ),
                )
            })?;
        let bytes = from_hex(body).ok_or_else(|| Error::internal("a sealed secret is not hex"))?;
        if bytes.len() < NONCE_LEN {
            return Err(Error::internal("a sealed secret is too short"));
        }
        let (nonce, sealed) = bytes.split_at(NONCE_LEN);
        let nonce: [u8; NONCE_LEN] = nonce
            .try_into()
            .map_err(|_| Error::internal("a sealed secret's nonce"))?;
        let mut data = sealed.to_vec();
        let plain = key
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(context.as_bytes()),
                &mut data,
            )
            .map_err(|_| {
                Error::internal("a sealed secret does not open (wrong row or tampered)")
            })?;
        String::from_utf8(plain.to_vec()).map_err(|_| Error::internal("a sealed secret's text"))
    }

    /// Whether `stored` is sealed under the current key.
    pub fn is_current(&self, stored: &str) -> bool {
        stored
            .strip_prefix(PREFIX)
            .and_then(|r| r.split_once(':'))
            .is_some_and(|(id, _)| id == self.current.id)
    }
}

/// Opens `stored` with `keyring`, or returns it as it is when there is none and it is not
/// sealed.
pub fn open(keyring: Option<&Keyring>, stored: &str, context: &str) -> Result<String> {
    match keyring {
        Some(k) => k.open(stored, context),
        None if stored.starts_with(PREFIX) => Err(Error::bad_input(
            "secrets-key",
            "a secret is sealed and no key is configured (COMPUTE_SECRETS_KEY)",
        )),
        None => Ok(stored.to_owned()),
    }
}

/// Seals `plain` with `keyring`, or keeps it as it is without one.
pub fn seal(keyring: Option<&Keyring>, plain: &str, context: &str) -> Result<String> {
    match keyring {
        Some(k) => k.seal(plain, context),
        None => Ok(plain.to_owned()),
    }
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> String {
        hex(&[n; 32])
    }

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_its_row() {
        let ring = Keyring::parse(&key(1), &[]).expect("ring");
        let sealed = ring.seal("whsec_abc", "snk_1").expect("seal");
        assert!(sealed.starts_with("sealed:v1:"), "{sealed}");
        assert!(!sealed.contains("whsec_abc"));
        assert_eq!(ring.open(&sealed, "snk_1").expect("open"), "whsec_abc");
        assert!(ring.open(&sealed, "snk_2").is_err(), "bound to its row");
        let other = Keyring::parse(&key(2), &[]).expect("ring");
        assert!(other.open(&sealed, "snk_1").is_err(), "another key");
        let rotated = Keyring::parse(&key(2), &[key(1)]).expect("ring");
        assert_eq!(
            rotated.open(&sealed, "snk_1").expect("old key"),
            "whsec_abc"
        );
        assert!(!rotated.is_current(&sealed));
        assert!(rotated.is_current(&rotated.seal("x", "c").expect("seal")));
        assert_eq!(
            ring.open("whsec_plain", "snk_1").expect("legacy"),
            "whsec_plain"
        );
        let mut tampered = sealed.clone();
        tampered.pop();
        tampered.push(if sealed.ends_with('0') { '1' } else { '0' });
        assert!(
            ring.open(&tampered, "snk_1").is_err(),
            "tampering is detected"
        );
        assert!(Keyring::parse("short", &[]).is_err());
    }
}
