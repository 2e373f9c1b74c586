//! Activations recomputed in the backward: attention's probabilities
//! (`StepOptions::recompute_attention`, Megatron-LM's selective recomputation), the MLP's
//! activation (`recompute_mlp`, llm.c's default), or both. The GPT's and the Llama's steps
//! give the plain steps' losses and gradients bit for bit (the same kernels on the same
//! inputs), over two micro-batches and an evaluation, in f32 and bf16, while holding one
//! buffer of each recomputed activation instead of one per block.

mod common;

use common::run_micro_batches;
use stoker_gpu::parallel::Trainable;
use stoker_gpu::sample::{gpt, ids, llama};
use stoker_gpu::step::gpt::gpt_step_sizes;
use stoker_gpu::step::llama::llama_step_sizes;
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::{GptGpuStep, LlamaGpuStep};
use stoker_gpu::{Act, Host};
use stoker_kernels::{GptDims, LlamaDims};
use stoker_testkit::assert_bits_eq;

const B: usize = 2;
const T: usize = 9;
const RECOMPUTE: StepOptions = StepOptions {
    offload_params: false,
    recompute_attention: true,
    recompute_mlp: false,
    grads_in_slots: false,
    shard_params: None,
    graph_micro_batches: false,
    flash_attention: false,
    fp8_linears: false,
};

/// Two micro-batches' tokens and targets over `vocab`, a few targets ignored.
fn batches(vocab: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    (0..2u64)
        .map(|k| {
            let draw = |s| -> Vec<i64> { ids(B * T, s, vocab).iter().map(|&x| x as i64).collect() };
            let mut targets = draw(20 + k);
            targets[3] = -1;
            (draw(10 + k), targets)
        })
        .collect()
}

/// Runs `plain` and `recompute` (steps of one model) over the same micro-batches `data`
/// (two at least) and compares losses, gradients and an evaluation bit for bit.
fn same_bits<S: Trainable<Host>>(
    what: String,
    params: &[f32],
    data: Vec<(Vec<i64>, Vec<i64>)>,
    plain: &S,
    recompute: &S,
) {
    let (want, got) = (
        run_micro_batches(plain, params, &data),
        run_micro_batches(recompute, params, &data),
    );
    assert_eq!(got.0, want.0, "{what}: losses");
    assert_bits_eq(&got.1, &want.1, &format!("{what}: gradients"));
    assert_eq!(got.2, want.2, "{what}: evaluation");
}

/// Each recompute option: attention's probabilities, the MLP's activation, both.
fn options() -> [(StepOptions, &'static str); 3] {
    let mlp = StepOptions {
        recompute_attention: false,
        recompute_mlp: true,
        ..RECOMPUTE
    };
    let both = StepOptions {
        recompute_mlp: true,
        ..RECOMPUTE
    };
    [
        (RECOMPUTE, "attention"),
        (mlp, "mlp"),
        (both, "attention+mlp"),
    ]
}

/// Elements a step of `n_layer` blocks saves by keeping one buffer of `per_block` for
/// every block instead of one each, where `on`: each span starts aligned, so one held
/// between others takes `per_block` rounded up to the alignment.
fn saved(n_layer: usize, per_block: usize, on: bool) -> usize {
    match on {
        true => (n_layer - 1) * per_block.next_multiple_of(stoker_gpu::step::layout::SPAN_ALIGN),
        false => 0,
    }
}

#[test]
fn recomputed_activations_are_the_kept_ones_bit_for_bit_in_less_memory() {
    fn check<A: Act>(opts: StepOptions, which: &str) {
        let what = format!("{:?}, {which} recomputed", A::DTYPE);
        let dims = GptDims {
            vocab: 41,
            context: 12,
            d_model: 16,
            n_layer: 3,
            n_head: 2,
        };
        let g = gpt(&dims, 5, 0.2);
        let plain = GptGpuStep::<Host, A>::new(&Host, dims, g.offsets.clone(), 1e-5, B, T).unwrap();
        let rec =
            GptGpuStep::<Host, A>::with_options(&Host, dims, g.offsets.clone(), 1e-5, (B, T), opts)
                .unwrap();
        same_bits(
            format!("gpt {what}"),
            &g.params,
            batches(dims.vocab),
            &plain,
            &rec,
        );
        // Two blocks' probabilities and/or GELU outputs fewer: counted, and planned alike.
        let tt = B * dims.n_head * T * T;
        let gelu = B * T * 4 * dims.d_model;
        let size = std::mem::size_of::<A>();
        assert_eq!(
            plain.buffers().bytes() - rec.buffers().bytes(),
            (saved(dims.n_layer, tt, opts.recompute_attention)
                + saved(dims.n_layer, gelu, opts.recompute_mlp))
                * size,
            "gpt {what}: bytes saved"
        );
        let planned = gpt_step_sizes(&dims, g.offsets.end(), (B, T), opts).bytes(size);
        assert_eq!(
            rec.buffers().bytes(),
            planned,
            "gpt {what}: counted against planned"
        );

        let dims = LlamaDims {
            vocab: 43,
            context: 12,
            d_model: 16,
            n_layer: 3,
            n_head: 4,
            n_kv_head: 2,
            ffn_hidden: 24,
        };
        let l = llama(&dims, 6, 0.2);
        let theta = 10_000.0;
        let plain = LlamaGpuStep::<Host, A>::new(&Host, dims, l.offsets.clone(), 1e-5, theta, B, T)
            .unwrap();
        let rec = LlamaGpuStep::<Host, A>::with_options(
            &Host,
            dims,
            l.offsets.clone(),
            (1e-5, theta),
            (B, T),
            opts,
        )
        .unwrap();
        same_bits(
            format!("llama {what}"),
            &l.params,
            batches(dims.vocab),
            &plain,
            &rec,
        );
        let (tt, act) = (B * dims.n_head * T * T, B * T * dims.ffn_hidden);
        assert_eq!(
            plain.buffers().bytes() - rec.buffers().bytes(),
            (saved(dims.n_layer, tt, opts.recompute_attention)
                + saved(dims.n_layer, act, opts.recompute_mlp))
                * size,
            "llama {what}: bytes saved"
        );
        let planned = llama_step_sizes(&dims, l.offsets.end(), (B, T), opts).bytes(size);
        assert_eq!(
            rec.buffers().bytes(),
            planned,
            "llama {what}: counted against planned"
        );
    }
    for (opts, which) in options() {
        check::<f32>(opts, which);
        check::<half::bf16>(opts, which);
    }
}

/// 520 positions, attention in 2 query chunks of 260: the recomputed probabilities land
/// in one buffer shared by every block, each row written up to its chunk's width; the
/// steps still give the kept ones' losses, gradients and evaluation bit for bit, GPT and
/// Llama, f32 and bf16.
#[test]
fn recompute_with_chunked_attention_is_the_kept_one_bit_for_bit() {
    const LONG: usize = 520;
    assert_eq!(stoker_gpu::step::attention::query_chunk(LONG), 260);
    let both = StepOptions {
        recompute_mlp: true,
        ..RECOMPUTE
    };
    let data = |vocab: usize| -> Vec<(Vec<i64>, Vec<i64>)> {
        let draw = |s| -> Vec<i64> { ids(LONG, s, vocab).iter().map(|&x| x as i64).collect() };
        vec![(draw(31), draw(32)), (draw(33), draw(34))]
    };
    fn check<A: Act>(opts: StepOptions, data: &dyn Fn(usize) -> Vec<(Vec<i64>, Vec<i64>)>) {
        let what = format!("{:?}, 520 positions", A::DTYPE);
        let dims = GptDims {
            vocab: 23,
            context: LONG,
            d_model: 8,
            n_layer: 2,
            n_head: 2,
        };
        let g = gpt(&dims, 7, 0.3);
        let make = |o| {
            GptGpuStep::<Host, A>::with_options(&Host, dims, g.offsets.clone(), 1e-5, (1, LONG), o)
                .unwrap()
        };
        let (plain, rec) = (make(StepOptions::default()), make(opts));
        same_bits(
            format!("gpt {what}"),
            &g.params,
            data(dims.vocab),
            &plain,
            &rec,
        );
        let dims = LlamaDims {
            vocab: 23,
            context: LONG,
            d_model: 8,
            n_layer: 2,
            n_head: 2,
            n_kv_head: 1,
            ffn_hidden: 12,
        };
        let l = llama(&dims, 8, 0.3);
        let make = |o| {
            LlamaGpuStep::<Host, A>::with_options(
                &Host,
                dims,
                l.offsets.clone(),
                (1e-5, 10_000.0),
                (1, LONG),
                o,
            )
            .unwrap()
        };
        let (plain, rec) = (make(StepOptions::default()), make(opts));
        same_bits(
            format!("llama {what}"),
            &l.params,
            data(dims.vocab),
            &plain,
            &rec,
        );
    }
    check::<f32>(both, &data);
    check::<half::bf16>(both, &data);
}
