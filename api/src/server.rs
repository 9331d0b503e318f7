//! The HTTP server: the router and graceful shutdown.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use compute_domain::clock::Clock;
use compute_domain::db::Db;
use compute_domain::metrics::Registry;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::graph::admission::Peer;

use crate::auth::Verifier;
use crate::graph;
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::state::{AppState, Inner};
use crate::tailer::{StreamConfig, Tailer};

/// The router's paths, named once: [`router`] serves them and the metrics label requests by them
/// (handed to `Metrics::new`), so a label is one of these static strings.
pub mod routes {
    pub const GRAPHQL: &str = "/graphql";
    pub const GRAPHQL_STREAM: &str = "/graphql/stream";
    pub const USAGE_CSV: &str = "/usage.csv";
    pub const CONSOLE_INDEX: &str = "/";
    pub const GRAPHIQL: &str = "/graphiql";
    pub const CONSOLE_DEV_TOKEN: &str = "/console/dev-token";
    pub const CONSOLE_FILE: &str = "/console/{*path}";
    pub const AGENT: &str = "/agent";
    pub const HEALTHZ: &str = "/healthz";
    pub const READYZ: &str = "/readyz";
    pub const METRICS: &str = "/metrics";
    /// Every path of the router.
    pub const ALL: [&str; 11] = [
        GRAPHQL,
        GRAPHQL_STREAM,
        USAGE_CSV,
        CONSOLE_INDEX,
        GRAPHIQL,
        CONSOLE_DEV_TOKEN,
        CONSOLE_FILE,
        AGENT,
        HEALTHZ,
        READYZ,
        METRICS,
    ];
}

/// The router of the API.
pub fn router(app: AppState) -> Router {
    let api = if app.gateway_only {
        Router::new()
    } else {
        Router::new()
            .route(
                routes::GRAPHQL,
                get(crate::transport::http::get).post(crate::transport::http::post),
            )
            .route(
                routes::GRAPHQL_STREAM,
                get(crate::transport::sse::get).post(crate::transport::sse::post),
            )
            .route(routes::USAGE_CSV, get(crate::transport::csv::get))
    };
    // The console and GraphiQL (`docs/console.md`): same-origin pages, outside CORS.
    let pages = if app.gateway_only {
        Router::new()
    } else {
        use crate::transport::console;
        Router::new()
            .route(routes::CONSOLE_INDEX, get(console::index))
            .route(routes::GRAPHIQL, get(console::graphiql))
            .route(routes::CONSOLE_DEV_TOKEN, get(console::dev_token))
            .route(routes::CONSOLE_FILE, get(console::file))
    };
    // Browsers may call the API from the allowed origins only (none by default): a preflight is
    // answered, and the answers carry `Access-Control-Allow-Origin` for those origins. Bearer
    // tokens travel in a header, never in cookies, so credentials are not allowed.
    let api = if app.cors_origins.is_empty() {
        api
    } else {
        use axum::http::{Method, header};
        api.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(tower_http::cors::AllowOrigin::list(
                    app.cors_origins.iter().cloned(),
                ))
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::ACCEPT,
                    header::HeaderName::from_static("last-event-id"),
                    // A browser's own tracing continues its trace here.
                    header::HeaderName::from_static(crate::trace::TRACEPARENT),
                ])
                // So a page can show the trace id a user quotes.
                .expose_headers([
                    header::HeaderName::from_static(crate::trace::TRACE_ID_HEADER),
                    header::HeaderName::from_static("traceresponse"),
                ])
                .max_age(Duration::from_secs(600)),
        )
    };
    api.merge(pages)
        .route(routes::AGENT, get(crate::transport::agent::get))
        .route(routes::HEALTHZ, get(crate::ops::health::healthz))
        .route(routes::READYZ, get(crate::ops::health::readyz))
        .route(routes::METRICS, get(crate::ops::health::metrics))
        .layer(crate::ops::TrackLayer::new(app.metrics.clone()))
        .with_state(app)
}

/// Accepts connections until `stop` resolves, at most [`Limits::max_connections`] at once, each
/// served by hyper's HTTP/1 with a header read timeout ([`Limits::header_timeout`], which also
/// closes idle keep-alive connections) and its peer address in the request ([`Peer`]). Then it
/// stops accepting, raises `shutdown_tx` (WebSockets close with 1001), lets each connection
/// finish its request in flight, and returns when all have.
async fn serve(
    listener: TcpListener,
    app: AppState,
    stop: impl Future<Output = ()> + Send + 'static,
    shutdown_tx: watch::Sender<bool>,
) -> std::io::Result<()> {
    let limits = app.limits.clone();
    let router = router(app.clone());
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Each connection holds a clone of `open`; `closed()` resolves when every one is gone.
    let (open_tx, open) = watch::channel(());
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // A slot for it, or a wait for one: counted and said only when a connection does wait
        // (counted when the last slot was taken, it fired with nobody waiting). The others
        // wait in the listen backlog meanwhile.
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(tokio::sync::TryAcquireError::Closed) => break,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                app.metrics.record_refusal("connections");
                warn!(
                    max = limits.max_connections,
                    %peer,
                    "the connection limit is reached: a new connection waits for a slot"
                );
                tokio::select! {
                    p = slots.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    () = &mut stop => break,
                }
            }
        };
        // Small messages (WebSocket frames, short responses) go out at once: with Nagle's
        // algorithm a frame written in two parts waits for the peer's delayed ACK (up to 200 ms
        // on Linux) before its second part leaves.
        if let Err(e) = stream.set_nodelay(true) {
            debug!(error = %e, "TCP_NODELAY could not be set");
        }
        let router = router.clone();
        let mut shutdown = app.shutdown.clone();
        let open = open.clone();
        let header_timeout = limits.header_timeout;
        // The slot is the HTTP connection's: a WebSocket leaves it at the upgrade (hyper ends
        // the connection's task there). Sockets are bounded per identity instead
        // (`--max-streams-per-identity`; an anonymous one by its address, for 10 s before its
        // `connection_init`): one gateway serves more daemons than HTTP connections.
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(Peer(peer.ip()));
                router.clone().oneshot(req.map(axum::body::Body::new))
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        debug!(error = %e, %peer, "connection ended");
                    }
                }
                () = async { drop(shutdown.wait_for(|s| *s).await) } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(open);
        });
    }
    info!("shutting down: no new connections, finishing requests in flight");
    drop(listener);
    let _ = shutdown_tx.send(true);
    drop(open);
    open_tx.closed().await;
    Ok(())
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
        Server::with_limits(db, verifier, stream, Limits::default(), registry).await
    }

    /// [`Server::with_registry`] enforcing `limits` (`docs/security.md`).
    pub async fn with_limits(
        db: Db,
        verifier: Verifier,
        stream: StreamConfig,
        limits: Limits,
        registry: Registry,
    ) -> compute_domain::Result<Server> {
        let clock = Clock::anchored(&db).await?;
        // Tokens expire in business time, as leases and bookings do.
        let verifier = verifier.on_business_time(&clock);
        let (shutdown_tx, shutdown) = watch::channel(false);
        let authz = crate::authz::Authz::load(db.clone(), clock.clone()).await?;
        authz.register_metrics(&registry);
        let tailer = Tailer::new(db.clone(), stream);
        let metrics = Metrics::new(&registry, &db, &clock, &tailer, &routes::ALL);
        let schema = graph::build(Some((
            db.clone(),
            tailer.clone(),
            crate::auth::TokenIssuer(verifier.issuer().to_owned()),
        )));
        let costs = graph::cost::CostModel::from_sdl(&schema.sdl())
            .map_err(|e| compute_domain::Error::internal(e.to_string()))?;
        let admission = graph::admission::AdmissionControl::new(limits.clone(), costs, {
            let metrics = metrics.clone();
            std::sync::Arc::new(move |reason| metrics.record_refusal(reason))
        });
        let documents = admission.clone();
        registry.sample(
            "compute_graphql_documents",
            "GraphQL documents by how the door got their parse: reused (a document seen lately, \
             its kept parse cloned) or parsed.",
            compute_domain::metrics::Sampled::Counter,
            Some("parse"),
            move || {
                let (reused, parsed) = documents.documents().counts();
                vec![("reused", reused as f64), ("parsed", parsed as f64)]
            },
        );
        let gateway = crate::gateway::Gateway::new(
            db.clone(),
            clock.clone(),
            crate::gateway::GatewayConfig::new(),
        );
        let app = AppState::new(Inner {
            gateway,
            gateway_only: false,
            schema,
            admission,
            limits,
            streams: crate::limits::Streams::default(),
            tailer,
            db,
            clock,
            verifier,
            authz,
            metrics,
            registry,
            persisted: Arc::new(
                crate::persisted::Persisted::automatic().with_trusted(crate::console::documents()),
            ),
            dev_token: None,
            cors_origins: Vec::new(),
            shutdown,
        });
        Ok(Server { app, shutdown_tx })
    }

    /// This server with the persisted documents of `persisted` (a manifest, `--persisted-only`)
    /// and the browser origins of `cors_origins` allowed (CORS).
    pub fn with_frontends(
        mut self,
        persisted: crate::persisted::Persisted,
        cors_origins: Vec<axum::http::HeaderValue>,
    ) -> Server {
        // The console's operations ship with the binary: trusted, in `--persisted-only` too.
        let persisted = persisted.with_trusted(crate::console::documents());
        self.app.configure(|inner| {
            inner.persisted = Arc::new(persisted);
            inner.cors_origins = cors_origins;
        });
        self
    }

    /// This server taking the roles of a subject without grants from `source`
    /// (`serve --authz`).
    pub fn with_authz_source(self, source: crate::authz::Source) -> Server {
        self.app.authz.set_source(source);
        self
    }

    /// This server trusting its grants for `trust` after each read of the feed (tests of a
    /// database outage; `authz::TRUST` otherwise).
    pub fn with_authz_trust(self, trust: std::time::Duration) -> Server {
        self.app.authz.set_trust(trust);
        self
    }

    /// This server handing `token` to the console's one-click sign-in (`compute-api dev`).
    pub fn with_dev_token(mut self, token: &str) -> Server {
        self.app
            .configure(|inner| inner.dev_token = Some(Arc::from(token)));
        self
    }

    /// This server with a gateway of `config`, serving only `/agent` (and `/healthz`, `/readyz`,
    /// `/metrics`) when `only` (`serve --gateway-only`).
    pub fn with_gateway(mut self, config: crate::gateway::GatewayConfig, only: bool) -> Server {
        self.app.configure(|inner| {
            inner.gateway =
                crate::gateway::Gateway::new(inner.db.clone(), inner.clock.clone(), config);
            inner.gateway_only = only;
        });
        self
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
        let authz = tokio::spawn(app.authz.clone().run({
            let mut rx = app.shutdown.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }));
        let gateway = tokio::spawn(app.gateway.clone().run({
            let mut rx = app.shutdown.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        }));
        let result = serve(listener, app.clone(), stop, shutdown_tx).await;
        sampler.abort();
        tailer.abort();
        authz.abort();
        // The gateway ends its sessions and lets its lease go, so daemons reconnect elsewhere.
        let _ = tokio::time::timeout(Duration::from_secs(5), gateway).await;
        result
    }
}
