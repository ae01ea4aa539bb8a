//! `dflash-drafter bench-transport`: the hidden-state gRPC stream (the real
//! drafter receiver: reassembly, CRC32C, queue, acknowledgements, credits)
//! against raw TCP moving the same bytes on the same host.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_proto as pb;
use dflash_proto::drafter_client::DrafterClient;
use dflash_proto::drafter_server::DrafterServer;
use dflash_role::{Stop, transport};
use dflash_wire::{BatchMeta, DType, HostBatch, Layout, batch_messages};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::receiver::{DrafterService, Expected};

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
    /// Unacknowledged batches in flight.
    #[arg(long, default_value_t = 4)]
    pub credits: u32,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Result {
    grpc_gbps: f64,
    tcp_gbps: f64,
    ratio: f64,
}

fn batch(id: u64, payload: &Bytes, hidden: u32) -> anyhow::Result<HostBatch> {
    // Sized so that T * 1 * hidden * 2 bytes = payload.len().
    let t = payload.len() / (hidden as usize * 2);
    let meta = BatchMeta {
        batch_id: id,
        epoch: 0,
        target_instance: "bench".into(),
        layout: Layout::Split,
        dtype: DType::Bf16,
        seq_lengths: vec![t as u32],
        input_ids: vec![1; t],
        loss_mask: vec![1; t],
        layer_ids: vec![0],
        hidden_size: hidden,
        sample_ids: vec![id],
        trace_context: Default::default(),
    };
    Ok(HostBatch::new(meta, payload.clone())?)
}

async fn grpc(a: &BenchTransportArgs, payload: Bytes, hidden: u32, batches: usize) -> anyhow::Result<f64> {
    let stop = Stop::new();
    let (queue, rx) = flume::bounded(8);
    let consumer = std::thread::spawn(move || rx.iter().count());
    let service = DrafterService {
        landing: None,
        run_id: "bench".into(),
        instance_id: "bench-drafter".into(),
        credits: a.credits,
        expected: Expected { hidden_size: hidden, layer_ids: vec![0] },
        max_payload_bytes: payload.len(),
        queue,
        stop: stop.clone(),
        hello_timeout: Duration::from_secs(10),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server_stop = stop.clone();
    let server = tokio::spawn(
        transport::data_server()
            .add_service(
                DrafterServer::new(service)
                    .max_decoding_message_size(transport::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(transport::MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async move {
                server_stop.stopped().await
            }),
    );
    let channel = transport::data_endpoint(&format!("http://{addr}"))?.connect().await?;
    let mut client = DrafterClient::new(channel)
        .max_decoding_message_size(transport::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(transport::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::TargetMessage {
        msg: Some(pb::target_message::Msg::Hello(pb::StreamHello {
            protocol_version: dflash_proto::PROTOCOL_VERSION,
            run_id: "bench".into(),
            target_instance: "bench".into(),
        })),
    })
    .await?;
    let mut acks = client.stream_hidden_states(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    let _welcome = acks.message().await?;
    let chunk = a.chunk_mib << 20;
    let t0 = Instant::now();
    let mut in_flight = 0u32;
    let mut acked = 0usize;
    for id in 0..batches as u64 {
        while in_flight >= a.credits {
            acks.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended"))?;
            in_flight -= 1;
            acked += 1;
        }
        for m in batch_messages(&batch(id, &payload, hidden)?, chunk) {
            tx.send(m).await?;
        }
        in_flight += 1;
    }
    while acked < batches {
        acks.message().await?.ok_or_else(|| anyhow::anyhow!("stream ended"))?;
        acked += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    drop(tx);
    stop.stop(dflash_role::StopCause::RunCompleted);
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let received = consumer.join().map_err(|_| anyhow::anyhow!("consumer panicked"))?;
    anyhow::ensure!(received == batches, "drafter queued {received} of {batches} batches");
    Ok((batches * payload.len()) as f64 / secs / 1e9)
}

async fn raw_tcp(payload: Bytes, batches: usize) -> anyhow::Result<f64> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let total = batches * payload.len();
    let reader = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        sock.set_nodelay(true)?;
        let mut buf = vec![0u8; 4 << 20];
        let mut got = 0usize;
        while got < total {
            let n = sock.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "raw TCP closed early");
            got += n;
        }
        sock.write_all(b"k").await?;
        Ok::<_, anyhow::Error>(())
    });
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.set_nodelay(true)?;
    let t0 = Instant::now();
    for _ in 0..batches {
        sock.write_all(&payload).await?;
    }
    let mut k = [0u8; 1];
    sock.read_exact(&mut k).await?;
    let secs = t0.elapsed().as_secs_f64();
    reader.await??;
    Ok(total as f64 / secs / 1e9)
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
    let (g, t) = rt.block_on(async {
        // Warm both paths once, then measure.
        grpc(a, payload.clone(), hidden, 2).await?;
        let g = grpc(a, payload.clone(), hidden, batches).await?;
        raw_tcp(payload.clone(), 2).await?;
        let t = raw_tcp(payload.clone(), batches).await?;
        Ok::<_, anyhow::Error>((g, t))
    })?;
    let r = Result { grpc_gbps: g, tcp_gbps: t, ratio: g / t };
    println!("{:<10} {:>8}", "path", "GB/s");
    println!("{:<10} {:>8.2}", "gRPC", r.grpc_gbps);
    println!("{:<10} {:>8.2}", "raw TCP", r.tcp_gbps);
    println!("gRPC / raw TCP = {:.2}", r.ratio);
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "transport",
            "batch_bytes": bytes,
            "batches": batches,
            "chunk_mib": a.chunk_mib,
            "credits": a.credits,
            "result": r,
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
