//! Log setup: text or JSON on stderr, plus an optional JSON role log file.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Mutex;

use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, Layer};

use crate::config::LogFormat;
use crate::rolelog;

/// Installs the global subscriber. The role log, when given, receives every role event as one
/// JSON line (appended, so a restarted replica extends the same file).
pub fn init(format: LogFormat, filter: &str, role_log: Option<&Path>) -> std::io::Result<()> {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let console = match format {
        LogFormat::Text => fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let roles = match role_log {
        Some(path) => {
            let file = OpenOptions::new().create(true).append(true).open(path)?;
            Some(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(false)
                    .with_writer(Mutex::new(file))
                    .with_filter(
                        Targets::new()
                            .with_target(rolelog::TARGET, tracing::Level::INFO)
                            .with_target(crate::coordinator::SCHEDULE_EVENTS, tracing::Level::INFO),
                    ),
            )
        }
        None => None,
    };
    tracing_subscriber::registry()
        .with(console)
        .with(roles)
        .try_init()
        .map_err(std::io::Error::other)
}
