//! The machine profile (`stoker plan --calibrate`'s figures kept for later plans): which
//! MFU it gives a config's step, when it applies, that a plan on it gives a measured step
//! back, and that a broken file is refused naming the field.

mod common;

use std::path::Path;

use stoker_plan::loader::{BenchPoint, LoaderBench};
use stoker_train::config::TrainConfig;
use stoker_train::machine::profile::{
    pick_mfu, this_cpu, LoaderProbe, MachineProfile, StepAt, StepPoint,
};
use stoker_train::machine::{probe_machine, step_mfu, MachineFigures};

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Made-up figures of this machine (its CPU and cores, so that the profile applies).
fn figures() -> MachineFigures {
    MachineFigures {
        cores: cores(),
        fp32_tflops: 0.2,
        bf16_tflops: 0.4,
        host_mem_gbyte_s: 12.0,
        allreduce_gbyte_s: 4.0,
    }
}

fn at(precision: &str, d_model: usize, ranks: usize, threads: usize) -> StepAt {
    StepAt {
        model: "gpt".into(),
        precision: precision.into(),
        path: "direct".into(),
        ranks_per_host: ranks,
        ranks_at_once: ranks,
        threads_per_rank: threads,
        d_model,
        n_layer: 2,
        n_head: (d_model / 32).max(1),
        context: 128,
        vocab: 256,
        micro_batch: 8,
    }
}

fn point(at: StepAt, mfu: f64) -> StepPoint {
    StepPoint {
        step_s: 0.01,
        mfu,
        source: "probe".into(),
        at,
    }
}

/// A loader probe on windows of 128 tokens (2048 bytes a sample) at 0 workers.
fn loader_probe(samples_per_s: f64) -> LoaderProbe {
    LoaderProbe {
        context: 128,
        bench: LoaderBench {
            dataset: Some("synthetic".into()),
            sample_bytes: Some(2048),
            points: vec![BenchPoint {
                num_workers: 0,
                prefetch_factor: 2,
                batch_size: Some(16),
                samples_per_s,
                mb_per_s: None,
                consumer_wait_pct: None,
                peak_rss_bytes: None,
            }],
        },
    }
}

/// bf16 direct steps at widths 64, 128, 256 by one rank of 2 threads, one at 128 by two
/// ranks of one thread, and an fp32 one.
fn points() -> Vec<StepPoint> {
    vec![
        point(at("bf16", 64, 1, 2), 0.3),
        point(at("bf16", 128, 1, 2), 0.5),
        point(at("bf16", 256, 1, 2), 0.7),
        point(at("bf16", 128, 2, 1), 0.6),
        point(at("fp32", 128, 1, 2), 0.9),
    ]
}

#[test]
fn the_mfu_is_the_step_s_own_else_interpolated_over_the_width() {
    let pts = points();
    // Measured at this very shape and layout: its own MFU.
    let p = pick_mfu(&pts, &at("bf16", 128, 1, 2)).unwrap();
    assert_eq!(p.mfu, 0.5);
    assert!(p.basis.contains("of this shape"), "{}", p.basis);
    // Between two widths: linear in ln(d_model).
    let p = pick_mfu(&pts, &at("bf16", 181, 1, 2)).unwrap();
    let f = (181f64 / 128.0).ln() / 2f64.ln();
    assert_eq!(p.mfu, 0.5 + f * (0.7 - 0.5));
    assert!(p.basis.contains("between d_model 128"), "{}", p.basis);
    // Outside the widths measured: the nearest one's.
    assert_eq!(pick_mfu(&pts, &at("bf16", 1024, 1, 2)).unwrap().mfu, 0.7);
    assert_eq!(pick_mfu(&pts, &at("bf16", 32, 1, 2)).unwrap().mfu, 0.3);
    // A deeper model at a measured width: that width's step, the shape nearest.
    let mut deeper = at("bf16", 256, 1, 2);
    deeper.n_layer = 8;
    let p = pick_mfu(&pts, &deeper).unwrap();
    assert_eq!(p.mfu, 0.7);
    assert!(p.basis.contains("at d_model 256 (0.700)"), "{}", p.basis);
    assert!(!p.basis.contains("nearest"), "{}", p.basis);
    // Two ranks of one thread each: the steps measured so, at any width.
    assert_eq!(pick_mfu(&pts, &at("bf16", 512, 2, 1)).unwrap().mfu, 0.6);
    // Its precision only.
    assert_eq!(pick_mfu(&pts, &at("fp32", 64, 1, 2)).unwrap().mfu, 0.9);
    let none = pick_mfu(&pts, &at("fp16", 128, 1, 2)).unwrap_err();
    assert!(none.contains("fp16"), "{none}");
    // Another layout than any measured: the nearest in ranks at once, said in the basis;
    // a point of 1 rank per host planned for 2 per host gives each rank twice the share
    // (the host's peak is halved per rank, its rate is the same).
    let mut four = at("bf16", 128, 1, 2);
    four.ranks_at_once = 1;
    four.threads_per_rank = 1;
    four.ranks_per_host = 2;
    let p = pick_mfu(&pts, &four).unwrap();
    assert_eq!(p.mfu, 1.0, "0.5 x 2, at most 1");
    assert!(p.basis.contains("nearest to this run's"), "{}", p.basis);
}

/// A Llama plans from the Llama's steps where the profile measured them, else from the
/// GPT's, saying so.
#[test]
fn a_llama_plans_from_llama_steps_and_else_from_the_gpt_s_saying_so() {
    let mut pts = points();
    let llama = |d| {
        let mut a = at("bf16", d, 1, 2);
        a.model = "llama".into();
        a
    };
    let p = pick_mfu(&pts, &llama(128)).unwrap();
    assert_eq!(p.mfu, 0.5, "the GPT's step of that width");
    assert!(
        p.basis.contains("another family's steps: none of a llama"),
        "{}",
        p.basis
    );
    pts.push(point(llama(128), 0.42));
    let p = pick_mfu(&pts, &llama(128)).unwrap();
    assert_eq!(p.mfu, 0.42);
    assert!(
        p.basis.contains("bf16 direct llama step of this shape"),
        "{}",
        p.basis
    );
    // And a GPT still plans from the GPT's.
    assert_eq!(pick_mfu(&pts, &at("bf16", 128, 1, 2)).unwrap().mfu, 0.5);
}

/// Two widths, each at 512 and 2048 tokens per micro-batch (micro-batches 4 and 16 of 128).
#[test]
fn the_tokens_per_micro_batch_are_a_second_axis_inside_the_width() {
    let with = |d, mb, mfu| {
        let mut a = at("bf16", d, 1, 2);
        a.micro_batch = mb;
        point(a, mfu)
    };
    let pts = vec![
        with(128, 4, 0.4),
        with(128, 16, 0.6),
        with(256, 4, 0.6),
        with(256, 16, 0.8),
    ];
    // 1024 tokens: halfway in ln(tokens) at each width.
    let half = |lo: f64, hi: f64| lo + 0.5 * (hi - lo);
    let p = pick_mfu(&pts, &at("bf16", 128, 1, 2)).unwrap();
    assert!((p.mfu - half(0.4, 0.6)).abs() < 1e-12, "{}", p.mfu);
    assert!(
        p.basis.contains("between tokens per micro-batch 512"),
        "{}",
        p.basis
    );
    // Between widths too: each width's value at 1024 tokens, then along ln(d_model).
    let p = pick_mfu(&pts, &at("bf16", 181, 1, 2)).unwrap();
    let f = (181f64 / 128.0).ln() / 2f64.ln();
    let (lo, hi) = (half(0.4, 0.6), half(0.6, 0.8));
    assert!((p.mfu - (lo + f * (hi - lo))).abs() < 1e-12, "{}", p.mfu);
    // Beyond the tokens measured: the nearest count's.
    let mut long = at("bf16", 256, 1, 2);
    long.micro_batch = 64;
    assert_eq!(pick_mfu(&pts, &long).unwrap().mfu, 0.8);
}

#[test]
fn a_profile_plans_a_config_that_gives_no_figures_and_gives_a_measured_step_back() {
    let tmp = tempfile::tempdir().unwrap();
    let text = common::gpt_config(tmp.path(), "fp32", 10, "");
    let cfg = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let threads = 2;
    let mut profile = MachineProfile::new(figures(), &tmp.path().join("profile.toml"));
    // The config's own step, measured (made up) at 40 ms per micro-batch.
    let mut mine = StepAt::of(&cfg, 1, threads).unwrap();
    mine.ranks_at_once = 1;
    let step = 0.040;
    let mfu = step_mfu(&cfg, &profile.figures, 1, step).unwrap();
    profile.record(StepPoint {
        step_s: step,
        mfu,
        source: "t.toml".into(),
        at: mine.clone(),
    });
    profile.record(point(at("fp32", 256, 1, 2), 0.8));
    // Recording the same place again replaces it.
    profile.record(point(at("fp32", 256, 1, 2), 0.85));
    assert_eq!(profile.steps.len(), 2);
    assert_eq!(profile.steps[1].mfu, 0.85);

    let mut planned = cfg.clone();
    let basis = profile.apply(&mut planned, 1, threads).unwrap();
    assert!(basis.contains("of this shape"), "{basis}");
    let section = planned.plan.as_ref().unwrap();
    assert_eq!(section.mfu, Some(mfu));
    let peaks = section.hardware.peak_tflops.as_ref().unwrap();
    assert_eq!((peaks["fp32"], peaks["bf16"]), (0.2, 0.4));
    assert_eq!(section.hardware.intra_node_gbyte_s, Some(4.0));
    // The run's forecast names the profile and plans the step measured: one rank, two
    // micro-batches of 40 ms.
    let f = stoker_train::planned::forecast(&planned, 1, 1, None).unwrap();
    assert!(f.measured_figures);
    assert!(f.hardware.contains("profile.toml"), "{}", f.hardware);
    let planned_step = f.step_s.unwrap();
    assert!(
        (planned_step - 2.0 * step).abs() < 1e-9,
        "{planned_step} vs {}",
        2.0 * step
    );

    // A new machine calibration keeps the config's step, its MFU at the new GEMM rates
    // (twice the fp32 rate: half the MFU), and not the old probes.
    let mut faster = figures();
    faster.fp32_tflops *= 2.0;
    let mut again = MachineProfile::new(faster, &tmp.path().join("profile.toml"));
    assert_eq!(again.keep_config_steps(&profile), 1);
    assert_eq!(again.steps.len(), 1);
    assert_eq!(again.steps[0].source, "t.toml");
    assert!((again.steps[0].mfu - mfu / 2.0).abs() < 1e-15);

    // The profile's loader rates plan the config's loader, scaled from the probe's windows
    // of 128 tokens to the config's 16 by their bytes.
    assert_eq!(profile.loader_for(&cfg), None, "no loader measured");
    profile.loader = Some(loader_probe(1000.0));
    let bench = profile.loader_for(&cfg).unwrap();
    assert_eq!(bench.points[0].samples_per_s, 1000.0 * 128.0 / 16.0);
    assert_eq!(bench.sample_bytes, Some(2048 * 16 / 128));
    assert!(bench.dataset.unwrap().contains("windows of 16 tokens"));
    // A Llama reads the same token windows: the same benchmark (before: none, and its plan
    // took the chapter's starting point of workers).
    let llama = common::gpt_config(tmp.path(), "fp32", 10, "").replacen(
        "kind = \"gpt\"",
        "kind = \"llama\"",
        1,
    );
    let llama = TrainConfig::parse(&llama, Path::new("llama.toml")).unwrap();
    assert_eq!(
        profile.loader_for(&llama).unwrap().points,
        profile.loader_for(&cfg).unwrap().points
    );

    // The config's own figures win, and so does another preset or device.
    for extra in [
        "[plan]\nmfu = 0.3\n",
        "[plan.hardware]\npeak_tflops = { fp32 = 1.0 }\n",
        "[plan.hardware]\npreset = \"h100\"\n",
    ] {
        let text = common::gpt_config(tmp.path(), "fp32", 10, extra);
        let mut own = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
        let before = own.clone();
        let why = profile.apply(&mut own, 1, threads).unwrap_err();
        assert!(why.contains("[plan]") || why.contains("h100"), "{why}");
        assert_eq!(own, before, "left as it was");
    }
    // Measured on another machine: not used, and the reason names both.
    let mut elsewhere = profile.clone();
    elsewhere.cpu = "Some Other CPU".into();
    let why = elsewhere.apply(&mut cfg.clone(), 1, threads).unwrap_err();
    assert!(
        why.contains("Some Other CPU") && why.contains(&this_cpu()),
        "{why}"
    );
    // A precision it never measured: not used.
    let text = common::gpt_config(tmp.path(), "fp16", 10, "");
    let fp16 = TrainConfig::parse(&text, Path::new("t.toml")).unwrap();
    let why = profile.apply(&mut fp16.clone(), 1, threads).unwrap_err();
    assert!(why.contains("fp16"), "{why}");
}

#[test]
fn a_profile_reads_back_what_it_wrote_and_refuses_a_broken_file_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("sub").join("profile.toml");
    assert_eq!(
        MachineProfile::load(&path).unwrap(),
        None,
        "no file: no profile"
    );
    let mut profile = MachineProfile::new(figures(), &path);
    for p in points() {
        profile.record(p);
    }
    profile.loader = Some(loader_probe(1000.0));
    profile.save().unwrap();
    assert_eq!(MachineProfile::load(&path).unwrap(), Some(profile.clone()));
    let text = std::fs::read_to_string(&path).unwrap();
    for (from, to, field) in [
        ("mfu = 0.6", "mfu = nan", "step[3].mfu"),
        ("mfu = 0.6", "mfu = 1.5", "step[3].mfu"),
        (
            "fp32_tflops = 0.2",
            "fp32_tflops = 0.0",
            "figures.fp32_tflops",
        ),
        ("cores = ", "kernels = 3\ncores = ", "kernels"),
        (
            "samples_per_s = 1000.0",
            "samples_per_s = -1.0",
            "loader.bench.points[0].samples_per_s",
        ),
    ] {
        assert!(text.contains(from), "{from} in\n{text}");
        std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
        let e = MachineProfile::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("profile.toml") && e.contains(field),
            "{field}: {e}"
        );
    }
}

#[test]
fn a_machine_calibration_measures_every_probe_step() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("profile.toml");
    let mut heard = 0;
    let profile = probe_machine(2, &[32, 64], &path, |_| heard += 1).unwrap();
    // The GPT in fp32 and (where the CPU has bf16 hardware) bf16 on the direct step by 1
    // rank of 2 threads and 2 of 1, both on candle's fused graph by 1 rank; the Llama on
    // its direct step as the GPT; at each width and micro-batch.
    let bf16_direct = stoker_kernels::bf16_native();
    let direct = 2 + usize::from(bf16_direct) * 2;
    let per_size = 2 * direct + 2;
    let expected = 2 * per_size * stoker_train::machine::PROBE_MICRO_BATCHES.len();
    let llamas = profile
        .steps
        .iter()
        .filter(|p| p.at.model == "llama")
        .count();
    assert_eq!(
        llamas,
        2 * direct * stoker_train::machine::PROBE_MICRO_BATCHES.len()
    );
    assert_eq!(profile.steps.len(), expected);
    assert_eq!(heard, expected);
    assert_eq!(profile.cpu, this_cpu());
    assert_eq!(profile.figures.cores, cores());
    // The loader on a synthetic token shard at 0, 1, 2 and 4 workers, up to the cores.
    let loader = profile.loader.as_ref().unwrap();
    assert_eq!(loader.context, stoker_train::machine::LOADER_PROBE_CONTEXT);
    let workers: Vec<u64> = loader.bench.points.iter().map(|p| p.num_workers).collect();
    let expected: Vec<u64> = [0, 1, 2, 4]
        .into_iter()
        .filter(|&w| w == 0 || w <= cores() as u64)
        .collect();
    assert_eq!(workers, expected);
    for p in &loader.bench.points {
        assert!(
            p.samples_per_s.is_finite() && p.samples_per_s > 0.0,
            "{p:?}"
        );
    }
    for p in &profile.steps {
        assert!(p.step_s.is_finite() && p.step_s > 0.0, "{p:?}");
        assert!(p.mfu > 0.0 && p.mfu <= 1.0, "{p:?}");
        assert!([32, 64].contains(&p.at.d_model), "{p:?}");
        assert_eq!(p.at.ranks_per_host, p.at.ranks_at_once);
        assert_eq!(p.at.ranks_at_once * p.at.threads_per_rank, 2, "{p:?}");
    }
    profile.save().unwrap();
    assert_eq!(MachineProfile::load(&path).unwrap(), Some(profile));
}
