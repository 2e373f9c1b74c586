//! The step's forecast (`stoker_gpu::forecast`): the counting backend runs the step's own
//! code, so what it counts must be the step's work exactly. Its products' FLOPs equal
//! the count written out from the model's shapes. The roofline adds its parts up, and
//! each part answers to the figure it depends on.

use stoker_gpu::counting::Work;
use stoker_gpu::forecast::{forecast, gpt_step_work, llama_step_work, GpuFigures};
use stoker_gpu::step::options::StepOptions;
use stoker_kernels::{GptDims, LlamaDims};

const GPT: GptDims = GptDims {
    vocab: 97,
    context: 40,
    d_model: 32,
    n_layer: 3,
    n_head: 4,
};

/// GPT-2 124M.
const GPT2: GptDims = GptDims {
    vocab: 50_257,
    context: 1024,
    d_model: 768,
    n_layer: 12,
    n_head: 12,
};

fn flops(work: &[Work]) -> (f64, f64) {
    let (mut dense, mut batched) = (0.0, 0.0);
    for w in work {
        if let Work::Product { flops, batch, .. } = w {
            match batch {
                1 => dense += flops,
                _ => batched += flops,
            }
        }
    }
    (dense, batched)
}

/// Keys each query's chunk covers, summed over one sequence: the width the attention
/// products run at (`step::attention::query_chunk`).
fn chunked_keys(t: usize) -> usize {
    let chunk = stoker_gpu::step::attention::query_chunk(t);
    (0..t).map(|q| ((q / chunk + 1) * chunk).min(t)).sum()
}

#[test]
fn the_gpt_steps_products_are_its_linear_layers_head_and_chunked_attention() {
    for (b, t) in [(2, 40), (1, 600)] {
        let dims = GptDims { context: t, ..GPT };
        let work = gpt_step_work::<half::bf16>(dims, (b, t), StepOptions::default())
            .unwrap()
            .all();
        let (dense, batched) = flops(&work);
        let (n, c, l) = ((b * t) as f64, dims.d_model as f64, dims.n_layer as f64);
        let v = dims.vocab as f64;
        // Forward 2 FLOPs a weight a position, backward twice that (input and weight
        // gradients): 12 C^2 weights a block, the tied head's V x C (the logits' rows
        // are padded to Vp, but the products stop at the vocabulary).
        assert_eq!(
            dense,
            6.0 * n * (12.0 * c * c * l + v * c),
            "dense, {b} x {t}"
        );
        // Scores and weighted values forward, their four gradients back: six products of
        // each head's queries against the keys its chunk covers, d = C / H wide.
        let heads = (b * dims.n_head) as f64 * l;
        let d = c / dims.n_head as f64;
        assert_eq!(
            batched,
            6.0 * 2.0 * heads * chunked_keys(t) as f64 * d,
            "batched, {b} x {t}"
        );
    }
}

/// With the linear layers in FP8 the products are the same, and exactly the blocks' (not
/// the head's) are FP8's: 12 a block (four layers, forward and two gradients), 6 x 12 C^2
/// FLOPs a position. Timed at FP8's peak they take less, down to half where FLOP-bound;
/// the rest of the products take what they took.
#[test]
fn fp8_linear_layers_products_are_counted_as_fp8_and_timed_at_its_peak() {
    let dims = GptDims {
        vocab: 50_304,
        ..GPT2
    };
    let fp8 = StepOptions {
        fp8_linears: true,
        ..StepOptions::default()
    };
    let (b, t) = (4, 1024);
    let work = gpt_step_work::<half::bf16>(dims, (b, t), fp8)
        .unwrap()
        .all();
    let plain = gpt_step_work::<half::bf16>(dims, (b, t), StepOptions::default())
        .unwrap()
        .all();
    assert_eq!(flops(&work), flops(&plain), "the same products");
    let (mut count, mut fp8_flops) = (0, 0.0);
    for w in &work {
        if let Work::Product {
            flops, fp8: true, ..
        } = w
        {
            count += 1;
            fp8_flops += flops;
        }
    }
    let (n, c) = ((b * t) as f64, dims.d_model as f64);
    assert_eq!(count, 12 * dims.n_layer);
    assert_eq!(fp8_flops, 6.0 * n * 12.0 * c * c * dims.n_layer as f64);
    assert!(!plain
        .iter()
        .any(|w| matches!(w, Work::Product { fp8: true, .. })));
    let h100 = GpuFigures::assumed(989e12, 3.35e12, 50e9);
    let (at_bf16, at_fp8) = (
        forecast(&work, &h100),
        forecast(&work, &h100.clone().with_fp8_peak(2.0 * 989e12)),
    );
    assert!(at_bf16.fp8_products_s > 0.0);
    assert!(
        at_fp8.fp8_products_s < at_bf16.fp8_products_s
            && at_fp8.fp8_products_s >= at_bf16.fp8_products_s / 2.0,
        "{} at FP8's peak, {} at bf16's",
        at_fp8.fp8_products_s,
        at_bf16.fp8_products_s
    );
    let rest = |f: &stoker_gpu::forecast::StepForecast| f.products_s - f.fp8_products_s;
    assert!((rest(&at_fp8) - rest(&at_bf16)).abs() <= 1e-12 * rest(&at_bf16));
    assert_eq!(forecast(&plain, &h100).fp8_products_s, 0.0);
}

#[test]
fn recomputing_attention_adds_the_scores_product_again() {
    let (b, t) = (2, 40);
    let dims = GptDims { context: t, ..GPT };
    let opts = StepOptions {
        recompute_attention: true,
        ..StepOptions::default()
    };
    let plain = flops(
        &gpt_step_work::<half::bf16>(dims, (b, t), StepOptions::default())
            .unwrap()
            .all(),
    );
    let again = flops(
        &gpt_step_work::<half::bf16>(dims, (b, t), opts)
            .unwrap()
            .all(),
    );
    let heads = (b * dims.n_head * dims.n_layer) as f64;
    let d = (dims.d_model / dims.n_head) as f64;
    assert_eq!(again.0, plain.0);
    assert_eq!(again.1 - plain.1, 2.0 * heads * chunked_keys(t) as f64 * d);
}

#[test]
fn flash_attention_counts_its_causal_tiles_in_place_of_the_per_head_products() {
    // d_model 32 over 2 heads: heads 16 wide; 40 positions: 3 tiles a head, one partial.
    let (b, t) = (2, 40);
    let dims = GptDims {
        context: t,
        n_head: 2,
        ..GPT
    };
    let opts = StepOptions {
        flash_attention: true,
        ..StepOptions::default()
    };
    let plain = gpt_step_work::<half::bf16>(dims, (b, t), StepOptions::default()).unwrap();
    let flash = gpt_step_work::<half::bf16>(dims, (b, t), opts).unwrap();
    let (dense, batched) = flops(&flash.all());
    assert_eq!(
        dense,
        flops(&plain.all()).0,
        "the linear layers and the head"
    );
    assert_eq!(batched, 0.0, "no per-head products");
    let kernel_flops = |k: &str| -> f64 {
        flash
            .all()
            .iter()
            .filter_map(|w| match w {
                Work::Launch { kernel, flops, .. } if *kernel == k => Some(*flops),
                _ => None,
            })
            .sum()
    };
    // Per head, R = 3 tiles meet R (R + 1) / 2 = 6 pairs of 16 x 16 blocks, each product
    // 2 x 16 x 16 x 16 FLOPs: the forward 2 products a pair, the key side 4, the query
    // side 3.
    let pairs = (b * dims.n_head * dims.n_layer * 6) as f64;
    let product = 2.0 * 16.0 * 16.0 * 16.0;
    assert_eq!(kernel_flops("flash_forward"), pairs * 2.0 * product);
    assert_eq!(kernel_flops("flash_backward_kv"), pairs * 4.0 * product);
    assert_eq!(kernel_flops("flash_backward_q"), pairs * 3.0 * product);
    assert_eq!(kernel_flops("attention_softmax_forward"), 0.0);
    let softmaxes = |w: &[Work]| {
        w.iter()
            .filter(|w| matches!(w, Work::Launch { kernel, .. } if kernel.starts_with("attention_softmax")))
            .count()
    };
    assert_eq!(softmaxes(&flash.all()), 0);
    assert!(softmaxes(&plain.all()) > 0);
}

#[test]
fn the_forecast_adds_its_parts_and_each_follows_its_figure() {
    let dims = GPT2;
    let work = gpt_step_work::<half::bf16>(dims, (16, 1024), StepOptions::default())
        .unwrap()
        .all();
    let h100 = GpuFigures::assumed(989e12, 3.35e12, 50e9);
    let f = forecast(&work, &h100);
    let parts = f.products_s + f.batched_products_s + f.kernels_s() + f.device_s + f.host_s;
    assert_eq!(f.total_s(), parts);
    // The copy streams' transfers hide behind the stream up to its length, each way on
    // its own: up and down at once take the longer.
    let transfer = |ways: &[(f64, bool)]| {
        let mut more = work.clone();
        more.extend(ways.iter().map(|&(bytes, up)| Work::Transfer {
            bytes: bytes as u64,
            up,
        }));
        forecast(&more, &h100)
    };
    let link = |s: f64| s * parts * h100.link_bw;
    let hidden = transfer(&[(link(0.5), true), (link(0.9), false)]);
    assert_eq!(hidden.total_s(), parts);
    assert!((hidden.transfer_up_s - 0.5 * parts).abs() < 1e-9 * parts);
    let longer = transfer(&[(link(2.0), true), (link(1.5), false)]);
    assert!((longer.total_s() - 2.0 * parts).abs() < 1e-9 * parts);
    assert_eq!(
        f.launches,
        work.iter()
            .filter(|w| matches!(w, Work::Launch { .. } | Work::Product { .. }))
            .count()
    );
    // The dense products are FLOP-bound: half the peak doubles them exactly.
    let slow = forecast(
        &work,
        &GpuFigures {
            peak_flops: h100.peak_flops / 2.0,
            ..h100.clone()
        },
    );
    assert!((slow.products_s - 2.0 * f.products_s).abs() < 1e-12 * f.products_s);
    assert_eq!(slow.kernels_s(), f.kernels_s());
    // Attention's per-head products (d = 64) are bound by their bytes, not their FLOPs.
    assert_eq!(slow.batched_products_s, f.batched_products_s);
    // The kernels are bound by bytes: twice the bandwidth halves every one above the
    // launch floor.
    let wide = forecast(
        &work,
        &GpuFigures {
            mem_bw: 2.0 * h100.mem_bw,
            ..h100.clone()
        },
    );
    let softmax = |f: &stoker_gpu::forecast::StepForecast| {
        f.kernels
            .iter()
            .find(|k| k.kernel == "attention_softmax_forward")
            .map(|k| k.seconds)
            .unwrap()
    };
    assert!((softmax(&wide) - softmax(&f) / 2.0).abs() < 1e-12);
    // The classifier reads and writes the padded logits once each (16 x 1,024 rows of
    // 50,304 bf16), plus a loss and a target each row, once per step.
    let classifier = f.kernels.iter().find(|k| k.kernel == "classifier").unwrap();
    assert_eq!(classifier.launches, 1);
    assert_eq!(classifier.bytes, 2 * 16384 * 50_304 * 2 + 8 * 16384);
    // The update is its own part: the optimizer and the norm, nothing of the forward.
    let parts = gpt_step_work::<half::bf16>(dims, (16, 1024), StepOptions::default()).unwrap();
    assert_eq!(parts.all(), work);
    let update = forecast(&parts.update, &h100);
    assert_eq!(update.flops, 0.0);
    assert!(update.kernels.iter().any(|k| k.kernel == "adamw_segments"));
    assert!(!update.kernels.iter().any(|k| k.kernel == "classifier"));
    // AdamW over the master: 7 f32 accesses and the bf16 copy a parameter.
    let adamw = f
        .kernels
        .iter()
        .find(|k| k.kernel == "adamw_segments")
        .unwrap();
    let params = stoker_gpu::sample::gpt_layout(&dims)
        .1
        .last()
        .unwrap()
        .1
        .end as u64;
    assert_eq!(adamw.bytes, params * 30);
}

#[test]
fn a_llama_step_is_counted_too() {
    let dims = LlamaDims {
        vocab: 101,
        context: 32,
        d_model: 32,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        ffn_hidden: 48,
    };
    let (b, t) = (2, 32);
    let work = llama_step_work::<half::bf16>(dims, (b, t), StepOptions::default())
        .unwrap()
        .all();
    let (dense, _) = flops(&work);
    let (n, c, l) = ((b * t) as f64, dims.d_model as f64, dims.n_layer as f64);
    let kv = (dims.n_kv_head * (dims.d_model / dims.n_head)) as f64;
    let f = dims.ffn_hidden as f64;
    let v = dims.vocab as f64;
    // q and o (C x C each), k and v (C x kv each), gate, up and down (C x F each); the
    // untied head.
    let block = 2.0 * c * c + 2.0 * c * kv + 3.0 * c * f;
    assert_eq!(dense, 6.0 * n * (block * l + v * c));
}

/// The device check's fit: a step timed as if the GPU reached other fractions of its
/// peaks (products at 55%, kernels at 65% of the bandwidth, flash attention at 20%) gives
/// those fractions back from the forecast at the assumed ones; an unmeasured or NaN part
/// keeps its assumed fraction.
#[test]
fn a_fit_recovers_the_fractions_a_step_ran_at() {
    use stoker_gpu::efficiency_fit::{fit, MeasuredParts};
    use stoker_gpu::forecast::Efficiencies;
    let dims = GPT2;
    let flash = StepOptions {
        flash_attention: true,
        ..Default::default()
    };
    let work = gpt_step_work::<half::bf16>(dims, (16, 1024), flash)
        .unwrap()
        .all();
    let assumed = GpuFigures::assumed(989e12, 3.35e12, 50e9);
    let truth = Efficiencies {
        product: 0.55,
        memory: 0.65,
        tensor_kernel: 0.2,
    };
    let ran = forecast(&work, &assumed.clone().with_efficiencies(&truth));
    let measured = MeasuredParts {
        products_s: ran.products_s,
        kernels_s: ran.kernels.iter().map(|k| (k.kernel, k.seconds)).collect(),
    };
    let got = fit(&work, &assumed, &measured);
    let close = |a: f64, b: f64, what: &str| {
        assert!((a - b).abs() <= 1e-9 * b, "{what}: fitted {a}, ran at {b}");
    };
    close(got.efficiencies.product, truth.product, "products");
    close(got.efficiencies.memory, truth.memory, "streaming kernels");
    close(
        got.efficiencies.tensor_kernel,
        truth.tensor_kernel,
        "flash attention",
    );
    close(
        got.products.unwrap(),
        0.7 / 0.55,
        "the products' measured / forecast",
    );
    // Nothing measured, or a NaN: the assumed fractions stay.
    let none = fit(&work, &assumed, &MeasuredParts::default());
    assert_eq!(none.efficiencies, Efficiencies::ASSUMED);
    assert_eq!(
        (none.products, none.memory, none.tensor_kernels),
        (None, None, None)
    );
    let nan = MeasuredParts {
        products_s: f64::NAN,
        ..measured
    };
    assert_eq!(
        fit(&work, &assumed, &nan).efficiencies.product,
        Efficiencies::ASSUMED.product
    );
}

/// A model whose FP32 master would not fit in host memory (GPT, 9.9B parameters: 39.5 GB
/// of f32) is counted without a host copy of it: `stoker plan` aborted on an allocation
/// of that size before the update was counted over zeros on the counting backend.
#[test]
fn a_model_larger_than_host_memory_is_counted_without_a_copy_of_its_master() {
    let dims = GptDims {
        vocab: 50_304,
        context: 64,
        d_model: 4096,
        n_layer: 48,
        n_head: 32,
    };
    let work = gpt_step_work::<half::bf16>(dims, (1, 64), StepOptions::default()).unwrap();
    let (offsets, _) = stoker_gpu::sample::gpt_layout(&dims);
    assert_eq!(work.params, offsets.end());
    assert!(work.params > 9_800_000_000, "{} parameters", work.params);
}
