//! Named trainable parameters: how models declare them and how they are initialized.
//!
//! Models declare parameters in execution order (the order the forward uses them), each
//! in a numbered group (a layer or block; groups never decrease): the flat layout keeps
//! that order, so each group is one contiguous range of the flat buffer, which the
//! data-parallel strategy reduces as soon as the backward has finished it.
//!
//! Initial values come from a counter-based generator keyed by (seed, parameter name,
//! element index), so they do not depend on the order in which a model declares its
//! parameters, nor on the compute dtype (values are drawn in f32, then cast), and any
//! stretch of a parameter can be drawn alone: a ZeRO-3 rank draws only its pieces of the
//! flat buffer ([`ParamSet::init_pieces`]) from a model declared without values
//! ([`ParamBuilder::meta`], PyTorch's meta-device init), so no rank ever holds the whole
//! model.

use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Result, TrainError};
use crate::layout::{FlatLayout, ParamSpec};

/// How a parameter's initial values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros (biases).
    Zeros,
    /// All ones (norm gains).
    Ones,
    /// Normal with mean 0 and this standard deviation (GPT-2's 0.02).
    Normal(f32),
    /// Uniform in `[-bound, bound]` (torch's Kaiming-uniform default for linear/conv).
    Uniform(f32),
}

/// One trainable parameter: its name, its group, its shape, how it is initialized and its
/// compute-dtype variable.
#[derive(Debug, Clone)]
pub struct Param {
    /// Dotted name, e.g. `h.0.attn.qkv.weight`.
    pub name: String,
    /// Execution-order group (a layer or block), see the module doc.
    pub group: usize,
    /// The declared shape (the variable's, unless it is an empty placeholder).
    pub shape: Vec<usize>,
    /// How its initial values are drawn.
    pub init: Init,
    /// The candle variable the model computes with (0 elements for a placeholder).
    pub var: Var,
}

/// A model's parameters in declaration (execution) order: the flat-buffer order.
#[derive(Debug, Clone, Default)]
pub struct ParamSet {
    params: Vec<Param>,
    /// The seed the initial values are drawn from.
    seed: u64,
    /// Declared without values: every variable an empty placeholder
    /// ([`ParamBuilder::meta`]).
    meta: bool,
    /// The variables' dtype where it is narrower than f32 (None: f32): a whole model's
    /// initial values are its variables', rounded to it, and so are drawn pieces.
    narrow: Option<DType>,
}

impl ParamSet {
    /// The parameters in declaration order.
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Total number of scalar elements.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }

    /// The specs in declaration order: the input of [`FlatLayout::new`].
    pub fn specs(&self) -> Vec<ParamSpec> {
        self.params
            .iter()
            .map(|p| ParamSpec {
                name: p.name.clone(),
                shape: p.shape.clone(),
                group: p.group,
            })
            .collect()
    }

    /// Whether the parameters were declared without values ([`ParamBuilder::meta`]).
    pub fn is_meta(&self) -> bool {
        self.meta
    }

    /// The initial values of the elements `pieces` of the flat buffer `layout` lays out,
    /// end to end (padding zero): what [`FlatLayout::flatten`] of the
    /// initialized model followed by [`Pieces::take`] gives, drawn piece by piece (and
    /// rounded to the variables' dtype, as the whole model's variables hold them).
    ///
    /// [`Pieces::take`]: crate::pieces::Pieces::take
    pub fn init_pieces(
        &self,
        layout: &FlatLayout,
        pieces: &crate::pieces::Pieces,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0f32; pieces.len()];
        for slot in layout.slots() {
            let p = self.get(&slot.name).ok_or_else(|| {
                TrainError::Layout(format!("layout slot `{}` is not a parameter", slot.name))
            })?;
            for (r, at) in pieces.with_starts() {
                let (lo, hi) = (r.start.max(slot.offset), r.end.min(slot.offset + slot.len));
                if lo < hi {
                    let mut values = init_range(
                        self.seed,
                        &p.name,
                        lo - slot.offset..hi - slot.offset,
                        p.init,
                    );
                    round_to(&mut values, self.narrow);
                    out[at + lo - r.start..at + hi - r.start].copy_from_slice(&values);
                }
            }
        }
        Ok(out)
    }

    /// The `i`-th parameter in declaration order (the `i`-th slot of its layout).
    pub fn at(&self, i: usize) -> Option<&Param> {
        self.params.get(i)
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }
}

/// `values` rounded to `dtype` and back (f16 or bf16, to nearest even, as a cast of the
/// variables rounds); None leaves them.
fn round_to(values: &mut [f32], dtype: Option<DType>) {
    match dtype {
        Some(DType::F16) => values
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        Some(DType::BF16) => values
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        _ => {}
    }
}

/// Where a builder takes its parameters' values from instead of drawing them.
enum Values {
    /// None: every parameter an empty placeholder ([`ParamBuilder::meta`]).
    Meta,
    /// Some groups' values (group number, the group's first flat element, its values from
    /// there), laid out by the layout; every other group's parameters are empty
    /// placeholders.
    Groups(FlatLayout, Vec<(usize, usize, std::sync::Arc<Vec<f32>>)>),
}

/// Collects a model's parameters as it declares them.
pub struct ParamBuilder {
    device: Device,
    dtype: DType,
    seed: u64,
    /// Values to take instead of drawing them.
    values: Option<Values>,
    group: usize,
    params: Vec<Param>,
}

impl ParamBuilder {
    /// Parameters in `dtype` on `device`, initialized from `seed`.
    pub fn new(device: Device, dtype: DType, seed: u64) -> Self {
        ParamBuilder {
            device,
            dtype,
            seed,
            values: None,
            group: 0,
            params: Vec::new(),
        }
    }

    /// Parameters in `dtype` on `device` for the groups of `groups` alone (group number
    /// and the group's values from the start of its span in `layout`): every other
    /// group's parameters are empty placeholders (0 elements). A model built so can run
    /// only the units those groups serve ([`crate::models::Model::unit_forward`]); ZeRO-3
    /// builds one per unit on the graph path.
    pub fn from_groups(
        device: Device,
        dtype: DType,
        layout: FlatLayout,
        groups: Vec<(usize, std::sync::Arc<Vec<f32>>)>,
    ) -> Self {
        let spans = layout.group_ranges();
        let groups = groups
            .into_iter()
            .map(|(g, v)| {
                let start = spans.iter().find(|(n, _)| *n == g).map(|(_, r)| r.start);
                (g, start.unwrap_or(usize::MAX), v)
            })
            .collect();
        ParamBuilder {
            values: Some(Values::Groups(layout, groups)),
            ..ParamBuilder::new(device, dtype, 0)
        }
    }

    /// Parameters declared from now on belong to `group` (at least the current one).
    pub fn set_group(&mut self, group: usize) -> Result<()> {
        if group < self.group {
            return Err(TrainError::Layout(format!(
                "group {group} declared after group {}: groups follow execution order",
                self.group
            )));
        }
        self.group = group;
        Ok(())
    }

    /// Parameters in `dtype` on `device` declared without values: each an empty
    /// placeholder, its shape and initialization recorded, so the flat layout and any
    /// rank's pieces of the initial values come from the declaration alone
    /// ([`ParamSet::init_pieces`]). ZeRO-3 builds its model so.
    pub fn meta(device: Device, dtype: DType, seed: u64) -> Self {
        ParamBuilder {
            values: Some(Values::Meta),
            ..ParamBuilder::new(device, dtype, seed)
        }
    }

    /// The dtype parameters are created in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Declares every row of a model's parameter table (stoker-kernels' GPT or Llama
    /// table), each in its group, in the table's (execution) order.
    pub fn params_of(&mut self, table: &[stoker_kernels::ParamSpec]) -> Result<()> {
        for p in table {
            self.set_group(p.group)?;
            let init = match p.init {
                stoker_kernels::SpecInit::Zeros => Init::Zeros,
                stoker_kernels::SpecInit::Ones => Init::Ones,
                stoker_kernels::SpecInit::Normal(std) => Init::Normal(std),
            };
            self.param(&p.name, &p.shape, init)?;
        }
        Ok(())
    }

    /// Declares parameter `name` of `shape`, initialized by `init`.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        if self.params.iter().any(|p| p.name == name) {
            return Err(TrainError::Model(format!(
                "parameter `{name}` declared twice"
            )));
        }
        let n: usize = shape.iter().product();
        let offset = |layout: &FlatLayout| {
            layout.offset_of(name).ok_or_else(|| {
                TrainError::Layout(format!("parameter `{name}` is not in the flat layout"))
            })
        };
        fn part<'v>(values: &'v [f32], off: usize, n: usize, name: &str) -> Result<&'v [f32]> {
            values.get(off..off + n).ok_or_else(|| {
                TrainError::Layout(format!(
                    "parameter `{name}` at {off}..{} is outside the {} values",
                    off + n,
                    values.len()
                ))
            })
        }
        // An empty placeholder is made in the parameters' dtype: a cast of an empty tensor
        // launches a kernel of zero blocks, which CUDA refuses (invalid argument).
        let placeholder = || Tensor::zeros(0, self.dtype, &self.device);
        let t = match &self.values {
            None => Tensor::from_vec(init_range(self.seed, name, 0..n, init), shape, &self.device)?,
            Some(Values::Meta) => placeholder()?,
            Some(Values::Groups(layout, groups)) => {
                match groups.iter().find(|(g, _, _)| *g == self.group) {
                    Some((g, start, values)) => {
                        let off = offset(layout)?.checked_sub(*start).ok_or_else(|| {
                            TrainError::Layout(format!("parameter `{name}` is not in group {g}"))
                        })?;
                        Tensor::from_slice(part(values, off, n, name)?, shape, &self.device)?
                    }
                    None => placeholder()?,
                }
            }
        };
        let t = t.to_dtype(self.dtype)?;
        let var = Var::from_tensor(&t)?;
        self.params.push(Param {
            name: name.to_string(),
            group: self.group,
            shape: shape.to_vec(),
            init,
            var: var.clone(),
        });
        Ok(var)
    }

    /// The declared parameters, in declaration order.
    pub fn finish(self) -> ParamSet {
        ParamSet {
            narrow: matches!(self.dtype, DType::F16 | DType::BF16).then_some(self.dtype),
            meta: matches!(self.values, Some(Values::Meta)),
            seed: self.seed,
            params: self.params,
        }
    }
}

/// SplitMix64 finalizer: a well-mixed 64-bit hash.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
    })
}

/// Uniform in (0, 1) from a hash.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The initial values of elements `range` of parameter `name`.
fn init_range(seed: u64, name: &str, range: std::ops::Range<usize>, init: Init) -> Vec<f32> {
    let key = mix64(seed ^ name_hash(name));
    let u = |i: usize| unit(mix64(key ^ mix64(i as u64)));
    match init {
        Init::Zeros => vec![0.0; range.len()],
        Init::Ones => vec![1.0; range.len()],
        Init::Uniform(b) => range
            .map(|i| ((2.0 * u(i) - 1.0) * b as f64) as f32)
            .collect(),
        Init::Normal(std) => range
            .map(|i| {
                // Box-Muller on two independent uniforms per element.
                let (u1, u2) = (u(2 * i), u(2 * i + 1));
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (z * std as f64) as f32
            })
            .collect(),
    }
}
