//! Device lists: `"cpu"` or GPU indices (`"0,1,2"`, `"cuda:0,cuda:1"`).
//! A drafter trains one data-parallel replica per entry; `"cpu,cpu"` runs
//! two replicas on the host's cores (each a rank of the drafter group's Gloo
//! collective), which is how a member with several devices runs, and is
//! tested, on machines without GPUs.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One compute device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    Cpu,
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The devices a role owns, in order. Never empty; CPU never mixes with
/// GPUs; a GPU is listed at most once (the CPU may be, once per replica).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Spelled", into = "String")]
pub struct DeviceList(Vec<Device>);

/// How a config may write a device list: `"0,1"`, `"cpu"`, or one GPU index
/// as a number (`drafter = 1`, `--set devices.drafter=1`).
#[derive(Deserialize)]
#[serde(untagged)]
enum Spelled {
    Text(String),
    Index(u32),
}

impl DeviceList {
    pub fn cpu() -> Self {
        Self(vec![Device::Cpu])
    }

    pub fn cuda(indices: impl IntoIterator<Item = u32>) -> Self {
        Self(indices.into_iter().map(Device::Cuda).collect())
    }

    pub fn devices(&self) -> &[Device] {
        &self.0
    }

    pub fn is_cpu(&self) -> bool {
        self.0.iter().all(|d| *d == Device::Cpu)
    }

    /// GPU indices (empty for CPU).
    pub fn cuda_indices(&self) -> Vec<u32> {
        self.0
            .iter()
            .filter_map(|d| match d {
                Device::Cuda(i) => Some(*i),
                Device::Cpu => None,
            })
            .collect()
    }
}

impl TryFrom<Spelled> for DeviceList {
    type Error = String;

    fn try_from(s: Spelled) -> Result<Self, Self::Error> {
        match s {
            Spelled::Text(s) => s.parse(),
            Spelled::Index(i) => Ok(Self::cuda([i])),
        }
    }
}

impl std::str::FromStr for DeviceList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim) {
            if part.eq_ignore_ascii_case("cpu") {
                out.push(Device::Cpu);
                continue;
            }
            let idx = part.strip_prefix("cuda:").unwrap_or(part);
            let i: u32 = idx
                .parse()
                .map_err(|_| format!("'{part}' is not a device: use \"cpu\" or GPU indices like \"0,1,2\""))?;
            let d = Device::Cuda(i);
            if out.contains(&d) {
                return Err(format!("GPU {i} is listed twice in \"{s}\""));
            }
            out.push(d);
        }
        if out.is_empty() {
            return Err("the device list is empty".into());
        }
        if out.contains(&Device::Cpu) && !out.iter().all(|d| *d == Device::Cpu) {
            return Err(format!("\"{s}\" mixes the CPU with GPUs: a role runs on one or the other"));
        }
        Ok(Self(out))
    }
}

impl From<DeviceList> for String {
    fn from(d: DeviceList) -> String {
        d.to_string()
    }
}

impl fmt::Display for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_cpu() {
            return f.write_str(&vec!["cpu"; self.0.len()].join(","));
        }
        let parts: Vec<String> = self.cuda_indices().iter().map(u32::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_gpu_lists() {
        assert!("cpu".parse::<DeviceList>().unwrap().is_cpu());
        let two: DeviceList = "cpu, CPU".parse().unwrap();
        assert_eq!((two.devices().len(), two.is_cpu(), two.to_string()), (2, true, "cpu,cpu".to_string()));
        let l: DeviceList = "0, 1,cuda:4".parse().unwrap();
        assert_eq!(l.cuda_indices(), vec![0, 1, 4]);
        assert_eq!(l.to_string(), "0,1,4");
    }

    #[test]
    fn rejects_garbage_and_duplicates() {
        assert!("gpu0".parse::<DeviceList>().unwrap_err().contains("gpu0"));
        assert!("1,1".parse::<DeviceList>().unwrap_err().contains("twice"));
        assert!("".parse::<DeviceList>().is_err());
        assert!("cpu,0".parse::<DeviceList>().unwrap_err().contains("mixes the CPU with GPUs"));
    }
}
