//! Reading named tensors from a Hugging Face model directory: one
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use tch::{Device, Kind, Tensor};

use crate::ModelError;

/// Tensors of a checkpoint, taken out by name as the model is built.
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    dir: PathBuf,
}

fn kind_of(dtype: Dtype, file: &Path, name: &str) -> Result<Kind, ModelError> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        other => {
            return Err(ModelError::Weights {
                path: file.to_path_buf(),
                message: format!("tensor {name} has unsupported dtype {other:?}"),
            });
        }
    })
}

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

impl Weights {
    /// Loads every tensor whose name passes `keep` from the directory's
    /// safetensors files, converting floating tensors to `kind` on `device`.
    pub fn load(dir: &Path, device: Device, kind: Kind, keep: impl Fn(&str) -> bool) -> Result<Self, ModelError> {
        let mut tensors = HashMap::new();
        for file in shard_files(dir)? {
            let f = std::fs::File::open(&file).map_err(|e| ModelError::io(&file, e))?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::io(&file, e))?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| ModelError::Weights {
                path: file.clone(),
                message: format!("not a valid safetensors file: {e:?}"),
            })?;
            for name in st.names() {
                if !keep(name) {
                    continue;
                }
                let view = st
                    .tensor(name)
                    .map_err(|e| ModelError::Weights { path: file.clone(), message: format!("{name}: {e:?}") })?;
                let src_kind = kind_of(view.dtype(), &file, name)?;
                let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                let t = Tensor::f_from_data_size(view.data(), &shape, src_kind)?;
                let t = if t.is_floating_point() { t.to_kind(kind) } else { t };
                tensors.insert(name.to_string(), t.to_device(device));
            }
        }
        Ok(Self { tensors, dir: dir.to_path_buf() })
    }

    /// Tensors already in memory (named as in a checkpoint).
    pub fn from_tensors(tensors: Vec<(String, Tensor)>, label: &Path) -> Self {
        Self { tensors: tensors.into_iter().collect(), dir: label.to_path_buf() }
    }

    /// Removes and returns a tensor, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, ModelError> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor { dir: self.dir.clone(), name: name.to_string() })?;
        if t.size() != shape {
            return Err(ModelError::Weights {
                path: self.dir.clone(),
                message: format!("tensor {name} has shape {:?}, expected {shape:?}", t.size()),
            });
        }
        Ok(t)
    }

    /// Like [`Weights::take`] for a tensor that may be absent.
    pub fn take_optional(&mut self, name: &str, shape: &[i64]) -> Result<Option<Tensor>, ModelError> {
        if self.tensors.contains_key(name) { self.take(name, shape).map(Some) } else { Ok(None) }
    }

    /// Every tensor, by name.
    pub fn into_tensors(self) -> Vec<(String, Tensor)> {
        self.tensors.into_iter().collect()
    }

    /// Names not taken by the model (for a warning about unused tensors).
    pub fn remaining(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort();
        v
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
    safetensors::tensor::serialize_to_file(views.iter().map(|(n, v)| (n.as_str(), v)), &meta, path)
        .map_err(|e| ModelError::Weights { path: path.to_path_buf(), message: format!("{e:?}") })
}
