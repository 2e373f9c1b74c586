//! How one rank sums its window's micro-batch gradients.
//!
//! - [`SumOrder::InPlace`] (default): every micro-batch's backward adds straight into the
//!   gradient buffer, PyTorch's `.grad` accumulation. No extra memory.
//! - [`SumOrder::Sequential`]: each micro-batch's gradient goes into a zeroed buffer of its
//!   own (so the data-parallel strategy can reduce that micro-batch alone, as
//!   `sync_every_micro_batch` does), then is added to the sum in order. One extra buffer.
//! - [`SumOrder::Tree`] (deterministic mode): each micro-batch's gradient goes into a
//!   zeroed buffer and the buffers are summed as a binary tree over the micro-batches in
//!   order, neighbours first, `lower + higher`: `((g0 + g1) + (g2 + g3))`. With `k` a
//!   power of two this is exactly the subtree of the global batch's tree that this rank's
//!   micro-batches form, so a world of `N` ranks combining their subtrees with
//!   [`stoker_comm::tree_all_reduce`] produces the bits one rank produces from all `N k`
//!   micro-batches. Up to `log2(k) + 2` extra buffers.
//!
//! The micro-batches' summed losses (f64) follow the same order as their gradients.

use serde::{Deserialize, Serialize};

/// The order a window's micro-batch gradients are summed in on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SumOrder {
    /// Add into the gradient buffer during each backward.
    InPlace,
    /// Each micro-batch into its own zeroed buffer, added to the sum in order.
    Sequential,
    /// Each micro-batch into its own zeroed buffer, summed as a fixed binary tree.
    Tree,
}

/// A partial sum of the tree: `leaves` micro-batches' gradients and summed losses.
struct Node {
    leaves: usize,
    grads: Vec<f32>,
    loss: f64,
}

/// The running sum of a window's micro-batch gradients and losses.
pub struct GradSum {
    order: SumOrder,
    /// The buffer the next micro-batch's backward writes (not in place).
    leaf: Vec<f32>,
    /// The tree's pending subtrees, earliest first (Tree).
    stack: Vec<Node>,
    /// Buffers to reuse.
    free: Vec<Vec<f32>>,
    loss: f64,
}

impl GradSum {
    /// A sum in `order` over gradient buffers of `len` elements.
    pub fn new(order: SumOrder, len: usize) -> Self {
        let leaf = match order {
            SumOrder::InPlace => Vec::new(),
            _ => vec![0.0; len],
        };
        GradSum {
            order,
            leaf,
            stack: Vec::new(),
            free: Vec::new(),
            loss: 0.0,
        }
    }

    /// The order.
    pub fn order(&self) -> SumOrder {
        self.order
    }

    /// Starts a window: zeroes `grads` and forgets any partial sums.
    pub fn begin(&mut self, grads: &mut [f32]) {
        stoker_kernels::flat::zero(grads);
        while let Some(n) = self.stack.pop() {
            self.free.push(n.grads);
        }
        self.loss = 0.0;
    }

    /// The buffer the next micro-batch's backward adds into: `grads` itself (in place) or
    /// a zeroed buffer of its own.
    pub fn target<'a>(&'a mut self, grads: &'a mut [f32]) -> &'a mut [f32] {
        match self.order {
            SumOrder::InPlace => grads,
            _ => {
                if self.leaf.len() != grads.len() {
                    self.leaf = vec![0.0; grads.len()];
                } else {
                    stoker_kernels::flat::zero(&mut self.leaf);
                }
                &mut self.leaf
            }
        }
    }

    /// Takes the micro-batch just written into [`GradSum::target`] (its summed loss
    /// `loss`) into the sum.
    pub fn push(&mut self, grads: &mut [f32], loss: f64) {
        match self.order {
            SumOrder::InPlace => self.loss += loss,
            SumOrder::Sequential => {
                add_into(grads, &self.leaf);
                self.loss += loss;
            }
            SumOrder::Tree => {
                let spare = self
                    .free
                    .pop()
                    .unwrap_or_else(|| vec![0.0; self.leaf.len()]);
                let mut node = Node {
                    leaves: 1,
                    grads: std::mem::replace(&mut self.leaf, spare),
                    loss,
                };
                // Merge equal-sized neighbours: the earlier subtree is the lower operand.
                while self
                    .stack
                    .last()
                    .is_some_and(|top| top.leaves == node.leaves)
                {
                    let mut lower = self.stack.pop().expect("checked");
                    add_into(&mut lower.grads, &node.grads);
                    lower.loss += node.loss;
                    lower.leaves += node.leaves;
                    self.free.push(node.grads);
                    node = lower;
                }
                self.stack.push(node);
            }
        }
    }

    /// Ends the window: `grads` holds the sum of every micro-batch's gradient, and the
    /// summed loss comes back. (In the tree, subtrees left when `k` is not a power of two
    /// are combined from the latest, `lower + higher`.)
    pub fn finish(&mut self, grads: &mut [f32]) -> f64 {
        if self.order != SumOrder::Tree {
            return self.loss;
        }
        let Some(mut node) = self.stack.pop() else {
            return 0.0;
        };
        while let Some(mut lower) = self.stack.pop() {
            add_into(&mut lower.grads, &node.grads);
            lower.loss += node.loss;
            lower.leaves += node.leaves;
            self.free.push(node.grads);
            node = lower;
        }
        grads.copy_from_slice(&node.grads);
        self.free.push(node.grads);
        node.loss
    }

    /// The gradient-sized buffers a sum in `order` holds once it has summed windows of
    /// `k` micro-batches, predicted before any (the forecast's count): in place none, in
    /// sequence the leaf, in the tree the leaf and every partial sum the binary tree of `k`
    /// leaves keeps at once (its buffers are kept for reuse). Counted by running the sum's
    /// own bookkeeping for two windows over one-element buffers: the count does not depend
    /// on the length.
    pub fn steady_extra_buffers(order: SumOrder, k: usize) -> usize {
        let mut sum = GradSum::new(order, 1);
        let mut grads = [0f32];
        for _window in 0..2 {
            sum.begin(&mut grads);
            for _ in 0..k {
                sum.target(&mut grads);
                sum.push(&mut grads, 0.0);
            }
            sum.finish(&mut grads);
        }
        sum.extra_buffers()
    }

    /// Gradient-sized buffers this sum holds beyond the gradient buffer itself (for the
    /// memory accounting).
    pub fn extra_buffers(&self) -> usize {
        usize::from(!self.leaf.is_empty()) + self.stack.len() + self.free.len()
    }
}

/// `lower[i] += higher[i]`, in parallel over fixed chunks (thread-count independent:
/// each element is one addition).
fn add_into(lower: &mut [f32], higher: &[f32]) {
    use rayon::prelude::*;
    lower
        .par_chunks_mut(1 << 16)
        .zip(higher.par_chunks(1 << 16))
        .for_each(|(l, h)| l.iter_mut().zip(h).for_each(|(l, &h)| *l += h));
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_testkit::assert_bits_eq;

    /// The buffers predicted before any window are the ones held after two windows of k.
    #[test]
    fn steady_buffers_are_told_before_the_first_window() {
        for order in [SumOrder::InPlace, SumOrder::Sequential, SumOrder::Tree] {
            for k in 1..=13 {
                let mut sum = GradSum::new(order, 5);
                let mut grads = vec![0f32; 5];
                for _ in 0..2 {
                    sum.begin(&mut grads);
                    for j in 0..k {
                        sum.target(&mut grads).copy_from_slice(&leaf(j, 5));
                        sum.push(&mut grads, 1.0);
                    }
                    sum.finish(&mut grads);
                }
                assert_eq!(
                    sum.extra_buffers(),
                    GradSum::steady_extra_buffers(order, k),
                    "{order:?} k {k}"
                );
            }
        }
    }

    fn leaf(j: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i * 31 + j * 17) % 23) as f32 * 0.1f32.powi((j % 5) as i32) + 1e-3 * j as f32
            })
            .collect()
    }

    fn run(order: SumOrder, k: usize, len: usize) -> (Vec<f32>, f64) {
        let mut s = GradSum::new(order, len);
        let mut g = vec![7.0f32; len];
        s.begin(&mut g);
        for j in 0..k {
            let t = s.target(&mut g);
            t.iter_mut().zip(leaf(j, len)).for_each(|(t, x)| *t += x);
            s.push(&mut g, j as f64 * 0.25);
        }
        let loss = s.finish(&mut g);
        (g, loss)
    }

    #[test]
    fn the_tree_is_the_pairwise_tree_and_its_subtrees() {
        let len = 101;
        let leaves: Vec<Vec<f32>> = (0..8).map(|j| leaf(j, len)).collect();
        let (g, loss) = run(SumOrder::Tree, 8, len);
        assert_bits_eq(&g, &stoker_comm::tree_sum(&leaves), "tree of 8");
        assert_eq!(loss, (0..8).map(|j| j as f64 * 0.25).sum::<f64>());
        // Two halves of four, combined lower + higher, give the same bits.
        let (a, _) = run(SumOrder::Tree, 4, len);
        let upper: Vec<Vec<f32>> = (4..8).map(|j| leaf(j, len)).collect();
        let b = stoker_comm::tree_sum(&upper);
        let top: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_bits_eq(&g, &top, "two subtrees of 4");
        // Every order gives the same sum up to rounding.
        for order in [SumOrder::InPlace, SumOrder::Sequential] {
            let (h, _) = run(order, 8, len);
            for (x, y) in h.iter().zip(&g) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{order:?}");
            }
        }
        // Odd window sizes work (combined from the latest subtree).
        let (g5, _) = run(SumOrder::Tree, 5, len);
        let want: Vec<f32> = (0..len)
            .map(|i| {
                let l: Vec<f32> = (0..5).map(|j| leaf(j, len)[i]).collect();
                ((l[0] + l[1]) + (l[2] + l[3])) + l[4]
            })
            .collect();
        assert_bits_eq(&g5, &want, "tree of 5");
    }
}
