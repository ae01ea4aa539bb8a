//! Progress of long tool work (`regenerate`, `eval`): a bar with rate and
//! ETA on a terminal (indicatif), and a plain line at most every
//! [`PLAIN_EVERY`] (and at the end) when stderr is a file or a pipe, so
//! that logs of unattended runs show progress without a line per item.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often the plain (non-terminal) form prints a line.
pub const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// One piece of work counted in `unit`s (e.g. "prompts").
pub struct Meter {
    what: String,
    unit: &'static str,
    total: u64,
    done: u64,
    started: Instant,
    last_line: Instant,
    bar: Option<ProgressBar>,
}

impl Meter {
    pub fn new(what: &str, total: u64, unit: &'static str) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            let template = format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} ({{per_sec}}, ETA {{eta}})");
            if let Ok(style) = ProgressStyle::with_template(&template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(what.to_string());
            bar
        });
        let now = Instant::now();
        Self { what: what.to_string(), unit, total, done: 0, started: now, last_line: now, bar }
    }

    /// `n` more units done; `note` (e.g. a rate of tokens) joins the plain line.
    pub fn add(&mut self, n: u64, note: &str) {
        self.done += n;
        match &self.bar {
            Some(bar) => bar.inc(n),
            None if self.last_line.elapsed() >= PLAIN_EVERY || self.done >= self.total => {
                self.last_line = Instant::now();
                eprintln!("{}", self.plain_line(note));
            }
            None => {}
        }
    }

    /// The plain form: done/total, percent, rate and ETA.
    pub fn plain_line(&self, note: &str) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = self.done as f64 / secs;
        let left = self.total.saturating_sub(self.done) as f64;
        let eta = if rate > 0.0 { format!("{:.0} s", left / rate) } else { "unknown".into() };
        let pct = if self.total > 0 { 100.0 * self.done as f64 / self.total as f64 } else { 100.0 };
        let note = if note.is_empty() { String::new() } else { format!(", {note}") };
        format!(
            "{}: {}/{} {} ({pct:.0}%), {rate:.2} {}/s, ETA {eta}{note}",
            self.what, self.done, self.total, self.unit, self.unit
        )
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_line_names_progress_rate_and_eta() {
        let mut m = Meter::new("regenerate", 10, "prompts");
        m.bar = None;
        m.done = 4;
        m.started = Instant::now() - Duration::from_secs(2);
        let line = m.plain_line("310 new tokens/s");
        assert!(line.starts_with("regenerate: 4/10 prompts (40%), 2.00 prompts/s, ETA 3 s"), "{line}");
        assert!(line.ends_with(", 310 new tokens/s"), "{line}");
    }
}
