//! The driver of the parsers' fuzz tests (`common/*/tests/fuzz.rs`): runs a
//! check on a bounded number of random inputs (`DFLASH_FUZZ_CASES`, else
//! the property's default), fails on the first panic with the shrunk input,
//! and prints how many inputs ended in each outcome the check names, so a
//! property that only ever reaches its refusal path shows it.
//!
//! `DFLASH_FUZZ_SECONDS` bounds a long run by time as well: rounds of at
//! most [`ROUND`] inputs, each from a fresh random seed, until that many
//! seconds have passed or the cases are done, whichever comes first (the
//! issue's "10 minutes or 10^6 cases" is `DFLASH_FUZZ_SECONDS=600
//! DFLASH_FUZZ_CASES=1000000`).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestRunner};

/// Runs `check` on `default_cases` inputs of `strategy` (or
/// `DFLASH_FUZZ_CASES`); `check` panics on a failure and otherwise returns
/// the outcome it saw.
pub fn fuzz<S: Strategy>(name: &str, default_cases: u32, strategy: S, check: impl Fn(S::Value) -> &'static str) {
    let cases = setting("DFLASH_FUZZ_CASES").unwrap_or(default_cases);
    let budget = setting::<u64>("DFLASH_FUZZ_SECONDS").map(Duration::from_secs);
    let start = Instant::now();
    let seen = RefCell::new(BTreeMap::<&str, u64>::new());
    let mut done = 0u32;
    while done < cases {
        let round = match budget {
            Some(_) => (cases - done).min(ROUND),
            None => cases,
        };
        let mut runner = TestRunner::new(Config { cases: round, failure_persistence: None, ..Config::default() });
        let result = runner.run(&strategy, |v| {
            *seen.borrow_mut().entry(check(v)).or_default() += 1;
            Ok(())
        });
        if let Err(e) = result {
            panic!("fuzz {name}: {e}");
        }
        done += round;
        if budget.is_some_and(|b| start.elapsed() >= b) {
            break;
        }
    }
    let seen = seen.into_inner();
    let outcomes: Vec<String> = seen.iter().map(|(k, n)| format!("{n} {k}")).collect();
    println!(
        "fuzz {name}: {} inputs in {:.0} s, no failure ({})",
        seen.values().sum::<u64>(),
        start.elapsed().as_secs_f64(),
        outcomes.join(", ")
    );
}

/// Inputs per round of a run bounded by time.
pub const ROUND: u32 = 10_000;

/// A numeric environment setting; a value that does not parse stops the
/// run, naming it.
fn setting<T: std::str::FromStr>(var: &str) -> Option<T> {
    let v = std::env::var(var).ok()?;
    Some(v.trim().parse().unwrap_or_else(|_| panic!("{var}={v} is not a number")))
}
