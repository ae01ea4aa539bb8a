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

/// `t` plus uniform noise of standard deviation `std` (U(-a, a),
/// a = std * sqrt(3)); `t` itself when `std` is 0.
pub fn add_uniform_noise(t: Tensor, std: f64) -> Tensor {
    if std == 0.0 {
        return t;
    }
    let a = std * 3f64.sqrt();
    &t + (t.rand_like() * (2.0 * a) - a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_has_the_asked_spread_and_kinds_round_trip() {
        tch::manual_seed(3);
        let t = Tensor::zeros([200_000], (Kind::Float, tch::Device::Cpu));
        let n = add_uniform_noise(t.shallow_clone(), 0.5);
        let (std, max) = (n.std(true).double_value(&[]), n.abs().max().double_value(&[]));
        assert!((std - 0.5).abs() < 0.01, "std {std}");
        assert!(max <= 0.5 * 3f64.sqrt() + 1e-6, "max {max}");
        assert!(add_uniform_noise(t.shallow_clone(), 0.0).equal(&t));
        for d in [DType::F32, DType::Bf16, DType::F16] {
            assert_eq!(dtype_of(kind_of(d)), Some(d));
        }
        assert_eq!(dtype_of(Kind::Int64), None);
    }
}
