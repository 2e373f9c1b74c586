//! The GPU-design steps as stoker-kernels' [`TokenStep`], the interface stoker-train's
//! direct path runs: each micro-batch's parameters are gathered through the group
//! protocol (the calls and order of `group_calls`, so every strategy's source, ZeRO-3's
//! included, serves them as it serves the CPU step), loaded into the step's compute copy,
//! run, and its gradients added back group by group as the protocol marks them final.
//! The trainer's master and optimizer stay where they are. On the host backend this is
//! the GPU step's code inside the whole training loop (`step = "resident"`).

use std::ops::Range;

use stoker_kernels::gpt::{group_calls, GroupCall, Phase, StepParams};
use stoker_kernels::{GptBatch, KernelError, TokenStep};

use super::TokenBatch;
use crate::backend::Backend;
use crate::error::GpuError;

/// What a GPU-design step offers the adapter: the GPT's and the Llama's at one shape.
pub trait ResidentStep<B: Backend>: Send {
    /// Copies the flat FP32 `params` into the compute copy.
    fn load(&self, be: &B, params: &[f32]) -> Result<(), GpuError>;
    /// Zeroes the gradients, runs one micro-batch, returns the summed loss.
    fn run(&self, be: &B, batch: TokenBatch, grad_scale: f32) -> Result<f64, GpuError>;
    /// The gradients (flat layout) into `out`.
    fn gradients_into(&self, be: &B, out: &mut [f32]) -> Result<(), GpuError>;
    /// The evaluation of one micro-batch: summed loss, top-1 hits, valid targets.
    fn eval(&self, be: &B, batch: TokenBatch) -> Result<(f64, usize, usize), GpuError>;
    /// Bytes of its buffers.
    fn buffer_bytes(&self) -> usize;
}

/// Builds a step for `batch` sequences of `t` positions.
pub type MakeStep<B, S> = Box<dyn Fn(&B, usize, usize) -> Result<S, GpuError> + Send>;

/// A [`ResidentStep`] per batch shape, on backend `B`, as a [`TokenStep`].
pub struct AsTokenStep<B: Backend, S: ResidentStep<B>> {
    be: B,
    make: MakeStep<B, S>,
    steps: Vec<((usize, usize), S)>,
    groups: Vec<Range<usize>>,
    end: usize,
    /// The protocol's forward calls, each open marked where it gathers its group (the
    /// first time the group is opened).
    forward: Vec<(GroupCall, bool)>,
    /// The backward calls, each open marked where it adds its group's gradients (the
    /// last open before the group is marked done: group 0 opens twice).
    backward: Vec<(GroupCall, bool)>,
    /// The gathered parameters, reused from micro-batch to micro-batch.
    staging: Vec<f32>,
    /// The step's gradients read back, reused likewise.
    grads: Vec<f32>,
}

const OP: &str = "resident-step";

fn kernel_err(e: GpuError) -> KernelError {
    KernelError::Layout {
        op: OP,
        msg: e.to_string(),
    }
}

impl<B: Backend, S: ResidentStep<B>> AsTokenStep<B, S> {
    /// Steps made by `make` on `be` for parameters whose groups span `groups` of a flat
    /// layout ending at `end`.
    pub fn new(be: B, make: MakeStep<B, S>, groups: Vec<Range<usize>>, end: usize) -> Self {
        let calls = group_calls(groups.len());
        let split = calls
            .iter()
            .position(|c| matches!(c, GroupCall::Open(_, Phase::Backward)))
            .unwrap_or(calls.len());
        let mut seen = vec![false; groups.len()];
        let forward = calls[..split]
            .iter()
            .map(|&c| match c {
                GroupCall::Open(g, _) => (c, !std::mem::replace(&mut seen[g], true)),
                GroupCall::Done(..) => (c, false),
            })
            .collect();
        let back = &calls[split..];
        let backward = back
            .iter()
            .enumerate()
            .map(|(k, &c)| match c {
                GroupCall::Open(g, _) => (
                    c,
                    back.get(k + 1) == Some(&GroupCall::Done(g, Phase::Backward)),
                ),
                GroupCall::Done(..) => (c, false),
            })
            .collect();
        AsTokenStep {
            be,
            make,
            steps: Vec::new(),
            groups,
            end,
            forward,
            backward,
            staging: vec![0f32; end],
            grads: vec![0f32; end],
        }
    }

    /// The step for `batch` x `t` (made on first use: a shape's buffers once).
    fn step(&mut self, batch: usize, t: usize) -> Result<usize, KernelError> {
        if let Some(i) = self.steps.iter().position(|(k, _)| *k == (batch, t)) {
            return Ok(i);
        }
        let s = (self.make)(&self.be, batch, t).map_err(kernel_err)?;
        self.steps.push(((batch, t), s));
        Ok(self.steps.len() - 1)
    }

    /// The parameters gathered into `staging` through the forward calls of the group
    /// protocol.
    fn gather(&mut self, source: &mut dyn StepParams) -> Result<(), KernelError> {
        for &(call, copy) in &self.forward {
            match call {
                GroupCall::Open(g, phase) => {
                    let view = source.group(g, phase)?;
                    if copy {
                        let r = self.groups[g].clone();
                        let from = r
                            .start
                            .checked_sub(view.base)
                            .and_then(|s| view.params.get(s..s + r.len()));
                        let from = from.ok_or_else(|| KernelError::Layout {
                            op: OP,
                            msg: format!("group {g}'s view does not cover {r:?}"),
                        })?;
                        self.staging[r].copy_from_slice(from);
                    }
                }
                GroupCall::Done(g, phase) => source.done(g, phase)?,
            }
        }
        Ok(())
    }
}

impl<B: Backend + Send, S: ResidentStep<B>> TokenStep for AsTokenStep<B, S> {
    fn param_end(&self) -> usize {
        self.end
    }

    fn forward_backward_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
        grad_scale: f32,
    ) -> Result<f64, KernelError> {
        self.gather(source)?;
        let i = self.step(batch.batch, batch.t)?;
        let (be, s) = (&self.be, &self.steps[i].1);
        s.load(be, &self.staging).map_err(kernel_err)?;
        let tb = TokenBatch {
            tokens: batch.tokens,
            targets: batch.targets,
            ignore: batch.ignore,
        };
        let loss = s.run(be, tb, grad_scale).map_err(kernel_err)?;
        s.gradients_into(be, &mut self.grads).map_err(kernel_err)?;
        let grads = &self.grads;
        for &(call, add) in &self.backward {
            match call {
                GroupCall::Open(g, phase) => {
                    let view = source.group(g, phase)?;
                    if add {
                        let r = self.groups[g].clone();
                        let at = r
                            .start
                            .checked_sub(view.base)
                            .filter(|s| s + r.len() <= view.grads.len());
                        let at = at.ok_or_else(|| KernelError::Layout {
                            op: OP,
                            msg: format!("group {g}'s gradient view does not cover {r:?}"),
                        })?;
                        view.grads[at..at + r.len()]
                            .iter_mut()
                            .zip(&grads[r])
                            .for_each(|(a, &g)| *a += g);
                    }
                }
                GroupCall::Done(g, phase) => source.done(g, phase)?,
            }
        }
        Ok(loss)
    }

    fn evaluate_groups(
        &mut self,
        source: &mut dyn StepParams,
        batch: GptBatch,
    ) -> Result<(f64, usize, usize), KernelError> {
        self.gather(source)?;
        let i = self.step(batch.batch, batch.t)?;
        let (be, s) = (&self.be, &self.steps[i].1);
        s.load(be, &self.staging).map_err(kernel_err)?;
        s.eval(
            be,
            TokenBatch {
                tokens: batch.tokens,
                targets: batch.targets,
                ignore: batch.ignore,
            },
        )
        .map_err(kernel_err)
    }

    fn activation_bytes(&self) -> usize {
        self.steps.iter().map(|(_, s)| s.buffer_bytes()).sum()
    }
}

macro_rules! resident {
    ($t:ident) => {
        impl<B: Backend + Send, T: crate::Act> ResidentStep<B> for super::$t<B, T>
        where
            super::$t<B, T>: Send,
        {
            fn load(&self, be: &B, params: &[f32]) -> Result<(), GpuError> {
                self.buffers().load_params(be, params)
            }
            fn run(&self, be: &B, batch: TokenBatch, grad_scale: f32) -> Result<f64, GpuError> {
                self.buffers().zero_grads(be)?;
                self.forward_backward(be, batch, grad_scale)
            }
            fn gradients_into(&self, be: &B, out: &mut [f32]) -> Result<(), GpuError> {
                self.buffers().grads_into(be, out)
            }
            fn eval(&self, be: &B, batch: TokenBatch) -> Result<(f64, usize, usize), GpuError> {
                self.evaluate(be, batch)
            }
            fn buffer_bytes(&self) -> usize {
                self.buffers().bytes()
            }
        }
    };
}

resident!(GptGpuStep);
resident!(LlamaGpuStep);
