//! The after-commit poke: `NOTIFY compute_outbox` from a transaction of its own, debounced,
//! after this process committed a change. It lives here, below the outbox, because every
//! writing commit of [`crate::db::Db`] asks for it; the outbox's readers listen on its channel.

/// The channel of the outbox poke.
pub const NOTIFY_CHANNEL: &str = "compute_outbox";

/// The shortest time between two pokes of one process: the most a poke waits for the one
/// before it, and what bounds a process to 200 notifying transactions a second. A change after a
/// quiet spell is poked at once; under load, changes within this interval share one poke (and
/// every listening process one read of the outbox), which at 5 ms cost about one notifying
/// transaction and one read per listener for each reservation (`bench-reservations`).
pub const POKE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(5);

/// Pokes the outbox readers of every process after this process committed a change
/// ([`super::Db`] calls [`Poker::poke`] after each writing commit). Pokes that arrive while
/// one is being sent, or within [`POKE_INTERVAL`] of it, fold into one more.
#[derive(Debug, Clone)]
pub(crate) struct Poker(tokio::sync::mpsc::Sender<()>);

impl Poker {
    /// Starts the task that sends the pokes on `pool`; it ends when the last handle is dropped.
    /// `None` outside a Tokio runtime.
    pub(crate) fn start(pool: sqlx::PgPool) -> Option<Poker> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        runtime.spawn(async move {
            while rx.recv().await.is_some() {
                if let Err(e) = sqlx::query("SELECT pg_notify($1, '')")
                    .bind(NOTIFY_CHANNEL)
                    .execute(&pool)
                    .await
                {
                    tracing::debug!(error = %e, "the outbox poke was not sent (readers poll anyway)");
                }
                tokio::time::sleep(POKE_INTERVAL).await;
            }
        });
        Some(Poker(tx))
    }

    /// Asks for a poke; never waits.
    pub(crate) fn poke(&self) {
        let _ = self.0.try_send(());
    }
}
