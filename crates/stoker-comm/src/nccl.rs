//! The NCCL backend (feature `cuda`): placeholder until the next commit.
