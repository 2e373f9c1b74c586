//! End-to-end runs on small generated data: bit-identical resume, reduced precision
//! against fp32, and checkpoints that fail their checksum or do not match the model.

mod common;

use std::path::Path;

use common::*;
use stoker_train::config::TrainConfig;
use stoker_train::metrics::{read, Record};
use stoker_train::run::{run, Resume, RunOptions};
use stoker_train::TrainError;

fn config(dir: &Path, precision: &str, steps: u64, extra: &str) -> TrainConfig {
    if !dir.join("corpus.bin").exists() {
        write_token_corpus(&dir.join("corpus.bin"), 12_000);
    }
    TrainConfig::parse(
        &gpt_config(dir, precision, steps, extra),
        Path::new("test.toml"),
    )
    .unwrap()
}

fn losses(dir: &Path) -> Vec<(u64, u64)> {
    read(dir)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Train { step, loss, .. } => Some((step, loss.to_bits())),
            _ => None,
        })
        .collect()
}

/// Every rank's summary of a run of `c`'s `parallel.backend = "local"` ranks (threads).
fn every_rank(c: &TrainConfig, opts: RunOptions) -> Vec<stoker_train::run::RunSummary> {
    stoker_train::run::run_threads(c, &opts)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

#[test]
fn resume_continues_the_loss_curve_bit_identically() {
    // fp16 and fp8 also carry loss-scaler / FP8 delayed-scaler state through the checkpoint.
    for p in ["fp32", "fp16", "fp8"] {
        let tmp = tempfile::tempdir().unwrap();
        let a = tmp.path().join("a");
        std::fs::create_dir_all(&a).unwrap();
        let ca = config(&a, p, 8, "checkpoint_every = 4");
        run(&ca, &RunOptions::default()).unwrap();

        let b = tmp.path().join("b");
        std::fs::create_dir_all(&b).unwrap();
        let cb = config(&b, p, 8, "checkpoint_every = 4");
        run(
            &cb,
            &RunOptions {
                stop_after: Some(4),
                ..Default::default()
            },
        )
        .unwrap();
        let ckpt = cb.run_dir.join("checkpoints/step_00000004");
        run(
            &cb,
            &RunOptions {
                resume: Some(Resume::From(ckpt)),
                ..Default::default()
            },
        )
        .unwrap();

        let (la, lb) = (losses(&ca.run_dir), losses(&cb.run_dir));
        assert_eq!(la.len(), 8);
        assert_eq!(la, lb, "{p}: 2N steps vs N + resume + N");
    }
}

/// A run resumed from an earlier checkpoint is a new timeline: its checkpoints, not the
/// newer ones the run before it left, are what `latest` takes (`LATEST`, as DeepSpeed's
/// `latest`; before: the old timeline's newest, silently), and those are passed over with
/// a reason.
#[test]
fn latest_is_the_checkpoint_this_timeline_wrote_last() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp32", 4, "checkpoint_every = 1");
    run(&c, &RunOptions::default()).unwrap();
    let root = c.run_dir.join("checkpoints");
    let step = |n: u64| root.join(format!("step_{n:08}"));
    assert_eq!(stoker_train::checkpoint::latest(&root), Some(step(4)));
    run(
        &c,
        &RunOptions {
            resume: Some(Resume::From(step(1))),
            stop_after: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(stoker_train::checkpoint::latest(&root), Some(step(2)));
    let intact = stoker_train::checkpoint::latest_intact(&root);
    assert_eq!(intact.dir, Some(step(2)));
    let passed: Vec<_> = intact.skipped.iter().map(|(d, _)| d.clone()).collect();
    assert_eq!(passed, [step(4), step(3)]);
    assert!(
        intact.skipped[0].1.to_string().contains("newer than"),
        "{:?}",
        intact.skipped
    );
    // LATEST naming a checkpoint removed by hand: said as such (before: only the newer
    // ones passed over, and the resume's error called them failed).
    std::fs::remove_dir_all(step(2)).unwrap();
    std::fs::remove_dir_all(step(1)).unwrap();
    let intact = stoker_train::checkpoint::latest_intact(&root);
    assert_eq!(intact.dir, None);
    let gone = intact
        .skipped
        .iter()
        .find(|(d, _)| *d == step(2))
        .unwrap_or_else(|| panic!("{:?}", intact.skipped));
    assert!(gone.1.to_string().contains("but not there"), "{}", gone.1);
}

/// A resumed run's `elapsed_s` goes on from its checkpoint's (it restarted at 0), the
/// summary names the step of its last evaluation (a run stopped early ends after a
/// later one), and a finished run resubmitted (a job requeued after its last step)
/// trains nothing, keeps its weights and leaves the metrics log as it was (it printed a
/// NaN loss and wrote records of no steps).
#[test]
fn a_resumed_run_goes_on_in_time_and_a_finished_one_trains_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(
        tmp.path(),
        "fp32",
        6,
        "checkpoint_every = 3\neval_every = 2",
    );
    let stopped = RunOptions {
        stop_after: Some(5),
        ..Default::default()
    };
    let first = run(&c, &stopped).unwrap();
    assert_eq!((first.steps, first.steps_run()), (5, 5));
    assert_eq!(first.eval_step, Some(4));
    let root = c.run_dir.join("checkpoints");
    let resume = |step: u64| RunOptions {
        resume: Some(Resume::From(root.join(format!("step_{step:08}")))),
        ..Default::default()
    };
    let second = run(&c, &resume(5)).unwrap();
    assert_eq!((second.steps, second.steps_run()), (6, 1));
    assert_eq!(second.eval_step, Some(6));
    let elapsed: Vec<(u64, f64)> = read(&c.run_dir)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Train {
                step, elapsed_s, ..
            } => Some((step, elapsed_s)),
            _ => None,
        })
        .collect();
    assert_eq!(
        elapsed.iter().map(|e| e.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    assert!(
        elapsed.windows(2).all(|w| w[1].1 >= w[0].1),
        "elapsed_s goes back: {elapsed:?}"
    );
    let records = read(&c.run_dir).unwrap().len();
    let again = run(&c, &resume(6)).unwrap();
    assert_eq!((again.steps, again.steps_run()), (6, 0));
    assert_eq!(again.weights_crc32, second.weights_crc32);
    assert_eq!(again.eval_step, None);
    assert_eq!(read(&c.run_dir).unwrap().len(), records);
}

#[test]
fn bf16_and_fp16_reach_fp32_loss_within_2_percent() {
    let tmp = tempfile::tempdir().unwrap();
    let mut finals = Vec::new();
    for p in ["fp32", "bf16", "fp16", "fp8"] {
        let dir = tmp.path().join(p);
        std::fs::create_dir_all(&dir).unwrap();
        let c = config(&dir, p, 40, "");
        let s = run(&c, &RunOptions::default()).unwrap();
        let l = losses(&c.run_dir);
        let first = f64::from_bits(l[0].1);
        // Mean of the last 5 steps smooths single-batch noise.
        let last: f64 = l[l.len() - 5..]
            .iter()
            .map(|x| f64::from_bits(x.1))
            .sum::<f64>()
            / 5.0;
        assert!(
            last < 0.7 * first,
            "{p}: loss {first} -> {last} did not fall"
        );
        finals.push((p, last, s.eval.unwrap().loss));
    }
    eprintln!("final losses (train mean of last 5, eval): {finals:?}");
    let fp32 = finals[0].1;
    for (p, last, _) in &finals[1..3] {
        let rel = (last - fp32).abs() / fp32;
        assert!(
            rel < 0.02,
            "{p}: final loss {last} vs fp32 {fp32} ({:.2}%)",
            100.0 * rel
        );
    }
}

#[test]
fn corrupt_or_mismatched_checkpoints_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp32", 2, "");
    run(&c, &RunOptions::default()).unwrap();
    let ckpt = c.run_dir.join("checkpoints/step_00000002");

    // A different model (wider) does not match.
    let other = TrainConfig::parse(
        &gpt_config(tmp.path(), "fp32", 2, "").replace("d_model = 32", "d_model = 16"),
        Path::new("t.toml"),
    )
    .unwrap();
    let err = run(
        &other,
        &RunOptions {
            resume: Some(Resume::From(ckpt.clone())),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, TrainError::Checkpoint { .. })
            && err.to_string().contains("does not match the model"),
        "{err}"
    );

    let resume = |dir: &Path| {
        run(
            &c,
            &RunOptions {
                resume: Some(Resume::From(dir.to_path_buf())),
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string()
    };
    // Another optimizer keeps other buffers: refused naming the manifest key.
    let sgd = TrainConfig::parse(
        &gpt_config(tmp.path(), "fp32", 2, "").replace("kind = \"adamw\"", "kind = \"sgd\""),
        Path::new("t.toml"),
    )
    .unwrap();
    let err = run(
        &sgd,
        &RunOptions {
            resume: Some(Resume::From(ckpt.clone())),
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("manifest.json") && err.contains("optimizer_buffers"),
        "{err}"
    );

    // One flipped byte in a shard fails its checksum, naming the file.
    let path = ckpt.join("shard_00000.safetensors");
    let good = std::fs::read(&path).unwrap();
    let mut bytes = good.clone();
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let err = resume(&ckpt);
    assert!(
        err.contains("checksum mismatch") && err.contains("shard_00000.safetensors"),
        "{err}"
    );
    // A truncated shard says how many bytes it holds; an emptied one is named, with its
    // size, where the layout cannot fit the shards (before: only manifest.json named).
    std::fs::write(&path, &good[..good.len() / 2]).unwrap();
    let err = resume(&ckpt);
    assert!(
        err.contains("shard_00000.safetensors")
            && err.contains(&format!("it holds {} bytes", good.len() / 2)),
        "{err}"
    );
    std::fs::write(&path, b"").unwrap();
    let err = resume(&ckpt);
    assert!(
        err.contains("(shard_00000.safetensors: 0 bytes): a shard file is truncated or empty"),
        "{err}"
    );
    // A missing shard names the file.
    std::fs::remove_file(&path).unwrap();
    let err = resume(&ckpt);
    assert!(err.contains("shard_00000.safetensors"), "{err}");
    std::fs::write(&path, good).unwrap();
    // An edited manifest fails the commit marker's checksum.
    let m = ckpt.join("manifest.json");
    let text = std::fs::read_to_string(&m).unwrap();
    std::fs::write(&m, text.replace("\"world_size\": 1", "\"world_size\": 2")).unwrap();
    let err = resume(&ckpt);
    assert!(
        err.contains("manifest.json") && err.contains("checksum mismatch"),
        "{err}"
    );
    std::fs::write(&m, text).unwrap();
    // Without its commit marker (a save that crashed) it is refused, and `latest` skips it.
    std::fs::remove_file(ckpt.join("COMMITTED")).unwrap();
    let err = resume(&ckpt);
    assert!(err.contains("COMMITTED"), "{err}");
    let root = c.run_dir.join("checkpoints");
    assert_ne!(stoker_train::checkpoint::latest(&root), Some(ckpt));
}

#[test]
fn consolidated_weights_are_plain_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "bf16", 1, "");
    run(&c, &RunOptions::default()).unwrap();
    let out =
        stoker_train::checkpoint::consolidate(&c.run_dir.join("checkpoints/step_00000001"), None)
            .unwrap();
    let bytes = std::fs::read(out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let wte = st.tensor("wte.weight").unwrap();
    assert_eq!(wte.shape(), &[24, 32]);
    assert_eq!(wte.dtype(), safetensors::Dtype::F32); // FP32 master, not the bf16 copy
                                                      // Never over a file of the checkpoint (before: the shard was overwritten, "wrote").
    let dir = c.run_dir.join("checkpoints/step_00000001");
    for name in ["shard_00000.safetensors", "manifest.json", "COMMITTED"] {
        let e = stoker_train::checkpoint::consolidate(&dir, Some(&dir.join(name)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is a file of the checkpoint being consolidated"),
            "{e}"
        );
    }
    stoker_train::checkpoint::verify(&dir).unwrap();
    // A layout edited to another shape of the same length (the marker recomputed, so the
    // checksum passes) is refused against the model table the checkpoint records, by
    // consolidate and verify alike (before: consolidate wrote `wte.weight` as [32, 24]).
    let path = dir.join("manifest.json");
    let text = std::fs::read(&path).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&text).unwrap();
    let slot = &mut v["layout"]["slots"][0];
    assert_eq!(slot["name"], "wte.weight");
    slot["shape"] = serde_json::json!([32, 24]);
    let edited = serde_json::to_vec_pretty(&v).unwrap();
    let commit = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        let crc = format!("{:08x}\n", crc32fast::hash(bytes));
        std::fs::write(dir.join("COMMITTED"), crc).unwrap();
    };
    commit(&edited);
    let e = [
        stoker_train::checkpoint::verify(&dir)
            .map(|_| ())
            .unwrap_err()
            .to_string(),
        stoker_train::checkpoint::consolidate(&dir, Some(&tmp.path().join("x.safetensors")))
            .map(|_| ())
            .unwrap_err()
            .to_string(),
    ];
    for e in e {
        assert!(
            e.contains("manifest.json")
                && e.contains("layout does not match its own model table")
                && e.contains("`wte.weight` [32, 24] where the model has `wte.weight` [24, 32]"),
            "{e}"
        );
    }
    // A table that cannot declare a model is refused by its key (before: a division by
    // zero while declaring it ended the process, and `--resume latest` with it).
    let mut v: serde_json::Value = serde_json::from_slice(&text).unwrap();
    v["model"]["n_head"] = serde_json::json!(0);
    commit(&serde_json::to_vec_pretty(&v).unwrap());
    let e = stoker_train::checkpoint::verify(&dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.n_head: must be at least 1"), "{e}");
    commit(&text);
    stoker_train::checkpoint::verify(&dir).unwrap();
    // Given the run directory (DeepSpeed's zero_to_fp32 takes the root), verify and
    // consolidate say alike that it is not one checkpoint and name the newest to give
    // (before: consolidate said the manifest file was missing, verify gave no hint).
    let e = [
        stoker_train::checkpoint::verify(&c.run_dir)
            .map(|_| ())
            .unwrap_err()
            .to_string(),
        stoker_train::checkpoint::consolidate(&c.run_dir, None)
            .map(|_| ())
            .unwrap_err()
            .to_string(),
    ];
    for e in e {
        assert!(
            e.contains("not a stoker checkpoint directory")
                && e.contains("give one checkpoint, e.g.")
                && e.contains("step_00000001"),
            "{e}"
        );
    }
    // A shard's permissions are a new file's (the umask's), as the manifest's: not the
    // 0600 of safetensors' temporary file.
    use std::os::unix::fs::PermissionsExt;
    let mode = |n: &str| std::fs::metadata(dir.join(n)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("shard_00000.safetensors"), mode("manifest.json"));
}

/// The printed weights' CRC-32 is the whole FP32 master's at every strategy: under ZeRO-3
/// the ranks combine their shards' CRCs instead of gathering the buffer. It equals the CRC
/// of the final checkpoint's master read back whole, and is the same for DDP and ZeRO-1
/// in deterministic mode at 2 ranks as at 1.
#[test]
fn the_weights_crc_is_the_whole_master_s_at_every_strategy() {
    let tmp = tempfile::tempdir().unwrap();
    let mut crcs = Vec::new();
    for (ranks, strategy, det) in [
        (1, "ddp", true),
        (2, "ddp", true),
        (2, "zero1", true),
        (2, "zero3", false),
    ] {
        let dir = tmp.path().join(format!("{strategy}{ranks}"));
        std::fs::create_dir_all(&dir).unwrap();
        write_token_corpus(&dir.join("corpus.bin"), 12_000);
        let extra = format!(
            "[parallel]\nstrategy = \"{strategy}\"\nbackend = \"local\"\ndeterministic = {det}\n"
        );
        let text = gpt_config(&dir, "fp32", 3, &extra).replace(
            "accumulation_steps = 2\n",
            &format!("accumulation_steps = {}\nworld_size = {ranks}\n", 2 / ranks),
        );
        let c = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
        let s = stoker_train::run::run_threads(&c, &RunOptions::default())
            .unwrap()
            .remove(0)
            .unwrap();
        let (_, master) = stoker_train::checkpoint::consolidate::read_params(
            &c.run_dir.join("checkpoints/step_00000003"),
        )
        .unwrap();
        let whole = crc32fast::hash(bytemuck::cast_slice(&master));
        assert_eq!(s.weights_crc32, whole, "{strategy} on {ranks}");
        crcs.push((strategy, ranks, whole));
        if strategy == "zero3" {
            zero3_shards_are_a_piece_of_every_group(&c.run_dir.join("checkpoints/step_00000003"));
        }
    }
    assert!(crcs[..3].iter().all(|c| c.2 == crcs[0].2), "{crcs:x?}");
}

/// A 2-rank ZeRO-3 checkpoint: each rank saved what it holds, a piece of every parameter
/// group (the manifest lists them), half the buffer each to within alignment; pieces that
/// overlap another shard's are refused naming the manifest.
fn zero3_shards_are_a_piece_of_every_group(ckpt: &Path) {
    let m = stoker_train::checkpoint::sharded::read_manifest(ckpt).unwrap();
    let groups = m.layout.group_spans().unwrap();
    let len = m.layout.total_len();
    for s in &m.shards {
        let pieces = s.try_pieces().unwrap();
        // One piece per group, except where a group's last unit went to the other rank
        // and two of this rank's pieces met.
        assert!(pieces.ranges().len() > groups.len() / 2, "{s:?}");
        for g in &groups {
            let mine = pieces.owned_len(g) as f64;
            assert!(
                (mine - g.len() as f64 / 2.0).abs() <= 16.0,
                "{s:?} of group {g:?}"
            );
        }
        assert!(
            (pieces.len() as f64 - len as f64 / 2.0).abs() <= 16.0,
            "{s:?}"
        );
    }
    let path = ckpt.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["shards"][1]["pieces"][0][0] = serde_json::json!(0);
    v["shards"][1]["start"] = serde_json::json!(0);
    let bytes = serde_json::to_vec_pretty(&v).unwrap();
    std::fs::write(&path, &bytes).unwrap();
    std::fs::write(
        ckpt.join("COMMITTED"),
        format!("{:08x}\n", crc32fast::hash(&bytes)),
    )
    .unwrap();
    let err = stoker_train::checkpoint::sharded::read_manifest(ckpt)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("manifest.json") && err.contains("tile the buffer"),
        "{err}"
    );
}

#[test]
fn report_writes_seven_pngs_with_planned_vs_measured() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp16", 3, "eval_every = 2");
    run(&c, &RunOptions::default()).unwrap();
    let files = stoker_train::report::write_report(&c.run_dir).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "loss.png",
            "throughput.png",
            "loader_wait.png",
            "loss_scale.png",
            "memory.png",
            "step_time.png",
            "lr.png"
        ]
    );
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{}", f.display());
    }
    // A last line cut short (a run that crashed mid-write) is dropped, not fatal.
    let metrics = c.run_dir.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"kind\":\"train\",\"step\":4,\"lo");
    std::fs::write(&metrics, text).unwrap();
    let again = stoker_train::report::write_report(&c.run_dir).unwrap();
    assert_eq!(again, files);
    // Records with nothing to plot: an error naming the file (before: exit status 0, no
    // file), and the earlier report's plots are not left beside them.
    std::fs::write(&metrics, "").unwrap();
    let e = stoker_train::report::write_report(&c.run_dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("metrics.jsonl") && e.contains("no training or evaluation records"),
        "{e}"
    );
    assert!(files.iter().all(|f| !f.exists()), "stale plots left");
}

/// Evaluation and checkpoint time are measured on their own and kept out of the training
/// throughput (the demo's throughput plot no longer dips at every evaluation).
#[test]
fn evaluation_and_checkpoint_time_are_reported_apart_from_training() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(
        tmp.path(),
        "fp32",
        4,
        "eval_every = 2\ncheckpoint_every = 2",
    );
    let s = run(&c, &RunOptions::default()).unwrap();
    assert!(
        s.eval_s > 0.0 && s.checkpoint_s > 0.0,
        "{} {}",
        s.eval_s,
        s.checkpoint_s
    );
    assert!(
        s.throughput.is_finite() && s.throughput > 0.0,
        "{}",
        s.throughput
    );
    assert_eq!(s.step_times_s.len(), 4);
}

/// `--dry-run` predicts what the run then holds: the same plan, and the bytes the run's
/// buffers hold, counted, equal to it; nothing is written.
#[test]
fn a_dry_run_plans_what_the_run_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "bf16", 2, "");
    let d = stoker_train::dry_run::dry_run(&c, 1, None, None).unwrap();
    assert!(
        !c.run_dir.exists(),
        "a dry run wrote {}",
        c.run_dir.display()
    );
    let s = run(&c, &RunOptions::default()).unwrap();
    assert_eq!(d.planned, s.planned);
    assert_eq!(d.params, s.params);
    assert_eq!(s.held.model_states() as f64, d.planned.model_states());
    // At 3 ranks the batch is 3x (the config pins the accumulation, not the global batch).
    let d3 = stoker_train::dry_run::dry_run(&c, 3, None, None).unwrap();
    assert_eq!(d3.dims.global_batch, 3 * d.dims.global_batch);
}

/// bf16 on a CPU without bf16 hardware runs candle's emulated bf16 (5x slower than fp32
/// on this project's AVX2 machine), and the run says so at its start; fp32 never.
#[test]
fn bf16_without_bf16_hardware_is_named_as_slow() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = config(tmp.path(), "bf16", 2, "");
    let fp32 = config(tmp.path(), "fp32", 2, "");
    let native = stoker_kernels::bf16_native();
    let why = stoker_train::run::slow_precision(&bf16);
    assert_eq!(why.is_some(), !native, "{why:?}");
    if let Some(w) = why {
        assert!(w.contains("precision = \"fp32\""), "{w}");
    }
    assert_eq!(stoker_train::run::slow_precision(&fp32), None);
    // candle's composed ops emulate bf16 whatever the CPU: the warning names the cause
    // (before, it called a CPU with bf16 instructions one without).
    let text = gpt_config(tmp.path(), "bf16", 2, "").replacen(
        "seed = 3\n",
        "seed = 3\nstep = \"graph\"\nkernels = \"composed\"\n",
        1,
    );
    let composed = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let w = stoker_train::run::slow_precision(&composed).expect("composed bf16 is slow");
    match native {
        true => assert!(
            w.contains("kernels = \"composed\"") && !w.contains("without"),
            "{w}"
        ),
        false => assert!(w.contains("without bf16 instructions"), "{w}"),
    }
}

/// `step = "handwritten" | "graph"` chooses the step path; `kernels` names the graph's ops.
/// `kernels = "direct"`, the older name of the handwritten step, still works and the
/// config says it was renamed; contradictions are refused naming `kernels`; a config
/// written back (the run directory's `config.toml`) parses to the same config, silently.
#[test]
fn step_chooses_the_path_and_the_older_kernels_key_still_works() {
    use stoker_train::config::StepKind;
    use stoker_train::precision::Kernels;
    let tmp = tempfile::tempdir().unwrap();
    let text = |top: &str| {
        gpt_config(tmp.path(), "fp32", 2, "").replacen(
            "seed = 3\n",
            &format!("seed = 3\n{top}\n"),
            1,
        )
    };
    let parse = |top: &str| TrainConfig::parse(&text(top), Path::new("t.toml"));
    let cases = [
        ("", StepKind::Handwritten, Kernels::Direct, false),
        (
            "kernels = \"direct\"",
            StepKind::Handwritten,
            Kernels::Direct,
            true,
        ),
        (
            "kernels = \"fused\"",
            StepKind::Graph,
            Kernels::Fused,
            false,
        ),
        (
            "kernels = \"composed\"",
            StepKind::Graph,
            Kernels::Composed,
            false,
        ),
        (
            "step = \"handwritten\"",
            StepKind::Handwritten,
            Kernels::Direct,
            false,
        ),
        ("step = \"graph\"", StepKind::Graph, Kernels::Fused, false),
        (
            "step = \"graph\"\nkernels = \"composed\"",
            StepKind::Graph,
            Kernels::Composed,
            false,
        ),
    ];
    for (top, step, kernels, renamed) in cases {
        let c = parse(top).unwrap();
        assert_eq!((c.step, c.kernels), (Some(step), kernels), "{top:?}");
        assert_eq!(
            c.notes.iter().any(|n| n.contains("step = \"handwritten\"")),
            renamed,
            "{top:?}: {:?}",
            c.notes
        );
        let again = TrainConfig::parse(&toml::to_string(&c).unwrap(), Path::new("w.toml")).unwrap();
        assert_eq!(
            again,
            TrainConfig {
                notes: vec![],
                ..c.clone()
            },
            "{top:?} written back"
        );
    }
    for top in [
        "step = \"graph\"\nkernels = \"direct\"",
        "step = \"handwritten\"\nkernels = \"composed\"",
    ] {
        let e = parse(top).unwrap_err().to_string();
        assert!(e.contains("`kernels`"), "{top:?}: {e}");
    }
}

/// (step, loss bits) of each record of one kind.
type LossCurve = Vec<(u64, u64)>;

/// A run's train losses and evaluation losses, as bits.
fn train_and_eval_losses(dir: &Path) -> (LossCurve, LossCurve) {
    let eval = read(dir)
        .unwrap()
        .into_iter()
        .filter_map(|r| match r {
            Record::Eval { step, loss, .. } => Some((step, loss.to_bits())),
            _ => None,
        })
        .collect();
    (losses(dir), eval)
}

#[test]
fn the_resident_loop_runs_whole_runs_that_resume_bit_identically() {
    // The resident loop (`step = "resident"`, one rank, ZeRO-1 and ZeRO-3 on two) inside
    // the run: loader, schedule, evaluation (ZeRO-3's a collective), checkpoints (the
    // master and moments read back from the loop, the shards gathered), resume (sent
    // back down) and the closing CRC.
    for (ranks, strategy) in [(1, "none"), (2, "zero1"), (2, "zero3")] {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = |name: &str| {
            let dir = tmp.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            write_token_corpus(&dir.join("corpus.bin"), 12_000);
            let extra = format!(
                "checkpoint_every = 4\neval_every = 4\n[parallel]\nstrategy = \"{strategy}\"\nbackend = \"local\"\n"
            );
            let text = gpt_config(&dir, "fp32", 8, &extra)
                .replace("[data]", "step = \"resident\"\n[data]")
                .replace(
                    "accumulation_steps = 2\n",
                    &format!("accumulation_steps = {}\nworld_size = {ranks}\n", 2 / ranks),
                );
            TrainConfig::parse(&text, Path::new("test.toml")).unwrap()
        };
        let ca = cfg("a");
        let a = every_rank(&ca, RunOptions::default());
        let cb = cfg("b");
        let stop = RunOptions {
            stop_after: Some(4),
            ..Default::default()
        };
        every_rank(&cb, stop);
        let resume = RunOptions {
            resume: Some(Resume::From(cb.run_dir.join("checkpoints/step_00000004"))),
            ..Default::default()
        };
        let b = every_rank(&cb, resume);
        let (want, got) = (
            train_and_eval_losses(&ca.run_dir),
            train_and_eval_losses(&cb.run_dir),
        );
        let what = format!("resident {strategy} on {ranks}");
        assert_eq!(want.0.len(), 8, "{what}: train records");
        assert_eq!(want.1.len(), 2, "{what}: eval records");
        assert_eq!(want, got, "{what}: 2N steps vs N + resume + N");
        // The closing CRC is the checkpoint's whole master, the same on every rank.
        let (_, master) = stoker_train::checkpoint::consolidate::read_params(
            &ca.run_dir.join("checkpoints/step_00000008"),
        )
        .unwrap();
        let whole = crc32fast::hash(bytemuck::cast_slice(&master));
        for s in a.iter().chain(&b) {
            assert_eq!(s.weights_crc32, whole, "{what}: the closing CRC");
        }
    }
}

/// A signal during an evaluation stops the run within a chunk of batches: the ranks agree
/// between chunks, the cut-short evaluation is not logged, and a checkpoint of the step is
/// written saying the evaluation is owed; a signal before a due evaluation skips it the
/// same way. The last step's evaluation stops too. A resume runs the owed evaluation
/// first, and the run's evaluations then equal an uninterrupted run's, bit for bit. On
/// one rank and on two (threads), where the evaluation's chunks and the checks are
/// collectives.
#[test]
fn a_signal_during_an_evaluation_stops_the_run_within_a_chunk() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    // (ranks, steps, eval_every, stop_in_eval, flag up from the start, the step it stops at)
    let cases = [
        (1, 6, 1, Some(9), false, 1),
        (2, 6, 1, Some(1), false, 1),
        (2, 6, 1, None, true, 1),
        // The last step's evaluation (eval_every 0: the end only).
        (2, 2, 0, Some(1), false, 2),
    ];
    for (world, steps, eval_every, stop_in_eval, flag_at_start, step) in cases {
        let config = |dir: &Path| {
            // 30 evaluation batches: chunks of 8, 8, 8 and 6.
            let extra = format!("eval_every = {eval_every}\n[parallel]\nbackend = \"local\"\n");
            let text = gpt_config(dir, "fp32", steps, &extra)
                .replace(
                    "accumulation_steps = 2\n",
                    &format!("accumulation_steps = {}\nworld_size = {world}\n", 2 / world),
                )
                .replace("eval_batches = 4", "eval_batches = 30");
            write_token_corpus(&dir.join("corpus.bin"), 60_000);
            TrainConfig::parse(&text, Path::new("test.toml")).unwrap()
        };
        let evals = |c: &TrainConfig| train_and_eval_losses(&c.run_dir).1;
        let (tmp, reference) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let c = config(tmp.path());
        let what = format!(
            "{world} rank(s), {steps} steps, stop_in_eval {stop_in_eval:?}, flag {flag_at_start}"
        );
        let flag = Arc::new(AtomicBool::new(flag_at_start));
        let summaries = every_rank(
            &c,
            RunOptions {
                stop: Some(flag.clone()),
                stop_in_eval,
                ..Default::default()
            },
        );
        assert!(flag.load(Ordering::SeqCst), "{what}: the flag was raised");
        for s in &summaries {
            assert!(s.preempted, "{what}");
            assert_eq!(s.steps, step, "{what}");
            assert_eq!(
                s.eval_step, None,
                "{what}: the cut-short evaluation is not kept"
            );
            assert_eq!(
                s.eval_s > 0.0,
                !flag_at_start,
                "{what}: evaluated for {} s",
                s.eval_s
            );
        }
        assert_eq!(evals(&c), [], "{what}: no evaluation logged");
        let ckpt = c.run_dir.join(format!("checkpoints/step_{step:08}"));
        let manifest = std::fs::read_to_string(ckpt.join("manifest.json")).unwrap();
        assert!(
            manifest.contains("\"eval_pending\": true"),
            "{what}: {manifest}"
        );
        // The resume evaluates first, then trains on; its evaluations are an
        // uninterrupted run's.
        let resumed = every_rank(
            &c,
            RunOptions {
                resume: Some(Resume::Latest(c.run_dir.join("checkpoints"))),
                ..Default::default()
            },
        );
        assert!(!resumed[0].preempted, "{what}: the resume ran to the end");
        assert_eq!(resumed[0].steps, steps, "{what}");
        let r = config(reference.path());
        every_rank(&r, RunOptions::default());
        let want = evals(&r);
        assert_eq!(
            want.len() as u64,
            if eval_every == 1 { steps } else { 1 },
            "{what}"
        );
        assert_eq!(
            evals(&c),
            want,
            "{what}: the evaluations of a run never stopped"
        );
        // Resubmitted once more (a requeue of the finished job): nothing to train, and an
        // evaluation the latest checkpoint owes is logged once, not again beside itself.
        every_rank(
            &c,
            RunOptions {
                resume: Some(Resume::Latest(c.run_dir.join("checkpoints"))),
                ..Default::default()
            },
        );
        assert_eq!(evals(&c), want, "{what}: resubmitted");
    }
}

/// An evaluation of many batches, in chunks, gives the same numbers at every world size,
/// and a run that is never signalled evaluates every batch.
#[test]
fn a_chunked_evaluation_is_the_same_at_one_and_two_ranks() {
    let mut evals = Vec::new();
    for world in [1, 2] {
        let tmp = tempfile::tempdir().unwrap();
        let extra = "eval_every = 2\n[parallel]\nbackend = \"local\"\n\
                     deterministic = true\n";
        let text = gpt_config(tmp.path(), "fp32", 2, extra)
            .replace(
                "accumulation_steps = 2\n",
                &format!("accumulation_steps = {}\nworld_size = {world}\n", 2 / world),
            )
            .replace("eval_batches = 4", "eval_batches = 30");
        write_token_corpus(&tmp.path().join("corpus.bin"), 60_000);
        let c = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
        let s = every_rank(&c, RunOptions::default());
        let e = s[0].eval.expect("an evaluation");
        for r in &s {
            let f = r.eval.expect("every rank's evaluation");
            assert_eq!(f.loss.to_bits(), e.loss.to_bits(), "{world} ranks agree");
        }
        // 30 batches of micro-batch 4 windows of 16 tokens: every target counted.
        assert_eq!(e.count, 30 * 4 * 16, "{world} rank(s)");
        assert!(e.loss.is_finite(), "{world} rank(s): {}", e.loss);
        evals.push(e);
    }
    assert!(
        (evals[0].loss - evals[1].loss).abs() <= 1e-12 * evals[0].loss.abs(),
        "1 rank {} vs 2 ranks {}",
        evals[0].loss,
        evals[1].loss
    );
    assert_eq!(evals[0].accuracy.to_bits(), evals[1].accuracy.to_bits());
}

#[test]
fn the_data_is_checked_before_the_weights_are_made_and_a_master_past_memory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    write_token_corpus(&d.join("corpus.bin"), 12_000);
    // 10^10 rows of 32: 320G parameters, 1.2 TiB of FP32 master, whatever the machine.
    let text = gpt_config(d, "fp32", 1, "").replace("vocab = 24", "vocab = 10000000000");
    let parse = |t: &str| TrainConfig::parse(t, Path::new("test.toml")).unwrap();
    // A context past the data's 12,000 tokens: the data's error, before any weight is
    // made (allocating these would abort the process).
    let e = run(
        &parse(&text.replace("context = 16", "context = 100000")),
        &RunOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("data.train") && e.contains("not one window of context 100000"),
        "{e}"
    );
    // No evaluation data: a fraction of 0 holds none out, named as the key's doing.
    let none = text.replace("[model]", "eval_fraction = 0.0\n[model]");
    match run(&parse(&none), &RunOptions::default()) {
        Err(TrainError::Config { key, .. }) => assert_eq!(key, "data.eval_fraction"),
        other => panic!("expected data.eval_fraction refused, got {other:?}"),
    }
    // The data fits: the model is refused by its size, naming the key.
    assert!(
        stoker_data::measure::memory_limit_bytes().is_some(),
        "this test needs /proc/meminfo to know the machine's memory"
    );
    match run(&parse(&text), &RunOptions::default()) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "model");
            assert!(
                message.contains("320000") && message.contains("FP32 master"),
                "{message}"
            );
        }
        other => panic!("expected the model's size refused, got {other:?}"),
    }
}

#[test]
fn evaluation_counts_every_held_out_window_the_short_last_batch_too() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let c = config(d, "fp32", 2, "");
    let text = gpt_config(d, "fp32", 2, "").replace("eval_batches = 4", "eval_batches = 1000");
    let c_all = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
    // The held-out tenth of the corpus's 16-token windows (data.eval_fraction's default).
    let shard = stoker_data::TokenShard::open_detect(d.join("corpus.bin")).unwrap();
    let windows = (shard.len() - 1) / 16;
    let held = (windows as f64 * 0.1).round() as usize;
    assert_ne!(
        held % 4,
        0,
        "the test wants a short last batch of micro_batch 4"
    );
    let all = run(&c_all, &RunOptions::default()).unwrap().eval.unwrap();
    // The short last batch's rows padded to the micro-batch count nothing: a padded row
    // counted would add 16.
    assert_eq!(all.count, held * 16, "every held-out window's targets");
    assert!(all.loss.is_finite() && all.loss > 0.0, "{}", all.loss);
    // eval_batches still takes that many whole batches where the set has more.
    let _ = std::fs::remove_dir_all(&c.run_dir);
    let four = run(&c, &RunOptions::default()).unwrap().eval.unwrap();
    assert_eq!(four.count, 4 * 4 * 16);
}

/// A manifest whose layout was edited (its CRC recomputed, so it reads as intact) is
/// refused by name before anything allocates its total or slices by its slots: a slot
/// moved past the total, a shape that is not its length, two slots overlapping, a name
/// twice, a total larger than the shards hold. Before, consolidation panicked, aborted
/// allocating, or wrote one tensor's values under another's name.
#[test]
fn an_edited_manifest_layout_is_refused_before_it_is_used() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp32", 2, "checkpoint_every = 2");
    run(&c, &RunOptions::default()).unwrap();
    let ckpt = c.run_dir.join("checkpoints/step_00000002");
    /// A manifest edit: its name, the edit, and what the refusal says.
    type Edit = (&'static str, fn(&mut serde_json::Value), &'static str);
    let edits: [Edit; 5] = [
        (
            "past",
            |m| {
                let last = m["layout"]["slots"].as_array().unwrap().len() - 1;
                let o = m["layout"]["slots"][last]["offset"].as_u64().unwrap();
                m["layout"]["slots"][last]["offset"] = (o + 16).into();
            },
            "runs past the total",
        ),
        (
            "shape",
            |m| m["layout"]["slots"][0]["shape"][0] = 97.into(),
            "length",
        ),
        (
            "overlap",
            |m| m["layout"]["slots"][1]["offset"] = 0.into(),
            "inside the slot before it",
        ),
        (
            "twice",
            |m| {
                let first = m["layout"]["slots"][0]["name"].clone();
                m["layout"]["slots"][1]["name"] = first;
            },
            "appears twice",
        ),
        (
            "total",
            |m| {
                m["layout"]["total"] = (1u64 << 40).into();
                let last = m["shards"].as_array().unwrap().len() - 1;
                m["shards"][last]["end"] = (1u64 << 40).into();
            },
            "more than the",
        ),
    ];
    // A copy of the checkpoint at `to` with its manifest edited and its COMMITTED
    // checksum recomputed, so that it reads as intact.
    let edited_copy = |to: &std::path::Path, edit: fn(&mut serde_json::Value)| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(&ckpt).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        let path = to.join("manifest.json");
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut m);
        let bytes = serde_json::to_vec(&m).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        std::fs::write(
            to.join("COMMITTED"),
            format!("{:08x}\n", crc32fast::hash(&bytes)),
        )
        .unwrap();
    };
    for (name, edit, says) in edits {
        let ck = tmp.path().join(name);
        edited_copy(&ck, edit);
        for e in [
            stoker_train::checkpoint::verify(&ck)
                .map(|_| ())
                .unwrap_err(),
            stoker_train::checkpoint::consolidate::consolidate(&ck, None)
                .map(|_| ())
                .unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(
                e.contains("manifest.json") && e.contains("layout: ") && e.contains(says),
                "{name}: {e}"
            );
        }
    }
    // Counts the manifest gives twice that disagree, and a step its directory is not
    // named for (before: "intact", and a resume from step 18 at step 20's data position).
    let copy_to = |to: &std::path::Path, edit: fn(&mut serde_json::Value)| {
        edited_copy(to, edit);
        stoker_train::checkpoint::verify(to)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = copy_to(&tmp.path().join("ranks"), |m| m["world_size"] = 5.into());
    assert!(e.contains("world_size 5, but data.world_size 1"), "{e}");
    let e = copy_to(&tmp.path().join("step_00000002"), |m| m["step"] = 1.into());
    assert!(
        e.contains("step 1, but its directory is named for step 2"),
        "{e}"
    );
}

/// A fresh run in a run directory that holds an earlier run's checkpoints is refused,
/// naming the key and the way on: before, it wrote its own beside them, and `--resume
/// latest` then continued the earlier run's newest, silently.
#[test]
fn a_fresh_run_beside_an_earlier_run_s_checkpoints_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp32", 4, "checkpoint_every = 2");
    run(&c, &RunOptions::default()).unwrap();
    match run(&c, &RunOptions::default()) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "run_dir");
            assert!(
                message.contains("2 checkpoint(s) of an earlier run")
                    && message.contains("step_00000004")
                    && message.contains("--resume latest"),
                "{message}"
            );
        }
        other => panic!("expected run_dir refused, got {other:?}"),
    }
    // Resuming it under another seed (which orders the data) is refused by name too.
    let text =
        gpt_config(tmp.path(), "fp32", 4, "checkpoint_every = 2").replace("seed = 3", "seed = 4");
    let other = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
    let resume = RunOptions {
        resume: Some(Resume::From(c.run_dir.join("checkpoints/step_00000002"))),
        ..Default::default()
    };
    match run(&other, &resume) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "seed");
            assert!(message.contains("with seed 3"), "{message}");
        }
        other => panic!("expected seed refused, got {other:?}"),
    }
    // So are another head count (the same layout: the checkpoint's layout check passed
    // it), another held-out fraction (other training samples than its position counts)
    // and another data.shuffle: the manifest records the model and the samples.
    let refusals = [
        ("n_head = 4", "n_head = 2", "model.n_head", "n_head = 4"),
        (
            "[data]\n",
            "[data]\neval_fraction = 0.2\n",
            "data.train",
            "training samples",
        ),
        // The other data.shuffle orders the samples otherwise (before: resumed silently).
        (
            "[data]\n",
            "[data]\nshuffle = false\n",
            "data.shuffle",
            "written with data.shuffle = true",
        ),
    ];
    for (was, now, key, says) in refusals {
        let text = gpt_config(tmp.path(), "fp32", 4, "checkpoint_every = 2").replace(was, now);
        let other = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
        match run(&other, &resume) {
            Err(TrainError::Config { key: k, message }) => {
                assert_eq!(k, key, "{message}");
                assert!(message.contains(says), "{message}");
            }
            other => panic!("expected {key} refused, got {other:?}"),
        }
    }
    // Another file of the same size: its samples' fingerprint differs.
    let shard = stoker_data::TokenShard::open_detect(tmp.path().join("corpus.bin")).unwrap();
    let reversed: Vec<u16> = (0..shard.len()).rev().map(|i| shard.token(i)).collect();
    let other_bin = tmp.path().join("other.bin");
    stoker_data::tokens::write_tokens(&other_bin, &reversed, stoker_data::TokenFormat::Llmc)
        .unwrap();
    let corpus = tmp.path().join("corpus.bin").display().to_string();
    let text = gpt_config(tmp.path(), "fp32", 4, "checkpoint_every = 2")
        .replace(&corpus, &other_bin.display().to_string());
    match run(
        &TrainConfig::parse(&text, Path::new("t.toml")).unwrap(),
        &resume,
    ) {
        Err(TrainError::Config { key, message }) => {
            assert_eq!(key, "data.train");
            assert!(message.contains("its samples differ"), "{message}");
        }
        other => panic!("expected data.train refused, got {other:?}"),
    }
    // Another precision goes on from the same weights and moments (with a warning).
    run(
        &config(tmp.path(), "bf16", 4, "checkpoint_every = 2"),
        &resume,
    )
    .unwrap();
    run(&c, &resume).unwrap();
}

/// A run whose checkpoints cannot be saved fails before its first step (before: at its
/// first save, all of its training lost): a file where `checkpoints/` goes, or a link to
/// a folder that does not exist, named as such.
#[test]
fn a_checkpoints_folder_that_cannot_be_made_fails_before_training() {
    let tmp = tempfile::tempdir().unwrap();
    let c = config(tmp.path(), "fp32", 4, "checkpoint_every = 4");
    std::fs::create_dir_all(&c.run_dir).unwrap();
    let at = c.run_dir.join("checkpoints");
    std::fs::write(&at, "x").unwrap();
    let e = run(&c, &RunOptions::default()).unwrap_err().to_string();
    assert!(
        e.contains("checkpoints") && e.contains("File exists"),
        "{e}"
    );
    assert!(
        !c.run_dir.join("metrics.jsonl").exists(),
        "no step ran, no record was written"
    );
    std::fs::remove_file(&at).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("nowhere/ckpts"), &at).unwrap();
    let e = run(&c, &RunOptions::default()).unwrap_err().to_string();
    assert!(
        e.contains("is a symbolic link to") && e.contains("which does not exist"),
        "{e}"
    );
}

/// ZeRO-3 at more ranks than a tiny model's aligned pieces: some ranks hold nothing and
/// write an empty shard. `ckpt verify` reads and checks every shard the manifest lists,
/// those too: one deleted or damaged is named (before, verify passed over them).
#[test]
fn verify_checks_the_shards_that_hold_nothing_too() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    write_token_corpus(&d.join("corpus.bin"), 12_000);
    let extra = "[parallel]\nstrategy = \"zero3\"\nbackend = \"local\"\n";
    let text = gpt_config(d, "fp32", 1, extra)
        .replace("d_model = 32", "d_model = 2")
        .replace("n_head = 4", "n_head = 1")
        .replace("n_layer = 2", "n_layer = 1")
        .replace("micro_batch = 4", "micro_batch = 1")
        .replace("accumulation_steps = 2\n", "world_size = 256\n");
    let c = TrainConfig::parse(&text, Path::new("test.toml")).unwrap();
    for r in stoker_train::run::run_threads(&c, &RunOptions::default()).unwrap() {
        r.unwrap();
    }
    let ck = c.run_dir.join("checkpoints/step_00000001");
    let m = stoker_train::checkpoint::sharded::read_manifest(&ck).unwrap();
    let empty: Vec<&str> = m
        .shards
        .iter()
        .filter(|s| s.try_pieces().unwrap().is_empty())
        .map(|s| s.file.as_str())
        .collect();
    assert!(
        !empty.is_empty(),
        "every rank holds a piece: the test needs an empty shard"
    );
    let v = stoker_train::checkpoint::verify(&ck).unwrap();
    assert_eq!(v.files, m.shards.len() + 1, "the manifest and every shard");
    std::fs::remove_file(ck.join(empty[0])).unwrap();
    let e = stoker_train::checkpoint::verify(&ck)
        .unwrap_err()
        .to_string();
    assert!(e.contains(empty[0]), "{e}");
}

/// `--resume latest` at three ranks: each rank verifies the manifest's share of a
/// checkpoint (every third shard file), so the ranks read it once together, not three
/// times; a corrupt shard that one rank checks makes all three pass over its checkpoint
/// together, and the resumed run ends on the bits of one never stopped. With no intact
/// checkpoint left, every rank fails alike.
#[test]
fn ranks_split_the_resume_check_and_pass_over_a_corrupt_shard_together() {
    use stoker_train::checkpoint::{verify, verify_share, Share};
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        write_token_corpus(&dir.join("corpus.bin"), 12_000);
        // Not `deterministic` (a power of two only): the in-process backend sums in rank
        // order, the same every run.
        let extra = "checkpoint_every = 2\n[parallel]\nstrategy = \"zero1\"\n\
                     backend = \"local\"\n";
        let text = gpt_config(&dir, "fp32", 8, extra).replace(
            "accumulation_steps = 2\n",
            "global_batch = 12\nworld_size = 3\n",
        );
        TrainConfig::parse(&text, Path::new("test.toml")).unwrap()
    };
    let whole = every_rank(&cfg("a"), RunOptions::default());
    let c = cfg("b");
    let stop = RunOptions {
        stop_after: Some(6),
        ..Default::default()
    };
    every_rank(&c, stop);
    let root = c.run_dir.join("checkpoints");
    let newest = root.join("step_00000006");
    let all = verify(&newest).unwrap();
    assert_eq!(all.files, 4, "the manifest and three shards");
    let shares: Vec<_> = (0..3)
        .map(|rank| verify_share(&newest, Share { rank, world: 3 }).unwrap())
        .collect();
    // Rank 0 counts the manifest; each rank reads one shard file.
    let files: Vec<usize> = shares.iter().map(|v| v.files).collect();
    assert_eq!(files, [2, 1, 1]);
    assert_eq!(shares.iter().map(|v| v.bytes).sum::<u64>(), all.bytes);
    // One byte flipped in the shard rank 2 checks.
    let shard = newest.join("shard_00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&shard, bytes).unwrap();
    assert!(verify_share(&newest, Share { rank: 0, world: 3 }).is_ok());
    assert!(verify_share(&newest, Share { rank: 2, world: 3 }).is_err());
    let latest = RunOptions {
        resume: Some(Resume::Latest(root.clone())),
        ..Default::default()
    };
    let resumed = every_rank(&c, latest.clone());
    for (r, s) in resumed.iter().enumerate() {
        assert_eq!(s.steps_run(), 4, "rank {r}: resumed from step 4, not 6");
        assert_eq!(s.weights_crc32, whole[0].weights_crc32, "rank {r}");
    }
    // Every checkpoint corrupt: no rank resumes, every rank says so.
    for dir in stoker_train::checkpoint::complete(&root) {
        let shard = dir.join("shard_00001.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        std::fs::write(&shard, bytes).unwrap();
    }
    let ends = stoker_train::run::run_threads(&c, &latest).unwrap();
    assert_eq!(ends.len(), 3);
    for end in ends {
        let Err(e) = end else {
            panic!("a rank resumed though no checkpoint is intact");
        };
        let e = e.to_string();
        assert!(e.contains("no intact checkpoint"), "{e}");
    }
}

/// `train.keep_checkpoints = 2` keeps the run's two newest checkpoints, removing older
/// ones after each save. After a resume from an earlier checkpoint, the newer ones the
/// run before left (another timeline's, which no resume takes) are not its to remove.
#[test]
fn keep_checkpoints_removes_the_older_ones_of_the_run_s_own_timeline() {
    let tmp = tempfile::tempdir().unwrap();
    let names = |root: &Path| -> Vec<String> {
        stoker_train::checkpoint::complete(root)
            .iter()
            .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    let kept = config(
        tmp.path(),
        "fp32",
        6,
        "checkpoint_every = 1\nkeep_checkpoints = 2",
    );
    run(&kept, &RunOptions::default()).unwrap();
    let root = kept.run_dir.join("checkpoints");
    assert_eq!(names(&root), ["step_00000005", "step_00000006"]);
    std::fs::remove_dir_all(&kept.run_dir).unwrap();

    let all = config(tmp.path(), "fp32", 6, "checkpoint_every = 1");
    run(&all, &RunOptions::default()).unwrap();
    assert_eq!(names(&root).len(), 6);
    let resume = RunOptions {
        resume: Some(Resume::From(root.join("step_00000002"))),
        stop_after: Some(4),
        ..Default::default()
    };
    run(&kept, &resume).unwrap();
    // Steps 3 and 4 rewritten (1 and 2 removed); 5 and 6 are the old timeline's.
    assert_eq!(
        names(&root),
        [
            "step_00000003",
            "step_00000004",
            "step_00000005",
            "step_00000006"
        ]
    );
    let latest = stoker_train::checkpoint::latest_intact(&root);
    assert_eq!(latest.dir, Some(root.join("step_00000004")));
}

/// An fp8 run trains the same weights whether it evaluates or not: evaluation's forward
/// casts through the delayed scalers but records nothing in their amax histories (it
/// did, and a run with `eval_every = 2` trained other weights from its third step).
#[test]
fn an_fp8_run_trains_the_same_whether_or_not_it_evaluates() {
    let tmp = tempfile::tempdir().unwrap();
    let crc = |name: &str, extra: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let c = config(&dir, "fp8", 8, extra);
        let s = run(&c, &RunOptions::default()).unwrap();
        (s.weights_crc32, losses(&c.run_dir))
    };
    let quiet = crc("quiet", "");
    let evaluated = crc("evaluated", "eval_every = 2");
    assert_eq!(quiet.1.len(), 8);
    assert_eq!(quiet, evaluated);
}
