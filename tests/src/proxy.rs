//! A TCP proxy that can cut the network: while cut, every connection through
//! it stops forwarding in both directions (bytes wait, nothing is closed),
//! and new connections are accepted but not forwarded, as a partition looks
//! to the peers; when the cut heals, what waited flows on. Peers notice only
//! through their own timeouts and keepalives.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy to one upstream address.
pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    _rt: tokio::runtime::Runtime,
}

impl Proxy {
    /// Forwards a free loopback port to `upstream`.
    pub fn start(upstream: SocketAddr) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = Arc::clone(&cut);
        rt.spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let c = Arc::clone(&c);
                tokio::spawn(async move {
                    wait_healed(&c).await;
                    let Ok(up) = TcpStream::connect(upstream).await else { return };
                    let _ = (down.set_nodelay(true), up.set_nodelay(true));
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pump(dr, uw, Arc::clone(&c)), pump(ur, dw, c));
                });
            }
        });
        Self { port, cut, _rt: rt }
    }

    /// Cuts (true) or heals (false) every connection through the proxy.
    pub fn set_cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
    }
}

async fn wait_healed(cut: &AtomicBool) {
    while cut.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Copies one direction, holding every read while the network is cut.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, cut: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 256 << 10];
    loop {
        wait_healed(&cut).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        wait_healed(&cut).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
