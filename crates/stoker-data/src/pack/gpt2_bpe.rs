//! GPT-2's byte-level BPE (`r50k_base`), ids identical to tiktoken's `encode_ordinary`, at
//! data-preparation speed. tiktoken-rs gives the ranks; the text is split by a scanner
//! written for GPT-2's one pattern instead of a backtracking regex, and the merges of a
//! piece seen before come from a cache (natural text repeats its words). tiktoken-rs's own
//! encoder ran at 5.9 MB/s on one core here and slower on two (its regexes share state),
//! against Python tiktoken's 11.3 MB/s (docs/benchmarks.md, "Data preparation").
//!
//! The pattern, tried in order at each position (leftmost-first):
//! `'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//! The Unicode classes come from regex-syntax (the regex engine's own tables), so letters,
//! numbers and white space are what tiktoken's regex calls them.

use std::ops::RangeInclusive;

use regex_syntax::hir::{Class, HirKind};
use rustc_hash::FxHashMap;

/// GPT-2's end-of-text token.
pub const END_OF_TEXT: u16 = 50_256;

/// A Unicode class as sorted, disjoint ranges.
struct CharClass {
    ranges: Vec<RangeInclusive<char>>,
}

impl CharClass {
    /// The class regex-syntax parses `pattern` (one class, such as `\p{L}`) into.
    fn of(pattern: &str) -> CharClass {
        let hir = regex_syntax::ParserBuilder::new()
            .build()
            .parse(pattern)
            .expect("a valid class pattern");
        let HirKind::Class(Class::Unicode(c)) = hir.kind() else {
            unreachable!("{pattern} is one Unicode class")
        };
        CharClass {
            ranges: c.iter().map(|r| r.start()..=r.end()).collect(),
        }
    }

    fn contains(&self, c: char) -> bool {
        let i = self.ranges.partition_point(|r| *r.end() < c);
        self.ranges.get(i).is_some_and(|r| r.contains(&c))
    }
}

/// What a character is to the pattern.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Letter,
    Number,
    Space,
    Other,
}

/// The classes, with an ASCII table for the common case.
struct Classes {
    letter: CharClass,
    number: CharClass,
    space: CharClass,
    ascii: [Kind; 128],
}

impl Classes {
    fn new() -> Classes {
        let (letter, number, space) = (
            CharClass::of(r"\p{L}"),
            CharClass::of(r"\p{N}"),
            CharClass::of(r"\s"),
        );
        let mut ascii = [Kind::Other; 128];
        for (b, k) in ascii.iter_mut().enumerate() {
            let c = b as u8 as char;
            *k = Self::slow(&letter, &number, &space, c);
        }
        Classes {
            letter,
            number,
            space,
            ascii,
        }
    }

    fn slow(letter: &CharClass, number: &CharClass, space: &CharClass, c: char) -> Kind {
        if letter.contains(c) {
            Kind::Letter
        } else if number.contains(c) {
            Kind::Number
        } else if space.contains(c) {
            Kind::Space
        } else {
            Kind::Other
        }
    }

    fn kind(&self, c: char) -> Kind {
        match (c as u32) < 128 {
            true => self.ascii[c as usize],
            false => Self::slow(&self.letter, &self.number, &self.space, c),
        }
    }
}

/// GPT-2's encoder: its ranks and the pattern's classes. Shared by every thread; each
/// keeps its own [`PieceCache`].
pub struct Gpt2Bpe {
    ranks: FxHashMap<Vec<u8>, u16>,
    classes: Classes,
}

/// Merges of pieces already encoded, per thread.
#[derive(Default)]
pub struct PieceCache {
    map: FxHashMap<Vec<u8>, Vec<u16>>,
}

/// Pieces the cache keeps at most before it starts over (bounded memory).
const CACHE_PIECES: usize = 1 << 16;

impl Gpt2Bpe {
    /// The encoder, its ranks read from tiktoken-rs's `r50k_base`.
    pub fn new() -> std::result::Result<Gpt2Bpe, String> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| e.to_string())?;
        let ranks: FxHashMap<Vec<u8>, u16> = bpe
            ._decode_native_and_split((0..END_OF_TEXT as u32).collect())
            .enumerate()
            .map(|(rank, bytes)| (bytes, rank as u16))
            .collect();
        if ranks.len() != END_OF_TEXT as usize {
            return Err(format!(
                "{} distinct GPT-2 tokens, expected 50256",
                ranks.len()
            ));
        }
        Ok(Gpt2Bpe {
            ranks,
            classes: Classes::new(),
        })
    }

    /// `text`'s tokens appended to `out` (tiktoken's `encode_ordinary`: special tokens are
    /// text like any other).
    pub fn encode_into(&self, text: &str, cache: &mut PieceCache, out: &mut Vec<u16>) {
        let mut at = 0;
        while at < text.len() {
            let end = self.piece_end(text, at);
            let piece = &text.as_bytes()[at..end];
            match self.ranks.get(piece) {
                Some(&r) => out.push(r),
                None => match cache.map.get(piece) {
                    Some(ids) => out.extend_from_slice(ids),
                    None => {
                        let ids = self.merge(piece);
                        out.extend_from_slice(&ids);
                        if cache.map.len() >= CACHE_PIECES {
                            cache.map.clear();
                        }
                        cache.map.insert(piece.to_vec(), ids);
                    }
                },
            }
            at = end;
        }
    }

    /// Where the pattern's match starting at byte `at` of `text` ends.
    fn piece_end(&self, text: &str, at: usize) -> usize {
        let rest = &text[at..];
        let b = rest.as_bytes();
        // 's 't 're 've 'm 'll 'd
        if b[0] == b'\'' && b.len() >= 2 {
            match b[1] {
                b's' | b't' | b'm' | b'd' => return at + 2,
                b'l' if b.get(2) == Some(&b'l') => return at + 3,
                b'v' | b'r' if b.get(2) == Some(&b'e') => return at + 3,
                _ => {}
            }
        }
        let mut chars = rest.char_indices().peekable();
        let (_, first) = chars.next().expect("not at the end");
        // An optional ASCII space, then a run of one kind: letters, numbers, or neither
        // letters, numbers nor white space.
        let next = match first {
            ' ' => rest[1..].chars().next(),
            _ => None,
        };
        let (start_kind, skipped) = match next {
            Some(next) if self.classes.kind(next) != Kind::Space => {
                chars.next();
                (self.classes.kind(next), 1 + next.len_utf8())
            }
            _ => (self.classes.kind(first), first.len_utf8()),
        };
        if start_kind != Kind::Space {
            let mut end = skipped;
            for (i, c) in chars {
                if self.classes.kind(c) != start_kind {
                    return at + i;
                }
                end = i + c.len_utf8();
            }
            return at + end;
        }
        // White space: all of it up to the end of the text; before anything else, all
        // but its last character when it has more than one (`\s+(?!\S)`), else that one.
        let mut last_start = 0;
        let mut end = first.len_utf8();
        for (i, c) in chars {
            if self.classes.kind(c) != Kind::Space {
                return at + if last_start > 0 { last_start } else { end };
            }
            last_start = i;
            end = i + c.len_utf8();
        }
        at + end
    }

    /// tiktoken's byte-pair merge of `piece`: the lowest-ranked adjacent pair merged
    /// first (the leftmost of equal ranks), until no pair is a token. A short piece (a
    /// word) rescans its pairs after each merge; a long one (a DNA sequence, minified
    /// code: one piece of 300,000 letters took 70 s that way) keeps them in a heap.
    fn merge(&self, piece: &[u8]) -> Vec<u16> {
        match piece.len() > SHORT_PIECE {
            true => self.merge_long(piece),
            false => self.merge_short(piece),
        }
    }

    /// [`merge`](Self::merge) by rescanning every pair after each merge: O(n^2).
    fn merge_short(&self, piece: &[u8]) -> Vec<u16> {
        // Part boundaries; `rank[i]` is the rank of parts i and i + 1 joined.
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        let rank_of = |bounds: &[usize], i: usize| -> u32 {
            match bounds.get(i + 2) {
                Some(&end) => self
                    .ranks
                    .get(&piece[bounds[i]..end])
                    .map_or(u32::MAX, |&r| r as u32),
                None => u32::MAX,
            }
        };
        let mut ranks: Vec<u32> = (0..bounds.len() - 1).map(|i| rank_of(&bounds, i)).collect();
        // The first of the lowest-ranked pairs, as tiktoken takes it.
        while let Some((i, _)) = ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| **r != u32::MAX)
            .min_by_key(|&(i, r)| (*r, i))
        {
            bounds.remove(i + 1);
            ranks.remove(i + 1);
            ranks[i] = rank_of(&bounds, i);
            if i > 0 {
                ranks[i - 1] = rank_of(&bounds, i - 1);
            }
        }
        bounds
            .windows(2)
            .map(|w| self.ranks[&piece[w[0]..w[1]]])
            .collect()
    }
}

/// Pieces up to this many bytes are merged by rescanning (fewer steps than a heap's for a
/// word); longer ones through [`Gpt2Bpe::merge_long`].
const SHORT_PIECE: usize = 128;

impl Gpt2Bpe {
    /// [`merge`](Self::merge) in O(n log n): parts in a list named by their first byte,
    /// each pair's rank in a min-heap of (rank, first byte), so ties go to the leftmost
    /// pair as in the rescan. An entry is stale when its part is gone or its pair's rank
    /// changed; a pair only grows, and a longer pair is another token, so a rank that
    /// matches is the pair's current one.
    fn merge_long(&self, piece: &[u8]) -> Vec<u16> {
        use std::cmp::Reverse;
        let n = piece.len();
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<Option<usize>> = (0..n).map(|s| s.checked_sub(1)).collect();
        let mut alive = vec![true; n];
        let rank_of = |next: &[usize], s: usize| -> Option<u32> {
            let m = next[s];
            let end = *next.get(m)?;
            self.ranks.get(&piece[s..end]).map(|&r| r as u32)
        };
        let mut rank_at: Vec<Option<u32>> = (0..n).map(|s| rank_of(&next, s)).collect();
        let mut heap: std::collections::BinaryHeap<Reverse<(u32, usize)>> = rank_at
            .iter()
            .enumerate()
            .filter_map(|(s, r)| r.map(|r| Reverse((r, s))))
            .collect();
        while let Some(Reverse((r, s))) = heap.pop() {
            if !alive[s] || rank_at[s] != Some(r) {
                continue;
            }
            // Part `s` takes in the part after it.
            let m = next[s];
            alive[m] = false;
            next[s] = next[m];
            if let Some(p) = prev.get_mut(next[s]) {
                *p = Some(s);
            }
            for part in [Some(s), prev[s]].into_iter().flatten() {
                rank_at[part] = rank_of(&next, part);
                if let Some(r) = rank_at[part] {
                    heap.push(Reverse((r, part)));
                }
            }
        }
        let mut ids = Vec::new();
        let mut s = 0;
        while s < n {
            ids.push(self.ranks[&piece[s..next[s]]]);
            s = next[s];
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_equal_tiktoken_s_on_tricky_text() {
        let bpe = Gpt2Bpe::new().unwrap();
        let reference = tiktoken_rs::r50k_base().unwrap();
        let texts = [
            "Hello world! It's a test, isn't it? They'll've done 'em.",
            "  leading spaces\n\n\nnewlines  \t tabs\r\n and trailing   ",
            "numbers 12345 67.89 ١٢٣ (Arabic) Ⅻ (roman) ²",
            "données 名前 café naïve Ελληνικά русский עברית हिन्दी ಕನ್ನಡ",
            "emoji 🙂🙂 👍🏽 flags 🇫🇷 zwj 👩‍👩‍👧",
            "punct!!! ??? ... --- *** ''quotes'' \"dq\" `bt` «guillemets»",
            "'s 't 're 've 'm 'll 'd 'x 'S 'LL",
            "\u{a0}nbsp\u{2003}em\u{3000}ideographic space",
            "<|endoftext|> is text here",
            "a",
            " ",
            "\n",
            "x\u{301}y\u{308} combining marks",
        ];
        for text in texts {
            let mut cache = PieceCache::default();
            let mut ours = Vec::new();
            bpe.encode_into(text, &mut cache, &mut ours);
            // Twice through the cache.
            let mut again = Vec::new();
            bpe.encode_into(text, &mut cache, &mut again);
            let want: Vec<u16> = reference
                .encode_ordinary(text)
                .into_iter()
                .map(|t| t as u16)
                .collect();
            assert_eq!(ours, want, "{text:?}");
            assert_eq!(again, want, "{text:?} from the cache");
        }
    }

    /// Long pieces (no white space for thousands of bytes) merge through the heap to
    /// tiktoken's ids, and to the rescan's, ties included (a run of one letter is all
    /// ties).
    #[test]
    fn long_pieces_merge_as_tiktoken_merges_them() {
        let bpe = Gpt2Bpe::new().unwrap();
        let reference = tiktoken_rs::r50k_base().unwrap();
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut letter = |alphabet: &[u8]| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            alphabet[(seed % alphabet.len() as u64) as usize] as char
        };
        let dna: String = (0..3000).map(|_| letter(b"ACGT")).collect();
        let word: String = (0..2000).map(|_| letter(b"etaoinshrdlu")).collect();
        let texts = [
            dna,
            word,
            "a".repeat(1500),
            "ab".repeat(700),
            "!?".repeat(400),
            "é".repeat(300),
        ];
        for text in &texts {
            assert!(text.len() > SHORT_PIECE);
            let mut ours = Vec::new();
            bpe.encode_into(text, &mut PieceCache::default(), &mut ours);
            let want: Vec<u16> = reference
                .encode_ordinary(text)
                .into_iter()
                .map(|t| t as u16)
                .collect();
            assert_eq!(ours, want, "{}...", &text[..20]);
            // The rescan gives the same ids.
            let piece = text.as_bytes();
            assert_eq!(
                bpe.merge_long(piece),
                bpe.merge_short(piece),
                "{}...",
                &text[..20]
            );
        }
    }
}
