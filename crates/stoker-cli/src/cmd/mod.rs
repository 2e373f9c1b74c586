//! One module per subcommand.
pub mod bench;
pub mod bench_comm;
pub mod bench_ddp;
pub mod bench_gpu;
pub mod ckpt;
pub mod dataset_args;
pub mod export;
pub mod pack;
pub mod plan;
pub mod report;
pub mod train;
pub mod train_report;
pub mod tune;
pub mod tune_write;
