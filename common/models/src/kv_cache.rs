//! The target's decoding cache: per attention layer the keys and values of
//! the tokens seen, per linear-attention layer the convolution window and
//! the recurrent state after them.

use tch::Tensor;

/// What a Gated DeltaNet layer carries from one forward to the next.
pub struct RecurrentState {
    /// The last `kernel - 1` inputs of the convolution `[B, K-1, C]`.
    pub conv: Tensor,
    /// The delta rule's state `[B, H, dk, dv]` (f32).
    pub state: Tensor,
    /// The last forward's window and per-token states, kept so that the
    /// cache can go back to any of its positions (a verified block of
    /// which only a prefix is accepted).
    pub recorded: Option<Recorded>,
}

/// A forward's convolution inputs `[B, K-1+t, C]` (the window before it,
/// then its t inputs) and the state after each of its tokens
/// `[B, t, H, dk, dv]`.
pub struct Recorded {
    pub window: Tensor,
    pub states: Tensor,
}

enum Slot {
    Empty,
    /// Keys and values `[B, kv_heads, L, head_dim]`.
    Attention(Tensor, Tensor),
    Recurrent(RecurrentState),
}

/// The cache of every layer for a batch of sequences.
pub struct KvCache {
    layers: Vec<Slot>,
    batch: i64,
    len: i64,
    /// The length before the last forward (what a recorded state is relative to).
    base: i64,
}

/// Forwards of at most this many tokens keep their per-token recurrent
/// states (verification blocks); longer ones (prefills) keep only the last.
pub const RECORDED_TOKENS: i64 = 64;

impl KvCache {
    pub fn new(num_layers: usize, batch: i64) -> Self {
        Self { layers: (0..num_layers).map(|_| Slot::Empty).collect(), batch, len: 0, base: 0 }
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
        let (k, v) = match std::mem::replace(slot, Slot::Empty) {
            Slot::Attention(pk, pv) => (Tensor::cat(&[&pk, &k], 2), Tensor::cat(&[&pv, &v], 2)),
            _ => (k, v),
        };
        *slot = Slot::Attention(k.shallow_clone(), v.shallow_clone());
        (k, v)
    }

    /// The recurrent state of a linear-attention layer (None before its first token).
    pub fn recurrent(&self, layer: usize) -> Option<&RecurrentState> {
        match &self.layers[layer] {
            Slot::Recurrent(r) => Some(r),
            _ => None,
        }
    }

    /// Replaces a linear-attention layer's state with the one after the
    /// forward in progress.
    pub fn set_recurrent(&mut self, layer: usize, state: RecurrentState) {
        self.layers[layer] = Slot::Recurrent(state);
    }

    /// Whether a forward of `t` tokens should record its per-token states.
    pub fn records(t: i64) -> bool {
        t <= RECORDED_TOKENS
    }

    pub fn advance(&mut self, t: i64) {
        self.base = self.len;
        self.len += t;
    }

    /// Keeps only the sequences at `rows` (finished ones leave the batch).
    pub fn retain_rows(&mut self, rows: &Tensor) {
        for slot in &mut self.layers {
            // A target split over devices keeps each layer's cache on its own.
            let rows = &match slot {
                Slot::Empty => continue,
                Slot::Attention(k, _) => rows.to_device(k.device()),
                Slot::Recurrent(r) => rows.to_device(r.state.device()),
            };
            match slot {
                Slot::Empty => {}
                Slot::Attention(k, v) => {
                    *k = k.index_select(0, rows);
                    *v = v.index_select(0, rows);
                }
                Slot::Recurrent(r) => {
                    r.conv = r.conv.index_select(0, rows);
                    r.state = r.state.index_select(0, rows);
                    if let Some(rec) = &mut r.recorded {
                        rec.window = rec.window.index_select(0, rows);
                        rec.states = rec.states.index_select(0, rows);
                    }
                }
            }
        }
        self.batch = rows.size()[0];
    }

    /// Forgets every token after the first `len` (rejected draft tokens).
    /// A recurrent layer can go back only inside its last forward (which
    /// recorded its states); going back further is a caller's bug.
    pub fn truncate(&mut self, len: i64) {
        assert!(len <= self.len, "cannot grow a cache by truncation");
        if len == self.len {
            return;
        }
        let (base, held) = (self.base, self.len);
        for slot in &mut self.layers {
            match slot {
                Slot::Empty => {}
                Slot::Attention(k, v) => {
                    *k = k.narrow(2, 0, len);
                    *v = v.narrow(2, 0, len);
                }
                Slot::Recurrent(r) => {
                    let rec = r.recorded.take().filter(|_| len > base).unwrap_or_else(|| {
                        panic!(
                            "a linear-attention cache of {} tokens cannot go back to {len}: only the positions \
                             after {base} (its last forward) are kept",
                            held
                        )
                    });
                    let kept = len - base; // tokens of the last forward that stay
                    let k1 = r.conv.size()[1];
                    r.conv = rec.window.narrow(1, kept, k1);
                    r.state = rec.states.select(1, kept - 1);
                }
            }
        }
        self.len = len;
    }
}
