//! Presets: parameter counts from the architecture formula, and each preset's recommendation
//! pinned with the arithmetic that explains it.

mod common;

use common::{chosen, plan, r1};
use stoker_plan::hardware::{self, GB};
use stoker_plan::model;
use stoker_plan::setup::{Dtype, Precision};

#[test]
fn parameter_counts_match_the_published_ones() {
    let count = |n: &str| model::preset(n).unwrap().params;
    assert_eq!(count("gpt2-124m"), 124_439_808); // GPT-2 small (HF)
    assert_eq!(count("gpt2-1.5b"), 1_557_611_200); // GPT-2 XL (HF)
    assert_eq!(count("llama-7b"), 6_738_415_616); // Llama-2-7b
    assert_eq!(count("llama-13b"), 13_015_864_320); // Llama-2-13b
    assert_eq!(count("llama-70b"), 68_976_648_192); // Llama-2-70b (GQA, 8 kv heads)
                                                    // The demo GPT: 96x128 tokens + 128x128 positions + 4 x (12 x 128^2 + 13 x 128) +
                                                    // 2 x 128, head tied to the token embedding (REFERENCES.md's 826,368 is vocab 65
                                                    // with an untied head: 818,048 + 65 x 128).
    assert_eq!(count("stoker-gpt"), 822_016);
    assert_eq!(count("t5-3b"), 2_851_598_336);
}

#[test]
fn gpt2_124m_on_an_a100_node_is_plain_ddp_with_no_accumulation() {
    // 16 bytes x 124.4M = 2.0 GB of model states; 64 sequences of 1024 tokens per device
    // (512 / 8) need 33.9 GB of activations with FlashAttention: DDP fits in one micro-step.
    let p = plan("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\" }");
    assert_eq!(chosen(&p), Some("ddp"));
    let row = &p.strategies[p.decision.chosen.unwrap()];
    assert_eq!((row.micro_batch, row.accumulation_steps), (64, 1));
    assert_eq!(r1(row.memory.device.model_states() / GB), 2.0);
    assert_eq!(r1(row.memory.device.activations / GB), 33.9);
    assert_eq!(p.inputs.setup.precision, Precision::Bf16);
}

#[test]
fn gpt2_1_5b_on_an_h100_node_is_ddp_with_4_accumulation_steps() {
    // 16 x 1.56B = 24.9 GB of states; micro-batch 32 would add 92 GB of activations, 16 adds
    // 46.2 GB: 75.8 GB of the 77.0 GB usable (85.5 GB less 10%).
    let p = plan("model = { preset = \"gpt2-1.5b\" }\nhardware = { preset = \"h100-80gb\" }");
    assert_eq!(chosen(&p), Some("ddp"));
    let row = &p.strategies[p.decision.chosen.unwrap()];
    assert_eq!((row.micro_batch, row.accumulation_steps), (16, 4));
    assert_eq!(r1(row.memory.device.model_states() / GB), 24.9);
    assert_eq!(r1(row.memory.device.total / GB), 75.8);
}

#[test]
fn llama_7b_on_an_a100_node_needs_zero1() {
    // DDP: 16 x 6.74B = 107.8 GB of states alone > 77.3 GB usable. ZeRO-1: 4P + 12P/8 =
    // 37.1 GB + 20.7 GB of activations (one 4096-token sequence) = 61.8 GB with buffers.
    let p = plan("model = { preset = \"llama-7b\" }\nhardware = { preset = \"a100-80gb\" }");
    assert_eq!(chosen(&p), Some("zero1"));
    assert_eq!(r1(p.strategies[0].memory.device.model_states() / GB), 107.8);
    let row = &p.strategies[1];
    assert_eq!((row.micro_batch, row.accumulation_steps), (1, 128));
    assert_eq!(r1(row.memory.device.model_states() / GB), 37.1);
    assert_eq!(r1(row.memory.device.total / GB), 61.8);
}

#[test]
fn llama_13b_on_an_h100_node_needs_zero3() {
    // ZeRO-2: 2P + 14P/8 = 48.8 GB + 32.1 GB activations = 86.1 GB > 77.0 usable.
    // ZeRO-3: 16P/8 = 26.0 GB + 32.1 GB + two gathered blocks = 64.2 GB.
    let p = plan("model = { preset = \"llama-13b\" }\nhardware = { preset = \"h100-80gb\" }");
    assert_eq!(chosen(&p), Some("zero3"));
    assert_eq!(r1(p.strategies[2].memory.device.total / GB), 86.1);
    assert_eq!(r1(p.strategies[3].memory.device.total / GB), 64.2);
}

#[test]
fn llama_70b_on_one_h200_node_only_fits_with_everything_offloaded() {
    // Without checkpointing 80 blocks of one 4096-token sequence hold 118.8 GB of activations,
    // so only ZeRO-3 with optimizer and parameters offloaded fits (131.2 of 135.7 GB); the
    // planner says activation checkpointing would cut the activations.
    let p = plan("model = { preset = \"llama-70b\" }\nhardware = { preset = \"h200-141gb\" }");
    assert_eq!(chosen(&p), Some("zero3+offload-opt+params"));
    let row = &p.strategies[p.decision.chosen.unwrap()];
    assert_eq!(r1(row.memory.device.activations / GB), 118.8);
    assert_eq!(r1(row.memory.host.needed / GB), 1241.6); // 18 bytes x 69.0B on one node's host
    assert!(p
        .decision
        .warnings
        .iter()
        .any(|w| w.contains("activation checkpointing would cut them")));
}

#[test]
fn llama_70b_on_four_h100_nodes_with_checkpointing_is_zero3() {
    // 16P/32 = 34.5 GB of states; checkpointing keeps 2sbh per block: micro-batch 4 fits at
    // 74.2 of 77.0 GB, with 8 accumulation steps to reach 1024 = 4 x 8 x 32.
    let p = plan(
        "model = { preset = \"llama-70b\" }\nhardware = { preset = \"h100-80gb\", nodes = 4 }\n\
         training = { activation_checkpointing = true }",
    );
    assert_eq!(chosen(&p), Some("zero3"));
    let row = &p.strategies[3];
    assert_eq!((row.micro_batch, row.accumulation_steps), (4, 8));
    assert_eq!(r1(row.memory.device.model_states() / GB), 34.5);
    assert_eq!(r1(row.memory.device.total / GB), 74.2);
    assert!(p.decision.warnings.iter().all(|w| !w.contains("10 Gbps")));
}

#[test]
fn llama_70b_over_a_10_gbps_network_warns_that_zero3_is_communication_bound() {
    // At 10 Gbit/s per node the ring runs at 1.25 GB/s: ZeRO-3 moves 3 x 138 GB per
    // micro-step, 2566 s of communication against 197 s of compute.
    let p = plan(
        "model = { preset = \"llama-70b\" }\n\
         hardware = { preset = \"h100-80gb\", nodes = 4, inter_node_gbit_s = 10 }\n\
         training = { activation_checkpointing = true }",
    );
    let z3 = &p.strategies[3];
    assert_eq!(z3.time.comm_s.round(), 2566.0);
    assert_eq!(z3.time.compute_s.round(), 197.0);
    assert!(p
        .decision
        .warnings
        .iter()
        .any(|w| w.contains("the chapter's 10 Gbps warning")));
}

#[test]
fn stoker_gpt_on_the_build_machine_is_one_bf16_rank() {
    // 822k parameters: 13 MB of fp32 Adam states. The CPU runs bf16 on AMX tiles, so bf16:
    // 16 x 128 tokens x (6 x 822,016 + 12 x 4 x 128 x 128) FLOPs = 11.71 GFLOP at the
    // measured 3.7% of the AMX peak of 6.26 TFLOP/s = 0.0506 s (`make bench-step`
    // measured 50.3 ms for this model).
    let p = plan("model = { preset = \"stoker-gpt\" }\nhardware = { preset = \"cpu\" }");
    assert_eq!(chosen(&p), Some("ddp"));
    assert_eq!(p.inputs.setup.precision, Precision::Bf16);
    let row = &p.strategies[0];
    assert_eq!((row.micro_batch, row.accumulation_steps), (16, 1));
    assert_eq!((row.time.step_s * 10000.0).round(), 506.0);
    // fp32 on request: 11.71 GFLOP at 40% of 426 GFLOP/s = 0.0687 s (measured 69.5 ms).
    let p = plan(
        "model = { preset = \"stoker-gpt\" }\nhardware = { preset = \"cpu\" }\n\
         training = { precision = \"fp32\" }",
    );
    assert_eq!((p.strategies[0].time.step_s * 10000.0).round(), 687.0);
    let cfg = p.choice.unwrap();
    assert_eq!(cfg.data.num_workers, 1); // 2 cores: one worker beside the trainer
    assert!(!cfg.data.pin_memory);
}

#[test]
fn precision_per_hardware_preset() {
    let prec = |hw: &str, extra: &str| {
        let p = plan(&format!(
            "model = {{ preset = \"gpt2-124m\" }}\nhardware = {{ preset = \"{hw}\" }}\n{extra}"
        ));
        (p.inputs.setup.precision, p.decision.warnings)
    };
    assert_eq!(prec("a100-80gb", "").0, Precision::Bf16);
    assert_eq!(prec("h100-80gb", "").0, Precision::Bf16); // fp8 only on request
    assert_eq!(
        prec("h200-141gb", "training = { precision = \"fp8\" }").0,
        Precision::Fp8
    );
    let (p, w) = prec("a100-80gb", "training = { precision = \"fp8\" }");
    assert_eq!(p, Precision::Bf16);
    assert!(w[0].contains("a100-80gb has no fp8 matmul"), "{w:?}");
    assert_eq!(
        prec("cpu", "training = { global_batch = 16 }").0,
        Precision::Bf16
    );
    // A device with fp16 but no bf16 (V100-like) gets fp16 with dynamic loss scaling.
    let p = plan(
        "model = { preset = \"gpt2-124m\" }\n\
         hardware = { memory_gib = 32.0, peak_tflops = { fp16 = 125.0, fp32 = 15.7 } }",
    );
    assert_eq!(p.inputs.setup.precision, Precision::Fp16);
    assert_eq!(p.choice.unwrap().precision.loss_scaling, "dynamic");
}

#[test]
fn hardware_presets_are_what_nvidia_smi_reports() {
    let mib = |n: &str| hardware::preset(n).unwrap().device_memory / (1024.0 * 1024.0);
    assert_eq!(mib("a100-80gb"), 81920.0);
    assert_eq!(mib("h100-80gb"), 81559.0);
    assert_eq!(mib("h200-141gb"), 143771.0);
    let e = hardware::preset("v100").unwrap_err().to_string();
    assert!(
        e.contains("known: a100-80gb, h100-80gb, h200-141gb, cpu"),
        "{e}"
    );
}

#[test]
fn a_cpu_only_machine_is_never_told_to_offload() {
    // GPT-2 1.5B on the 24 GiB `cpu` preset: 16 x 1.56B = 24.9 GB of states do not fit
    // even as ZeRO-3 on one device; offloading "to the host" would move host memory to
    // host memory, so the offload rows are skipped with a reason and nothing is chosen.
    let p = plan("model = { preset = \"gpt2-1.5b\" }\nhardware = { preset = \"cpu\" }");
    assert!(
        chosen(&p).is_none_or(|c| !c.contains("offload")),
        "{:?}",
        chosen(&p)
    );
    let path = p.decision.path.join("\n");
    assert!(
        path.contains("offload-opt: not considered") && path.contains("host memory already"),
        "{path}"
    );
}

/// The activation-checkpointing hint speaks when memory forced the plan's hand: the
/// planner's own micro-batch of 32 with 4 accumulation steps, not a micro-batch of 8 the
/// user pinned (before, both said it).
#[test]
fn a_pinned_micro_batch_is_no_reason_for_the_checkpointing_hint() {
    let hint = |p: &stoker_plan::Plan| {
        p.decision
            .warnings
            .iter()
            .any(|w| w.contains("activation checkpointing would cut them"))
    };
    let base = "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"cpu\" }\n";
    let free = plan(&format!("{base}training = {{ global_batch = 128 }}"));
    assert_eq!(chosen(&free), Some("ddp"));
    assert!(free.strategies[0].accumulation_steps > 1);
    assert!(hint(&free), "{:?}", free.decision.warnings);
    let pinned = plan(&format!(
        "{base}training = {{ global_batch = 128, micro_batch = 8 }}"
    ));
    assert_eq!(chosen(&pinned), Some("ddp"));
    assert!(!hint(&pinned), "{:?}", pinned.decision.warnings);
}

/// When nothing fits, the row named is one the walk considered (no offload on a CPU,
/// whose states are in host memory already), and a row short of host memory, not device
/// memory, is said to be so.
#[test]
fn nothing_fits_names_a_considered_row_and_the_memory_it_lacks() {
    let cpu = plan(
        "model = { preset = \"llama-7b\" }\nhardware = { preset = \"cpu\", devices_per_node = 2 }",
    );
    assert_eq!(chosen(&cpu), None);
    assert!(
        cpu.decision
            .strategy
            .starts_with("nothing fits: the smallest need is zero3 with")
            && !cpu.decision.strategy.contains("offload"),
        "{}",
        cpu.decision.strategy
    );
    let host = plan(
        "model = { preset = \"llama-70b\" }\n\
         hardware = { preset = \"h100-80gb\", host_memory_gib = 1024 }\n\
         training = { seq_len = 1024, activation_checkpointing = true }",
    );
    assert_eq!(chosen(&host), None);
    let s = &host.decision.strategy;
    assert!(
        s.starts_with("nothing fits: the smallest need, zero3+offload-opt, fits the device")
            && s.contains("of host memory per node")
            && s.contains("add host memory or nodes"),
        "{s}"
    );
}

/// A pinned strategy that the device holds and the host does not: the warning names the
/// host's need (before: "does NOT fit" beside a device figure that fit).
#[test]
fn a_pinned_strategy_short_of_host_memory_says_so() {
    let p = plan(
        "model = { preset = \"llama-13b\" }\n\
         hardware = { preset = \"a100-80gb\", host_memory_gib = 100 }\n\
         training = { global_batch = 64, seq_len = 2048, strategy = \"zero3\", offload_optimizer = true }",
    );
    let w = p
        .decision
        .warnings
        .iter()
        .find(|w| w.starts_with("the configuration asks for zero3+offload-opt"))
        .unwrap_or_else(|| panic!("{:?}", p.decision.warnings));
    assert!(
        w.contains("does NOT fit: the device holds it") && w.contains("the host needs"),
        "{w}"
    );
}

/// Where one sequence's activations alone exceed the device, more devices do not help
/// (they shard the model states only): the advice says so instead of "add devices".
#[test]
fn nothing_fits_on_activations_alone_does_not_ask_for_devices() {
    let p = plan(
        "model = { preset = \"llama-70b\" }\n\
         hardware = { preset = \"h100-80gb\", nodes = 4096 }\n\
         training = { global_batch = 32768, seq_len = 4096 }",
    );
    assert_eq!(chosen(&p), None);
    let s = &p.decision.strategy;
    assert!(
        s.starts_with("nothing fits")
            && s.contains("activations alone take")
            && !s.contains("add devices"),
        "{s}"
    );
}

/// `hardware.emulated`: a CPU without bf16 instructions (AVX2 only) has the `cpu` preset's
/// bf16 peak but not its hardware. Decision (b) then picks fp32 with none requested, and a
/// request for bf16 is planned at its rate with a warning. Naming a dtype the hardware
/// has no peak for is refused, naming the field.
#[test]
fn an_emulated_dtype_is_planned_on_request_but_never_picked() {
    let cpu = |extra: &str| {
        plan(&format!(
            "model = {{ preset = \"stoker-gpt\" }}\n\
             hardware = {{ preset = \"cpu\", emulated = [\"bf16\"] }}\n{extra}"
        ))
    };
    let p = cpu("");
    assert_eq!(p.inputs.setup.precision, Precision::Fp32);
    assert!(
        p.decision
            .precision
            .starts_with("fp32: cpu runs neither bf16 nor fp16 natively (bf16: emulated, "),
        "{}",
        p.decision.precision
    );
    let p = cpu("training = { precision = \"bf16\" }");
    assert_eq!(p.inputs.setup.precision, Precision::Bf16);
    assert!(
        p.decision.warnings[0]
            .starts_with("bf16 was requested but cpu has no hardware for it (emulated)"),
        "{:?}",
        p.decision.warnings
    );
    let input = stoker_plan::input::PlanInput::from_toml_str(
        "t.toml",
        "model = { preset = \"stoker-gpt\" }\n\
         hardware = { memory_gib = 16.0, peak_tflops = { fp32 = 1.0 }, emulated = [\"bf16\"] }",
    )
    .unwrap();
    let e = stoker_plan::resolve::resolve(&input, None, &Default::default()).unwrap_err();
    assert!(e.to_string().contains("hardware.peak_tflops.bf16"), "{e}");
    // fp32 is what the others are weighed against: refused.
    let input = stoker_plan::input::PlanInput::from_toml_str(
        "t.toml",
        "model = { preset = \"stoker-gpt\" }\nhardware = { preset = \"cpu\", emulated = [\"fp32\"] }",
    )
    .unwrap();
    let e = stoker_plan::resolve::resolve(&input, None, &Default::default()).unwrap_err();
    assert!(e.to_string().contains("hardware.emulated.fp32"), "{e}");
    // Another preset on top is another device: the CPU's marks (and peaks) go with it.
    let input = stoker_plan::input::PlanInput::from_toml_str(
        "t.toml",
        "model = { preset = \"stoker-gpt\" }\n\
         hardware = { preset = \"cpu\", emulated = [\"bf16\"], peak_tflops = { fp32 = 0.03 } }",
    )
    .unwrap();
    let flags = stoker_plan::input::PlanInput::from_toml_str(
        "flags.toml",
        "hardware = { preset = \"h100-80gb\" }",
    )
    .unwrap();
    let r = stoker_plan::resolve::resolve(&input, None, &flags).unwrap();
    assert_eq!(r.precision.precision, Precision::Bf16);
    let fp32 = |hw: &hardware::Hardware| hw.dtype(Dtype::Fp32).unwrap().peak_flops;
    assert_eq!(
        fp32(&r.hardware),
        fp32(&hardware::preset("h100-80gb").unwrap())
    );
    // An alias or another case of the same preset is the same device: nothing dropped.
    for alias in ["cpu-only", "CPU"] {
        let flags = stoker_plan::input::PlanInput::from_toml_str(
            "flags.toml",
            &format!("hardware = {{ preset = \"{alias}\" }}"),
        )
        .unwrap();
        let r = stoker_plan::resolve::resolve(&input, None, &flags).unwrap();
        assert_eq!(fp32(&r.hardware), 0.03e12, "{alias}");
        assert_eq!(r.precision.precision, Precision::Fp32, "{alias}");
    }
    // `auto` in a plan file is no request: the planner's choice.
    let p = plan(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
         training = { precision = \"auto\" }",
    );
    assert_eq!(p.inputs.setup.precision, Precision::Bf16);
}

#[test]
fn fp8_on_several_devices_is_planned_as_on_one() {
    // An H100 node of 8: stoker trains fp8 on several ranks (each amax the largest over
    // them), so the plan warns of nothing about it (it once said a config for 8 ranks was
    // refused).
    let node = "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\" }\n\
                training = { precision = \"fp8\" }";
    let p = plan(node);
    assert_eq!(p.inputs.setup.precision, Precision::Fp8);
    assert!(
        !p.decision.warnings.iter().any(|w| w.contains("fp8")),
        "{:?}",
        p.decision.warnings
    );
}
