//! stoker-plan: the memory / communication / time model behind `stoker plan`.
#![deny(missing_docs)]
