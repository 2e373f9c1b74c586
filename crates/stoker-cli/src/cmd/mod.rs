//! One module per subcommand.
pub mod bench;
pub mod pack;
pub mod plan;
pub mod tune;
