//! What the launcher announced, read from the environment before any MPI call.

/// Which launcher started this process and the world size it announced (MPICH's Hydra
/// and Slurm's PMI set `PMI_SIZE`, Open MPI `OMPI_COMM_WORLD_SIZE`, PMIx `PMIX_SIZE`,
/// Slurm `SLURM_NTASKS`); None outside a launcher.
pub fn launched_world() -> Option<(String, usize)> {
    for (var, name) in [
        ("PMI_SIZE", "mpiexec (PMI)"),
        ("OMPI_COMM_WORLD_SIZE", "Open MPI mpirun"),
        ("PMIX_SIZE", "PMIx launcher"),
        ("SLURM_NTASKS", "srun"),
    ] {
        if let Some(n) = std::env::var(var).ok().and_then(|v| v.trim().parse().ok()) {
            return Some((name.to_string(), n));
        }
    }
    None
}

/// How many of the job's ranks the launcher started on this host (MPICH's Hydra sets
/// `MPI_LOCALNRANKS`, Open MPI `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm
/// `SLURM_NTASKS_PER_NODE`); None outside a launcher or where it does not say.
pub fn local_ranks() -> Option<usize> {
    [
        "MPI_LOCALNRANKS",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// This machine's host name (for messages that say where a rank runs).
pub fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes to `name`, a live local array of
    // that length (truncating, possibly without a NUL, which the search below handles).
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    if rc != 0 {
        return "(unknown host)".into();
    }
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}
