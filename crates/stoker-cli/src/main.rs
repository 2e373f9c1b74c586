//! `stoker`: the command-line front end of the stoker training engine.

mod candle_threads;
mod cmd;
mod error_kind;
mod error_text;
mod heap;
mod machine_profile;

use clap::{Parser, Subcommand};

/// glibc's malloc, told to keep and reuse what is freed (`main` sets it first thing,
/// `stoker_train::malloc_tuning`): candle allocates every activation and gradient afresh
/// each step. Counted (heap.rs), so that runs can report the bytes they really hold.
#[global_allocator]
static ALLOC: heap::CountingAllocator = heap::CountingAllocator::new(heap::Allocator);

/// stoker keeps accelerators fed: data loading, precision, distribution.
#[derive(Parser)]
#[command(name = "stoker", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert raw data into stoker's memory-mappable formats: idx, text, docs, images.
    Pack(cmd::pack::PackArgs),
    /// Measure a component against a baseline: loader, comm, ddp, gpu-kernels.
    Bench(cmd::bench::BenchArgs),
    /// Search settings for a throughput target: loader.
    Tune(cmd::tune::TuneArgs),
    /// Predict memory, communication and step time per strategy and recommend one.
    Plan(Box<cmd::plan::PlanArgs>),
    /// Train a model from a TOML config.
    Train(cmd::train::TrainArgs),
    /// Plot a training run's metrics to PNG files.
    Report(cmd::report::ReportArgs),
    /// Work with checkpoints: consolidate, verify.
    Ckpt(cmd::ckpt::CkptArgs),
    /// Export a trained model to another framework's format: hf.
    Export(cmd::export::ExportArgs),
}

/// Runs the command; a failure prints one line, `error[KIND]: what: why: ...` (the kind from
/// [`error_kind::ErrorKind`], then the whole chain of causes), and exits with status 1.
fn main() -> std::process::ExitCode {
    let malloc = heap::keep_freed_memory();
    heap::no_transparent_huge_pages();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a job's log file (Slurm's, a redirect) gets plain
        // text, as NO_COLOR gives.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let stoker_train::malloc_tuning::MallocTuning::Refused(what) = malloc {
        tracing::warn!("glibc refused the malloc setting {what}: freed memory may go back to the kernel and fault in again every step");
    }
    quiet_guarded_panics();
    let command = match Cli::try_parse() {
        Ok(cli) => cli.command,
        Err(e) => return refused_command_line(e),
    };
    if command.writes_for_a_pipe() {
        default_sigpipe();
    }
    // Every command computes on rayon's pool; an unusable size is refused before any.
    let result = match stoker_train::device::rayon_threads_env() {
        Err(e) => Err(e.into()),
        Ok(_) => match command {
            Command::Pack(a) => cmd::pack::run(a),
            Command::Bench(a) => cmd::bench::run(a),
            Command::Tune(a) => cmd::tune::run(a),
            Command::Plan(a) => cmd::plan::run(*a),
            Command::Train(a) => cmd::train::run(a),
            Command::Report(a) => cmd::report::run(a),
            Command::Ckpt(a) => cmd::ckpt::run(a),
            Command::Export(a) => cmd::export::run(a),
        },
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One write: under a launcher every rank may print the same error at once, and
            // eprintln!'s pieces interleaved into "error[error[config]: ...".
            stoker_comm::say(&format!(
                "error[{}]: {}",
                error_kind::ErrorKind::of(&e).name(),
                error_text::chain_text(&e)
            ));
            std::process::ExitCode::FAILURE
        }
    }
}

/// A command line clap refuses, said as stoker's own usage errors are (`error[usage]: ...`,
/// its usage lines and hint kept below it; before, clap's plain `error: ...`), with clap's
/// exit status 2. Help and version are printed as clap prints them.
fn refused_command_line(e: clap::Error) -> std::process::ExitCode {
    use clap::error::ErrorKind as Kind;
    if matches!(
        e.kind(),
        Kind::DisplayHelp | Kind::DisplayVersion | Kind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit()
    }
    let text = e.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    stoker_comm::say(&format!("error[usage]: {}", text.trim_end()));
    std::process::ExitCode::from(2)
}

impl Command {
    /// Whether this command only writes what a pipe may close early (`stoker pack ... |
    /// head`): not a training run or a benchmark, whose MPI sockets keep Rust's ignored
    /// SIGPIPE so that a peer that dies is an error, not a signal.
    fn writes_for_a_pipe(&self) -> bool {
        matches!(
            self,
            Command::Pack(_)
                | Command::Plan(_)
                | Command::Tune(_)
                | Command::Report(_)
                | Command::Ckpt(_)
                | Command::Export(_)
        )
    }
}

/// SIGPIPE back to its default, as other Unix tools have it: a reader that closes the
/// pipe ends the process quietly, where Rust's ignored SIGPIPE would make the next print
/// panic ("failed printing to stdout: Broken pipe").
fn default_sigpipe() {
    // SAFETY: `signal` with a valid signal number and SIG_DFL only restores the default
    // disposition; this runs on the main thread before any other thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// The default panic hook, except for a damaged Parquet file's panic inside the reader:
/// stoker-data turns that into an error naming the file, which is all the user needs.
fn quiet_guarded_panics() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !stoker_data::pack::doc_sources::panicking_in_guarded_read() {
            default_hook(info);
        }
    }));
}
