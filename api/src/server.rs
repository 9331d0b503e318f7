//! The HTTP server: the router and graceful shutdown.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use compute_domain::clock::Clock;
use compute_domain::db::Db;
use compute_domain::metrics::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::info;

use crate::auth::Verifier;
use crate::graph;
use crate::metrics::Metrics;
use crate::state::{AppState, Inner};
use crate::tailer::{StreamConfig, Tailer};

/// The router of the API.
pub fn router(app: AppState) -> Router {
    Router::new()
        .route(
            "/graphql",
            get(crate::transport::http::get).post(crate::transport::http::post),
        )
        .route(
            "/graphql/stream",
            get(crate::transport::sse::get).post(crate::transport::sse::post),
        )
        .route("/healthz", get(crate::ops::health::healthz))
        .route("/readyz", get(crate::ops::health::readyz))
        .route("/metrics", get(crate::ops::health::metrics))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            crate::ops::track,
        ))
        .with_state(app)
}

/// A server ready to run: its state and the switch that starts its shutdown.
pub struct Server {
    app: AppState,
    shutdown_tx: watch::Sender<bool>,
}

impl Server {
    /// Anchors the clock to the database and builds the state.
    pub async fn new(db: Db, verifier: Verifier) -> compute_domain::Result<Server> {
        Server::with_config(db, verifier, StreamConfig::default()).await
    }

    /// [`Server::new`] with the tailer and streaming transports set by `stream`.
    pub async fn with_config(
        db: Db,
        verifier: Verifier,
        stream: StreamConfig,
    ) -> compute_domain::Result<Server> {
        let registry = Registry::default();
        db.register_metrics(&registry);
        Server::with_registry(db, verifier, stream, registry).await
    }

    /// [`Server::with_config`] declaring its metrics in `registry`, the process's one registry
    /// (`dev` shares it with the workers it runs).
    pub async fn with_registry(
        db: Db,
        verifier: Verifier,
        stream: StreamConfig,
        registry: Registry,
    ) -> compute_domain::Result<Server> {
        let clock = Clock::anchored(&db).await?;
        let (shutdown_tx, shutdown) = watch::channel(false);
        let tailer = Tailer::new(db.clone(), stream);
        let metrics = Metrics::new(&registry, &db, &clock, &tailer);
        let app = AppState::new(Inner {
            schema: graph::build(Some((db.clone(), tailer.clone()))),
            tailer,
            db,
            clock,
            verifier,
            metrics,
            registry,
            shutdown,
        });
        Ok(Server { app, shutdown_tx })
    }

    /// The shared state.
    pub fn state(&self) -> &AppState {
        &self.app
    }

    /// Serves on `listener` until `stop` resolves; then stops accepting, tells WebSocket
    /// connections to close, and waits for requests in flight.
    pub async fn run(
        self,
        listener: TcpListener,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Server { app, shutdown_tx } = self;
        let sampler = tokio::spawn(app.clock.clone().run_sampler(
            app.db.clone(),
            Duration::from_secs(30),
            {
                let mut rx = app.shutdown.clone();
                async move {
                    let _ = rx.wait_for(|s| *s).await;
                }
            },
        ));
        let tailer = tokio::spawn(app.tailer.clone().run({
            let mut rx = app.shutdown.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }));
        let result = axum::serve(listener, router(app))
            .with_graceful_shutdown(async move {
                stop.await;
                info!("shutting down: no new connections, finishing requests in flight");
                let _ = shutdown_tx.send(true);
            })
            .await;
        sampler.abort();
        tailer.abort();
        result
    }
}
