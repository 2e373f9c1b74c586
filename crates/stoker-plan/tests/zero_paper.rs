//! The ZeRO paper's Figure 1 (arXiv 1910.02054): 7.5B parameters, 64 devices, mixed-precision
//! Adam: 120 / 31.4 / 16.6 / 1.9 GB of model states per device for DDP / ZeRO-1/2/3.

mod common;

use common::{r1, resolved};
use stoker_plan::hardware::GB;
use stoker_plan::memory;
use stoker_plan::strategy::{Stage, Strategy};

const CLUSTER_64: &str = r#"
[model]
params = "7.5B"
[hardware]
devices_per_node = 8
nodes = 8
memory_gib = 80
peak_tflops = { bf16 = 312, fp32 = 19.5 }
intra_node_gbyte_s = 240
inter_node_gbit_s = 1600
[training]
global_batch = 64
seq_len = 1024
"#;

fn model_states_gb(extra: &str, stage: Stage) -> f64 {
    let r = resolved(&format!("{CLUSTER_64}{extra}")).unwrap();
    let m = memory::estimate(&r.model, &r.hardware, &r.setup, Strategy::plain(stage), 1);
    m.device.model_states() / GB
}

#[test]
fn figure_1_mixed_precision_adam_7_5b_on_64_devices() {
    // 16P, 4P + 12P/64, 2P + 14P/64, 16P/64 with P = 7.5e9.
    assert_eq!(r1(model_states_gb("", Stage::Ddp)), 120.0);
    assert_eq!(r1(model_states_gb("", Stage::Zero1)), 31.4);
    assert_eq!(r1(model_states_gb("", Stage::Zero2)), 16.6);
    assert_eq!(r1(model_states_gb("", Stage::Zero3)), 1.9);
}

#[test]
fn figure_1_holds_for_fp16_and_fp8_too() {
    // fp16 and fp8 recipes keep 16-bit weights/gradients and fp32 master + moments (fp8 on
    // this custom device, which has no fp8, falls back to bf16: the same bytes).
    for p in ["fp16", "fp8"] {
        let text = CLUSTER_64.replace(
            "seq_len = 1024",
            &format!("seq_len = 1024\nprecision = \"{p}\""),
        );
        let r = resolved(&text).unwrap();
        let m = memory::estimate(
            &r.model,
            &r.hardware,
            &r.setup,
            Strategy::plain(Stage::Zero1),
            1,
        );
        assert_eq!(r1(m.device.model_states() / GB), 31.4, "{p}");
    }
}

#[test]
fn fp32_adam_is_also_16_bytes_but_split_4_4_8() {
    let r = resolved(&CLUSTER_64.replace("seq_len = 1024", "seq_len = 1024\nprecision = \"fp32\""))
        .unwrap();
    let m = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::plain(Stage::Ddp),
        1,
    );
    assert_eq!(r1(m.device.params / GB), 30.0);
    assert_eq!(r1(m.device.grads / GB), 30.0);
    assert_eq!(r1(m.device.optimizer / GB), 60.0);
    // ZeRO-1 shards only the 8 moment bytes: 8P + 8P/64.
    let z1 = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::plain(Stage::Zero1),
        1,
    );
    assert_eq!(r1(z1.device.model_states() / GB), 60.9);
}

#[test]
fn pure_bf16_adam_is_8_bytes_and_sgd_drops_a_moment() {
    let r = resolved(&CLUSTER_64.replace(
        "seq_len = 1024",
        "seq_len = 1024\nprecision = \"bf16-pure\"",
    ))
    .unwrap();
    let m = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::plain(Stage::Ddp),
        1,
    );
    assert_eq!(r1(m.device.model_states() / GB), 60.0); // 2 + 2 + 4 bytes
    let r = resolved(&CLUSTER_64.replace("seq_len = 1024", "seq_len = 1024\noptimizer = \"sgd\""))
        .unwrap();
    let m = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::plain(Stage::Ddp),
        1,
    );
    assert_eq!(r1(m.device.model_states() / GB), 90.0); // 2 + 2 + (4 master + 4 momentum)
}

#[test]
fn optimizer_offload_moves_16_bytes_per_parameter_to_the_hosts() {
    // ZeRO-2 + offload: 2P of 16-bit weights stay on the device; each node's host keeps its 8
    // ranks' shards of fp32 master + moments + fp32 gradients: 8 x 16P/64 = 15 GB.
    let r = resolved(CLUSTER_64).unwrap();
    let m = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::offload(Stage::Zero2),
        1,
    );
    assert_eq!(r1(m.device.model_states() / GB), 15.0);
    assert_eq!(r1(m.host.needed / GB), 15.0);
    // DDP + offload (in the table, never recommended): 4P on the device, and every rank keeps
    // the whole 16P on the host: 8 x 120 GB per node.
    let m = memory::estimate(
        &r.model,
        &r.hardware,
        &r.setup,
        Strategy::offload(Stage::Ddp),
        1,
    );
    assert_eq!(r1(m.device.model_states() / GB), 30.0);
    assert_eq!(r1(m.host.needed / GB), 960.0);
}
