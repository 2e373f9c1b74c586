//! Clipping by global gradient norm over the flat gradient buffer (after unscaling,
//! before the optimizer step), with torch's `clip_grad_norm_` coefficient.

/// The L2 norm of `grads`, accumulated in f64. Finite exactly when every gradient is
/// (an f32 squared fits f64, and so does any realistic count of them).
pub fn global_norm(grads: &[f32]) -> f64 {
    stoker_kernels::flat::l2_norm(grads)
}

/// Scales `grads` so their global norm is at most `max_norm`; returns the norm before
/// clipping. The coefficient is `max_norm / (norm + 1e-6)`, applied only when below 1.
pub fn clip_global_norm(grads: &mut [f32], max_norm: f64) -> f64 {
    let norm = global_norm(grads);
    clip_to(grads, norm, max_norm);
    norm
}

/// The scaling of [`clip_global_norm`] for a `norm` already computed by [`global_norm`].
pub fn clip_to(grads: &mut [f32], norm: f64, max_norm: f64) {
    if let Some(coef) = stoker_kernels::flat::clip_coefficient(norm, max_norm) {
        stoker_kernels::flat::scale(grads, coef as f32);
    }
}
