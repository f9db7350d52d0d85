//! The HTTP listener of `baton serve`: the JSON API and the console.

use std::net::SocketAddr;

use clap::Args;

use super::common::ConfigError;

#[derive(Debug, Clone, Args)]
pub struct HttpArgs {
    /// Serve the JSON API (`/api/v1`) and the web console (`/`) on this address (off unless
    /// given), with the gRPC listener's TLS, tokens and roles.
    #[arg(long, env = "BATON_HTTP_LISTEN")]
    pub http_listen: Option<SocketAddr>,
    /// Host names the HTTP listener answers besides loopback literals, `localhost` and the
    /// advertise host, comma-separated (the name of a Service or an ingress). Any other Host
    /// is refused with 421, so a page under a rebound DNS name cannot reach the API.
    #[arg(long, env = "BATON_HTTP_ALLOWED_HOSTS", value_delimiter = ',')]
    pub http_allowed_hosts: Vec<String>,
    /// Live streams (console pages, log follows, watches) open at once; more answer 503.
    #[arg(long, env = "BATON_HTTP_MAX_STREAMS", default_value_t = 100)]
    pub http_max_streams: usize,
}

impl HttpArgs {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for h in &self.http_allowed_hosts {
            if h.is_empty() || h.contains(['/', ' ', '@']) {
                return Err(ConfigError(format!(
                    "--http-allowed-hosts: {h:?} is not a host name"
                )));
            }
        }
        if self.http_max_streams == 0 {
            return Err(ConfigError("--http-max-streams must be at least 1".into()));
        }
        Ok(())
    }
}
