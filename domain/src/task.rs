//! Spawned tasks that belong to the future that spawned them.

use tokio::task::{JoinError, JoinHandle};

/// A spawned task that is aborted when its handle is dropped: work started for a request (a
/// read on a connection of its own) goes away with the request.
pub struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    pub fn spawn(task: impl Future<Output = T> + Send + 'static) -> Self
    where
        T: Send + 'static,
    {
        AbortOnDrop(tokio::spawn(task))
    }

    /// The task's output; an error when it panicked or the runtime cancelled it (this handle's
    /// own abort happens only on drop, so it is never seen here).
    pub async fn join(mut self) -> Result<T, JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
