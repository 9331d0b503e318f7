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
/// ([`super::Db`] calls [`Poker::poke`] after each writing commit), and whatever other channel a
/// writer asks for after its commit ([`Poker::poke_to`]: the command dispatcher wakes a gateway
/// so). Pokes that arrive while one is being sent, or within [`POKE_INTERVAL`] of it, fold into
/// one more statement, which sends each distinct (channel, payload) once.
#[derive(Debug, Clone)]
pub(crate) struct Poker {
    wake: tokio::sync::mpsc::Sender<()>,
    pending: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<(String, String)>>>,
}

impl Poker {
    /// Starts the task that sends the pokes on `pool`; it ends when the last handle is dropped.
    /// `None` outside a Tokio runtime.
    pub(crate) fn start(pool: sqlx::PgPool) -> Option<Poker> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let (wake, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let pending = std::sync::Arc::<
            std::sync::Mutex<std::collections::BTreeSet<(String, String)>>,
        >::default();
        let sending = pending.clone();
        runtime.spawn(async move {
            while rx.recv().await.is_some() {
                let due = std::mem::take(&mut *sending.lock().unwrap_or_else(|p| p.into_inner()));
                let (channels, payloads): (Vec<String>, Vec<String>) = due.into_iter().unzip();
                if let Err(e) = sqlx::query(
                    "SELECT pg_notify(c, p) FROM unnest($1::text[], $2::text[]) AS t(c, p)",
                )
                .bind(&channels)
                .bind(&payloads)
                .execute(&pool)
                .await
                {
                    tracing::debug!(error = %e, "a poke was not sent (its readers poll anyway)");
                }
                tokio::time::sleep(POKE_INTERVAL).await;
            }
        });
        Some(Poker { wake, pending })
    }

    /// Asks for the outbox poke; never waits.
    pub(crate) fn poke(&self) {
        self.poke_to(NOTIFY_CHANNEL, "");
    }

    /// Asks for a `NOTIFY channel, payload` after the caller's commit; never waits.
    pub(crate) fn poke_to(&self, channel: &str, payload: &str) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((channel.to_owned(), payload.to_owned()));
        let _ = self.wake.try_send(());
    }
}
