//! The driver of the parsers' fuzz tests (`common/*/tests/fuzz.rs`): runs a
//! check on a bounded number of random inputs (`DFLASH_FUZZ_CASES`, else
//! the property's default), fails on the first panic with the shrunk input,
//! and prints how many inputs ended in each outcome the check names, so a
//! property that only ever reaches its refusal path shows it.

use std::cell::RefCell;
use std::collections::BTreeMap;

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestRunner};

/// Runs `check` on `default_cases` inputs of `strategy` (or
/// `DFLASH_FUZZ_CASES`); `check` panics on a failure and otherwise returns
/// the outcome it saw.
pub fn fuzz<S: Strategy>(name: &str, default_cases: u32, strategy: S, check: impl Fn(S::Value) -> &'static str) {
    let cases = std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default_cases);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let seen = RefCell::new(BTreeMap::<&str, u64>::new());
    let result = runner.run(&strategy, |v| {
        *seen.borrow_mut().entry(check(v)).or_default() += 1;
        Ok(())
    });
    if let Err(e) = result {
        panic!("fuzz {name}: {e}");
    }
    let seen = seen.into_inner();
    let outcomes: Vec<String> = seen.iter().map(|(k, n)| format!("{n} {k}")).collect();
    println!("fuzz {name}: {} inputs, no failure ({})", seen.values().sum::<u64>(), outcomes.join(", "));
}
