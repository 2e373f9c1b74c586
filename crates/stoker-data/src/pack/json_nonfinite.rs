//! Python's `json.dumps` writes `NaN`, `Infinity` and `-Infinity` by default, which JSON has
//! not; Python's `json.loads` and pyarrow (what Hugging Face `datasets` reads JSON Lines
//! with) read them back. A JSON Lines line that fails to parse is given a second chance with
//! those tokens, outside strings, read as `null`: a document's other fields (a score, a
//! perplexity) may hold them, and a text field that does is then refused as null, by name.

/// `line` with every `NaN`, `Infinity` and `-Infinity` outside a string replaced by
/// `null`, or `None` where there is none.
pub fn nonfinite_as_null(line: &str) -> Option<String> {
    const TOKENS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];
    let mut out = String::with_capacity(line.len());
    let (mut in_string, mut escaped, mut replaced) = (false, false, false);
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(t) = TOKENS.iter().find(|t| rest.starts_with(**t)) {
            out.push_str("null");
            rest = &rest[t.len()..];
            replaced = true;
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    replaced.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_s_nonfinite_floats_outside_strings_read_as_null() {
        assert_eq!(
            nonfinite_as_null(
                r#"{"text": "NaN \"Infinity\" here", "s": NaN, "t": [-Infinity, Infinity]}"#
            )
            .as_deref(),
            Some(r#"{"text": "NaN \"Infinity\" here", "s": null, "t": [null, null]}"#)
        );
        assert_eq!(nonfinite_as_null(r#"{"text": "NaN"}"#), None);
        assert_eq!(
            nonfinite_as_null(r#"{"text": "a\\", "n": NaN}"#).as_deref(),
            Some(r#"{"text": "a\\", "n": null}"#)
        );
    }
}
