//! stoker-precision: number formats, loss scaling, FP8 delayed scaling and the autocast policy.
#![deny(missing_docs)]
