//! An error and its causes as one line, each cause once.

/// `e` followed by each cause in its chain that the text so far does not already hold.
/// Many library errors print their cause in their own message and also return it as
/// their source; `{e:#}` would then say it two or three times.
pub fn chain_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::chain_text;

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        // A message that already holds its source's text, under a context that does not.
        #[derive(Debug)]
        struct Holds(std::io::Error);
        impl std::fmt::Display for Holds {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "x.bin: {}", self.0)
            }
        }
        impl std::error::Error for Holds {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Holds(io)).context("config key `data.train`");
        assert_eq!(
            chain_text(&e),
            "config key `data.train`: x.bin: no such file"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(chain_text(&plain), "outer: inner");
    }
}
