//! The SIGBUS handler of `mapped`: a mapped file truncated under a reader ends the process
//! with status 74 and one line naming the file (past the table's slots, one line saying
//! so without the name); a SIGBUS that is not a fault in a mapping still gets the default
//! action. Each case runs in a child (this test binary, re-run on
//! an ignored worker), since both end the process.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use stoker_data::mapped::{Mapped, SHRUNK_EXIT};

const FILE: &str = "STOKER_TEST_MAPPED_FILE";

/// Runs worker `name` with the file's path in the environment.
fn child(name: &str, path: &std::path::Path) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FILE, path)
        .output()
        .unwrap()
}

fn mapped_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.bin");
    std::fs::write(&path, vec![7u8; 3 * 4096]).unwrap();
    (dir, path)
}

#[test]
#[ignore = "worker of a_truncated_mapping_is_named: ends its process"]
fn worker_truncated() {
    let path = std::path::PathBuf::from(std::env::var_os(FILE).unwrap());
    let file = std::fs::File::open(&path).unwrap();
    // More mappings than one, dropped and made again, so the table has been rewritten.
    for _ in 0..3 {
        drop(Mapped::map(&file, &path).unwrap());
    }
    let map = Mapped::map(&file, &path).unwrap();
    assert_eq!(map[3 * 4096 - 1], 7);
    let last = truncate_then_read_past_it(&path, &map);
    println!("read {last} past the end without a fault");
}

/// Truncates the mapped file at `path` to 100 bytes, then reads `map`'s last byte, past
/// the new end (a read the optimizer must keep): the fault the handler catches.
fn truncate_then_read_past_it(path: &std::path::Path, map: &Mapped) -> u8 {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(100)
        .unwrap();
    std::hint::black_box(std::hint::black_box(&map[..])[3 * 4096 - 1])
}

#[test]
fn a_truncated_mapping_is_named() {
    let (_dir, path) = mapped_file();
    let o = child("worker_truncated", &path);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(SHRUNK_EXIT), "{err}");
    assert!(
        err.contains(&format!(
            "stoker: {} changed while it was being read",
            path.display()
        )),
        "{err}"
    );
}

#[test]
#[ignore = "worker of a_truncated_mapping_past_the_table_still_ends_with_74: ends its process"]
fn worker_truncated_past_the_table() {
    let path = std::path::PathBuf::from(std::env::var_os(FILE).unwrap());
    let file = std::fs::File::open(&path).unwrap();
    // Every slot taken, then one more mapping, which the table cannot name.
    let named: Vec<Mapped> = (0..stoker_data::mapped::SLOTS)
        .map(|_| Mapped::map(&file, &path).unwrap())
        .collect();
    let map = Mapped::map(&file, &path).unwrap();
    let last = truncate_then_read_past_it(&path, &map);
    println!(
        "read {last} past the end without a fault ({} named)",
        named.len()
    );
}

/// More mappings than the table names (a dataset of thousands of shards): a truncated one
/// still ends the process with 74 and a line saying why, not a bare SIGBUS (before: exit
/// 135 past 256 mappings).
#[test]
fn a_truncated_mapping_past_the_table_still_ends_with_74() {
    let (_dir, path) = mapped_file();
    let o = child("worker_truncated_past_the_table", &path);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(SHRUNK_EXIT), "{err}");
    assert!(
        err.contains("stoker: a mapped file changed while it was being read")
            && err.contains("outside the 4096 mappings stoker names"),
        "{err}"
    );
}

#[test]
#[ignore = "worker of a_sent_sigbus_gets_the_default_action: ends its process"]
fn worker_sent_sigbus() {
    let path = std::path::PathBuf::from(std::env::var_os(FILE).unwrap());
    let file = std::fs::File::open(&path).unwrap();
    let _map = Mapped::map(&file, &path).unwrap();
    // SAFETY: raise(3) takes no pointers and only signals this process.
    unsafe { libc::raise(libc::SIGBUS) };
    println!("survived a SIGBUS");
}

#[test]
fn a_sent_sigbus_gets_the_default_action() {
    let (_dir, path) = mapped_file();
    let o = child("worker_sent_sigbus", &path);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.signal(), Some(libc::SIGBUS), "{out}");
    assert!(!out.contains("survived"), "{out}");
}
