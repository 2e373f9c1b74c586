//! The loader benchmark contract, the communication volumes and ring times, and the emitted
//! config.

mod common;

use common::{chosen, plan, resolved};
use stoker_plan::comm::communication;
use stoker_plan::emit::PlanChoice;
use stoker_plan::hardware::GB;
use stoker_plan::loader::{pick, LoaderBench};
use stoker_plan::strategy::{Stage, Strategy};

const BENCH: &str = r#"{"dataset": "data/shakespeare.tok", "sample_bytes": 258, "points": [
  {"num_workers": 8, "prefetch_factor": 2, "batch_size": 64, "samples_per_s": 900.0, "mb_per_s": 0.2, "consumer_wait_pct": 0.1, "peak_rss_bytes": 1000},
  {"num_workers": 2, "prefetch_factor": 4, "batch_size": 64, "samples_per_s": 300.0, "mb_per_s": 0.1, "consumer_wait_pct": 3.0, "peak_rss_bytes": 1000},
  {"num_workers": 4, "prefetch_factor": 4, "batch_size": 64, "samples_per_s": 610.0, "mb_per_s": 0.1, "consumer_wait_pct": 1.0, "peak_rss_bytes": 1000},
  {"num_workers": 4, "prefetch_factor": 2, "batch_size": 64, "samples_per_s": 600.0, "mb_per_s": 0.1, "consumer_wait_pct": 1.0, "peak_rss_bytes": 1000}
]}"#;

#[test]
fn loader_pick_is_fewest_workers_then_smallest_prefetch() {
    let b = LoaderBench::from_json_str("bench.json", BENCH).unwrap();
    let c = pick(&b, 500.0);
    let p = c.chosen.unwrap();
    assert_eq!((p.num_workers, p.prefetch_factor), (4, 2));
    assert_eq!(pick(&b, 250.0).chosen.unwrap().num_workers, 2);
    let none = pick(&b, 1000.0);
    assert!(none.chosen.is_none());
    assert_eq!(none.fastest.unwrap().num_workers, 8);
    // 0 workers load in series with the step: 1,000 samples/s deliver 100 (a tenth of
    // each step spent loading), not 250, where 2 workers' 300 do.
    let zero = BENCH.replacen("\"num_workers\": 8", "\"num_workers\": 0", 1);
    let zero = zero.replacen("900.0", "1000.0", 1);
    let b = LoaderBench::from_json_str("bench.json", &zero).unwrap();
    assert_eq!(pick(&b, 100.0).chosen.unwrap().num_workers, 0);
    assert_eq!(pick(&b, 250.0).chosen.unwrap().num_workers, 2);
}

#[test]
fn plan_with_a_loader_benchmark_emits_the_chosen_setting() {
    // gpt2-124m on 8 A100s needs 1133.9 samples/s, 141.7 per device: 2 workers (300/s) do.
    let r = resolved("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\" }")
        .unwrap();
    let b = LoaderBench::from_json_str("bench.json", BENCH).unwrap();
    let p = stoker_plan::plan(r, Some(&b));
    assert_eq!((p.decision.data.per_device * 10.0).round() / 10.0, 141.7);
    let cfg = p.choice.as_ref().unwrap();
    assert_eq!((cfg.data.num_workers, cfg.data.prefetch_factor), (2, 4));
    assert!(p
        .decision
        .data
        .reason
        .contains("num_workers 2 and prefetch_factor 4"));

    // On an H100 node with fp8 the job needs 899 samples/s per device: nothing measured
    // reaches it except 8 workers (900/s).
    let r = resolved(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
         training = { precision = \"fp8\" }",
    )
    .unwrap();
    let p = stoker_plan::plan(r, Some(&b));
    assert_eq!(p.choice.unwrap().data.num_workers, 8);
    // At 0.8 MFU the step is twice as fast and so is the rate: nothing measured reaches it,
    // and the warning gives the numbers.
    let r = resolved(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
         training = { precision = \"fp8\", mfu = 0.8 }",
    )
    .unwrap();
    let p = stoker_plan::plan(r, Some(&b));
    assert!(
        p.decision.warnings.iter().any(|w| w.starts_with(
            "no measured loader setting reaches the 1798.0 samples/s each device needs"
        )),
        "{:?}",
        p.decision.warnings
    );
}

#[test]
fn communication_is_2p_for_ddp_and_zero12_and_3p_for_zero3() {
    let r = resolved(
        "model = { params = \"1B\" }\nhardware = { preset = \"a100-80gb\" }\n\
         training = { global_batch = 8, seq_len = 1024 }",
    )
    .unwrap();
    let c = |stage| communication(&r.model, &r.hardware, &r.setup, Strategy::plain(stage), 1);
    // bf16: 2 bytes x 1e9 x 2 = 4 GB; ZeRO-3 6 GB.
    for stage in [Stage::Ddp, Stage::Zero1, Stage::Zero2] {
        assert_eq!(c(stage).bytes_per_sync / GB, 4.0);
    }
    assert_eq!(c(Stage::Zero3).bytes_per_sync / GB, 6.0);
    // Ring: all-reduce of 2 GB over 8 devices at 240 GB/s: 2 x 7/8 x 2 GB / 240 GB/s.
    assert!((c(Stage::Ddp).step_s - 2.0 * 7.0 / 8.0 * 2.0 / 240.0).abs() < 1e-12);
    // With 4 accumulation steps ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 does all three.
    let c4 = |stage| communication(&r.model, &r.hardware, &r.setup, Strategy::plain(stage), 4);
    assert_eq!(c4(Stage::Ddp).bytes_per_step / GB, 4.0);
    assert_eq!(c4(Stage::Zero2).bytes_per_step / GB, 10.0);
    assert_eq!(c4(Stage::Zero3).bytes_per_step / GB, 24.0);
    // FP32 collectives (FSDP's reduce_dtype / param_dtype; stoker's trainer) double them.
    let r32 = resolved(
        "model = { params = \"1B\" }\nhardware = { preset = \"a100-80gb\" }\n\
         training = { global_batch = 8, seq_len = 1024, reduce_dtype = \"fp32\", \
         gather_dtype = \"fp32\" }",
    )
    .unwrap();
    let c32 = |stage| {
        communication(
            &r32.model,
            &r32.hardware,
            &r32.setup,
            Strategy::plain(stage),
            1,
        )
    };
    assert_eq!(c32(Stage::Ddp).bytes_per_sync / GB, 8.0);
    assert_eq!(c32(Stage::Zero3).bytes_per_sync / GB, 12.0);
    // DDP's all-reduce carries gradients both ways, in the reduction's dtype: fp32
    // gathers (parameters, which DDP does not gather) leave it at 2 x 2 bytes x 1e9;
    // ZeRO-1 gathers parameters, so it grows.
    let mixed = resolved(
        "model = { params = \"1B\" }\nhardware = { preset = \"a100-80gb\" }\n\
         training = { global_batch = 8, seq_len = 1024, gather_dtype = \"fp32\" }",
    )
    .unwrap();
    let cm = |stage| {
        communication(
            &mixed.model,
            &mixed.hardware,
            &mixed.setup,
            Strategy::plain(stage),
            1,
        )
    };
    assert_eq!(cm(Stage::Ddp).bytes_per_sync / GB, 4.0);
    assert_eq!(cm(Stage::Zero1).bytes_per_sync / GB, 6.0);
    // One device moves nothing: 0 s, not 0 bytes over 0 bandwidth (NaN), and 0 bytes.
    let one = resolved(
        "model = { params = \"1B\" }\nhardware = { memory_gib = 32, devices_per_node = 1, \
         peak_tflops = { bf16 = 100 } }\ntraining = { global_batch = 8, seq_len = 1024 }",
    )
    .unwrap();
    for stage in [Stage::Ddp, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        let c = communication(
            &one.model,
            &one.hardware,
            &one.setup,
            Strategy::plain(stage),
            4,
        );
        assert_eq!(
            (c.step_s, c.unit_rs_s, c.unit_ag_s),
            (0.0, 0.0, 0.0),
            "{stage:?}"
        );
        // ... and no bytes (before: the 2P or 3P buffers its table printed).
        assert_eq!(
            (c.bytes_per_sync, c.bytes_per_step),
            (0.0, 0.0),
            "{stage:?}"
        );
    }
    assert!(resolved(
        "model = { params = \"1B\" }\nhardware = { preset = \"a100-80gb\" }\n\
         training = { global_batch = 8, seq_len = 1024, reduce_dtype = \"fp64\" }",
    )
    .unwrap_err()
    .to_string()
    .contains("training.reduce_dtype"));
}

#[test]
fn the_choice_round_trips_through_json() {
    let p = plan("model = { preset = \"llama-7b\" }\nhardware = { preset = \"a100-80gb\" }");
    assert_eq!(chosen(&p), Some("zero1"));
    let c = p.choice.as_ref().unwrap();
    let back: PlanChoice = serde_json::from_str(&serde_json::to_string(c).unwrap()).unwrap();
    assert_eq!(&back, c);
    assert_eq!(back.parallel.strategy, stoker_plan::strategy::Stage::Zero1);
    assert_eq!(back.parallel.world_size, 8);
    assert_eq!(
        back.data.micro_batch * back.accumulation.accumulation_steps * 8,
        1024
    );
    assert_eq!(
        back.precision.precision,
        stoker_plan::setup::Precision::Bf16
    );
    assert_eq!(
        back.predicted.step_s,
        p.strategies[p.decision.chosen.unwrap()].time.step_s
    );
    assert!(
        c.summary()
            .starts_with("zero1 on 8 device(s): micro-batch "),
        "{}",
        c.summary()
    );
    // JSON for tools parses and carries the same choice.
    let json: serde_json::Value = serde_json::from_str(&p.to_json()).unwrap();
    assert_eq!(json["choice"]["parallel"]["strategy"], "zero1");
    assert_eq!(json["strategies"][0]["label"], "ddp");
}

/// CPU ranks: DDP's collectives never hide; ZeRO-3's hide behind the compute except the
/// cores' own part (the bytes at the node's bandwidth), so on one node nothing hides and on
/// a slow network only the wire time beyond the compute shows.
#[test]
fn on_cpus_zero3_hides_its_wire_time_behind_compute_but_not_its_copies() {
    let step = |hardware: &str, stage| {
        let r = resolved(&format!(
            "model = {{ params = \"100M\" }}\nhardware = {{ {hardware} }}\n\
             training = {{ global_batch = 8, seq_len = 256, micro_batch = 4 }}"
        ))
        .unwrap();
        let s = Strategy::plain(stage);
        let accum = 8 / 4 / r.hardware.world_size();
        let c = communication(&r.model, &r.hardware, &r.setup, s, accum);
        let peak = r
            .hardware
            .device_peak_flops(r.setup.precision.compute_dtype())
            .unwrap();
        let t =
            stoker_plan::time::step_time(&r.model, &r.hardware, &r.setup, s, &c, 4, accum, peak);
        (t, c, r.hardware.intra_node_bw)
    };
    // One node of 2 CPU ranks: every collective's time is exposed, either strategy.
    for stage in [Stage::Ddp, Stage::Zero3] {
        let (t, c, _) = step("preset = \"cpu\", devices_per_node = 2", stage);
        assert_eq!(t.exposed_comm_s, c.step_s, "{stage:?}");
    }
    // Two nodes over 1 Gbit/s: DDP still waits for all of it; ZeRO-3 for the cores' part
    // plus whatever of the wire time its compute does not cover.
    let net = "preset = \"cpu\", nodes = 2, devices_per_node = 1, inter_node_gbit_s = 1";
    let (ddp, c, _) = step(net, Stage::Ddp);
    assert_eq!(ddp.exposed_comm_s, c.step_s);
    let (z3, c, intra) = step(net, Stage::Zero3);
    let host = c.step_s * c.bus_bw / intra;
    let want = host + (c.step_s - host - z3.compute_s).max(0.0);
    assert!(host < c.step_s && z3.exposed_comm_s < c.step_s);
    assert!((z3.exposed_comm_s - want).abs() < 1e-12, "{z3:?} {c:?}");
    // Cores that push only 2 Gbit/s through their network stack pay the bytes at that rate.
    let (z3, c, _) = step(&format!("{net}, host_net_gbit_s = 2"), Stage::Zero3);
    let host = c.step_s * c.bus_bw / 0.25e9;
    let want = host + (c.step_s - host - z3.compute_s).max(0.0);
    assert!((z3.exposed_comm_s - want).abs() < 1e-12, "{z3:?} {c:?}");
}

/// Optimizer offload sends gradients down once they are reduced: under DDP and ZeRO-1 once
/// per step (they accumulate on the device), under ZeRO-2 and ZeRO-3 every micro-batch.
/// Eight accumulation steps leave the first two's offload time as it was at one, and add
/// seven micro-batches' gradient shards to the others' (before, to all four).
#[test]
fn offload_sends_gradients_down_per_reduction_not_per_micro_batch() {
    let offload = |global: u64| {
        let p = plan(&format!(
            "model = {{ preset = \"gpt2-124m\" }}\nhardware = {{ preset = \"h100-80gb\" }}\n\
             training = {{ micro_batch = 4, global_batch = {global} }}"
        ));
        let s = |label: &str| {
            let row = p.strategies.iter().find(|r| r.label == label).unwrap();
            (row.accumulation_steps, row.time.offload_s)
        };
        [
            s("ddp+offload-opt"),
            s("zero1+offload-opt"),
            s("zero2+offload-opt"),
            s("zero3+offload-opt"),
        ]
    };
    let (one, eight) = (offload(32), offload(256));
    for ((k1, t1), (k8, t8)) in one.iter().zip(&eight) {
        assert_eq!((*k1, *k8), (1, 8));
        assert!(t1.is_finite() && *t1 > 0.0 && t8.is_finite(), "{t1} {t8}");
    }
    assert_eq!(one[0].1, eight[0].1, "ddp");
    assert_eq!(one[1].1, eight[1].1, "zero1");
    // The shard is the same for ZeRO-2 and ZeRO-3, so are the seven extra copies.
    let extra = |i: usize| eight[i].1 - one[i].1;
    assert!(extra(2) > 0.0, "{}", extra(2));
    assert!(
        (extra(3) - extra(2)).abs() <= 1e-12 * extra(2),
        "{} {}",
        extra(2),
        extra(3)
    );
}
