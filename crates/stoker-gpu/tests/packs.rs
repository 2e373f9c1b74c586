//! Pack kernels and the row kernels' lanes move eight elements at a time, as 16-byte
//! words where the address allows and element by element where it does not (cuda/pack.h).
//! Which way a pack moves must change no bit: the results may not depend on how a view
//! happens to be aligned, nor on a length that leaves a partial pack at the end. Each
//! kernel here runs on the same values placed at every element offset 0..8 of a buffer
//! (every alignment a 16-byte word can have), and every run must give offset 0's bits.

use half::bf16;
use stoker_gpu::{kernels, Backend, Heads, Host, View};
use stoker_testkit::assert_bits_eq;

/// The element offsets tried: every residue of a 16-byte word for 2- and 4-byte elements.
const OFFSETS: std::ops::Range<usize> = 0..8;

/// `data` placed at element `off` of a fresh buffer (with slack after it).
fn placed<E: stoker_gpu::Elem>(data: &[E], off: usize) -> stoker_gpu::host::HostBuf<E> {
    let mut padded = vec![data[0]; off];
    padded.extend_from_slice(data);
    padded.extend(std::iter::repeat_n(data[0], 8));
    Host.upload(&padded).unwrap()
}

/// The view of `len` elements at `off` of `buf`.
fn at<E: stoker_gpu::Elem>(
    buf: &stoker_gpu::host::HostBuf<E>,
    off: usize,
    len: usize,
) -> View<'_, E> {
    Host.view(buf, off..off + len).unwrap()
}

fn bf16s(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
    stoker_gpu::sample::uniform(n, seed, scale)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Runs `run(off)` at every offset and checks each result against offset 0's (bf16
/// results widened to f32, which is exact).
fn same_at_every_offset(what: &str, run: impl Fn(usize) -> Vec<f32>) {
    let want = run(0);
    for off in OFFSETS.skip(1) {
        assert_bits_eq(&run(off), &want, &format!("{what} at element offset {off}"));
    }
}

/// bf16 values widened to f32.
fn wide(x: Vec<bf16>) -> Vec<f32> {
    x.into_iter().map(f32::from).collect()
}

#[test]
fn gelu_and_the_residual_layer_norm_ignore_alignment_and_partial_packs() {
    // 37 elements: four whole packs and a partial one; rows of 20 and 24 (a row of 20
    // starts mid-word every other row).
    let x = bf16s(37, 1, 2.0);
    same_at_every_offset("gelu forward", |off| {
        let (inp, out) = (placed(&x, off), placed(&[bf16::ZERO; 37], off));
        kernels::gelu_forward(&Host, at(&out, off, 37), at(&inp, off, 37)).unwrap();
        wide(Host.read(at(&out, off, 37)).unwrap())
    });
    for c in [20, 24, 3] {
        let rows = 5;
        let (x, a2, w, b) = (
            bf16s(rows * c, 2, 1.0),
            bf16s(rows * c, 3, 1.0),
            bf16s(c, 4, 1.0),
            bf16s(c, 5, 0.5),
        );
        same_at_every_offset(&format!("layer norm of rows of {c}"), |off| {
            let (xb, a2b, wb, bb) = (
                placed(&x, off),
                placed(&a2, off),
                placed(&w, off),
                placed(&b, off),
            );
            let (out, sum) = (placed(&x, off), placed(&x, off));
            let (mean, rstd) = (
                Host.zeros::<f32>(rows).unwrap(),
                Host.zeros::<f32>(rows).unwrap(),
            );
            kernels::layernorm_forward(
                &Host,
                at(&out, off, rows * c),
                kernels::Stats {
                    mean: Host.all(&mean),
                    rstd: Host.all(&rstd),
                },
                at(&xb, off, rows * c),
                Some((at(&sum, off, rows * c), at(&a2b, off, rows * c))),
                at(&wb, off, c),
                at(&bb, off, c),
                1e-5,
            )
            .unwrap();
            let mut got = wide(Host.read(at(&out, off, rows * c)).unwrap());
            got.extend(wide(Host.read(at(&sum, off, rows * c)).unwrap()));
            got.extend(Host.download(&mean).unwrap());
            got.extend(Host.download(&rstd).unwrap());
            got
        });
    }
}

#[test]
fn the_causal_softmax_ignores_alignment_and_partial_packs() {
    // T = 13: every row ends mid-pack, and rows start at every residue.
    let (t, heads) = (13, 2);
    let pre = bf16s(heads * t * t, 6, 3.0);
    for chunk in [t, 5] {
        same_at_every_offset(&format!("softmax forward, chunk {chunk}"), |off| {
            let (p, a) = (placed(&pre, off), placed(&vec![bf16::ZERO; pre.len()], off));
            kernels::attention_softmax_forward(
                &Host,
                at(&a, off, pre.len()),
                at(&p, off, pre.len()),
                (t, chunk),
                0.3,
            )
            .unwrap();
            wide(Host.read(at(&a, off, pre.len())).unwrap())
        });
    }
}

#[test]
fn the_classifier_ignores_alignment_and_partial_packs() {
    // V = 45 padded to Vp = 48: rows start on a word only at some offsets.
    let (n, v, vp) = (4, 45, 48);
    let logits = bf16s(n * vp, 7, 4.0);
    let targets = stoker_gpu::Ids::new(&Host, "targets", &[3, 44, 0, 17], v, None).unwrap();
    same_at_every_offset("classifier", |off| {
        let x = placed(&logits, off);
        let (losses, hits) = (Host.zeros::<f32>(n).unwrap(), Host.zeros::<f32>(n).unwrap());
        kernels::classifier(
            &Host,
            at(&x, off, n * vp),
            Host.all(&losses),
            Some(Host.all(&hits)),
            &targets,
            v,
            Some(0.25),
            -1,
        )
        .unwrap();
        let mut got: Vec<f32> = Host
            .read(at(&x, off, n * vp))
            .unwrap()
            .into_iter()
            .map(f32::from)
            .collect();
        got.extend(Host.download(&losses).unwrap());
        got.extend(Host.download(&hits).unwrap());
        got
    });
}

#[test]
fn head_permutations_ignore_alignment_and_odd_head_widths() {
    // d = 8 moves whole packs; d = 5 goes element by element: both are the same layout.
    for d in [8, 5] {
        let g = Heads {
            b: 2,
            t: 3,
            h: 2,
            d,
        };
        let len = 3 * 2 * 3 * 2 * d as usize;
        let qkv = bf16s(len, 8, 1.0);
        same_at_every_offset(&format!("qkv to heads and back, d {d}"), |off| {
            let (src, dst, back) = (
                placed(&qkv, off),
                placed(&vec![bf16::ZERO; len], off),
                placed(&vec![bf16::ZERO; len], off),
            );
            kernels::qkv_heads(&Host, at(&dst, off, len), at(&src, off, len), g, false).unwrap();
            kernels::qkv_heads(&Host, at(&back, off, len), at(&dst, off, len), g, true).unwrap();
            let mut got = wide(Host.read(at(&dst, off, len)).unwrap());
            let round = wide(Host.read(at(&back, off, len)).unwrap());
            assert_bits_eq(
                &round,
                &wide(qkv.clone()),
                "qkv to heads and back is the identity",
            );
            got.extend(round);
            got
        });
    }
}

#[test]
fn adamw_ignores_alignment_and_partial_packs() {
    let n = 29;
    let (p, g) = (
        stoker_gpu::sample::uniform(n, 9, 1.0),
        stoker_gpu::sample::uniform(n, 10, 0.1),
    );
    let (m, v) = (
        stoker_gpu::sample::uniform(n, 11, 0.01),
        stoker_gpu::sample::uniform(n, 12, 0.01)
            .into_iter()
            .map(f32::abs)
            .collect::<Vec<_>>(),
    );
    let step = stoker_kernels::AdamWStep::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
    same_at_every_offset("adamw", |off| {
        let (pb, gb, mb, vb) = (
            placed(&p, off),
            placed(&g, off),
            placed(&m, off),
            placed(&v, off),
        );
        let copy = placed(&vec![bf16::ZERO; n], off);
        kernels::adamw(
            &Host,
            at(&pb, off, n),
            at(&gb, off, n),
            at(&mb, off, n),
            at(&vb, off, n),
            Some(at(&copy, off, n)),
            &step,
            true,
            0.5,
        )
        .unwrap();
        let mut got = Host.read(at(&pb, off, n)).unwrap();
        got.extend(Host.read(at(&mb, off, n)).unwrap());
        got.extend(Host.read(at(&vb, off, n)).unwrap());
        got.extend(
            Host.read(at(&copy, off, n))
                .unwrap()
                .into_iter()
                .map(f32::from),
        );
        got
    });
}
