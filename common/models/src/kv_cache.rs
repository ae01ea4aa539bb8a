//! Key/value cache for decoding with the target.

use tch::Tensor;

/// Per-layer keys and values `[B, kv_heads, L, head_dim]` of the tokens seen.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    batch: i64,
    len: i64,
}

impl KvCache {
    pub fn new(num_layers: usize, batch: i64) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect(), batch, len: 0 }
    }

    /// Tokens held per sequence.
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn batch(&self) -> i64 {
        self.batch
    }

    /// Appends the new keys/values of one layer and returns all of them.
    /// The length moves on in [`KvCache::advance`] once every layer appended.
    pub fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let slot = &mut self.layers[layer];
        let (k, v) = match slot.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2), Tensor::cat(&[&pv, &v], 2)),
            None => (k, v),
        };
        *slot = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v)
    }

    pub fn advance(&mut self, t: i64) {
        self.len += t;
    }

    /// Keeps only the sequences at `rows` (finished ones leave the batch).
    pub fn retain_rows(&mut self, rows: &Tensor) {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(0, rows);
            *v = v.index_select(0, rows);
        }
        self.batch = rows.size()[0];
    }

    /// Forgets every token after the first `len` (rejected draft tokens).
    pub fn truncate(&mut self, len: i64) {
        assert!(len <= self.len, "cannot grow a cache by truncation");
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(2, 0, len);
            *v = v.narrow(2, 0, len);
        }
        self.len = len;
    }
}
