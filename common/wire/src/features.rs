//! The features a target ships and a drafter expects, derived once from
//! the run config: their dtype, their layout, the captured layers, and who
//! adds the training noise. Both ends use this one spec, so they cannot
//! disagree about the bytes between them.

use dflash_config::{ComputeDtype, RunConfig};

use crate::{BatchMeta, DType, Layout};

/// What every batch of a run carries.
#[derive(Clone, Debug, PartialEq)]
pub struct FeatureSpec {
    /// The target's compute dtype, in which it ships its features.
    pub dtype: DType,
    pub layout: Layout,
    /// Target layers captured, in the order of the concatenation.
    pub layer_ids: Vec<u32>,
    /// Std of the uniform noise on the features (0: none).
    pub noise_std: f64,
    /// Distillation: the target's top-k next tokens shipped per position
    /// (0: none).
    pub target_top_k: u32,
}

impl DType {
    /// The dtype a model computes in for a config dtype on a GPU or a CPU.
    pub fn compute(dtype: ComputeDtype, on_gpu: bool) -> Self {
        match dtype {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::Bf16,
            ComputeDtype::Auto if on_gpu => DType::Bf16,
            ComputeDtype::Auto => DType::F32,
        }
    }
}

impl FeatureSpec {
    /// The run's spec (`model.target_layer_ids` as the coordinator resolved it).
    pub fn of(c: &RunConfig) -> Self {
        Self {
            dtype: DType::compute(c.model.dtype, !c.devices.target.is_cpu()),
            layout: if c.pipeline.split_fc_layers { Layout::Split } else { Layout::Packed },
            layer_ids: c.model.target_layer_ids.clone(),
            noise_std: c.training.feature_noise_std,
            target_top_k: match c.training.loss {
                dflash_config::Objective::Kd => c.training.kd_top_k.unwrap_or(dflash_config::DEFAULT_KD_TOP_K),
                _ => 0,
            },
        }
    }

    /// Noise the target adds: PACKED features are concatenated, and so
    /// noised, by the target.
    pub fn target_noise_std(&self) -> f64 {
        if self.layout == Layout::Packed { self.noise_std } else { 0.0 }
    }

    /// Noise the drafter adds: SPLIT features are concatenated, and so
    /// noised, by the drafter after the copy to its device.
    pub fn drafter_noise_std(&self) -> f64 {
        if self.layout == Layout::Split { self.noise_std } else { 0.0 }
    }

    /// Payload bytes of `tokens` tokens of a target of `hidden` hidden size.
    pub fn payload_bytes(&self, tokens: usize, hidden: usize) -> usize {
        tokens * self.layer_ids.len() * hidden * self.dtype.size()
            + crate::distill_bytes(tokens, self.target_top_k as usize)
    }

    /// Why a batch's header does not match the spec, if it does not.
    pub fn mismatch(&self, m: &BatchMeta) -> Option<String> {
        if m.layer_ids != self.layer_ids {
            return Some(format!("layers {:?} but the run captures {:?}", m.layer_ids, self.layer_ids));
        }
        if m.dtype != self.dtype {
            return Some(format!("dtype {:?} but the run ships {:?}", m.dtype, self.dtype));
        }
        if m.layout != self.layout {
            return Some(format!("layout {} but the run uses {}", m.layout, self.layout));
        }
        if m.target_top_k != self.target_top_k {
            return Some(format!(
                "the target's top-{} next tokens but the run distills from its top {} (0: none)",
                m.target_top_k, self.target_top_k
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_run_config_decides_dtype_layout_and_who_adds_noise() {
        let mut c = RunConfig::default();
        c.model.target_layer_ids = vec![1, 5, 9];
        c.training.feature_noise_std = 0.2;
        c.devices.target = dflash_config::TargetDevices::cuda([0]);
        c.pipeline.split_fc_layers = true;
        let s = FeatureSpec::of(&c);
        assert_eq!((s.dtype, s.layout), (DType::Bf16, Layout::Split));
        assert_eq!((s.target_noise_std(), s.drafter_noise_std()), (0.0, 0.2));
        assert_eq!(s.payload_bytes(10, 64), 10 * 3 * 64 * 2);
        assert_eq!(s.target_top_k, 0);
        c.training.loss = dflash_config::Objective::Kd;
        let s = FeatureSpec::of(&c);
        assert_eq!(s.target_top_k, dflash_config::DEFAULT_KD_TOP_K);
        assert_eq!(s.payload_bytes(10, 64), 10 * 3 * 64 * 2 + 10 * 32 * 8);
        c.training.loss = dflash_config::Objective::Ce;

        c.devices.target = dflash_config::TargetDevices::cpu();
        c.pipeline.split_fc_layers = false;
        let s = FeatureSpec::of(&c);
        assert_eq!((s.dtype, s.layout), (DType::F32, Layout::Packed));
        assert_eq!((s.target_noise_std(), s.drafter_noise_std()), (0.2, 0.0));
        c.model.dtype = ComputeDtype::Bf16;
        assert_eq!(FeatureSpec::of(&c).dtype, DType::Bf16);
    }
}
