//! Host copies of a trainer's tensors that are kept from one checkpoint to
//! the next. Copies of GPU tensors go into pinned (page-locked) memory, so
//! the device-to-host copy runs at the bus's speed instead of through a
//! pageable bounce buffer; the buffers are allocated once (pinning many GB
//! takes seconds) and refilled at every checkpoint, so the host holds one
//! copy of the state, not a fresh one per checkpoint.

use tch::{Device, Kind, Tensor};

use crate::ModelError;

/// Named host tensors, refilled in place.
#[derive(Default)]
pub struct HostCopies {
    tensors: Vec<(String, Tensor)>,
}

impl HostCopies {
    /// Copies each of `list` into its buffer (converted to `kind` where
    /// given), reusing the buffer of the same position, name, shape and
    /// kind, and allocating the others (pinned where the source is on a
    /// GPU). Returns after the copies are done: the trainer may step on.
    pub fn fill(&mut self, list: Vec<(String, Tensor)>, kind: Option<Kind>) -> Result<(), ModelError> {
        let mut old = std::mem::take(&mut self.tensors).into_iter();
        let _guard = tch::no_grad_guard();
        for (name, src) in list {
            let want = kind.unwrap_or(src.kind());
            let reused = old.next().filter(|(n, t)| *n == name && t.size() == src.size() && t.kind() == want);
            let mut dst = match reused {
                Some((_, t)) => t,
                None => allocate(&src, want)?,
            };
            dst.f_copy_(&src.detach())?;
            self.tensors.push((name, dst));
        }
        Ok(())
    }

    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.tensors
    }

    /// Host memory held.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }
}

/// A contiguous host tensor for a copy of `src` as `kind`: pinned for a
/// GPU source. Never a view of `src` (a CPU source gets its own storage),
/// so the trainer may step on while the copy is written.
fn allocate(src: &Tensor, kind: Kind) -> Result<Tensor, ModelError> {
    let host = Tensor::f_empty(src.size(), (kind, Device::Cpu))?;
    Ok(match src.device() {
        Device::Cuda(_) => crate::cuda::pinned(&host)?,
        _ => host,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(ts: &[(&str, &Tensor)]) -> Vec<(String, Tensor)> {
        ts.iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect()
    }

    #[test]
    fn refilled_buffers_are_reused_and_hold_the_new_values_never_the_source_itself() {
        let a = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([5], (Kind::Float, Device::Cpu));
        let mut copies = HostCopies::default();
        copies.fill(named(&[("a", &a), ("b", &b)]), None).unwrap();
        let first = copies.tensors()[0].1.data_ptr();
        assert_ne!(first, a.data_ptr(), "a copy, not a view of the trainer's tensor");
        assert!(copies.tensors()[0].1.equal(&a));
        let _ = tch::no_grad(|| a.shallow_clone().f_add_scalar_(1.0)).unwrap();
        copies.fill(named(&[("a", &a), ("b", &b)]), None).unwrap();
        assert_eq!(copies.tensors()[0].1.data_ptr(), first, "the buffer is reused");
        assert!(copies.tensors()[0].1.equal(&a));
        assert_eq!(copies.bytes(), (12 + 5) * 4);
    }

    #[test]
    fn a_buffer_whose_shape_kind_or_name_changed_is_replaced() {
        let a = Tensor::randn([4], (Kind::Float, Device::Cpu));
        let mut copies = HostCopies::default();
        copies.fill(named(&[("a", &a)]), Some(Kind::BFloat16)).unwrap();
        assert_eq!(copies.tensors()[0].1.kind(), Kind::BFloat16);
        let longer = Tensor::randn([6], (Kind::Float, Device::Cpu));
        copies.fill(named(&[("a", &longer)]), None).unwrap();
        assert_eq!(copies.tensors()[0].1.size(), vec![6]);
        assert_eq!(copies.tensors()[0].1.kind(), Kind::Float);
        copies.fill(named(&[("c", &longer)]), None).unwrap();
        assert_eq!(copies.tensors()[0].0, "c");
        assert_eq!(copies.tensors().len(), 1);
    }
}
