//! Target features as tensors: the libtorch kind of a wire dtype and back,
//! and the training noise, written once for the target (PACKED) and the
//! drafter (SPLIT) alike ([`dflash_wire::FeatureSpec`] says which adds it).

use dflash_wire::DType;
use tch::{Kind, Tensor};

/// The libtorch kind of a wire dtype.
pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::F32 => Kind::Float,
        DType::Bf16 => Kind::BFloat16,
        DType::F16 => Kind::Half,
    }
}

/// The wire dtype of a libtorch kind; `None` for kinds features never have.
pub fn dtype_of(kind: Kind) -> Option<DType> {
    match kind {
        Kind::Float => Some(DType::F32),
        Kind::BFloat16 => Some(DType::Bf16),
        Kind::Half => Some(DType::F16),
        _ => None,
    }
}

/// The key of one batch's noise: the run's seed and the batch id, so the
/// same batch gets the same noise in every run and after every restart.
pub fn noise_key(seed: u64, batch_id: u64) -> u64 {
    seed ^ batch_id.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// libtorch's generators are process-wide: the draws of one key are made
/// under this lock, so concurrent stages cannot interleave theirs.
static DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `t` plus uniform noise of standard deviation `std` (U(-a, a),
/// a = std * sqrt(3)) drawn from `key` ([`noise_key`]); `t` itself when
/// `std` is 0. The training step draws nothing from libtorch's generators
/// (its anchors come from their own keyed generator), so the noise is all
/// that reseeding touches.
pub fn add_uniform_noise(t: Tensor, std: f64, key: u64) -> Tensor {
    if std == 0.0 {
        return t;
    }
    let a = std * 3f64.sqrt();
    let u = {
        let _draw = DRAWS.lock().unwrap_or_else(|e| e.into_inner());
        tch::manual_seed(key as i64);
        t.rand_like()
    };
    &t + (u * (2.0 * a) - a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_has_the_asked_spread_is_keyed_and_kinds_round_trip() {
        tch::manual_seed(3);
        let t = Tensor::zeros([200_000], (Kind::Float, tch::Device::Cpu));
        let n = add_uniform_noise(t.shallow_clone(), 0.5, noise_key(1, 7));
        let (std, max) = (n.std(true).double_value(&[]), n.abs().max().double_value(&[]));
        assert!((std - 0.5).abs() < 0.01, "std {std}");
        assert!(max <= 0.5 * 3f64.sqrt() + 1e-6, "max {max}");
        assert!(add_uniform_noise(t.shallow_clone(), 0.0, 0).equal(&t));
        // The same key draws the same noise whatever was drawn in between.
        let _ = Tensor::rand([1000], (Kind::Float, tch::Device::Cpu));
        assert!(add_uniform_noise(t.shallow_clone(), 0.5, noise_key(1, 7)).equal(&n));
        assert!(!add_uniform_noise(t.shallow_clone(), 0.5, noise_key(1, 8)).equal(&n));
        for d in [DType::F32, DType::Bf16, DType::F16] {
            assert_eq!(dtype_of(kind_of(d)), Some(d));
        }
        assert_eq!(dtype_of(Kind::Int64), None);
    }
}
