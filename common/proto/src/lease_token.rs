//! Lease tokens: proof that a batch comes from the target instance it is
//! leased to. The coordinator keeps a secret key per run; a lease carries
//! `HMAC-SHA256(key, run | batch | target instance)` (truncated to 16
//! bytes), the target puts it in the batch's header, and the drafter, which
//! holds the key too, recomputes it for the stream's target instance. A
//! client that holds no lease for a batch cannot make its token, so it
//! cannot have its features trained in the real target's place; checking
//! needs no round trip to the coordinator, so training goes on while the
//! coordinator restarts.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a run's key.
pub const KEY_BYTES: usize = 32;
/// Bytes of a token.
pub const TOKEN_BYTES: usize = 16;

/// The MAC over (run, batch, instance), lengths first so that no two
/// (run, instance) pairs share a message.
fn mac(key: &[u8], run_id: &str, batch_id: u64, target_instance: &str) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(&(run_id.len() as u64).to_le_bytes());
    mac.update(run_id.as_bytes());
    mac.update(&batch_id.to_le_bytes());
    mac.update(&(target_instance.len() as u64).to_le_bytes());
    mac.update(target_instance.as_bytes());
    mac
}

/// The token of `batch_id` leased to `target_instance` in `run_id`.
pub fn lease_token(key: &[u8], run_id: &str, batch_id: u64, target_instance: &str) -> Vec<u8> {
    mac(key, run_id, batch_id, target_instance).finalize().into_bytes()[..TOKEN_BYTES].to_vec()
}

/// Whether `token` is the token of `batch_id` leased to `target_instance`
/// (compared in constant time).
pub fn verify(key: &[u8], run_id: &str, batch_id: u64, target_instance: &str, token: &[u8]) -> bool {
    token.len() == TOKEN_BYTES && mac(key, run_id, batch_id, target_instance).verify_truncated_left(token).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_holds_for_its_batch_and_instance_only() {
        let key = [7u8; KEY_BYTES];
        let t = lease_token(&key, "run-1", 42, "target-a");
        assert_eq!(t.len(), TOKEN_BYTES);
        assert!(verify(&key, "run-1", 42, "target-a", &t));
        assert!(!verify(&key, "run-1", 43, "target-a", &t), "another batch");
        assert!(!verify(&key, "run-1", 42, "target-b", &t), "another instance");
        assert!(!verify(&key, "run-2", 42, "target-a", &t), "another run");
        assert!(!verify(&[8u8; KEY_BYTES], "run-1", 42, "target-a", &t), "another key");
        assert!(!verify(&key, "run-1", 42, "target-a", &t[..8]), "a shortened token");
        assert!(!verify(&key, "run-1", 42, "target-a", &[]), "no token");
    }
}
