//! A hidden-state batch: what one target forward produced for the drafter.

use std::collections::HashMap;

use bytes::Bytes;
use dflash_proto as pb;

use crate::WireError;

/// How the captured layers are laid out in the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One row-major [T, k*H] matrix, noise already added by the target.
    Packed,
    /// k row-major [T, H] matrices in layer-id order; the drafter concatenates.
    Split,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::Packed => "PACKED",
            Layout::Split => "SPLIT",
        })
    }
}

/// Element type of the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

/// Everything about a batch except its hidden states.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMeta {
    pub batch_id: u64,
    pub epoch: u32,
    pub target_instance: String,
    pub layout: Layout,
    pub dtype: DType,
    /// Lengths of the packed sequences, in order.
    pub seq_lengths: Vec<u32>,
    /// Token ids of all sequences, concatenated.
    pub input_ids: Vec<u32>,
    /// 1 where the token is trained on (assistant tokens), else 0.
    pub loss_mask: Vec<u8>,
    /// Target layers captured, in payload order.
    pub layer_ids: Vec<u32>,
    pub hidden_size: u32,
    pub sample_ids: Vec<u64>,
    /// Distillation: the target's `k` most likely next tokens per position
    /// follow the features (0: none; see [`BatchMeta::distill_bytes`]).
    pub target_top_k: u32,
    /// W3C trace context (traceparent, tracestate) of the batch.
    pub trace_context: HashMap<String, String>,
    /// The lease's token (`dflash_proto::lease_token`).
    pub lease_token: Vec<u8>,
}

impl BatchMeta {
    /// CRC32C of every field but the trace context, little-endian, each
    /// list preceded by its length (what `BatchEnd.header_crc32c` carries).
    pub fn header_crc(&self) -> u32 {
        let mut crc = 0u32;
        let mut put = |bytes: &[u8]| crc = crc32c::crc32c_append(crc, bytes);
        let list = |put: &mut dyn FnMut(&[u8]), n: usize| put(&(n as u64).to_le_bytes());
        put(&self.batch_id.to_le_bytes());
        put(&self.epoch.to_le_bytes());
        list(&mut put, self.target_instance.len());
        put(self.target_instance.as_bytes());
        // The enums as the proto numbers them.
        let layout = match self.layout {
            Layout::Packed => 1u8,
            Layout::Split => 2,
        };
        let dtype = match self.dtype {
            DType::F32 => 1u8,
            DType::Bf16 => 2,
            DType::F16 => 3,
        };
        put(&[layout, dtype]);
        list(&mut put, self.seq_lengths.len());
        self.seq_lengths.iter().for_each(|v| put(&v.to_le_bytes()));
        list(&mut put, self.input_ids.len());
        self.input_ids.iter().for_each(|v| put(&v.to_le_bytes()));
        list(&mut put, self.loss_mask.len());
        put(&self.loss_mask);
        list(&mut put, self.layer_ids.len());
        self.layer_ids.iter().for_each(|v| put(&v.to_le_bytes()));
        put(&self.hidden_size.to_le_bytes());
        list(&mut put, self.sample_ids.len());
        self.sample_ids.iter().for_each(|v| put(&v.to_le_bytes()));
        put(&self.target_top_k.to_le_bytes());
        list(&mut put, self.lease_token.len());
        put(&self.lease_token);
        crc
    }

    pub fn token_count(&self) -> usize {
        self.input_ids.len()
    }

    /// Bytes of the payload: the features, then the distillation targets.
    pub fn payload_bytes(&self) -> usize {
        self.feature_bytes() + self.distill_bytes()
    }

    /// Bytes of the hidden states: T * layers * H * element size.
    pub fn feature_bytes(&self) -> usize {
        self.token_count() * self.layer_ids.len() * self.hidden_size as usize * self.dtype.size()
    }

    /// Bytes of the distillation targets: per position the top-k token ids
    /// (int32) and then, after all ids, their log-probabilities (float32):
    /// T * k * 8.
    pub fn distill_bytes(&self) -> usize {
        distill_bytes(self.token_count(), self.target_top_k as usize)
    }

    /// Checks the header's internal consistency.
    pub fn validate(&self) -> Result<(), WireError> {
        let bad = |what: String| Err(WireError::InvalidHeader { batch_id: self.batch_id, what });
        let t = self.token_count();
        if t == 0 {
            return bad("token count is 0".into());
        }
        let total: u64 = self.seq_lengths.iter().map(|&l| l as u64).sum();
        if total != t as u64 {
            return bad(format!("sequence lengths sum to {total} but there are {t} tokens"));
        }
        if self.seq_lengths.contains(&0) {
            return bad("a sequence has length 0".into());
        }
        if self.loss_mask.len() != t {
            return bad(format!("loss mask has {} entries for {t} tokens", self.loss_mask.len()));
        }
        if self.loss_mask.iter().any(|&m| m > 1) {
            return bad("loss mask holds values other than 0 and 1".into());
        }
        if self.layer_ids.is_empty() {
            return bad("no captured layers".into());
        }
        if self.hidden_size == 0 {
            return bad("hidden size is 0".into());
        }
        if self.target_top_k > dflash_config::MAX_KD_TOP_K {
            return bad(format!(
                "top-{} distillation targets; at most {} are shipped",
                self.target_top_k,
                dflash_config::MAX_KD_TOP_K
            ));
        }
        if !self.sample_ids.is_empty() && self.sample_ids.len() != self.seq_lengths.len() {
            return bad(format!("{} sample ids for {} sequences", self.sample_ids.len(), self.seq_lengths.len()));
        }
        Ok(())
    }

    /// The protobuf header announcing this batch.
    pub fn to_header(&self) -> pb::BatchHeader {
        pb::BatchHeader {
            batch_id: self.batch_id,
            target_instance: self.target_instance.clone(),
            layout: match self.layout {
                Layout::Packed => pb::Layout::Packed,
                Layout::Split => pb::Layout::Split,
            } as i32,
            dtype: match self.dtype {
                DType::F32 => pb::Dtype::F32,
                DType::Bf16 => pb::Dtype::Bf16,
                DType::F16 => pb::Dtype::F16,
            } as i32,
            token_count: self.token_count() as u32,
            seq_lengths: self.seq_lengths.clone(),
            input_ids: self.input_ids.clone(),
            loss_mask: Bytes::copy_from_slice(&self.loss_mask),
            layer_ids: self.layer_ids.clone(),
            hidden_size: self.hidden_size,
            payload_bytes: self.payload_bytes() as u64,
            epoch: self.epoch,
            sample_ids: self.sample_ids.clone(),
            trace_context: self.trace_context.clone(),
            target_top_k: self.target_top_k,
            lease_token: Bytes::copy_from_slice(&self.lease_token),
        }
    }

    /// Reads and validates a received header.
    pub fn from_header(h: pb::BatchHeader) -> Result<Self, WireError> {
        let bad = |what: String| WireError::InvalidHeader { batch_id: h.batch_id, what };
        let layout = match pb::Layout::try_from(h.layout) {
            Ok(pb::Layout::Packed) => Layout::Packed,
            Ok(pb::Layout::Split) => Layout::Split,
            _ => return Err(bad(format!("unknown layout {}", h.layout))),
        };
        let dtype = match pb::Dtype::try_from(h.dtype) {
            Ok(pb::Dtype::F32) => DType::F32,
            Ok(pb::Dtype::Bf16) => DType::Bf16,
            Ok(pb::Dtype::F16) => DType::F16,
            _ => return Err(bad(format!("unknown dtype {}", h.dtype))),
        };
        if h.token_count as usize != h.input_ids.len() {
            return Err(bad(format!("token count {} but {} input ids", h.token_count, h.input_ids.len())));
        }
        let meta = BatchMeta {
            batch_id: h.batch_id,
            epoch: h.epoch,
            target_instance: h.target_instance,
            layout,
            dtype,
            seq_lengths: h.seq_lengths,
            input_ids: h.input_ids,
            loss_mask: h.loss_mask.to_vec(),
            layer_ids: h.layer_ids,
            hidden_size: h.hidden_size,
            sample_ids: h.sample_ids,
            target_top_k: h.target_top_k,
            trace_context: h.trace_context,
            lease_token: h.lease_token.to_vec(),
        };
        meta.validate()?;
        if meta.payload_bytes() as u64 != h.payload_bytes {
            return Err(WireError::InvalidHeader {
                batch_id: meta.batch_id,
                what: format!(
                    "payload_bytes {} does not match T*k*H*elem + T*top_k*8 = {}",
                    h.payload_bytes,
                    meta.payload_bytes()
                ),
            });
        }
        Ok(meta)
    }
}

/// Bytes of the distillation targets of `tokens` positions at top-`k`
/// (an int32 id and a float32 log-probability each).
pub fn distill_bytes(tokens: usize, k: usize) -> usize {
    tokens * k * 8
}

/// A batch whose hidden states sit in host memory, ready to send or train on.
///
/// The payload is reference-counted `Bytes`: the sender slices it into chunks
/// without copying, and whatever owns the memory (a pooled pinned buffer, a
/// `Vec`) is released only when the last chunk has left.
#[derive(Clone, Debug)]
pub struct HostBatch {
    pub meta: BatchMeta,
    pub payload: Bytes,
}

impl HostBatch {
    /// Pairs a header with its payload, checking the size.
    pub fn new(meta: BatchMeta, payload: Bytes) -> Result<Self, WireError> {
        meta.validate()?;
        if payload.len() != meta.payload_bytes() {
            return Err(WireError::InvalidHeader {
                batch_id: meta.batch_id,
                what: format!("payload has {} bytes, header implies {}", payload.len(), meta.payload_bytes()),
            });
        }
        Ok(Self { meta, payload })
    }
}
