//! TLS for the gRPC listeners (certificates re-read when their files change) and for the
//! clients that call them (the CLI, coordinators reading a worker's logs).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;

use super::files::Watched;

/// A client that opens a connection and never finishes the handshake holds nothing longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The files a TLS listener serves from.
#[derive(Clone, Debug)]
pub struct ServerTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Verify client certificates against this CA (mTLS).
    pub client_ca: Option<PathBuf>,
    /// Let clients without a certificate finish the handshake (they must then send a token).
    pub client_cert_optional: bool,
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// Builds a server configuration from the files as they are now.
pub fn server_config(files: &ServerTlsFiles) -> Result<ServerConfig, String> {
    let provider = Arc::new(ring::default_provider());
    let chain = certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&read(&files.key)?)
        .map_err(|e| format!("{}: {e}", files.key.display()))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca)? {
                roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let mut v = WebPkiClientVerifier::builder_with_provider(roots.into(), provider);
            if files.client_cert_optional {
                v = v.allow_unauthenticated();
            }
            builder.with_client_cert_verifier(v.build().map_err(|e| e.to_string())?)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| format!("{} and {}: {e}", files.cert.display(), files.key.display()))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// The configuration, re-read when any of its files changes.
pub fn watched_server_config(files: ServerTlsFiles) -> Result<Watched<ServerConfig>, String> {
    let mut paths = vec![files.cert.clone(), files.key.clone()];
    paths.extend(files.client_ca.clone());
    Watched::load("TLS certificate", paths, move || server_config(&files))
}

/// Accepts TCP connections and completes TLS handshakes (each with the configuration current
/// when it arrived), yielding the streams tonic serves. A failed handshake closes only its
/// own connection.
pub fn incoming(
    listener: TcpListener,
    config: Watched<ServerConfig>,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    accept(listener, config, false)
}

/// [`incoming`] for the HTTP listener: browsers and curl may speak HTTP/1.1 as well as h2.
pub fn incoming_http(
    listener: TcpListener,
    config: Watched<ServerConfig>,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    accept(listener, config, true)
}

fn accept(
    listener: TcpListener,
    config: Watched<ServerConfig>,
    http1: bool,
) -> ReceiverStream<Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = if http1 {
                let mut c = ServerConfig::clone(&config.get());
                c.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                TlsAcceptor::from(Arc::new(c))
            } else {
                TlsAcceptor::from(config.get())
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// The subject CN of a DER certificate.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

/// What a client needs to call a TLS listener: the CA that signed it, and optionally a
/// certificate of its own (mTLS).
#[derive(Clone, Debug, Default)]
pub struct ClientTlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl ClientTlsFiles {
    /// `None` when no CA is given: the peer is called over plain HTTP/2.
    pub fn config(&self) -> Result<Option<tonic::transport::ClientTlsConfig>, String> {
        let Some(ca) = &self.ca else {
            if self.cert.is_some() || self.key.is_some() {
                return Err("a client certificate needs the CA of the server too (--ca)".into());
            }
            return Ok(None);
        };
        let mut c = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                c = c.identity(tonic::transport::Identity::from_pem(
                    read(cert)?,
                    read(key)?,
                ));
            }
            (None, None) => {}
            _ => return Err("a client certificate needs both the certificate and its key".into()),
        }
        Ok(Some(c))
    }
}
