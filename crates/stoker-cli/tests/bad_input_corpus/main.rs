//! The bad-input corpus (docs/reliability.md): over 300 broken inputs, generated here
//! from valid ones (nothing binary is committed), each run through the `stoker` command
//! that reads it. Every case must end with a non-zero exit status (not a signal, not a
//! timeout), no panic, exactly one error line, `error[KIND]: ...`, of the kind the case
//! expects (a broken file is `format`, a missing one `io`, a bad key `config`, a damaged
//! checkpoint `checkpoint`), naming the broken file (or, for a config's values, the key);
//! and no allocation beyond what the file's size justifies: each case runs with its address
//! space limited to [`ADDRESS_SPACE`], so a reader that trusts a size in a header aborts.
//!
//! Formats, one module each: `.npy`, llm.c and nanoGPT token shards, IDX (raw and gzip),
//! image folders and the JPEG record shards packed from them (data, index, manifest,
//! labels), sharded checkpoints, training configs and vocab JSON, plan configs, DeepSpeed
//! JSON and loader benchmark JSON, users' Parquet and JSON Lines documents.

mod checkpoints;
mod configs;
mod docs;
mod idx;
mod images;
mod npy;
mod plan;
mod tokens;

use std::process::{Command, Output};

/// The binary under test.
pub const STOKER: &str = env!("CARGO_BIN_EXE_stoker");

/// The address space each case may reserve. The corpus's files are at most a few MiB and a
/// healthy run of these commands stays under 1.5 GiB of address space (thread stacks and
/// the allocator's arenas included), so a case that needs more allocated for a size a
/// header claimed, not for bytes its file holds: the allocation fails and the process
/// aborts, which [`check`] reports as a signal.
pub const ADDRESS_SPACE: u64 = 3 << 30;

/// One broken input: what to run, what the error must name, and its kind.
pub struct Case {
    /// What was broken, for the failure report.
    pub what: String,
    /// The `stoker` arguments.
    pub args: Vec<String>,
    /// The error line must contain one of these (the file's name or the key).
    pub names: Vec<String>,
    /// The expected `error[KIND]` (`stoker-cli/src/error_kind.rs`).
    pub kind: &'static str,
}

/// Runs `stoker args` under a 30 s timeout and the address-space limit.
pub fn run(args: &[String]) -> Output {
    Command::new("timeout")
        .args(["-k", "5", "30", "prlimit"])
        .arg(format!("--as={ADDRESS_SPACE}"))
        .args(["--", STOKER])
        .args(args)
        .output()
        .unwrap()
}

fn check(c: &Case) -> Result<(), String> {
    let o = run(&c.args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error[")).collect();
    let fail = |why: &str| Err(format!("{}: {why}\n--- stderr\n{err}", c.what));
    match o.status.code() {
        None => return fail("killed by a signal (SIGABRT: an allocation over the limit)"),
        Some(0) => return fail("exit status 0: the broken input was accepted"),
        Some(124) | Some(137) => return fail("timed out"),
        Some(_) => {}
    }
    if err.contains("panicked") {
        return fail("panicked");
    }
    let [line] = errors[..] else {
        return fail(&format!("{} error lines, expected one", errors.len()));
    };
    let want = format!("error[{}]", c.kind);
    if !line.starts_with(&want) {
        return fail(&format!("expected {want}"));
    }
    if !c.names.iter().any(|n| line.contains(n.as_str())) {
        return fail(&format!("the error line names none of {:?}", c.names));
    }
    Ok(())
}

/// A path or string as an owned `String` argument.
pub fn s(x: impl AsRef<std::ffi::OsStr>) -> String {
    x.as_ref().to_string_lossy().to_string()
}

/// The limit reaches the process under test: with 16 MiB of address space `stoker` cannot
/// even start, so a case that passes under [`ADDRESS_SPACE`] really ran within it.
#[test]
fn the_address_space_limit_applies_to_stoker() {
    let o = Command::new("prlimit")
        .arg(format!("--as={}", 16 << 20))
        .args(["--", STOKER, "plan", "--params", "124M"])
        .output()
        .expect("prlimit (util-linux) runs");
    assert!(!o.status.success(), "stoker ran in 16 MiB of address space");
}

/// A format module's case generator.
type AddCases = fn(&std::path::Path, &mut Vec<Case>);

#[test]
fn every_case_of_the_bad_input_corpus_fails_cleanly_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    checkpoints::corpus(dir);
    let mut cases = Vec::new();
    let formats: [(&str, AddCases); 8] = [
        ("npy", npy::cases),
        ("token shards", tokens::cases),
        ("IDX", idx::cases),
        ("image folders and JPEG records", images::cases),
        ("checkpoints", checkpoints::cases),
        ("training configs and vocab", configs::cases),
        ("plan, DeepSpeed and loader-bench inputs", plan::cases),
        ("Parquet and JSON Lines documents", docs::cases),
    ];
    for (name, add) in formats {
        let before = cases.len();
        add(dir, &mut cases);
        eprintln!("bad-input corpus: {name}: {} cases", cases.len() - before);
    }
    let failures: Vec<String> = cases.iter().filter_map(|c| check(c).err()).collect();
    let mut kinds = std::collections::BTreeMap::new();
    for c in &cases {
        *kinds.entry(c.kind).or_insert(0) += 1;
    }
    eprintln!(
        "bad-input corpus: {} cases ({kinds:?}), {} failed cleanly with their kind, naming the file or key",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
    assert!(cases.len() >= 300, "only {} cases", cases.len());
}
