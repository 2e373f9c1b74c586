//! Version 3 checkpoints, written by every rank together and loadable at any world size
//! and with any strategy:
//!
//! - `shard_RRRRR.safetensors`, one per rank of the saving world: the elements
//!   `[start, end)` of the flat FP32 parameter buffer (`master`) and of each optimizer
//!   buffer (`exp_avg`, `exp_avg_sq` / `momentum`), where `[start, end)` is the rank's
//!   range of the ZeRO split of the buffer ([`crate::parallel::ShardPlan`]) whatever the strategy (a DDP
//!   rank holds everything and writes its part, so saving is parallel there too), except
//!   under ZeRO-3, whose ranks write what they hold: a piece of every parameter group
//!   ([`crate::parallel::GroupShards`]), end to end, listed as the entry's `pieces`;
//! - `manifest.json` (rank 0): format and version, step, the saving world size and
//!   strategy, the parameter layout (names, shapes, offsets), every shard's range, size
//!   and CRC-32, every rank's data position (and the training samples it counts),
//!   loss-scaler and FP8 state, and what a resume must keep ([`super::RunRecord`]: the
//!   seed, the `[model]` table, the precision);
//! - `COMMITTED` (rank 0, last): the CRC-32 of `manifest.json`.
//!
//! The ranks write into `.tmp_step_NNNNNNNN/`; once every shard is on disk (fsynced) and
//! the manifest written, rank 0 renames the directory into place and writes the marker.
//! A crash at any point leaves either no `step_` directory or one without `COMMITTED`,
//! which [`super::latest`] skips and [`load`] refuses, so the previous checkpoint stays
//! the one a resume takes.
//!
//! Loading reads, for each shard file that overlaps what this rank needs (the parameters
//! it holds: the whole buffer, or under ZeRO-3 its pieces; its optimizer's pieces), the
//! overlapping elements: resharding is a copy of ranges, and no rank ever holds more
//! parameters or optimizer state than its own.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde::{Deserialize, Serialize};
use stoker_comm::{CommExt, Communicator};
use stoker_data::SamplerState;
use stoker_precision::ScalerState;

use super::state::{LoadedState, Stateful};
use super::{read_checked, step_dir, DataPosition, Resumed, FORMAT};
use crate::error::{io_err, Result};
use crate::layout::FlatLayout;
use crate::model_files::{ckpt_err, f32s, write_synced};
use crate::optim::OptimState;
use crate::parallel::ShardPlan;
use crate::pieces::Pieces;
use crate::precision::LayerScalers;

/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The commit marker's file name.
pub const COMMITTED: &str = "COMMITTED";
/// The sharded format's version.
const VERSION: u32 = 3;
/// The parameter buffer's tensor name in a shard file.
const MASTER: &str = "master";

/// One rank's shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The rank that wrote it.
    pub rank: usize,
    /// File name inside the checkpoint directory.
    pub file: String,
    /// First element of the flat buffers it holds.
    pub start: usize,
    /// One past its last element.
    pub end: usize,
    /// Its ranges of the flat buffer, end to end in the file, where there are several
    /// (ZeRO-3's piece of every group); absent: `[start, end)` alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<[usize; 2]>,
    /// File size in bytes.
    pub bytes: u64,
    /// CRC-32 of the file.
    pub crc32: u32,
}

impl ShardEntry {
    /// The ranges of the flat buffer it holds, end to end in its file, or what is wrong
    /// with them.
    pub fn try_pieces(&self) -> std::result::Result<Pieces, String> {
        let p = match self.pieces.is_empty() {
            true => Pieces::try_new(std::iter::once(self.start..self.end))?,
            false => Pieces::try_new(self.pieces.iter().map(|[a, b]| *a..*b))?,
        };
        let extent = p.ranges().first().map(|r| r.start)..p.ranges().last().map(|r| r.end);
        if !p.is_empty() && extent != (Some(self.start)..Some(self.end)) {
            return Err(format!(
                "pieces span {extent:?}, the entry says [{}, {})",
                self.start, self.end
            ));
        }
        Ok(p)
    }

    /// [`ShardEntry::try_pieces`] of an entry [`read_manifest`] has checked.
    fn held(&self) -> Pieces {
        self.try_pieces().unwrap_or_default()
    }
}

/// `manifest.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always `stoker-checkpoint`.
    pub format: String,
    /// 3.
    pub version: u32,
    /// Optimizer steps taken.
    pub step: u64,
    /// The optimizer's own step count (bias correction).
    pub optimizer_step: u64,
    /// The optimizer's buffer names, in every shard file.
    pub optimizer_buffers: Vec<String>,
    /// Ranks that wrote it.
    pub world_size: usize,
    /// Their strategy (`none`, `ddp`, `zero1`, `zero2`, `zero3`): informative, any strategy
    /// loads it.
    pub strategy: String,
    /// The run's seed.
    pub seed: u64,
    /// The run's `[model]` table, resolved ([`super::RunRecord`]); absent in checkpoints
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<crate::models::ModelConfig>,
    /// The run's precision; absent in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<crate::precision::Precision>,
    /// Rank 0's loader position.
    pub sampler: SamplerState,
    /// Every rank's data position.
    pub data: DataPosition,
    /// Seconds the run had run when this was written, its earlier lives included, so
    /// that a resumed run's `elapsed_s` goes on from it (absent in checkpoints written
    /// before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_s: Option<f64>,
    /// The evaluation due at this step did not finish (a signal stopped the run): a
    /// resume runs it first. Written only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eval_pending: bool,
    /// Loss-scaler state (fp16).
    pub scaler: Option<ScalerState>,
    /// FP8 delayed scalers by layer (fp8).
    pub fp8: Option<BTreeMap<String, LayerScalers>>,
    /// The flat layout of every buffer.
    pub layout: FlatLayout,
    /// The shard files, rank order, their pieces tiling the buffer.
    pub shards: Vec<ShardEntry>,
}

/// A crash to inject into a save, for the tests of crash safety: rank `rank` aborts the
/// process at point `at` of the checkpoint of step `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SaveFault {
    /// The rank that crashes.
    pub rank: usize,
    /// The checkpoint's step.
    pub step: u64,
    /// Where in the save.
    pub at: SavePoint,
}

/// The points of a save a [`SaveFault`] can stop at, in the order a save passes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavePoint {
    /// The rank's shard is written but not yet fsynced.
    ShardWritten,
    /// The rank's shard is written and fsynced (before the ranks exchange checksums).
    ShardSynced,
    /// Rank 0 has written and fsynced the manifest into the temporary directory.
    ManifestWritten,
    /// Rank 0 has renamed the temporary directory to `step_N` (no commit marker yet).
    Renamed,
    /// Rank 0 has written the commit marker, before fsyncing the parent directory.
    Committed,
}

impl SavePoint {
    /// Every point, in save order.
    pub const ALL: [SavePoint; 5] = [
        SavePoint::ShardWritten,
        SavePoint::ShardSynced,
        SavePoint::ManifestWritten,
        SavePoint::Renamed,
        SavePoint::Committed,
    ];

    /// The point's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SavePoint::ShardWritten => "shard-written",
            SavePoint::ShardSynced => "shard-synced",
            SavePoint::ManifestWritten => "manifest-written",
            SavePoint::Renamed => "renamed",
            SavePoint::Committed => "committed",
        }
    }

    /// The point named `name`.
    pub fn from_name(name: &str) -> Option<SavePoint> {
        SavePoint::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Aborts the process when `fault` names this rank, step and point.
fn crash_if(fault: Option<SaveFault>, rank: usize, step: u64, at: SavePoint, path: &Path) {
    if fault == Some(SaveFault { rank, step, at }) {
        eprintln!(
            "stoker: rank {rank}: injected crash at {} ({}) (test)",
            at.name(),
            path.display()
        );
        std::process::abort();
    }
}

/// What rank `rank` of `world` saves of the FP32 parameters, and its values: where it
/// holds a shard (ZeRO-3), that shard (its piece of every group); where it holds the whole
/// buffer, its range of [`ShardPlan`]'s even split, so that every rank writes.
fn master_shard<'a>(
    state: &'a super::state::RankState<'_>,
    world: usize,
    rank: usize,
) -> (Pieces, &'a [f32]) {
    let len = state.layout.total_len();
    if !state.held.is_whole(len) {
        return (state.held.clone(), state.master);
    }
    let own = ShardPlan::new(len, world, state.layout.align()).range(rank);
    (Pieces::one(own.clone()), &state.master[own])
}

fn shard_file(rank: usize) -> String {
    format!("shard_{rank:05}.safetensors")
}

/// Writes `trainer`'s checkpoint under `root`, every rank of `comm` its shard (a
/// collective); returns the directory. `run` is what the manifest records of the run,
/// `progress` where it stands (data position, seconds so far, an evaluation owed).
pub fn save(
    trainer: &dyn Stateful,
    comm: &dyn Communicator,
    root: &Path,
    run: &super::RunRecord,
    progress: super::RunProgress,
    fault: Option<SaveFault>,
) -> Result<PathBuf> {
    let super::RunProgress {
        data,
        elapsed_s,
        eval_pending,
    } = progress;
    let (rank, world) = (comm.rank(), comm.world_size());
    let state = trainer.state();
    let step = state.step;
    let dir = step_dir(root, step);
    let tmp = root.join(format!(".tmp_step_{step:08}"));
    if rank == 0 {
        std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    comm.barrier()?;

    let layout = state.layout;
    let (own, mine) = master_shard(&state, world, rank);
    let opt = &state.optimizer;
    let Some(local) = opt.pieces.local_of(&own) else {
        return Err(ckpt_err(
            &tmp,
            format!(
                "rank {rank} holds optimizer state for elements {:?}, its shard to save is {:?}",
                opt.pieces.ranges(),
                own.ranges()
            ),
        ));
    };
    let mut views = vec![(MASTER.to_string(), view(mine))];
    for (name, buf) in &opt.buffers {
        views.push((name.to_string(), view(&buf[local.clone()])));
    }
    // Streamed to the file from the buffers themselves (safetensors writes through a
    // 1 MiB buffer): a serialized copy in memory would add 12 bytes per parameter of the
    // shard to the run's peak. The manifest's CRC is of the bytes read back.
    let file = tmp.join(shard_file(rank));
    safetensors::serialize_to_file(views, None, &file).map_err(|e| write_err(&file, e))?;
    crate::model_files::give_created_mode(&file)?;
    crash_if(fault, rank, step, SavePoint::ShardWritten, &file);
    let (crc, len) = sync_and_hash(&file)?;
    crash_if(fault, rank, step, SavePoint::ShardSynced, &file);
    // Rank 0 learns every shard's checksum, size and pieces.
    let mut mine = vec![crc as u64, len];
    mine.extend(
        own.ranges()
            .iter()
            .flat_map(|r| [r.start as u64, r.end as u64]),
    );
    let all = comm.all_gather_varying(&mine)?;

    if rank == 0 {
        let manifest = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            step,
            optimizer_step: opt.step,
            optimizer_buffers: opt.buffers.iter().map(|(n, _)| n.to_string()).collect(),
            world_size: world,
            strategy: state.strategy.into(),
            seed: run.seed,
            model: Some(run.model.clone()),
            precision: Some(run.precision),
            sampler: state.sampler,
            data,
            elapsed_s: Some(elapsed_s),
            eval_pending,
            scaler: state.scaler.clone(),
            fp8: state.fp8.clone(),
            layout: (*layout).clone(),
            shards: shard_entries(&all),
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| ckpt_err(&tmp, e))?;
        write_synced(&tmp.join(MANIFEST), &json)?;
        crash_if(fault, rank, step, SavePoint::ManifestWritten, &tmp);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        }
        std::fs::rename(&tmp, &dir).map_err(|e| io_err(&dir, e))?;
        crash_if(fault, rank, step, SavePoint::Renamed, &dir);
        // Named before it commits: a crash between leaves it uncommitted, and a resume
        // then takes the newest committed one below it.
        super::record_latest(root, &dir)?;
        write_synced(
            &dir.join(COMMITTED),
            format!("{:08x}\n", crc32fast::hash(&json)).as_bytes(),
        )?;
        crash_if(fault, rank, step, SavePoint::Committed, &dir);
        if let Ok(d) = std::fs::File::open(root) {
            let _ = d.sync_all(); // make the renames durable
        }
    }
    comm.barrier()?;
    Ok(dir)
}

/// The manifest's shard entries from every rank's `[crc, bytes, start, end, start, end,
/// ...]`, rank order.
fn shard_entries(all: &[Vec<u64>]) -> Vec<ShardEntry> {
    all.iter()
        .enumerate()
        .map(|(rank, part)| {
            let ranges: Vec<[usize; 2]> = part[2..]
                .chunks(2)
                .map(|c| [c[0] as usize, c[1] as usize])
                .collect();
            let (start, end) = match (ranges.first(), ranges.last()) {
                (Some(f), Some(l)) => (f[0], l[1]),
                // An empty shard (a tiny model): it holds nothing.
                _ => (0, 0),
            };
            ShardEntry {
                rank,
                file: shard_file(rank),
                start,
                end,
                pieces: if ranges.len() > 1 { ranges } else { Vec::new() },
                crc32: part[0] as u32,
                bytes: part[1],
            }
        })
        .collect()
}

/// A shard's write failing: the file system's error (a full disk, a lost mount) as an
/// I/O error on the file, anything else as the checkpoint's.
fn write_err(path: &Path, e: safetensors::SafeTensorError) -> crate::error::TrainError {
    match e {
        safetensors::SafeTensorError::IoError(e) => io_err(path, e),
        e => ckpt_err(path, e),
    }
}

/// Fsyncs `path` and returns the CRC-32 and length of its bytes, read in 1 MiB pieces.
fn sync_and_hash(path: &Path) -> Result<(u32, u64)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        len += n as u64;
    }
    Ok((hasher.finalize(), len))
}

fn view(v: &[f32]) -> TensorView<'_> {
    TensorView::new(StDtype::F32, vec![v.len()], bytemuck::cast_slice(v)).expect("sizes match")
}

/// Reads and checks `dir`'s manifest against its commit marker.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let mp = dir.join(MANIFEST);
    let json = std::fs::read(&mp).map_err(|e| match e.kind() {
        // No manifest at all (a run directory, say): not a checkpoint, as every reader
        // says it, with the checkpoint to give instead.
        std::io::ErrorKind::NotFound => super::not_a_checkpoint(dir),
        _ => io_err(&mp, e),
    })?;
    let cp = dir.join(COMMITTED);
    let marker = std::fs::read_to_string(&cp).map_err(|_| {
        ckpt_err(
            dir,
            format!("no {COMMITTED} marker: the save did not finish (a crash or a kill during it); resume from an earlier checkpoint"),
        )
    })?;
    let want = u32::from_str_radix(marker.trim(), 16)
        .map_err(|e| ckpt_err(&cp, format!("not a CRC-32: {e}")))?;
    if crc32fast::hash(&json) != want {
        return Err(ckpt_err(
            &mp,
            format!(
                "checksum mismatch: CRC-32 {:08x}, {COMMITTED} records {want:08x}",
                crc32fast::hash(&json)
            ),
        ));
    }
    let m: Manifest = serde_json::from_slice(&json).map_err(|e| ckpt_err(&mp, e))?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(ckpt_err(
            &mp,
            format!(
                "format {} v{}, expected {FORMAT} v{VERSION}",
                m.format, m.version
            ),
        ));
    }
    // The counts the manifest gives more than once agree: the ranks that wrote it, its
    // data position's, one position per rank, no more shards than ranks; and the step is
    // the one its directory is named for (an edit that passes the checksum, with the
    // marker recomputed, is still refused here).
    let (ranks, data_ranks, positions) = (m.world_size, m.data.world_size, m.data.ranks.len());
    if ranks == 0 || data_ranks != ranks || positions != ranks || m.shards.len() > ranks {
        return Err(ckpt_err(
            &mp,
            format!(
                "world_size {ranks}, but data.world_size {data_ranks}, {positions} data \
                 position(s) and {} shard(s): the manifest does not agree with itself",
                m.shards.len()
            ),
        ));
    }
    if let Some(named) = super::step_of(dir).filter(|&n| n != m.step) {
        return Err(ckpt_err(
            &mp,
            format!(
                "step {}, but its directory is named for step {named}: the manifest does not \
                 belong here",
                m.step
            ),
        ));
    }
    // The layout as its own table, and no larger than the shards can hold (each holds
    // its pieces as f32, and more): a damaged or edited one is refused here, before a
    // reader allocates its total or slices by its slots.
    let sizes: Option<Vec<(&str, u64)>> = m
        .shards
        .iter()
        .map(|s| {
            let len = std::fs::metadata(dir.join(&s.file)).ok()?.len();
            Some((s.file.as_str(), len))
        })
        .collect();
    let shard_bytes: Option<u64> = sizes.as_ref().map(|s| s.iter().map(|(_, b)| b).sum());
    let max = shard_bytes.map_or(usize::MAX, |b| (b / 4) as usize);
    if let Some(why) = m.layout.problem(max) {
        // Where the shards are too small for the layout, say which: a truncated or
        // emptied shard, not the manifest, is the usual cause.
        let held = match (&sizes, m.layout.problem(usize::MAX)) {
            (Some(sizes), None) => {
                let each: Vec<String> = sizes
                    .iter()
                    .map(|(f, b)| format!("{f}: {b} bytes"))
                    .collect();
                format!(" ({}): a shard file is truncated or empty", each.join(", "))
            }
            _ => String::new(),
        };
        return Err(ckpt_err(&mp, format!("layout: {why}{held}")));
    }
    // Every shard's pieces together tile the buffer.
    let mut pieces = Vec::new();
    for s in &m.shards {
        let held = s
            .try_pieces()
            .map_err(|e| ckpt_err(&mp, format!("shards: {}: {e}", s.file)))?;
        pieces.extend(held.ranges().iter().map(|r| (r.clone(), &s.file)));
        if s.file.contains('/') || s.file.contains('\\') || s.file.starts_with('.') {
            return Err(ckpt_err(
                &mp,
                format!(
                    "shards: file name `{}` leaves the checkpoint directory",
                    s.file
                ),
            ));
        }
    }
    pieces.sort_by_key(|(r, _)| r.start);
    let mut at = 0;
    for (r, file) in &pieces {
        if r.start != at {
            return Err(ckpt_err(
                &mp,
                format!(
                    "shards: {file} covers [{}, {}), expected a piece to start at {at} (the shards' pieces must tile the buffer)",
                    r.start, r.end
                ),
            ));
        }
        at = r.end;
    }
    if at != m.layout.total_len() {
        return Err(ckpt_err(
            &mp,
            format!(
                "shards: cover {at} elements, the layout has {}",
                m.layout.total_len()
            ),
        ));
    }
    Ok(m)
}

/// Checks that the manifest's layout is the one its recorded `[model]` table declares,
/// name for name and shape for shape (a checkpoint written before the table was recorded
/// passes). The checksum covers only the manifest as written, so a layout edited to
/// another shape of the same length (a transpose) with the marker recomputed would
/// otherwise consolidate into wrongly shaped tensors; training already refuses it against
/// its own model.
pub(super) fn check_recorded_model(dir: &Path, m: &Manifest) -> Result<()> {
    let Some(model) = &m.model else {
        return Ok(());
    };
    let mp = dir.join(MANIFEST);
    // The table checked as a config's is, and its blocks bounded by the layout's slots,
    // before a model is declared from it (a zero head count divided by zero there).
    let table = |key: &str, why: String| ckpt_err(&mp, format!("model.{key}: {why}"));
    model.validate().map_err(|(key, why)| table(key, why))?;
    let blocks = match model {
        crate::models::ModelConfig::Gpt(g) => g.n_layer,
        crate::models::ModelConfig::Llama(l) => l.n_layer,
        _ => 0,
    };
    if blocks > m.layout.slots().len() {
        let why = format!("{blocks}, more blocks than the layout has parameters");
        return Err(table("n_layer", why));
    }
    let meta = crate::models::build_meta_model_on(
        model,
        crate::precision::Precision::Fp32,
        crate::precision::Kernels::default(),
        m.seed,
        &candle_core::Device::Cpu,
    )
    .map_err(|e| ckpt_err(&mp, format!("model: {e}")))?;
    // At the manifest's own alignment, so that a later change of the default leaves older
    // checkpoints readable.
    let declared = FlatLayout::new(&meta.params().specs(), m.layout.align())?;
    // Groups are left out: checkpoints written before them record 0 for every slot.
    let place = |l: &FlatLayout| -> Vec<(String, Vec<usize>, usize, usize)> {
        let slots = l.slots().iter();
        slots
            .map(|s| (s.name.clone(), s.shape.clone(), s.offset, s.len))
            .collect()
    };
    if place(&m.layout) != place(&declared) || m.layout.total_len() != declared.total_len() {
        let diff = super::legacy::describe_mismatch(&m.layout, &declared);
        return Err(ckpt_err(
            &mp,
            format!("layout does not match its own model table: {diff}"),
        ));
    }
    Ok(())
}

/// Calls `each(pieces, tensors)` for every shard file of `dir` holding any of `want` (the
/// ranges the shard holds, end to end in its tensors, read from the manifest once), after
/// checking its checksum and that every tensor of `names` is F32 of the shard's length.
pub(crate) fn for_shards(
    dir: &Path,
    m: &Manifest,
    want: &Pieces,
    names: &[&str],
    mut each: impl FnMut(&Pieces, &safetensors::SafeTensors) -> Result<()>,
) -> Result<()> {
    // Asked for the whole buffer (verify, consolidate), every shard is read and checked,
    // those that hold nothing (more ranks than a small model's pieces) included.
    let whole = want.is_whole(m.layout.total_len());
    for s in &m.shards {
        let held = s.held();
        if !whole && !want.ranges().iter().any(|r| held.owned_len(r) > 0) {
            continue;
        }
        let bytes = read_shard(dir, s, names)?;
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("checked by read_shard");
        each(&held, &st)?;
    }
    Ok(())
}

/// The bytes of shard `s` of `dir`, after checking its checksum and size against the
/// manifest's entry and that every tensor of `names` is F32 of the shard's length.
pub(crate) fn read_shard(dir: &Path, s: &ShardEntry, names: &[&str]) -> Result<Vec<u8>> {
    let path = dir.join(&s.file);
    let bytes = read_checked(&path, s.crc32, MANIFEST)?;
    if bytes.len() as u64 != s.bytes {
        return Err(ckpt_err(
            &path,
            format!(
                "{} bytes, {MANIFEST} records {} for it",
                bytes.len(),
                s.bytes
            ),
        ));
    }
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| ckpt_err(&path, e))?;
    let len = s.held().len();
    for name in names {
        let t = st
            .tensor(name)
            .map_err(|e| ckpt_err(&path, format!("tensor `{name}`: {e}")))?;
        if t.dtype() != StDtype::F32 || t.shape() != [len] {
            return Err(ckpt_err(
                &path,
                format!(
                    "tensor `{name}`: {:?} {:?}, the manifest says F32 [{len}]",
                    t.dtype(),
                    t.shape(),
                ),
            ));
        }
    }
    Ok(bytes)
}

/// Copies the part of tensor `name` of a shard holding `shard` (its ranges end to end)
/// inside `want` into `out` (which holds the elements `want`).
pub(crate) fn copy_overlap(
    shard: &Pieces,
    st: &safetensors::SafeTensors,
    name: &str,
    want: &Range<usize>,
    out: &mut [f32],
) {
    let data = st.tensor(name).expect("checked by for_shards").data();
    for (r, at) in shard.with_starts() {
        let (start, end) = (r.start.max(want.start), r.end.min(want.end));
        if start >= end {
            continue;
        }
        let src = &data[4 * (at + start - r.start)..4 * (at + end - r.start)];
        for (o, v) in out[start - want.start..end - want.start]
            .iter_mut()
            .zip(f32s(src))
        {
            *o = v;
        }
    }
}

/// Loads a version 3 checkpoint into this rank's state.
pub fn load(trainer: &mut dyn Stateful, dir: &Path) -> Result<Resumed> {
    let m = read_manifest(dir)?;
    let mp = dir.join(MANIFEST);
    let ours = trainer.state();
    if m.layout != *ours.layout {
        let diff = super::legacy::describe_mismatch(&m.layout, ours.layout);
        return Err(ckpt_err(
            &mp,
            format!("layout does not match the model: {diff}"),
        ));
    }
    let names: Vec<&str> = ours.optimizer.buffers.iter().map(|(n, _)| *n).collect();
    if m.optimizer_buffers != names {
        return Err(ckpt_err(
            &mp,
            format!(
                "optimizer_buffers: {:?}, this run's optimizer keeps {names:?} (another optimizer kind)",
                m.optimizer_buffers
            ),
        ));
    }
    let pieces = ours.optimizer.pieces.clone();
    // The parameters this rank holds alone (under ZeRO-3 its pieces, not the whole model).
    let held = ours.held.clone();
    let mut master = vec![0f32; held.len()];
    let mut buffers: Vec<(String, Vec<f32>)> = names
        .iter()
        .map(|n| (n.to_string(), vec![0f32; pieces.len()]))
        .collect();
    let mut wanted = names.clone();
    wanted.push(MASTER);
    // The optimizer's pieces are among the parameters': only shards holding those are read.
    for_shards(dir, &m, &held, &wanted, |shard, st| {
        for (r, at) in held.with_starts() {
            copy_overlap(shard, st, MASTER, r, &mut master[at..at + r.len()]);
        }
        for (name, buf) in buffers.iter_mut() {
            for (r, at) in pieces.with_starts() {
                copy_overlap(shard, st, name, r, &mut buf[at..at + r.len()]);
            }
        }
        Ok(())
    })?;
    trainer
        .load_state(LoadedState {
            step: m.step,
            sampler: m.sampler,
            master,
            optimizer: OptimState {
                step: m.optimizer_step,
                pieces,
                buffers,
            },
            scaler: m.scaler.clone(),
            fp8: m.fp8.clone(),
        })
        .map_err(|e| ckpt_err(&mp, e))?;
    Ok(Resumed {
        step: m.step,
        sampler: m.sampler,
        data: Some(m.data),
        seed: Some(m.seed),
        model: m.model.clone(),
        precision: m.precision,
        elapsed_s: m.elapsed_s,
        eval_pending: m.eval_pending,
    })
}
