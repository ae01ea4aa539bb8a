//! How one target instance's layers are split over its devices: each
//! device holds a run of consecutive layers (a pipeline stage), planned
//! before any weight is read from what the checkpoint's headers say each
//! layer takes (ARCHITECTURE.md, "Targets larger than one device", says why
//! stages and not tensor or expert parallelism).
//!
//! The first part also holds the input embedding, the last the final norm
//! and LM head when they are loaded; each part keeps the captures of its
//! own layers (they are copied to the host from where they were computed).

use std::fmt;
use std::ops::Range;

use tch::Device;

/// One device's share of a target.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub device: Device,
    pub layers: Range<i64>,
}

/// What a target needs, part by part, before it is placed: bytes of the
/// tensors outside the layers, of each layer, and each layer's compute.
#[derive(Clone, Debug, Default)]
pub struct Footprint {
    /// The input embedding (first part).
    pub embed: u64,
    /// Each loaded layer's tensors.
    pub layers: Vec<u64>,
    /// The final norm and LM head when loaded (last part).
    pub tail: u64,
    /// Whether the LM head is the embedding (loaded and tied): a last part
    /// other than the first then holds a copy of the embedding.
    pub tied_head: bool,
    /// Multiply-adds per token of each layer (what balances the parts).
    pub cost: Vec<f64>,
    /// Activations of one forward on every part (see [`workspace_bytes`]).
    pub workspace: u64,
    /// Per layer, what its part holds besides for its captures: the
    /// captured batches in flight and the layer's share of the feature
    /// cache (0 for a layer not captured; missing entries count 0).
    pub captures: Vec<u64>,
}

impl Footprint {
    /// Bytes of the tensors alone, whole.
    pub fn weight_bytes(&self) -> u64 {
        self.embed + self.layers.iter().sum::<u64>() + self.tail
    }

    /// Sets `per_layer` capture bytes on each of `layer_ids` (the rest 0).
    pub fn capture(&mut self, layer_ids: &[i64], per_layer: u64) {
        self.captures = vec![0; self.layers.len()];
        for &i in layer_ids {
            if let Some(c) = self.captures.get_mut(i as usize) {
                *c = per_layer;
            }
        }
    }

    /// Capture bytes of `layers`.
    fn captures_of(&self, layers: Range<i64>) -> u64 {
        layers.filter_map(|i| self.captures.get(i as usize)).sum()
    }
}

/// Where every layer of one target instance lives.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    parts: Vec<Part>,
}

/// Why no placement was found.
#[derive(Clone, Debug, PartialEq)]
pub struct DoesNotFit {
    pub message: String,
}

impl fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DoesNotFit {}

impl Placement {
    /// Every layer on one device.
    pub fn whole(device: Device, layers: i64) -> Self {
        Self { parts: vec![Part { device, layers: 0..layers }] }
    }

    /// The parts, in layer order (the first is the instance's home device).
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The device inputs come in on (each captured layer leaves from its own part's).
    pub fn home(&self) -> Device {
        self.parts[0].device
    }

    /// The device of the last part (final norm and LM head).
    pub fn last(&self) -> Device {
        self.parts[self.parts.len() - 1].device
    }

    /// The index of the part holding `layer`.
    pub fn part_of(&self, layer: i64) -> usize {
        self.parts.iter().position(|p| p.layers.contains(&layer)).unwrap_or(self.parts.len() - 1)
    }

    /// Bytes each part holds: its layers and their captures, the embedding
    /// (first), the tail (last) and the workspace.
    pub fn bytes(&self, f: &Footprint) -> Vec<u64> {
        let n = self.parts.len();
        self.parts.iter().enumerate().map(|(i, p)| part_bytes(f, p.layers.clone(), i == 0, i + 1 == n)).collect()
    }

    /// Splits the layers of `f` over `devices` (in order) into runs of
    /// consecutive layers, one per device, each at least one layer: of the
    /// splits whose parts fit `capacity` (bytes per device, None: no
    /// limit), the one whose largest part computes least (ties: the one
    /// whose fullest device holds less, as far as the search keeps it).
    /// Parts on the CPU share the host's memory: their sum must fit its
    /// capacity.
    pub fn plan(devices: &[Device], f: &Footprint, capacity: Option<&[u64]>) -> Result<Self, DoesNotFit> {
        let (p, n) = (devices.len(), f.layers.len());
        if p == 0 {
            return Err(DoesNotFit { message: "no devices to place the target on".into() });
        }
        if p > n {
            return Err(DoesNotFit {
                message: format!("{p} devices for {n} layers: each device needs at least one layer"),
            });
        }
        let fits = |k: usize, layers: Range<usize>| -> bool {
            let Some(cap) = capacity else { return true };
            devices[k] == Device::Cpu
                || part_bytes(f, layers.start as i64..layers.end as i64, k == 0, k + 1 == p) <= cap[k]
        };
        let prefix: Vec<f64> = std::iter::once(0.0)
            .chain(f.cost.iter().scan(0.0, |s, c| {
                *s += c;
                Some(*s)
            }))
            .collect();
        let cost = |r: Range<usize>| prefix[r.end] - prefix[r.start];
        // best[k][j]: the least (largest cost, then largest bytes) of
        // layers 0..j on parts 0..=k, with where part k starts; infinite
        // where nothing fits. The cost is optimal; among equal costs the
        // bytes break ties as far as the kept prefixes allow.
        let bytes = |k: usize, r: Range<usize>| part_bytes(f, r.start as i64..r.end as i64, k == 0, k + 1 == p) as f64;
        let none = (f64::INFINITY, f64::INFINITY, 0usize);
        let mut best = vec![vec![none; n + 1]; p];
        for (j, first) in best[0].iter_mut().enumerate().skip(1) {
            if fits(0, 0..j) {
                *first = (cost(0..j), bytes(0, 0..j), 0);
            }
        }
        for k in 1..p {
            for j in k + 1..=n {
                for i in k..j {
                    let (c0, b0, _) = best[k - 1][i];
                    if c0.is_finite() && fits(k, i..j) {
                        let worst = (c0.max(cost(i..j)), b0.max(bytes(k, i..j)));
                        if worst < (best[k][j].0, best[k][j].1) {
                            best[k][j] = (worst.0, worst.1, i);
                        }
                    }
                }
            }
        }
        if !best[p - 1][n].0.is_finite() {
            return Err(DoesNotFit { message: does_not_fit(devices, f, capacity.unwrap_or(&[])) });
        }
        let mut parts = Vec::with_capacity(p);
        let mut end = n;
        for k in (0..p).rev() {
            let start = best[k][end].2;
            parts.push(Part { device: devices[k], layers: start as i64..end as i64 });
            end = start;
        }
        parts.reverse();
        let placed = Self { parts };
        if let Some(cap) = capacity {
            placed.check_host(f, devices, cap)?;
        }
        Ok(placed)
    }

    /// Parts on the CPU together within the host's capacity.
    fn check_host(&self, f: &Footprint, devices: &[Device], cap: &[u64]) -> Result<(), DoesNotFit> {
        let bytes = self.bytes(f);
        let on_cpu: Vec<usize> = (0..devices.len()).filter(|&k| devices[k] == Device::Cpu).collect();
        let need: u64 = on_cpu.iter().map(|&k| bytes[k]).sum();
        match on_cpu.first() {
            Some(&k) if need > cap[k] => Err(DoesNotFit {
                message: format!(
                    "the target needs {} in host memory ({} part(s) on the CPU) and {} is available",
                    gib(need),
                    on_cpu.len(),
                    gib(cap[k])
                ),
            }),
            _ => Ok(()),
        }
    }
}

fn part_bytes(f: &Footprint, layers: Range<i64>, first: bool, last: bool) -> u64 {
    let held: u64 = f.layers[layers.start as usize..layers.end as usize].iter().sum();
    let tail = if last { f.tail + if f.tied_head && !first { f.embed } else { 0 } } else { 0 };
    held + f.captures_of(layers) + f.workspace + if first { f.embed } else { 0 } + tail
}

/// The refusal: what the target needs in all and at least on one device,
/// against what the devices have.
fn does_not_fit(devices: &[Device], f: &Footprint, cap: &[u64]) -> String {
    let need = f.weight_bytes() + f.captures.iter().sum::<u64>() + f.workspace * devices.len() as u64;
    let largest = f.layers.iter().max().copied().unwrap_or(0) + f.workspace;
    let have: Vec<String> = devices
        .iter()
        .zip(cap)
        .map(|(d, &c)| format!("{} {}", name(*d), if c == u64::MAX { "unknown".into() } else { gib(c) }))
        .collect();
    format!(
        "the target does not fit its devices: it needs {} in all ({} of weights, {} of activations a device; \
         its largest layer alone {}, the embedding {}, the head {}), and the devices have {}",
        gib(need),
        gib(f.weight_bytes()),
        gib(f.workspace),
        gib(largest),
        gib(f.embed),
        gib(f.tail),
        have.join(", ")
    )
}

/// Memory free for a target part on `device`, in bytes: the GPU's free
/// memory, or the host's available memory (`MemAvailable`). None where it
/// cannot be read: see [`capacities`].
pub fn capacity(device: Device) -> Option<u64> {
    match device {
        Device::Cuda(i) => crate::gpu::context(i).ok()?.mem_get_info().ok().map(|(free, _)| free as u64),
        _ => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib << 10)
        }
    }
}

/// A device as configs spell it (`cpu`, `cuda:1`).
pub fn name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

/// Each device's [`capacity`], `u64::MAX` (no limit) for one that cannot be
/// read.
pub fn capacities(devices: &[Device]) -> Vec<u64> {
    devices.iter().map(|&d| capacity(d).unwrap_or(u64::MAX)).collect()
}

/// Bytes as GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Activations of one packed forward of `tokens` on a part, in bytes of
/// `elem` each: four copies of the residual stream (input, normed, output,
/// the sum), every projection's output of the busiest layer (its
/// multiply-adds per token over the hidden size: q, k, v, gate, up, ...
/// as if all were alive at once), and for distillation the top-k's chunk
/// of f32 logits with its softmax and log-softmax ([`crate::distill`] works
/// through the vocabulary `CHUNK_ENTRIES` entries at a time; every part is
/// planned to leave room for it, to keep the plan simple). An estimate that
/// errs high.
pub fn workspace_bytes(c: &crate::TargetConfig, tokens: u64, elem: u64, top_k: bool) -> u64 {
    let h = c.hidden_size as u64;
    let widest = (0..c.num_layers).map(|i| c.layer_linear_macs(i) as u64 / h).max();
    let rows = 4 * h + widest.unwrap_or(0);
    let logits = if top_k { 3 * crate::distill::CHUNK_ENTRIES as u64 * 4 } else { 0 };
    tokens * rows * elem + logits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn footprint(layers: &[u64]) -> Footprint {
        Footprint {
            embed: 50,
            layers: layers.to_vec(),
            tail: 60,
            cost: layers.iter().map(|&b| b as f64).collect(),
            tied_head: false,
            workspace: 5,
            // The first layer captured: its part holds 10 more.
            captures: vec![10],
        }
    }

    fn ranges(p: &Placement) -> Vec<Range<i64>> {
        p.parts().iter().map(|p| p.layers.clone()).collect()
    }

    #[test]
    fn layers_split_into_runs_whose_largest_computes_least() {
        let f = footprint(&[10, 10, 10, 10, 10, 10]);
        let two = [Device::Cuda(0), Device::Cuda(1)];
        assert_eq!(ranges(&Placement::plan(&two, &f, None).unwrap()), [0..3, 3..6]);
        // Uneven layers (a dense layer before sparse ones): the cut follows the cost.
        let f = footprint(&[40, 10, 10, 10, 10]);
        assert_eq!(ranges(&Placement::plan(&two, &f, None).unwrap()), [0..1, 1..5]);
        let three = [Device::Cuda(0), Device::Cuda(1), Device::Cuda(2)];
        let f = footprint(&[20, 10, 10, 10, 10, 10, 10, 10]);
        let p = Placement::plan(&three, &f, None).unwrap();
        assert_eq!(ranges(&p), [0..2, 2..5, 5..8]);
        assert_eq!((p.home(), p.last(), p.part_of(4), p.part_of(5)), (Device::Cuda(0), Device::Cuda(2), 1, 2));
        // Bytes: layers + workspace, the embedding first, the tail last, and
        // each captured layer's captures on its own part.
        assert_eq!(p.bytes(&f), vec![30 + 5 + 50 + 10, 30 + 5, 30 + 5 + 60]);
        let mut g = f.clone();
        g.capture(&[1, 3, 7], 7);
        assert_eq!(p.bytes(&g), vec![30 + 5 + 50 + 7, 30 + 5 + 7, 30 + 5 + 60 + 7]);
        // Equal costs: the first part (which holds the embedding) takes fewer layers.
        let f = footprint(&[10, 10, 10]);
        assert_eq!(ranges(&Placement::plan(&two, &f, None).unwrap()), [0..1, 1..3]);
    }

    #[test]
    fn memory_moves_the_cut_and_a_model_too_large_is_refused_naming_need_and_capacity() {
        let f = footprint(&[10, 10, 10, 10, 10, 10]);
        let two = [Device::Cuda(0), Device::Cuda(1)];
        // The first device is small: it takes fewer layers than the balance would.
        let p = Placement::plan(&two, &f, Some(&[90, 1000])).unwrap();
        assert_eq!(ranges(&p), [0..2, 2..6]);
        assert!(p.bytes(&f).iter().zip([90, 1000]).all(|(b, c)| *b <= c));
        let err = Placement::plan(&two, &f, Some(&[60, 60])).unwrap_err().to_string();
        assert!(err.contains("does not fit") && err.contains("cuda:0 0.00 GiB"), "{err}");
        let err = Placement::plan(&[Device::Cuda(0); 7], &f, None).unwrap_err().to_string();
        assert!(err.contains("7 devices for 6 layers"), "{err}");
        // CPU parts share the host: their sum counts.
        let cpus = [Device::Cpu, Device::Cpu];
        Placement::plan(&cpus, &f, Some(&[190, 190])).unwrap();
        let err = Placement::plan(&cpus, &f, Some(&[150, 150])).unwrap_err().to_string();
        assert!(err.contains("host memory") && err.contains("2 part(s)"), "{err}");
    }
}
