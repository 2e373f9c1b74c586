//! glibc takes every setting of `keep_freed_memory`, and memory freed afterwards serves the
//! next allocation of another size. One test in its own binary: no other test thread
//! allocates in between.

use stoker_train::malloc_tuning::{keep_freed_memory, MallocTuning};

#[test]
fn glibc_keeps_freed_memory_for_the_next_block_of_any_size() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        assert!(
            !std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")),
            "GLIBC_TUNABLES sets malloc in this test's environment: unset it to run the test"
        );
        assert_eq!(keep_freed_memory(), MallocTuning::Set);
        // 8 MiB is above glibc's default threshold (128 KiB): by default its own mapping,
        // unmapped when freed. Kept, the freed block serves the next, smaller one.
        let a = vec![1u8; 8 << 20];
        let p = std::hint::black_box(&a).as_ptr() as usize;
        drop(a);
        let b = vec![2u8; 6 << 20];
        assert_eq!(std::hint::black_box(&b).as_ptr() as usize, p);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    assert_eq!(keep_freed_memory(), MallocTuning::NotGlibc);
}
