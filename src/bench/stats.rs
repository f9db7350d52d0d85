//! Latency samples and what the report shows of them.

use std::time::Duration;

use serde::Serialize;

/// Throughput and latency of one load at one concurrency.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Load {
    pub ops: usize,
    pub errors: usize,
    pub ops_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// The latency CDF, downsampled (milliseconds at evenly spaced quantiles), for plots.
    #[serde(skip)]
    pub cdf_ms: Vec<f64>,
}

impl Load {
    pub fn from_samples(mut samples: Vec<Duration>, errors: usize, elapsed: Duration) -> Load {
        samples.sort();
        let ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        Load {
            ops: ms.len(),
            errors,
            ops_per_sec: ms.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            p50_ms: quantile(&ms, 0.50),
            p99_ms: quantile(&ms, 0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
            cdf_ms: (0..=200).map(|i| quantile(&ms, i as f64 / 200.0)).collect(),
        }
    }
}

/// The `q` quantile of sorted values (nearest rank); 0 for none.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// min, p50, p99 and max of unsorted milliseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Spread {
    pub n: usize,
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Spread {
    pub fn of(mut ms: Vec<f64>) -> Spread {
        ms.sort_by(f64::total_cmp);
        Spread {
            n: ms.len(),
            min_ms: ms.first().copied().unwrap_or(0.0),
            p50_ms: quantile(&ms, 0.5),
            p99_ms: quantile(&ms, 0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        let s = Spread::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.n, s.min_ms, s.p50_ms, s.max_ms), (3, 1.0, 2.0, 3.0));
    }
}
