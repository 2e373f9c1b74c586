//! stoker-train: the trainer.
#![deny(missing_docs)]
