//! What the launcher announced, read from the environment before any MPI call.

/// Which launcher started this process and the world size it announced (MPICH's Hydra
/// and Slurm's PMI set `PMI_SIZE`, Open MPI `OMPI_COMM_WORLD_SIZE`, PMIx `PMIX_SIZE`,
/// Slurm's `srun` `SLURM_STEP_NUM_TASKS`); None outside a launcher. Not `SLURM_NTASKS`:
/// an sbatch script's own shell has it too, and a `stoker` started there without `srun`
/// is one process, not the allocation's N.
pub fn launched_world() -> Option<(String, usize)> {
    // Slurm's PMI server sets PMI_SIZE too; Hydra alone sets MPI_LOCALNRANKS.
    let slurm_pmi = std::env::var_os("MPI_LOCALNRANKS").is_none()
        && std::env::var_os("SLURM_STEP_ID").is_some();
    let pmi = if slurm_pmi {
        "srun (PMI)"
    } else {
        "mpiexec (PMI)"
    };
    for (var, name) in [
        ("PMI_SIZE", pmi),
        ("OMPI_COMM_WORLD_SIZE", "Open MPI mpirun"),
        ("PMIX_SIZE", "PMIx launcher"),
        ("SLURM_STEP_NUM_TASKS", "srun"),
    ] {
        if let Some(n) = std::env::var(var).ok().and_then(|v| v.trim().parse().ok()) {
            return Some((name.to_string(), n));
        }
    }
    None
}

/// How many of the job's ranks the launcher started on this host (MPICH's Hydra sets
/// `MPI_LOCALNRANKS`, Open MPI `OMPI_COMM_WORLD_LOCAL_SIZE`, Slurm's `srun`
/// `SLURM_STEP_TASKS_PER_NODE` read at this node's `SLURM_NODEID`); None outside a
/// launcher or where it does not say.
pub fn local_ranks() -> Option<usize> {
    let var = |name: &str| std::env::var(name).ok();
    ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"]
        .iter()
        .find_map(|v| var(v)?.trim().parse().ok())
        .or_else(|| {
            let node = var("SLURM_NODEID")?.trim().parse().ok()?;
            slurm_tasks_on_node(&var("SLURM_STEP_TASKS_PER_NODE")?, node)
        })
}

/// The tasks Slurm placed on node `node` (0-based), from its compressed per-node list:
/// `"2(x3),1"` means 2 tasks on each of nodes 0-2 and 1 on node 3. None where the list
/// is malformed or shorter than `node`.
pub fn slurm_tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut first = 0;
    for group in spec.split(',') {
        let group = group.trim();
        let (tasks, repeat) = match group.split_once("(x") {
            Some((tasks, rest)) => (tasks, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (group, 1),
        };
        let tasks: usize = tasks.parse().ok()?;
        if node < first + repeat {
            return Some(tasks);
        }
        first += repeat;
    }
    None
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_s_compressed_task_lists_expand_per_node() {
        assert_eq!(slurm_tasks_on_node("2", 0), Some(2));
        assert_eq!(slurm_tasks_on_node("2", 1), None);
        for (node, want) in [(0, 2), (2, 2), (3, 1), (4, 4)] {
            assert_eq!(
                slurm_tasks_on_node("2(x3),1,4", node),
                Some(want),
                "node {node}"
            );
        }
        assert_eq!(slurm_tasks_on_node("2(x3),1,4", 5), None);
        for bad in ["", "x", "2(x", "2(xq)", "2(x3"] {
            assert_eq!(slurm_tasks_on_node(bad, 0), None, "{bad:?}");
        }
    }
}
