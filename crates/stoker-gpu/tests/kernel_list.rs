//! The kernel list exists three times: cuda/kernels.inc (the C++ entries both builds
//! define), the host build's extern table (src/ffi.rs: a missing symbol fails the link)
//! and [`Call`] (names, grids, argument counts for the device launch). This holds
//! kernels.inc and `Call` in step: the same names, each with the same grid kind and the
//! same number of parameters.

use std::collections::BTreeMap;

use stoker_gpu::call::{Call, Grid};
use stoker_gpu::{AdamWArgs, Dtype, Heads};

/// kernels.inc's entries: symbol -> (grid kind, parameter count).
fn entries() -> BTreeMap<String, (String, usize)> {
    let src =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/cuda/kernels.inc")).unwrap();
    let mut out = BTreeMap::new();
    for kind in ["ELEMENTS", "PACKS", "ROWS", "WARPS"] {
        let tag = format!("STOKER_{kind}(");
        for (at, _) in src.match_indices(&tag) {
            let rest = &src[at + tag.len()..];
            let name = rest[..rest.find(',').unwrap()].trim().to_string();
            if name == "name" {
                continue; // the macro's own definition comment
            }
            let open = rest.find('(').unwrap();
            let close = open + rest[open..].find(')').unwrap();
            let params = rest[open + 1..close].split(',').count();
            // _##S: every element type; _##H: the tensor-core kernels' bf16 alone.
            let typed = [("_##S", "_f32"), ("_##S", "_bf16"), ("_##S", "_f16")];
            for (suffix, s) in typed.into_iter().chain([("_##H", "_bf16")]) {
                if let Some(base) = name.strip_suffix(suffix) {
                    out.insert(format!("{base}{s}"), (kind.to_string(), params));
                } else if !name.ends_with("_##S") && !name.ends_with("_##H") {
                    out.insert(name.clone(), (kind.to_string(), params));
                }
            }
        }
    }
    out
}

/// One call of every kind, in every element type where typed.
fn calls() -> Vec<Call> {
    let g = Heads {
        b: 1,
        t: 1,
        h: 1,
        d: 1,
    };
    let s = AdamWArgs::from(&stoker_kernels::AdamWStep::new(
        1e-3, 0.9, 0.999, 1e-8, 0.0, 1,
    ));
    let mut out = Vec::new();
    for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        out.extend([
            Call::FromF32 {
                dtype,
                out: 0,
                x: 0,
                n: 1,
            },
            Call::EncoderForward {
                dtype,
                out: 0,
                tokens: 0,
                wte: 0,
                wpe: 0,
                n: 1,
                t: 1,
                c: 1,
            },
            Call::EncoderBackwardWpe {
                dtype,
                dwpe: 0,
                dout: 0,
                b: 1,
                t: 1,
                c: 1,
            },
            Call::EncoderBackwardWte {
                dtype,
                dwte: 0,
                dout: 0,
                uniq: 0,
                starts: 0,
                positions: 0,
                u: 1,
                c: 1,
            },
            Call::GeluForward {
                dtype,
                out: 0,
                inp: 0,
                n: 1,
            },
            Call::GeluBackward {
                dtype,
                dinp: 0,
                inp: 0,
                dout: 0,
                n: 1,
            },
            Call::AddBias {
                dtype,
                out: 0,
                bias: 0,
                n: 1,
                cols: 1,
            },
            Call::QkvToHeads {
                dtype,
                dst: 0,
                src: 0,
                g,
            },
            Call::HeadsToQkv {
                dtype,
                dst: 0,
                src: 0,
                g,
            },
            Call::HeadsToMerged {
                dtype,
                dst: 0,
                src: 0,
                g,
            },
            Call::MergedToHeads {
                dtype,
                dst: 0,
                src: 0,
                g,
            },
            Call::ColumnPartials {
                dtype,
                partials: 0,
                x: 0,
                n: 1,
                cols: 1,
                r: 1,
                chunk: 1,
            },
            Call::LayernormForward {
                dtype,
                out: 0,
                mean: 0,
                rstd: 0,
                resid: 0,
                a: 0,
                a2: 0,
                weight: 0,
                bias: 0,
                n: 1,
                c: 1,
                eps: 1e-5,
            },
            Call::LayernormBackward {
                dtype,
                dinp: 0,
                partials: 0,
                dout: 0,
                inp: 0,
                weight: 0,
                mean: 0,
                rstd: 0,
                n: 1,
                c: 1,
                warps: 1,
            },
            Call::AttentionSoftmaxForward {
                dtype,
                att: 0,
                pre: 0,
                rows: 1,
                t: 1,
                chunk: 1,
                scale: 1.0,
            },
            Call::AttentionSoftmaxBackward {
                dtype,
                dpre: 0,
                datt: 0,
                att: 0,
                rows: 1,
                t: 1,
                chunk: 1,
                scale: 1.0,
            },
            Call::RmsnormForward {
                dtype,
                out: 0,
                rstd: 0,
                resid: 0,
                a: 0,
                a2: 0,
                weight: 0,
                n: 1,
                c: 1,
                eps: 1e-5,
            },
            Call::RmsnormBackward {
                dtype,
                dinp: 0,
                partials: 0,
                dout: 0,
                inp: 0,
                weight: 0,
                rstd: 0,
                n: 1,
                c: 1,
                warps: 1,
            },
            Call::Rope {
                dtype,
                x: 0,
                cos: 0,
                sin: 0,
                n: 1,
                t: 1,
                h: 1,
                d: 2,
                sign: 1.0,
            },
            Call::SwigluForward {
                dtype,
                y: 0,
                gate: 0,
                up: 0,
                n: 1,
            },
            Call::SwigluBackward {
                dtype,
                dgate: 0,
                dup: 0,
                gate: 0,
                up: 0,
                dy: 0,
                n: 1,
            },
            Call::KvToHeads {
                dtype,
                dst: 0,
                src: 0,
                g,
                kv: 1,
            },
            Call::HeadsToKv {
                dtype,
                dst: 0,
                src: 0,
                g,
                kv: 1,
            },
            Call::Fp8Quantize {
                dtype,
                out: 0,
                out_t: 0,
                amax: 0,
                x: 0,
                scale: 0,
                rows: 1,
                cols: 1,
                e5m2: 0,
                warps: 1,
            },
            Call::Classifier {
                dtype,
                logits: 0,
                losses: 0,
                hits: 0,
                targets: 0,
                n: 1,
                v: 1,
                vp: 1,
                grad: 1,
                dscale: 1.0,
                ignore: -1,
            },
        ]);
    }
    out.extend([
        Call::ReducePartials {
            dst: 0,
            partials: 0,
            p: 1,
            cols: 1,
            stride: 1,
        },
        Call::Adamw {
            p: 0,
            g: 0,
            m: 0,
            v: 0,
            copy: 0,
            n: 1,
            s,
            decay: 0,
            grad_scale: 1.0,
        },
        Call::AdamwSegments {
            p: 0,
            g: 0,
            m: 0,
            v: 0,
            copy: 0,
            n: 1,
            s,
            bounds: 0,
            decay: 0,
            segs: 1,
            grad_scale: 1.0,
        },
        Call::SgdSegments {
            p: 0,
            g: 0,
            buf: 0,
            copy: 0,
            n: 1,
            s: stoker_gpu::args::SgdArgs::from(&stoker_kernels::SgdStep {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
                first: true,
            }),
            bounds: 0,
            decay: 0,
            segs: 1,
            grad_scale: 1.0,
        },
        Call::SumPartials {
            partials: 0,
            x: 0,
            n: 1,
            squares: 0,
            warps: 1,
        },
        Call::Sum {
            out: 0,
            x: 0,
            n: 1,
            accumulate: 0,
        },
        Call::Fp8AmaxFold {
            amax: 0,
            history: 0,
            partials: 0,
            count: 1,
            len: 1,
            pos: 0,
            parts: 1,
        },
        Call::Fp8ScaleUpdate {
            state: 0,
            history: 0,
            amax: 0,
            count: 1,
            len: 1,
            pos: 0,
            most_recent: 0,
        },
        Call::FlashForward {
            out: 0,
            lse: 0,
            q: 0,
            k: 0,
            v: 0,
            tiles: 1,
            t: 1,
            d: 16,
            group: 1,
            scale: 1.0,
        },
        Call::FlashRowdot {
            dsum: 0,
            dout: 0,
            out: 0,
            rows: 1,
            d: 16,
        },
        Call::FlashBackwardKv {
            dk: 0,
            dv: 0,
            q: 0,
            k: 0,
            v: 0,
            dout: 0,
            lse: 0,
            dsum: 0,
            tiles: 1,
            t: 1,
            d: 16,
            group: 1,
            scale: 1.0,
        },
        Call::FlashBackwardQ {
            dq: 0,
            q: 0,
            k: 0,
            v: 0,
            dout: 0,
            lse: 0,
            dsum: 0,
            tiles: 1,
            t: 1,
            d: 16,
            group: 1,
            scale: 1.0,
        },
    ]);
    out
}

#[test]
fn every_call_is_a_kernels_inc_entry_with_its_grid_and_arity() {
    let want = entries();
    let got: BTreeMap<String, (String, usize)> = calls()
        .iter()
        .map(|c| {
            let kind = match c.grid() {
                Grid::Elements(_) => "ELEMENTS",
                Grid::Packs(_) => "PACKS",
                Grid::Rows(_) => "ROWS",
                Grid::Warps(_) => "WARPS",
            };
            (c.symbol(), (kind.to_string(), c.args().len()))
        })
        .collect();
    assert_eq!(
        got, want,
        "Call against cuda/kernels.inc (symbol -> grid kind, parameters)"
    );
    assert_eq!(
        want.len(),
        87,
        "kernels.inc's entry count changed: update Call and ffi.rs"
    );
}
