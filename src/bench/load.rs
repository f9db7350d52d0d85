//! Closed-loop load: C clients, each sending its next request when the last one is answered,
//! for a fixed time.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::stats::Load;

/// Runs `op(i)` (i counts up from 0 across clients) from `concurrency` clients for `duration`.
/// `op` answers whether the request succeeded; failures are counted, not timed.
pub async fn drive<F, Fut>(concurrency: usize, duration: Duration, op: F) -> Load
where
    F: Fn(u64) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let end = started + duration;
    let clients: Vec<_> = (0..concurrency)
        .map(|_| {
            let (op, next) = (op.clone(), next.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut errors = 0;
                while Instant::now() < end {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    if op(i).await {
                        samples.push(t.elapsed());
                    } else {
                        errors += 1;
                    }
                }
                (samples, errors)
            })
        })
        .collect();
    let mut samples = Vec::new();
    let mut errors = 0;
    for c in clients {
        if let Ok((s, e)) = c.await {
            samples.extend(s);
            errors += e;
        }
    }
    Load::from_samples(samples, errors, started.elapsed())
}
