//! Token shards (nanoGPT raw u16, llm.c header) and (input, target) windows.

use stoker_data::tokens::{write_tokens, TokenFormat, TokenShard, TokenWindows};
use stoker_data::{DType, Dataset, SampleContext};

fn read(ds: &TokenWindows, i: usize) -> (Vec<i64>, Vec<i64>) {
    let c = ds.context();
    let (mut a, mut b) = (vec![0u8; 8 * c], vec![0u8; 8 * c]);
    ds.read_sample(
        &mut (),
        SampleContext {
            seed: 0,
            epoch: 0,
            index: i as u64,
        },
        &mut [&mut a, &mut b],
    )
    .unwrap();
    let dec = |v: &[u8]| {
        v.chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (dec(&a), dec(&b))
}

#[test]
fn windows_match_hand_computed_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<u16> = (0..23).map(|t| t * 3 + 1000).collect(); // 22/4 = 5 windows
    let b: Vec<u16> = (0..9).map(|t| 60000 + t).collect(); // 8/4 = 2 windows
    write_tokens(dir.path().join("a.bin"), &a, TokenFormat::Llmc).unwrap();
    write_tokens(dir.path().join("b.bin"), &b, TokenFormat::NanoGpt).unwrap();
    let sa = TokenShard::open_detect(dir.path().join("a.bin")).unwrap();
    let sb = TokenShard::open_detect(dir.path().join("b.bin")).unwrap();
    assert_eq!((sa.len(), sb.len()), (23, 9));
    assert_eq!(
        std::fs::metadata(dir.path().join("a.bin")).unwrap().len(),
        1024 + 46
    );
    let ds = TokenWindows::new(vec![sa, sb], 4, DType::I64).unwrap();
    assert_eq!(ds.len(), 7);
    // Window 3 of shard a: tokens 12..16, targets 13..17.
    let (x, y) = read(&ds, 3);
    assert_eq!(x, vec![1036, 1039, 1042, 1045]);
    assert_eq!(y, vec![1039, 1042, 1045, 1048]);
    // Window 6 = window 1 of shard b: tokens 4..8, targets 5..9 (last token used only as target).
    let (x, y) = read(&ds, 6);
    assert_eq!(x, vec![60004, 60005, 60006, 60007]);
    assert_eq!(y, vec![60005, 60006, 60007, 60008]);
    assert_eq!(ds.locate(5), (1, 0));
}

#[test]
fn u16_and_i32_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let toks: Vec<u16> = vec![1, 2, 65535, 4, 5];
    write_tokens(dir.path().join("t.bin"), &toks, TokenFormat::NanoGpt).unwrap();
    let s = TokenShard::open(dir.path().join("t.bin"), TokenFormat::NanoGpt).unwrap();
    let ds = TokenWindows::new(vec![s.clone()], 2, DType::I32).unwrap();
    let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
    ds.read_sample(
        &mut (),
        SampleContext {
            seed: 0,
            epoch: 0,
            index: 1,
        },
        &mut [&mut a, &mut b],
    )
    .unwrap();
    assert_eq!(bytemuck::cast_slice::<u8, i32>(&a), &[65535, 4]);
    let ds16 = TokenWindows::new(vec![s], 2, DType::U16).unwrap();
    let (mut a, mut b) = ([0u8; 4], [0u8; 4]);
    ds16.read_sample(
        &mut (),
        SampleContext {
            seed: 0,
            epoch: 0,
            index: 0,
        },
        &mut [&mut a, &mut b],
    )
    .unwrap();
    assert_eq!(a, [1, 0, 2, 0]);
    assert_eq!(b, [2, 0, 255, 255]);
}

#[test]
fn bad_token_files_give_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("odd.bin");
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    let e = TokenShard::open(&p, TokenFormat::NanoGpt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("odd.bin") && e.contains("odd"), "{e}");

    let p = dir.path().join("magic.bin");
    std::fs::write(&p, vec![0u8; 2048]).unwrap();
    let e = TokenShard::open(&p, TokenFormat::Llmc)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("magic") && e.contains("20240520") && e.contains("HINT"),
        "{e}"
    );

    let p = dir.path().join("count.bin");
    write_tokens(&p, &[1, 2, 3], TokenFormat::Llmc).unwrap();
    let mut v = std::fs::read(&p).unwrap();
    v.truncate(v.len() - 2);
    std::fs::write(&p, &v).unwrap();
    let e = TokenShard::open(&p, TokenFormat::Llmc)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token count") && e.contains("3 tokens need 6 bytes") && e.contains("has 4"),
        "{e}"
    );

    let p = dir.path().join("version.bin");
    write_tokens(&p, &[1, 2, 3], TokenFormat::Llmc).unwrap();
    let mut v = std::fs::read(&p).unwrap();
    v[4] = 7;
    std::fs::write(&p, &v).unwrap();
    let e = TokenShard::open(&p, TokenFormat::Llmc)
        .unwrap_err()
        .to_string();
    assert!(e.contains("version") && e.contains("7"), "{e}");

    let s = TokenShard::open(
        dir.path().join("odd.bin").with_file_name("magic.bin"),
        TokenFormat::NanoGpt,
    )
    .unwrap();
    assert!(TokenWindows::new(vec![s.clone()], 0, DType::I64)
        .unwrap_err()
        .to_string()
        .contains("context"));
    assert!(TokenWindows::new(vec![s], 4, DType::F32)
        .unwrap_err()
        .to_string()
        .contains("token_dtype"));
}

/// A dataset tells the bytes of the files it maps (what its pages can add to the resident
/// set), each file once: the llm.c shard's header is mapped too, and `.npy` fields count
/// file by file.
#[test]
fn datasets_tell_the_bytes_of_the_files_they_map() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u16> = (0..5000).map(|t| t % 50).collect();
    let shard = dir.path().join("text.bin");
    write_tokens(&shard, &tokens, TokenFormat::Llmc).unwrap();
    let file_len = |p: &std::path::Path| std::fs::metadata(p).unwrap().len();
    let opts = stoker_data::OpenOptions {
        context: 16,
        ..Default::default()
    };
    let ds = stoker_data::open_dataset(&shard, &opts).unwrap();
    assert_eq!(ds.mapped_bytes(), file_len(&shard));
    assert!(
        file_len(&shard) > 2 * tokens.len() as u64,
        "the header is in the file"
    );

    let (x, y) = (dir.path().join("d.x.npy"), dir.path().join("d.y.npy"));
    stoker_data::npy::write_npy(&x, DType::U8, &[10, 3], &[1u8; 30]).unwrap();
    stoker_data::npy::write_npy(&y, DType::I64, &[10], &[0u8; 80]).unwrap();
    let ds = stoker_data::open_dataset(dir.path().join("d"), &opts).unwrap();
    assert_eq!(ds.mapped_bytes(), file_len(&x) + file_len(&y));
}

/// A file of 256 i32 (the header) then `body` bytes.
fn with_header(path: &std::path::Path, header: [i32; 3], body: &[u8]) {
    let mut bytes = vec![0u8; 1024];
    for (i, v) in header.iter().enumerate() {
        bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    bytes.extend_from_slice(body);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn another_llmc_header_is_refused_by_its_magic_not_read_as_raw_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // llm.c's Llama 3 shard: 100 u32 tokens.
    let u32s: Vec<u8> = (0..100u32).flat_map(|t| t.to_le_bytes()).collect();
    with_header(&d.join("llama3.bin"), [20240801, 7, 100], &u32s);
    let e = TokenShard::open_detect(d.join("llama3.bin"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("llama3.bin")
            && e.contains("header[0] (magic)")
            && e.contains("20240801")
            && e.contains("u32 tokens"),
        "{e}"
    );
    // Any header whose count gives the file's size, with a magic of its own.
    with_header(&d.join("other.bin"), [1234567, 2, 50], &[0u8; 100]);
    let e = TokenShard::open_detect(d.join("other.bin"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("other.bin") && e.contains("1234567") && e.contains("llm.c-style header"),
        "{e}"
    );
    // The same bytes with a count that does not fit the size are raw tokens (nanoGPT's).
    with_header(&d.join("raw.bin"), [1234567, 2, 51], &[0u8; 100]);
    let s = TokenShard::open_detect(d.join("raw.bin")).unwrap();
    assert_eq!(s.len(), (1024 + 100) / 2);
    assert_eq!(
        (s.token(0), s.token(1)),
        (1234567u32 as u16, (1234567u32 >> 16) as u16)
    );
    // A raw file shorter than a header opens as raw tokens too.
    write_tokens(
        d.join("short.bin"),
        &[(20240801u32 % 65536) as u16, 0, 3],
        TokenFormat::NanoGpt,
    )
    .unwrap();
    assert_eq!(
        TokenShard::open_detect(d.join("short.bin")).unwrap().len(),
        3
    );
}

#[test]
fn an_id_past_the_model_s_vocabulary_fails_naming_the_file_the_token_and_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens: Vec<u16> = (0..200).map(|t| t % 50).collect();
    tokens[37] = 50;
    write_tokens(dir.path().join("t.bin"), &tokens, TokenFormat::Llmc).unwrap();
    let shard = TokenShard::open_detect(dir.path().join("t.bin")).unwrap();
    let ds = TokenWindows::new(vec![shard], 16, DType::I64)
        .unwrap()
        .with_vocab(stoker_data::tokens::IdLimit {
            ids: 50,
            key: "model.vocab",
        });
    let read_window = |i: u64| {
        let (mut a, mut b) = (vec![0u8; 8 * 16], vec![0u8; 8 * 16]);
        ds.read_sample(
            &mut (),
            SampleContext {
                seed: 0,
                epoch: 0,
                index: i,
            },
            &mut [&mut a, &mut b],
        )
    };
    // Window 0 (tokens 0..17) and window 3 (48..65) hold only ids below 50.
    read_window(0).unwrap();
    read_window(3).unwrap();
    // Window 2 holds tokens 32..49: id 50 at token 37.
    let e = read_window(2).unwrap_err().to_string();
    assert!(
        e.contains("t.bin")
            && e.contains("id 50 at token 37 (window 2)")
            && e.contains("vocabulary of 50 (model.vocab)"),
        "{e}"
    );
}

/// A FIFO where a shard should be is refused at once (before: opening it blocked until a
/// writer came, and a run hung before its first step, deaf to one SIGTERM); so is one
/// where an `.npy` should be.
#[test]
fn a_fifo_where_a_shard_should_be_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.bin");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) reads the NUL-terminated path `c` owns for the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = TokenShard::open_detect(&fifo).unwrap_err().to_string();
    assert!(
        e.contains("fifo.bin") && e.contains("a FIFO (named pipe), expected a regular file"),
        "{e}"
    );
    let npy = dir.path().join("x.npy");
    std::fs::rename(&fifo, &npy).unwrap();
    let e = stoker_data::npy::NpyArray::open(&npy)
        .unwrap_err()
        .to_string();
    assert!(e.contains("x.npy") && e.contains("a FIFO"), "{e}");
}

#[test]
fn a_directory_where_a_shard_should_be_is_named_as_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("x.bin")).unwrap();
    let e = TokenShard::open_detect(dir.path().join("x.bin"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("x.bin") && e.contains("a directory, expected a file"),
        "{e}"
    );
}
