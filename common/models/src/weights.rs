//! Reading named tensors from a Hugging Face model directory: one
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.
//! FP8 weights are dequantized as they load (`quant.rs`).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::quant::Fp8Config;

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
        other => {
            return Err(ModelError::Weights {
                path: file.to_path_buf(),
                message: format!("tensor {name} has unsupported dtype {other:?}"),
            });
        }
    })
}

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

/// The headers of every kept tensor of `dir`, checked: known dtypes, and
/// every float8 weight paired with a scale of the shape `fp8` implies.
fn scan(
    dir: &Path,
    keep: &dyn Fn(&str) -> bool,
    fp8: Option<&Fp8Config>,
) -> Result<HashMap<String, Entry>, ModelError> {
    let mut entries = HashMap::new();
    for file in shard_files(dir)? {
        let mmap = map_file(&file)?;
        let st = parse(&file, &mmap)?;
        for (name, view) in st.iter() {
            if !keep(name) {
                continue;
            }
            let kind = kind_of(view.dtype(), &file, name)?;
            let shape = view.shape().iter().map(|&d| d as i64).collect();
            entries.insert(name.to_string(), Entry { file: file.clone(), kind, shape });
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
                    "tensor {name} is float8 but {} has no fp8 quantization_config",
                    dir.join("config.json").display()
                ),
            });
        };
        let scale_name = format!("{name}{SCALE_SUFFIX}");
        let Some(scale) = entries.get(&scale_name) else {
            return Err(ModelError::MissingTensor { dir: dir.to_path_buf(), name: scale_name });
        };
        let want = crate::quant::scale_shape(&e.shape, fp8.block);
        let per_tensor = fp8.block.is_none() && scale.shape.iter().product::<i64>() == 1;
        if scale.shape != want && !per_tensor {
            return Err(ModelError::Weights {
                path: scale.file.clone(),
                message: format!(
                    "{scale_name} has shape {:?}, expected {want:?} for a {:?} weight in blocks of {:?}",
                    scale.shape, e.shape, fp8.block
                ),
            });
        }
    }
    let stray = entries.iter().find(|(n, _)| {
        n.strip_suffix(SCALE_SUFFIX).is_some_and(|w| entries.get(w).is_none_or(|e| e.kind != Kind::Float8e4m3fn))
    });
    if let Some((name, e)) = stray {
        return Err(ModelError::Weights {
            path: e.file.clone(),
            message: format!("{name} scales a weight that is not float8 (or not present)"),
        });
    }
    Ok(entries)
}

impl Weights {
    /// Loads every tensor whose name passes `keep` from the directory's
    /// safetensors files, converting floating tensors to `kind` on `device`.
    pub fn load(dir: &Path, device: Device, kind: Kind, keep: impl Fn(&str) -> bool) -> Result<Self, ModelError> {
        Self::load_quantized(dir, device, kind, keep, None)
    }

    /// Like [`Weights::load`] for a checkpoint that may hold FP8 weights
    /// (`fp8`: its `quantization_config`): each float8 `X.weight` is
    /// dequantized with its `X.weight_scale_inv` (wherever the shards put
    /// it) on `device` into `kind`.
    pub fn load_quantized(
        dir: &Path,
        device: Device,
        kind: Kind,
        keep: impl Fn(&str) -> bool,
        fp8: Option<&Fp8Config>,
    ) -> Result<Self, ModelError> {
        let entries = scan(dir, &keep, fp8)?;
        let files: BTreeSet<&PathBuf> = entries.values().map(|e| &e.file).collect();
        let mut raw = HashMap::with_capacity(entries.len());
        for file in files {
            let mmap = map_file(file)?;
            let st = parse(file, &mmap)?;
            for (name, e) in entries.iter().filter(|(_, e)| &e.file == file) {
                let view = st
                    .tensor(name)
                    .map_err(|err| ModelError::Weights { path: file.clone(), message: format!("{name}: {err:?}") })?;
                let t = Tensor::f_from_data_size(view.data(), &e.shape, e.kind)?.to_device(device);
                // Scales stay f32 and FP8 weights raw until they meet.
                let keep_raw = e.kind == Kind::Float8e4m3fn || name.ends_with(SCALE_SUFFIX);
                raw.insert(name.clone(), if t.is_floating_point() && !keep_raw { t.to_kind(kind) } else { t });
            }
        }
        // Dequantize one weight at a time, so the raw and the dequantized
        // copies of the whole model never coexist.
        if let Some(q) = fp8 {
            let mut quantized: Vec<String> =
                raw.iter().filter(|(_, t)| t.kind() == Kind::Float8e4m3fn).map(|(n, _)| n.clone()).collect();
            quantized.sort();
            for name in quantized {
                let weight = raw.remove(&name).expect("listed above");
                let scale = raw.remove(&format!("{name}{SCALE_SUFFIX}")).expect("paired by scan");
                raw.insert(name, crate::quant::dequantize(&weight, &scale, q.block, kind));
            }
        }
        let tensors = raw;
        Ok(Self { source: Source::Loaded(tensors), dir: dir.to_path_buf(), taken: 0 })
    }

    /// The kept tensors' headers only, checked as [`Weights::load_quantized`]
    /// checks them: taking a tensor checks its name and shape and returns
    /// an empty stand-in. For validating a model before loading it and for
    /// sizing it.
    pub fn headers(
        dir: &Path,
        kind: Kind,
        keep: &dyn Fn(&str) -> bool,
        fp8: Option<&Fp8Config>,
    ) -> Result<Self, ModelError> {
        let mut entries = scan(dir, keep, fp8)?;
        entries.retain(|n, _| !n.ends_with(SCALE_SUFFIX));
        Ok(Self { source: Source::Headers { entries, kind }, dir: dir.to_path_buf(), taken: 0 })
    }

    /// Tensors already in memory (named as in a checkpoint).
    pub fn from_tensors(tensors: Vec<(String, Tensor)>, label: &Path) -> Self {
        Self { source: Source::Loaded(tensors.into_iter().collect()), dir: label.to_path_buf(), taken: 0 }
    }

    /// Random tensors of whatever shapes are taken, made on `device` in
    /// `kind` (seed libtorch first for a reproducible draw).
    pub fn random(device: Device, kind: Kind, init: RandomInit) -> Self {
        Self { source: Source::Random { device, kind, init, made: None }, dir: "<random weights>".into(), taken: 0 }
    }

    /// Like [`Weights::random`], keeping every tensor made for
    /// [`Weights::into_tensors`] (to write a random model to disk).
    pub fn random_recorded(device: Device, kind: Kind, init: RandomInit) -> Self {
        let source = Source::Random { device, kind, init, made: Some(Vec::new()) };
        Self { source, dir: "<random weights>".into(), taken: 0 }
    }

    /// Whether this is the header-only dry run.
    pub fn is_headers(&self) -> bool {
        matches!(self.source, Source::Headers { .. })
    }

    /// Bytes of every tensor taken so far (held in the load's kind).
    pub fn taken_bytes(&self) -> u64 {
        self.taken
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, ModelError> {
        let missing = || ModelError::MissingTensor { dir: self.dir.clone(), name: name.to_string() };
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
                message: format!("tensor {name} has shape {found:?}, expected {shape:?}"),
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
/// as Hugging Face loaders expect.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), ModelError> {
    struct View {
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    }
    impl safetensors::tensor::View for &View {
        fn dtype(&self) -> Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.data)
        }
        fn data_len(&self) -> usize {
            self.data.len()
        }
    }
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let t = t.to_device(Device::Cpu).contiguous();
        let dtype = match t.kind() {
            Kind::Float => Dtype::F32,
            Kind::BFloat16 => Dtype::BF16,
            Kind::Half => Dtype::F16,
            Kind::Int64 => Dtype::I64,
            Kind::Int => Dtype::I32,
            k => {
                return Err(ModelError::Weights {
                    path: path.to_path_buf(),
                    message: format!("cannot write {name} of kind {k:?}"),
                });
            }
        };
        let numel = t.numel();
        let mut data = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut data, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        views.push((name.clone(), View { dtype, shape, data }));
    }
    let meta: Option<HashMap<String, String>> = Some([("format".to_string(), "pt".to_string())].into());
    safetensors::tensor::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), meta, path)
        .map_err(|e| ModelError::Weights { path: path.to_path_buf(), message: format!("{e:?}") })
}
