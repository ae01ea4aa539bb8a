//! Device lists: `"cpu"` or GPU indices (`"0,1,2"`, `"cuda:0,cuda:1"`).
//! A drafter trains one data-parallel replica per entry; `"cpu,cpu"` runs
//! two replicas on the host's cores (each a rank of the drafter group's Gloo
//! collective), which is how a member with several devices runs, and is
//! tested, on machines without GPUs.
//!
//! A target's list is one of device groups ([`TargetDevices`]): each group
//! is one target instance, its devices splitting the model.

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

/// The target's device groups, one target instance each (`devices.target`):
/// `"0,1,2"` three one-GPU instances; `"0-3,4"` an instance over GPUs 0-3
/// and one on GPU 4; `"0+2,1+3"` two instances of two GPUs each; `"cpu"`
/// one CPU instance and `"cpu,cpu"` one instance of two CPU parts (a target
/// has nothing to gain from two CPU instances; two parts exercise the split
/// on machines without GPUs). Never empty; a GPU is named at most once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Spelled", into = "String")]
pub struct TargetDevices(Vec<DeviceList>);

impl TargetDevices {
    pub fn cpu() -> Self {
        Self(vec![DeviceList::cpu()])
    }

    /// One one-GPU instance per index.
    pub fn cuda(indices: impl IntoIterator<Item = u32>) -> Self {
        Self(indices.into_iter().map(|i| DeviceList::cuda([i])).collect())
    }

    /// The instances, each its devices in layer order.
    pub fn instances(&self) -> &[DeviceList] {
        &self.0
    }

    /// Every device of every instance.
    pub fn devices(&self) -> Vec<Device> {
        self.0.iter().flat_map(|g| g.devices().iter().copied()).collect()
    }

    pub fn is_cpu(&self) -> bool {
        self.0.iter().all(DeviceList::is_cpu)
    }

    /// GPU indices of every instance (empty for CPU).
    pub fn cuda_indices(&self) -> Vec<u32> {
        self.0.iter().flat_map(DeviceList::cuda_indices).collect()
    }
}

impl TryFrom<Spelled> for TargetDevices {
    type Error = String;

    fn try_from(s: Spelled) -> Result<Self, Self::Error> {
        match s {
            Spelled::Text(s) => s.parse(),
            Spelled::Index(i) => Ok(Self::cuda([i])),
        }
    }
}

impl std::str::FromStr for TargetDevices {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (mut groups, mut cpus) = (Vec::new(), 0usize);
        for part in s.split(',').map(str::trim) {
            if part.eq_ignore_ascii_case("cpu") {
                cpus += 1;
                continue;
            }
            let gpu = |t: &str| -> Result<u32, String> {
                let t = t.trim();
                t.strip_prefix("cuda:").unwrap_or(t).parse().map_err(|_| {
                    format!("'{part}' is not a device group: use \"cpu\", GPU indices like \"0,1\", ranges like \"0-3\" or \"0+2\"")
                })
            };
            let indices: Vec<u32> = match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (gpu(a)?, gpu(b)?);
                    if a > b {
                        return Err(format!("the range '{part}' runs backwards"));
                    }
                    if b - a >= 1024 {
                        return Err(format!("the range '{part}' names more than 1024 GPUs"));
                    }
                    (a..=b).collect()
                }
                None => part.split('+').map(gpu).collect::<Result<_, _>>()?,
            };
            groups.push(DeviceList::cuda(indices));
        }
        if cpus > 0 {
            if !groups.is_empty() {
                return Err(format!("\"{s}\" mixes the CPU with GPUs: a role runs on one or the other"));
            }
            groups.push(DeviceList(vec![Device::Cpu; cpus]));
        }
        let all: Vec<u32> = groups.iter().flat_map(DeviceList::cuda_indices).collect();
        if let Some(i) = all.iter().find(|i| all.iter().filter(|j| j == i).count() > 1) {
            return Err(format!("GPU {i} is named twice in \"{s}\""));
        }
        if groups.is_empty() {
            return Err("the device list is empty".into());
        }
        Ok(Self(groups))
    }
}

impl From<TargetDevices> for String {
    fn from(d: TargetDevices) -> String {
        d.to_string()
    }
}

impl fmt::Display for TargetDevices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups: Vec<String> = self.0.iter().map(group_name).collect();
        f.write_str(&groups.join(","))
    }
}

/// An instance's devices as `devices.target` spells them: `"cpu,cpu"`,
/// `"3"`, `"0-3"` (consecutive) or `"0+2"`.
pub fn group_name(g: &DeviceList) -> String {
    if g.is_cpu() {
        return g.to_string();
    }
    let i = g.cuda_indices();
    match (i.first(), i.last()) {
        (Some(a), Some(b)) if i.len() > 1 && i.windows(2).all(|w| w[1] == w[0] + 1) => format!("{a}-{b}"),
        _ => i.iter().map(u32::to_string).collect::<Vec<_>>().join("+"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_devices_name_instances_of_one_or_several_devices() {
        let five: TargetDevices = "0,1,2,3,4".parse().unwrap();
        assert_eq!((five.instances().len(), five.to_string()), (5, "0,1,2,3,4".to_string()));
        let two: TargetDevices = "0-3, cuda:4".parse().unwrap();
        assert_eq!(two.instances().iter().map(|g| g.cuda_indices()).collect::<Vec<_>>(), [vec![0, 1, 2, 3], vec![4]]);
        assert_eq!(two.to_string(), "0-3,4");
        let pairs: TargetDevices = "0+2,1+3".parse().unwrap();
        assert_eq!((pairs.to_string(), pairs.cuda_indices()), ("0+2,1+3".to_string(), vec![0, 2, 1, 3]));
        let cpu: TargetDevices = "cpu,cpu".parse().unwrap();
        assert_eq!((cpu.instances().len(), cpu.instances()[0].devices().len(), cpu.is_cpu()), (1, 2, true));
        assert_eq!(cpu.to_string(), "cpu,cpu");
        // What is written reads back the same.
        for t in [five, two, pairs, cpu] {
            assert_eq!(t.to_string().parse::<TargetDevices>().unwrap(), t);
        }
        assert!("0-2,2".parse::<TargetDevices>().unwrap_err().contains("GPU 2 is named twice"));
        assert!("3-1".parse::<TargetDevices>().unwrap_err().contains("backwards"));
        assert!("0-4000000000".parse::<TargetDevices>().unwrap_err().contains("more than 1024"));
        assert!("cpu,0".parse::<TargetDevices>().unwrap_err().contains("mixes"));
        assert!("0-x".parse::<TargetDevices>().unwrap_err().contains("'0-x'"));
    }

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
