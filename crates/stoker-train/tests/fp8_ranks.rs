//! FP8 on several ranks: every delayed scaler's amax of a step is the largest over the
//! ranks (Transformer Engine's amax all-reduce), so N ranks take one rank's scales.
//!
//! - Deterministic mode: N ranks (DDP, ZeRO-1, ZeRO-2 at 2 and 4) give one rank's weights
//!   and scalers (scales and amax histories) bit for bit.
//! - Default mode, every strategy (ZeRO-3 included) at 2 and 3 ranks: every rank holds
//!   the same scalers, bit for bit, and the weights are within fp8's tolerance of one
//!   rank's.
//! - The reduction is exercised: one rank's share of the batch alone records other
//!   amaxes than the whole batch.

mod common;

use std::collections::BTreeMap;

use common::ranks::*;
use stoker_train::precision::LayerScalers;

/// The models fp8 runs on (its quantization is the graph's): the GPT's and the Llama's
/// linear layers, and the MLP's.
const CASES: [(&str, &str); 3] = [(GPT, ADAMW), (LLAMA, SGD), (MLP, ADAMW)];

/// Every scaler's scale and history as bits, by layer and role, for exact comparisons.
fn scaler_bits(state: &BTreeMap<String, LayerScalers>) -> Vec<(String, Vec<u32>)> {
    state
        .iter()
        .flat_map(|(name, three)| {
            three.iter().enumerate().map(move |(role, s)| {
                let mut bits = vec![s.scale().to_bits()];
                bits.extend(s.history().iter().map(|a| a.to_bits()));
                (format!("{name} scaler {role}"), bits)
            })
        })
        .collect()
}

/// Asserts `got`'s scalers are `want`'s, bit for bit, naming the first that is not.
fn assert_same_scalers(got: &RankRun, want: &RankRun, what: &str) {
    let (g, w) = (
        scaler_bits(got.fp8.as_ref().expect("fp8 state")),
        scaler_bits(want.fp8.as_ref().expect("fp8 state")),
    );
    assert_eq!(g.len(), w.len(), "{what}: scalers");
    assert!(!g.is_empty(), "{what}: no scaler recorded");
    for ((name, a), (_, b)) in g.iter().zip(&w) {
        assert_eq!(a, b, "{what}: {name} (scale, then history, as bits)");
    }
}

#[test]
fn deterministic_fp8_on_n_ranks_is_one_rank_bit_for_bit_scalers_included() {
    let g = 4;
    for (model, optimizer) in CASES {
        let one = config(model, "fp8", "fused", optimizer, "deterministic = true");
        let reference = train_and_evaluate(1, &one, model, g, 2, STEPS, 0, micro_batch).remove(0);
        for strategy in ["ddp", "zero1", "zero2"] {
            let c = config(
                model,
                "fp8",
                "fused",
                optimizer,
                &format!("deterministic = true\nstrategy = \"{strategy}\""),
            );
            for world in [2, 4] {
                let runs = train_and_evaluate(world, &c, model, g, 1, STEPS, 0, micro_batch);
                for (r, run) in runs.iter().enumerate() {
                    let what = format!("fp8 {strategy} {} world {world} rank {r}", &model[8..11]);
                    stoker_testkit::assert_bits_eq(&run.master, &reference.master, &what);
                    assert_same_scalers(run, &reference, &what);
                }
            }
        }
    }
}

#[test]
fn fp8_ranks_agree_on_every_scale_under_every_strategy_and_train_as_one_rank() {
    let tol = stoker_testkit::data_parallel_tolerance("fp8");
    for (model, optimizer) in CASES {
        let g = 6;
        let one = config(model, "fp8", "fused", optimizer, "");
        let reference = train_and_evaluate(1, &one, model, g, 2, STEPS, 0, micro_batch).remove(0);
        for strategy in strategies() {
            let c = config(model, "fp8", "fused", optimizer, strategy);
            for world in [2, 3] {
                let runs = train_and_evaluate(world, &c, model, g, 1, STEPS, 0, micro_batch);
                for (r, run) in runs.iter().enumerate() {
                    let what = format!(
                        "fp8 {} {} world {world} rank {r}",
                        strategy.replace('\n', " "),
                        &model[8..11]
                    );
                    assert_same_scalers(run, &runs[0], &what);
                    let d = rel_l2_checked(&run.master, &reference.master);
                    assert!(d <= tol, "{what}: weights differ by {d:e} (L2, relative)");
                }
            }
        }
    }
}

/// Without the reduction each rank would scale by its own share's amax: the check above
/// means something only if a share's amaxes differ from the whole batch's.
#[test]
fn one_rank_s_share_alone_records_other_amaxes_than_the_whole_batch() {
    for (model, optimizer) in CASES {
        let c = config(model, "fp8", "fused", optimizer, "");
        let whole = train_and_evaluate(1, &c, model, 4, 1, 1, 0, micro_batch).remove(0);
        // Rank 0's share at world 2: the first two of the four micro-batches.
        let share = train_and_evaluate(1, &c, model, 2, 1, 1, 0, micro_batch).remove(0);
        let (a, b) = (
            scaler_bits(whole.fp8.as_ref().expect("fp8 state")),
            scaler_bits(share.fp8.as_ref().expect("fp8 state")),
        );
        assert_eq!(a.len(), b.len());
        let differ = a.iter().zip(&b).filter(|(x, y)| x.1 != y.1).count();
        assert!(
            differ > 0,
            "{}: a share's amaxes equal the whole batch's in every scaler",
            &model[8..11]
        );
    }
}
