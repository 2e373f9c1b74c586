//! f32 -> FP8 / bf16 / f16 bit-exact against ml_dtypes (vectors from scripts/ref/fp8_vectors.py).

use std::io::Read;

use half::{bf16, f16};
use stoker_precision::convert;
use stoker_precision::fp8::{self, Fp8Format, Saturation};

struct Vectors {
    inputs: Vec<f32>,
    n_struct: usize,
    /// e4m3fn, e4m3fn_sat, e5m2, e5m2_sat
    fp8: [Vec<u8>; 4],
    bf16: Vec<u16>,
    f16: Vec<u16>,
    decode: [Vec<u32>; 2],
}

/// splitmix64 output `i` (1-based increments), as `splitmix64()` in the Python script.
fn splitmix64(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn load() -> Vectors {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/fp8_vectors.bin.gz");
    let file = std::fs::File::open(path).unwrap_or_else(|e| {
        panic!("{path}: {e}; regenerate with python3 scripts/ref/fp8_vectors.py")
    });
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut raw)
        .unwrap();
    assert_eq!(&raw[..8], b"STKF8V01", "{path}: wrong magic; regenerate it");
    let mut at = 8;
    let mut take = |n: usize| {
        let s = &raw[at..at + n];
        at += n;
        s.to_vec()
    };
    let u64_ = |b: Vec<u8>| u64::from_le_bytes(b.try_into().unwrap());
    let u32_ = |b: Vec<u8>| u32::from_le_bytes(b.try_into().unwrap()) as usize;
    let seed = u64_(take(8));
    let (n_struct, n_bits, n_range) = (u32_(take(4)), u32_(take(4)), u32_(take(4)));
    let mut inputs: Vec<f32> = take(4 * n_struct)
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for i in 0..n_bits as u64 {
        inputs.push(f32::from_bits((splitmix64(seed, i + 1) >> 32) as u32));
    }
    for i in 0..n_range as u64 {
        let z = splitmix64(seed, n_bits as u64 + i + 1);
        let sign = ((z >> 63) as u32) << 31;
        let exp = ((99 + (z >> 32) % 50) as u32) << 23;
        inputs.push(f32::from_bits(sign | exp | (z & 0x7F_FFFF) as u32));
    }
    let n = inputs.len();
    let fp8 = [take(n), take(n), take(n), take(n)];
    let u16s = |b: Vec<u8>| -> Vec<u16> {
        b.chunks(2)
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let u32s = |b: Vec<u8>| -> Vec<u32> {
        b.chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let bf16 = u16s(take(2 * n_struct));
    let f16 = u16s(take(2 * n_struct));
    let decode = [u32s(take(1024)), u32s(take(1024))];
    assert_eq!(at, raw.len(), "trailing bytes in {path}");
    Vectors {
        inputs,
        n_struct,
        fp8,
        bf16,
        f16,
        decode,
    }
}

fn assert_same(what: &str, inputs: &[f32], got: &[u8], want: &[u8]) {
    let bad: Vec<String> = (0..inputs.len())
        .filter(|&i| got[i] != want[i])
        .take(10)
        .map(|i| {
            format!(
                "x={:e} ({:#010x}): got {:#04x}, ml_dtypes {:#04x}",
                inputs[i],
                inputs[i].to_bits(),
                got[i],
                want[i]
            )
        })
        .collect();
    let n = (0..inputs.len()).filter(|&i| got[i] != want[i]).count();
    assert_eq!(
        n,
        0,
        "{what}: {n} of {} differ, first: {bad:#?}",
        inputs.len()
    );
}

#[test]
fn f32_to_fp8_matches_ml_dtypes_bit_exact() {
    let v = load();
    assert!(v.inputs.len() >= 1_000_000, "{} inputs", v.inputs.len());
    let cases = [
        (Fp8Format::E4M3, Saturation::NonSaturating, "e4m3fn"),
        (Fp8Format::E4M3, Saturation::Saturate, "e4m3fn saturating"),
        (Fp8Format::E5M2, Saturation::NonSaturating, "e5m2"),
        (Fp8Format::E5M2, Saturation::Saturate, "e5m2 saturating"),
    ];
    for (k, (format, sat, name)) in cases.into_iter().enumerate() {
        let mut got = vec![0u8; v.inputs.len()];
        convert::par_f32_to_fp8(&v.inputs, &mut got, format, sat).unwrap();
        assert_same(name, &v.inputs, &got, &v.fp8[k]);
        // The scalar routine and the serial bulk loop agree with the parallel one.
        let mut serial = vec![0u8; v.n_struct];
        convert::f32_to_fp8(&v.inputs[..v.n_struct], &mut serial, format, sat).unwrap();
        assert_same(
            name,
            &v.inputs[..v.n_struct],
            &serial,
            &v.fp8[k][..v.n_struct],
        );
        for (i, &x) in v.inputs.iter().enumerate().step_by(7) {
            assert_eq!(
                fp8::f32_to_fp8(x, format, sat),
                v.fp8[k][i],
                "{name} scalar {x:e}"
            );
        }
    }
}

#[test]
fn all_256_fp8_patterns_decode_like_ml_dtypes() {
    let v = load();
    let all: Vec<u8> = (0..=255).collect();
    for (k, format) in [Fp8Format::E4M3, Fp8Format::E5M2].into_iter().enumerate() {
        let mut out = vec![0f32; 256];
        convert::fp8_to_f32(&all, &mut out, format).unwrap();
        for (b, (y, &want)) in out.iter().zip(&v.decode[k]).enumerate() {
            assert_eq!(y.to_bits(), want, "{format:?} {b:#04x}");
            assert_eq!(fp8::fp8_to_f32(b as u8, format).to_bits(), want);
        }
    }
}

#[test]
fn bf16_and_f16_match_ml_dtypes_and_numpy_on_structured_inputs() {
    let v = load();
    let x = &v.inputs[..v.n_struct];
    let mut b = vec![bf16::ZERO; x.len()];
    convert::f32_to_bf16(x, &mut b).unwrap();
    let mut h = vec![f16::ZERO; x.len()];
    convert::f32_to_f16(x, &mut h).unwrap();
    for i in 0..x.len() {
        assert_eq!(
            b[i].to_bits(),
            v.bf16[i],
            "bf16 of {:#010x}",
            x[i].to_bits()
        );
        if x[i].is_nan() {
            // NaN payloads differ by convention (numpy keeps a signalling NaN signalling, the
            // half crate / F16C quiets it): require a NaN of the same sign.
            assert!(h[i].is_nan() && h[i].is_sign_negative() == x[i].is_sign_negative());
            assert_eq!(v.f16[i] & 0x7C00, 0x7C00);
        } else {
            assert_eq!(h[i].to_bits(), v.f16[i], "f16 of {:#010x}", x[i].to_bits());
        }
    }
}

/// The `float8` crate (a port of CUDA's `__NV_SATFINITE` conversion) agrees with the saturating
/// mode on every non-NaN input; NaN payload handling differs for E5M2 (see `fp8` module docs).
#[test]
fn saturating_mode_agrees_with_float8_crate() {
    let v = load();
    let mut mismatches = 0;
    for &x in &v.inputs {
        if x.is_nan() {
            continue;
        }
        let e4 = fp8::f32_to_fp8(x, Fp8Format::E4M3, Saturation::Saturate);
        let e5 = fp8::f32_to_fp8(x, Fp8Format::E5M2, Saturation::Saturate);
        mismatches += usize::from(e4 != float8::F8E4M3::from_f32(x).to_bits());
        mismatches += usize::from(e5 != float8::F8E5M2::from_f32(x).to_bits());
    }
    assert_eq!(mismatches, 0);
}
