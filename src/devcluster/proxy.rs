//! A fault-injecting TCP proxy between a replica and etcd, on loopback.
//!
//! Modes: [`Mode::Pass`] forwards bytes; [`Mode::Blackhole`] keeps every connection open and
//! silently drops what flows (a partition as a client sees it: no error, no answer);
//! [`Mode::Reset`] resets every connection and refuses new ones with a reset; [`Mode::Closed`]
//! resets every connection and stops listening, so connecting is refused (`ECONNREFUSED`) as
//! if nothing listened there, until another mode opens the same port again. A connection that
//! lost bytes in a blackhole is reset when the mode changes back, as its stream is corrupt.
//!
//! The proxy runs on its own thread and runtime so the test or drill driving it cannot stall it.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Blackhole,
    Reset,
    Closed,
}

pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    stop: watch::Sender<bool>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub fn start(target: SocketAddr) -> std::io::Result<FaultProxy> {
        let std_listener = super::bind_loopback()?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let (stop, stop_rx) = watch::channel(false);
        std::thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(accept_loop(std_listener, addr, target, mode_rx, stop_rx));
            })?;
        Ok(FaultProxy { addr, mode, stop })
    }

    /// Where clients should connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

async fn accept_loop(
    listener: std::net::TcpListener,
    addr: SocketAddr,
    target: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    mut stop: watch::Receiver<bool>,
) {
    let mut listener = Some(TcpListener::from_std(listener).expect("proxy listener"));
    loop {
        let accept = async {
            match &listener {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.changed() => return,
            changed = mode.changed() => {
                if changed.is_err() { return; }
                let closed = *mode.borrow_and_update() == Mode::Closed;
                if closed {
                    listener = None;
                } else if listener.is_none() {
                    // The same port again; a client may have taken it meanwhile, then retry.
                    while listener.is_none() {
                        listener = TcpListener::bind(addr).await.ok();
                        if listener.is_none() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }
            accepted = accept => {
                let Ok((client, _)) = accepted else { continue };
                let mode = mode.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = connection(client, target, mode) => {}
                        _ = wait_true(stop) => {}
                    }
                });
            }
        }
    }
}

async fn wait_true(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|v| *v).await;
}

fn reset(s: TcpStream) {
    #[allow(deprecated)]
    let _ = s.set_linger(Some(Duration::ZERO));
    drop(s);
}

async fn connection(client: TcpStream, target: SocketAddr, mut mode: watch::Receiver<Mode>) {
    if matches!(*mode.borrow(), Mode::Reset | Mode::Closed) {
        return reset(client);
    }
    let upstream = match TcpStream::connect(target).await {
        Ok(s) => s,
        Err(_) => return reset(client),
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    let mut cbuf = vec![0u8; 64 * 1024];
    let mut ubuf = vec![0u8; 64 * 1024];
    let mut poisoned = false;
    loop {
        tokio::select! {
            changed = mode.changed() => {
                if changed.is_err() { break; }
                let m = *mode.borrow_and_update();
                if matches!(m, Mode::Reset | Mode::Closed) || (m == Mode::Pass && poisoned) { break; }
            }
            n = cr.read(&mut cbuf) => {
                let Ok(n) = n else { break };
                if n == 0 { break; }
                if *mode.borrow() == Mode::Pass {
                    if uw.write_all(&cbuf[..n]).await.is_err() { break; }
                } else {
                    poisoned = true;
                }
            }
            n = ur.read(&mut ubuf) => {
                let Ok(n) = n else { break };
                if n == 0 { break; }
                if *mode.borrow() == Mode::Pass {
                    if cw.write_all(&ubuf[..n]).await.is_err() { break; }
                } else {
                    poisoned = true;
                }
            }
        }
    }
    if let (Ok(c), Ok(u)) = (cr.reunite(cw), ur.reunite(uw)) {
        reset(c);
        reset(u);
    }
}
