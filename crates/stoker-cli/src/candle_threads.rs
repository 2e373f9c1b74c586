//! Candle's own elementwise worker threads, sized to a rank's share of the cores.

/// Candle runs its elementwise CPU ops on spinning worker threads of its own (its "barrier
/// pool", sized from `CANDLE_NUM_THREADS`, else `RAYON_NUM_THREADS`, else every physical
/// core, when first used), apart from the rayon pool stoker sizes per rank: with several
/// ranks on one host each rank's candle workers spun beside the others' compute (2 ranks on
/// 2 cores: the graph path's step 747 ms, 198 ms with one thread each). Sets
/// `CANDLE_NUM_THREADS` to the rank's share of the cores unless the user set either
/// variable. Changing the environment races with any other thread reading it, so it is
/// done only while this process has one thread, checked here (`/proc/self/task`);
/// otherwise it says so and leaves candle as it is.
pub fn share_cores_with_candle(threads: usize) {
    if ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        return;
    }
    let tasks = std::fs::read_dir("/proc/self/task").map(|d| d.count());
    match tasks {
        Ok(1) => std::env::set_var("CANDLE_NUM_THREADS", threads.to_string()),
        other => eprintln!(
            "stoker: warning: candle's elementwise workers keep their default count ({} threads in this \
             process, so the environment cannot be changed safely); set CANDLE_NUM_THREADS={threads} \
             to give each rank its share of the cores",
            other.map_or("an unknown number of".into(), |n| n.to_string())
        ),
    }
}
