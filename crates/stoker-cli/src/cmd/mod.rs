//! One module per subcommand.
pub mod bench;
pub mod dataset_args;
pub mod pack;
pub mod plan;
pub mod report;
pub mod train;
pub mod tune;
