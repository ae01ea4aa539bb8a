//! Reading named tensors from a Hugging Face model directory: one
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.
//! FP8 and MXFP4 weights are dequantized as they load (`quant.rs`).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::quant::{MXFP4_BLOCKS, MXFP4_SCALES, Quantization};

/// Tensors of a checkpoint, taken out by name as the model is built. Also
/// two stand-ins with the same interface: the checkpoint's headers only
/// (a dry run that checks every name, shape and dtype before any byte is
/// read or any device is touched), and random tensors made on request in
/// the shape the model asks for (benchmarks, generated targets).
pub struct Weights {
    source: Source,
    dir: PathBuf,
    /// Bytes of the tensors taken so far, in the kind they are held in.
    taken: u64,
    names: TensorNames,
    skipped: Vec<SkippedTensors>,
}

/// How a checkpoint's tensor names relate to the names the model loads by
/// (`model.layers.N.*`, `model.embed_tokens.weight`, `lm_head.weight`),
/// and which of its parts are never read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorNames {
    /// Where a multimodal checkpoint keeps the language model's `model.*`
    /// tensors (`model.language_model.`); None: under `model.`.
    pub language_model: Option<String>,
    /// Parts of the checkpoint that are never read.
    pub skipped: Vec<SkippedPart>,
}

/// Tensors of a checkpoint that are not part of the target (a vision
/// tower, multi-token-prediction layers): every name under `prefix`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedPart {
    pub prefix: String,
    pub what: String,
}

/// What a load found and did not read, per skipped part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedTensors {
    pub part: SkippedPart,
    pub tensors: usize,
    pub bytes: u64,
}

impl TensorNames {
    /// The model's name for a checkpoint tensor; None for a skipped one.
    fn to_model(&self, stored: &str) -> Option<String> {
        if self.skipped.iter().any(|s| stored.starts_with(&s.prefix)) {
            return None;
        }
        match &self.language_model {
            Some(p) => {
                Some(stored.strip_prefix(p.as_str()).map_or_else(|| stored.to_string(), |rest| format!("model.{rest}")))
            }
            None => Some(stored.to_string()),
        }
    }

    /// The checkpoint's name for a tensor the model asks for.
    pub fn to_checkpoint(&self, name: &str) -> String {
        match (&self.language_model, name.strip_prefix("model.")) {
            (Some(p), Some(rest)) => format!("{p}{rest}"),
            _ => name.to_string(),
        }
    }
}

enum Source {
    Loaded(HashMap<String, Tensor>),
    Headers {
        entries: HashMap<String, Entry>,
        kind: Kind,
    },
    /// `made` keeps what was handed out when it is to be written later.
    Random {
        device: Device,
        kind: Kind,
        init: RandomInit,
        made: Option<Vec<(String, Tensor)>>,
    },
}

/// How random weights are drawn: matrices N(0, 0.02) as Hugging Face
/// initialises them; norms 1 and biases 0, or perturbed around those so a
/// missing scale or bias shows in a comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomInit {
    HuggingFace,
    Perturbed,
}

/// One stored tensor, from its file's header.
#[derive(Clone, Debug)]
struct Entry {
    file: PathBuf,
    /// Its name in the checkpoint.
    stored: String,
    kind: Kind,
    shape: Vec<i64>,
}

fn kind_of(dtype: Dtype, file: &Path, name: &str) -> Result<Kind, ModelError> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::U8 => Kind::Uint8,
        other => {
            return Err(ModelError::Weights {
                path: file.to_path_buf(),
                message: format!("tensor {name} has unsupported dtype {other:?}"),
            });
        }
    })
}

/// A tensor that keeps its stored floating kind: DeepSeek's routing
/// correction bias, which only ranks experts (rounding it to bf16 changes
/// which ones are chosen).
const KEPT_AS_STORED: &str = ".e_score_correction_bias";

/// Suffix of an FP8 weight's block scales (`X.weight` -> `X.weight_scale_inv`).
const SCALE_SUFFIX: &str = "_scale_inv";

/// The safetensors files of a model directory.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Weights { path: index.clone(), message: e.to_string() })?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Weights {
            path: index.clone(),
            message: "has no \"weight_map\" object".into(),
        })?;
        let files: BTreeSet<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(ModelError::Weights {
        path: dir.to_path_buf(),
        message: "has neither model.safetensors nor model.safetensors.index.json".into(),
    })
}

/// Maps a file (read-only; kept mapped only while it is read).
fn map_file(file: &Path) -> Result<memmap2::Mmap, ModelError> {
    let f = std::fs::File::open(file).map_err(|e| ModelError::io(file, e))?;
    // SAFETY: the file is opened read-only and not modified while mapped.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::io(file, e))
}

fn parse<'a>(file: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, ModelError> {
    SafeTensors::deserialize(bytes).map_err(|e| ModelError::Weights {
        path: file.to_path_buf(),
        message: format!("not a valid (or a truncated) safetensors file: {e:?}"),
    })
}

/// The headers of every kept tensor of `dir` by the model's names (`keep`
/// sees those, and for MXFP4 parts the name of the tensor they make),
/// checked: known dtypes, every float8 weight paired with a scale of the
/// shape `quant` implies, every MXFP4 `_blocks` with its `_scales`.
/// Skipped parts are counted, not read.
fn scan(
    dir: &Path,
    names: &TensorNames,
    keep: &dyn Fn(&str) -> bool,
    quant: Option<&Quantization>,
) -> Result<(HashMap<String, Entry>, Vec<SkippedTensors>), ModelError> {
    let fp8 = quant.and_then(Quantization::fp8);
    let mut entries = HashMap::new();
    let mut skipped: Vec<SkippedTensors> =
        names.skipped.iter().map(|p| SkippedTensors { part: p.clone(), tensors: 0, bytes: 0 }).collect();
    for file in shard_files(dir)? {
        let mmap = map_file(&file)?;
        let st = parse(&file, &mmap)?;
        for (stored, view) in st.iter() {
            let Some(name) = names.to_model(stored) else {
                if let Some(s) = skipped.iter_mut().find(|s| stored.starts_with(&s.part.prefix)) {
                    s.tensors += 1;
                    s.bytes += view.data().len() as u64;
                }
                continue;
            };
            if !keep(mxfp4_base(&name).unwrap_or(&name)) {
                continue;
            }
            let kind = kind_of(view.dtype(), &file, stored)?;
            let shape = view.shape().iter().map(|&d| d as i64).collect();
            entries.insert(name, Entry { file: file.clone(), stored: stored.to_string(), kind, shape });
        }
    }
    let mut quantized: Vec<&String> =
        entries.iter().filter(|(_, e)| e.kind == Kind::Float8e4m3fn).map(|(n, _)| n).collect();
    quantized.sort();
    for name in quantized {
        let e = &entries[name];
        let Some(fp8) = fp8 else {
            return Err(ModelError::Weights {
                path: e.file.clone(),
                message: format!(
                    "tensor {} is float8 but {} has no fp8 quantization_config",
                    e.stored,
                    dir.join("config.json").display()
                ),
            });
        };
        let scale_name = format!("{name}{SCALE_SUFFIX}");
        let Some(scale) = entries.get(&scale_name) else {
            return Err(ModelError::MissingTensor {
                dir: dir.to_path_buf(),
                name: format!("{}{SCALE_SUFFIX}", e.stored),
            });
        };
        let want = crate::quant::scale_shape(&e.shape, fp8.block);
        let per_tensor = fp8.block.is_none() && scale.shape.iter().product::<i64>() == 1;
        if scale.shape != want && !per_tensor {
            return Err(ModelError::Weights {
                path: scale.file.clone(),
                message: format!(
                    "{} has shape {:?}, expected {want:?} for a {:?} weight in blocks of {:?}",
                    scale.stored, scale.shape, e.shape, fp8.block
                ),
            });
        }
    }
    check_mxfp4(dir, &entries, quant)?;
    let stray = entries.iter().find(|(n, _)| {
        n.strip_suffix(SCALE_SUFFIX).is_some_and(|w| entries.get(w).is_none_or(|e| e.kind != Kind::Float8e4m3fn))
    });
    if let Some((_, e)) = stray {
        return Err(ModelError::Weights {
            path: e.file.clone(),
            message: format!("{} scales a weight that is not float8 (or not present)", e.stored),
        });
    }
    Ok((entries, skipped))
}

/// The tensor an MXFP4 part makes (`X_blocks` and `X_scales` make `X`).
fn mxfp4_base(name: &str) -> Option<&str> {
    name.strip_suffix(MXFP4_BLOCKS).or_else(|| name.strip_suffix(MXFP4_SCALES))
}

/// Every u8 tensor is a part of an MXFP4 pair in a checkpoint that says
/// mxfp4, and the pair's shapes agree.
fn check_mxfp4(dir: &Path, entries: &HashMap<String, Entry>, quant: Option<&Quantization>) -> Result<(), ModelError> {
    let mut bytes: Vec<(&String, &Entry)> = entries.iter().filter(|(_, e)| e.kind == Kind::Uint8).collect();
    bytes.sort_by_key(|(n, _)| n.as_str());
    for (name, e) in bytes {
        let bad = |message: String| ModelError::Weights { path: e.file.clone(), message };
        if quant != Some(&Quantization::Mxfp4) {
            return Err(bad(format!(
                "tensor {} is u8 but {} has no mxfp4 quantization_config",
                e.stored,
                dir.join("config.json").display()
            )));
        }
        let Some(base) = name.strip_suffix(MXFP4_BLOCKS) else {
            if name.strip_suffix(MXFP4_SCALES).is_some_and(|b| entries.contains_key(&format!("{b}{MXFP4_BLOCKS}"))) {
                continue;
            }
            return Err(bad(format!("{} is neither MXFP4 blocks nor the scales of present blocks", e.stored)));
        };
        if crate::quant::mxfp4_shape(&e.shape).is_none() {
            return Err(bad(format!("{} has shape {:?}, expected [experts, rows, blocks, 16]", e.stored, e.shape)));
        }
        let Some(scales) = entries.get(&format!("{base}{MXFP4_SCALES}")) else {
            return Err(ModelError::MissingTensor {
                dir: dir.to_path_buf(),
                name: format!("{}{MXFP4_SCALES}", e.stored.strip_suffix(MXFP4_BLOCKS).unwrap_or(&e.stored)),
            });
        };
        if scales.kind != Kind::Uint8 || scales.shape != e.shape[..3] {
            return Err(ModelError::Weights {
                path: scales.file.clone(),
                message: format!(
                    "{} is {:?} {:?}, expected u8 {:?} for blocks {:?}",
                    scales.stored,
                    scales.kind,
                    scales.shape,
                    &e.shape[..3],
                    e.shape
                ),
            });
        }
    }
    Ok(())
}

/// Replaces each MXFP4 pair of `raw` by the tensor it makes, in `kind`,
/// one pair at a time.
fn dequantize_mxfp4_pairs(raw: &mut HashMap<String, Tensor>, kind: Kind) {
    let mut pairs: Vec<String> = raw.keys().filter_map(|n| n.strip_suffix(MXFP4_BLOCKS).map(str::to_string)).collect();
    pairs.sort();
    for base in pairs {
        let blocks = raw.remove(&format!("{base}{MXFP4_BLOCKS}")).expect("listed above");
        let scales = raw.remove(&format!("{base}{MXFP4_SCALES}")).expect("paired by scan");
        raw.insert(base, crate::quant::dequantize_mxfp4(&blocks, &scales, kind));
    }
}

impl Weights {
    /// Loads every tensor whose name passes `keep` from the directory's
    /// safetensors files, converting floating tensors to `kind` on `device`.
    pub fn load(dir: &Path, device: Device, kind: Kind, keep: impl Fn(&str) -> bool) -> Result<Self, ModelError> {
        Self::load_quantized(dir, &TensorNames::default(), device, kind, keep, None)
    }

    /// Like [`Weights::load`] for a checkpoint named as `names` says that
    /// may hold quantized weights (`quant`: its `quantization_config`):
    /// each float8 `X.weight` is dequantized with its `X.weight_scale_inv`,
    /// each MXFP4 `X_blocks` with its `X_scales` into `X` (wherever the
    /// shards put them), on `device` into `kind`.
    pub fn load_quantized(
        dir: &Path,
        names: &TensorNames,
        device: Device,
        kind: Kind,
        keep: impl Fn(&str) -> bool,
        quant: Option<&Quantization>,
    ) -> Result<Self, ModelError> {
        let (entries, skipped) = scan(dir, names, &keep, quant)?;
        let files: BTreeSet<&PathBuf> = entries.values().map(|e| &e.file).collect();
        let mut raw = HashMap::with_capacity(entries.len());
        for file in files {
            let mmap = map_file(file)?;
            let st = parse(file, &mmap)?;
            for (name, e) in entries.iter().filter(|(_, e)| &e.file == file) {
                let view = st.tensor(&e.stored).map_err(|err| ModelError::Weights {
                    path: file.clone(),
                    message: format!("{}: {err:?}", e.stored),
                })?;
                let t = Tensor::f_from_data_size(view.data(), &e.shape, e.kind)?.to_device(device);
                // Scales stay f32 and FP8 weights raw until they meet; a
                // routing bias stays as stored, as transformers keeps it
                // in f32 whatever the model's dtype.
                let keep_raw =
                    e.kind == Kind::Float8e4m3fn || name.ends_with(SCALE_SUFFIX) || name.ends_with(KEPT_AS_STORED);
                raw.insert(name.clone(), if t.is_floating_point() && !keep_raw { t.to_kind(kind) } else { t });
            }
        }
        // Dequantize one weight at a time, so the raw and the dequantized
        // copies of the whole model never coexist.
        dequantize_mxfp4_pairs(&mut raw, kind);
        if let Some(q) = quant.and_then(Quantization::fp8) {
            let mut quantized: Vec<String> =
                raw.iter().filter(|(_, t)| t.kind() == Kind::Float8e4m3fn).map(|(n, _)| n.clone()).collect();
            quantized.sort();
            for name in quantized {
                let weight = raw.remove(&name).expect("listed above");
                let scale = raw.remove(&format!("{name}{SCALE_SUFFIX}")).expect("paired by scan");
                raw.insert(name, crate::quant::dequantize(&weight, &scale, q.block, kind));
            }
        }
        Ok(Self { source: Source::Loaded(raw), dir: dir.to_path_buf(), taken: 0, names: names.clone(), skipped })
    }

    /// The kept tensors' headers only, checked as [`Weights::load_quantized`]
    /// checks them: taking a tensor checks its name and shape and returns
    /// an empty stand-in. For validating a model before loading it and for
    /// sizing it.
    pub fn headers(
        dir: &Path,
        names: &TensorNames,
        kind: Kind,
        keep: &dyn Fn(&str) -> bool,
        quant: Option<&Quantization>,
    ) -> Result<Self, ModelError> {
        let (mut entries, skipped) = scan(dir, names, keep, quant)?;
        entries.retain(|n, _| !n.ends_with(SCALE_SUFFIX));
        // An MXFP4 pair stands for the tensor it makes, in a float kind.
        let pairs: Vec<String> =
            entries.keys().filter_map(|n| n.strip_suffix(MXFP4_BLOCKS).map(str::to_string)).collect();
        for base in pairs {
            let blocks = entries.remove(&format!("{base}{MXFP4_BLOCKS}")).expect("listed above");
            entries.remove(&format!("{base}{MXFP4_SCALES}"));
            let shape = crate::quant::mxfp4_shape(&blocks.shape).expect("checked by scan");
            entries.insert(base, Entry { kind: Kind::BFloat16, shape, ..blocks });
        }
        let source = Source::Headers { entries, kind };
        Ok(Self { source, dir: dir.to_path_buf(), taken: 0, names: names.clone(), skipped })
    }

    fn of(source: Source, dir: PathBuf) -> Self {
        Self { source, dir, taken: 0, names: TensorNames::default(), skipped: Vec::new() }
    }

    /// Tensors already in memory (named as in a checkpoint).
    pub fn from_tensors(tensors: Vec<(String, Tensor)>, label: &Path) -> Self {
        Self::of(Source::Loaded(tensors.into_iter().collect()), label.to_path_buf())
    }

    /// Random tensors of whatever shapes are taken, made on `device` in
    /// `kind` (seed libtorch first for a reproducible draw).
    pub fn random(device: Device, kind: Kind, init: RandomInit) -> Self {
        Self::of(Source::Random { device, kind, init, made: None }, "<random weights>".into())
    }

    /// Like [`Weights::random`], keeping every tensor made for
    /// [`Weights::into_tensors`] (to write a random model to disk).
    pub fn random_recorded(device: Device, kind: Kind, init: RandomInit) -> Self {
        Self::of(Source::Random { device, kind, init, made: Some(Vec::new()) }, "<random weights>".into())
    }

    /// The parts of the checkpoint that were found and not read.
    pub fn skipped(&self) -> &[SkippedTensors] {
        &self.skipped
    }

    /// Whether this is the header-only dry run.
    pub fn is_headers(&self) -> bool {
        matches!(self.source, Source::Headers { .. })
    }

    /// `f(t)` for a tensor taken from these weights, except in the
    /// header-only dry run, whose stand-ins hold no values to transform
    /// (a norm's offset folded in, a reshape, a reordering).
    pub fn transform(&self, t: Tensor, f: impl FnOnce(Tensor) -> Tensor) -> Tensor {
        if self.is_headers() { t } else { f(t) }
    }

    /// Bytes of every tensor taken so far (held in the load's kind).
    pub fn taken_bytes(&self) -> u64 {
        self.taken
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, ModelError> {
        let missing = || ModelError::MissingTensor { dir: self.dir.clone(), name: self.names.to_checkpoint(name) };
        let (t, found, kind) = match &mut self.source {
            Source::Loaded(tensors) => {
                let t = tensors.remove(name).ok_or_else(missing)?;
                let (size, kind) = (t.size(), t.kind());
                (t, size, kind)
            }
            Source::Headers { entries, kind } => {
                let e = entries.remove(name).ok_or_else(missing)?;
                let held = if e.kind == Kind::Float8e4m3fn || is_float(e.kind) { *kind } else { e.kind };
                (Tensor::zeros([0], (Kind::Float, Device::Cpu)), e.shape, held)
            }
            Source::Random { device, kind, init, made } => {
                let t = random_tensor(name, shape, *device, *kind, *init);
                if let Some(made) = made {
                    made.push((name.to_string(), t.shallow_clone()));
                }
                (t, shape.to_vec(), *kind)
            }
        };
        if found != shape {
            return Err(ModelError::Weights {
                path: self.dir.clone(),
                message: format!("tensor {} has shape {found:?}, expected {shape:?}", self.names.to_checkpoint(name)),
            });
        }
        self.taken += shape.iter().product::<i64>() as u64 * kind.elt_size_in_bytes() as u64;
        Ok(t)
    }

    /// Like [`Weights::take`] for a tensor that may be absent (never made
    /// up by random weights).
    pub fn take_optional(&mut self, name: &str, shape: &[i64]) -> Result<Option<Tensor>, ModelError> {
        let present = match &self.source {
            Source::Loaded(t) => t.contains_key(name),
            Source::Headers { entries, .. } => entries.contains_key(name),
            Source::Random { .. } => false,
        };
        if present { self.take(name, shape).map(Some) } else { Ok(None) }
    }

    /// Drops a tensor the model does not use (e.g. a stored LM head that
    /// the config ties to the embedding).
    pub fn discard(&mut self, name: &str) {
        match &mut self.source {
            Source::Loaded(t) => drop(t.remove(name)),
            Source::Headers { entries, .. } => drop(entries.remove(name)),
            Source::Random { .. } => {}
        }
    }

    /// Every tensor, by name: those loaded and not taken, or those made up
    /// (when recorded).
    pub fn into_tensors(self) -> Vec<(String, Tensor)> {
        match self.source {
            Source::Loaded(t) => t.into_iter().collect(),
            Source::Headers { .. } => Vec::new(),
            Source::Random { made, .. } => made.unwrap_or_default(),
        }
    }

    /// Names not taken by the model (for a warning about unused tensors).
    pub fn remaining(&self) -> Vec<&str> {
        let mut v: Vec<&str> = match &self.source {
            Source::Loaded(t) => t.keys().map(String::as_str).collect(),
            Source::Headers { entries, .. } => entries.keys().map(String::as_str).collect(),
            Source::Random { .. } => Vec::new(),
        };
        v.sort();
        v
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double)
}

fn random_tensor(name: &str, shape: &[i64], device: Device, kind: Kind, init: RandomInit) -> Tensor {
    let _guard = tch::no_grad_guard();
    let base = if name.ends_with("norm.weight") {
        Tensor::ones(shape, (kind, device))
    } else if name.ends_with(".bias") {
        Tensor::zeros(shape, (kind, device))
    } else {
        return Tensor::randn(shape, (kind, device)) * 0.02;
    };
    match init {
        RandomInit::HuggingFace => base,
        RandomInit::Perturbed => &base + base.rand_like() * 0.2 - 0.1,
    }
}

/// Writes tensors to one safetensors file with `{"format": "pt"}` metadata,
/// as Hugging Face loaders expect, durable when it returns
/// ([`crate::tensor_file::write_safetensors_digested`]).
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), ModelError> {
    crate::tensor_file::write_safetensors_digested(path, tensors).map(|_| ())
}
