//! The client side: how the CLI and coordinators (reading a worker's logs) present
//! themselves, with TLS and a bearer token.

use std::path::Path;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// Adds `authorization: Bearer <token>` to every request, if a token is set. The value is
/// marked sensitive so no debug output shows it.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    /// Reads the token (the whole file, trimmed) from `path`.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(format!("the token file {} is empty", path.display()));
        }
        let mut v: MetadataValue<Ascii> = format!("Bearer {token}").parse().map_err(|_| {
            format!(
                "the token in {} has characters a header cannot carry",
                path.display()
            )
        })?;
        v.set_sensitive(true);
        Ok(Bearer(Some(v)))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel that carries the caller's token.
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// TLS and token for calling Baton's gRPC listeners.
#[derive(Clone, Default)]
pub struct ClientSecurity {
    pub tls: Option<ClientTlsConfig>,
    pub bearer: Bearer,
}

impl ClientSecurity {
    /// `addr` is `host:port` (https with TLS, http without) or a full URI. With TLS set, an
    /// `http://` URI is refused: tonic would dial it in clear and the token would travel
    /// readable (an advertise address read from etcd is no reason to drop TLS).
    pub async fn connect(
        &self,
        addr: &str,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<AuthChannel, String> {
        let uri = match (addr.contains("://"), self.tls.is_some()) {
            (true, true) if !addr.starts_with("https://") => {
                return Err(format!(
                "refusing {addr:?}: TLS is configured, so only https:// (or host:port) is dialled"
            ))
            }
            (true, _) => addr.to_string(),
            (false, true) => format!("https://{addr}"),
            (false, false) => format!("http://{addr}"),
        };
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("invalid endpoint {addr:?}: {e}"))?
            .connect_timeout(connect_timeout)
            .timeout(timeout);
        if let Some(tls) = &self.tls {
            ep = ep
                .tls_config(tls.clone())
                .map_err(|e| format!("TLS settings for {uri}: {e}"))?;
        }
        self.dial(ep, addr).await
    }

    /// Connects to exactly `addr` (no name resolution), verifying a TLS certificate for `host`:
    /// what a follower watching the leader dials, so a refused connection is about that socket.
    pub async fn connect_exact(
        &self,
        host: &str,
        addr: std::net::SocketAddr,
        timeout: Duration,
    ) -> Result<AuthChannel, String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| format!("invalid endpoint {addr}: {e}"))?
            .connect_timeout(timeout)
            .tcp_nodelay(true)
            // A long-held stream silently dropped on the way (NAT, conntrack) is noticed.
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5));
        if let Some(tls) = &self.tls {
            ep = ep
                .tls_config(tls.clone().domain_name(host))
                .map_err(|e| format!("TLS settings for {addr}: {e}"))?;
        }
        self.dial(ep, &addr.to_string()).await
    }

    async fn dial(&self, ep: Endpoint, addr: &str) -> Result<AuthChannel, String> {
        let ch = ep.connect().await.map_err(|e| {
            let mut msg = format!("cannot connect to {addr}: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            msg
        })?;
        Ok(InterceptedService::new(ch, self.bearer.clone()))
    }
}
