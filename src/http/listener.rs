//! Connections of the HTTP listener, plain or TLS, and what each tells the request about its
//! peer.

use std::net::SocketAddr;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;

use crate::security::common_name;

/// What the request handlers know of a connection.
#[derive(Clone, Debug, Default)]
pub struct Peer {
    pub addr: Option<SocketAddr>,
    /// The CN of the client certificate the TLS layer verified (mTLS).
    pub cn: Option<String>,
}

/// Plain TCP connections, with Nagle's algorithm off so a small event is not held back.
pub struct PlainListener(pub TcpListener);

impl Listener for PlainListener {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (tcp, addr) = Listener::accept(&mut self.0).await;
        let _ = tcp.set_nodelay(true);
        (tcp, addr)
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

impl Connected<IncomingStream<'_, PlainListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, PlainListener>) -> Self {
        Peer {
            addr: Some(*stream.remote_addr()),
            cn: None,
        }
    }
}

/// TLS connections whose handshakes [`crate::security::incoming_http`] completed.
pub struct TlsListener {
    pub streams: mpsc::Receiver<Result<TlsStream<TcpStream>, std::io::Error>>,
    pub local: SocketAddr,
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.streams.recv().await {
                Some(Ok(s)) => {
                    if let Ok(addr) = s.get_ref().0.peer_addr() {
                        return (s, addr);
                    }
                }
                Some(Err(_)) => {}
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        let cn = stream
            .io()
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first().and_then(|c| common_name(c)));
        Peer {
            addr: Some(*stream.remote_addr()),
            cn,
        }
    }
}
