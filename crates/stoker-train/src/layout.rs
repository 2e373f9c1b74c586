//! The flat parameter layout: every trainable parameter in one FP32 master buffer.
//!
//! A [`FlatLayout`] is an ordered table of (name, shape, group, offset, len) in the
//! model's execution order; each parameter starts at a multiple of `align` elements
//! (padding is zero and stays zero), and each group (a layer or block) is one contiguous
//! range ([`FlatLayout::group_ranges`]). Gradients are gathered into a buffer of the same
//! layout. The layout knows nothing about any model, only the [`ParamSpec`]s it is made
//! from: data-parallel and ZeRO strategies bucket and shard these buffers, and
//! [`crate::vars`] copies between them and a model's variables.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::pieces::Pieces;

/// What the flat layout needs of a parameter: name, shape and group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Dotted name.
    pub name: String,
    /// Tensor shape.
    pub shape: Vec<usize>,
    /// Execution-order group.
    pub group: usize,
}

impl ParamSpec {
    /// A spec in group 0.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            group: 0,
        }
    }
}

/// Default alignment: 16 f32 elements = 64 bytes, one cache line (stoker-comm's, which
/// the shards of every path share).
pub use stoker_comm::shard::DEFAULT_ALIGN;

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// Parameter name.
    pub name: String,
    /// Tensor shape.
    pub shape: Vec<usize>,
    /// Execution-order group (layer or block); 0 in checkpoints written before groups.
    #[serde(default)]
    pub group: usize,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements (without padding).
    pub len: usize,
}

/// The ordered table of parameter slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatLayout {
    slots: Vec<Slot>,
    align: usize,
    total: usize,
}

impl FlatLayout {
    /// Lays out `specs` in the given order, each slot aligned to `align` elements; groups
    /// must not decrease (each group one contiguous range).
    pub fn new(specs: &[ParamSpec], align: usize) -> Result<Self> {
        if align == 0 {
            return Err(TrainError::Layout("alignment must be at least 1".into()));
        }
        let mut slots: Vec<Slot> = Vec::with_capacity(specs.len());
        let mut offset = 0;
        for spec in specs {
            if let Some(prev) = slots.last() {
                if spec.group < prev.group {
                    return Err(TrainError::Layout(format!(
                        "parameter `{}` in group {} follows `{}` in group {}: groups must not decrease",
                        spec.name, spec.group, prev.name, prev.group
                    )));
                }
            }
            let len = spec.shape.iter().product();
            slots.push(Slot {
                name: spec.name.clone(),
                shape: spec.shape.clone(),
                group: spec.group,
                offset,
                len,
            });
            offset += len.div_ceil(align) * align;
        }
        Ok(FlatLayout {
            slots,
            align,
            total: offset,
        })
    }

    /// Why this layout, read from a file, cannot lay out a buffer (None: it can): every
    /// slot's length is its shape's product, inside the total, the slots in order without
    /// overlap, each name once, and the total within `max_total` elements. A layout made
    /// by [`FlatLayout::new`] always passes; one deserialized from a damaged or edited
    /// file would otherwise send readers out of bounds or onto a neighbour's values.
    pub fn problem(&self, max_total: usize) -> Option<String> {
        if self.total > max_total {
            return Some(format!(
                "total {} elements, more than the {max_total} its files hold",
                self.total
            ));
        }
        let mut end = 0usize;
        let mut names = std::collections::HashSet::new();
        for s in &self.slots {
            let product = s.shape.iter().try_fold(1usize, |p, &d| p.checked_mul(d));
            if product != Some(s.len) {
                return Some(format!(
                    "slot `{}`: length {} but shape {:?}",
                    s.name, s.len, s.shape
                ));
            }
            let Some(slot_end) = s.offset.checked_add(s.len).filter(|&e| e <= self.total) else {
                return Some(format!(
                    "slot `{}`: [{}, +{}) runs past the total {}",
                    s.name, s.offset, s.len, self.total
                ));
            };
            if s.offset < end {
                return Some(format!(
                    "slot `{}` starts at {}, inside the slot before it (which ends at {end})",
                    s.name, s.offset
                ));
            }
            if !names.insert(s.name.as_str()) {
                return Some(format!("slot `{}` appears twice", s.name));
            }
            end = slot_end;
        }
        None
    }
    /// The slots in buffer order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Buffer length in elements, padding included.
    pub fn total_len(&self) -> usize {
        self.total
    }

    /// Alignment in elements.
    pub fn align(&self) -> usize {
        self.align
    }

    /// Each group's span ([`FlatLayout::group_ranges`]) indexed by group number; an error
    /// unless the groups are numbered 0, 1, 2, ... in buffer order, as the strategies that
    /// work group by group (ZeRO-2 and ZeRO-3 on the direct step, ZeRO-3's units) need.
    pub fn group_spans(&self) -> Result<Vec<std::ops::Range<usize>>> {
        let ranges = self.group_ranges();
        if let Some((i, (g, _))) = ranges.iter().enumerate().find(|(i, (g, _))| i != g) {
            return Err(TrainError::Layout(format!(
                "parameter groups must be numbered 0, 1, 2, ... in buffer order; group {g} is \
                 the {}th",
                i + 1
            )));
        }
        Ok(ranges.into_iter().map(|(_, r)| r).collect())
    }

    /// Each group's `(group, element range)` in buffer order, the padding after its last
    /// slot included, so the ranges tile the buffer.
    pub fn group_ranges(&self) -> Vec<(usize, std::ops::Range<usize>)> {
        let mut out: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        for s in &self.slots {
            match out.last_mut() {
                Some((g, r)) if *g == s.group => r.end = s.offset + s.len,
                _ => out.push((s.group, s.offset..s.offset + s.len)),
            }
        }
        // Extend each range to the next one's start (padding belongs to the group before).
        for i in 0..out.len() {
            let end = out.get(i + 1).map_or(self.total, |(_, r)| r.start);
            out[i].1.end = end;
        }
        if let Some((_, r)) = out.first_mut() {
            r.start = 0;
        }
        out
    }

    /// The offset of parameter `name`, if the layout has it.
    pub fn offset_of(&self, name: &str) -> Option<usize> {
        self.slots.iter().find(|s| s.name == name).map(|s| s.offset)
    }

    /// Trainable elements (padding excluded).
    pub fn numel(&self) -> usize {
        self.slots.iter().map(|s| s.len).sum()
    }

    /// The span table stoker-precision's loss scaler uses to name overflowing parameters.
    pub fn param_table(&self) -> stoker_precision::ParamTable {
        stoker_precision::ParamTable::new(
            self.slots.iter().map(|s| (s.name.clone(), s.offset, s.len)),
        )
    }

    /// The first slot holding a non-finite value in `buf`.
    pub fn first_nonfinite(&self, buf: &[f32]) -> Option<&str> {
        self.first_nonfinite_in(buf, &Pieces::one(0..buf.len()))
    }

    /// As [`FlatLayout::first_nonfinite`] for `part`, the flat buffer's elements
    /// `pieces` end to end (a ZeRO shard).
    pub fn first_nonfinite_in(&self, part: &[f32], pieces: &Pieces) -> Option<&str> {
        if stoker_precision::overflow::all_finite(part) {
            return None;
        }
        self.slots
            .iter()
            .find(|s| {
                let local = pieces.local(&(s.offset..s.offset + s.len));
                part[local].iter().any(|x| !x.is_finite())
            })
            .map(|s| s.name.as_str())
    }

    /// `buf`, laid out by `from`, re-laid out by this layout parameter by parameter (by
    /// name), padding zero: how a checkpoint written with another order or alignment
    /// loads. The error names a parameter that is missing or has another shape.
    pub fn remap_from(&self, from: &FlatLayout, buf: &[f32]) -> Result<Vec<f32>> {
        from.check_len(buf.len())?;
        if from.slots.len() != self.slots.len() {
            return Err(TrainError::Layout(format!(
                "{} parameters, expected {}",
                from.slots.len(),
                self.slots.len()
            )));
        }
        let mut out = vec![0f32; self.total];
        for s in &self.slots {
            let f = from
                .slots
                .iter()
                .find(|f| f.name == s.name)
                .ok_or_else(|| TrainError::Layout(format!("no parameter `{}`", s.name)))?;
            if f.shape != s.shape {
                return Err(TrainError::Layout(format!(
                    "parameter `{}` is {:?}, expected {:?}",
                    s.name, f.shape, s.shape
                )));
            }
            out[s.offset..s.offset + s.len].copy_from_slice(&buf[f.offset..f.offset + f.len]);
        }
        Ok(out)
    }

    /// Fails unless a flat buffer of `n` elements has this layout's length.
    pub fn check_len(&self, n: usize) -> Result<()> {
        if n != self.total {
            return Err(TrainError::Layout(format!(
                "buffer of {n} elements, layout needs {}",
                self.total
            )));
        }
        Ok(())
    }
}
