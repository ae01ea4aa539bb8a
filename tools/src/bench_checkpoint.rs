//! `dflash bench-checkpoint`: how long a drafter checkpoint pauses training,
//! on random weights of a named target shape: written in the train loop
//! (`checkpoint.async_write = false`: the whole write) against a host
//! snapshot handed to a writer thread (the default: only the snapshot
//! pauses; its pinned host buffers are allocated in the first round and
//! reused after, as in the train loop), and how long that write takes until
//! durable. Prints a table and writes JSON.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use dflash_models::blocks::BlockSettings;
use dflash_models::checkpoint::{CheckpointSnapshot, TrainerState};
use dflash_models::optim::{AdamWSettings, LrSchedule};
use dflash_models::perf::sync_device;
use dflash_models::{Drafter, DrafterConfig, TrainSettings, Trainer};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

#[derive(clap::Args, Debug)]
pub struct BenchCheckpointArgs {
    /// Target shape the drafter matches: qwen3-8b, smollm2-135m or tiny.
    #[arg(long, default_value = "tiny")]
    pub shape: String,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Drafter layers.
    #[arg(long, default_value_t = 5)]
    pub layers: i64,
    /// Checkpoints written per mode.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Where to write them (a fresh folder under it; removed afterwards).
    #[arg(long, default_value = "/tmp")]
    pub dir: PathBuf,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    mode: &'static str,
    round: usize,
    /// Training paused this long.
    pause_s: f64,
    /// Until the checkpoint was durable.
    write_s: f64,
    bytes: u64,
}

pub fn run(a: &BenchCheckpointArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.rounds > 0, "--rounds must be at least 1");
    let shape = crate::cli_args::shape(&a.shape)?;
    let device = crate::cli_args::device(&a.device)?;
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    let layer_ids: Vec<i64> = dflash_config::default_target_layer_ids(shape.num_layers as u32, a.layers as u32)
        .into_iter()
        .map(i64::from)
        .collect();
    let config = DrafterConfig::for_target(&shape, a.layers, 16, 3, layer_ids);
    let embed = Tensor::randn([shape.vocab_size, shape.hidden_size], (kind, device)) * 0.02;
    let head = Tensor::randn([shape.vocab_size, shape.hidden_size], (kind, device)) * 0.02;
    // The optimizer holds its full state from the start (f32 masters and
    // moments), so no step is needed for a checkpoint of full size.
    let settings = TrainSettings {
        blocks: BlockSettings { block_size: 16, mask_token_id: 3, gamma: 7.0, anchors_per_sequence: 512 },
        schedule: LrSchedule::new(1e-3, 1000, 0.04, 0.0),
        adamw: AdamWSettings { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 },
        grad_clip: 1.0,
        max_blocks_per_micro_batch: 4096,
        loss_chunk_blocks: 64,
        attention_chunk_blocks: 64,
        context_pad_multiple: 128,
        seed: 0,
        objective: dflash_models::Objective::CrossEntropy,
        selector_loss_weight: 0.0,
    };
    let trainer = Trainer::new(Drafter::new(config, device, kind), embed, head, settings);
    let params: i64 = trainer.drafter().named_parameters().iter().map(|(_, t)| t.numel() as i64).sum();
    println!(
        "bench-checkpoint: {}-layer drafter for {} ({:.1} M parameters), {kind:?} on {device:?}, into {}",
        a.layers,
        a.shape,
        params as f64 / 1e6,
        a.dir.display()
    );
    let root = a.dir.join(format!("dflash-bench-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let measured = measure(&trainer, &root, a.rounds, device);
    let _ = std::fs::remove_dir_all(&root);
    let rows = measured?;
    println!("{:>26} {:>6} {:>10} {:>10} {:>10}", "mode", "round", "pause s", "write s", "MiB");
    for r in &rows {
        println!(
            "{:>26} {:>6} {:>10.3} {:>10.3} {:>10.0}",
            r.mode,
            r.round,
            r.pause_s,
            r.write_s,
            r.bytes as f64 / 1048576.0
        );
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&rows)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Alternates the two ways of checkpointing `rounds` times each, with one
/// set of host buffers as the train loop keeps (the first snapshot
/// allocates and pins them).
fn measure(trainer: &Trainer, root: &std::path::Path, rounds: usize, device: Device) -> anyhow::Result<Vec<Row>> {
    let state = |step| TrainerState { step, batch_ids: vec![], run_config: String::new(), run_id: "bench".into() };
    let mut rows = Vec::new();
    let mut step = 0;
    let mut buffers = None;
    for round in 1..=rounds {
        // In the train loop: the step waits for the whole write.
        step += 1;
        sync_device(device);
        let t0 = Instant::now();
        let snapshot = CheckpointSnapshot::take_into(trainer, state(step), buffers.take().unwrap_or_default())?;
        let ck = snapshot.save(root, 1)?;
        buffers = Some(snapshot.into_buffers());
        let write_s = t0.elapsed().as_secs_f64();
        let mode = if round == 1 { "in the loop (allocating)" } else { "in the loop" };
        rows.push(Row { mode, round, pause_s: write_s, write_s, bytes: dir_bytes(&ck.dir)? });
        // Snapshot, then a writer thread: the step waits for the snapshot.
        step += 1;
        sync_device(device);
        let t0 = Instant::now();
        let snapshot = CheckpointSnapshot::take_into(trainer, state(step), buffers.take().unwrap_or_default())?;
        let pause_s = t0.elapsed().as_secs_f64();
        let path = root.to_path_buf();
        let (ck, back) = std::thread::spawn(move || (snapshot.save(&path, 1), snapshot.into_buffers()))
            .join()
            .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?;
        let ck = ck?;
        buffers = Some(back);
        let write_s = t0.elapsed().as_secs_f64();
        let mode = "snapshot + writer thread";
        rows.push(Row { mode, round, pause_s, write_s, bytes: dir_bytes(&ck.dir)? });
    }
    Ok(rows)
}

fn dir_bytes(dir: &std::path::Path) -> anyhow::Result<u64> {
    let mut n = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        n += e?.metadata()?.len();
    }
    Ok(n)
}
