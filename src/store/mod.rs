//! etcd access shared by every part of a replica: the connection, the key layout, bounded
//! single calls, and the one place where etcd error conditions are recognised.
//!
//! There is deliberately one client *without* a per-request timeout: etcd-client's
//! `with_timeout` would also cancel a waiting `campaign` and every stream. Single calls are
//! bounded by [`Store::timed`] instead.

pub mod codec;
pub mod group;
mod keys;
pub mod mem;
mod write;

pub use group::GroupCommit;
pub use keys::{JobKeys, Keys};
pub use write::{Cond, Effect, Write};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("etcd endpoints are invalid ({endpoints})")]
    Endpoints {
        endpoints: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("etcd refused the user {user:?}: {reason}")]
    Auth { user: String, reason: String },
    #[error("etcd did not answer {op} within {timeout:?}")]
    Timeout { op: &'static str, timeout: Duration },
    #[error("etcd {op} failed: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    #[error("cannot reach etcd at {endpoints} within {waited:?} (last error: {last})")]
    Unreachable {
        endpoints: String,
        waited: Duration,
        last: String,
    },
    /// A batch of writes failed together; each write gets this copy of the cause.
    #[error("etcd {op} failed: {reason}")]
    Shared { op: &'static str, reason: String },
    #[error("the committer stopped before the write was answered")]
    Stopped,
}

impl Error {
    pub fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> Error {
        move |source| Error::Etcd { op, source }
    }

    /// The lease named in the request no longer exists (expired or revoked).
    pub fn is_lease_not_found(&self) -> bool {
        matches!(self, Error::Etcd { source, .. } if is_lease_not_found(source))
    }

    /// etcd refused the request as such (too many operations, a key put twice, too large):
    /// nothing of it was applied, and sending it again unchanged fails again.
    pub fn is_malformed_request(&self) -> bool {
        // Not every ResourceExhausted: etcd also says so for "too many requests" and NOSPACE.
        matches!(self, Error::Etcd { source: etcd_client::Error::GRpcStatus(s), .. }
            if s.code() == tonic::Code::InvalidArgument
                || (s.code() == tonic::Code::ResourceExhausted
                    && s.message().contains("larger than max")))
    }

    /// The same failure, for one more waiter: timeouts stay timeouts (the write may have
    /// committed), anything else keeps its message.
    pub fn shared(&self, reason: &str) -> Error {
        match self {
            Error::Timeout { op, timeout } => Error::Timeout {
                op,
                timeout: *timeout,
            },
            Error::Etcd { op, .. } | Error::Shared { op, .. } => Error::Shared {
                op,
                reason: reason.to_string(),
            },
            Error::Stopped => Error::Stopped,
            _ => Error::Shared {
                op: "batch",
                reason: reason.to_string(),
            },
        }
    }
}

/// etcd answered that the lease does not exist (expired or revoked).
pub fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::LeaseKeepAliveError(m) => m.contains("lease not found"),
        etcd_client::Error::GRpcStatus(s) => s.message().contains("requested lease not found"),
        _ => false,
    }
}

/// etcd's election service answered that nobody holds the election.
pub fn is_no_leader(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("election: no leader"))
}

/// How to reach etcd.
#[derive(Clone)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    /// Bound on every single (non-streaming) call.
    pub request_timeout: Duration,
    /// Bound on opening one TCP connection.
    pub connect_timeout: Duration,
    /// TLS to etcd (endpoints without a scheme then use https).
    pub tls: Option<etcd_client::TlsOptions>,
    /// etcd user and password; etcd-client renews the auth token when etcd expires it.
    pub user: Option<(String, String)>,
    /// Test hook: where lease keepalives go instead of `endpoints` (so a test can cut every
    /// other connection off while keepalives still pass).
    pub keepalive_endpoints: Option<Vec<String>>,
}

/// Never shows the password.
impl std::fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("tls", &self.tls.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            request_timeout: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(2),
            tls: None,
            user: None,
            keepalive_endpoints: None,
        }
    }

    fn options(&self) -> ConnectOptions {
        // HTTP/2 pings every 10 s: etcd closes connections that ping more often than every 5 s,
        // and a dead connection under a long watch or campaign must still be noticed.
        // Requests to a member cut off from its cluster's leader fail fast instead of waiting.
        let mut o = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(3))
            .with_require_leader(true);
        if let Some(tls) = &self.tls {
            o = o.with_tls(tls.clone());
        }
        if let Some((user, password)) = &self.user {
            o = o.with_user(user, password).with_auto_token_refresh(true);
        }
        o
    }
}

/// A cheap-to-clone handle on etcd.
#[derive(Clone)]
pub struct Store {
    config: Arc<EtcdConfig>,
    client: Client,
}

impl Store {
    /// Builds the client. Connections are opened lazily: use [`Store::wait_reachable`] to know
    /// whether etcd answers.
    pub async fn connect(config: EtcdConfig) -> Result<Store, Error> {
        let client = Self::fresh_client(&config).await?;
        Ok(Store {
            config: Arc::new(config),
            client,
        })
    }

    /// A client on new connections, sharing nothing with the others. Used after a timeout,
    /// because a blackholed connection looks open forever.
    pub async fn fresh_client(config: &EtcdConfig) -> Result<Client, Error> {
        let connect = Client::connect(&config.endpoints, Some(config.options()));
        match tokio::time::timeout(config.connect_timeout, connect).await {
            Ok(r) => r.map_err(|source| match (&config.user, &source) {
                (Some((user, _)), etcd_client::Error::GRpcStatus(s))
                    if s.code() == tonic::Code::InvalidArgument
                        || s.message().contains("authentication failed") =>
                {
                    Error::Auth {
                        user: user.clone(),
                        reason: s.message().to_string(),
                    }
                }
                _ => Error::Endpoints {
                    endpoints: config.endpoints.join(","),
                    source,
                },
            }),
            Err(_) => Err(Error::Timeout {
                op: "connect",
                timeout: config.connect_timeout,
            }),
        }
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// The shared client, without a per-request timeout.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Runs one etcd call under the request timeout.
    pub async fn timed<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, Error> {
        let timeout = self.config.request_timeout;
        let started = std::time::Instant::now();
        let r = tokio::time::timeout(timeout, call).await;
        crate::metrics::get().etcd_request(op, started.elapsed());
        match r {
            Ok(r) => r.map_err(Error::etcd(op)),
            Err(_) => Err(Error::Timeout { op, timeout }),
        }
    }

    /// Waits until etcd serves a linearizable read (so it has quorum), or gives up after `wait`.
    pub async fn wait_reachable(&self, probe_key: &str, wait: Duration) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut last;
        loop {
            let mut c = self.client();
            let probe = c.get(probe_key, Some(GetOptions::new().with_count_only()));
            match self.timed("get", probe).await {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
            if tokio::time::Instant::now() + Duration::from_millis(200) >= deadline {
                return Err(Error::Unreachable {
                    endpoints: self.config.endpoints.join(","),
                    waited: wait,
                    last,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
