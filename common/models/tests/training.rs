//! The training step against references: chunked block attention and a
//! padded context compute exactly what one dense mask computes, micro-batching accumulates the
//! same gradient as one forward, and a fixed batch is learned (loss falls).

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use dflash_models::blocks::BlockSettings;
use dflash_models::optim::{AdamWSettings, LrSchedule};
use dflash_models::synthetic::synthetic_target_config;
use dflash_models::{DeviceBatch, Drafter, DrafterConfig, StepOutcome, TrainSettings, Trainer};
use tch::{Device, Kind, Tensor};

fn settings(chunk: usize, micro: usize) -> TrainSettings {
    TrainSettings {
        blocks: BlockSettings { block_size: 4, mask_token_id: 3, gamma: 4.0, anchors_per_sequence: 6 },
        schedule: LrSchedule::new(1e-2, 100, 0.0, 0.0),
        adamw: AdamWSettings { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        grad_clip: 0.0,
        max_blocks_per_micro_batch: micro,
        loss_chunk_blocks: 3,
        attention_chunk_blocks: chunk,
        context_pad_multiple: 1,
        seed: 5,
        objective: dflash_models::Objective::CrossEntropy,
        selector_loss_weight: 0.0,
    }
}

fn trainer(chunk: usize, micro: usize) -> Trainer {
    let tc = synthetic_target_config(2);
    tch::manual_seed(11);
    let dc = DrafterConfig::for_target(&tc, 1, 4, 3, vec![0, 1]);
    let drafter = Drafter::new(dc, Device::Cpu, Kind::Double);
    let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Double, Device::Cpu));
    let head = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Double, Device::Cpu)) * 0.1;
    Trainer::new(drafter, embed, head, settings(chunk, micro))
}

fn batch() -> DeviceBatch {
    let lens = [23u32, 17, 30];
    let t: usize = lens.iter().map(|&l| l as usize).sum();
    tch::manual_seed(3);
    DeviceBatch {
        batch_id: 9,
        features: Tensor::randn([t as i64, 2 * 64], (Kind::Double, Device::Cpu)),
        input_ids: (0..t as u32).map(|i| 20 + (i * 7) % 200).collect(),
        loss_mask: (0..t).map(|i| u8::from(i % 5 != 0)).collect(),
        seq_lengths: lens.to_vec(),
        target_top_k: None,
        landing: None,
        trace_context: Default::default(),
    }
}

/// `b` with its features in `kind` on `device`.
fn batch_as(b: &DeviceBatch, kind: Kind, device: Device) -> DeviceBatch {
    DeviceBatch {
        batch_id: b.batch_id,
        features: b.features.to_kind(kind).to_device(device),
        input_ids: b.input_ids.clone(),
        loss_mask: b.loss_mask.clone(),
        seq_lengths: b.seq_lengths.clone(),
        target_top_k: None,
        landing: None,
        trace_context: Default::default(),
    }
}

fn grads(t: &Trainer) -> Vec<Tensor> {
    t.drafter().named_parameters().into_iter().map(|(_, p)| p.grad().copy()).collect()
}

fn loss(o: StepOutcome) -> f64 {
    match o {
        StepOutcome::Trained(m) => m.loss,
        StepOutcome::Skipped(r) => panic!("skipped: {r}"),
    }
}

/// One step on batch `b` of a drafter of `dc` in `kind` on `reference`'s
/// device, holding `reference`'s weights and set up by `configure`: the loss
/// and every gradient in f64 on the CPU.
fn step_like(
    reference: &Drafter,
    dc: &DrafterConfig,
    kind: Kind,
    (embed, head): (&Tensor, &Tensor),
    b: &DeviceBatch,
    configure: impl FnOnce(&mut Drafter),
) -> (f64, Vec<Tensor>) {
    let device = reference.device();
    let mut d = Drafter::new(dc.clone(), device, kind);
    d.vs.copy(&reference.vs).unwrap();
    configure(&mut d);
    let mut t = Trainer::new(d, embed.to_kind(kind), head.to_kind(kind), settings(1000, 1000));
    let l = loss(t.train_batch(&batch_as(b, kind, device)));
    (l, grads(&t).iter().map(|g| g.to_kind(Kind::Double).to_device(Device::Cpu)).collect())
}

/// The relative L2 distance of gradients `g` from `reference`, over all
/// parameters together.
fn gradient_error(g: &[Tensor], reference: &[Tensor]) -> f64 {
    let num: f64 = g.iter().zip(reference).map(|(a, r)| (a - r).square().sum(Kind::Double).double_value(&[])).sum();
    let den: f64 = reference.iter().map(|r| r.square().sum(Kind::Double).double_value(&[])).sum();
    (num / den).sqrt()
}

#[test]
fn chunked_attention_and_micro_batches_match_one_dense_forward() {
    let b = batch();
    let mut dense = trainer(1000, 1000);
    let l_dense = loss(dense.train_batch(&b));
    let g_dense = grads(&dense);
    for (chunk, micro, pad) in [(1, 1000, 1), (2, 1000, 1), (1000, 6, 1), (2, 12, 1), (2, 1000, 16), (1000, 12, 64)] {
        let mut t = trainer(chunk, micro);
        t.settings.context_pad_multiple = pad;
        let l = loss(t.train_batch(&b));
        assert!((l - l_dense).abs() < 1e-10, "chunk {chunk} micro {micro} pad {pad}: loss {l} vs {l_dense}");
        for (a, d) in grads(&t).iter().zip(&g_dense) {
            let err = (a - d).abs().max().double_value(&[]);
            assert!(err < 1e-10, "chunk {chunk} micro {micro} pad {pad}: gradient differs by {err}");
        }
    }
}

#[test]
fn a_fixed_batch_is_learned() {
    let b = batch();
    let mut t = trainer(2, 1000);
    let first = loss(t.train_batch(&b));
    let mut last = first;
    for _ in 0..30 {
        last = loss(t.train_batch(&b));
    }
    assert!(last < 0.5 * first, "loss {first} -> {last}");
}

/// Bad inputs are checked on the device and the verdict read with the
/// step's metrics (after the forward and backward): the reason names the
/// input, not the loss the NaN also spoils; the weights, step and
/// optimizer are untouched, the gradients zeroed, and the next batch trains.
#[test]
fn non_finite_features_are_skipped_without_touching_the_weights() {
    let b = batch();
    let _ = b.features.get(3).get(5).fill_(f64::NAN);
    let mut t = trainer(2, 1000);
    let before: Vec<Tensor> = t.drafter().named_parameters().into_iter().map(|(_, p)| p.copy()).collect();
    match t.train_batch(&b) {
        StepOutcome::Skipped(r) => assert_eq!(r, "batch 9: non-finite target features"),
        StepOutcome::Trained(_) => panic!("trained on NaN features"),
    }
    for (p, q) in t.drafter().named_parameters().iter().zip(&before) {
        assert!(p.1.equal(q));
    }
    assert!(grads(&t).iter().all(|g| g.abs().sum(Kind::Double).double_value(&[]) == 0.0), "gradients left behind");
    assert_eq!(t.step(), 0);
    assert!(loss(t.train_batch(&batch())).is_finite());
    assert_eq!(t.step(), 1);
}

/// Distillation: a NaN or +inf among the target's log-probabilities skips
/// the batch by name (an -inf is an underflowed probability and trains).
#[test]
fn a_teacher_with_non_finite_log_probabilities_is_skipped() {
    let mut s = settings(2, 1000);
    s.objective = dflash_models::Objective::Distill;
    let mut t = trainer(2, 1000);
    t.settings = s;
    let with_teacher = |bad: f64| {
        let mut b = batch();
        let rows = b.features.size()[0];
        let ids = Tensor::arange(rows * 3, (Kind::Int64, Device::Cpu)).remainder(200).view([rows, 3]) + 20;
        let log_probs = Tensor::full([rows, 3], -1.0986, (Kind::Double, Device::Cpu));
        let _ = log_probs.get(7).get(1).fill_(bad);
        b.target_top_k = Some(dflash_models::TopK { ids, log_probs });
        b
    };
    for bad in [f64::NAN, f64::INFINITY] {
        match t.train_batch(&with_teacher(bad)) {
            StepOutcome::Skipped(r) => assert_eq!(r, "batch 9: non-finite log-probabilities in the target's top-k"),
            StepOutcome::Trained(_) => panic!("trained on a teacher with {bad}"),
        }
    }
    assert_eq!(t.step(), 0);
    assert!(loss(t.train_batch(&with_teacher(f64::NEG_INFINITY))).is_finite());
    assert_eq!(t.step(), 1);
}

/// A bf16 drafter's loss and gradients against the same drafter in f64,
/// with its residual stream and norms in bf16 or in f32: the f32 stream
/// (what autocast trainers compute) lands closer to the f64 reference.
#[test]
fn an_f32_residual_stream_brings_a_bf16_drafters_gradients_closer_to_f64() {
    let tc = synthetic_target_config(2);
    let dc = DrafterConfig::for_target(&tc, 4, 4, 3, vec![0, 1]);
    tch::manual_seed(11);
    let reference = Drafter::new(dc.clone(), Device::Cpu, Kind::Double);
    let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Double, Device::Cpu));
    let head = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Double, Device::Cpu)) * 0.1;
    let b = batch();
    let run = |kind: Kind, f32_residual: bool| {
        step_like(&reference, &dc, kind, (&embed, &head), &b, |d| d.set_f32_residual(f32_residual))
    };
    let (l_ref, g_ref) = run(Kind::Double, false);
    let error = |(l, g): (f64, Vec<Tensor>)| ((l - l_ref).abs(), gradient_error(&g, &g_ref));
    let (loss_bf16, grad_bf16) = error(run(Kind::BFloat16, false));
    let (loss_mixed, grad_mixed) = error(run(Kind::BFloat16, true));
    // Both are bf16 drafters (loose), the f32 stream the closer of the two.
    assert!(grad_bf16 < 0.1 && grad_mixed < 0.1, "gradients off by {grad_bf16} / {grad_mixed}");
    eprintln!(
        "relative gradient error {grad_mixed:.3e} (f32 stream) vs {grad_bf16:.3e} (bf16 stream); loss {loss_mixed:.3e} vs {loss_bf16:.3e}"
    );
    assert!(grad_mixed < grad_bf16, "f32 stream {grad_mixed} vs bf16 stream {grad_bf16}");
    assert!(loss_mixed < loss_bf16, "loss off by {loss_mixed} (f32 stream) vs {loss_bf16}");
    // An f64 drafter is unchanged by the setting.
    let (l64, g64) = run(Kind::Double, true);
    assert_eq!(l64, l_ref);
    assert!(g64.iter().zip(&g_ref).all(|(a, r)| a.equal(r)));
}

#[test]
fn fp8_matmuls_are_refused_off_a_gpu_naming_the_setting() {
    let tc = synthetic_target_config(2);
    let dc = DrafterConfig::for_target(&tc, 1, 4, 3, vec![0, 1]);
    let mut d = Drafter::new(dc, Device::Cpu, Kind::BFloat16);
    let err = d.set_fp8_matmuls(true).unwrap_err().to_string();
    assert!(err.contains("training.precision") && err.contains("Cpu"), "{err}");
    d.set_fp8_matmuls(false).unwrap();
}

/// The FP8 step (e4m3 forward, e5m2 gradients) against the same step in
/// f32 and in bf16 on one batch: its gradients within 15% relative (L2, all
/// parameters) of f32's and its loss within 2%, where bf16's are within a
/// few percent; the printed figures say how far each is.
#[test]
#[ignore = "needs a CUDA GPU of compute capability 8.9 or newer"]
fn an_fp8_step_stays_within_a_stated_tolerance_of_the_bf16_and_f32_steps() {
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    let tc = synthetic_target_config(2);
    let dc = DrafterConfig::for_target(&tc, 2, 4, 3, vec![0, 1]);
    tch::manual_seed(11);
    let reference = Drafter::new(dc.clone(), gpu, Kind::Float);
    let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Float, gpu));
    let head = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::Float, gpu)) * 0.1;
    let b = batch();
    let run = |kind: Kind, fp8: bool| {
        step_like(&reference, &dc, kind, (&embed, &head), &b, |d| d.set_fp8_matmuls(fp8).unwrap())
    };
    let (l_ref, g_ref) = run(Kind::Float, false);
    let error = |(l, g): (f64, Vec<Tensor>)| ((l - l_ref).abs() / l_ref.abs(), gradient_error(&g, &g_ref));
    let (loss_bf16, grad_bf16) = error(run(Kind::BFloat16, false));
    let (loss_fp8, grad_fp8) = error(run(Kind::BFloat16, true));
    eprintln!(
        "relative to f32: gradients fp8 {grad_fp8:.3e}, bf16 {grad_bf16:.3e}; loss fp8 {loss_fp8:.3e}, bf16 {loss_bf16:.3e}"
    );
    assert!(grad_fp8 < 0.15 && loss_fp8 < 0.02, "fp8: gradients off by {grad_fp8}, loss by {loss_fp8}");
    assert!(grad_bf16 < 0.05 && loss_bf16 < 0.01, "bf16: gradients off by {grad_bf16}, loss by {loss_bf16}");
    // Not the bf16 step under another name.
    assert!(grad_fp8 > grad_bf16, "fp8 {grad_fp8} vs bf16 {grad_bf16}");
}

/// The split attention's step against the chunked mask's on a GPU: the same
/// bf16 drafter (grouped-query heads, which the split takes reordered) and
/// batch, loss within 1% and gradients within 3% (L2, all parameters) of the
/// masked step's. Both run in bf16 and differ only in the attention kernels'
/// rounding; a wrong head order or key set misses by far more.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_split_attention_step_matches_the_masked_step_on_a_gpu() {
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    let tc = synthetic_target_config(2);
    assert!(tc.num_heads > tc.num_kv_heads, "grouped-query heads");
    let dc = DrafterConfig::for_target(&tc, 2, 4, 3, vec![0, 1]);
    tch::manual_seed(11);
    let reference = Drafter::new(dc.clone(), gpu, Kind::BFloat16);
    let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::BFloat16, gpu));
    let head = Tensor::randn([tc.vocab_size, tc.hidden_size], (Kind::BFloat16, gpu)) * 0.1;
    let b = batch();
    let run = |split: bool| {
        step_like(&reference, &dc, Kind::BFloat16, (&embed, &head), &b, |d| {
            d.set_split_attention(split);
            assert_eq!(d.uses_split_attention(), split);
        })
    };
    let (l_mask, g_mask) = run(false);
    let (l_split, g_split) = run(true);
    let (loss_err, grad_err) = ((l_split - l_mask).abs() / l_mask.abs(), gradient_error(&g_split, &g_mask));
    eprintln!("split against masked: loss {loss_err:.3e}, gradients {grad_err:.3e} (relative)");
    assert!(loss_err < 1e-2 && grad_err < 3e-2, "loss off by {loss_err}, gradients by {grad_err}");
}
