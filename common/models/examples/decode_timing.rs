//! Times the pieces of one batched decode step on a model directory.
//! `cargo run --release --example decode_timing -- <model dir> <batch> <past len>`

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::time::Instant;

use dflash_models::{LoadScope, TargetModel};
use tch::{Device, Kind, Tensor};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::Path::new(&args[1]);
    let b: i64 = args[2].parse().unwrap();
    let past: i64 = args[3].parse().unwrap();
    let t = TargetModel::load(dir, Device::Cpu, Kind::Float, LoadScope::Full).unwrap();
    let _g = tch::no_grad_guard();
    let ids = Tensor::randint(1000, [b, past], (Kind::Int64, Device::Cpu));
    let pos = Tensor::arange(past, (Kind::Int64, Device::Cpu)).unsqueeze(0).repeat([b, 1]);
    let mut cache = t.new_cache(b);
    let valid = Tensor::ones([b, past], (Kind::Bool, Device::Cpu));
    let t0 = Instant::now();
    let (h, _) = t.forward_cached(&ids, &pos, &valid, &mut cache, &[]);
    println!("prefill {b}x{past}: {:.3} s", t0.elapsed().as_secs_f64());
    let mut valid = valid;
    for step in 0..5 {
        let next = t.logits(&h.select(1, past - 1)).argmax(-1, false);
        valid = Tensor::cat(&[&valid, &Tensor::ones([b, 1], (Kind::Bool, Device::Cpu))], 1);
        let p = Tensor::full([b, 1], past + step, (Kind::Int64, Device::Cpu));
        let t0 = Instant::now();
        let (h2, _) = t.forward_cached(&next.unsqueeze(1), &p, &valid, &mut cache, &[]);
        let t1 = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let _ = t.logits(&h2.select(1, 0)).argmax(-1, false);
        println!("step: forward {:.3} s, logits {:.3} s", t1, t0.elapsed().as_secs_f64());
    }
}
