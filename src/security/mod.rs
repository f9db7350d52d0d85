//! Who may call what: TLS on the listeners (certificates re-read when they change), bearer
//! tokens and client certificates mapped to roles, the gRPC layer that enforces them before
//! any handler runs, and the client side that presents them.

mod client;
mod files;
mod layer;
pub mod operations;
mod roles;
mod tls;
mod tokens;

pub use client::{AuthChannel, Bearer, ClientSecurity};
pub use files::Watched;
pub use layer::{AuthLayer, Policy};
pub use roles::{caller_name, required, Caller, Role};
pub use tls::{
    common_name, incoming, incoming_http, server_config, watched_server_config, ClientTlsFiles,
    ServerTlsFiles,
};
pub use tokens::{digest, TokenTable, MIN_TOKEN_LEN};

use std::collections::HashMap;

use tokio_rustls::rustls::ServerConfig;

use crate::config::SecurityArgs;

/// A listener's security, loaded from its flags.
#[derive(Clone, Default)]
pub struct Security {
    pub tls: Option<Watched<ServerConfig>>,
    pub policy: Policy,
    /// How this process calls workers (coordinators reading logs).
    pub peer: ClientSecurity,
}

impl Security {
    /// Reads every file now, so a wrong path or a bad certificate stops the start with its
    /// reason. Must run inside the runtime (the files are watched from a task).
    pub fn load(args: &SecurityArgs) -> Result<Security, String> {
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(watched_server_config(ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.tls_client_ca.clone(),
                client_cert_optional: args.auth_tokens_file.is_some(),
            })?),
            (None, None) => None,
            _ => return Err("--tls-cert and --tls-key go together".into()),
        };
        let tokens = match &args.auth_tokens_file {
            Some(path) => {
                let p = path.clone();
                let w = Watched::load("tokens file", vec![path.clone()], move || {
                    TokenTable::read(&p)
                })?;
                if w.get().is_empty() {
                    tracing::warn!(file = %path.display(), "the tokens file has no tokens: every call that needs a role is refused");
                }
                Some(w)
            }
            None => None,
        };
        let mut cert_roles = HashMap::new();
        for pair in &args.tls_client_roles {
            let (cn, role) = pair
                .split_once('=')
                .ok_or_else(|| format!("--tls-client-roles {pair:?}: expected CN=role"))?;
            let role: Role = role
                .parse()
                .map_err(|e| format!("--tls-client-roles {pair:?}: {e}"))?;
            cert_roles.insert(cn.to_string(), role);
        }
        let peer_files = ClientTlsFiles {
            ca: args.peer_ca.clone(),
            cert: args.peer_ca.as_ref().and(args.tls_cert.clone()),
            key: args.peer_ca.as_ref().and(args.tls_key.clone()),
        };
        let peer = ClientSecurity {
            tls: peer_files.config()?,
            bearer: match &args.peer_token_file {
                Some(p) => Bearer::from_file(p)?,
                None => Bearer::default(),
            },
        };
        Ok(Security {
            tls,
            policy: Policy {
                tokens,
                cert_roles,
                mtls: args.tls_client_ca.is_some(),
            },
            peer,
        })
    }
}
