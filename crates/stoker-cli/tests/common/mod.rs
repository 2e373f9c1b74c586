//! What the multi-process tests share (`mpi_train.rs` under `mpirun`, `slurm.rs` under
//! `srun` and `sbatch`): the data they train on, the configs, and readers of a run's output.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use stoker_testkit::write_npy;

pub const STOKER: &str = env!("CARGO_BIN_EXE_stoker");

/// Whether `mpirun` is here; says so loudly when it is not.
pub fn have_mpirun(test: &str) -> bool {
    let ok = Command::new("mpirun").arg("--version").output().is_ok();
    if !ok {
        stoker_testkit::skip(
            test,
            "mpirun not found (scripts/install-deps.sh installs MPICH)",
        );
    }
    ok
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `stoker train CONFIG` on one rank, or under `mpirun -n ranks`, bounded by `timeout`.
pub fn train(ranks: usize, config: &Path, extra: &[&str]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", "180"]);
    if ranks > 1 {
        cmd.args(["mpirun", "-n", &ranks.to_string()]);
    }
    cmd.arg(STOKER)
        .arg("train")
        .arg(config)
        .arg("--no-progress")
        .args(extra);
    cmd.output().unwrap()
}

/// The value after `key` on the line that has it (`weights crc32: 1a2b...`).
pub fn field(o: &Output, key: &str) -> String {
    let out = String::from_utf8_lossy(&o.stdout);
    out.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no `{key}` in the output: {}", text(o)))
        .trim()
        .to_string()
}

/// The final checkpoint's weights (consolidated by `stoker ckpt consolidate` from its
/// shards), every tensor in name order, as f32.
pub fn final_weights(run_dir: &Path) -> Vec<f32> {
    let root = run_dir.join("checkpoints");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("step_")
        })
        .collect();
    dirs.sort();
    let out = root.join("consolidated.safetensors");
    let o = Command::new(STOKER)
        .args(["ckpt", "consolidate"])
        .arg(dirs.last().unwrap())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    names
        .iter()
        .flat_map(|n| {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>()
        })
        .collect()
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let d = stoker_testkit::rel_l2(a, b);
    assert!(d.is_finite(), "non-finite weights");
    d
}

/// The test data under `dir`: a char-level token shard (`corpus.bin`) and 8x8 images
/// with 4 classes (`images.*.npy`) and 6-wide vectors with 3 classes (`vectors.*.npy`).
pub fn write_data(dir: &Path) {
    let words = [
        "the", "cat", "sat", "on", "mat", "dog", "ran", "in", "fog", "we", "go", "to", "sea",
    ];
    let mut s = String::new();
    let mut z = 7u64;
    while s.len() < 20_000 {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(words[(z >> 33) as usize % words.len()]);
        s.push(' ');
    }
    std::fs::write(dir.join("text.txt"), s).unwrap();
    let o = Command::new(STOKER)
        .args(["pack", "text"])
        .arg(dir.join("corpus"))
        .arg(dir.join("text.txt"))
        .args(["--tokenizer", "char"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let n = 256;
    let px: Vec<u8> = (0..n * 64)
        .map(|i| ((i * 37 + i / 64 * 11) % 251) as u8)
        .collect();
    write_npy(&dir.join("images.image.npy"), "|u1", &[n, 1, 8, 8], &px);
    let labels: Vec<i64> = (0..n).map(|i| ((i * 7) % 4) as i64).collect();
    write_npy(
        &dir.join("images.label.npy"),
        "<i8",
        &[n],
        bytemuck::cast_slice(&labels),
    );
    let v: Vec<f32> = (0..n * 6)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
        .collect();
    write_npy(
        &dir.join("vectors.x.npy"),
        "<f4",
        &[n, 6],
        bytemuck::cast_slice(&v),
    );
    let l: Vec<i64> = (0..n).map(|i| ((i * 5) % 3) as i64).collect();
    write_npy(
        &dir.join("vectors.y.npy"),
        "<i8",
        &[n],
        bytemuck::cast_slice(&l),
    );
}

#[derive(Clone, Copy)]
pub enum Model {
    Gpt,
    Llama,
    Cnn,
    Mlp,
}

/// A config for `model` writing to `run`, with `extra` appended (as TOML lines inside the
/// `[parallel]` table, or whole tables).
pub fn config(
    dir: &Path,
    name: &str,
    model: Model,
    precision: &str,
    kernels: &str,
    steps: u64,
    extra: &str,
) -> PathBuf {
    let data = match model {
        Model::Gpt | Model::Llama => format!(
            "train = \"{}\"\nvocab = \"{}\"",
            dir.join("corpus.bin").display(),
            dir.join("corpus.vocab.json").display()
        ),
        Model::Cnn => format!(
            "train = \"{}\"\neval_fraction = 0.25",
            dir.join("images").display()
        ),
        Model::Mlp => format!(
            "train = \"{}\"\neval_fraction = 0.25\ninput_field = \"x\"\ntarget_field = \"y\"",
            dir.join("vectors").display()
        ),
    };
    let model_t = match model {
        Model::Gpt => "kind = \"gpt\"\nvocab = 16\ncontext = 16\nd_model = 16\nn_layer = 2\nn_head = 2",
        Model::Llama => "kind = \"llama\"\nvocab = 16\ncontext = 16\nd_model = 16\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nffn_hidden = 24",
        Model::Cnn => "kind = \"cnn\"\nin_channels = 1\nimage_size = 8\nchannels1 = 2\nchannels2 = 3\nhidden = 8\nclasses = 4",
        Model::Mlp => "kind = \"mlp\"\ninput_shape = [6]\nhidden = [8]\nclasses = 3",
    };
    let text = format!(
        r#"run_dir = "{run}"
seed = 5
precision = "{precision}"
kernels = "{kernels}"
[data]
{data}
[model]
{model_t}
[batch]
micro_batch = 2
global_batch = 8
[optimizer]
kind = "adamw"
lr = 1e-3
weight_decay = 0.1
grad_clip = 1.0
[train]
steps = {steps}
log_every = 1
eval_batches = 4
checkpoint_every = 2
[parallel]
bucket_cap_mb = 0.002
first_bucket_mb = 0.0005
{extra}
"#,
        run = dir.join(name).display()
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Waits (up to `secs` seconds) until `ready()` holds; the panic names `what`.
pub fn wait_for(what: &str, secs: u64, ready: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !ready() {
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "timed out after {secs} s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `cmd` with stdout and stderr into `log` through one file description (so that
/// they share the offset and interleave as written).
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    cmd.stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap()
}

/// The pid rank `rank` of `world` printed at its start (`stoker: rank R of N: pid P ...`).
pub fn rank_pid(log: &str, rank: usize, world: usize) -> Option<String> {
    let key = format!("rank {rank} of {world}: pid ");
    log.lines()
        .find_map(|l| l.split(&key).nth(1))
        .and_then(|l| l.split(' ').next())
        .map(String::from)
}
