//! The `compute-api` command line: one typed configuration from flags and environment.
//!
//! `dev.rs` is `compute-api dev` (the whole system in one process on the embedded database) and
//! the embedded database `serve` falls back to without `DATABASE_URL`; it alone uses the
//! workers, the simulator and the embedded-PostgreSQL crates, behind the default-on `dev`
//! feature (`cargo build -p compute-api --no-default-features` leaves all three out).

#[cfg(feature = "dev")]
mod dev;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use compute_domain::db::{Db, PoolSettings};
use compute_domain::ids::GatewayId;
use compute_domain::secrets::Keyring;
use compute_domain::{Error, Result};
use tracing::info;

use crate::auth::{self, KeySource, Role, Secret, Verifier};
use crate::limits::Limits;
use crate::server::Server;
use compute_domain::process::stop_signal as shutdown_signal;
pub use compute_domain::process::{LogFormat, init_logging};

/// The database the embedded server keeps the system's data in.
pub const EMBEDDED_DATABASE: &str = "compute";

#[derive(Debug, Parser)]
#[command(
    name = "compute-api",
    version,
    about = "Better Compute: the GraphQL API of a GPU fleet control plane"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the API (production): on DATABASE_URL, or on the embedded database without it.
    Serve(Box<ServeArgs>),
    /// Run the whole system in one process on the embedded database, with a development token.
    #[cfg(feature = "dev")]
    Dev(dev::DevArgs),
    /// Apply pending migrations and exit.
    Migrate(MigrateArgs),
    /// Print the GraphQL schema (SDL).
    Schema,
    /// Print the web console's GraphQL operations as Apollo's persisted query manifest (the
    /// binary trusts them already; for a gateway or CDN that needs the list).
    ConsoleManifest,
    /// Print a development JWT signed with the key `dev` keeps in its data directory.
    Token(TokenArgs),
    /// Make a subject an administrator (a grant of the `admin` role), without a token: the first
    /// administrator of a deployment that runs `serve --authz grants`.
    GrantAdmin(GrantAdminArgs),
    /// Seal every sink secret under the current secrets key (after setting a key for the first
    /// time, or to finish a rotation); safe to run beside running processes, and again.
    ResealSecrets(ResealArgs),
}

/// The key that seals sink secrets at rest (`docs/security.md`, "Secrets at rest").
#[derive(Debug, Args)]
pub struct SecretsArgs {
    /// The current key: 64 hex digits (32 bytes). New secrets are sealed with it. Generate one
    /// with `openssl rand -hex 32`. Without it, `serve` on the embedded database keeps a key in
    /// its data directory, and `serve` on DATABASE_URL stores secrets unsealed (with a warning).
    #[arg(long, env = "COMPUTE_SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<Secret>,
    /// Former keys, comma-separated, still accepted to open secrets during a rotation.
    #[arg(long, env = "COMPUTE_SECRETS_OLD_KEYS", hide_env_values = true)]
    pub secrets_old_keys: Option<Secret>,
}

impl SecretsArgs {
    /// The keyring, falling back to the data directory's key file when `data_dir` is given (the
    /// embedded database and `dev`).
    pub fn keyring(&self, data_dir: Option<&Path>) -> Result<Option<Arc<Keyring>>> {
        let current = match (&self.secrets_key, data_dir) {
            (Some(k), _) => Some(k.expose().to_owned()),
            (None, Some(dir)) => Some(data_dir_key(dir)?),
            (None, None) => None,
        };
        Keyring::from_config(
            current.as_deref(),
            self.secrets_old_keys.as_ref().map(Secret::expose),
        )
    }
}

/// The file, inside the data directory, that holds the embedded database's secrets key.
pub const SECRETS_KEY_FILE: &str = "secrets-key";

/// Reads the secrets key of `data_dir`, creating it (mode 0600) on first use.
fn data_dir_key(data_dir: &Path) -> Result<String> {
    let path = data_dir.join(SECRETS_KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(k) => Ok(k.trim().to_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::create_dir_all(data_dir).map_err(Error::internal)?;
            let key = Keyring::generate_key()?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| Error::internal(format!("cannot create {}: {e}", path.display())))?;
            writeln!(f, "{key}").map_err(Error::internal)?;
            Ok(key)
        }
        Err(e) => Err(Error::internal(format!(
            "cannot read {}: {e}",
            path.display()
        ))),
    }
}

/// The node-daemon gateway every `serve` process runs at `/agent` (`docs/agent-protocol.md`).
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// This gateway's id (its lease is `gateway:<id>`): unique per process. Default: host, pid
    /// and a random suffix.
    #[arg(long, env = "COMPUTE_GATEWAY_ID")]
    pub gateway_id: Option<String>,
    /// Serve only `/agent` (and `/healthz`, `/readyz`, `/metrics`): a gateway process apart from
    /// the GraphQL API.
    #[arg(long, env = "COMPUTE_GATEWAY_ONLY")]
    pub gateway_only: bool,
    /// The heartbeat period told to daemons, in seconds; a daemon silent for three periods is
    /// disconnected.
    #[arg(long, env = "COMPUTE_AGENT_HEARTBEAT_SECONDS", default_value_t = 5)]
    pub agent_heartbeat_seconds: u64,
    /// How often the gateway writes its sessions' ages, in seconds.
    #[arg(long, env = "COMPUTE_GATEWAY_FLUSH_SECONDS", default_value_t = 2)]
    pub gateway_flush_seconds: u64,
}

impl GatewayArgs {
    /// The gateway's configuration.
    pub fn config(&self) -> Result<crate::gateway::GatewayConfig> {
        let mut config = crate::gateway::GatewayConfig::new();
        if let Some(id) = &self.gateway_id {
            config.id = GatewayId::parse("gateway-id", id)?;
        }
        if !(1..=60).contains(&self.agent_heartbeat_seconds) {
            return Err(Error::bad_input("agent-heartbeat-seconds", "1 to 60"));
        }
        if !(1..=60).contains(&self.gateway_flush_seconds) {
            return Err(Error::bad_input("gateway-flush-seconds", "1 to 60"));
        }
        config.heartbeat = Duration::from_secs(self.agent_heartbeat_seconds);
        config.silent_after = config.heartbeat * 3;
        config.flush_every = Duration::from_secs(self.gateway_flush_seconds);
        Ok(config)
    }
}

#[derive(Debug, Args)]
pub struct ResealArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub secrets: SecretsArgs,
}

#[derive(Debug, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL. Without it, an embedded server runs from --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<Secret>,
    /// Where the embedded database and the development key live.
    #[arg(long, env = "COMPUTE_DATA_DIR", default_value = ".compute")]
    pub data_dir: PathBuf,
    /// Maximum connections of the pool.
    #[arg(long, env = "COMPUTE_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,
    /// DATABASE_URL is a transaction pooler (PgBouncer 1.21 or later with `pool_mode =
    /// transaction` and `max_prepared_statements` above 0): no startup options are sent (set
    /// `statement_timeout` on the role instead), `LISTEN` connects to --listen-database-url, and
    /// migrations are refused (they need a session of their own: run them on PostgreSQL itself).
    #[arg(long, env = "COMPUTE_DB_POOLED")]
    pub db_pooled: bool,
    /// PostgreSQL itself, for the `LISTEN` connections (outbox and command wake-ups) when
    /// DATABASE_URL is a transaction pooler. Without it they listen on DATABASE_URL, and behind a
    /// pooler hear nothing: readers then wait for their polls (up to a second).
    #[arg(long, env = "COMPUTE_LISTEN_DATABASE_URL", hide_env_values = true)]
    pub listen_database_url: Option<Secret>,
    /// Log format: pretty (for a person) or json (one object a line, for a log shipper).
    #[arg(long, env = "COMPUTE_LOG_FORMAT", default_value = "pretty")]
    pub log_format: LogFormat,
}

#[derive(Debug, Args)]
pub struct JwtArgs {
    /// HS256 shared secret (at least 32 bytes).
    #[arg(long, env = "COMPUTE_JWT_HS256_SECRET", hide_env_values = true)]
    pub jwt_hs256_secret: Option<Secret>,
    /// File holding the HS256 shared secret.
    #[arg(long, env = "COMPUTE_JWT_HS256_SECRET_FILE")]
    pub jwt_hs256_secret_file: Option<PathBuf>,
    /// PEM file with the issuer's public key (use with --jwt-algorithm).
    #[arg(long, env = "COMPUTE_JWT_PUBLIC_KEY_FILE")]
    pub jwt_public_key_file: Option<PathBuf>,
    /// JWKS file with the issuer's public keys (use with --jwt-algorithm).
    #[arg(long, env = "COMPUTE_JWT_JWKS_FILE")]
    pub jwt_jwks_file: Option<PathBuf>,
    /// The one algorithm accepted with public keys.
    #[arg(long, env = "COMPUTE_JWT_ALGORITHM", value_enum)]
    pub jwt_algorithm: Option<PublicKeyAlgorithm>,
    /// Required `iss` claim.
    #[arg(long, env = "COMPUTE_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Required `aud` claim.
    #[arg(long, env = "COMPUTE_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
}

/// `serve --authz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AuthzSource {
    /// A subject without grants keeps its token's claims.
    Claims,
    /// Only grants give roles.
    Grants,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PublicKeyAlgorithm {
    #[value(name = "RS256")]
    Rs256,
    #[value(name = "ES256")]
    Es256,
    #[value(name = "EdDSA")]
    EdDsa,
}

impl From<PublicKeyAlgorithm> for jsonwebtoken::Algorithm {
    fn from(a: PublicKeyAlgorithm) -> Self {
        match a {
            PublicKeyAlgorithm::Rs256 => jsonwebtoken::Algorithm::RS256,
            PublicKeyAlgorithm::Es256 => jsonwebtoken::Algorithm::ES256,
            PublicKeyAlgorithm::EdDsa => jsonwebtoken::Algorithm::EdDSA,
        }
    }
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "COMPUTE_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub jwt: JwtArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub secrets: SecretsArgs,
    #[command(flatten)]
    pub gateway: GatewayArgs,
    #[command(flatten)]
    pub frontends: FrontendArgs,
    /// Where a subject's roles come from when it has no grants: `claims` (its token's `roles`
    /// and `tenant`, the default) or `grants` (nowhere: only grants give roles; make the first
    /// administrator with `compute-api grant-admin`). A subject with grants is governed by its
    /// grants either way (docs/security.md#grants).
    #[arg(long, env = "COMPUTE_AUTHZ", value_enum, default_value = "claims")]
    pub authz: AuthzSource,
    /// Apply pending migrations at start. Without it, `serve` on DATABASE_URL expects them
    /// applied (`compute-api migrate`, as the schema's owner) and refuses to start otherwise, so
    /// it can run as a role that cannot change the schema. The embedded database is always
    /// migrated.
    #[arg(long, env = "COMPUTE_MIGRATE")]
    pub migrate: bool,
    /// Let event sinks name private, loopback and link-local targets (on-premises receivers).
    /// Without it, creating or changing a sink whose URL names such an address (or `localhost`)
    /// is `BAD_USER_INPUT`. The workers take the same flag (and the same
    /// `COMPUTE_WEBHOOKS_ALLOW_PRIVATE`) for delivery: set it on both.
    #[arg(long, env = "COMPUTE_WEBHOOKS_ALLOW_PRIVATE")]
    pub webhooks_allow_private: bool,
}

/// What browser frontends need (`docs/frontends.md`): CORS and persisted operations.
#[derive(Debug, Args)]
pub struct FrontendArgs {
    /// A browser origin allowed to call the API (CORS), such as `https://console.example.com`;
    /// repeat it (or separate with commas) for several. None by default: no browser page on
    /// another origin may call the API.
    #[arg(
        long = "cors-origin",
        env = "COMPUTE_CORS_ORIGINS",
        value_delimiter = ','
    )]
    pub cors_origins: Vec<String>,
    /// A manifest of persisted operations (Apollo's persisted query manifest, or a JSON object
    /// of SHA-256 → document): clients may send a hash instead of a document.
    #[arg(long, env = "COMPUTE_PERSISTED_MANIFEST")]
    pub persisted_manifest: Option<PathBuf>,
    /// Run only the manifest's operations and the console's (trusted documents): any other
    /// document is refused with `PERSISTED_QUERY_REQUIRED`, and automatic persisted queries
    /// register nothing. Without a manifest, only the console's operations run.
    #[arg(long, env = "COMPUTE_PERSISTED_ONLY")]
    pub persisted_only: bool,
}

impl FrontendArgs {
    /// The persisted documents and the allowed origins, checked.
    pub fn load(&self) -> Result<(crate::persisted::Persisted, Vec<axum::http::HeaderValue>)> {
        let persisted = match &self.persisted_manifest {
            None if self.persisted_only => {
                crate::persisted::Persisted::from_manifest("{}", true)
                    .map_err(|why| Error::bad_input("persisted-only", why))?
            }
            None => crate::persisted::Persisted::automatic(),
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::bad_input(
                        "persisted-manifest",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                let p = crate::persisted::Persisted::from_manifest(&text, self.persisted_only)
                    .map_err(|why| {
                        Error::bad_input("persisted-manifest", format!("{}: {why}", path.display()))
                    })?;
                info!(
                    manifest = %path.display(),
                    operations = p.manifest_len(),
                    persisted_only = p.only(),
                    "persisted operations loaded"
                );
                p
            }
        };
        Ok((persisted, cors_origins(&self.cors_origins)?))
    }
}

/// Origins as CORS compares them: `scheme://host[:port]`, nothing else.
fn cors_origins(origins: &[String]) -> Result<Vec<axum::http::HeaderValue>> {
    origins
        .iter()
        .map(|o| o.trim().trim_end_matches('/'))
        .filter(|o| !o.is_empty())
        .map(|o| {
            let host = o
                .strip_prefix("https://")
                .or_else(|| o.strip_prefix("http://"));
            let ok = host.is_some_and(|h| {
                !h.is_empty() && !h.contains(['/', '?', '#', '@']) && !h.contains(char::is_whitespace)
            });
            if !ok {
                return Err(Error::bad_input(
                    "cors-origin",
                    format!("`{o}` is not an origin: give scheme://host[:port], such as https://console.example.com"),
                ));
            }
            axum::http::HeaderValue::from_str(o)
                .map_err(|_| Error::bad_input("cors-origin", format!("`{o}` is not an origin")))
        })
        .collect()
}

/// The published limits (`docs/security.md`); each flag's default is `Limits::default()`'s.
#[derive(Debug, Args)]
pub struct LimitArgs {
    /// The largest cost of one request by an authenticated caller.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "COMPUTE_MAX_COST", default_value_t = Limits::default().max_cost)]
    pub max_cost: u64,
    /// The largest cost of one request without a token.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "COMPUTE_ANONYMOUS_MAX_COST", default_value_t = Limits::default().anonymous_max_cost)]
    pub anonymous_max_cost: u64,
    /// Points each authenticated identity may spend per minute.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "COMPUTE_BUDGET_PER_MINUTE", default_value_t = Limits::default().budget_per_minute)]
    pub budget_per_minute: u64,
    /// Points each anonymous peer address may spend per minute.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "COMPUTE_ANONYMOUS_BUDGET_PER_MINUTE", default_value_t = Limits::default().anonymous_budget_per_minute)]
    pub anonymous_budget_per_minute: u64,
    /// The largest GraphQL document, in bytes.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_DOCUMENT_BYTES", default_value_t = Limits::default().max_document_bytes)]
    pub max_document_bytes: usize,
    /// Aliased fields in one document (fragments expanded).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_ALIASES", default_value_t = Limits::default().max_aliases)]
    pub max_aliases: usize,
    /// Root fields of one operation.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_ROOT_FIELDS", default_value_t = Limits::default().max_root_fields)]
    pub max_root_fields: usize,
    /// Directives in one document (fragments expanded).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_DIRECTIVES", default_value_t = Limits::default().max_directives)]
    pub max_directives: usize,
    /// Field selections in one document (fragments expanded).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_SELECTIONS", default_value_t = Limits::default().max_selections)]
    pub max_selections: usize,
    /// Errors in one response.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_ERRORS", default_value_t = Limits::default().max_errors)]
    pub max_errors: usize,
    /// Items in any one list of an argument (in the document or its variables).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_LIST_ITEMS", default_value_t = Limits::default().max_list_items)]
    pub max_list_items: usize,
    /// Seconds one query or mutation may run.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600), env = "COMPUTE_REQUEST_TIMEOUT_SECONDS", default_value_t = Limits::default().request_timeout.as_secs())]
    pub request_timeout_seconds: u64,
    /// Seconds a client has to send a request's headers (also the keep-alive idle timeout).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600), env = "COMPUTE_HEADER_TIMEOUT_SECONDS", default_value_t = Limits::default().header_timeout.as_secs())]
    pub header_timeout_seconds: u64,
    /// Connections held open at once.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_CONNECTIONS", default_value_t = Limits::default().max_connections)]
    pub max_connections: usize,
    /// The largest WebSocket message or frame, in bytes.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_WS_MESSAGE_BYTES", default_value_t = Limits::default().max_ws_message)]
    pub max_ws_message_bytes: usize,
    /// WebSocket connections and SSE streams one identity may hold open.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), env = "COMPUTE_MAX_STREAMS_PER_IDENTITY", default_value_t = Limits::default().max_streams_per_identity)]
    pub max_streams_per_identity: usize,
    /// The longest a bearer token may still be valid when presented, in seconds.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "COMPUTE_MAX_TOKEN_LIFETIME_SECONDS", default_value_t = auth::DEFAULT_MAX_TOKEN_LIFETIME.as_secs())]
    pub max_token_lifetime_seconds: u64,
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        Limits {
            max_cost: self.max_cost,
            anonymous_max_cost: self.anonymous_max_cost,
            budget_per_minute: self.budget_per_minute,
            anonymous_budget_per_minute: self.anonymous_budget_per_minute,
            max_document_bytes: self.max_document_bytes,
            max_aliases: self.max_aliases,
            max_root_fields: self.max_root_fields,
            max_directives: self.max_directives,
            max_selections: self.max_selections,
            max_errors: self.max_errors,
            max_list_items: self.max_list_items,
            request_timeout: Duration::from_secs(self.request_timeout_seconds),
            header_timeout: Duration::from_secs(self.header_timeout_seconds),
            max_connections: self.max_connections,
            max_ws_message: self.max_ws_message_bytes,
            max_streams_per_identity: self.max_streams_per_identity,
        }
    }
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// After migrating, grant this existing role what `serve` and the workers need at run time
    /// (rows, sequences, functions) and nothing that changes the schema.
    #[arg(long, env = "COMPUTE_RUNTIME_ROLE")]
    pub runtime_role: Option<String>,
}

#[derive(Debug, Args)]
pub struct GrantAdminArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The subject (`sub`) of the administrator's tokens.
    #[arg(long)]
    pub subject: String,
    /// The issuer (`iss`) of its tokens, as `serve --jwt-issuer` names it (the development
    /// issuer by default).
    #[arg(long, env = "COMPUTE_JWT_ISSUER", default_value = crate::auth::DEV_ISSUER)]
    pub issuer: String,
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// Role to grant; repeat for several (operator, member, node).
    #[arg(long = "role", required = true, value_parser = parse_role)]
    pub roles: Vec<Role>,
    /// Tenant the caller acts for.
    #[arg(long)]
    pub tenant: Option<String>,
    /// The node a `node` token belongs to (required with `--role node`): a daemon's token opens
    /// that node's session at `/agent` and can do nothing else.
    #[arg(long)]
    pub node: Option<String>,
    /// Identity (`sub`); defaults to `node:<id>` for a node token.
    #[arg(long)]
    pub sub: Option<String>,
    /// Lifetime in seconds.
    #[arg(long, default_value_t = 86_400)]
    pub ttl_seconds: i64,
    /// The data directory `dev` uses.
    #[arg(long, env = "COMPUTE_DATA_DIR", default_value = ".compute")]
    pub data_dir: PathBuf,
}

fn parse_role(s: &str) -> std::result::Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("unknown role `{s}`: use admin, operator, member or node"))
}

/// A database handle, and the embedded server behind it when there is one (stopped on drop).
pub struct Database {
    pub db: Db,
    pub embedded: Option<Embedded>,
}

#[cfg(feature = "dev")]
pub use dev::Embedded;
/// Without the `dev` feature there is no embedded server: no value of this type exists.
#[cfg(not(feature = "dev"))]
pub type Embedded = std::convert::Infallible;

#[cfg(feature = "dev")]
use dev::embedded;

/// Without the `dev` feature, a database needs `DATABASE_URL`.
#[cfg(not(feature = "dev"))]
async fn embedded(_data_dir: &Path, _settings: &PoolSettings) -> Result<(Db, Embedded)> {
    Err(Error::bad_input(
        "database-url",
        "this compute-api is built without the embedded database (the `dev` feature): set \
         DATABASE_URL (or --database-url) to a PostgreSQL server",
    ))
}

/// Connects to `DATABASE_URL`, or starts the embedded server from the data directory.
pub async fn open_database(args: &DatabaseArgs, max_connections: u32) -> Result<Database> {
    let settings = PoolSettings {
        max_connections,
        statement_timeout: if args.db_pooled {
            None
        } else {
            PoolSettings::default().statement_timeout
        },
        listen_url: args
            .listen_database_url
            .as_ref()
            .map(|u| u.expose().to_owned()),
        ..PoolSettings::default()
    };
    let data_dir = args.data_dir.as_path();
    match args.database_url.as_ref() {
        Some(url) => Ok(Database {
            db: Db::connect(url.expose(), &settings).await?,
            embedded: None,
        }),
        None => {
            let (db, pg) = embedded(data_dir, &settings).await?;
            Ok(Database {
                db,
                embedded: Some(pg),
            })
        }
    }
}

fn verifier_from(args: &JwtArgs) -> Result<Verifier> {
    let config = |m: &str| Error::internal(format!("JWT configuration: {m}"));
    let read = |p: &Path| {
        std::fs::read(p).map_err(|e| config(&format!("cannot read {}: {e}", p.display())))
    };
    let source = match (
        &args.jwt_hs256_secret,
        &args.jwt_hs256_secret_file,
        &args.jwt_public_key_file,
        &args.jwt_jwks_file,
    ) {
        (Some(s), None, None, None) => KeySource::Hs256(s.clone()),
        (None, Some(f), None, None) => {
            KeySource::Hs256(Secret::new(String::from_utf8_lossy(&read(f)?).trim()))
        }
        (None, None, Some(f), None) => KeySource::PublicKeyPem {
            algorithm: args
                .jwt_algorithm
                .ok_or_else(|| config("--jwt-public-key-file needs --jwt-algorithm"))?
                .into(),
            pem: read(f)?,
        },
        (None, None, None, Some(f)) => KeySource::Jwks {
            algorithm: args
                .jwt_algorithm
                .ok_or_else(|| config("--jwt-jwks-file needs --jwt-algorithm"))?
                .into(),
            jwks: String::from_utf8_lossy(&read(f)?).into_owned(),
        },
        (None, None, None, None) => {
            return Err(config(
                "no verification key: set one of --jwt-hs256-secret, --jwt-hs256-secret-file, \
                 --jwt-public-key-file or --jwt-jwks-file",
            ));
        }
        _ => return Err(config("set exactly one of the JWT key options")),
    };
    let issuer = args
        .jwt_issuer
        .as_deref()
        .ok_or_else(|| config("--jwt-issuer (COMPUTE_JWT_ISSUER) is required"))?;
    let audience = args
        .jwt_audience
        .as_deref()
        .ok_or_else(|| config("--jwt-audience (COMPUTE_JWT_AUDIENCE) is required"))?;
    Verifier::new(source, issuer, audience).map_err(Error::internal)
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::internal(format!("cannot listen on {addr}: {e}")))
}

/// `compute-api serve`.
pub async fn serve(args: ServeArgs) -> Result<()> {
    let telemetry =
        compute_domain::process::init_telemetry("compute-api", args.database.log_format)
            .map_err(|e| Error::bad_input("otel", e))?;
    let verifier = verifier_from(&args.jwt)?
        .with_max_lifetime(Duration::from_secs(args.limits.max_token_lifetime_seconds));
    let database = open_database(&args.database, args.database.db_max_connections).await?;
    if args.migrate && args.database.db_pooled {
        return Err(pooled_migration());
    }
    if args.migrate || database.embedded.is_some() {
        database.db.migrate().await?;
    } else {
        let status = database.db.migration_status().await?;
        if !status.is_current() {
            return Err(Error::internal(format!(
                "the database has {} of the {} migrations this binary needs ({} failed): run \
                 `compute-api migrate` as the schema's owner, or start with --migrate",
                status.applied, status.expected, status.failed
            )));
        }
    }
    let keyring = args.secrets.keyring(
        database
            .embedded
            .is_some()
            .then_some(args.database.data_dir.as_path()),
    )?;
    match &keyring {
        Some(k) => info!(key = k.current_id(), "sink secrets are sealed at rest"),
        None => tracing::warn!(
            "no secrets key (COMPUTE_SECRETS_KEY): sink secrets are stored unsealed; see \
             docs/security.md"
        ),
    }
    let db = database
        .db
        .clone()
        .with_keyring(keyring)
        .allowing_private_webhooks(args.webhooks_allow_private);
    let gateway = args.gateway.config()?;
    let listener = bind(args.listen).await?;
    if args.gateway.gateway_only {
        info!(listen = %args.listen, gateway = %gateway.id, "serving only the node-daemon gateway at /agent");
    } else {
        info!(listen = %args.listen, gateway = %gateway.id, "serving GraphQL at /graphql and the node-daemon gateway at /agent");
    }
    let (persisted, cors) = args.frontends.load()?;
    let registry = compute_domain::metrics::Registry::default();
    db.register_metrics(&registry);
    Server::with_limits(
        db,
        verifier,
        crate::tailer::StreamConfig::default(),
        args.limits.limits(),
        registry,
    )
    .await?
    .with_gateway(gateway, args.gateway.gateway_only)
    .with_frontends(persisted, cors)
    .with_authz_source(match args.authz {
        AuthzSource::Claims => crate::authz::Source::ClaimsThenGrants,
        AuthzSource::Grants => crate::authz::Source::GrantsOnly,
    })
    .run(listener, shutdown_signal())
    .await
    .map_err(Error::internal)?;
    drop(database);
    telemetry.shutdown().await;
    Ok(())
}

/// Migrations hold a session advisory lock (sqlx's migrator) across statements, which a
/// transaction pooler cannot keep: they run on PostgreSQL itself.
fn pooled_migration() -> Error {
    Error::bad_input(
        "db-pooled",
        "migrations need a session of their own (an advisory lock held across statements), \
         which a transaction pooler cannot keep: run `compute-api migrate` with DATABASE_URL \
         pointing at PostgreSQL itself",
    )
}

/// `compute-api migrate`.
pub async fn migrate(args: MigrateArgs) -> Result<()> {
    let MigrateArgs {
        database: args,
        runtime_role,
    } = args;
    init_logging(args.log_format);
    if args.db_pooled {
        return Err(pooled_migration());
    }
    let database = open_database(&args, 2).await?;
    database.db.migrate().await?;
    let status = database.db.migration_status().await?;
    info!(
        migrations.applied = status.applied,
        migrations.expected = status.expected,
        "migrations applied"
    );
    if let Some(role) = runtime_role {
        database.db.grant_runtime(&role).await?;
        info!(role = %role, "run-time privileges granted");
    }
    Ok(())
}

/// `compute-api grant-admin`.
pub async fn grant_admin(args: GrantAdminArgs) -> Result<()> {
    init_logging(args.database.log_format);
    let database = open_database(&args.database, 2).await?;
    let grant =
        compute_domain::authz::bootstrap_admin(&database.db, &args.issuer, &args.subject).await?;
    info!(grant = %grant.id, subject = %grant.subject, issuer = %grant.issuer, "administrator granted");
    Ok(())
}

/// `compute-api reseal-secrets`.
pub async fn reseal_secrets(args: ResealArgs) -> Result<()> {
    init_logging(args.database.log_format);
    let database = open_database(&args.database, 2).await?;
    let keyring = args.secrets.keyring(
        database
            .embedded
            .is_some()
            .then_some(args.database.data_dir.as_path()),
    )?;
    let db = database.db.clone().with_keyring(keyring);
    let done = compute_domain::sinks::reseal_all(&db).await?;
    info!(
        resealed = done.resealed,
        already_current = done.current,
        key = db.keyring().map(Keyring::current_id).unwrap_or_default(),
        "sink secrets sealed under the current key"
    );
    Ok(())
}

/// `compute-api token`.
pub fn token(args: TokenArgs) -> Result<String> {
    if args.ttl_seconds <= 0 {
        return Err(Error::bad_input("ttl-seconds", "must be positive"));
    }
    let is_node = args.roles.contains(&Role::Node);
    let node = match (&args.node, is_node) {
        (Some(n), true) => Some(compute_domain::ids::NodeId::parse("node", n)?),
        (None, true) => return Err(Error::bad_input("node", "--role node needs --node <id>")),
        (Some(_), false) => {
            return Err(Error::bad_input("node", "--node goes with --role node"));
        }
        (None, false) => None,
    };
    let sub = match (&args.sub, &node) {
        (Some(s), _) => s.clone(),
        (None, Some(n)) => format!("node:{n}"),
        (None, None) => return Err(Error::bad_input("sub", "--sub is required")),
    };
    let secret = auth::dev_secret(&args.data_dir, false)?;
    let mut claims = auth::dev_claims(&sub, args.tenant.as_deref(), &args.roles, args.ttl_seconds);
    claims.node = node.map(|n| n.to_string());
    auth::mint_hs256(&secret, &claims)
}

/// The `compute-api` command line: parses the arguments, runs the command, and reports an
/// error on stderr with a failing exit code. (`main.rs` is only this; the tests package builds
/// it too, as `test-api`, to start and kill real API processes.)
pub async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args).await,
        #[cfg(feature = "dev")]
        Command::Dev(args) => dev::dev(args).await,
        Command::Migrate(args) => migrate(args).await,
        Command::GrantAdmin(args) => grant_admin(args).await,
        Command::Schema => {
            let _ = write!(std::io::stdout().lock(), "{}", crate::graph::sdl());
            Ok(())
        }
        Command::ConsoleManifest => serde_json::to_string_pretty(&crate::console::manifest())
            .map_err(Error::internal)
            .map(|manifest| {
                let _ = writeln!(std::io::stdout().lock(), "{manifest}");
            }),
        Command::ResealSecrets(args) => reseal_secrets(args).await,
        Command::Token(args) => token(args).map(|t| {
            let _ = writeln!(std::io::stdout().lock(), "{t}");
        }),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let detail = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            let _ = writeln!(std::io::stderr().lock(), "error: {e}{detail}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cors_origins;

    #[test]
    fn limits_of_zero_are_refused_where_they_enter() {
        use clap::Parser;
        for flag in [
            "--request-timeout-seconds",
            "--header-timeout-seconds",
            "--max-connections",
            "--max-cost",
            "--max-streams-per-identity",
        ] {
            let parsed = super::Cli::try_parse_from(["compute-api", "serve", flag, "0"]);
            assert!(parsed.is_err(), "{flag} 0 was accepted");
        }
        assert!(
            super::Cli::try_parse_from([
                "compute-api",
                "serve",
                "--request-timeout-seconds",
                "3601"
            ])
            .is_err()
        );
        assert!(
            super::Cli::try_parse_from(["compute-api", "serve", "--max-connections", "2"]).is_ok()
        );
    }

    #[test]
    fn cors_origins_take_both_schemes_and_nothing_but_an_origin() {
        let ok = cors_origins(&[
            "https://console.example.com".into(),
            "http://localhost:5173/".into(),
            "https://console.example.com:8443".into(),
        ])
        .expect("origins");
        assert_eq!(
            ok,
            [
                "https://console.example.com",
                "http://localhost:5173",
                "https://console.example.com:8443"
            ]
        );
        for bad in [
            "console.example.com",
            "https://",
            "https://console.example.com/app",
            "ftp://console.example.com",
            "https://a b",
            "https://user@console.example.com",
        ] {
            assert!(cors_origins(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
