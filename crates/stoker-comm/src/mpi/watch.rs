//! Notices at once when a peer process on this host dies, and says which rank it was.
//!
//! A rank killed by a signal leaves its peers waiting in a collective. MPICH's launcher
//! then kills every other rank too, naming only the dead process's pid, and other
//! launchers (Slurm without `--kill-on-bad-exit`) leave them waiting until the
//! collective timeout. This thread holds a Linux pidfd of every other rank on this host
//! and wakes the moment one exits: it prints which rank died and ends this process, so
//! the job ends with a message that names the lost rank either way. A clean shutdown
//! disarms it first (see `MpiComm::finalize`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The watching thread's switch; dropping it does not stop the thread, [`Watch::disarm`]
/// does.
pub(super) struct Watch {
    armed: Arc<AtomicBool>,
}

impl Watch {
    /// Watches `peers` (`(rank, pid)` on this host) on behalf of rank `me` of `world`.
    /// Without pidfd support (Linux before 5.3) nothing is watched and the collective
    /// timeout remains the only guard.
    pub(super) fn start(me: usize, world: usize, peers: Vec<(usize, u64)>) -> Watch {
        let armed = Arc::new(AtomicBool::new(true));
        let fds: Vec<(usize, u64, OwnedFd)> = peers
            .into_iter()
            .filter_map(|(rank, pid)| pidfd(pid).map(|fd| (rank, pid, fd)))
            .collect();
        if !fds.is_empty() {
            let flag = armed.clone();
            std::thread::Builder::new()
                .name("stoker-peer-watch".into())
                .spawn(move || watch(me, world, fds, flag))
                .expect("spawning the peer watcher");
        }
        Watch { armed }
    }

    /// Stops reporting deaths (a clean shutdown is under way).
    pub(super) fn disarm(&self) {
        self.armed.store(false, Ordering::SeqCst);
    }
}

/// A pidfd of process `pid` (Linux 5.3+), or None.
fn pidfd(pid: u64) -> Option<OwnedFd> {
    // A pid that does not fit a positive pid_t names no process (and must not wrap into
    // 0 or a negative value, which mean other things to the kernel).
    let pid = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0)?;
    // SAFETY: pidfd_open takes a pid and flags (no pointers) and returns a new descriptor
    // or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // A descriptor is a non-negative int; anything else is an error.
    let fd = RawFd::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` was just returned by pidfd_open (checked to be a descriptor), is open,
    // and nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn watch(me: usize, world: usize, fds: Vec<(usize, u64, OwnedFd)>, armed: Arc<AtomicBool>) {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|(_, _, fd)| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let count = libc::nfds_t::try_from(polls.len()).expect("a few descriptors");
    while armed.load(Ordering::SeqCst) {
        // SAFETY: `polls` holds `count` pollfd (its length, converted with a check, and it
        // never grows) for poll to read and write; the descriptors stay open (owned by
        // `fds`) for the whole loop, and poll ignores the ones set to -1.
        let n = unsafe { libc::poll(polls.as_mut_ptr(), count, 500) };
        if n <= 0 || !armed.load(Ordering::SeqCst) {
            continue;
        }
        // A descriptor that errs without saying the process exited is dropped from the
        // watch (poll skips negative descriptors), so the loop never spins on it.
        for p in polls.iter_mut() {
            if p.revents & libc::POLLIN == 0
                && p.revents & (libc::POLLERR | libc::POLLNVAL | libc::POLLHUP) != 0
            {
                p.fd = -1;
            }
        }
        if polls.iter().all(|p| p.fd < 0) {
            return;
        }
        // Every peer found gone in this wake-up, not the lowest alone: the one killed
        // first may take others with it (a transport that aborts when its peer's memory
        // vanishes), and which came first the kernel does not say.
        let dead: Vec<String> = polls
            .iter()
            .zip(&fds)
            .filter(|(p, _)| p.revents & libc::POLLIN != 0)
            .map(|(_, (rank, pid, _))| format!("rank {rank} (pid {pid}, this host)"))
            .collect();
        if !dead.is_empty() {
            let verb = if dead.len() == 1 {
                "died"
            } else {
                "died at once"
            };
            // One write: the launcher may kill this process any moment now.
            crate::say(&format!(
                "stoker: rank {me} of {world}: {} {verb} in the middle of the job; ending this rank",
                dead.join(" and ")
            ));
            std::thread::sleep(Duration::from_millis(200));
            if armed.load(Ordering::SeqCst) {
                // SAFETY: _exit(2) has no preconditions; it ends the process at once (no MPI
                // call from this thread).
                unsafe { libc::_exit(1) };
            }
            return;
        }
    }
}
