//! The help is the first thing a new user reads: every summary that lists commands lists
//! exactly the commands that exist, so the next command added cannot leave it stale (the
//! top-level summary once named four of eight commands, and `bench`'s "the data loader"
//! sat above three benchmarks).

use std::process::Command;

const STOKER: &str = env!("CARGO_BIN_EXE_stoker");

/// `stoker ARGS --help`'s output.
fn help(args: &[&str]) -> String {
    let o = Command::new(STOKER)
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success(), "stoker {args:?} --help: {o:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// The summary (first line) and the listed commands with their one-line summaries,
/// `help` left out.
fn summary_and_commands(text: &str) -> (String, Vec<(String, String)>) {
    let summary = text.lines().next().unwrap_or_default().to_string();
    let commands = text
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| {
            let l = l.trim_start();
            let (name, about) = l.split_once(' ')?;
            Some((name.to_string(), about.trim().to_string()))
        })
        .filter(|(name, _)| name != "help")
        .collect();
    (summary, commands)
}

/// The names after a summary's last ": ", comma-separated (`... formats: idx, text,
/// images.` -> idx, text, images).
fn listed(summary: &str) -> Vec<String> {
    let (_, list) = summary
        .rsplit_once(": ")
        .unwrap_or_else(|| panic!("`{summary}` lists no commands after `: `"));
    let mut names: Vec<String> = list
        .trim_end_matches('.')
        .split(", ")
        .map(|s| s.trim().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn every_summary_of_a_command_with_subcommands_lists_exactly_those_that_exist() {
    let (summary, commands) = summary_and_commands(&help(&[]));
    let mut names: Vec<String> = commands.iter().map(|(n, _)| n.clone()).collect();
    names.sort();
    assert!(names.len() >= 8, "{names:?}");
    assert_eq!(
        listed(&summary),
        names,
        "`stoker --help`'s summary: {summary}"
    );
    for (name, about) in &commands {
        let text = help(&[name]);
        let (own, subs) = summary_and_commands(&text);
        if subs.is_empty() {
            continue;
        }
        let mut subs: Vec<String> = subs.into_iter().map(|(n, _)| n).collect();
        subs.sort();
        // The line in the top-level list and the command's own help say the same.
        assert_eq!(
            listed(about),
            subs,
            "`stoker --help` says of {name}: {about}"
        );
        assert_eq!(listed(&own), subs, "`stoker {name} --help` says: {own}");
    }
}

/// A command line clap refuses says `error[usage]:` as stoker's own usage errors do (a
/// script tells the kinds apart by it; before, clap's plain `error:`), keeps clap's hints
/// and exit status 2; help still prints to stdout and succeeds.
#[test]
fn a_refused_command_line_is_a_usage_error() {
    for (args, says) in [
        (
            &["train", "x.toml", "--world", "2"][..],
            "error[usage]: the following required arguments were not provided:",
        ),
        (&["trian"], "error[usage]: unrecognized subcommand 'trian'"),
        (
            &["plan", "--global-batch", "ten"],
            "error[usage]: invalid value 'ten' for '--global-batch",
        ),
    ] {
        let o = Command::new(STOKER).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with(says), "{args:?}: {err}");
        assert!(err.contains("try '--help'"), "{args:?}: {err}");
        assert_eq!(err.matches("error").count(), 1, "{args:?}: {err}");
    }
    assert!(
        help(&["train"]).starts_with("Train"),
        "{}",
        help(&["train"])
    );
}
