//! What every handler shares: the database, the clock, the schema, the verifier, the metrics,
//! the tailer and the shutdown signal.

use std::ops::Deref;
use std::sync::Arc;

use compute_domain::clock::Clock;
use compute_domain::db::Db;
use tokio::sync::watch;

use crate::auth::Verifier;
use crate::graph::ApiSchema;
use crate::metrics::Metrics;
use crate::tailer::Tailer;

/// What every handler shares. Cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

/// The contents of [`AppState`].
pub struct Inner {
    pub db: Db,
    pub clock: Clock,
    pub schema: ApiSchema,
    /// What every GraphQL request passes before and after execution (`graph::admission`).
    pub admission: crate::graph::admission::AdmissionControl,
    /// The published limits the transports and the schema's door enforce.
    pub limits: crate::limits::Limits,
    /// The streams each identity holds open.
    pub streams: crate::limits::Streams,
    pub verifier: Verifier,
    /// The process's projection of the grants, which every caller is resolved against.
    pub authz: crate::authz::Authz,
    pub metrics: Metrics,
    /// The process's one metrics registry, which `/metrics` encodes.
    pub registry: compute_domain::metrics::Registry,
    /// The process's one outbox reader, which feeds every subscription.
    pub tailer: Tailer,
    /// The node-daemon gateway at `/agent`.
    pub gateway: crate::gateway::Gateway,
    /// Serve `/agent` and the operational endpoints only (`serve --gateway-only`).
    pub gateway_only: bool,
    /// The documents known by hash: APQ, and the manifest of `--persisted-only`.
    pub persisted: std::sync::Arc<crate::persisted::Persisted>,
    /// The development token the console's one-click sign-in fetches (`compute-api dev` only).
    pub dev_token: Option<std::sync::Arc<str>>,
    /// The origins allowed to call the API from a browser (CORS); none by default.
    pub cors_origins: Vec<axum::http::HeaderValue>,
    /// Turns `true` when the server begins to shut down.
    pub shutdown: watch::Receiver<bool>,
}

impl Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Wraps the shared contents.
    pub fn new(inner: Inner) -> AppState {
        AppState(Arc::new(inner))
    }

    /// Who a bearer token is, with what the grants let it do: a service account's token
    /// (`cst_…`) or a JWT, then resolved against the grants (`crate::authz`). `Err` is why it
    /// is not accepted (`401`).
    pub fn identify(&self, token: &str) -> Result<crate::auth::Viewer, String> {
        if let Some(account) = self.authz.service_account(token) {
            return account;
        }
        self.verifier
            .verify(token)
            .map(|v| self.authz.resolve(v))
            .map_err(|e| e.to_string())
    }

    /// Changes the contents before the state is shared; `false` once it has been cloned.
    pub fn configure(&mut self, f: impl FnOnce(&mut Inner)) -> bool {
        match Arc::get_mut(&mut self.0) {
            Some(inner) => {
                f(inner);
                true
            }
            None => false,
        }
    }
}
