//! DeepSpeed's published estimator example (docs "Memory Requirements"): t5-3b, 2851M
//! parameters, 1 node of 8 GPUs. Its table, made with the pre-PR-#5099 formula 4P + 16P/G:
//! ZeRO-2 15.93 GiB per GPU (no offload) and 5.31 GiB (optimizer offload), 127.48 GiB per CPU.

mod common;

use common::{r2, resolved};
use stoker_plan::ds_estimate::{estimate, Formula};
use stoker_plan::hardware::GIB;
use stoker_plan::strategy::{Stage, Strategy, ALL};

const T5_3B: f64 = 2_851_598_336.0;
const T5_LARGEST: f64 = 32_899_072.0; // shared 32128 x 1024 embedding

fn gib(x: f64) -> f64 {
    r2(x / GIB)
}

#[test]
fn t5_3b_zero2_legacy_formula_matches_the_docs_table() {
    let none = estimate(
        T5_3B,
        T5_LARGEST,
        8,
        1,
        Strategy::plain(Stage::Zero2),
        Formula::Legacy,
    )
    .unwrap();
    assert_eq!(gib(none.gpu), 15.93); // 4P + 16P/8 = 6P
    assert_eq!(gib(none.cpu_per_node), 127.48); // 4P x 8 GPUs x 1.5
    let off = estimate(
        T5_3B,
        T5_LARGEST,
        8,
        1,
        Strategy::offload(Stage::Zero2),
        Formula::Legacy,
    )
    .unwrap();
    assert_eq!(gib(off.gpu), 5.31); // 2P
    assert_eq!(gib(off.cpu_per_node), 127.48); // P x max(4 x 8, 16) x 1.5
}

#[test]
fn t5_3b_zero2_current_formula_is_2p_plus_18p_over_g() {
    let none = estimate(
        T5_3B,
        T5_LARGEST,
        8,
        1,
        Strategy::plain(Stage::Zero2),
        Formula::Current,
    )
    .unwrap();
    assert_eq!(gib(none.gpu), 11.29); // 2P + 18P/8 = 4.25P
                                      // Offload is the same in both versions.
    let off = estimate(
        T5_3B,
        T5_LARGEST,
        8,
        1,
        Strategy::offload(Stage::Zero2),
        Formula::Current,
    )
    .unwrap();
    assert_eq!(gib(off.gpu), 5.31);
}

#[test]
fn t5_3b_zero3_rows_match_the_docs_table() {
    // zero_init = 1 rows: offload param+optimizer 0.12 / 71.71, optimizer only 0.79 / 63.74,
    // none 6.10 / 1.47 (GiB per GPU / per CPU).
    let rows = [
        (ALL[7], 0.12, 71.71),
        (Strategy::offload(Stage::Zero3), 0.79, 63.74),
        (Strategy::plain(Stage::Zero3), 6.10, 1.47),
    ];
    for (s, gpu, cpu) in rows {
        let e = estimate(T5_3B, T5_LARGEST, 8, 1, s, Formula::Current).unwrap();
        assert_eq!(
            (gib(e.gpu), gib(e.cpu_per_node)),
            (gpu, cpu),
            "{}",
            s.label()
        );
    }
}

#[test]
fn ddp_has_no_deepspeed_estimator() {
    assert!(estimate(
        T5_3B,
        T5_LARGEST,
        8,
        1,
        Strategy::plain(Stage::Ddp),
        Formula::Current
    )
    .is_none());
}

const T5_NODE: &str = r#"
[model]
preset = "t5-3b"
[hardware]
preset = "a100-80gb"
[training]
global_batch = 64
seq_len = 512
"#;

#[test]
fn accounting_flag_switches_the_model_states_of_the_table() {
    let with = |acc: &str| {
        let r = resolved(&format!("{T5_NODE}accounting = \"{acc}\"\n")).unwrap();
        let p = stoker_plan::plan(r, None);
        let z2 = p.strategies.iter().find(|x| x.label == "zero2").unwrap();
        (gib(z2.memory.device.model_states()), p)
    };
    let (legacy, p) = with("deepspeed-legacy");
    assert_eq!(legacy, 15.93);
    let text = p.to_text();
    assert!(text.contains("  127.48GB |  15.93GB | zero2"), "{text}");
    assert!(
        text.contains("  127.48GB |   5.31GB | zero2+offload-opt"),
        "{text}"
    );
    assert_eq!(with("deepspeed").0, 11.29);
    // stoker's default: the ZeRO paper's 2P + 14P/8 = 3.75P = 9.96 GiB.
    assert_eq!(with("stoker").0, 9.96);
}
