//! A TCP proxy that can cut the network: while cut, every connection through
//! it stops forwarding in both directions (bytes wait, nothing is closed),
//! and new connections are accepted but not forwarded, as a partition looks
//! to the peers; when the cut heals, what waited flows on. Peers notice only
//! through their own timeouts and keepalives.
//!
//! It can also stall the replies of the connections open at that moment
//! (`stall_replies`): in the upstream-to-client direction, read as HTTP/2
//! frames, only connection-level frames (stream 0: SETTINGS, PING, GOAWAY)
//! and WINDOW_UPDATEs pass; every stream's frames wait, in order. The
//! server looks alive (keepalive pings are answered) while nothing it
//! says on a stream arrives: a peer whose application is wedged, or a
//! reply path lost in a middlebox. New connections are not stalled.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running proxy to one upstream address.
pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    /// Each open connection's "replies stalled" flag.
    connections: Arc<Mutex<Vec<Weak<AtomicBool>>>>,
    _rt: tokio::runtime::Runtime,
}

impl Proxy {
    /// Forwards a free loopback port to `upstream`.
    pub fn start(upstream: SocketAddr) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<Weak<AtomicBool>>>> = Arc::default();
        let (c, conns) = (Arc::clone(&cut), Arc::clone(&connections));
        rt.spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let c = Arc::clone(&c);
                let stalled = Arc::new(AtomicBool::new(false));
                {
                    let mut list = conns.lock().expect("proxy connections");
                    list.retain(|w| w.strong_count() > 0);
                    list.push(Arc::downgrade(&stalled));
                }
                tokio::spawn(async move {
                    wait_healed(&c).await;
                    let Ok(up) = TcpStream::connect(upstream).await else { return };
                    let _ = (down.set_nodelay(true), up.set_nodelay(true));
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pump(dr, uw, Arc::clone(&c)), pump_replies(ur, dw, c, stalled));
                });
            }
        });
        Self { port, cut, connections, _rt: rt }
    }

    /// Stalls the stream frames of the replies on every connection open
    /// now (see the module's doc), until [`Proxy::release_replies`].
    pub fn stall_replies(&self) {
        self.set_stalled(true);
    }

    /// Lets the stalled replies flow on, in order.
    pub fn release_replies(&self) {
        self.set_stalled(false);
    }

    fn set_stalled(&self, on: bool) {
        for flag in self.connections.lock().expect("proxy connections").iter().filter_map(Weak::upgrade) {
            flag.store(on, Ordering::SeqCst);
        }
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

/// The upstream-to-client direction: copies as [`pump`] does, tracking
/// HTTP/2 frame boundaries from the connection's first byte. While
/// `stalled`, a frame of a stream (stream id != 0, not a WINDOW_UPDATE)
/// whose header arrives is held, in order with those held before it;
/// connection-level frames pass. Without a stall bytes are never delayed
/// (traffic that is not HTTP/2 passes untouched).
async fn pump_replies(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
    stalled: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 256 << 10];
    let mut frames = FrameSplitter::default();
    loop {
        wait_healed(&cut).await;
        let stall = stalled.load(Ordering::SeqCst);
        if !stall && !frames.held.is_empty() {
            let held = std::mem::take(&mut frames.held);
            if to.write_all(&held).await.is_err() {
                break;
            }
        }
        // A bounded read, so that a release is noticed without new bytes.
        let n = match tokio::time::timeout(Duration::from_millis(50), from.read(&mut buf)).await {
            Err(_) => continue,
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => n,
        };
        let pass = frames.split(&buf[..n], stall);
        wait_healed(&cut).await;
        if !pass.is_empty() && to.write_all(&pass).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Where the reader is in the HTTP/2 frame sequence, and what it holds.
#[derive(Default)]
struct FrameSplitter {
    /// Header bytes of the next frame, while a stall makes them wait.
    header: Vec<u8>,
    /// Header bytes of the next frame already passed on (no stall then).
    header_passed: usize,
    /// Payload bytes of the current frame still to come, and whether
    /// they pass (else they are held).
    remaining: usize,
    passing: bool,
    held: Vec<u8>,
}

impl FrameSplitter {
    const HEADER: usize = 9;
    const WINDOW_UPDATE: u8 = 0x8;

    /// The bytes of `input` to pass on now; held ones go to `self.held`.
    fn split(&mut self, mut input: &[u8], stall: bool) -> Vec<u8> {
        let mut pass = Vec::with_capacity(input.len());
        while !input.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(input.len());
                let out = if self.passing { &mut pass } else { &mut self.held };
                out.extend_from_slice(&input[..n]);
                (self.remaining, input) = (self.remaining - n, &input[n..]);
                continue;
            }
            // A frame header: 3 bytes length, type, flags, 4 bytes stream.
            // `header` keeps its bytes to read the fields; they pass at once
            // when no stall holds them (or the header had begun to pass).
            let n = (Self::HEADER - self.header.len()).min(input.len());
            if self.header_passed > 0 || (!stall && self.header.is_empty()) {
                pass.extend_from_slice(&input[..n]);
                self.header_passed += n;
            }
            self.header.extend_from_slice(&input[..n]);
            input = &input[n..];
            if self.header.len() < Self::HEADER {
                continue;
            }
            let h = std::mem::take(&mut self.header);
            let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let stream_frame = stream != 0 && h[3] != Self::WINDOW_UPDATE;
            self.passing = self.header_passed > 0 || {
                let keep = !((stall || !self.held.is_empty()) && stream_frame);
                let out = if keep { &mut pass } else { &mut self.held };
                out.extend_from_slice(&h);
                keep
            };
            (self.header_passed, self.remaining) = (0, len);
        }
        pass
    }
}

#[cfg(test)]
mod tests {
    use super::FrameSplitter;

    fn frame(ty: u8, stream: u32, len: usize, fill: u8) -> Vec<u8> {
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, 0];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend(std::iter::repeat_n(fill, len));
        f
    }

    #[test]
    fn a_stall_holds_stream_frames_in_order_and_passes_connection_frames() {
        let settings = frame(0x4, 0, 6, 1);
        let data = frame(0x0, 1, 300, 2);
        let ping = frame(0x6, 0, 8, 3);
        let window = frame(0x8, 1, 4, 4);
        let headers = frame(0x1, 1, 0, 5);
        let all = [settings.clone(), data.clone(), ping.clone(), window.clone(), headers.clone()].concat();
        // Every chunking of the bytes: 1, 2, 7, 9, 100 bytes a read.
        for chunk in [1usize, 2, 7, 9, 100, all.len()] {
            let (mut stalled, mut free) = (FrameSplitter::default(), FrameSplitter::default());
            let (mut passed, mut flowed) = (Vec::new(), Vec::new());
            for c in all.chunks(chunk) {
                passed.extend(stalled.split(c, true));
                flowed.extend(free.split(c, false));
            }
            assert_eq!(flowed, all, "without a stall every byte passes as it came (chunks of {chunk})");
            assert!(free.held.is_empty());
            assert_eq!(passed, [settings.clone(), ping.clone(), window.clone()].concat(), "chunks of {chunk}");
            assert_eq!(stalled.held, [data.clone(), headers.clone()].concat(), "chunks of {chunk}");
        }
    }
}
