//! Module cycles in a crate's source, read from its `crate::` paths: the check that keeps
//! a crate's modules layered (each can be understood, and split off, from the ones it
//! uses). A module is a file's top-level module (`src/parallel/zero.rs` is `parallel`);
//! an edge is any `crate::x::...` path or `use crate::{x, ...}` item outside comments.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every cycle among the top-level modules of the crate whose source is `src`: each as
/// its modules with the edges between them (`a -> b`), sorted; empty where the modules
/// are layered.
pub fn module_cycles(src: &Path) -> Vec<Vec<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut modules = BTreeSet::new();
    for f in &files {
        modules.insert(top_module(src, f));
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let from = top_module(src, f);
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for to in referenced(&text) {
            if to != from && modules.contains(&to) {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    strongly_connected(&modules, &edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let mut lines = Vec::new();
            for a in &c {
                for b in edges.get(a).into_iter().flatten() {
                    if c.contains(b) {
                        lines.push(format!("{a} -> {b}"));
                    }
                }
            }
            lines
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/parallel/zero.rs` -> `parallel`; `src/run.rs` -> `run`; `src/lib.rs` -> `lib`.
fn top_module(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let first = rel
        .components()
        .next()
        .map(|c| c.as_os_str().to_string_lossy().into_owned());
    first
        .unwrap_or_default()
        .trim_end_matches(".rs")
        .to_string()
}

/// The top-level modules `text` names through `crate::`, comments left out.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(list) = rest.strip_prefix('{') {
                // `use crate::{a, b::c}`: each item's first segment (on this line).
                let list = list.split('}').next().unwrap_or("");
                for item in list.split(',') {
                    if let Some(name) = first_ident(item.trim()) {
                        out.insert(name);
                    }
                }
            } else if let Some(name) = first_ident(rest) {
                out.insert(name);
            }
        }
    }
    out
}

fn first_ident(s: &str) -> Option<String> {
    let name: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Tarjan's strongly connected components.
fn strongly_connected(
    nodes: &BTreeSet<String>,
    edges: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut State<'_>, v: &str) {
        s.index.insert(v.into(), s.next);
        s.low.insert(v.into(), s.next);
        s.next += 1;
        s.stack.push(v.into());
        s.on.insert(v.into());
        let targets: Vec<String> = s.edges.get(v).into_iter().flatten().cloned().collect();
        for w in targets {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let lw = s.low[&w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(&w) {
                let iw = s.index[&w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(&w);
                let done = w == v;
                comp.push(w);
                if done {
                    break;
                }
            }
            comp.sort();
            s.out.push(comp);
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_through_three_modules_is_found_and_a_layered_crate_has_none() {
        let dir = std::env::temp_dir().join(format!("stoker-cycles-{}", std::process::id()));
        let src = dir.join("src");
        std::fs::create_dir_all(src.join("b")).unwrap();
        std::fs::write(src.join("lib.rs"), "pub mod a;\npub mod b;\npub mod c;\n").unwrap();
        std::fs::write(
            src.join("a.rs"),
            "use crate::b::X; // crate::c in a comment\n",
        )
        .unwrap();
        std::fs::write(src.join("b/mod.rs"), "mod y;\n").unwrap();
        std::fs::write(src.join("b/y.rs"), "use crate::{c, a::Z};\n").unwrap();
        std::fs::write(src.join("c.rs"), "fn f() { crate::a::g() }\n").unwrap();
        let cycles = module_cycles(&src);
        assert_eq!(
            cycles,
            vec![vec!["a -> b", "b -> a", "b -> c", "c -> a"]],
            "{cycles:?}"
        );
        std::fs::write(src.join("c.rs"), "fn f() {}\n").unwrap();
        std::fs::write(src.join("b/y.rs"), "use crate::{c};\n").unwrap();
        assert!(module_cycles(&src).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
