//! Where a leader's process listens, as the one socket address a follower dials: evidence of a
//! refused connection means something only for that exact socket, so an advertise address that
//! is unspecified or names several addresses gives no target at all.

use std::net::SocketAddr;

/// A leader's advertise address, resolved once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The host as advertised: what a TLS certificate is verified for.
    pub host: String,
    pub addr: SocketAddr,
}

#[derive(Debug, thiserror::Error)]
pub enum NotSpecific {
    #[error("advertise address {0:?} is not host:port")]
    Malformed(String),
    #[error("advertise address {0} is unspecified (0.0.0.0 or ::)")]
    Unspecified(String),
    #[error("advertise address {0} resolves to {1} addresses")]
    Several(String, usize),
    #[error("advertise address {0} does not resolve: {1}")]
    Unresolved(String, String),
}

impl NotSpecific {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            NotSpecific::Malformed(_) => "advertise_malformed",
            NotSpecific::Unspecified(_) => "advertise_unspecified",
            NotSpecific::Several(..) => "advertise_several_addresses",
            NotSpecific::Unresolved(..) => "advertise_unresolved",
        }
    }
}

/// `host:port`, `[v6]:port` or a URI with them.
fn split(advertise: &str) -> Option<(String, u16)> {
    let rest = advertise
        .split_once("://")
        .map_or(advertise, |(_, r)| r)
        .trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains('/') {
        return None;
    }
    Some((host.to_string(), port.parse().ok()?))
}

/// Resolves `advertise` once, to exactly one specified address.
pub async fn resolve(advertise: &str) -> Result<Target, NotSpecific> {
    let (host, port) = split(advertise).ok_or_else(|| NotSpecific::Malformed(advertise.into()))?;
    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|e| NotSpecific::Unresolved(advertise.into(), e.to_string()))?
        .collect();
    addrs.sort();
    addrs.dedup();
    match addrs.as_slice() {
        [a] if a.ip().is_unspecified() => Err(NotSpecific::Unspecified(advertise.into())),
        [a] => Ok(Target { host, addr: *a }),
        _ => Err(NotSpecific::Several(advertise.into(), addrs.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_one_specified_address_is_a_target() {
        let t = resolve("127.0.0.1:7000").await.unwrap();
        assert_eq!(t.addr, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(t.host, "127.0.0.1");
        let t = resolve("https://[::1]:7000/").await.unwrap();
        assert_eq!(t.addr, "[::1]:7000".parse().unwrap());
        assert!(matches!(
            resolve("0.0.0.0:7000").await,
            Err(NotSpecific::Unspecified(_))
        ));
        assert!(matches!(
            resolve("[::]:7000").await,
            Err(NotSpecific::Unspecified(_))
        ));
        for bad in ["7000", "host:", ":7000", "a/b:70"] {
            assert!(
                matches!(resolve(bad).await, Err(NotSpecific::Malformed(_))),
                "{bad}"
            );
        }
    }
}
