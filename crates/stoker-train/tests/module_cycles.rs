//! stoker-train's modules are layered: no module reaches back to one that reaches it
//! (`crate::` paths read from the source by `stoker_testkit::module_cycles`). The cycles
//! that were broken: config <-> parallel (the batch arithmetic now lives in the config),
//! config <-> models (the model config and its factory in `models`), layout <-> params
//! (the variable copies in `vars`), trainer -> hf -> checkpoint -> trainer (the synced
//! writes in `model_files`), and calibrate <-> profile -> run (one `machine` module; the
//! compute threads in `device`).

#[test]
fn stoker_train_has_no_module_cycles() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let cycles = stoker_testkit::module_cycles(&src);
    assert!(
        cycles.is_empty(),
        "module cycles in stoker-train: {cycles:#?}"
    );
}
