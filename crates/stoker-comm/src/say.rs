//! Messages to standard error in one write each: a launcher merges every rank's stderr,
//! and a line written in pieces (as `eprintln!` may) interleaves with other ranks' lines.

use std::io::Write;

/// Writes `line` and a newline to stderr in a single write.
pub fn say(line: &str) {
    let mut buf = String::with_capacity(line.len() + 1);
    buf.push_str(line);
    buf.push('\n');
    let _ = std::io::stderr().write_all(buf.as_bytes());
}
