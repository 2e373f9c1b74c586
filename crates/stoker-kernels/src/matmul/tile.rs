//! The kernels that compute one 32 x 32 block of `C` from packed operands, over the whole
//! inner dimension: AMX tiles, AVX512-BF16 registers, or portable Rust.

use super::pack::{PackedA, PackedB, PANEL, ROW_BLOCK};

/// Edge of the `C` block every kernel computes.
pub(crate) const BLOCK: usize = 32;
const _: () = assert!(BLOCK == ROW_BLOCK && BLOCK == 2 * PANEL);

/// One `C` block in f32, row-major `BLOCK x BLOCK`.
pub(crate) type Block = [f32; BLOCK * BLOCK];

/// Rows of the AVX512 / portable register tile.
const MR: usize = 8;

/// The portable kernel: `vdpbf16ps`'s arithmetic (per pair, the odd product then the even
/// one, each sum rounded in f32) over 8-row tiles.
pub(crate) fn block_portable(a: &PackedA, b: &PackedB, rb: usize, q: usize, out: &mut Block) {
    let lo = |w: u32| f32::from_bits(w << 16);
    let hi = |w: u32| f32::from_bits(w & 0xFFFF_0000);
    let pairs = a.pairs;
    let (b0, b1) = (
        &b.words[q * 2 * pairs * PANEL..],
        &b.words[(q * 2 + 1) * pairs * PANEL..],
    );
    for t in 0..BLOCK / MR {
        let mut acc = [[0f32; BLOCK]; MR];
        for p in 0..pairs {
            let (bp0, bp1) = (
                &b0[p * PANEL..(p + 1) * PANEL],
                &b1[p * PANEL..(p + 1) * PANEL],
            );
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = a.words[(rb * BLOCK + t * MR + r) * pairs + p];
                let (a0, a1) = (lo(w), hi(w));
                let (s0, s1) = acc.split_at_mut(PANEL);
                for (s, bp) in [(s0, bp0), (s1, bp1)] {
                    for (s, &bw) in s.iter_mut().zip(bp) {
                        *s += a1 * hi(bw);
                        *s += a0 * lo(bw);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            out[(t * MR + r) * BLOCK..(t * MR + r + 1) * BLOCK].copy_from_slice(acc);
        }
    }
}

/// The AVX512-BF16 kernel: 8 x 32 register tiles of `vdpbf16ps`.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn block_avx512(a: &PackedA, b: &PackedB, rb: usize, q: usize, out: &mut Block) {
    use std::arch::x86_64::*;
    let pairs = a.pairs;
    let a_rows = &a.words[rb * BLOCK * pairs..(rb + 1) * BLOCK * pairs];
    let b0 = &b.words[q * 2 * pairs * PANEL..(q * 2 + 1) * pairs * PANEL];
    let b1 = &b.words[(q * 2 + 1) * pairs * PANEL..(q * 2 + 2) * pairs * PANEL];
    for t in 0..BLOCK / MR {
        let ap = a_rows[t * MR * pairs..].as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for p in 0..pairs {
            // SAFETY: p < pairs; each panel slice holds pairs x PANEL words and each of
            // the MR rows of this tile holds pairs words.
            let v0: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(b0.as_ptr().add(p * PANEL) as *const _));
            let v1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(b1.as_ptr().add(p * PANEL) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = *ap.add(r * pairs + p);
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(w as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], av, v0);
                acc[1] = _mm512_dpbf16_ps(acc[1], av, v1);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let o = out.as_mut_ptr().add((t * MR + r) * BLOCK);
            _mm512_storeu_ps(o, acc[0]);
            _mm512_storeu_ps(o.add(16), acc[1]);
        }
    }
}

/// AMX: tiles 0-3 hold the four 16 x 16 quarters of `C`, 4-5 two 16-row slices of `A`,
/// 6-7 two 16-column panels of `B`; one `tdpbf16ps` per quarter per 32 inner elements.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod amx {
    use std::arch::asm;
    use std::marker::PhantomData;

    use super::{Block, PackedA, PackedB, BLOCK, PANEL};
    use crate::matmul::pack::PAIR_BLOCK;
    use crate::matmul::Bf16Kernel;

    // A tile row is 64 bytes: 16 words of a packed `A` row chunk, 16 columns of a `B` panel.
    const _: () = assert!(PAIR_BLOCK == 16 && PANEL == 16 && BLOCK == 32);

    /// The 64-byte tile configuration: palette 1, eight tiles of 16 rows x 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    const CONFIG: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        TileConfig(c)
    };

    /// Asks Linux for permission to use AMX tile data in this process; true if granted.
    pub(crate) fn request_permission() -> bool {
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes this process's
        // permitted xsave features; it reads no memory of ours.
        unsafe {
            asm!("syscall",
                inlateout("rax") SYS_ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _, lateout("r11") _,
                options(nostack));
        }
        ret == 0
    }

    /// Holds this thread's tile configuration; releases the tiles when dropped. Not
    /// `Send`: the configuration belongs to the thread that loaded it.
    pub(crate) struct Tiles(PhantomData<*const ()>);

    impl Tiles {
        /// Loads the tile configuration on this thread, where the CPU has AMX-TILE and
        /// AMX-BF16 and Linux granted the tile state (the kernel detection, checked here);
        /// None elsewhere.
        pub(crate) fn configure() -> Option<Tiles> {
            if !Bf16Kernel::supported().contains(&Bf16Kernel::Amx) {
                return None;
            }
            // SAFETY: checked just above: the CPU has AMX and the process may use its
            // tile state; CONFIG is a valid 64-byte palette-1 configuration.
            unsafe {
                asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
            }
            Some(Tiles(PhantomData))
        }

        /// One `C` block over the whole inner dimension.
        pub(crate) fn block(&self, a: &PackedA, b: &PackedB, rb: usize, q: usize, out: &mut Block) {
            let pairs = a.pairs;
            // The tile loads below read 16-word chunks of each row: whole chunks only.
            assert!(
                pairs.is_multiple_of(PAIR_BLOCK) && b.pairs == pairs,
                "packed operands: A has {pairs} pairs per row, B {}; both must be equal \
                 multiples of {PAIR_BLOCK}",
                b.pairs
            );
            let a_rows = &a.words[rb * BLOCK * pairs..(rb + 1) * BLOCK * pairs];
            let b0 = &b.words[q * 2 * pairs * PANEL..(q * 2 + 1) * pairs * PANEL];
            let b1 = &b.words[(q * 2 + 1) * pairs * PANEL..(q * 2 + 2) * pairs * PANEL];
            let a_stride = pairs * 4;
            let b_stride = PANEL * 4;
            let c_stride = BLOCK * 4;
            // SAFETY: tiles are configured on this thread (self exists and is not Send);
            // every load reads 16 rows of 64 bytes inside the slices above (pairs is a
            // multiple of PAIR_BLOCK, asserted above, so chunk c's 16 words end at or before
            // the row's end, and B's panel rows are PANEL = 16 words), and the stores write
            // 16 rows of 64 bytes inside `out` (32 x 32 floats).
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
                for c in (0..pairs).step_by(PAIR_BLOCK) {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {sb}*1]",
                        "tileloadd tmm7, [{b1} + {sb}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a_rows.as_ptr().add(c),
                        a1 = in(reg) a_rows.as_ptr().add(16 * pairs + c),
                        b0 = in(reg) b0.as_ptr().add(c * PANEL),
                        b1 = in(reg) b1.as_ptr().add(c * PANEL),
                        sa = in(reg) a_stride,
                        sb = in(reg) b_stride,
                        options(nostack, readonly),
                    );
                }
                let o = out.as_mut_ptr();
                asm!(
                    "tilestored [{c0} + {sc}*1], tmm0",
                    "tilestored [{c1} + {sc}*1], tmm1",
                    "tilestored [{c2} + {sc}*1], tmm2",
                    "tilestored [{c3} + {sc}*1], tmm3",
                    c0 = in(reg) o,
                    c1 = in(reg) o.add(16),
                    c2 = in(reg) o.add(16 * BLOCK),
                    c3 = in(reg) o.add(16 * BLOCK + 16),
                    sc = in(reg) c_stride,
                    options(nostack),
                );
            }
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: the tiles were configured by this thread (Tiles is not Send).
            unsafe { asm!("tilerelease", options(nostack, nomem)) }
        }
    }
}
