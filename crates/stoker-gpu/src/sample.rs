//! Seeded inputs (splitmix64), the same on every machine: the tests' and the device
//! check's random buffers.

/// `n` values uniform in `[-scale, scale)` from seed `seed`.
pub fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `n` ids in `0..limit` from seed `seed`.
pub fn ids(n: usize, seed: u64, limit: usize) -> Vec<i32> {
    uniform(n, seed, 1.0)
        .iter()
        .map(|&u| (((u + 1.0) * 0.5 * limit as f32) as usize).min(limit - 1) as i32)
        .collect()
}
