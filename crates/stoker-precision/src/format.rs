//! Element dtypes the engine moves between.

/// A floating-point element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (f32's exponent, 7 mantissa bits).
    BF16,
    /// FP8 E4M3FN.
    F8E4M3,
    /// FP8 E5M2.
    F8E5M2,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
        }
    }

    /// Lowercase name (`"f32"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
            Dtype::F8E4M3 => "f8e4m3",
            Dtype::F8E5M2 => "f8e5m2",
        }
    }

    /// Promotion order: f32 > f16 = bf16 > FP8.
    pub(crate) const fn rank(self) -> u8 {
        match self {
            Dtype::F32 => 3,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
        }
    }

    /// The dtype two inputs promote to (f16 with bf16 gives f32, as torch).
    pub fn promote(self, other: Dtype) -> Dtype {
        if self == other {
            self
        } else if self.rank() == other.rank() {
            Dtype::F32
        } else if self.rank() > other.rank() {
            self
        } else {
            other
        }
    }
}
