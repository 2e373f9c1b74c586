//! Seeded inputs (splitmix64), the same on every machine: the tests' and the device
//! check's random buffers.

/// `n` values uniform in `[-scale, scale)` from seed `seed`.
pub fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `n` ids in `0..limit` from seed `seed`.
pub fn ids(n: usize, seed: u64, limit: usize) -> Vec<i32> {
    uniform(n, seed, 1.0)
        .iter()
        .map(|&u| (((u + 1.0) * 0.5 * limit as f32) as usize).min(limit - 1) as i32)
        .collect()
}

/// A parameter table laid out contiguously in its order: each name's offset, each
/// parameter's name and range, and parameters drawn near their initialization (gains
/// 1 +- 0.1, everything else +-`scale`) from seed `seed`.
fn flat(
    table: &[stoker_kernels::ParamSpec],
    seed: u64,
    scale: f32,
) -> (std::collections::HashMap<String, usize>, Vec<f32>, Ranges) {
    use stoker_kernels::SpecInit;
    let (at, ranges) = contiguous(table);
    let mut params = Vec::with_capacity(ranges.last().map_or(0, |(_, r)| r.end));
    for (i, (p, (_, r))) in table.iter().zip(&ranges).enumerate() {
        params.extend(
            uniform(r.len(), seed + i as u64, 1.0)
                .iter()
                .map(|x| match p.init {
                    SpecInit::Ones => 1.0 + 0.1 * x,
                    _ => scale * x,
                }),
        );
    }
    (at, params, ranges)
}

/// A parameter table laid out contiguously in its order: each name's offset, and each
/// parameter's name and range.
fn contiguous(
    table: &[stoker_kernels::ParamSpec],
) -> (std::collections::HashMap<String, usize>, Ranges) {
    let (mut at, mut ranges, mut end) = (std::collections::HashMap::new(), Vec::new(), 0);
    for p in table {
        let len = p.numel();
        at.insert(p.name.clone(), end);
        ranges.push((p.name.clone(), end..end + len));
        end += len;
    }
    (at, ranges)
}

/// A GPT of `dims` laid out as [`gpt`] lays it out, without drawing its parameters: its
/// offsets and each parameter's range.
pub fn gpt_layout(dims: &stoker_kernels::GptDims) -> (stoker_kernels::GptOffsets, Ranges) {
    let (at, ranges) = contiguous(&stoker_kernels::gpt_params(dims));
    let offsets = stoker_kernels::GptOffsets::from_table(dims, |name| at.get(name).copied())
        .expect("every name of the table has an offset");
    (offsets, ranges)
}

/// A Llama of `dims` laid out as [`llama`] lays it out, without drawing its parameters.
pub fn llama_layout(dims: &stoker_kernels::LlamaDims) -> (stoker_kernels::LlamaOffsets, Ranges) {
    let (at, ranges) = contiguous(&stoker_kernels::llama_params(dims));
    let offsets = stoker_kernels::LlamaOffsets::from_table(dims, |name| at.get(name).copied())
        .expect("every name of the table has an offset");
    (offsets, ranges)
}

/// Each parameter's name and range of the flat buffer, in table order.
pub type Ranges = Vec<(String, std::ops::Range<usize>)>;

/// The optimizer's segments of a sampled model as stoker-train makes them: each
/// parameter's range of `ranges` (in `table`'s order), weight decay on tensors of rank
/// >= 2.
pub fn segments(
    table: &[stoker_kernels::ParamSpec],
    ranges: &[(String, std::ops::Range<usize>)],
) -> Vec<(std::ops::Range<usize>, bool)> {
    ranges
        .iter()
        .zip(table)
        .map(|((_, r), p)| (r.clone(), p.shape.len() >= 2))
        .collect()
}

/// A GPT of `dims` laid out contiguously in its table's order, parameters drawn as
/// `flat` draws them.
pub fn gpt(dims: &stoker_kernels::GptDims, seed: u64, scale: f32) -> SampleGpt {
    let (at, params, ranges) = flat(&stoker_kernels::gpt_params(dims), seed, scale);
    let offsets = stoker_kernels::GptOffsets::from_table(dims, |name| at.get(name).copied())
        .expect("every name of the table has an offset");
    SampleGpt {
        offsets,
        params,
        ranges,
    }
}

/// What [`gpt`] draws.
#[derive(Debug, Clone)]
pub struct SampleGpt {
    /// Where each parameter starts.
    pub offsets: stoker_kernels::GptOffsets,
    /// The flat parameters.
    pub params: Vec<f32>,
    /// Each parameter's name and range, in table order.
    pub ranges: Ranges,
}

/// The small Llama the step is checked on, against the CPU and on a device: grouped-query
/// attention (4 query heads over 2 kv heads) and widths that are multiples of 16, as
/// FP8 products take them.
pub const SMALL_LLAMA: stoker_kernels::LlamaDims = stoker_kernels::LlamaDims {
    vocab: 67,
    context: 16,
    d_model: 32,
    n_layer: 2,
    n_head: 4,
    n_kv_head: 2,
    ffn_hidden: 48,
};

/// A Llama of `dims`, laid out and drawn as [`gpt`] does.
pub fn llama(dims: &stoker_kernels::LlamaDims, seed: u64, scale: f32) -> SampleLlama {
    let (at, params, ranges) = flat(&stoker_kernels::llama_params(dims), seed, scale);
    let offsets = stoker_kernels::LlamaOffsets::from_table(dims, |name| at.get(name).copied())
        .expect("every name of the table has an offset");
    SampleLlama {
        offsets,
        params,
        ranges,
    }
}

/// What [`llama`] draws.
#[derive(Debug, Clone)]
pub struct SampleLlama {
    /// Where each parameter starts.
    pub offsets: stoker_kernels::LlamaOffsets,
    /// The flat parameters.
    pub params: Vec<f32>,
    /// Each parameter's name and range, in table order.
    pub ranges: Ranges,
}

/// A sampled micro-batch (tokens, targets, -1 ignored) as the steps take it.
pub fn batch(m: &(Vec<i64>, Vec<i64>)) -> crate::step::TokenBatch<'_> {
    crate::step::TokenBatch {
        tokens: &m.0,
        targets: &m.1,
        ignore: -1,
    }
}
