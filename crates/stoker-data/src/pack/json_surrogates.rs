//! Python's `json.dumps` escapes a string's unpaired UTF-16 surrogates (text decoded with
//! `errors="surrogateescape"`, or cut between the two halves of a pair) as `\udXXX`, and
//! Python's `json.loads` reads them back; they are not Unicode, and serde_json refuses the
//! line ("unexpected end of hex escape", "lone leading surrogate"). A JSON Lines line that
//! fails to parse is given a second chance with each unpaired surrogate escape replaced by
//! `\ufffd` (U+FFFD, the replacement character, what Python's `errors="replace"` writes),
//! and the pack counts and reports them: a corpus with a few such documents packs, and
//! says so, where Python's tokenizers (tiktoken) would fail on the whole document.

/// `line` with every unpaired surrogate escape (`\uD800`-`\uDFFF` not in a high-low pair)
/// replaced by `\ufffd`, and how many; `None` where there is none.
pub fn lone_surrogates_replaced(line: &str) -> Option<(String, usize)> {
    let bytes = line.as_bytes();
    let unit = |at: usize| -> Option<u16> {
        // `\uXXXX` at `at`: the code unit it escapes.
        let hex = bytes.get(at..at + 6)?;
        if &hex[..2] != b"\\u" {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let high = |u: u16| (0xD800..0xDC00).contains(&u);
    let low = |u: u16| (0xDC00..0xE000).contains(&u);
    let mut out = String::with_capacity(line.len());
    let (mut i, mut copied, mut replaced) = (0, 0, 0);
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        match unit(i) {
            Some(u) if high(u) && unit(i + 6).is_some_and(low) => i += 12,
            Some(u) if high(u) || low(u) => {
                out.push_str(&line[copied..i]);
                out.push_str("\\ufffd");
                replaced += 1;
                i += 6;
                copied = i;
            }
            Some(_) => i += 6,
            // Another escape (`\\`, `\"`, `\n`): its second character is not a backslash
            // that starts an escape of its own.
            None => i += 2,
        }
    }
    out.push_str(&line[copied.min(line.len())..]);
    (replaced > 0).then_some((out, replaced))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpaired_surrogates_are_replaced_and_pairs_kept() {
        let (out, n) = lone_surrogates_replaced(r#"{"text": "a \ud800 b \udc00 \ud83d\ude00"}"#)
            .expect("two unpaired");
        assert_eq!(out, r#"{"text": "a \ufffd b \ufffd \ud83d\ude00"}"#);
        assert_eq!(n, 2);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["text"], "a \u{fffd} b \u{fffd} \u{1f600}");
        // A high surrogate at the end, and one followed by a non-surrogate escape.
        assert_eq!(
            lone_surrogates_replaced(r#"["\ud800\u0041", "\udbff"]"#),
            Some((r#"["\ufffd\u0041", "\ufffd"]"#.to_string(), 2))
        );
        // An escaped backslash before `u` is text, not an escape; nothing to replace.
        assert_eq!(lone_surrogates_replaced(r#"{"t": "\\ud800 é"}"#), None);
        assert_eq!(lone_surrogates_replaced(r#"{"t": "\ud83d\ude00"}"#), None);
    }
}
