//! Where every rank runs, exchanged at start, so that a rank that waits too long can
//! tell which peers on its host are gone, and the peer watcher knows whom to watch.

use std::sync::Arc;

/// One rank's machine and process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Peer {
    /// Hash of what makes pids comparable: host name, boot id, pid namespace.
    pub(super) host: u64,
    /// Hash of the machine alone (host name, boot id): ranks in separate pid namespaces
    /// of one machine still share its cores.
    pub(super) machine: u64,
    /// Its process id (in that pid namespace).
    pub(super) pid: u64,
}

/// A hash of this machine's identity as pids see it: host name, kernel boot id and pid
/// namespace (containers on one host may share a name and reuse each other's pids).
pub(super) fn host_key() -> u64 {
    let mut id = machine_id();
    if let Ok(ns) = std::fs::read_link("/proc/self/ns/pid") {
        id.push_str(&ns.to_string_lossy());
    }
    fnv1a(&id)
}

/// A hash of this machine alone: host name and kernel boot id.
pub(super) fn machine_key() -> u64 {
    fnv1a(&machine_id())
}

/// Host name and kernel boot id.
fn machine_id() -> String {
    let mut id = crate::launch::host_name();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    id.push_str(boot.trim());
    id
}

/// FNV-1a over `s`'s bytes.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// How many of `peers` run on the machine of `peers[rank]` (it included), whatever their
/// pid namespaces.
pub(super) fn on_machine_of(peers: &[Peer], rank: usize) -> usize {
    let here = peers[rank].machine;
    peers.iter().filter(|p| p.machine == here).count()
}

/// All ranks' `Peer`s, rank order.
pub(super) type Peers = Arc<Vec<Peer>>;

/// `(rank, pid)` of the other ranks whose processes this one can see.
pub(super) fn local(peers: &[Peer], me: usize) -> Vec<(usize, u64)> {
    let here = host_key();
    peers
        .iter()
        .enumerate()
        .filter(|(r, p)| *r != me && p.host == here)
        .map(|(r, p)| (r, p.pid))
        .collect()
}

/// Which peers are gone, for a timeout message: ranks on this host whose process no
/// longer exists; ranks elsewhere cannot be checked from here.
pub(super) fn lost(peers: &[Peer], me: usize) -> (Vec<usize>, String) {
    let mut gone = Vec::new();
    let locals = local(peers, me);
    let remote = peers.len() - 1 - locals.len();
    for (r, pid) in locals {
        // Only a positive pid_t names one process (0 and negatives name process groups or
        // every process): one that does not fit cannot be checked, so it is not called gone.
        let Some(pid) = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0) else {
            continue;
        };
        // SAFETY: kill(2) takes no pointers; signal 0 to one process (a positive pid,
        // checked above) only checks that it exists, no signal is sent.
        let alive = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            gone.push(r);
        }
    }
    let mut detail = match gone.as_slice() {
        [] => "every rank on this host is still running (one may be stuck or slower)".to_string(),
        l => format!(
            "rank(s) {l:?} are gone (pid {} no longer exists)",
            l.iter()
                .map(|&r| peers[r].pid.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    if remote > 0 {
        detail.push_str(&format!("; {remote} rank(s) on other hosts not checked"));
    }
    (gone, detail)
}

/// The error of a wait on rank `me` that ran `timeout` past its start: a lost rank when
/// one on this host is gone, a timeout naming the collective and bytes otherwise.
pub(super) fn timeout_error(
    op: crate::stats::Op,
    bytes: usize,
    (me, world): (usize, usize),
    timeout: std::time::Duration,
    peers: &[Peer],
) -> crate::error::CommError {
    use crate::error::CommError;
    let (gone, detail) = lost(peers, me);
    match gone.first() {
        Some(&l) => CommError::RankLost {
            op: op.name(),
            rank: me,
            lost: l,
            bytes,
            detail: format!("noticed after {:.1} s: {detail}", timeout.as_secs_f64()),
        },
        None => CommError::Timeout {
            op: op.name(),
            rank: me,
            world,
            bytes,
            after: timeout,
            detail,
        },
    }
}
