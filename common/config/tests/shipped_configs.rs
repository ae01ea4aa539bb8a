//! Every config under `deploy/configs` loads and validates: a renamed or
//! mistyped field there would otherwise surface only when someone runs it.

use std::path::Path;

use dflash_config::ConfigLoader;

#[test]
fn every_shipped_config_loads_and_validates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("deploy/configs exists") {
        let path = entry.expect("readable entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let config =
            ConfigLoader::new().env(false).file(&path).load().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if let Err(e) = config.validate() {
            panic!("{}: {e}", path.display());
        }
        seen += 1;
    }
    assert!(seen >= 5, "found only {seen} configs in {}", dir.display());
}
