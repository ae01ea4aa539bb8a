//! A drafter group: several `dflash-drafter serve` processes train one
//! drafter together (data parallel over libtorch's Gloo on CPU), the
//! coordinator dealing each batch to one member, targets streaming to each
//! member directly. A member lost ends the generation; the others leave and
//! join the next (exit code 75, started again by their supervisor, here the
//! test), which resumes from the last committed checkpoint at whatever size
//! the group has then -- smaller, and again larger when a replacement comes.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dflash_coordinator::ledger::Ledger;
use dflash_tests::{Cluster, Proc, Workspace, free_port};
use nix::sys::signal::Signal;

/// Every batch committed exactly once; returns how many each member trained.
fn audit(ledger: &std::path::Path, batches: usize) -> BTreeMap<String, usize> {
    let l = Ledger::open(ledger).unwrap();
    let audit = l.audit().unwrap();
    assert_eq!(audit.len(), batches);
    let mut by_member = BTreeMap::new();
    for a in &audit {
        assert_eq!((a.state.as_str(), a.commits), ("committed", 1), "{a:?}");
        *by_member.entry(a.member.clone().unwrap_or_default()).or_insert(0) += 1;
    }
    by_member
}

const GROUP: &str = "[run]\nmax_steps = 30\n[checkpoint]\ninterval_steps = 5\n[pipeline]\nmax_batch_size = 4\n\
                     token_budget = 512\n[faults]\ninstance_timeout_ms = 3000\n";

#[test]
fn two_drafter_processes_train_one_drafter_with_two_targets() {
    let ws = Workspace::synthetic(600, 3);
    let config = ws.config("group", &format!("{GROUP}[group]\nsize = 2\ncollective_timeout_ms = 20000\n"));
    let cluster = Cluster::new(&ws, config);
    let mut coord = cluster.coordinator(&[]);
    let mut a = cluster.drafter_at("drafter-a", free_port());
    let mut b = cluster.drafter_at("drafter-b", free_port());
    let mut t0 = cluster.target("target-0");
    let mut t1 = cluster.target("target-1");
    assert!(coord.expect_exit(Duration::from_secs(240)).success(), "{}", coord.log_text());
    for p in [&mut a, &mut b, &mut t0, &mut t1] {
        let s = p.expect_exit(Duration::from_secs(30));
        assert!(s.success(), "{} exited with {s}:\n{}", p.name, p.log_text());
    }
    let (la, lb) = (a.log_text(), b.log_text());
    let leader = if la.contains("rank 0 of world 2") { &la } else { &lb };
    assert!(
        la.contains("of world 2 (2 member(s)") && lb.contains("of world 2 (2 member(s)"),
        "both members in one generation:\n{la}\n{lb}"
    );
    // Checked at every checkpoint interval: the members' weights agree.
    assert!(leader.contains("weights identical on all 2 replicas"), "{leader}");
    assert!(coord.log_text().contains("drafter group generation 1 formed with 2 member(s)"), "{}", coord.log_text());
    // 30 steps of two batches; each member trained its half.
    let by_member = audit(&cluster.ledger, 60);
    assert_eq!(by_member.len(), 2, "{by_member:?}");
    assert!(by_member.values().all(|&n| n == 30), "{by_member:?}");
}

/// A plan far over gRPC's 4 MiB message limit (40,000 samples over 20
/// epochs: 200,000 batches, about 5.8 MB as one message) and deals over
/// one page (100,000 batches a member) reach both members in pages, and the
/// group trains. One message, as before protocol 7, failed the drafter:
/// "decoded message length too large".
#[test]
fn a_plan_and_deals_over_grpcs_message_limit_reach_the_members_in_pages() {
    let ws = Workspace::synthetic(40_000, 3);
    let config = ws.config(
        "long-plan",
        "[run]\nmax_steps = 0\nepochs = 20\n[pipeline]\nmax_batch_size = 4\ntoken_budget = 512\n[faults]\ninstance_timeout_ms = 3000\n\
         [group]\nsize = 2\ncollective_timeout_ms = 20000\n",
    );
    let cluster = Cluster::new(&ws, config);
    let mut coord = cluster.coordinator(&[]);
    let mut a = cluster.drafter_at("drafter-a", free_port());
    let mut b = cluster.drafter_at("drafter-b", free_port());
    let _target = cluster.target("target-0");
    // Both members hold the whole plan and their deal, and train together
    // (the run itself is far longer than the test: it ends with the test).
    for m in [&mut a, &mut b] {
        assert!(m.wait_for_log("batch(es) of the plan", Duration::from_secs(120)), "{}:\n{}", m.name, m.log_text());
    }
    let leader = if a.log_text().contains("rank 0 of world 2") { &mut a } else { &mut b };
    assert!(leader.wait_for_log("step 3/", Duration::from_secs(120)), "{}", leader.log_text());
    let log = coord.log_text();
    let planned: usize = log
        .lines()
        .find(|l| l.contains(" batches over "))
        .and_then(|l| l.split("plan: ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no plan line:\n{log}"));
    assert!(planned > 150_000, "{planned} batches");
    for m in [&a, &b] {
        let text = m.log_text();
        assert!(text.contains(&format!("plan: {planned} batches")), "{text}");
        assert!(text.contains(&format!("train {} batch(es) of the plan", planned / 2)), "{text}");
    }
    assert!(coord.wait_for(Duration::ZERO).is_none(), "{log}");
}

/// One member slot: the process now in it, and how many it has had.
struct Slot {
    port: u16,
    name: &'static str,
    proc: Option<Proc>,
    starts: u32,
}

impl Slot {
    fn start(&mut self, cluster: &Cluster) {
        self.starts += 1;
        self.proc = Some(cluster.drafter_at(&format!("{}-{}", self.name, self.starts), self.port));
    }

    /// Starts the slot's drafter again if it left its group (exit 75), as
    /// its supervisor would; true while it runs.
    fn supervise(&mut self, cluster: &Cluster) -> bool {
        let Some(p) = self.proc.as_mut() else { return false };
        match p.child.try_wait().unwrap() {
            None => true,
            Some(s) if s.code() == Some(75) => {
                self.start(cluster);
                true
            }
            Some(s) => {
                assert!(s.success(), "{} exited with {s}:\n{}", p.name, p.log_text());
                false
            }
        }
    }
}

#[test]
fn a_killed_member_ends_its_generation_the_group_shrinks_then_grows_back() {
    let ws = Workspace::synthetic(600, 3);
    let group = "[group]\nsize = 2\nmin_size = 1\nwait_ms = 1500\ncollective_timeout_ms = 20000\n";
    // The whole epoch (150 batches): the group of one must still have work
    // when its replacement arrives, or the run ends before it grows back.
    let steps = GROUP.replace("max_steps = 30", "max_steps = 75");
    let cluster = Cluster::new(&ws, ws.config("group-loss", &format!("{steps}{group}")));
    let mut coord = cluster.coordinator(&[]);
    let mut slots = [("drafter-a"), ("drafter-b")].map(|name| Slot { port: free_port(), name, proc: None, starts: 0 });
    for s in &mut slots {
        s.start(&cluster);
    }
    let mut t0 = cluster.target("target-0");
    let mut t1 = cluster.target("target-1");
    let coord_log = |c: &Proc, needle: &str| c.log_text().contains(needle);
    let deadline = Instant::now() + Duration::from_secs(240);
    // Phase 1: both train; kill b after the first checkpoint.
    while !coord_log(&coord, "checkpoint at step 10 committed") {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        slots.iter_mut().for_each(|s| {
            s.supervise(&cluster);
        });
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Instant::now();
    slots[1].proc.as_ref().unwrap().signal(Signal::SIGKILL);
    slots[1].proc.as_mut().unwrap().expect_exit(Duration::from_secs(5));
    slots[1].proc = None;
    // Phase 2: a leaves (75), comes back alone; after group.wait_ms the
    // group goes on with one member.
    while !coord_log(&coord, "generation 2 formed with 1 member(s)") {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        slots[0].supervise(&cluster);
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("member SIGKILL to the group of one formed: {:.2} s", killed.elapsed().as_secs_f64());
    // Phase 3: the replacement arrives; the group grows back to two.
    slots[1].start(&cluster);
    while coord.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        slots.iter_mut().for_each(|s| {
            s.supervise(&cluster);
        });
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = coord.log_text();
    assert!(coord.expect_exit(Duration::from_secs(1)).success(), "{log}");
    assert!(log.contains("formed with 2 member(s)") && log.matches("formed with").count() >= 3, "{log}");
    for s in &mut slots {
        if let Some(p) = s.proc.as_mut() {
            let st = p.expect_exit(Duration::from_secs(30));
            assert!(st.success() || st.code() == Some(75), "{} exited with {st}:\n{}", p.name, p.log_text());
        }
    }
    for t in [&mut t0, &mut t1] {
        assert!(t.expect_exit(Duration::from_secs(30)).success(), "{}", t.log_text());
    }
    assert!(slots[0].starts >= 3, "a left and came back twice ({} starts)", slots[0].starts);
    // Whatever the world size of each stretch, every batch once.
    let by_member = audit(&cluster.ledger, 150);
    assert!(by_member.len() >= 3, "{by_member:?}");
}

fn sha256(path: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(std::fs::read(path).unwrap()).iter().map(|b| format!("{b:02x}")).collect()
}

/// What happens to a group run after the checkpoint of step 10 commits.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    /// Member b is SIGKILLed and a replacement started at once (the world
    /// size stays the same).
    KillMember,
}

/// The group config: `size` members, each training on `devices`.
fn group_config(ws: &Workspace, name: &str, size: usize, devices: &str) -> std::path::PathBuf {
    let extra =
        format!("{GROUP}[group]\nsize = {size}\ncollective_timeout_ms = 20000\n[devices]\ndrafter = \"{devices}\"\n");
    ws.config(name, &extra)
}

/// Runs `cluster` to the end with `size` member slots supervised as a
/// restarting supervisor would, two targets, and `fault` after step 10.
/// Returns the coordinator's log.
fn run_group(cluster: &Cluster, size: usize, fault: Fault) -> String {
    let mut coord = cluster.coordinator(&[]);
    let names = ["drafter-a", "drafter-b", "drafter-c"];
    let mut slots: Vec<Slot> =
        names[..size].iter().map(|&name| Slot { port: free_port(), name, proc: None, starts: 0 }).collect();
    for s in &mut slots {
        s.start(cluster);
    }
    let mut targets = [cluster.target("target-0"), cluster.target("target-1")];
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut faulted = fault == Fault::None;
    while coord.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        if !faulted && coord.log_text().contains("checkpoint at step 10 committed") {
            slots[1].proc.as_ref().unwrap().signal(Signal::SIGKILL);
            slots[1].proc.as_mut().unwrap().expect_exit(Duration::from_secs(5));
            slots[1].start(cluster);
            faulted = true;
        }
        slots.iter_mut().for_each(|s| {
            s.supervise(cluster);
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = coord.log_text();
    assert!(coord.expect_exit(Duration::from_secs(1)).success(), "{log}");
    for t in &mut targets {
        assert!(t.expect_exit(Duration::from_secs(30)).success(), "{}", t.log_text());
    }
    for s in &mut slots {
        if let Some(p) = s.proc.as_mut() {
            let st = p.expect_exit(Duration::from_secs(30));
            assert!(st.success() || st.code() == Some(75), "{} exited with {st}:\n{}", p.name, p.log_text());
        }
    }
    log
}

/// The sha256 of the final checkpoint's weights.
fn final_weights(ws: &Workspace) -> String {
    let root = ws.path("checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).unwrap();
    sha256(&root.join(latest.trim()).join("model.safetensors"))
}

/// The final weights of a run of `size` members on `devices` each.
fn group_run(size: usize, devices: &str, fault: Fault) -> String {
    let ws = Workspace::synthetic(600, 3);
    let cluster = Cluster::new(&ws, group_config(&ws, "group-det", size, devices));
    let log = run_group(&cluster, size, fault);
    if fault == Fault::KillMember {
        assert!(log.contains("generation 2 formed with"), "{log}");
    }
    audit(&cluster.ledger, 60);
    final_weights(&ws)
}

/// Two members of one device each until the checkpoint of step 10, then
/// every process SIGKILLed; the run resumed by one member of two devices
/// (another config, the same world size) on the same ledger and checkpoints.
/// The leases the dead targets held end one instance timeout after the new
/// coordinator starts (not after the 120 s lease), so the second half runs
/// in seconds.
fn switched_run() -> String {
    let ws = Workspace::synthetic(600, 3);
    let first = Cluster::new(&ws, group_config(&ws, "group-det", 2, "cpu"));
    let mut coord = first.coordinator(&[]);
    let mut procs = [
        first.drafter_at("drafter-a", free_port()),
        first.drafter_at("drafter-b", free_port()),
        first.target("target-0"),
        first.target("target-1"),
    ];
    assert!(coord.wait_for_log("checkpoint at step 10 committed", Duration::from_secs(240)), "{}", coord.log_text());
    for p in procs.iter_mut().chain([&mut coord]) {
        p.signal(Signal::SIGKILL);
        p.expect_exit(Duration::from_secs(5));
    }
    let second = Cluster::new(&ws, group_config(&ws, "group-det", 1, "cpu,cpu"));
    let started = Instant::now();
    let log = run_group(&second, 1, Fault::None);
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}:\n{log}", started.elapsed());
    assert!(log.contains("generation 1 formed with 1 member(s), world 2"), "{log}");
    // It resumed mid-run (not after the last step): the second half was
    // trained by the member of two replicas.
    let resumed = log.lines().find_map(|l| l.split(" starts from step ").nth(1)).unwrap_or_default();
    let step: u64 = resumed.split_whitespace().next().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX);
    assert!((10..30).contains(&step), "resumed from step {step}:\n{log}");
    audit(&second.ledger, 60);
    final_weights(&ws)
}

/// At a fixed world size the group's weights are a function of config,
/// data and seed: step k trains the k-th batch dealt to each rank, whatever
/// the timing, a member lost and replaced, or how the ranks are spread over
/// members -- two of one device, or one of two devices, also when a run
/// stopped as one and is resumed as the other. What the world size changes
/// is which batches meet in one step (the deal, i mod world), nothing else.
#[test]
fn at_a_fixed_world_size_the_weights_do_not_depend_on_timing_faults_or_topology() {
    let calm = group_run(2, "cpu", Fault::None);
    assert_eq!(group_run(2, "cpu", Fault::KillMember), calm, "a run that lost a member and took a replacement");
    assert_eq!(group_run(1, "cpu,cpu", Fault::None), calm, "one member of two replicas");
    assert_eq!(switched_run(), calm, "two members of one device resumed as one member of two");
}

/// Members that own several devices: two members of two CPU replicas each
/// form one group of four ranks; every replica's weights stay identical; a
/// member SIGKILLed mid-run and replaced takes both its ranks back.
#[test]
fn members_with_two_replicas_each_train_as_one_group_of_four_ranks() {
    let ws = Workspace::synthetic(600, 3);
    let extra = GROUP.replace("max_steps = 30", "max_steps = 20");
    let extra = format!("{extra}[group]\nsize = 2\ncollective_timeout_ms = 20000\n[devices]\ndrafter = \"cpu,cpu\"\n");
    let cluster = Cluster::new(&ws, ws.config("group-4", &extra));
    let log = run_group(&cluster, 2, Fault::KillMember);
    assert!(log.contains("generation 1 formed with 2 member(s), world 4: ranks 0-1 "), "{log}");
    assert!(log.contains(", ranks 2-3 "), "{log}");
    assert!(log.contains("generation 2 formed with 2 member(s), world 4"), "{log}");
    let first = ["drafter-a-1", "drafter-b-1"].map(|n| std::fs::read_to_string(ws.path(&format!("{n}.log"))).unwrap());
    let (leader, other) = if first[0].contains("ranks 0-1 of world 4") { (0, 1) } else { (1, 0) };
    assert!(first[leader].contains("ranks 0-1 of world 4"), "{}", first[leader]);
    assert!(first[other].contains("ranks 2-3 of world 4"), "{}", first[other]);
    assert!(first[leader].contains("weights identical on all 4 replicas"), "{}", first[leader]);
    // 20 steps of four batches, every batch once. Two members in each of
    // the two generations (a leaves and comes back, b is replaced), and
    // each commits whole checkpoint intervals of its two ranks: 5 steps x 2.
    let by_member = audit(&cluster.ledger, 80);
    assert_eq!(by_member.len(), 4, "{by_member:?}");
    assert!(by_member.values().all(|&n| n > 0 && n % 10 == 0), "{by_member:?}");
}

/// A member whose device breaks for good (the device-fault hook, from a
/// file, makes its probe fail from mid-run on) leaves the group with a named
/// error and exit 76 -- at once, or after one re-formation, whichever way
/// its generation ended first -- and a supervisor that starts it again sees
/// it leave at start, before it joins: no loop of re-formations. The group
/// goes on without it and the run completes, every batch once.
#[test]
fn a_member_whose_device_breaks_for_good_leaves_and_the_group_goes_on_without_it() {
    let ws = Workspace::synthetic(600, 3);
    let group = "[group]\nsize = 2\nmin_size = 1\nwait_ms = 1500\ncollective_timeout_ms = 20000\n";
    let steps = GROUP.replace("max_steps = 30", "max_steps = 75");
    let cluster = Cluster::new(&ws, ws.config("device-lost", &format!("{steps}{group}")));
    let fault = ws.path("b-device-fault");
    let hook = format!("@{}", fault.display());
    let mut coord = cluster.coordinator(&[]);
    let (port_a, port_b) = (free_port(), free_port());
    let start_b = |n: u32| {
        let cmd = cluster.local.drafter(&cluster.coordinator_url, &format!("127.0.0.1:{port_b}"));
        Proc::start_command(&format!("drafter-b-{n}"), &cmd, &[("DFLASH_FAULT_DEVICE", hook.as_str())], &ws.path(""))
    };
    let mut a = Slot { port: port_a, name: "drafter-a", proc: None, starts: 0 };
    a.start(&cluster);
    let mut b = start_b(1);
    let _t0 = cluster.target("target-0");
    let _t1 = cluster.target("target-1");
    let deadline = Instant::now() + Duration::from_secs(240);
    while !coord.log_text().contains("checkpoint at step 10 committed") {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        a.supervise(&cluster);
        assert!(b.child.try_wait().unwrap().is_none(), "{}", b.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    // b's device breaks; a is lost at the same moment, which ends the
    // generation and sends b through its failure path.
    std::fs::write(&fault, "cpu").unwrap();
    a.proc.as_ref().unwrap().signal(Signal::SIGKILL);
    a.proc.as_mut().unwrap().expect_exit(Duration::from_secs(5));
    a.proc = None;
    let mut b_starts = 1;
    let status = loop {
        let st = b.expect_exit(Duration::from_secs(60));
        if st.code() == Some(75) && b_starts == 1 {
            // Its generation ended before it probed: a supervisor starts it
            // again, and it leaves at start.
            b_starts += 1;
            b = start_b(b_starts);
            continue;
        }
        break st;
    };
    assert_eq!(status.code(), Some(76), "{}", b.log_text());
    assert!(b.log_text().contains("cpu: injected device fault"), "{}", b.log_text());
    // A supervisor that starts it once more: it leaves before joining.
    let mut again = start_b(b_starts + 1);
    assert_eq!(again.expect_exit(Duration::from_secs(60)).code(), Some(76));
    assert!(again.log_text().contains("fails its probe at start"), "{}", again.log_text());
    // a comes back; the group goes on with one member and completes.
    a.start(&cluster);
    while coord.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "{}", coord.log_text());
        a.supervise(&cluster);
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = coord.log_text();
    assert!(coord.expect_exit(Duration::from_secs(1)).success(), "{log}");
    assert!(log.contains("formed with 1 member(s)"), "{log}");
    let by_member = audit(&cluster.ledger, 150);
    assert!(by_member.len() >= 2, "{by_member:?}");
}
