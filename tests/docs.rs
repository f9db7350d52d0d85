//! The documentation works as printed: every `baton ...` line of a code block in README.md and
//! docs/ parses with the current CLI, and every relative link (and anchor) resolves.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use clap::Parser;

fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = vec![root.join("README.md")];
    for e in std::fs::read_dir(root.join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Code-block lines, with `\` continuations joined: `(line number, text)`.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if !fence {
            continue;
        }
        let (n, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        joined.push_str(line.trim_end());
        if let Some(stripped) = joined.strip_suffix('\\') {
            pending = Some((n, format!("{stripped} ")));
        } else {
            out.push((n, joined));
        }
    }
    out
}

/// The arguments of a `baton` command on this line, if it is one.
fn baton_args(line: &str) -> Option<Vec<String>> {
    let words = shell_words::split(line.trim().trim_start_matches("$ ")).ok()?;
    let start = words
        .iter()
        .position(|w| !w.contains('=') || w.starts_with('-'))?;
    let bin = words.get(start)?;
    if bin != "baton" && !bin.ends_with("/baton") {
        return None;
    }
    let mut args = vec!["baton".to_string()];
    for w in &words[start + 1..] {
        if ["|", "||", "&&", ";", "&", ">", "2>", ">>"].contains(&w.as_str()) || w.starts_with('#')
        {
            break;
        }
        args.push(w.clone());
    }
    Some(args)
}

#[test]
fn every_baton_line_in_the_docs_parses_with_the_cli() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (n, line) in code_lines(&text) {
            let Some(args) = baton_args(&line) else {
                continue;
            };
            checked += 1;
            if let Err(e) = baton::config::Cli::try_parse_from(&args) {
                use clap::error::ErrorKind::*;
                if !matches!(e.kind(), DisplayHelp | DisplayVersion) {
                    bad.push(format!(
                        "{}:{n}: {line}\n  {}",
                        page.display(),
                        e.to_string().lines().next().unwrap_or_default()
                    ));
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} baton lines found");
    assert!(bad.is_empty(), "lines the CLI refuses:\n{}", bad.join("\n"));
}

/// GitHub's anchor for a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> HashSet<String> {
    let mut fence = false;
    let mut out = HashSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if !fence && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// `](target)` links outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut bad = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.starts_with("http://")
                || link.starts_with("https://")
                || link.starts_with("mailto:")
            {
                continue;
            }
            checked += 1;
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            if !target.exists() {
                bad.push(format!("{}: {link}: no such file", page.display()));
                continue;
            }
            if let Some(a) = anchor {
                let t = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&t).contains(a) {
                    bad.push(format!("{}: {link}: no such heading", page.display()));
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} links found");
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}
