//! stoker-gpu's modules are layered (`crate::` paths read from the source by
//! `stoker_testkit::module_cycles`): launches as data at the bottom, then backends, then
//! the checked kernels and products, then the step and the checks on top.

#[test]
fn stoker_gpu_has_no_module_cycles() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let cycles = stoker_testkit::module_cycles(&src);
    assert!(
        cycles.is_empty(),
        "module cycles in stoker-gpu: {cycles:#?}"
    );
}
