//! Where a piece of work spends its device time, kernel by kernel, from
//! libtorch's own profiler (Kineto; CUPTI on a GPU, shipped with the PyTorch
//! wheel), through `csrc/profiler.cpp`. The device machines have neither
//! nsys nor ncu; this takes a training step or a forward apart in the
//! process that runs it.
//!
//! Each device kernel is linked to the host op that launched it (by the
//! correlation id libtorch gives every op), so a caller can sort kernels by
//! what they compute: the op's name and input shapes say more than a
//! kernel's name (a GEMM of the LM head and one of a layer share a kernel).

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};

use crate::ModelError;

/// What Kineto recorded (`libkineto::ActivityType`).
pub mod activity {
    pub const CPU_OP: u8 = 0;
    pub const GPU_MEMCPY: u8 = 3;
    pub const GPU_MEMSET: u8 = 4;
    pub const KERNEL: u8 = 5;
}

/// One recorded event.
#[derive(Clone, Debug)]
pub struct Event {
    pub name: String,
    /// Input shapes of a host op (`[a,b][c]`), empty otherwise.
    pub shapes: String,
    pub start_ns: u64,
    pub duration_ns: u64,
    pub correlation: u64,
    /// For a device event: the correlation id of the op that launched it.
    pub linked_correlation: u64,
    pub thread: u64,
    pub activity: u8,
    pub on_device: bool,
}

impl Event {
    /// A kernel, copy or memset that ran on the device.
    pub fn is_device_work(&self) -> bool {
        self.on_device && matches!(self.activity, activity::KERNEL | activity::GPU_MEMCPY | activity::GPU_MEMSET)
    }

    /// Whether any input of this op has a dimension of `size`.
    pub fn has_dim(&self, size: i64) -> bool {
        self.shapes.split(['[', ']', ',']).filter(|s| !s.is_empty()).any(|d| d.parse::<i64>() == Ok(size))
    }
}

#[repr(C)]
struct RawEvent {
    name: *const c_char,
    shapes: *const c_char,
    start_ns: u64,
    duration_ns: u64,
    correlation: u64,
    linked_correlation: u64,
    thread: u64,
    activity: u8,
    on_device: u8,
}

unsafe extern "C" {
    fn dflash_profiler_start(cuda: i32, err: *mut c_char, err_len: usize) -> i32;
    fn dflash_profiler_stop(err: *mut c_char, err_len: usize) -> *mut c_void;
    fn dflash_profile_len(profile: *mut c_void) -> usize;
    fn dflash_profile_event(profile: *mut c_void, i: usize, out: *mut RawEvent);
    fn dflash_profile_free(profile: *mut c_void);
}

fn profiler_error(what: &str, err: &[c_char]) -> ModelError {
    // SAFETY: the shim writes a NUL-terminated message into the buffer.
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
    ModelError::Device(format!("libtorch's profiler: {what}: {msg}"))
}

/// Runs `f` under libtorch's profiler (device activity too with `cuda`)
/// and returns its result and every event recorded. `f` should end with
/// its device's work done (a synchronize), or the last kernels are missed.
/// One profile at a time per process.
pub fn record<T>(cuda: bool, f: impl FnOnce() -> T) -> Result<(T, Vec<Event>), ModelError> {
    let mut err = [0 as c_char; 512];
    // SAFETY: err is a writable buffer of the given length.
    if unsafe { dflash_profiler_start(i32::from(cuda), err.as_mut_ptr(), err.len()) } != 0 {
        return Err(profiler_error("starting", &err));
    }
    let out = f();
    // SAFETY: as above; a null result comes with a message.
    let profile = unsafe { dflash_profiler_stop(err.as_mut_ptr(), err.len()) };
    if profile.is_null() {
        return Err(profiler_error("stopping", &err));
    }
    // SAFETY: `profile` is a live profile of dflash_profile_len events; its
    // strings live until dflash_profile_free, after they are copied here.
    let events = unsafe {
        let n = dflash_profile_len(profile);
        let mut events = Vec::with_capacity(n);
        for i in 0..n {
            let mut raw = std::mem::zeroed::<RawEvent>();
            dflash_profile_event(profile, i, &mut raw);
            events.push(Event {
                name: CStr::from_ptr(raw.name).to_string_lossy().into_owned(),
                shapes: CStr::from_ptr(raw.shapes).to_string_lossy().into_owned(),
                start_ns: raw.start_ns,
                duration_ns: raw.duration_ns,
                correlation: raw.correlation,
                linked_correlation: raw.linked_correlation,
                thread: raw.thread,
                activity: raw.activity,
                on_device: raw.on_device != 0,
            });
        }
        dflash_profile_free(profile);
        events
    };
    Ok((out, events))
}

/// Device time of each class that `classify` gives a device event (with the
/// host op that launched it, where one is linked).
#[derive(Clone, Debug, PartialEq)]
pub struct ClassTime {
    pub class: &'static str,
    pub events: usize,
    pub device_ns: u64,
}

/// Sums the device events' time by class, in the order classes first appear.
pub fn device_time_by_class(
    events: &[Event],
    classify: impl Fn(&Event, Option<&Event>) -> &'static str,
) -> Vec<ClassTime> {
    let ops: HashMap<u64, &Event> =
        events.iter().filter(|e| e.activity == activity::CPU_OP).map(|e| (e.correlation, e)).collect();
    let mut out: Vec<ClassTime> = Vec::new();
    for e in events.iter().filter(|e| e.is_device_work()) {
        let class = classify(e, ops.get(&e.linked_correlation).copied());
        match out.iter_mut().find(|c| c.class == class) {
            Some(c) => {
                c.events += 1;
                c.device_ns += e.duration_ns;
            }
            None => out.push(ClassTime { class, events: 1, device_ns: e.duration_ns }),
        }
    }
    out
}

/// Device time by a key of each device event (and its launching op), for
/// the events `key` names: the `n` largest, largest first.
pub fn device_time_by_key(
    events: &[Event],
    key: impl Fn(&Event, Option<&Event>) -> Option<String>,
    n: usize,
) -> Vec<(String, usize, u64)> {
    let ops: HashMap<u64, &Event> =
        events.iter().filter(|e| e.activity == activity::CPU_OP).map(|e| (e.correlation, e)).collect();
    let mut by_key: HashMap<String, (usize, u64)> = HashMap::new();
    for e in events.iter().filter(|e| e.is_device_work()) {
        if let Some(k) = key(e, ops.get(&e.linked_correlation).copied()) {
            let entry = by_key.entry(k).or_default();
            entry.0 += 1;
            entry.1 += e.duration_ns;
        }
    }
    let mut out: Vec<(String, usize, u64)> = by_key.into_iter().map(|(k, (c, ns))| (k, c, ns)).collect();
    out.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    out.truncate(n);
    out
}

/// Where the device waited on the host: each gap between device work
/// (longer than `min_gap_ns`) is put on the host op that ran through it --
/// the innermost op covering at least half of the gap, else the op that
/// overlaps it most, else "(between ops)" (host code outside libtorch).
/// The `n` largest by idle time, largest first: (op, gaps, idle ns).
pub fn idle_by_host_op(events: &[Event], min_gap_ns: u64, n: usize) -> Vec<(String, usize, u64)> {
    let mut spans: Vec<(u64, u64)> =
        events.iter().filter(|e| e.is_device_work()).map(|e| (e.start_ns, e.start_ns + e.duration_ns)).collect();
    spans.sort_unstable();
    let mut gaps = Vec::new();
    let mut end = spans.first().map_or(0, |s| s.1);
    for &(s, e) in &spans {
        if s > end + min_gap_ns {
            gaps.push((end, s));
        }
        end = end.max(e);
    }
    let ops: Vec<&Event> = events.iter().filter(|e| e.activity == activity::CPU_OP).collect();
    let mut by_op: HashMap<String, (usize, u64)> = HashMap::new();
    for (a, b) in gaps {
        let overlap = |o: &Event| (o.start_ns + o.duration_ns).min(b).saturating_sub(o.start_ns.max(a));
        let covering = ops.iter().filter(|o| 2 * overlap(o) >= b - a).min_by_key(|o| o.duration_ns);
        let op = covering.or_else(|| ops.iter().filter(|o| overlap(o) > 0).max_by_key(|o| overlap(o)));
        let name = op.map_or_else(|| "(between ops)".to_string(), |o| o.name.clone());
        let entry = by_op.entry(name).or_default();
        entry.0 += 1;
        entry.1 += b - a;
    }
    let mut out: Vec<(String, usize, u64)> = by_op.into_iter().map(|(k, (c, ns))| (k, c, ns)).collect();
    out.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
    out.truncate(n);
    out
}

/// The device's busy time: the union of its events' intervals (overlapping
/// kernels counted once), and the span from the first start to the last end.
pub fn device_busy_ns(events: &[Event]) -> (u64, u64) {
    let mut spans: Vec<(u64, u64)> =
        events.iter().filter(|e| e.is_device_work()).map(|e| (e.start_ns, e.start_ns + e.duration_ns)).collect();
    spans.sort_unstable();
    let (mut busy, mut end) = (0u64, 0u64);
    for &(s, e) in &spans {
        if e > end {
            busy += e - s.max(end);
            end = e;
        }
    }
    let span = spans.first().map_or(0, |f| end - f.0);
    (busy, span)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    fn kernel(start: u64, dur: u64, link: u64) -> Event {
        Event {
            name: "k".into(),
            shapes: String::new(),
            start_ns: start,
            duration_ns: dur,
            correlation: 0,
            linked_correlation: link,
            thread: 0,
            activity: activity::KERNEL,
            on_device: true,
        }
    }

    #[test]
    fn busy_time_counts_overlaps_once_and_classes_follow_the_launching_op() {
        let mut op = kernel(0, 50, 0);
        (op.activity, op.on_device, op.correlation, op.name, op.shapes) =
            (activity::CPU_OP, false, 7, "aten::mm".into(), "[4,151936][151936,8]".into());
        let events = vec![op, kernel(100, 10, 7), kernel(105, 10, 8), kernel(130, 5, 7)];
        assert_eq!(device_busy_ns(&events), (10 + 5 + 5, 35));
        let classes = device_time_by_class(&events, |_, op| match op {
            Some(o) if o.has_dim(151936) => "head",
            Some(_) => "other op",
            None => "unlinked",
        });
        assert_eq!(
            classes,
            vec![
                ClassTime { class: "head", events: 2, device_ns: 15 },
                ClassTime { class: "unlinked", events: 1, device_ns: 10 }
            ]
        );
        let by_op = device_time_by_key(&events, |_, op| op.map(|o| format!("{} {}", o.name, o.shapes)), 5);
        assert_eq!(by_op, vec![("aten::mm [4,151936][151936,8]".to_string(), 2, 15)], "unlinked kernels have no key");
    }

    #[test]
    fn device_gaps_go_to_the_host_op_that_ran_through_them() {
        let op = |name: &str, start: u64, dur: u64| {
            let mut e = kernel(start, dur, 0);
            (e.activity, e.on_device, e.name) = (activity::CPU_OP, false, name.into());
            e
        };
        let events = vec![
            kernel(0, 10, 0),
            // Gap 10..40: item() inside a loss op covers it.
            op("loss", 5, 100),
            op("aten::item", 12, 30),
            kernel(40, 10, 0),
            // Gap 50..60: no op ran through it.
            kernel(60, 10, 0),
            // Gap 70..71: shorter than the threshold.
            kernel(71, 10, 0),
        ];
        assert_eq!(
            idle_by_host_op(&events, 2, 5),
            vec![("aten::item".to_string(), 1, 30), ("loss".to_string(), 1, 10)],
            "the loss op overlaps the second gap (50..60) most"
        );
        let no_ops: Vec<Event> = events.iter().filter(|e| e.is_device_work()).cloned().collect();
        assert_eq!(idle_by_host_op(&no_ops, 2, 5), vec![("(between ops)".to_string(), 2, 40)]);
    }

    #[test]
    fn host_ops_are_recorded_with_their_input_shapes() {
        let a = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([5, 7], (Kind::Float, Device::Cpu));
        let (c, events) = record(false, || a.matmul(&b)).unwrap();
        assert_eq!(c.size(), vec![3, 7]);
        let mm = events.iter().find(|e| e.name == "aten::mm").expect("aten::mm recorded");
        assert_eq!(mm.shapes, "[3,5][5,7]");
        assert!(mm.has_dim(7) && !mm.has_dim(4));
        assert!(!mm.is_device_work());
    }
}
