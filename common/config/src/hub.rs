//! Models where users keep them: `model.target_path` is a model directory,
//! or a Hugging Face repo id (`ORG/NAME`, optionally `@REVISION`) found
//! offline in this host's hub cache, laid out as `huggingface_hub` writes
//! it: `HUB/models--ORG--NAME/snapshots/COMMIT/`, with `refs/REVISION`
//! holding the commit a branch or tag points at. Each role resolves it on
//! its own host, so every host may keep its own cache.

use std::path::{Path, PathBuf};

/// The hub cache of this host: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`
/// (huggingface_hub's order).
pub fn hub_cache() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("HF_HUB_CACHE") {
        return p;
    }
    if let Some(p) = var("HF_HOME") {
        return p.join("hub");
    }
    let cache = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache"))).unwrap_or_default();
    cache.join("huggingface").join("hub")
}

/// The directory `spec` names: itself when it is a directory, else the
/// snapshot of the repo id in this host's hub cache.
pub fn resolve_model_dir(spec: &str) -> Result<PathBuf, String> {
    resolve_in(spec, &hub_cache())
}

/// [`resolve_model_dir`] against the hub cache at `hub`.
pub fn resolve_in(spec: &str, hub: &Path) -> Result<PathBuf, String> {
    let as_path = Path::new(spec);
    if as_path.is_dir() {
        return Ok(as_path.to_path_buf());
    }
    let Some((org, name, revision)) = repo_id(spec) else {
        return Err(format!("{spec} is not a directory (nor a Hugging Face repo id ORG/NAME[@REVISION])"));
    };
    let repo = hub.join(format!("models--{org}--{name}"));
    let where_from = || {
        format!(
            "{spec} is not a directory, and the Hugging Face cache at {} has no {}: download it there \
             (`huggingface-cli download {org}/{name}`) or set HF_HOME / HF_HUB_CACHE",
            hub.display(),
            repo.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
        )
    };
    if !repo.is_dir() {
        return Err(where_from());
    }
    let snapshots = repo.join("snapshots");
    let commit = if is_commit(revision) {
        revision.to_string()
    } else {
        let r = repo.join("refs").join(revision);
        match std::fs::read_to_string(&r) {
            Ok(c) => c.trim().to_string(),
            Err(_) if revision == "main" => only_snapshot(&snapshots)?,
            Err(e) => return Err(format!("{spec}: revision {revision} is not in the cache ({}: {e})", r.display())),
        }
    };
    let dir = snapshots.join(&commit);
    if !dir.is_dir() {
        return Err(format!("{spec}: the cache has no snapshot {} (revision {revision})", dir.display()));
    }
    if !dir.join("config.json").exists() {
        return Err(format!("{spec}: snapshot {} holds no config.json (an incomplete download?)", dir.display()));
    }
    Ok(dir)
}

/// `ORG/NAME[@REVISION]` (revision `main` when absent).
fn repo_id(spec: &str) -> Option<(&str, &str, &str)> {
    let (id, revision) = spec.split_once('@').unwrap_or((spec, "main"));
    let (org, name) = id.split_once('/')?;
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    (ok(org) && ok(name) && !revision.is_empty() && !revision.contains("..")).then_some((org, name, revision))
}

fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// The one snapshot of a repo cached without refs (e.g. copied by hand).
fn only_snapshot(snapshots: &Path) -> Result<String, String> {
    let names: Vec<String> = std::fs::read_dir(snapshots)
        .map_err(|e| format!("{}: {e} (no snapshot)", snapshots.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(format!("{}: no snapshot", snapshots.display())),
        many => Err(format!(
            "{}: no refs/main and {} snapshots ({}): name one as ORG/NAME@COMMIT",
            snapshots.display(),
            many.len(),
            many.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(hub: &Path, repo: &str, commit: &str, refs_main: bool) -> PathBuf {
        let r = hub.join(repo);
        let snap = r.join("snapshots").join(commit);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        if refs_main {
            std::fs::create_dir_all(r.join("refs")).unwrap();
            std::fs::write(r.join("refs/main"), format!("{commit}\n")).unwrap();
        }
        snap
    }

    #[test]
    fn repo_ids_resolve_to_their_snapshot_and_directories_to_themselves() {
        let hub = tempfile::tempdir().unwrap();
        let c1 = "0123456789abcdef0123456789abcdef01234567";
        let snap = cached(hub.path(), "models--acme--tiny-3B", c1, true);
        assert_eq!(resolve_in("acme/tiny-3B", hub.path()).unwrap(), snap);
        assert_eq!(resolve_in(&format!("acme/tiny-3B@{c1}"), hub.path()).unwrap(), snap);
        // A branch other than main, by its ref.
        let c2 = "fedcba9876543210fedcba9876543210fedcba98";
        let other = cached(hub.path(), "models--acme--tiny-3B", c2, false);
        std::fs::write(hub.path().join("models--acme--tiny-3B/refs/v2"), c2).unwrap();
        assert_eq!(resolve_in("acme/tiny-3B@v2", hub.path()).unwrap(), other);
        // A directory is itself, whatever the cache holds.
        let dir = snap.display().to_string();
        assert_eq!(resolve_in(&dir, hub.path()).unwrap(), snap);
        // No refs: the only snapshot.
        let lone = cached(hub.path(), "models--acme--lone", "abc", false);
        assert_eq!(resolve_in("acme/lone", hub.path()).unwrap(), lone);
    }

    #[test]
    fn what_the_cache_lacks_is_named() {
        let hub = tempfile::tempdir().unwrap();
        let e = resolve_in("acme/missing", hub.path()).unwrap_err();
        assert!(e.contains("models--acme--missing") && e.contains("huggingface-cli download acme/missing"), "{e}");
        std::fs::create_dir_all(hub.path().join("models--acme--empty/snapshots")).unwrap();
        let e = resolve_in("acme/empty", hub.path()).unwrap_err();
        assert!(e.contains("no snapshot") && e.contains("models--acme--empty"), "{e}");
        cached(hub.path(), "models--acme--two", "a1", false);
        cached(hub.path(), "models--acme--two", "b2", false);
        let e = resolve_in("acme/two", hub.path()).unwrap_err();
        assert!(e.contains("2 snapshots") && e.contains("ORG/NAME@COMMIT"), "{e}");
        let e = resolve_in("acme/two@v9", hub.path()).unwrap_err();
        assert!(e.contains("revision v9 is not in the cache"), "{e}");
        let r = hub.path().join("models--acme--half");
        std::fs::create_dir_all(r.join("snapshots/c1")).unwrap();
        std::fs::create_dir_all(r.join("refs")).unwrap();
        std::fs::write(r.join("refs/main"), "c1").unwrap();
        let e = resolve_in("acme/half", hub.path()).unwrap_err();
        assert!(e.contains("holds no config.json"), "{e}");
        let e = resolve_in("/no/such/dir", hub.path()).unwrap_err();
        assert!(e.contains("is not a directory"), "{e}");
        assert!(resolve_in("../x", hub.path()).unwrap_err().contains("not a directory"));
    }
}
