//! `stoker pack` for IDX and text: outputs read back exactly; bad inputs named.

use std::io::Write;
use std::path::Path;

use stoker_data::pack::idx::{pack_idx, read_idx};
use stoker_data::pack::text::{pack_text, Tokenizer, Vocab};
use stoker_data::{ArrayDataset, DType, Dataset, TokenShard};

fn idx_bytes(dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(data);
    v
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn idx_images_and_labels_to_npy() {
    let dir = tempfile::tempdir().unwrap();
    let pixels: Vec<u8> = (0..3 * 4 * 5).map(|i| (i * 7 % 256) as u8).collect();
    // Two gzip members one after the other (what `cat a.gz b.gz` and parallel gzip
    // write): one stream to gunzip, and to the reader.
    let whole = idx_bytes(&[3, 4, 5], &pixels);
    let mut members = gz(&whole[..20]);
    members.extend(gz(&whole[20..]));
    std::fs::write(dir.path().join("img.idx.gz"), members).unwrap();
    std::fs::write(dir.path().join("lab.idx"), idx_bytes(&[3], &[7, 0, 9])).unwrap();
    let s = pack_idx(
        dir.path().join("img.idx.gz"),
        dir.path().join("lab.idx"),
        dir.path().join("out/train"),
    )
    .unwrap();
    assert_eq!((s.samples, s.rows, s.cols), (3, 4, 5));
    let ds = ArrayDataset::open_prefix(dir.path().join("out/train"), &["image", "label"]).unwrap();
    assert_eq!(ds.fields()[0].shape, vec![1, 4, 5]);
    assert_eq!(ds.fields()[1].dtype, DType::I64);
    assert_eq!(ds.arrays()[0].bytes(), &pixels[..]);
    assert_eq!(ds.arrays()[1].as_slice::<i64>().unwrap(), &[7, 0, 9]);
}

fn err_of(p: &Path) -> String {
    read_idx(p).unwrap_err().to_string()
}

#[test]
fn bad_idx_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, b: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let e = err_of(&w("type.idx", &[0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0]));
    assert!(
        e.contains("type.idx") && e.contains("0x0d") && e.contains("unsigned byte"),
        "{e}"
    );
    let e = err_of(&w("trunc.idx", &idx_bytes(&[2, 2, 2], &[1, 2, 3])));
    assert!(
        e.contains("data") && e.contains("need 8 bytes") && e.contains("has 3"),
        "{e}"
    );
    let e = err_of(&w("magic.idx", b"hello"));
    assert!(e.contains("magic"), "{e}");
    let mut bad_gz = gz(&idx_bytes(&[4], &[1, 2, 3, 4]));
    bad_gz.truncate(bad_gz.len() / 2);
    let e = err_of(&w("bad.gz", &bad_gz));
    assert!(e.contains("gzip"), "{e}");
    w("img.idx", &idx_bytes(&[3, 1, 1], &[1, 2, 3]));
    w("lab.idx", &idx_bytes(&[2], &[1, 2]));
    let e = pack_idx(
        dir.path().join("img.idx"),
        dir.path().join("lab.idx"),
        dir.path().join("o"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("3 images") && e.contains("2 labels"), "{e}");
    let e = pack_idx(
        dir.path().join("lab.idx"),
        dir.path().join("lab.idx"),
        dir.path().join("o"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("3 dimensions"), "{e}");
}

#[test]
fn char_and_gpt2_text_shards() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.txt"), "hello ").unwrap();
    std::fs::write(dir.path().join("b.txt"), "world\n").unwrap();
    let srcs = vec![dir.path().join("a.txt"), dir.path().join("b.txt")];
    let s = pack_text(&srcs, dir.path().join("c/chars"), Tokenizer::Char).unwrap();
    assert_eq!((s.tokens, s.vocab_size), (12, 9));
    let vocab = Vocab::load(dir.path().join("c/chars.vocab.json")).unwrap();
    assert_eq!(vocab.size(), 9);
    let Vocab::Char { tokens } = &vocab else {
        panic!("char vocab")
    };
    assert_eq!(tokens.concat(), "\n dehlorw");
    let shard = TokenShard::open_detect(dir.path().join("c/chars.bin")).unwrap();
    let ids: Vec<u32> = (0..shard.len()).map(|i| shard.token(i) as u32).collect();
    assert_eq!(ids, vec![4, 3, 5, 5, 6, 1, 8, 6, 7, 5, 2, 0]);
    assert_eq!(vocab.decode(&ids), "hello world\n");

    let s = pack_text(&srcs[..1], dir.path().join("g"), Tokenizer::Gpt2).unwrap();
    let shard = TokenShard::open_detect(dir.path().join("g.bin")).unwrap();
    assert_eq!(s.vocab_size, 50257);
    // GPT-2 BPE of "hello ": "hello" = 31373, " " = 220.
    assert_eq!(
        (0..shard.len()).map(|i| shard.token(i)).collect::<Vec<_>>(),
        vec![31373, 220]
    );
    // What `stoker train` reads back: the same BPE decodes the ids, and the vocabulary
    // knows its end-of-text token (config.json's bos and eos on export).
    let vocab = Vocab::load(dir.path().join("g.vocab.json")).unwrap();
    assert_eq!(vocab, Vocab::Gpt2 { size: 50257 });
    assert_eq!(vocab.decode(&[31373, 220]), "hello ");
    assert_eq!(vocab.end_of_text(), Some(50_256));
    assert_eq!(Vocab::Char { tokens: vec![] }.end_of_text(), None);
    // A literal "<|endoftext|>" in the text is ordinary text (`encode_ordinary`, as
    // `pack docs` reads it), not the special token: tiktoken's own ordinary ids.
    let text = "a <|endoftext|> b";
    std::fs::write(dir.path().join("eot.txt"), text).unwrap();
    pack_text(
        &[dir.path().join("eot.txt")],
        dir.path().join("e"),
        Tokenizer::Gpt2,
    )
    .unwrap();
    let shard = TokenShard::open_detect(dir.path().join("e.bin")).unwrap();
    let ids: Vec<u32> = (0..shard.len()).map(|i| shard.token(i) as u32).collect();
    let want = tiktoken_rs::r50k_base().unwrap().encode_ordinary(text);
    assert_eq!(ids, want);
    assert!(!ids.contains(&50_256), "{ids:?}");
    // A hand-written vocabulary without `kind` is characters; anything else is refused
    // naming the file and the field.
    for (text, field) in [
        (r#"{"tokens": ["a", "b"]}"#, ""),
        (r#"{"kind": 7}"#, "kind"),
        (r#"{"kind": "wordpiece"}"#, "kind"),
        (r#"{"kind": "gpt2"}"#, "size"),
        (r#"{"kind": "char", "tokens": 7}"#, "tokens"),
        (r#"{"tokens": ["a", 3]}"#, "tokens[1]"),
        ("not json", "vocab"),
    ] {
        let path = dir.path().join("hand.vocab.json");
        std::fs::write(&path, text).unwrap();
        match (Vocab::load(&path), field) {
            (Ok(v), "") => assert_eq!(v.size(), 2),
            (Err(e), f) if !f.is_empty() => {
                let e = e.to_string();
                assert!(
                    e.contains("hand.vocab.json") && e.contains(f),
                    "{text}: {e}"
                );
            }
            (other, _) => panic!("{text}: {other:?}"),
        }
    }

    std::fs::write(dir.path().join("latin1.txt"), [b'o', b'k', 0xE9, b'!']).unwrap();
    let e = pack_text(
        &[dir.path().join("latin1.txt")],
        dir.path().join("x"),
        Tokenizer::Char,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("latin1.txt") && e.contains("UTF-8") && e.contains("byte 2"),
        "{e}"
    );
}
