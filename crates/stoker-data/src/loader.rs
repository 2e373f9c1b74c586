//! The loader: a pool of worker threads that fill reusable batch buffers ahead of the
//! consumer, bounded by `prefetch_factor x num_workers`, delivered in sampler order.
//!
//! Semantics follow torch's DataLoader (num_workers 0 loads in the consumer's thread;
//! prefetch_factor 2 per worker; persistent_workers keeps threads and their state across
//! epochs; drop_last drops the short final batch), without its failure modes: workers are
//! threads sharing one memory map (no per-worker copies), randomness derives from
//! (seed, epoch, index) (no duplicated RNG), a worker's error or panic reaches the consumer,
//! and the position can be saved and restored mid-epoch.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::pool::{BufferPool, PooledStorage};
use crate::sampler::{Sampler, SamplerState};
use crate::stats::LoaderStats;
use crate::{DataError, Dataset, FieldSpec, Result};

pub use crate::dataset::MAX_FIELDS;

/// The most worker threads a loader starts: beyond it a typo, not a setting, and the
/// threads would fail to start.
pub const MAX_WORKERS: usize = 1024;

/// The most batches in flight per worker: the in-flight queues are allocated at their
/// bound, and each batch in flight holds a batch's memory.
pub const MAX_PREFETCH_FACTOR: usize = 1024;

/// The loader's knobs, named and defaulted as in torch's DataLoader.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Worker threads; 0 loads in the consumer's thread.
    pub num_workers: usize,
    /// Batches in flight per worker (only with workers).
    pub prefetch_factor: usize,
    /// Drop the final batch when it is short.
    pub drop_last: bool,
    /// Keep worker threads (and their scratch state) alive across epochs.
    pub persistent_workers: bool,
    /// Page-lock batch buffers.
    pub pin_memory: bool,
    /// Give up with an error when no batch arrives within this many seconds (None: wait).
    pub timeout_s: Option<f64>,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 1,
            num_workers: 0,
            prefetch_factor: 2,
            drop_last: false,
            persistent_workers: false,
            pin_memory: false,
            timeout_s: None,
        }
    }
}

impl LoaderConfig {
    /// Checks the knobs; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(DataError::Config {
                field: "batch_size",
                message: "must be at least 1".into(),
            });
        }
        if self.num_workers > MAX_WORKERS {
            return Err(DataError::Config {
                field: "num_workers",
                message: format!(
                    "{}: at most {MAX_WORKERS} worker threads (torch suggests no more than the cores)",
                    self.num_workers
                ),
            });
        }
        if self.prefetch_factor > MAX_PREFETCH_FACTOR {
            return Err(DataError::Config {
                field: "prefetch_factor",
                message: format!(
                    "{}: at most {MAX_PREFETCH_FACTOR} batches in flight per worker (each holds a batch's memory)",
                    self.prefetch_factor
                ),
            });
        }
        if self.num_workers > 0 && self.prefetch_factor == 0 {
            return Err(DataError::Config {
                field: "prefetch_factor",
                message: "must be at least 1 with workers".into(),
            });
        }
        if self.persistent_workers && self.num_workers == 0 {
            return Err(DataError::Config {
                field: "persistent_workers",
                message: "needs num_workers > 0 (as in torch)".into(),
            });
        }
        if let Some(t) = self.timeout_s {
            if !(t > 0.0 && t.is_finite()) {
                return Err(DataError::Config {
                    field: "timeout_s",
                    message: format!("{t}: expected a positive number of seconds"),
                });
            }
        }
        Ok(())
    }

    /// Batches in flight at most.
    pub fn max_in_flight(&self) -> usize {
        (self.prefetch_factor * self.num_workers).max(1)
    }
}

/// What every batch of one epoch shares: the order and the layout.
struct EpochPlan {
    epoch: u64,
    seed: u64,
    indices: Vec<usize>,
    batch_size: usize,
}

impl EpochPlan {
    fn batch_range(&self, b: usize) -> std::ops::Range<usize> {
        let start = b * self.batch_size;
        start..(start + self.batch_size).min(self.indices.len())
    }
}

/// How fields are laid out in a batch buffer.
struct Layout {
    fields: Arc<[FieldSpec]>,
    offsets: Arc<[usize]>,
}

type Done = (usize, Result<PooledStorage>);

struct Workers {
    tasks: Option<Sender<(Arc<EpochPlan>, usize)>>,
    results: Receiver<Done>,
    handles: Vec<JoinHandle<()>>,
    busy_ns: Arc<Vec<AtomicU64>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.tasks = None; // workers see a closed channel and exit
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A data loader over dataset `D`, with its sampler and buffer pool.
pub struct Loader<D: Dataset> {
    dataset: Arc<D>,
    sampler: Sampler,
    config: LoaderConfig,
    pool: Arc<BufferPool>,
    layout: Arc<Layout>,
    workers: Option<Workers>,
    local: D::Worker,
    stats: LoaderStats,
    busy_base: Vec<Duration>,
}

impl<D: Dataset> Loader<D> {
    /// A loader; checks the config and that the sampler was built for this dataset.
    pub fn new(dataset: Arc<D>, sampler: Sampler, config: LoaderConfig) -> Result<Self> {
        config.validate()?;
        if sampler.dataset_len() != dataset.len() {
            return Err(DataError::Shape(format!(
                "sampler built for {} samples but the dataset has {}",
                sampler.dataset_len(),
                dataset.len()
            )));
        }
        let fields: Arc<[FieldSpec]> = dataset.fields().to_vec().into();
        if fields.len() > MAX_FIELDS {
            return Err(DataError::Shape(format!(
                "{} fields: at most {MAX_FIELDS} supported",
                fields.len()
            )));
        }
        let mut offsets = Vec::with_capacity(fields.len());
        let mut total = 0usize;
        for f in fields.iter() {
            offsets.push(total);
            total += (f.sample_bytes() * config.batch_size).next_multiple_of(64);
        }
        let pool = BufferPool::new(total, config.pin_memory);
        tracing::info!(
            "loader: {} fields, {} bytes per batch buffer, up to {} batches in flight",
            fields.len(),
            total,
            config.max_in_flight()
        );
        Ok(Loader {
            dataset,
            sampler,
            pool,
            layout: Arc::new(Layout {
                fields,
                offsets: offsets.into(),
            }),
            workers: None,
            local: D::Worker::default(),
            stats: LoaderStats {
                worker_busy: vec![Duration::ZERO; config.num_workers],
                ..Default::default()
            },
            busy_base: vec![Duration::ZERO; config.num_workers],
            config,
        })
    }

    /// The config.
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The sampler.
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    /// Batches per epoch on this rank.
    pub fn batches_per_epoch(&self) -> usize {
        let n = self.sampler.rank_len();
        if self.config.drop_last {
            n / self.config.batch_size
        } else {
            n.div_ceil(self.config.batch_size)
        }
    }

    /// Batch buffers allocated so far (constant in steady state).
    pub fn buffers_allocated(&self) -> usize {
        self.pool.allocated()
    }

    /// Bytes of one batch buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.pool.buffer_bytes()
    }

    /// Heap bytes the loader holds in steady state, known before the first batch: a
    /// batch buffer per batch in flight plus the one the consumer holds, and the epoch's
    /// sample indices at their peak ([`Sampler::index_bytes`]).
    pub fn steady_bytes(&self) -> usize {
        self.buffer_bytes() * (self.config.max_in_flight() + 1) + self.sampler.index_bytes()
    }

    /// Counters since creation or the last [`reset_stats`](Self::reset_stats).
    pub fn stats(&self) -> LoaderStats {
        let mut s = self.stats.clone();
        if let Some(w) = &self.workers {
            for (i, b) in w.busy_ns.iter().enumerate() {
                s.worker_busy[i] = self.stats.worker_busy[i]
                    + Duration::from_nanos(b.load(Ordering::Relaxed))
                    - self.busy_base[i];
            }
        }
        s
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.stats = LoaderStats {
            worker_busy: vec![Duration::ZERO; self.config.num_workers],
            ..Default::default()
        };
        self.busy_base = match &self.workers {
            Some(w) => w
                .busy_ns
                .iter()
                .map(|b| Duration::from_nanos(b.load(Ordering::Relaxed)))
                .collect(),
            None => vec![Duration::ZERO; self.config.num_workers],
        };
    }

    /// Iterates epoch `epoch` from its start.
    pub fn epoch(&mut self, epoch: u64) -> EpochIter<'_, D> {
        self.resume(SamplerState {
            epoch,
            batches_done: 0,
        })
    }

    /// Iterates from a saved position: the batches that would have followed it.
    pub fn resume(&mut self, state: SamplerState) -> EpochIter<'_, D> {
        let plan = Arc::new(EpochPlan {
            epoch: state.epoch,
            seed: self.sampler.config().seed,
            indices: self.sampler.epoch_indices(state.epoch),
            batch_size: self.config.batch_size,
        });
        let nbatches = self.batches_per_epoch();
        let start = state.batches_done.min(nbatches);
        if self.config.num_workers > 0 && self.workers.is_none() {
            self.workers = Some(self.spawn_workers());
        }
        let cap = self.config.max_in_flight();
        EpochIter {
            loader: self,
            plan,
            nbatches,
            next_send: start,
            next_yield: start,
            pending: (0..cap).map(|_| None).collect(),
            outstanding: 0,
            started: Instant::now(),
            finished: false,
        }
    }

    fn spawn_workers(&mut self) -> Workers {
        let n = self.config.num_workers;
        let cap = self.config.max_in_flight();
        let (task_tx, task_rx) = bounded::<(Arc<EpochPlan>, usize)>(cap);
        let (done_tx, done_rx) = bounded::<Done>(cap);
        let busy_ns: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
        // Busy counters restart at zero with new threads: fold the old ones into the stats.
        self.busy_base = vec![Duration::ZERO; n];
        let handles = (0..n)
            .map(|w| {
                let (tasks, done) = (task_rx.clone(), done_tx.clone());
                let (dataset, pool, layout, busy) = (
                    self.dataset.clone(),
                    self.pool.clone(),
                    self.layout.clone(),
                    busy_ns.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("stoker-loader-{w}"))
                    .spawn(move || {
                        let mut state = D::Worker::default();
                        while let Ok((plan, b)) = tasks.recv() {
                            let t0 = Instant::now();
                            let result = catch_unwind(AssertUnwindSafe(|| {
                                let mut storage = pool.take();
                                fill_batch(&*dataset, &mut state, &plan, &layout, b, &mut storage)
                                    .map(|_| storage)
                            }))
                            .unwrap_or_else(|panic| {
                                Err(DataError::Worker {
                                    worker: w,
                                    message: format!("panicked: {}", panic_message(&panic)),
                                })
                            });
                            busy[w].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                            if done.send((b, result)).is_err() {
                                break;
                            }
                        }
                    })
                    .expect("spawning a loader thread")
            })
            .collect();
        Workers {
            tasks: Some(task_tx),
            results: done_rx,
            handles,
            busy_ns,
        }
    }

    fn retire_workers(&mut self) {
        if let Some(w) = self.workers.take() {
            for (i, b) in w.busy_ns.iter().enumerate() {
                self.stats.worker_busy[i] +=
                    Duration::from_nanos(b.load(Ordering::Relaxed)) - self.busy_base[i];
            }
            self.busy_base = vec![Duration::ZERO; self.config.num_workers];
        }
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Fills batch `b` of `plan` into `storage`: zero-copy views when every field allows it,
/// otherwise one `read_sample` per sample straight into the batch buffer.
fn fill_batch<D: Dataset>(
    dataset: &D,
    state: &mut D::Worker,
    plan: &EpochPlan,
    layout: &Layout,
    b: usize,
    storage: &mut PooledStorage,
) -> Result<()> {
    let idx = &plan.indices[plan.batch_range(b)];
    let nf = layout.fields.len();
    storage.indices.clear();
    storage.indices.extend_from_slice(idx);
    storage.mapped.clear();
    storage.mapped.resize(nf, None);
    if idx.windows(2).all(|w| w[1] == w[0] + 1) {
        for f in 0..nf {
            storage.mapped[f] = dataset.mapped_run(f, idx[0], idx.len());
        }
        if storage.mapped.iter().all(Option::is_some) {
            return Ok(());
        }
        storage.mapped.iter_mut().for_each(|m| *m = None);
    }
    let mut regions: [&mut [u8]; MAX_FIELDS] = Default::default();
    let mut rest: &mut [u8] = &mut storage.data;
    let mut consumed = 0;
    for ((region, offset), spec) in regions
        .iter_mut()
        .zip(layout.offsets.iter())
        .zip(layout.fields.iter())
    {
        let len = spec.sample_bytes() * plan.batch_size;
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - consumed);
        let (head, tail) = tail.split_at_mut(len);
        *region = head;
        rest = tail;
        consumed = offset + len;
    }
    dataset.read_batch(state, plan.seed, plan.epoch, idx, &mut regions[..nf])
}

/// The batches of one epoch, in order; dropping it mid-epoch drains in-flight work.
pub struct EpochIter<'a, D: Dataset> {
    loader: &'a mut Loader<D>,
    plan: Arc<EpochPlan>,
    nbatches: usize,
    next_send: usize,
    next_yield: usize,
    pending: Vec<Option<Result<PooledStorage>>>,
    /// Tasks sent whose results have not been received yet.
    outstanding: usize,
    started: Instant,
    finished: bool,
}

impl<D: Dataset> EpochIter<'_, D> {
    /// The position after the batches delivered so far; pass it to [`Loader::resume`].
    pub fn state(&self) -> SamplerState {
        SamplerState {
            epoch: self.plan.epoch,
            batches_done: self.next_yield,
        }
    }

    fn top_up(&mut self) {
        let Some(w) = &self.loader.workers else {
            return;
        };
        let tasks = w.tasks.as_ref().expect("open while the loader lives");
        // Batches sent and not yet delivered (in a worker, in the channel or waiting in
        // `pending`) never exceed prefetch_factor x num_workers.
        while self.next_send - self.next_yield < self.pending.len()
            && self.next_send < self.nbatches
        {
            if tasks.send((self.plan.clone(), self.next_send)).is_err() {
                return;
            }
            self.next_send += 1;
            self.outstanding += 1;
        }
    }

    fn receive(&mut self) -> Result<()> {
        let timeout = self.loader.config.timeout_s.map(Duration::from_secs_f64);
        let w = self.loader.workers.as_ref().expect("workers exist");
        let (b, r) = match timeout {
            Some(t) => w.results.recv_timeout(t).map_err(|e| match e {
                RecvTimeoutError::Timeout => DataError::Worker {
                    worker: 0,
                    message: format!("no batch within the {t:?} timeout"),
                },
                RecvTimeoutError::Disconnected => DataError::Worker {
                    worker: 0,
                    message: "all workers exited".into(),
                },
            })?,
            None => w.results.recv().map_err(|_| DataError::Worker {
                worker: 0,
                message: "all workers exited".into(),
            })?,
        };
        let cap = self.pending.len();
        self.pending[b % cap] = Some(r);
        self.outstanding -= 1;
        Ok(())
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.loader.stats.wall += self.started.elapsed();
        }
    }

    fn next_batch(&mut self) -> Result<Batch> {
        let b = self.next_yield;
        let t0 = Instant::now();
        let storage = if self.loader.config.num_workers == 0 {
            let mut storage = self.loader.pool.take();
            let l = &mut *self.loader;
            fill_batch(
                &*l.dataset,
                &mut l.local,
                &self.plan,
                &l.layout,
                b,
                &mut storage,
            )?;
            storage
        } else {
            self.top_up();
            let cap = self.pending.len();
            while self.pending[b % cap].is_none() {
                self.receive()?;
            }
            let r = self.pending[b % cap].take().expect("just checked");
            self.top_up();
            r?
        };
        let wait = t0.elapsed();
        self.next_yield += 1;
        let layout = &self.loader.layout;
        let batch = Batch {
            epoch: self.plan.epoch,
            index: b,
            len: self.plan.batch_range(b).len(),
            wait,
            storage,
            fields: layout.fields.clone(),
            offsets: layout.offsets.clone(),
        };
        let s = &mut self.loader.stats;
        s.batches += 1;
        s.samples += batch.len() as u64;
        s.bytes += batch.bytes() as u64;
        s.consumer_wait += wait;
        s.zero_copy_batches += batch.storage.mapped.first().is_some_and(Option::is_some) as u64;
        Ok(batch)
    }
}

impl<D: Dataset> Iterator for EpochIter<'_, D> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.finished {
            return None;
        }
        if self.next_yield >= self.nbatches {
            self.finish();
            return None;
        }
        let r = self.next_batch();
        if r.is_err() {
            self.finish();
        }
        Some(r)
    }
}

impl<D: Dataset> Drop for EpochIter<'_, D> {
    fn drop(&mut self) {
        self.finish();
        // Collect what is still in flight so the next epoch starts clean; on a timeout or a
        // dead worker, retire the workers instead of waiting.
        while self.outstanding > 0 {
            if self.receive().is_err() {
                self.loader.retire_workers();
                break;
            }
        }
        self.pending.iter_mut().for_each(|p| *p = None);
        if !self.loader.config.persistent_workers {
            self.loader.retire_workers();
        }
    }
}
