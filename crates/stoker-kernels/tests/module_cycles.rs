//! stoker-kernels' modules are layered: no module reaches back to one that reaches it
//! (`crate::` paths read from the source by `stoker_testkit::module_cycles`). The Llama's
//! step builds on the GPT's pieces; the trait both implement sits above both.

#[test]
fn stoker_kernels_has_no_module_cycles() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let cycles = stoker_testkit::module_cycles(&src);
    assert!(
        cycles.is_empty(),
        "module cycles in stoker-kernels: {cycles:#?}"
    );
}
