//! Bearer-token authentication.
//!
//! `serve` accepts only the keys it is configured with: an HS256 secret, or RS256/ES256/EdDSA
//! public keys from a PEM file or a JWKS file. The algorithm is pinned (a token whose header names
//! another algorithm is refused), and `exp`, `nbf`, `iss` and `aud` are checked. `exp` and `nbf`
//! are real-world times set by the issuer, so they are checked against this machine's wall clock,
//! not against `compute_now()`.

use compute_domain::actor::{Actor, Authority};
use compute_domain::ids::{NodeId, TenantId};
use std::fmt;
use std::path::Path;

use compute_domain::Error;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

pub use compute_domain::process::Secret;

/// A role a token can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Manages grants and service accounts; an operator of the whole fleet besides.
    Admin,
    /// Manages the fleet.
    Operator,
    /// Reserves capacity and sees only its tenant's objects.
    Member,
    /// A node daemon.
    Node,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "operator" => Some(Role::Operator),
            "member" => Some(Role::Member),
            "node" => Some(Role::Node),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Member => "member",
            Role::Node => "node",
        }
    }
}

/// The claims of a token, as issued and as checked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default)]
    pub roles: Vec<String>,
    pub iss: String,
    pub aud: String,
    pub exp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iat: Option<i64>,
    /// A node daemon's node id (with the `node` role): the one node whose session the token may
    /// open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// Who is calling: the identity, tenant and roles of a verified token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Viewer {
    pub subject: String,
    /// Who vouches for `subject`: the token's `iss`, or `compute:service-account`.
    pub issuer: String,
    /// The `tenant` claim, checked at the door ([`TenantId::parse`]): a token whose tenant is
    /// not a valid tenant id is refused, so an empty or odd tenant never reaches a rule.
    pub tenant: Option<TenantId>,
    /// The caller's roles. `Operator` is an operator of the whole fleet; an operator limited to
    /// sites or pools has `scopes` instead (`crate::authz`), so every rule that asks for the
    /// operator role refuses a scoped one unless it asks about a target in its scope.
    pub roles: Vec<Role>,
    /// The sites and pools a scoped operator grant covers; empty for everyone else.
    pub scopes: Vec<compute_domain::ids::ScopeId>,
    /// The grants could not be read lately (the database unreachable past the projection's
    /// trust): every field refuses with the retryable `UNAVAILABLE`.
    pub unavailable: bool,
    /// What the token itself claimed (`roles`, `tenant`), kept so the caller can be resolved
    /// against the grants again when they change (`crate::authz`).
    pub claimed: Option<Claimed>,
    /// The `node` claim, checked at the door ([`NodeId::parse`]): the node a daemon's token
    /// may open the session of.
    pub node: Option<NodeId>,
    /// When the token expires (seconds since the epoch).
    pub expires_at: i64,
    /// How long the token stays valid after verification, by the verifier's clock and leeway:
    /// an open connection ends after this.
    pub valid_for: std::time::Duration,
}

impl Viewer {
    pub fn has_role(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// The caller as the domain sees it: an operator, or a member of its tenant; `None` for a
    /// token with neither role (a node daemon's).
    pub fn actor(&self) -> Option<Actor> {
        let authority = if self.has_role(Role::Operator) {
            Authority::Operator
        } else if self.has_role(Role::Member) {
            Authority::Member
        } else {
            return None;
        };
        Some(Actor {
            subject: self.subject.clone(),
            authority,
            tenant: self.tenant.clone(),
        })
    }

    /// How long the token stays valid from its verification (the same rule and leeway as
    /// verification): an open connection ends after this.
    pub fn valid_for(&self) -> std::time::Duration {
        self.valid_for
    }
}

/// What a token claimed, before the grants had their say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    pub roles: Vec<Role>,
    pub tenant: Option<TenantId>,
}

/// The verifier's clock: seconds since the epoch. A server's verifier reads business time
/// ([`Verifier::on_business_time`]: `compute_now()` through the process's [`Clock`]), so a test
/// on simulated time expires a token by moving the clock; a verifier outside a server (the
/// benchmarks) reads the wall clock.
///
/// [`Clock`]: compute_domain::clock::Clock
pub type JwtClock = std::sync::Arc<dyn Fn() -> i64 + Send + Sync>;

fn wall_clock() -> JwtClock {
    std::sync::Arc::new(|| chrono::Utc::now().timestamp())
}

/// Where the verification keys come from.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// A shared HS256 secret.
    Hs256(Secret),
    /// One public key in PEM, for `algorithm` (RS256, ES256 or EdDSA).
    PublicKeyPem { algorithm: Algorithm, pem: Vec<u8> },
    /// A JWKS document; each key is used only with `algorithm`.
    Jwks { algorithm: Algorithm, jwks: String },
}

/// Seconds of clock difference allowed on `exp` and `nbf`; an open connection also closes this
/// long after its token's `exp`.
pub const LEEWAY_SECONDS: u64 = 5;

/// The issuer this server's tokens must name: the issuer of a grant's subject unless the
/// grant names another (schema data).
#[derive(Debug, Clone)]
pub struct TokenIssuer(pub String);

/// Checks bearer tokens against the configured keys, issuer and audience.
pub struct Verifier {
    algorithm: Algorithm,
    issuer: String,
    keys: Vec<(Option<String>, DecodingKey)>,
    validation: Validation,
    clock: JwtClock,
    max_lifetime: std::time::Duration,
    cache: AuthCache,
}

/// How long a verified token is remembered: within this, a token presented again is not
/// verified again (its signature, its claims), but its expiry is still checked on every use.
pub const AUTH_CACHE_SECONDS: i64 = 30;
/// The most tokens remembered at once; past it, expired entries go, then all of them.
pub const AUTH_CACHE_MAX: usize = 10_000;

/// Verified tokens by the SHA-256 of the token (a bearer token is not kept in memory), each with
/// the viewer it gave and until when (by the verifier's clock) it is trusted without a check.
#[derive(Default)]
struct AuthCache(std::sync::Mutex<std::collections::HashMap<[u8; 32], (Viewer, i64)>>);

fn token_key(token: &str) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut key = [0u8; 32];
    key.copy_from_slice(digest.as_ref());
    key
}

/// The longest a token may still be valid when it is presented, unless `serve` is told
/// otherwise (`--max-token-lifetime-seconds`): a leaked token is worth a day at most.
pub const DEFAULT_MAX_TOKEN_LIFETIME: std::time::Duration = std::time::Duration::from_secs(86_400);

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("algorithm", &self.algorithm)
            .field("keys", &self.keys.len())
            .finish()
    }
}

/// Why a verifier could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
#[error("JWT configuration: {0}")]
pub struct KeyConfigError(String);

impl Verifier {
    /// Builds a verifier; `issuer` and `audience` are required in every token.
    pub fn new(
        source: KeySource,
        issuer: &str,
        audience: &str,
    ) -> Result<Verifier, KeyConfigError> {
        let err = |e: jsonwebtoken::errors::Error| KeyConfigError(e.to_string());
        let (algorithm, keys) = match source {
            KeySource::Hs256(secret) => {
                if secret.expose().len() < 32 {
                    return Err(KeyConfigError(
                        "the HS256 secret must be at least 32 bytes".into(),
                    ));
                }
                (
                    Algorithm::HS256,
                    vec![(None, DecodingKey::from_secret(secret.expose().as_bytes()))],
                )
            }
            KeySource::PublicKeyPem { algorithm, pem } => {
                let key = match algorithm {
                    Algorithm::RS256 => DecodingKey::from_rsa_pem(&pem).map_err(err)?,
                    Algorithm::ES256 => DecodingKey::from_ec_pem(&pem).map_err(err)?,
                    Algorithm::EdDSA => DecodingKey::from_ed_pem(&pem).map_err(err)?,
                    other => {
                        return Err(KeyConfigError(format!(
                            "algorithm {other:?} is not supported with a public key; use RS256, ES256 or EdDSA"
                        )));
                    }
                };
                (algorithm, vec![(None, key)])
            }
            KeySource::Jwks { algorithm, jwks } => {
                let set: JwkSet = serde_json::from_str(&jwks)
                    .map_err(|e| KeyConfigError(format!("the JWKS file does not parse: {e}")))?;
                let mut keys = Vec::new();
                for jwk in &set.keys {
                    // A key that names another algorithm is never used with this one. The two
                    // enums of jsonwebtoken share their variant names, so the names compare.
                    if let Some(key_alg) = jwk.common.key_algorithm
                        && format!("{key_alg:?}") != format!("{algorithm:?}")
                    {
                        continue;
                    }
                    keys.push((
                        jwk.common.key_id.clone(),
                        DecodingKey::from_jwk(jwk).map_err(err)?,
                    ));
                }
                if keys.is_empty() {
                    return Err(KeyConfigError(format!(
                        "the JWKS file has no key usable with {algorithm:?}"
                    )));
                }
                (algorithm, keys)
            }
        };
        let mut validation = Validation::new(algorithm);
        validation.set_issuer(&[issuer]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        // `exp` and `nbf` are checked against the verifier's clock, below.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        if issuer == compute_domain::authz::SERVICE_ACCOUNT_ISSUER {
            return Err(KeyConfigError(format!(
                "the token issuer `{issuer}` is reserved for service accounts"
            )));
        }
        Ok(Verifier {
            algorithm,
            issuer: issuer.to_owned(),
            keys,
            validation,
            clock: wall_clock(),
            max_lifetime: DEFAULT_MAX_TOKEN_LIFETIME,
            cache: AuthCache::default(),
        })
    }

    /// This verifier refusing tokens still valid for longer than `max` when presented.
    pub fn with_max_lifetime(mut self, max: std::time::Duration) -> Verifier {
        self.max_lifetime = max;
        self
    }

    /// This verifier with `clock` in place of the wall clock (unit tests).
    pub fn with_clock(mut self, clock: JwtClock) -> Verifier {
        self.clock = clock;
        self
    }

    /// This verifier checking `exp` and `nbf` against business time: `clock`, the process's
    /// clock anchored to `compute_now()` (what every server's verifier does).
    pub fn on_business_time(self, clock: &compute_domain::clock::Clock) -> Verifier {
        let clock = clock.clone();
        self.with_clock(std::sync::Arc::new(move || clock.now().timestamp()))
    }

    /// The issuer every token must name.
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The pinned algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Verifies a token (without the `Bearer ` prefix). A token verified within the last
    /// [`AUTH_CACHE_SECONDS`] is answered from memory, its expiry checked again; refusals are
    /// never remembered.
    pub fn verify(&self, token: &str) -> Result<Viewer, Error> {
        let now = (self.clock)();
        let leeway = LEEWAY_SECONDS as i64;
        let key = token_key(token);
        let mut cache = self.cache.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((viewer, trusted_until)) = cache.get(&key) {
            if now < *trusted_until && viewer.expires_at + leeway >= now {
                let mut v = viewer.clone();
                v.valid_for =
                    std::time::Duration::from_secs((v.expires_at + leeway - now).max(0) as u64);
                return Ok(v);
            }
            cache.remove(&key);
        }
        drop(cache);
        let viewer = self.verify_uncached(token)?;
        let mut cache = self.cache.0.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= AUTH_CACHE_MAX {
            cache.retain(|_, (v, until)| *until > now && v.expires_at + leeway >= now);
            if cache.len() >= AUTH_CACHE_MAX {
                cache.clear();
            }
        }
        let until = (now + AUTH_CACHE_SECONDS).min(viewer.expires_at + leeway);
        cache.insert(key, (viewer.clone(), until));
        Ok(viewer)
    }

    /// How many verified tokens are remembered.
    pub fn cached(&self) -> usize {
        self.cache.0.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Verifies a token without the cache: its signature and every claim (benchmarks compare
    /// the two).
    pub fn verify_uncached(&self, token: &str) -> Result<Viewer, Error> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| unauthenticated("the bearer token is not a well-formed JWT"))?;
        if header.alg != self.algorithm {
            return Err(unauthenticated(&format!(
                "the bearer token is signed with {:?}; this server accepts only {:?}",
                header.alg, self.algorithm
            )));
        }
        let key = match (&header.kid, self.keys.len()) {
            (_, 1) => &self.keys[0].1,
            (Some(kid), _) => {
                &self
                    .keys
                    .iter()
                    .find(|(k, _)| k.as_deref() == Some(kid.as_str()))
                    .ok_or_else(|| unauthenticated("the bearer token names an unknown key (kid)"))?
                    .1
            }
            (None, _) => return Err(unauthenticated("the bearer token names no key (kid)")),
        };
        let data = jsonwebtoken::decode::<Claims>(token, key, &self.validation).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind;
            let why = match e.kind() {
                ErrorKind::ExpiredSignature => "the bearer token has expired",
                ErrorKind::ImmatureSignature => "the bearer token is not valid yet (nbf)",
                ErrorKind::InvalidIssuer => "the bearer token has the wrong issuer",
                ErrorKind::InvalidAudience => "the bearer token has the wrong audience",
                ErrorKind::InvalidSignature => "the bearer token's signature does not verify",
                ErrorKind::InvalidAlgorithm => "the bearer token is signed with another algorithm",
                ErrorKind::MissingRequiredClaim(_) => "the bearer token lacks a required claim",
                _ => "the bearer token is invalid",
            };
            unauthenticated(why)
        })?;
        let claims = data.claims;
        let now = (self.clock)();
        let leeway = LEEWAY_SECONDS as i64;
        if claims.exp + leeway < now {
            return Err(unauthenticated("the bearer token has expired"));
        }
        if claims.nbf.is_some_and(|nbf| nbf - leeway > now) {
            return Err(unauthenticated("the bearer token is not valid yet (nbf)"));
        }
        let max = self.max_lifetime.as_secs() as i64;
        if claims.exp.saturating_sub(now) > max {
            return Err(unauthenticated(&format!(
                "the bearer token is valid for longer than this server accepts (at most {max} s \
                 from now)"
            )));
        }
        let valid_for = std::time::Duration::from_secs((claims.exp + leeway - now).max(0) as u64);
        let tenant = claims
            .tenant
            .as_deref()
            .map(|t| TenantId::parse("tenant", t))
            .transpose()
            .map_err(|_| {
                unauthenticated(
                    "the bearer token's tenant claim is not a tenant id (1 to 63 of letters, digits, `_`, `.`, `-`)",
                )
            })?;
        // The subject is recorded in rows (`set_by`, `created_by`): checked here like the tenant.
        if claims.sub.is_empty()
            || claims.sub.chars().count() > 255
            || claims.sub.chars().any(char::is_control)
        {
            return Err(unauthenticated(
                "the bearer token's sub claim must be 1 to 255 printable characters",
            ));
        }
        let node = claims
            .node
            .as_deref()
            .map(|n| NodeId::parse("node", n))
            .transpose()
            .map_err(|_| unauthenticated("the bearer token's node claim is not a node id"))?;
        if claims.iss == compute_domain::authz::SERVICE_ACCOUNT_ISSUER {
            return Err(unauthenticated("the bearer token names a reserved issuer"));
        }
        Ok(Viewer {
            subject: claims.sub,
            issuer: claims.iss,
            scopes: Vec::new(),
            unavailable: false,
            claimed: None,
            tenant,
            node,
            roles: claims.roles.iter().filter_map(|r| Role::parse(r)).collect(),
            expires_at: claims.exp,
            valid_for,
        })
    }
}

fn unauthenticated(why: &str) -> Error {
    Error::Unauthenticated(why.to_owned())
}

/// The issuer of development tokens.
pub const DEV_ISSUER: &str = "compute-dev";
/// The audience of development tokens.
pub const DEV_AUDIENCE: &str = "compute-api";
/// The file, inside the data directory, that holds the development HS256 secret.
pub const DEV_SECRET_FILE: &str = "dev-jwt-secret";

/// Reads the development secret of `data_dir`, creating it (mode 0600) when `create` is set.
pub fn dev_secret(data_dir: &Path, create: bool) -> Result<Secret, Error> {
    let path = data_dir.join(DEV_SECRET_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(Secret::new(s.trim())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::create_dir_all(data_dir).map_err(Error::internal)?;
            let secret = compute_domain::process::random_hex(32)?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(Error::internal)?;
            writeln!(f, "{secret}").map_err(Error::internal)?;
            Ok(Secret::new(secret))
        }
        Err(e) => Err(Error::internal(format!(
            "cannot read the development signing key {}: {e}; run `compute-api dev` once to create it",
            path.display()
        ))),
    }
}

/// Signs a development token with an HS256 secret.
pub fn mint_hs256(secret: &Secret, claims: &Claims) -> Result<String, Error> {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(secret.expose().as_bytes()),
    )
    .map_err(Error::internal)
}

/// Claims for a development token valid for `ttl_seconds` from now.
pub fn dev_claims(sub: &str, tenant: Option<&str>, roles: &[Role], ttl_seconds: i64) -> Claims {
    let now = chrono::Utc::now().timestamp();
    Claims {
        sub: sub.to_owned(),
        tenant: tenant.map(str::to_owned),
        roles: roles.iter().map(|r| r.as_str().to_owned()).collect(),
        iss: DEV_ISSUER.to_owned(),
        aud: DEV_AUDIENCE.to_owned(),
        exp: now + ttl_seconds,
        nbf: Some(now - 5),
        iat: Some(now),
        node: None,
    }
}

/// The token of an `Authorization: Bearer …` value.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verifier() -> (Secret, Verifier) {
        let secret = Secret::new("0123456789abcdef0123456789abcdef");
        let v = Verifier::new(KeySource::Hs256(secret.clone()), DEV_ISSUER, DEV_AUDIENCE)
            .expect("verifier");
        (secret, v)
    }

    #[test]
    fn a_remembered_token_still_expires_and_the_memory_is_bounded() {
        let (secret, v) = verifier();
        let offset = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
        let o = offset.clone();
        let v = v.with_clock(std::sync::Arc::new(move || {
            chrono::Utc::now().timestamp() + o.load(std::sync::atomic::Ordering::SeqCst)
        }));
        let token = mint_hs256(
            &secret,
            &dev_claims("alice", Some("acme"), &[Role::Member], 60),
        )
        .expect("mint");
        let first = v.verify(&token).expect("valid");
        assert_eq!(v.cached(), 1);
        let again = v.verify(&token).expect("remembered");
        assert_eq!((again.subject, again.tenant), (first.subject, first.tenant));
        // Past its expiry (and the leeway), a remembered token is refused like any other.
        offset.store(
            60 + LEEWAY_SECONDS as i64 + 1,
            std::sync::atomic::Ordering::SeqCst,
        );
        assert!(
            v.verify(&token)
                .expect_err("expired")
                .to_string()
                .contains("expired")
        );
        assert_eq!(v.cached(), 0, "refusals are not remembered");
        // A refused token is never remembered, and the memory stays bounded.
        offset.store(0, std::sync::atomic::Ordering::SeqCst);
        assert!(v.verify("not-a-jwt").is_err());
        for i in 0..AUTH_CACHE_MAX + 5 {
            let t =
                mint_hs256(&secret, &dev_claims(&format!("u{i}"), None, &[], 60)).expect("mint");
            v.verify(&t).expect("valid");
        }
        assert!(v.cached() <= AUTH_CACHE_MAX, "{}", v.cached());
    }

    #[test]
    fn accepts_a_good_token_and_reads_its_roles() {
        let (secret, v) = verifier();
        let token = mint_hs256(
            &secret,
            &dev_claims("alice", Some("acme"), &[Role::Member], 60),
        )
        .expect("mint");
        let viewer = v.verify(&token).expect("valid");
        assert_eq!(viewer.subject, "alice");
        assert_eq!(viewer.tenant.as_ref().map(TenantId::as_str), Some("acme"));
        assert_eq!(viewer.roles, vec![Role::Member]);
    }

    #[test]
    fn refuses_expired_wrong_issuer_and_wrong_secret() {
        let (secret, v) = verifier();
        let mut claims = dev_claims("alice", None, &[], 60);
        claims.exp -= 3600;
        let token = mint_hs256(&secret, &claims).expect("mint");
        assert!(
            v.verify(&token)
                .expect_err("expired")
                .to_string()
                .contains("expired")
        );

        let mut claims = dev_claims("alice", None, &[], 60);
        claims.iss = "someone-else".into();
        let token = mint_hs256(&secret, &claims).expect("mint");
        assert!(
            v.verify(&token)
                .expect_err("issuer")
                .to_string()
                .contains("issuer")
        );

        let other = Secret::new("ffffffffffffffffffffffffffffffff");
        let token = mint_hs256(&other, &dev_claims("alice", None, &[], 60)).expect("mint");
        assert!(
            v.verify(&token)
                .expect_err("sig")
                .to_string()
                .contains("signature")
        );
    }

    #[test]
    fn bearer_parses_the_scheme_case_insensitively() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
    }
}
