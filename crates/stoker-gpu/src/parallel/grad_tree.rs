//! Deterministic mode's sums on the backend (docs/distributed.md, "Deterministic
//! mode"): a window's micro-batch gradients summed as a binary tree over the global
//! batch in its order, neighbours first, `lower + higher`, each rank's block of
//! micro-batches one subtree and the ranks' subtrees combined by the same tree over the
//! ranks. The bracketing, and so every bit, depends on the global batch alone, not on
//! how many ranks share it.
//!
//! Within a rank, a stack of partial sums waits for its neighbours ([`GradTree::push`]);
//! the last micro-batch's gradient stays in the step's buffer and the stack folds into it
//! from the top ([`GradTree::finish`]), which for a power-of-two count is the balanced
//! tree. Across ranks ([`GradTree::all_reduce`]), each chunk of the gradient is gathered
//! from every rank (all-gathers copy bits, on NCCL as through the host) and summed as the
//! balanced tree over ranks, the same adds on every rank.

use crate::backend::{Backend, View};
use crate::collectives::Collectives;
use crate::error::GpuError;
use crate::kernels::add_into;

/// Elements of the scratch a cross-rank round gathers into (16 MiB of f32), all ranks'
/// chunks together ([`chunk_for`]).
pub const TREE_CHUNK: usize = 1 << 22;

/// Elements of the gradient one cross-rank round takes from each of `world` ranks: the
/// scratch stays [`TREE_CHUNK`] elements whatever the world.
pub fn chunk_for(world: usize) -> usize {
    (TREE_CHUNK / world.max(1)).max(1)
}

/// Partial sums buffered for a window of at most `max_micro` micro-batches: one fewer
/// level than the tree's height, the last leaf being the step's own buffer.
fn levels(max_micro: usize) -> usize {
    max_micro.max(1).next_power_of_two().trailing_zeros() as usize
}

/// A world the tree over ranks serves: a power of two.
pub fn check_world(world: usize) -> Result<(), GpuError> {
    if world == 0 || !world.is_power_of_two() {
        return Err(GpuError::Shape {
            kernel: "deterministic",
            what: format!(
                "the tree over ranks needs a power-of-two world size, not {world} \
                 (parallel.deterministic)"
            ),
        });
    }
    Ok(())
}

/// The buffers of deterministic mode's sums, and the stack of partial sums in use.
pub struct GradTree<B: Backend> {
    /// Partial sums, bottom (earliest micro-batches) first.
    partial: Vec<B::Buf<f32>>,
    /// The level (log2 of the micro-batches summed) of each partial sum in use.
    stack: Vec<u32>,
    /// `world` slots of `chunk` elements for the tree over ranks (none at one rank).
    scratch: Option<B::Buf<f32>>,
    /// Each micro-batch's loss sum, copied on the backend and read once a window.
    losses: B::Buf<f32>,
    chunk: usize,
    world: usize,
    max_micro: usize,
}

impl<B: Backend> GradTree<B> {
    /// The bytes [`GradTree::new`] allocates: one f32 buffer of `len` per level, the
    /// scratch beyond one rank, and a loss per micro-batch.
    pub fn planned_bytes(len: usize, max_micro: usize, world: usize, chunk: usize) -> usize {
        let scratch = match world > 1 {
            true => world * chunk.min(len).max(1),
            false => 0,
        };
        4 * (levels(max_micro) * len + scratch + max_micro.max(1))
    }

    /// The sums for gradients of `len` elements, windows of at most `max_micro`
    /// micro-batches on `world` ranks (a power of two), gathering `chunk` elements a
    /// round across ranks.
    pub fn new(
        be: &B,
        len: usize,
        max_micro: usize,
        world: usize,
        chunk: usize,
    ) -> Result<Self, GpuError> {
        check_world(world)?;
        let chunk = chunk.min(len).max(1);
        let partial = (0..levels(max_micro))
            .map(|_| be.zeros::<f32>(len))
            .collect::<Result<_, _>>()?;
        let scratch = match world > 1 {
            true => Some(be.zeros::<f32>(world * chunk)?),
            false => None,
        };
        Ok(GradTree {
            partial,
            stack: Vec::new(),
            scratch,
            losses: be.zeros::<f32>(max_micro.max(1))?,
            chunk,
            world,
            max_micro: max_micro.max(1),
        })
    }

    /// Bytes held on the backend.
    pub fn bytes(&self) -> usize {
        let len = |b: &B::Buf<f32>| B::len(b);
        let partial = self.partial.iter().map(len).sum::<usize>();
        4 * (partial + self.scratch.as_ref().map_or(0, len) + len(&self.losses))
    }

    /// Keeps micro-batch `j`'s loss sum (`loss`, one f32 on the backend) without waiting
    /// for it.
    pub fn keep_loss(&self, be: &B, j: usize, loss: View<f32>) -> Result<(), GpuError> {
        be.copy(be.all(&self.losses).slice(j..j + 1)?, loss)
    }

    /// The first `micro` losses kept, read at once (waits for the backend).
    pub fn losses(&self, be: &B, micro: usize) -> Result<Vec<f64>, GpuError> {
        let kept = be.read(be.all(&self.losses).slice(0..micro)?)?;
        Ok(kept.into_iter().map(f64::from).collect())
    }

    /// Starts a window of `micro` micro-batches: `micro` within the planned count, and
    /// beyond one rank a power of two (each rank's block a whole subtree of the global
    /// tree).
    pub fn begin(&mut self, micro: usize) -> Result<(), GpuError> {
        let whole_subtree = self.world == 1 || micro.is_power_of_two();
        if micro == 0 || micro > self.max_micro || !whole_subtree {
            return Err(GpuError::Shape {
                kernel: "deterministic",
                what: format!(
                    "a window of {micro} micro-batches on {} rank(s): deterministic mode sums \
                     1 to {} (a power of two beyond one rank) (parallel.deterministic, \
                     batch.accumulation_steps)",
                    self.world, self.max_micro
                ),
            });
        }
        self.stack.clear();
        Ok(())
    }

    /// Takes a micro-batch's gradient (not the window's last) from `grads`, merging
    /// equal-sized neighbours as they complete; `grads` may then be zeroed and reused.
    pub fn push(&mut self, be: &B, grads: View<f32>) -> Result<(), GpuError> {
        if self.stack.last() == Some(&0) {
            // Its left neighbour waits on top: lower + higher.
            let top = self.stack.len() - 1;
            add_into(be, be.all(&self.partial[top]), grads)?;
            self.stack[top] = 1;
            while let [.., lower, higher] = self.stack[..] {
                if lower != higher {
                    break;
                }
                let n = self.stack.len();
                add_into(
                    be,
                    be.all(&self.partial[n - 2]),
                    be.all(&self.partial[n - 1]),
                )?;
                self.stack.pop();
                self.stack[n - 2] += 1;
            }
            return Ok(());
        }
        let at = self.stack.len();
        let Some(slot) = self.partial.get(at) else {
            return Err(GpuError::Shape {
                kernel: "deterministic",
                what: format!(
                    "more than {} micro-batches pushed into the tree",
                    self.max_micro
                ),
            });
        };
        be.copy(be.all(slot), grads)?;
        self.stack.push(0);
        Ok(())
    }

    /// Folds the waiting partial sums into `grads`, which holds the window's last
    /// micro-batch's gradient: from the top (the nearest neighbours) down, so `grads`
    /// ends with this rank's subtree.
    pub fn finish(&mut self, be: &B, grads: View<f32>) -> Result<(), GpuError> {
        while self.stack.pop().is_some() {
            // Addition commutes bit for bit: lower + higher lands in `grads`.
            add_into(be, grads, be.all(&self.partial[self.stack.len()]))?;
        }
        Ok(())
    }

    /// Replaces `grads` (this rank's subtree) on every rank by the balanced tree of the
    /// ranks' subtrees, rank order, `chunk` elements a round.
    pub fn all_reduce(
        &self,
        be: &B,
        coll: &impl Collectives<B>,
        grads: View<f32>,
    ) -> Result<(), GpuError> {
        let (world, rank) = (coll.world(), coll.rank());
        if world != self.world {
            return Err(GpuError::Shape {
                kernel: "deterministic",
                what: format!("a tree planned for {} rank(s) run on {world}", self.world),
            });
        }
        let Some(scratch) = &self.scratch else {
            return Ok(());
        };
        let mut start = 0;
        while start < grads.len() {
            let n = self.chunk.min(grads.len() - start);
            let slots = be.all(scratch).slice(0..world * n)?;
            let slot = |r: usize| slots.slice(r * n..(r + 1) * n);
            let mine = grads.slice(start..start + n)?;
            be.copy(slot(rank)?, mine)?;
            coll.all_gather(be, slots, &vec![n; world])?;
            rank_tree(world, |lower, higher| {
                add_into(be, slot(lower)?, slot(higher)?)
            })?;
            be.copy(mine, slot(0)?)?;
            start += n;
        }
        Ok(())
    }
}

/// `values` (one rank's micro-batches' losses, in order) summed with the bracketing of
/// [`GradTree`]'s push and finish.
pub fn tree_sum(values: &[f64]) -> f64 {
    let mut stack: Vec<(u32, f64)> = Vec::new();
    let Some((&last, rest)) = values.split_last() else {
        return 0.0;
    };
    for &v in rest {
        let mut carry = (0, v);
        while let Some(&(level, lower)) = stack.last() {
            if level != carry.0 {
                break;
            }
            stack.pop();
            carry = (level + 1, lower + carry.1);
        }
        stack.push(carry);
    }
    stack
        .iter()
        .rev()
        .fold(last, |acc, &(_, lower)| lower + acc)
}

/// `value` from every rank summed as the balanced tree over ranks (a power of two), the
/// same bits on every rank: the values gathered exactly (each rank adds its own into
/// zeros, a few at a time) and summed here.
pub fn rank_tree_sum<B: Backend>(
    be: &B,
    coll: &impl Collectives<B>,
    value: f64,
) -> Result<f64, GpuError> {
    let (world, rank) = (coll.world(), coll.rank());
    check_world(world)?;
    let mut all = Vec::with_capacity(world);
    for first in (0..world).step_by(crate::collectives::MAX_SCALARS) {
        let n = crate::collectives::MAX_SCALARS.min(world - first);
        let mut mine = vec![0.0; n];
        if (first..first + n).contains(&rank) {
            mine[rank - first] = value;
        }
        // x + 0 is x exactly: each slot ends with its one rank's value.
        all.extend(coll.sum(be, &mine)?);
    }
    rank_tree(world, |lower, higher| {
        all[lower] += all[higher];
        Ok(())
    })?;
    Ok(all[0])
}

/// The balanced tree over `world` ranks (a power of two), one `add(lower, higher)` per
/// pair, neighbours first: the sum ends at 0, in the same bracketing for the gradient and
/// the loss.
fn rank_tree(
    world: usize,
    mut add: impl FnMut(usize, usize) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let mut d = 1;
    while d < world {
        for r in (0..world).step_by(2 * d) {
            add(r, r + d)?;
        }
        d *= 2;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scalar_tree_brackets_neighbours_first() {
        let v = [1.0, 2.0, 4.0, 8.0];
        assert_eq!(tree_sum(&v), 15.0);
        // 1 + 1e16 loses the 1; 1e16 + 1e16 does not lose 2: ((a+b)+(c+d)) against a
        // left fold.
        let v = [1.0, 1e16, -1e16, 1.0];
        let left = ((v[0] + v[1]) + v[2]) + v[3];
        let tree = (v[0] + v[1]) + (v[2] + v[3]);
        assert_ne!(left, tree);
        assert_eq!(tree_sum(&v).to_bits(), tree.to_bits());
        assert_eq!(tree_sum(&[3.0]), 3.0);
        assert_eq!(tree_sum(&[]), 0.0);
    }

    /// The tree of `v` written as recursion: a power-of-two count is the balanced tree
    /// (left half + right half); any other count its largest power-of-two prefix's tree
    /// plus the rest's.
    fn reference<F: Copy + Default + std::ops::Add<Output = F>>(v: &[F]) -> F {
        match v.len() {
            0 => F::default(),
            1 => v[0],
            n if n.is_power_of_two() => reference(&v[..n / 2]) + reference(&v[n / 2..]),
            n => {
                let p = 1 << (usize::BITS - 1 - n.leading_zeros());
                reference(&v[..p]) + reference(&v[p..])
            }
        }
    }

    #[test]
    fn push_and_finish_sum_every_count_as_the_written_out_tree() {
        use crate::Host;
        // Values of very different sizes, so another bracketing gives other bits.
        let value = |j: usize, e: usize| {
            let x = (j * 7 + e * 3) % 11;
            (x as f32 - 5.0) * 10f32.powi((j * 5 % 9) as i32 - 4)
        };
        for k in 1..=17 {
            let mut tree = GradTree::new(&Host, 3, k, 1, TREE_CHUNK).unwrap();
            tree.begin(k).unwrap();
            let grads = Host.zeros::<f32>(3).unwrap();
            for j in 0..k {
                let leaf: Vec<f32> = (0..3).map(|e| value(j, e)).collect();
                Host.write_at(Host.all(&grads), &leaf).unwrap();
                match j + 1 == k {
                    true => tree.finish(&Host, Host.all(&grads)).unwrap(),
                    false => tree.push(&Host, Host.all(&grads)).unwrap(),
                }
            }
            let got = Host.download(&grads).unwrap();
            for (e, g) in got.iter().enumerate() {
                let leaves: Vec<f32> = (0..k).map(|j| value(j, e)).collect();
                let want = reference(&leaves);
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "{k} micro-batches, element {e}"
                );
                let wide: Vec<f64> = leaves.iter().map(|&x| x as f64).collect();
                let want64 = reference(&wide);
                assert_eq!(tree_sum(&wide).to_bits(), want64.to_bits(), "{k} losses");
            }
            assert_eq!(
                tree.bytes(),
                GradTree::<Host>::planned_bytes(3, k, 1, TREE_CHUNK)
            );
        }
    }

    #[test]
    fn levels_are_one_fewer_than_the_tree_s_height() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8].map(levels),
            [0, 1, 2, 2, 3, 3],
            "micro-batches 1, 2, 3, 4, 5, 8"
        );
    }
}
