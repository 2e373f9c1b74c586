//! Bad input gives a clear error naming the field and what was expected, never a panic.

mod common;

use common::resolved;
use stoker_plan::loader::LoaderBench;
use stoker_plan::PlanError;

fn err(text: &str) -> String {
    resolved(text).unwrap_err().to_string()
}

const OK: &str = "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\" }\n";

#[test]
fn zero_and_negative_sizes() {
    assert_eq!(
        err("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\", nodes = 0 }"),
        "hardware.nodes must be a positive integer, got 0"
    );
    assert_eq!(
        err("model = { layers = -4, hidden = 128, heads = 4, vocab = 65 }\nhardware = { preset = \"cpu\" }"),
        "model.layers must be a positive integer, got -4"
    );
    assert_eq!(
        err("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\", memory_gib = -80.0 }"),
        "hardware.memory_gib must be a positive number, got -80"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ global_batch = 0 }}")),
        "training.global_batch must be a positive integer, got 0"
    );
    // GPT-2's positions end at 1,024: a longer sequence is not a plan the run can follow.
    assert_eq!(
        err(&format!("{OK}training = {{ global_batch = 8, seq_len = 2048 }}")),
        "training.seq_len must be at most the model's context 1024 (its positions), or a model with a longer one, got 2048"
    );
    resolved(&format!(
        "{OK}training = {{ global_batch = 8, seq_len = 1024 }}"
    ))
    .unwrap();
    assert_eq!(
        err("model = { params = \"-3B\" }\nhardware = { preset = \"cpu\" }"),
        "model.params must be a positive count below 1e16, got -3B"
    );
    assert_eq!(
        err("model = { params = \"lots\" }\nhardware = { preset = \"cpu\" }"),
        "model.params must be a count such as 7.5e9, 7.5B or 124M, got lots"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ global_batch = 80000000000 }}")),
        "training.global_batch must be a positive integer up to 10^9, got 80000000000"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ mfu = 1.5 }}")),
        "training.mfu must be a fraction in (0, 1], got 1.5"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ activation_passes = -1.0 }}")),
        "training.activation_passes must be a number of passes >= 0, got -1"
    );
    assert_eq!(
        err("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\", peak_tflops = { bf16 = 0.0 } }"),
        "hardware.peak_tflops.bf16 must be a positive number, got 0"
    );
}

#[test]
fn world_size_that_does_not_divide_the_global_batch() {
    assert_eq!(
        err("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"h100-80gb\", nodes = 2 }\ntraining = { global_batch = 1000 }"),
        "batch arithmetic: training.global_batch 1000 is not divisible by the world size 16 (hardware.nodes 2 x hardware.devices_per_node 8)"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ global_batch = 512, micro_batch = 3 }}")),
        "batch arithmetic: micro_batch 3 does not divide the 64 sequences per device (global_batch 512 / world size 8)"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ global_batch = 512, micro_batch = 4, accumulation_steps = 4 }}")),
        "batch arithmetic: micro_batch 4 x accumulation_steps 4 x world size 8 = 128 != global_batch 512"
    );
}

#[test]
fn unknown_presets_list_the_known_ones() {
    assert_eq!(
        err("model = { preset = \"gpt5\" }\nhardware = { preset = \"cpu\" }"),
        "unknown model preset \"gpt5\"; known: gpt2-124m, gpt2-1.5b, llama-7b, llama-13b, llama-70b, stoker-gpt, t5-3b"
    );
    assert_eq!(
        err("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"tpu-v5\" }"),
        "unknown hardware preset \"tpu-v5\"; known: a100-80gb, h100-80gb, h200-141gb, cpu"
    );
}

#[test]
fn unknown_options_list_the_accepted_values() {
    assert_eq!(
        err(&format!("{OK}training = {{ precision = \"fp4\" }}")),
        "training.precision: unknown value \"fp4\"; expected one of fp32, fp16, bf16, bf16-pure, fp8, or auto (the planner's choice)"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ optimizer = \"lion\" }}")),
        "training.optimizer: unknown value \"lion\"; expected one of adam, adamw, sgd"
    );
    assert_eq!(
        err(&format!("{OK}training = {{ strategy = \"zero2\", offload_optimizer = true, offload_params = true }}")),
        "offloading parameters needs ZeRO-3 (stage 3), not zero2"
    );
}

#[test]
fn malformed_or_unknown_toml() {
    let e = resolved("model = { preset = \"gpt2-124m\"").unwrap_err();
    assert!(matches!(e, PlanError::Toml { .. }), "{e}");
    assert!(
        e.to_string().starts_with("test.toml: malformed TOML"),
        "{e}"
    );
    let e = resolved("[model]\npreset = \"gpt2-124m\"\nlayer = 4\n").unwrap_err();
    assert!(e.to_string().contains("unknown field `layer`"), "{e}");
}

#[test]
fn missing_inputs_say_how_to_give_them() {
    let e = err("hardware = { preset = \"cpu\" }");
    assert!(
        e.starts_with("model is required: give a preset (--model; known: gpt2-124m"),
        "{e}"
    );
    let e = err("model = { params = 1000000 }\nhardware = { preset = \"cpu\" }\ntraining = { global_batch = 8 }");
    assert_eq!(e, "training.seq_len is required: give --seq-len (tokens per sequence) when the model has no architecture");
    let e = err("model = { preset = \"gpt2-124m\" }\nhardware = { memory_gib = 16.0, devices_per_node = 2, peak_tflops = { fp16 = 100.0 } }");
    assert!(
        e.starts_with("hardware.intra_node_gbyte_s is required"),
        "{e}"
    );
    let e = err("model = { layers = 2, hidden = 100, heads = 3, vocab = 10 }\nhardware = { preset = \"cpu\" }");
    assert_eq!(
        e,
        "model.heads must be a divisor of model.hidden (100), got 3"
    );
}

#[test]
fn loader_bench_errors() {
    let e = LoaderBench::from_json_str("bench.json", "{\"points\": [").unwrap_err();
    assert!(
        e.to_string().starts_with("bench.json: malformed JSON"),
        "{e}"
    );
    let e = LoaderBench::from_json_str("bench.json", "{\"points\": []}").unwrap_err();
    assert_eq!(
        e.to_string(),
        "bench.json: points must be at least one measured point, got an empty list"
    );
    let e = LoaderBench::from_json_str(
        "bench.json",
        "{\"points\": [{\"num_workers\": -1, \"prefetch_factor\": 2, \"samples_per_s\": 5.0}]}",
    )
    .unwrap_err();
    assert!(e.to_string().contains("bench.json: malformed JSON"), "{e}");
}

/// Found by fuzzing (tests/fuzz.rs): a width of 2^63 - 1 overflowed `4 x hidden`; every
/// architecture dimension has an upper bound named in the error.
#[test]
fn architecture_dimensions_have_upper_bounds() {
    assert_eq!(
        err("model = { preset = \"gpt2-124m\", hidden = 9223372036854775807 }\nhardware = { preset = \"cpu\" }"),
        "model.hidden must be a positive integer up to 1048576, got 9223372036854775807"
    );
    assert_eq!(
        err("model = { layers = 100001, hidden = 128, heads = 4, vocab = 65 }\nhardware = { preset = \"cpu\" }"),
        "model.layers must be a positive integer up to 100000, got 100001"
    );
}

/// A parameter count beside a preset or an architecture was taken for the model states
/// while the activations and FLOPs followed the architecture (a "7B" gpt2-124m); a count
/// that is no whole number ("1.5") was rounded. Both are refused, naming the key.
#[test]
fn a_count_beside_a_preset_or_architecture_and_a_fractional_count_are_refused() {
    for (model, other) in [
        (
            "preset = \"gpt2-124m\", params = \"7B\"",
            "model.preset \"gpt2-124m\"",
        ),
        (
            "layers = 2, hidden = 64, heads = 4, vocab = 96, params = \"124M\"",
            "the architecture keys",
        ),
    ] {
        let e = err(&format!(
            "model = {{ {model} }}\nhardware = {{ preset = \"h100-80gb\" }}"
        ));
        assert!(
            e.contains("model.params (") && e.contains(other) && e.contains("Give one"),
            "{e}"
        );
    }
    assert_eq!(
        err("model = { params = \"1.5\" }\nhardware = { preset = \"cpu\" }"),
        "model.params must be a whole count, got 1.5"
    );
    // A count rounded by less than a millionth is the count.
    let r = resolved(
        "model = { params = \"1.2345678912B\" }\nhardware = { preset = \"cpu\" }\n\
         training = { global_batch = 8, seq_len = 128 }",
    )
    .unwrap();
    assert_eq!(r.model.params, 1_234_567_891);
}

/// On CPUs `memory_gib` is the host's memory, shared by its ranks (docs/plan.md): it
/// sets the host's figure too, which the trainer's dry run fits the ranks into (before:
/// the preset's 24 GiB whatever `memory_gib` said).
#[test]
fn on_a_cpu_memory_gib_is_the_host_s_memory() {
    let gib = (1u64 << 30) as f64;
    let r = resolved(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"cpu\", memory_gib = 5 }",
    )
    .unwrap();
    assert_eq!(
        (r.hardware.device_memory, r.hardware.host_memory),
        (5.0 * gib, 5.0 * gib)
    );
    let r = resolved(
        "model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"cpu\", memory_gib = 5, host_memory_gib = 7 }",
    )
    .unwrap();
    assert_eq!(r.hardware.host_memory, 7.0 * gib);
    // An accelerator's memory is its own.
    let r = resolved("model = { preset = \"gpt2-124m\" }\nhardware = { preset = \"a100-80gb\", memory_gib = 40 }")
        .unwrap();
    assert_eq!(r.hardware.device_memory, 40.0 * gib);
    assert!(r.hardware.host_memory > 100.0 * gib);
}

/// Offload without a strategy to apply it to was ignored; refused, naming the key.
#[test]
fn offload_without_a_strategy_is_refused() {
    let e = err(&format!(
        "{OK}training = {{ global_batch = 8, seq_len = 1024, offload_optimizer = true }}"
    ));
    assert!(
        e.starts_with("training.offload_optimizer: offload is an option of the strategy"),
        "{e}"
    );
    resolved(&format!(
        "{OK}training = {{ global_batch = 8, seq_len = 1024, offload_optimizer = false }}"
    ))
    .unwrap();
}
