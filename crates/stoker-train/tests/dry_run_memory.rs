//! A dry run of a model no machine here can hold costs next to nothing under every
//! strategy: ZeRO's planned workspace is counted on a pool that hands out no memory,
//! not replayed on the rank's real shard (which once took 16-25 s and 10-12 GB for a
//! 7.2B GPT at 4 ranks). Its own test binary, so the process's peak resident set is this
//! test's alone.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::dry_run::ScratchStep;

#[test]
fn a_dry_run_of_a_model_too_large_for_this_machine_holds_next_to_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    write_token_corpus(&tmp.path().join("corpus.bin"), 4000);
    // A 1.2B-parameter GPT: its ZeRO shard at 4 ranks is 1.2 GB of FP32 master alone.
    let big = gpt_config(tmp.path(), "fp32", 2, "")
        .replace("d_model = 32", "d_model = 2048")
        .replace("n_layer = 2", "n_layer = 24")
        .replace("n_head = 4", "n_head = 16");
    let before = stoker_data::measure::peak_rss_bytes();
    for strategy in ["zero1", "zero2", "zero3"] {
        let text = format!("{big}\n[parallel]\nstrategy = \"{strategy}\"\n");
        let c = TrainConfig::parse(&text, Path::new("big.toml")).unwrap();
        let d = stoker_train::dry_run::dry_run(&c, 4, None, None).unwrap();
        assert!(
            d.planned.model_states() > 4e9,
            "{strategy}: {}",
            d.planned.model_states()
        );
    }
    let grown = stoker_data::measure::peak_rss_bytes().saturating_sub(before);
    assert!(
        grown < 300 << 20,
        "the dry runs grew the peak resident set by {} MiB",
        grown >> 20
    );
}

/// A heap count that counts nothing: enough for a dry run to try its scratch micro-batch.
struct NoCount;

impl stoker_train::heap::HeapCount for NoCount {
    fn live(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
    fn reset_peak(&self) {}
}

#[test]
fn a_dry_run_skips_its_scratch_micro_batch_where_the_activations_do_not_fit() {
    let tmp = tempfile::tempdir().unwrap();
    write_token_corpus(&tmp.path().join("corpus.bin"), 4000);
    let text = gpt_config(tmp.path(), "fp32", 2, "");
    let c = TrainConfig::parse(&text, Path::new("small.toml")).unwrap();
    // A budget that holds the model states twice over but not the micro-batch's
    // activations: the dry run plans them and runs nothing (a micro-batch of 8,192 at
    // context 128 once allocated until the allocator aborted).
    let d = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(1e12)).unwrap();
    assert_eq!(
        d.scratch,
        ScratchStep::Measured,
        "a budget that holds it all measures the step"
    );
    let states = d.planned.model_states();
    let tight = 2.0 * states + 1.0;
    let d = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(tight)).unwrap();
    assert_eq!(
        d.scratch,
        ScratchStep::DoesNotFit,
        "the scratch micro-batch ran past its budget"
    );
    // Candle's graph (fp16 runs on it) keeps more than the planner's formula: its
    // activations count twice the formula's (a GPT-2 124M the planner fit in 20 GB took
    // this machine's 23 GB and was killed; before, the graph's counted nothing).
    let text = gpt_config(tmp.path(), "fp16", 2, "");
    let c = TrainConfig::parse(&text, Path::new("small.toml")).unwrap();
    assert!(!c.direct_step(), "fp16 runs on candle's graph");
    let formula = stoker_train::planned::forecast(&c, 1, 1, None)
        .unwrap()
        .activation_bytes;
    let states = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(1e12))
        .unwrap()
        .planned
        .model_states();
    assert!(formula > 0.0);
    let between = 2.0 * states + 1.5 * formula;
    let d = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(between)).unwrap();
    assert_eq!(d.scratch, ScratchStep::DoesNotFit);
    assert!(d.scratch.why_not().is_some());
    // Nothing counted the activations: the forecast takes the planner's, on top of the
    // trainer's own count of the rest (the process, the buffers, the mapped data; before,
    // the planner's row alone: an fp8 GPT forecast 1.0 MiB for 34.7 MiB).
    assert_eq!(d.own.activations, None);
    let row = stoker_train::planned::forecast(&c, 1, 1, None).unwrap();
    let f = stoker_train::planned::forecast(&c, 1, 1, Some(&d.own)).unwrap();
    let o = &d.own;
    let held = o.model_states + o.buffers + row.activation_bytes + o.workspace;
    let want = o.baseline + held + o.backend + o.loader + o.mapped;
    assert_eq!(f.activation_bytes, row.activation_bytes);
    assert!((f.peak_bytes - want).abs() <= 1e-6 * want, "{f:?} {o:?}");
    // The process is in it now: 20 MB here, against 0.7 MB of the row alone.
    assert!(o.baseline > 0.0 && f.peak_bytes > row.peak_bytes + o.mapped);
    // The resident step runs none, whatever the budget, and says why (the dry run said
    // that its model states did not fit).
    let text = format!(
        "step = \"resident\"\n{}",
        gpt_config(tmp.path(), "fp32", 2, "")
    );
    let c = TrainConfig::parse(&text, Path::new("small.toml")).unwrap();
    let d = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(1e12)).unwrap();
    assert_eq!(d.scratch, ScratchStep::Resident);
    assert!(d.scratch.why_not().is_some());
    // fp8 runs one (until 2026-12-08 it ran none): its casts as training's, its scalers
    // put back after it.
    let c = TrainConfig::parse(&gpt_config(tmp.path(), "fp8", 2, ""), Path::new("f.toml")).unwrap();
    let d = stoker_train::dry_run::dry_run(&c, 1, Some(&NoCount), Some(1e12)).unwrap();
    assert_eq!(d.scratch, ScratchStep::Measured);
}
