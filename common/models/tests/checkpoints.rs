//! Checkpoints a resume can trust: every file covered by a manifest of
//! sizes and sha256, damage found and named before anything is trained on
//! it, and what failed or killed writes leave behind cleaned up.

#![allow(clippy::unwrap_used)] // tests panic on failure by design

use std::path::Path;

use dflash_models::blocks::BlockSettings;
use dflash_models::checkpoint::{
    CheckpointSnapshot, MANIFEST, TrainerState, remove_stale_temporaries, restore_checkpoint, save_checkpoint,
    set_aside, step_dirs, verify_checkpoint,
};
use dflash_models::optim::{AdamWSettings, LrSchedule};
use dflash_models::synthetic::synthetic_target_config;
use dflash_models::{DeviceBatch, Drafter, DrafterConfig, StepOutcome, TrainSettings, Trainer};
use tch::{Device, Kind, Tensor};

fn trainer(seed: i64) -> Trainer {
    trainer_on(seed, Device::Cpu, Kind::Float)
}

fn trainer_on(seed: i64, device: Device, kind: Kind) -> Trainer {
    let tc = synthetic_target_config(2);
    tch::manual_seed(seed);
    let dc = DrafterConfig::for_target(&tc, 1, 4, 3, vec![0, 1]);
    let drafter = Drafter::new(dc, device, kind);
    tch::manual_seed(1);
    let embed = Tensor::randn([tc.vocab_size, tc.hidden_size], (kind, device));
    let head = Tensor::randn([tc.vocab_size, tc.hidden_size], (kind, device)) * 0.1;
    let settings = TrainSettings {
        blocks: BlockSettings { block_size: 4, mask_token_id: 3, gamma: 4.0, anchors_per_sequence: 6 },
        schedule: LrSchedule::new(1e-2, 100, 0.0, 0.0),
        adamw: AdamWSettings { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        grad_clip: 0.0,
        max_blocks_per_micro_batch: 64,
        loss_chunk_blocks: 3,
        attention_chunk_blocks: 4,
        context_pad_multiple: 1,
        seed: 5,
        objective: dflash_models::Objective::CrossEntropy,
        selector_loss_weight: 0.0,
    };
    Trainer::new(drafter, embed, head, settings)
}

fn batch(id: u64) -> DeviceBatch {
    let lens = [23u32, 17];
    let t: usize = lens.iter().map(|&l| l as usize).sum();
    tch::manual_seed(id as i64);
    DeviceBatch {
        batch_id: id,
        features: Tensor::randn([t as i64, 2 * 64], (Kind::Float, Device::Cpu)),
        input_ids: (0..t as u32).map(|i| 20 + (i * 7) % 200).collect(),
        loss_mask: vec![1; t],
        seq_lengths: lens.to_vec(),
        target_top_k: None,
        landing: None,
        trace_context: Default::default(),
    }
}

fn trained(steps: u64) -> Trainer {
    let mut t = trainer(11);
    for i in 0..steps {
        assert!(matches!(t.train_batch(&batch(i)), StepOutcome::Trained(_)));
    }
    t
}

fn state(t: &Trainer) -> TrainerState {
    TrainerState { step: t.step(), batch_ids: (0..t.step()).collect(), run_config: String::new(), run_id: "r".into() }
}

fn params(t: &Trainer) -> Vec<(String, Tensor)> {
    t.drafter().named_parameters()
}

#[test]
fn a_checkpoint_restores_exactly_and_its_content_hash_is_stable() {
    let root = tempfile::tempdir().unwrap();
    let t = trained(3);
    let ck = save_checkpoint(root.path(), &t, &state(&t), 0).unwrap();
    assert_eq!(ck.dir, root.path().join("step-00000003"));
    let verified = verify_checkpoint(&ck.dir).unwrap();
    assert_eq!(verified, ck, "the hash written is the hash verified");
    let mut fresh = trainer(99);
    let s = restore_checkpoint(&ck.dir, &mut fresh).unwrap();
    assert_eq!((s.step, fresh.step()), (3, 3));
    for ((n, a), (_, b)) in params(&t).iter().zip(params(&fresh)) {
        assert!(a.equal(&b), "{n} differs after a restore");
    }
    // The same training written twice has the same content.
    let root2 = tempfile::tempdir().unwrap();
    assert_eq!(save_checkpoint(root2.path(), &t, &state(&t), 0).unwrap().content_hash, ck.content_hash);
}

#[test]
fn a_snapshot_is_a_copy_written_while_the_trainer_steps_on() {
    let mut t = trained(3);
    let snapshot = CheckpointSnapshot::take(&t, state(&t)).unwrap();
    assert!(snapshot.bytes() > 0);
    // Training goes on in place (weights, master weights, moments) before
    // the snapshot is written, and while another thread writes it.
    for i in 3..5 {
        assert!(matches!(t.train_batch(&batch(i)), StepOutcome::Trained(_)));
    }
    let root = tempfile::tempdir().unwrap();
    let path = root.path().to_path_buf();
    let writer = std::thread::spawn(move || snapshot.save(&path, 0));
    assert!(matches!(t.train_batch(&batch(5)), StepOutcome::Trained(_)));
    let ck = writer.join().unwrap().unwrap();
    assert_eq!(ck.step, 3);
    // It holds step 3 exactly: what writing a trainer at step 3 holds.
    let reference = tempfile::tempdir().unwrap();
    let three = trained(3);
    assert_eq!(save_checkpoint(reference.path(), &three, &state(&three), 0).unwrap().content_hash, ck.content_hash);
    let mut fresh = trainer(99);
    restore_checkpoint(&ck.dir, &mut fresh).unwrap();
    for ((n, a), (_, b)) in params(&three).iter().zip(params(&fresh)) {
        assert!(a.equal(&b), "{n} is not step 3's after a restore");
    }
}

/// A GPU trainer's snapshot goes into pinned host buffers, which the next
/// snapshot reuses (refilled with the new values), and its checkpoint
/// holds the trainer's values exactly.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_snapshots_go_into_pinned_buffers_that_the_next_reuses() {
    dflash_models::cuda::ensure_cuda(&[0]).unwrap();
    let gpu = Device::Cuda(0);
    let t = trainer_on(11, gpu, Kind::BFloat16);
    let first = CheckpointSnapshot::take(&t, state(&t)).unwrap();
    let pointers: Vec<usize> = first.tensors().map(|(_, h)| h.data_ptr() as usize).collect();
    for (name, h) in first.tensors() {
        assert!(h.is_pinned(gpu), "{name} is not in pinned memory");
    }
    let snapshot = CheckpointSnapshot::take_into(&t, state(&t), first.into_buffers()).unwrap();
    let again: Vec<usize> = snapshot.tensors().map(|(_, h)| h.data_ptr() as usize).collect();
    assert_eq!(again, pointers, "the second snapshot reuses the first's buffers");
    // Changed weights are what the reused buffers hold next.
    tch::no_grad(|| {
        for (_, p) in params(&t) {
            let _ = p.shallow_clone().f_add_scalar_(0.5).unwrap();
        }
    });
    let snapshot = CheckpointSnapshot::take_into(&t, state(&t), snapshot.into_buffers()).unwrap();
    let root = tempfile::tempdir().unwrap();
    let ck = snapshot.save(root.path(), 0).unwrap();
    assert_eq!(verify_checkpoint(&ck.dir).unwrap(), ck);
    let written: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(ck.dir.join("model.safetensors")).unwrap().into_iter().collect();
    for (n, p) in params(&t) {
        assert!(written[&n].equal(&p.to_device(Device::Cpu)), "{n}: the checkpoint holds other values");
    }
}

#[test]
fn damaged_or_incomplete_checkpoints_are_named() {
    let t = trained(1);
    for (file, damage) in [
        ("model.safetensors", "truncate"),
        ("optimizer.safetensors", "truncate"),
        ("trainer_state.json", "edit"),
        ("config.json", "remove"),
        (MANIFEST, "remove"),
    ] {
        let root = tempfile::tempdir().unwrap();
        let ck = save_checkpoint(root.path(), &t, &state(&t), 0).unwrap();
        let p = ck.dir.join(file);
        match damage {
            "truncate" => {
                let len = std::fs::metadata(&p).unwrap().len();
                std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len - 1).unwrap();
            }
            "edit" => {
                let text = std::fs::read_to_string(&p).unwrap().replace("\"step\":1", "\"step\":7");
                std::fs::write(&p, text).unwrap();
            }
            _ => std::fs::remove_file(&p).unwrap(),
        }
        let err = verify_checkpoint(&ck.dir).unwrap_err().to_string();
        assert!(err.contains(file), "{file} ({damage}): {err}");
    }
}

#[test]
fn failed_writes_leave_nothing_behind_and_earlier_checkpoints_stay() {
    let root = tempfile::tempdir().unwrap();
    let t = trained(2);
    let first = save_checkpoint(root.path(), &t, &state(&t), 0).unwrap();
    // A later write that fails once its files are written: a file stands
    // where its step directory must go.
    let t3 = trained(3);
    let tmp = root.path().join(format!(".tmp-step-00000003-{}", std::process::id()));
    std::fs::write(root.path().join("step-00000003"), b"not a directory").unwrap();
    assert!(save_checkpoint(root.path(), &t3, &state(&t3), 0).is_err());
    assert!(!tmp.exists(), "the failed write removed its temporary folder");
    verify_checkpoint(&first.dir).unwrap();
    std::fs::remove_file(root.path().join("step-00000003")).unwrap();

    // What a killed write leaves is cleaned at the next start.
    std::fs::create_dir_all(root.path().join(".tmp-step-00000009-4242")).unwrap();
    std::fs::write(root.path().join(".latest.tmp"), b"step-00000009").unwrap();
    let removed = remove_stale_temporaries(root.path()).unwrap();
    assert_eq!(removed.len(), 2);
    assert!(remove_stale_temporaries(root.path()).unwrap().is_empty());
}

#[test]
fn unusable_checkpoints_are_set_aside_out_of_resuming_and_pruning() {
    let root = tempfile::tempdir().unwrap();
    let t = trained(1);
    let a = save_checkpoint(root.path(), &t, &state(&t), 0).unwrap();
    let t2 = trained(2);
    let b = save_checkpoint(root.path(), &t2, &state(&t2), 0).unwrap();
    let names = |root: &Path| step_dirs(root).unwrap().into_iter().map(|(s, _)| s).collect::<Vec<_>>();
    assert_eq!(names(root.path()), vec![2, 1], "newest first");
    let aside = set_aside(&b.dir).unwrap();
    assert_eq!(aside.file_name().unwrap(), "unusable-step-00000002");
    assert_eq!(names(root.path()), vec![1]);
    // Pruning keeps the newest step directories, never counting set-aside ones.
    let t3 = trained(3);
    save_checkpoint(root.path(), &t3, &state(&t3), 1).unwrap();
    assert_eq!(names(root.path()), vec![3]);
    assert!(aside.is_dir() && !a.dir.exists());
}

/// Runs the test `test` again inside a new user and mount namespace
/// (`unshare`, no root needed) with a tmpfs of `size` mounted on a new
/// folder: None here once that run passed, the folder in that run. (The
/// integration tests' `dflash_tests::on_small_disk`, which this crate
/// cannot depend on.)
fn on_small_disk(test: &str, size: &str) -> Option<std::path::PathBuf> {
    const VAR: &str = "DFLASH_TEST_SMALL_DISK";
    if let Some(dir) = std::env::var_os(VAR) {
        return Some(dir.into());
    }
    let dir = tempfile::tempdir().unwrap();
    let script =
        r#"mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97; exec "$3" --exact "$4" --nocapture --test-threads 1"#;
    let out = std::process::Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", size])
        .arg(dir.path())
        .arg(std::env::current_exe().unwrap())
        .arg(test)
        .env(VAR, dir.path())
        .output()
        .unwrap_or_else(|e| panic!("running `unshare` (util-linux), which gives this test a small disk: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("test result: ok. 1 passed"),
        "{test} on a {size} tmpfs in a new user and mount namespace ({}; 97: the mount failed; `unshare` itself \
         failing means no unprivileged user namespaces here):\n{text}",
        out.status
    );
    None
}

/// Bytes in use on the filesystem of `dir`.
fn used(dir: &Path) -> u64 {
    let out = std::process::Command::new("df").args(["--output=used", "-B1"]).arg(dir).output().unwrap();
    String::from_utf8_lossy(&out.stdout).lines().nth(1).unwrap().trim().parse().unwrap()
}

/// Gives the tmpfs at `dir` room for `bytes` in all.
fn resize(dir: &Path, bytes: u64) {
    let out = std::process::Command::new("mount")
        // Named as a tmpfs, or mount(8) passes the options it holds again,
        // uid= among them, which a user namespace refuses.
        .args(["-t", "tmpfs", "-o", &format!("remount,size={}k", bytes.div_ceil(1024)), "tmpfs"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// What a root holds besides its step directories and `latest`.
fn leftovers(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with("step-") && n != "latest")
        .collect()
}

#[test]
fn a_full_disk_fails_the_write_and_leaves_the_last_checkpoint_and_latest_as_they_were() {
    let Some(disk) =
        on_small_disk("a_full_disk_fails_the_write_and_leaves_the_last_checkpoint_and_latest_as_they_were", "16m")
    else {
        return;
    };
    let root = disk.join("checkpoints");
    let (t2, t3) = (trained(2), trained(3));
    let first = save_checkpoint(&root, &t2, &state(&t2), 0).unwrap();
    let before = used(&disk);
    // What step 3 takes, measured by writing it once (then undone).
    let third = save_checkpoint(&root, &t3, &state(&t3), 0).unwrap();
    let step3 = used(&disk) - before;
    std::fs::remove_dir_all(&third.dir).unwrap();
    dflash_models::checkpoint::point_latest(&root, &first.dir).unwrap();
    assert_eq!(used(&disk), before);
    let latest = || std::fs::read_to_string(root.join("latest")).unwrap();

    // Room for half of it: a file of the step finds the disk full.
    // Room for all its files but not for the new `latest` pointer: the
    // step must not be left behind complete, where a resume would find it
    // and commit a checkpoint whose write was reported failed.
    for (room, what) in [(step3 / 2, "half of the step"), (step3, "the step's files but not `latest`")] {
        resize(&disk, before + room);
        let err = save_checkpoint(&root, &t3, &state(&t3), 0).unwrap_err();
        let text = err.to_string();
        assert!(err.is_no_space(), "room for {what}: {text}");
        assert!(text.contains(&root.display().to_string()) && text.contains("No space left on device"), "{text}");
        assert!(!third.dir.exists(), "room for {what}: the failed step is on disk ({text})");
        assert_eq!(leftovers(&root), Vec::<String>::new(), "room for {what}: {text}");
        assert_eq!(used(&disk), before, "room for {what}: the failed write's space came back");
        assert_eq!(latest(), "step-00000002");
        assert_eq!(verify_checkpoint(&first.dir).unwrap(), first);
    }

    // Space again: the same write succeeds.
    resize(&disk, 16 << 20);
    let ck = save_checkpoint(&root, &t3, &state(&t3), 0).unwrap();
    assert_eq!((latest(), verify_checkpoint(&ck.dir).unwrap()), ("step-00000003".into(), ck));
    assert!(leftovers(&root).is_empty());
}
