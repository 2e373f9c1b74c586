//! The `device` config key: where the model's tensors live. `cpu` (the default) runs
//! everything in host memory. `cuda` (or `cuda:N`) puts the model's candle variables,
//! activations and gradients on a GPU and keeps the FP32 master weights, the optimizer
//! states and the optimizer step on the host ([`crate::offload`]): DeepSpeed's
//! `offload_optimizer`, FSDP's `CPUOffload`. Only builds with the `cuda` feature run it.

use candle_core::Device;

use crate::error::{config_err, Result};

/// A parsed `device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainDevice {
    /// Host memory, stoker's CPU kernels.
    Cpu,
    /// A CUDA GPU: `Some(n)` for `cuda:n`, `None` for `cuda` (the rank's index on its host).
    Cuda(Option<usize>),
}

impl TrainDevice {
    /// Parses the `device` key: `cpu`, `cuda` or `cuda:N`; anything else is an error
    /// naming the key.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            config_err(
                "device",
                format!("`{s}`: expected \"cpu\", \"cuda\" or \"cuda:N\" (N a GPU index)"),
            )
        };
        match s {
            "cpu" => Ok(TrainDevice::Cpu),
            "cuda" => Ok(TrainDevice::Cuda(None)),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse()
                    .map(|n| TrainDevice::Cuda(Some(n)))
                    .map_err(|_| bad())
            }
        }
    }

    /// Whether the model runs on a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, TrainDevice::Cuda(_))
    }

    /// The candle device for the rank whose index among the ranks of its host is
    /// `local_rank` (`cuda` alone takes GPU `local_rank`, one GPU per rank as `mpirun`
    /// and `torchrun` place them). Fails naming the key where this build has no CUDA or
    /// the GPU cannot be opened.
    pub fn open(self, local_rank: usize) -> Result<Device> {
        match self {
            TrainDevice::Cpu => Ok(Device::Cpu),
            TrainDevice::Cuda(n) => open_cuda(n.unwrap_or(local_rank)),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal)
        .map_err(|e| config_err("device", format!("opening CUDA GPU {ordinal}: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Device> {
    Err(not_compiled())
}

/// The error for a GPU device in a build without the `cuda` feature.
pub(crate) fn not_compiled() -> crate::error::TrainError {
    config_err(
        "device",
        "this build has no CUDA support and runs on \"cpu\" only: build with the `cuda` \
         feature (cargo build --release -p stoker-cli --features cuda; docs/zero.md, Offload)",
    )
}

/// This rank's index among the ranks on its host. Ranks that are threads of this process
/// (`launched` false) are all on it: `rank`. Ranks a launcher started: its variable
/// (MPICH's `MPI_LOCALRANKID`, Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK`, Slurm's
/// `SLURM_LOCALID`), else `rank` modulo the ranks on this host.
pub fn local_rank(rank: usize, ranks_on_this_host: usize, launched: bool) -> usize {
    if !launched {
        return rank;
    }
    [
        "MPI_LOCALRANKID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
    .unwrap_or(rank % ranks_on_this_host.max(1))
}

/// `RAYON_NUM_THREADS`, the user's size for every rank's compute pool: `None` when unset,
/// else a positive count. rayon itself reads `0` or a value that is not a number as "every
/// core", which would run each rank on all of them while stoker's banner and planner read
/// the value as given: refused instead, naming the variable.
pub fn rayon_threads_env() -> crate::Result<Option<usize>> {
    let Some(raw) = std::env::var_os("RAYON_NUM_THREADS") else {
        return Ok(None);
    };
    raw.to_str()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .map(Some)
        .ok_or_else(|| crate::TrainError::Environment {
            var: "RAYON_NUM_THREADS".into(),
            message: format!(
                "{raw:?}: expected a positive number of threads per rank (rayon would read it \
                 as every core); unset it, and stoker sizes each rank's pool from \
                 parallel.threads_per_rank, or shares the cores among the ranks"
            ),
        })
}

/// Compute threads for each of `ranks` ranks on this machine: `configured`, or the
/// cores divided among the ranks (at least 1).
pub fn threads_per_rank(configured: usize, ranks: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms_and_names_the_key_otherwise() {
        assert_eq!(TrainDevice::parse("cpu").unwrap(), TrainDevice::Cpu);
        assert_eq!(TrainDevice::parse("cuda").unwrap(), TrainDevice::Cuda(None));
        assert_eq!(
            TrainDevice::parse("cuda:3").unwrap(),
            TrainDevice::Cuda(Some(3))
        );
        for bad in ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1"] {
            let e = TrainDevice::parse(bad).unwrap_err().to_string();
            assert!(e.contains("`device`") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn threads_are_all_on_this_host_and_launched_ranks_ask_the_launcher() {
        assert_eq!(local_rank(3, 1, false), 3);
        let vars = [
            "MPI_LOCALRANKID",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "SLURM_LOCALID",
        ];
        if vars.iter().all(|v| std::env::var(v).is_err()) {
            assert_eq!(local_rank(5, 2, true), 1);
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_refuses_to_open_a_gpu() {
        let e = TrainDevice::Cuda(Some(0)).open(0).unwrap_err().to_string();
        assert!(
            e.contains("`device`") && e.contains("`cuda`") && e.contains("CUDA"),
            "{e}"
        );
        assert!(TrainDevice::Cpu.open(5).unwrap().is_cpu());
    }
}
