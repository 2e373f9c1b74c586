//! The timeout of a blocking collective.
//!
//! Blocking collectives call MPI's own blocking functions (whose algorithms MPICH tunes
//! best; its non-blocking forms are slower at some sizes). MPI cannot interrupt them, so a
//! thread watches the clock instead: it is armed with the collective, its bytes and a
//! deadline before each call and disarmed after. Past the deadline it prints the timeout
//! (naming the collective, the rank, the bytes and which peers on this host are gone)
//! and ends the process, which makes the launcher end the job. It makes no MPI call
//! (MPI is initialized for the main thread only).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::peers::{timeout_error, Peers};
use crate::stats::Op;

/// How often the watching thread looks at the clock.
const TICK: Duration = Duration::from_millis(50);

/// What the armed call is.
#[derive(Clone, Copy)]
struct Armed {
    op: Op,
    bytes: usize,
    started: Instant,
    timeout: Duration,
}

/// The switch of the watching thread.
pub(super) struct Watchdog {
    armed: Arc<Mutex<Option<Armed>>>,
}

impl Watchdog {
    /// Starts the watching thread for rank `me` of `world`.
    pub(super) fn start(me: usize, world: usize, peers: Peers) -> Watchdog {
        let armed: Arc<Mutex<Option<Armed>>> = Arc::new(Mutex::new(None));
        let slot = armed.clone();
        std::thread::Builder::new()
            .name("stoker-mpi-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(TICK);
                let a = *slot.lock().unwrap_or_else(|e| e.into_inner());
                let Some(a) = a else { continue };
                if a.started.elapsed() < a.timeout {
                    continue;
                }
                let e = timeout_error(a.op, a.bytes, (me, world), a.timeout, &peers);
                crate::say(&format!(
                    "stoker: rank {me} of {world}: {e}; ending the job"
                ));
                // Let the launcher forward the line, then end this process (the launcher
                // ends the others: this rank never finalized).
                std::thread::sleep(Duration::from_millis(500));
                // SAFETY: _exit(2) has no preconditions; it ends the process at once (this
                // thread holds no MPI state).
                unsafe { libc::_exit(1) };
            })
            .expect("spawning the MPI watchdog");
        Watchdog { armed }
    }

    /// Runs the blocking call `f` (collective `op` over `bytes`) under `timeout`.
    pub(super) fn guard<T>(
        &self,
        op: Op,
        bytes: usize,
        timeout: Duration,
        f: impl FnOnce() -> T,
    ) -> T {
        self.set(Some(Armed {
            op,
            bytes,
            started: Instant::now(),
            timeout,
        }));
        let r = f();
        self.set(None);
        r
    }

    fn set(&self, a: Option<Armed>) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = a;
    }
}
