//! Packs a folder of JPEGs with one sub-folder per class into an image record dataset.
//!
//! Classes are the sub-folder names in byte order (label `k` = `k`-th name, as torchvision's
//! `ImageFolder`); inside a class, files are taken in byte order of their relative path,
//! descending into nested folders. Every file must start with the JPEG SOI marker: by default a
//! non-JPEG is an error naming the file (a stray `.DS_Store` or PNG would otherwise silently
//! shift nothing but cost a decode error mid-epoch); [`PackOptions::skip_non_jpeg`] skips and
//! lists them instead. Files at the top level, beside the class folders, are ignored. Files are
//! stored byte for byte unless [`PackOptions::max_side`] asks for FFCV-style downscaling.
//!
//! Each photo's structure (SOI, marker segments, scans, EOI) is checked as it is packed, so a
//! truncated file is refused naming it; damage inside a scan shows only when it is decoded,
//! and `OUT.sources.json` (each record's photo, relative to the source folder) lets the
//! dataset name that photo then.

use std::fs;
use std::path::{Path, PathBuf};

use super::downscale::Downscaler;
use crate::image_folder::{classes_path, labels_path, sources_path, PackSources};
use crate::npy::write_npy;
use crate::records::{RecordManifest, RecordWriter};
use crate::{DType, DataError, Result};

/// Choices for [`pack_image_folder_with`].
#[derive(Debug, Clone)]
pub struct PackOptions {
    /// Skip (and report) files that are not JPEGs instead of failing on the first one.
    pub skip_non_jpeg: bool,
    /// Shrink photos whose longer side exceeds this many pixels and re-encode them (FFCV's
    /// `max_resolution`; lossy, see the `downscale` module). `None` stores every file as is.
    pub max_side: Option<u32>,
    /// JPEG quality (1..=100) of re-encoded photos.
    pub quality: u8,
}

impl Default for PackOptions {
    /// Fail on non-JPEGs, store every file byte for byte; quality 90 if `max_side` is set.
    fn default() -> Self {
        PackOptions {
            skip_non_jpeg: false,
            max_side: None,
            quality: 90,
        }
    }
}

/// What [`pack_image_folder`] wrote.
#[derive(Debug, Clone)]
pub struct PackSummary {
    /// Class names in label order.
    pub classes: Vec<String>,
    /// Images written per class, in label order.
    pub per_class: Vec<u64>,
    /// The shard's manifest (record count, sizes, checksums).
    pub manifest: RecordManifest,
    /// Files skipped as non-JPEG (empty unless `skip_non_jpeg`).
    pub skipped: Vec<PathBuf>,
    /// Photos shrunk and re-encoded (0 unless `max_side`).
    pub downscaled: u64,
    /// The files written: data, index, manifest, labels, classes, sources.
    pub outputs: Vec<PathBuf>,
}

/// Packs `src_dir` (one sub-folder per class) into `OUT.data`, `OUT.index`,
/// `OUT.manifest.json`, `OUT.labels.npy`, `OUT.classes.json` and `OUT.sources.json`;
/// non-JPEG and truncated files are an error.
pub fn pack_image_folder(
    src_dir: impl AsRef<Path>,
    out_prefix: impl AsRef<Path>,
) -> Result<PackSummary> {
    pack_image_folder_with(src_dir, out_prefix, &PackOptions::default())
}

/// [`pack_image_folder`] with options. The pack is written under a temporary prefix
/// beside `out_prefix` and renamed into place once whole: one that fails (a corrupt photo,
/// an empty class, a full disk) leaves an earlier pack at `out_prefix` as it was.
pub fn pack_image_folder_with(
    src_dir: impl AsRef<Path>,
    out_prefix: impl AsRef<Path>,
    options: &PackOptions,
) -> Result<PackSummary> {
    let out = out_prefix.as_ref();
    crate::paths::check_prefix(out)?;
    let tmp = crate::paths::prefixed(out, ".partial");
    let files = |p: &Path| {
        let r = crate::records::RecordPaths::new(p);
        vec![
            r.data,
            r.index,
            labels_path(p),
            classes_path(p),
            sources_path(p),
            r.manifest,
        ]
    };
    match write_pack(src_dir.as_ref(), &tmp, options) {
        Err(e) => {
            for f in files(&tmp) {
                let _ = fs::remove_file(f);
            }
            Err(e)
        }
        Ok(mut summary) => {
            // The manifest last: a reader checks the data and index against it.
            for (from, to) in files(&tmp).into_iter().zip(files(out)) {
                fs::rename(&from, &to).map_err(|e| DataError::io(&to, e))?;
            }
            summary.outputs = files(out);
            Ok(summary)
        }
    }
}

/// Writes the pack of `src` at `out` (a temporary prefix: [`pack_image_folder_with`]).
fn write_pack(src: &Path, out: &Path, options: &PackOptions) -> Result<PackSummary> {
    if let Some(m) = options
        .max_side
        .filter(|&m| m == 0 || m > u32::from(u16::MAX))
    {
        return Err(DataError::Config {
            field: "max_side",
            message: format!("{m} (expected 1..=65535)"),
        });
    }
    if !(1..=100).contains(&options.quality) {
        return Err(DataError::Config {
            field: "quality",
            message: format!("{} (expected 1..=100)", options.quality),
        });
    }
    let mut downscaled = 0;
    let classes = class_dirs(src)?;
    if classes.is_empty() {
        return Err(DataError::format(
            src,
            "classes",
            "no sub-folders (expected one folder per class)",
        ));
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|e| DataError::io(parent, e))?;
    }
    let mut writer = RecordWriter::create(out)?;
    let mut labels: Vec<i64> = Vec::new();
    let mut per_class = Vec::with_capacity(classes.len());
    let mut skipped = Vec::new();
    // Downscaling decodes every photo: spread it over the cores, a few photos at a time.
    let threads = match options.max_side {
        Some(_) => std::thread::available_parallelism().map_or(1, |n| n.get()),
        None => 1,
    };
    let mut downscalers: Vec<Downscaler> = (0..threads).map(|_| Downscaler::default()).collect();
    let mut pending: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    let mut sources: Vec<String> = Vec::new();
    let mut folders_seen = std::collections::HashSet::new();
    for (label, name) in classes.iter().enumerate() {
        let mut files = Vec::new();
        walk_files(&src.join(name), &mut files, &mut folders_seen)?;
        // A class with no photos would still take a label, shifting every later one's
        // meaning past `model.classes` (torchvision's ImageFolder refuses it too).
        if files.is_empty() {
            return Err(DataError::format(
                src.join(name),
                "class folder",
                "holds no files: every class needs photos (remove the folder, or fill it)",
            ));
        }
        let before = labels.len();
        for file in files {
            let buf = fs::read(&file).map_err(|e| DataError::io(&file, e))?;
            if !(buf.len() >= 3 && buf[..3] == [0xFF, 0xD8, 0xFF]) {
                if options.skip_non_jpeg {
                    skipped.push(file);
                    continue;
                }
                return Err(DataError::format(
                    &file,
                    "SOI marker",
                    format!(
                        "not a JPEG: starts with {:02X?} (expected FF D8 FF); remove it or pack with --skip-non-jpeg",
                        &buf[..buf.len().min(3)]
                    ),
                ));
            }
            // A truncated or garbled file is named now, not as a record mid-epoch.
            crate::transform::structure::validate(&buf).map_err(|e| match e {
                DataError::Format { message, .. } => DataError::format(
                    &file,
                    "jpeg",
                    format!("{message}; remove or replace the file and pack again"),
                ),
                other => other,
            })?;
            let relative = file.strip_prefix(src).unwrap_or(&file);
            sources.push(relative.to_string_lossy().into_owned());
            pending.push((file, buf));
            if pending.len() >= 4 * threads {
                downscaled += flush(&mut pending, options, &mut downscalers, &mut writer)?;
            }
            labels.push(label as i64);
        }
        downscaled += flush(&mut pending, options, &mut downscalers, &mut writer)?;
        // Every file skipped (`skip_non_jpeg`): the class would take a label and no photo.
        if labels.len() == before {
            return Err(DataError::format(
                src.join(name),
                "class folder",
                "holds no JPEG photos (its files were skipped as not JPEG): every class needs photos",
            ));
        }
        per_class.push((labels.len() - before) as u64);
    }
    if labels.is_empty() {
        return Err(DataError::format(
            src,
            "images",
            "no JPEG files in any class folder",
        ));
    }
    let manifest = writer.finish()?;
    let labels_file = labels_path(out);
    write_npy(
        &labels_file,
        DType::I64,
        &[labels.len()],
        bytemuck::cast_slice(&labels),
    )?;
    let classes_file = classes_path(out);
    let json = serde_json::to_string_pretty(&classes).expect("names serialize");
    fs::write(&classes_file, json + "\n").map_err(|e| DataError::io(&classes_file, e))?;
    let sources_file = sources_path(out);
    PackSources {
        // Absolute: a run may start from another working directory.
        root: fs::canonicalize(src)
            .unwrap_or_else(|_| src.to_path_buf())
            .to_string_lossy()
            .into_owned(),
        files: sources,
    }
    .write(&sources_file)?;
    let paths = crate::records::RecordPaths::new(out);
    Ok(PackSummary {
        classes,
        per_class,
        manifest,
        skipped,
        downscaled,
        outputs: vec![
            paths.data,
            paths.index,
            paths.manifest,
            labels_file,
            classes_file,
            sources_file,
        ],
    })
}

/// Shrinks `pending` photos in parallel when `max_side` is set (one thread per downscaler,
/// contiguous runs), appends them all in order, and returns how many were shrunk. On failure
/// the error of the earliest failing run is returned, naming its file.
fn flush(
    pending: &mut Vec<(PathBuf, Vec<u8>)>,
    options: &PackOptions,
    downscalers: &mut [Downscaler],
    writer: &mut RecordWriter,
) -> Result<u64> {
    let mut shrunk = 0;
    if let Some(max_side) = options.max_side {
        let per = pending.len().div_ceil(downscalers.len()).max(1);
        let results: Vec<Result<u64>> = std::thread::scope(|s| {
            let runs: Vec<_> = pending
                .chunks_mut(per)
                .zip(downscalers.iter_mut())
                .map(|(run, d)| {
                    s.spawn(move || {
                        let mut n = 0;
                        for (file, bytes) in run.iter_mut() {
                            let small = d
                                .downscale_jpeg(bytes, max_side, options.quality)
                                .map_err(|e| DataError::format(&*file, "jpeg", e.to_string()))?;
                            if let Some(small) = small {
                                *bytes = small;
                                n += 1;
                            }
                        }
                        Ok(n)
                    })
                })
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("downscale thread panicked"))
                .collect()
        });
        for r in results {
            shrunk += r?;
        }
    }
    for (_, bytes) in pending.drain(..) {
        writer.append(&bytes)?;
    }
    Ok(shrunk)
}

/// Sub-folder names of `dir` that are not hidden, sorted; they must be valid UTF-8 to go
/// into the JSON list.
fn class_dirs(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let name = entry.file_name().into_string().map_err(|raw| {
            DataError::format(&path, "class name", format!("{raw:?} is not valid UTF-8"))
        })?;
        // Hidden folders (`.ipynb_checkpoints`, `.git`) are no classes, as `pack docs`
        // passes over hidden entries.
        if name.starts_with('.') {
            continue;
        }
        names.push(name);
    }
    names.sort();
    Ok(names)
}

/// Every regular file under `dir`, in byte order of its path, recursively. Symlinks are
/// followed (a class folder may link to another disk, as with torchvision's ImageFolder),
/// but a directory reached twice (a symlink loop, or two links to one folder) is an error,
/// not the same photos packed again (`seen` holds the canonical folders visited, across
/// classes); so is an entry that is neither a file nor a folder (a dangling link, a link to
/// itself, a socket), which would otherwise vanish silently.
fn walk_files(
    dir: &Path,
    out: &mut Vec<PathBuf>,
    seen: &mut std::collections::HashSet<PathBuf>,
) -> Result<()> {
    let real = fs::canonicalize(dir).map_err(|e| DataError::io(dir, e))?;
    if !seen.insert(real.clone()) {
        return Err(DataError::format(
            dir,
            "folder",
            format!(
                "{} is reached twice (a symlink loop, or two links to one folder): its photos would be packed twice",
                real.display()
            ),
        ));
    }
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| DataError::io(dir, e))?
        .map(|e| e.map(|e| e.path()).map_err(|err| DataError::io(dir, err)))
        .collect::<Result<_>>()?;
    entries.sort();
    for path in entries {
        let meta = fs::metadata(&path).map_err(|e| DataError::io(&path, e))?;
        let hidden = path
            .file_name()
            .is_some_and(|n| n.as_encoded_bytes().starts_with(b"."));
        if meta.is_dir() && hidden {
            // A hidden folder (`.ipynb_checkpoints`' copies of the photos) is no photos of
            // the class, at any depth, as it is no class at the top.
            continue;
        } else if meta.is_dir() {
            walk_files(&path, out, seen)?;
        } else if meta.is_file() {
            out.push(path);
        } else {
            return Err(DataError::format(
                &path,
                "file",
                "neither a regular file nor a folder (a device, socket or pipe)",
            ));
        }
    }
    Ok(())
}
