//! `dflash bench-transport`: the hidden-state gRPC stream (the real
//! drafter receiver: reassembly, CRC32C, queue, acknowledgements, credits)
//! against raw TCP moving the same bytes on the same host.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto as pb;
use dflash_role::Stop;
use dflash_wire::rpc::{HiddenStateService, open_hidden_state_stream, transport};
use dflash_wire::{BatchMeta, DType, FeatureSpec, HostBatch, Layout, batch_messages};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use dflash_drafter::receiver::{DrafterService, Expected, Landing};

#[derive(clap::Args, Debug)]
pub struct BenchTransportArgs {
    /// Bytes to move per measurement (MiB).
    #[arg(long, default_value_t = 4096)]
    pub total_mib: usize,
    /// Payload of one batch (MiB).
    #[arg(long, default_value_t = 256)]
    pub batch_mib: usize,
    /// Chunk size on the stream (MiB).
    #[arg(long, default_value_t = 4)]
    pub chunk_mib: usize,
    /// Unacknowledged batches in flight per stream.
    #[arg(long, default_value_t = 2)]
    pub credits: u32,
    /// Comma-separated numbers of parallel streams (connections) to measure.
    #[arg(long, default_value = "1,2,4")]
    pub streams: String,
    /// Receive as a drafter on this device: "cpu" (pooled host buffers, the
    /// CPU drafter's path) or a GPU index (pooled pinned landing buffers,
    /// the GPU drafter's path).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    streams: usize,
    grpc_gbps: f64,
    tcp_gbps: f64,
    ratio: f64,
}

/// Tokens of a batch whose payload is `bytes` (one bf16 layer of `hidden`).
fn tokens_of(bytes: usize, hidden: u32) -> usize {
    bytes / (hidden as usize * 2)
}

/// The benchmark run's lease key (the receiver checks every batch's token).
const BENCH_KEY: [u8; 32] = [3; 32];

/// Stream `s`'s `i`-th batch id.
fn batch_id(s: usize, i: usize) -> u64 {
    (s * 1_000_000 + i) as u64
}

fn batch(id: u64, target: &str, payload: &Bytes, hidden: u32) -> anyhow::Result<HostBatch> {
    // Sized so that T * 1 * hidden * 2 bytes = payload.len().
    let t = tokens_of(payload.len(), hidden);
    let meta = BatchMeta {
        batch_id: id,
        epoch: 0,
        target_instance: target.into(),
        layout: Layout::Split,
        dtype: DType::Bf16,
        seq_lengths: vec![t as u32],
        input_ids: vec![1; t],
        loss_mask: vec![1; t],
        layer_ids: vec![0],
        hidden_size: hidden,
        sample_ids: vec![id],
        target_top_k: 0,
        trace_context: Default::default(),
        lease_token: dflash_proto::lease_token::lease_token(&BENCH_KEY, "bench", id, target),
    };
    Ok(HostBatch::new(meta, payload.clone())?)
}

/// Sends `batches` batches over `streams` parallel streams to the real
/// drafter receiver; returns GB/s of payload acknowledged.
async fn grpc(
    a: &BenchTransportArgs,
    landing: Landing,
    payload: Bytes,
    hidden: u32,
    batches: usize,
    streams: usize,
) -> anyhow::Result<f64> {
    let stop = Stop::new();
    let (queue, rx) = flume::bounded(8);
    let consumer = std::thread::spawn(move || rx.iter().count());
    // The plan every received batch is checked against, as in a run.
    let t = tokens_of(payload.len(), hidden) as u32;
    let share = |s: usize| batches / streams + usize::from(s < batches % streams);
    let plan: dflash_drafter::receiver::Plan = (0..streams)
        .flat_map(|s| (0..share(s)).map(move |i| batch_id(s, i)))
        .map(|id| (id, dflash_drafter::receiver::Planned { epoch: 0, sample_ids: vec![id], sample_lengths: vec![t] }))
        .collect();
    let service = DrafterService {
        landing,
        run_id: "bench".into(),
        instance_id: "bench-drafter".into(),
        credits: a.credits,
        expected: Expected {
            spec: FeatureSpec {
                dtype: DType::Bf16,
                layout: Layout::Split,
                layer_ids: vec![0],
                noise_std: 0.0,
                target_top_k: 0,
            },
            hidden_size: hidden,
            vocab_size: 2,
            plan: std::sync::Arc::new(plan),
            run_id: "bench".into(),
            lease_key: BENCH_KEY.as_slice().into(),
        },
        max_payload_bytes: payload.len(),
        queue,
        stop: stop.clone(),
        hello_timeout: Duration::from_secs(10),
        stall_timeout: Duration::from_secs(30),
        streams: std::sync::Arc::new(tokio::sync::Semaphore::new(streams)),
        max_streams: streams,
        stages: dflash_role::Stages::new(stop.clone()),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server_stop = stop.clone();
    let server = tokio::spawn(
        transport::data_server()
            .add_service(HiddenStateService::new(service))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
                server_stop.stopped().await
            }),
    );
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..streams {
        let share = share(s);
        let (payload, credits, chunk) = (payload.clone(), a.credits, a.chunk_mib << 20);
        let url = format!("http://{addr}");
        tasks.push(tokio::spawn(async move {
            let channel = transport::data_endpoint(&url).map_err(anyhow::Error::msg)?.connect().await?;
            let (tx, rx) = mpsc::channel(16);
            tx.send(pb::TargetMessage {
                msg: Some(pb::target_message::Msg::Hello(pb::StreamHello {
                    protocol_version: dflash_proto::PROTOCOL_VERSION,
                    run_id: "bench".into(),
                    target_instance: format!("bench-{s}"),
                })),
            })
            .await?;
            let mut acks =
                open_hidden_state_stream(channel, Ok::<tonic::Request<()>, tonic::Status>, rx).await?.into_inner();
            let _welcome = acks.message().await?;
            let (mut in_flight, mut acked) = (0u32, 0usize);
            for i in 0..share {
                while in_flight >= credits {
                    acks.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended"))?;
                    in_flight -= 1;
                    acked += 1;
                }
                for m in batch_messages(&batch(batch_id(s, i), &format!("bench-{s}"), &payload, hidden)?, chunk) {
                    tx.send(m).await?;
                }
                in_flight += 1;
            }
            while acked < share {
                acks.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended"))?;
                acked += 1;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = t0.elapsed().as_secs_f64();
    stop.stop(dflash_role::StopCause::RunCompleted);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let received = consumer.join().map_err(|_| anyhow::anyhow!("consumer panicked"))?;
    anyhow::ensure!(received == batches, "drafter queued {received} of {batches} batches");
    Ok((batches * payload.len()) as f64 / secs / 1e9)
}

/// The same bytes over `streams` plain TCP connections.
async fn raw_tcp(payload: Bytes, batches: usize, streams: usize) -> anyhow::Result<f64> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let shares: Vec<usize> = (0..streams).map(|s| batches / streams + usize::from(s < batches % streams)).collect();
    let len = payload.len();
    let reader = tokio::spawn(async move {
        let mut readers = Vec::new();
        for _ in 0..streams {
            let (mut sock, _) = listener.accept().await?;
            sock.set_nodelay(true)?;
            readers.push(tokio::spawn(async move {
                let mut len_buf = [0u8; 8];
                sock.read_exact(&mut len_buf).await?;
                let total = u64::from_le_bytes(len_buf) as usize;
                let mut buf = vec![0u8; 4 << 20];
                let mut got = 0usize;
                while got < total {
                    let n = sock.read(&mut buf).await?;
                    anyhow::ensure!(n > 0, "raw TCP closed early");
                    got += n;
                }
                sock.write_all(b"k").await?;
                Ok::<_, anyhow::Error>(())
            }));
        }
        for r in readers {
            r.await??;
        }
        Ok::<_, anyhow::Error>(())
    });
    let t0 = Instant::now();
    let mut writers = Vec::new();
    for share in shares {
        let payload = payload.clone();
        writers.push(tokio::spawn(async move {
            let mut sock = tokio::net::TcpStream::connect(addr).await?;
            sock.set_nodelay(true)?;
            sock.write_all(&((share * len) as u64).to_le_bytes()).await?;
            for _ in 0..share {
                sock.write_all(&payload).await?;
            }
            let mut k = [0u8; 1];
            sock.read_exact(&mut k).await?;
            Ok::<_, anyhow::Error>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    let secs = t0.elapsed().as_secs_f64();
    reader.await??;
    Ok((batches * len) as f64 / secs / 1e9)
}

pub fn run(a: &BenchTransportArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let hidden = 4096u32;
    let row = hidden as usize * 2;
    let bytes = (a.batch_mib << 20) / row * row;
    let payload: Bytes = (0..bytes).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>().into();
    let batches = ((a.total_mib << 20) / bytes).max(1);
    println!(
        "bench-transport: {batches} batches of {} MiB, {} MiB chunks, {} credits, loopback",
        bytes >> 20,
        a.chunk_mib,
        a.credits
    );
    let counts: Vec<usize> = a
        .streams
        .split(',')
        .map(|x| x.trim().parse::<usize>().map(|n| n.max(1)))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("--streams: comma-separated integers"))?;
    let most = counts.iter().copied().max().unwrap_or(1);
    // As the drafter sizes it: every stream's credits plus room.
    let count = most * a.credits as usize + 4;
    let landing = match a.device.as_str() {
        "cpu" => Landing::host(count),
        i => {
            let ordinal: usize = i.parse().map_err(|_| anyhow::anyhow!("--device: cpu or a GPU index"))?;
            let ctx = dflash_models::gpu::context(ordinal)?;
            // As a GPU drafter (and the targets feeding it) would run.
            Landing::Pinned(dflash_models::gpu::pinned_pool(&ctx, count, bytes)?)
        }
    };
    println!("landing: {landing}");
    let rows = rt.block_on(async {
        // Warm both paths once, then measure.
        grpc(a, landing.clone(), payload.clone(), hidden, 2, 1).await?;
        raw_tcp(payload.clone(), 2, 1).await?;
        let mut rows = Vec::new();
        for &n in &counts {
            let g = grpc(a, landing.clone(), payload.clone(), hidden, batches.max(n), n).await?;
            let t = raw_tcp(payload.clone(), batches.max(n), n).await?;
            rows.push(Row { streams: n, grpc_gbps: g, tcp_gbps: t, ratio: g / t });
        }
        Ok::<_, anyhow::Error>(rows)
    })?;
    println!("{:>8} {:>10} {:>10} {:>8}", "streams", "gRPC GB/s", "TCP GB/s", "ratio");
    for r in &rows {
        println!("{:>8} {:>10.2} {:>10.2} {:>8.2}", r.streams, r.grpc_gbps, r.tcp_gbps, r.ratio);
    }
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "transport",
            "batch_bytes": bytes,
            "batches": batches,
            "chunk_mib": a.chunk_mib,
            "credits_per_stream": a.credits,
            "landing": landing.to_string(),
            "rows": rows,
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
