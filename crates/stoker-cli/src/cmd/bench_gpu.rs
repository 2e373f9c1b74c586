//! `stoker bench gpu-kernels`: every GPU kernel on the GPU against the host build of the
//! same source (they must agree bit for bit), then each kernel's median time at GPT-2
//! 124M's shapes with its effective bandwidth against the GPU's. Needs the `cuda` build
//! (scripts/gpu/build.sh) and a GPU; the device check runs it first.

/// Arguments of `stoker bench gpu-kernels`.
#[derive(clap::Args)]
pub struct GpuKernelsArgs {
    /// Timed launches per kernel (the median is reported).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Sequences per micro-batch for the timings (1,024 positions each).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Only compare with the host build; no timings.
    #[arg(long)]
    no_timing: bool,
    /// Also the GPT step: on the GPU against the host backend (a small GPT, f32 and
    /// bf16), the resident training loop with NCCL at one rank against the host's, then
    /// the bf16 forward + backward of GPT-2 124M timed.
    #[arg(long)]
    step: bool,
    /// With --step: writes the forecast's efficiencies fitted to each timed GPT-2 step
    /// here (TOML; `stoker_gpu::efficiency_fit`), for `stoker_gpu::measured`'s table.
    #[arg(long)]
    fit_out: Option<std::path::PathBuf>,
}

/// One timed step's fitted efficiencies, as `--fit-out` writes them: each fraction with
/// its parts' measured over forecast time at the assumed fractions, only where the step
/// measured such parts (a graphed step's launches are timed as one replay).
#[cfg(feature = "cuda")]
#[derive(serde::Serialize)]
struct FitRow {
    variant: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    product: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    products_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    memory_ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tensor_kernel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tensor_kernels_ratio: Option<f64>,
}

/// What `--fit-out` writes.
#[cfg(feature = "cuda")]
#[derive(serde::Serialize)]
struct FitFile<'a> {
    gpu: String,
    preset: String,
    measured_unix_s: u64,
    command: String,
    fit: &'a [FitRow],
}

/// The copies between host and GPU, each way's median bandwidth, whether the driver
/// registers host memory (what parameter offload's copies read), and how much of a
/// copy up on the copy stream runs beside kernels on the compute stream
/// (`stoker_gpu::offload_bench`: each copy's bytes checked against its source).
#[cfg(feature = "cuda")]
fn host_copies(dev: &stoker_gpu::device::Device, reps: usize) -> anyhow::Result<()> {
    use stoker_gpu::offload_bench::{time_copies, time_host_adamw, time_host_add, time_overlap};
    println!("\ncopies between host and GPU (median of {reps}, after one untimed run):");
    let mut staged = false;
    for elems in [4usize << 20, 64 << 20] {
        for t in time_copies(dev, elems, reps)? {
            let how = match t.pinned_direct {
                Some(true) => "direct",
                Some(false) => "STAGED: not registered",
                None => "",
            };
            staged |= t.pinned_direct == Some(false);
            println!(
                "  {:<40} {:>6.0} MiB {:>10.1} us {:>7.1} GB/s  {how}",
                t.what,
                t.bytes as f64 / (1 << 20) as f64,
                t.micros,
                t.bytes as f64 / (t.micros * 1e-6) / 1e9
            );
        }
    }
    let o = time_overlap(dev, 4 << 20, (64 << 20, 4), reps)?;
    staged |= !o.pinned_direct;
    println!(
        "  16 MiB up (pinned, copy stream{}) beside 4 additions over 256 MiB: copy {:.1} us, kernels {:.1} us, both {:.1} us: {:.0}% of the shorter hidden",
        if o.pinned_direct { "" } else { ", STAGED" },
        o.copy_us,
        o.compute_us,
        o.both_us,
        100.0 * o.hidden()
    );
    if staged {
        let probe = stoker_gpu::PinnedHostBuf::<_, f32>::zeros(dev, 1 << 20)?;
        println!(
            "  the driver did not register pinned host memory: {}",
            probe
                .pin()
                .registration_error()
                .unwrap_or_else(|| "(a 4 MiB probe was registered)".into())
        );
    }
    let add = time_host_add(7_087_872, reps)?;
    println!(
        "  the host adding a GPT-2 block's gradients into the offload's sum: one thread {:.0} us, {} threads {:.0} us",
        add.one_thread_us, add.pool_threads, add.pool_us
    );
    // Three reps: one thread takes about a second for each.
    let adamw = time_host_adamw(124_475_904, 3)?;
    println!(
        "  the offloaded optimizer's AdamW over GPT-2 124M on the host: one thread {:.0} us, {} threads {:.0} us",
        adamw.one_thread_us, adamw.pool_threads, adamw.pool_us
    );
    Ok(())
}

/// Runs `stoker bench gpu-kernels`.
#[cfg(not(feature = "cuda"))]
pub fn run(_: GpuKernelsArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "this stoker was built without the `cuda` feature; the GPU binary comes from `make gpu-build` (scripts/gpu/build.sh)"
    )
}

/// Runs `stoker bench gpu-kernels`.
#[cfg(feature = "cuda")]
pub fn run(a: GpuKernelsArgs) -> anyhow::Result<()> {
    use stoker_gpu::device::{check, Device, GemmLibrary};
    use stoker_gpu::scenario::ScenarioSize;

    let dev = Device::new(0)?;
    let mut failed: Vec<&str> = Vec::new();
    println!(
        "gpu kernels on {}: against the host build of the same source",
        dev.name()
    );
    let compared = check::compare_with_host(&dev, ScenarioSize::SMALL)?;
    println!(
        "{:<44} {:>9} {:>9} {:>12}",
        "output", "elements", "differ", "max |diff|"
    );
    for c in &compared {
        println!(
            "{:<44} {:>9} {:>9} {:>12.3e}",
            c.name, c.elements, c.differing, c.max_abs_diff
        );
    }
    let bad = compared.iter().filter(|c| c.differing > 0).count();
    println!(
        "bit-identical: {} of {} outputs",
        compared.len() - bad,
        compared.len()
    );
    // Flash attention on tensor cores: within a tolerance (their sums' order is theirs).
    use stoker_gpu::device::flash_check::{compare_flash, tolerance};
    println!("\nflash attention on the tensor cores against the host build (largest difference over the largest value):");
    for c in compare_flash(&dev)? {
        let tol = tolerance(&c.name);
        let ok = c.rel <= tol;
        println!(
            "  {:<40} {:>10.2e} (tolerance {tol:.0e}) {}",
            c.name,
            c.rel,
            if ok { "OK" } else { "FAILED" }
        );
        if !ok {
            failed.push("flash attention against the host build");
        }
    }
    if !a.no_timing {
        let size = ScenarioSize {
            b: a.batch,
            ..check::GPT2
        };
        // The planner's preset of this GPU (H100, H200): its memory bandwidth.
        let peak = preset_of(&dev.name()).map(|hw| hw.device_mem_bw);
        println!(
            "\ntimes at GPT-2 124M's shapes, bf16, micro-batch {} x 1024 (median of {}):",
            a.batch, a.reps
        );
        println!(
            "{:<38} {:>10} {:>10} {:>8}",
            "kernel", "us", "GB/s", "of peak"
        );
        for t in check::time_kernels(&dev, size, a.reps.max(1))? {
            let gbs = t.bytes / (t.micros * 1e-6) / 1e9;
            let frac = peak
                .map(|p| format!("{:.0}%", 100.0 * gbs * 1e9 / p))
                .unwrap_or_else(|| "n/a".into());
            println!(
                "{:<38} {:>10.1} {:>10.0} {:>8}",
                t.name, t.micros, gbs, frac
            );
        }
    }
    if !a.no_timing {
        // Flash attention at GPT-2's attention, beside torch_kernels.py's SDPA.
        println!(
            "\nflash attention at GPT-2 124M's attention (bf16, {} x 12 heads of 64, 1024 positions; median of {}):",
            a.batch, a.reps
        );
        match stoker_gpu::device::flash_check::time_flash(&dev, a.batch, a.reps.max(1)) {
            Ok(times) => {
                for t in times {
                    let tflops = t.flops / (t.micros * 1e-6) / 1e12;
                    println!(
                        "  flash-{:<31} {:>10.1} us {:>8.1} TFLOP/s on tensor cores ({:.1}% of 989)",
                        t.name,
                        t.micros,
                        tflops,
                        100.0 * tflops / 989.0
                    );
                }
            }
            Err(e) => {
                println!("  did not run: {e}");
                failed.push("flash attention's timing");
            }
        }
        gemm_libraries(&dev, a.batch, a.reps, &mut failed);
        fp8_products(&dev, a.batch, a.reps, &mut failed);
        if let Err(e) = host_copies(&dev, a.reps) {
            println!("  did not run: {e}");
            failed.push("the copies between host and GPU");
        }
    }
    if a.step {
        println!(
            "\nthe GPT and Llama steps on the GPU against the host backend (products differ: a tolerance), products through {:?}:",
            dev.gemm_library()
        );
        for c in check::compare_step(&dev)? {
            println!(
                "  {:<10} loss {:.2e} relative; worst gradient {} {:.2e} of its largest",
                c.what, c.loss_rel, c.worst.0, c.worst.1
            );
        }
        println!(
            "\nthe resident training loop (3 windows of 2 micro-batches, AdamW, clipping) on the GPU, NCCL at one rank, against the host backend; then 2 ranks on the GPU (through host memory) against 1:"
        );
        // Not fatal: the timings below still run where NCCL cannot start on this machine.
        match stoker_gpu::device::replica_check::compare_replica(&dev) {
            Ok(compared) => {
                for c in compared {
                    println!(
                        "  {:<12} last window's loss {:.2e} relative; master {:.2e} of its largest",
                        c.what, c.loss_rel, c.master_rel
                    );
                }
            }
            Err(e) => {
                println!("  the resident loop did not run: {e}");
                failed.push("the resident loop");
            }
        }
        use stoker_gpu::device::replica_check::{compare_replica_ranks, Run};
        use stoker_gpu::parallel::Strategy;
        let deterministic = |strategy| Run {
            deterministic: true,
            ..Run::of(strategy)
        };
        for (run, name) in [
            (
                Run::of(Strategy::Zero1),
                "the resident loop at 2 ranks, ZeRO-1",
            ),
            (
                Run::of(Strategy::Zero3),
                "the resident loop at 2 ranks, ZeRO-3",
            ),
            (
                deterministic(Strategy::Ddp),
                "the resident loop at 2 ranks, deterministic DDP",
            ),
            (
                deterministic(Strategy::Zero1),
                "the resident loop at 2 ranks, deterministic ZeRO-1",
            ),
        ] {
            match compare_replica_ranks(0, run) {
                // Deterministic mode's trees give one rank's bits at two.
                Ok(c) if run.deterministic && (c.loss_rel != 0.0 || c.master_rel != 0.0) => {
                    println!(
                        "  {:<12} last window's loss {:.2e} relative; master {:.2e} of its largest: not bit-identical, FAILED",
                        c.what, c.loss_rel, c.master_rel
                    );
                    failed.push(name);
                }
                Ok(c) => println!(
                    "  {:<12} last window's loss {:.2e} relative; master {:.2e} of its largest",
                    c.what, c.loss_rel, c.master_rel
                ),
                Err(e) => {
                    println!("  {name} did not run: {e}");
                    failed.push(name);
                }
            }
        }
        // Attention's probabilities kept per block, then recomputed in the backward
        // (`recompute = "attention"`): what the recompute costs in time, and saves.
        let recompute = stoker_gpu::step::options::StepOptions {
            recompute_attention: true,
            ..Default::default()
        };
        // The products through the other library too: what cuBLASLt's epilogue and
        // algorithms change in the whole step.
        let (chosen, other) = match dev.gemm_library() {
            GemmLibrary::CublasLt => (GemmLibrary::CublasLt, GemmLibrary::Cublas),
            GemmLibrary::Cublas => (GemmLibrary::Cublas, GemmLibrary::CublasLt),
        };
        // llm.c's default: the GELU output recomputed too.
        let recompute_both = stoker_gpu::step::options::StepOptions {
            recompute_mlp: true,
            ..recompute
        };
        // Each micro-batch captured once and replayed as one CUDA graph (`cuda_graphs`):
        // what the host's launches cost at this size.
        let graphs = stoker_gpu::step::options::StepOptions {
            graph_micro_batches: true,
            ..Default::default()
        };
        use stoker_gpu::device::check::{DEMO_GPT, GPT2_124M};
        let gpt2 = ("GPT-2 124M", GPT2_124M, a.batch);
        // The figure is at the largest micro-batch that fits: twice and four times
        // the asked one too, with flash attention (no scores kept; `stoker plan` prints the
        // largest), beside PyTorch's at the asked one and twice it.
        let gpt2_twice = ("GPT-2 124M", GPT2_124M, 2 * a.batch);
        let gpt2_four_times = ("GPT-2 124M", GPT2_124M, 4 * a.batch);
        let demo = ("the demo's GPT", DEMO_GPT, 16);
        // Attention on tensor cores keeping no scores (`flash_attention`).
        let flash = stoker_gpu::step::options::StepOptions {
            flash_attention: true,
            ..Default::default()
        };
        // The linear layers in FP8 (`precision = "fp8"`'s products on the tensor cores),
        // beside the same step in bf16 above.
        let flash_fp8 = stoker_gpu::step::options::StepOptions {
            fp8_linears: true,
            ..flash
        };
        let variants = [
            (gpt2, "attention kept", Default::default(), chosen),
            (gpt2, "flash attention", flash, chosen),
            (
                gpt2,
                "flash attention, linear layers in FP8",
                flash_fp8,
                chosen,
            ),
            (
                gpt2_twice,
                "flash attention, linear layers in FP8, twice the micro-batch",
                flash_fp8,
                chosen,
            ),
            (
                gpt2_twice,
                "flash attention, twice the micro-batch",
                flash,
                chosen,
            ),
            (
                gpt2_four_times,
                "flash attention, four times the micro-batch",
                flash,
                chosen,
            ),
            (
                gpt2,
                "attention kept, micro-batches as CUDA graphs",
                graphs,
                chosen,
            ),
            (gpt2, "attention recomputed", recompute, chosen),
            (
                gpt2,
                "attention and GELU recomputed",
                recompute_both,
                chosen,
            ),
            (gpt2, "attention kept", Default::default(), other),
            (demo, "launched one by one", Default::default(), chosen),
            (demo, "micro-batches as CUDA graphs", graphs, chosen),
            (demo, "flash attention", flash, chosen),
        ];
        let mut fits = Vec::new();
        for ((model, dims, batch), variant, opts, library) in
            variants.into_iter().filter(|_| !a.no_timing)
        {
            dev.set_gemm_library(library);
            let variant = format!("{variant}, products through {library:?}");
            let st = match check::time_step(&dev, dims, batch, a.reps.max(1), opts) {
                Ok(st) => st,
                // A failure of a GPT-2 variant at the asked micro-batch with the chosen
                // library ends the part, but for an FP8 variant's (never run on a device
                // yet), which leaves the rest to run, as the other variants' do.
                Err(e)
                    if library != chosen
                        || (model, batch) != (gpt2.0, gpt2.2)
                        || opts.fp8_linears =>
                {
                    println!("{model}, {variant}: did not run: {e}");
                    failed.push("a timed step variant");
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let t = dims.context;
            let tokens = (batch * t) as f64;
            // llm.c's count: 6N + 6LCT a token.
            let flops = 6.0 * st.params as f64 + 6.0 * (dims.n_layer * dims.d_model * t) as f64;
            println!(
                "{model} ({} parameters), bf16{}, micro-batch {batch} x {t}, {variant}:",
                st.params,
                if opts.fp8_linears {
                    " around FP8 linear layers"
                } else {
                    ""
                }
            );
            // The forward alone does a third of the FLOPs (2N + 2LCT a token).
            for (label, ms, share) in [
                ("forward (evaluation)", st.forward_ms, 1.0 / 3.0),
                ("forward+backward", st.forward_backward_ms, 1.0),
                ("step with AdamW", st.step_ms, 1.0),
            ] {
                let tps = tokens / (ms / 1e3);
                println!(
                    "  {label:<24} {ms:9.2} ms  {tps:12.0} tokens/s  MFU {:5.1}% (989 TFLOP/s)",
                    100.0 * tps * flops * share / 989e12
                );
            }
            // An FP8 variant's products are FP8's, forecast at FP8's peak: its fit would
            // measure FP8's fraction, which the planner's one product fraction is not.
            let forecast = forecast_beside(&dev.name(), (dims, batch), opts, &st)
                .filter(|_| !opts.fp8_linears);
            if let Some(f) = forecast {
                let measured = f.products.or(f.memory).or(f.tensor_kernels).is_some();
                if model == gpt2.0 && measured {
                    let e = f.efficiencies;
                    fits.push(FitRow {
                        variant: variant.clone(),
                        product: f.products.map(|_| e.product),
                        products_ratio: f.products,
                        memory: f.memory.map(|_| e.memory),
                        memory_ratio: f.memory,
                        tensor_kernel: f.tensor_kernels.map(|_| e.tensor_kernel),
                        tensor_kernels_ratio: f.tensor_kernels,
                    });
                    // Written after each variant: a device call cut short keeps the rows
                    // it has measured.
                    if let Some(path) = &a.fit_out {
                        write_fits(path, &dev.name(), &fits)?;
                    }
                }
            }
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            println!(
                "  device memory: planned {:.0} MiB (the step's own count), measured {:.0} MiB (the driver's free memory before and after), measured/planned {:.3}",
                mib(st.planned_bytes),
                mib(st.measured_bytes),
                st.measured_bytes as f64 / st.planned_bytes as f64
            );
        }
        if let Some(path) = a.fit_out.as_ref().filter(|_| !fits.is_empty()) {
            println!("fitted efficiencies written to {}", path.display());
        }
        dev.set_gemm_library(chosen);
        let (plans, without, refused) = dev.gemm_plans();
        println!("cuBLASLt planned {plans} product shapes, {without} of them run through cuBLAS (no algorithm, or refused)");
        if let Some(why) = refused {
            println!("cuBLASLt's first refusal: {why}");
            failed.push("cuBLASLt refused a product");
        }
    }
    if bad > 0 {
        anyhow::bail!("{bad} outputs differ from the host build (above)");
    }
    if !failed.is_empty() {
        anyhow::bail!("did not run: {} (above)", failed.join(", "));
    }
    Ok(())
}

/// Writes `fits` to `path` (`--fit-out`), replacing what an earlier call wrote.
#[cfg(feature = "cuda")]
fn write_fits(path: &std::path::Path, gpu: &str, fits: &[FitRow]) -> anyhow::Result<()> {
    use anyhow::Context;
    let file = FitFile {
        gpu: gpu.to_string(),
        preset: preset_of(gpu).map_or_else(|| "none".into(), |h| h.name),
        measured_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        command: "stoker bench gpu-kernels --step".into(),
        fit: fits,
    };
    let text = toml::to_string(&file).context("writing the fitted efficiencies")?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The planner's hardware preset of a GPU named `name` (as the driver names it), where
/// it has one.
#[cfg(feature = "cuda")]
fn preset_of(name: &str) -> Option<stoker_plan::hardware::Hardware> {
    let key = match name {
        n if n.contains("H200") => "h200-141gb",
        n if n.contains("H100") => "h100-80gb",
        n if n.contains("A100") => "a100-80gb",
        _ => return None,
    };
    stoker_plan::hardware::preset(key).ok()
}

/// `stoker plan`'s forecast of the GPT step just timed (`stoker_gpu::forecast`, its
/// efficiencies assumed), beside the measured times, then the profiled step's parts
/// (CUDA events around each launch) beside the forecast's: where the time goes, and
/// which assumption each part checks.
#[cfg(feature = "cuda")]
fn forecast_beside(
    name: &str,
    (dims, batch): (stoker_gpu::GptDims, usize),
    opts: stoker_gpu::step::options::StepOptions,
    st: &stoker_gpu::device::check::StepTimes,
) -> Option<stoker_gpu::efficiency_fit::Fitted> {
    use stoker_gpu::device::profile::Part;
    use stoker_gpu::forecast::{forecast, gpt_step_work_in, GpuFigures};
    let Some(hw) = preset_of(name) else {
        println!("  forecast: no preset for {name}");
        return None;
    };
    let peak = hw
        .dtype(stoker_plan::setup::Dtype::Bf16)
        .map_or(989e12, |d| d.peak_flops);
    let fp8_peak = hw
        .dtype(stoker_plan::setup::Dtype::Fp8)
        .map_or(0.0, |d| d.peak_flops);
    let figures =
        GpuFigures::assumed(peak, hw.device_mem_bw, hw.host_link_bw).with_fp8_peak(fp8_peak);
    let work = match gpt_step_work_in(stoker_gpu::Dtype::Bf16, dims, (batch, dims.context), opts) {
        Ok(w) => w,
        Err(e) => {
            println!("  forecast: {e}");
            return None;
        }
    };
    let (micro, update) = (
        forecast(&work.micro_batch, &figures),
        forecast(&work.update, &figures),
    );
    let (fb, step) = (
        micro.total_s() * 1e3,
        (micro.total_s() + update.total_s()) * 1e3,
    );
    println!(
        "  forecast on {} (efficiencies assumed): forward+backward {fb:.2} ms (products {:.2}, of them FP8 {:.2}, attention's per-head products {:.2}, kernels {:.2}), step {step:.2} ms; measured/forecast {:.2} and {:.2}",
        hw.name,
        micro.products_s * 1e3,
        micro.fp8_products_s * 1e3,
        micro.batched_products_s * 1e3,
        micro.kernels_s() * 1e3,
        st.forward_backward_ms / fb,
        st.step_ms / step
    );
    // The forecast of each part, over the micro-batch and the update together.
    let forecast_ms = |part: Part| -> Option<f64> {
        let both = [&micro, &update];
        let s: f64 = match part {
            Part::Kernel(k) => both
                .iter()
                .flat_map(|f| f.kernels.iter())
                .filter(|s| s.kernel == k)
                .map(|s| s.seconds)
                .sum(),
            Part::Products => both.iter().map(|f| f.products_s).sum(),
            Part::BatchedProducts => both.iter().map(|f| f.batched_products_s).sum(),
            Part::Device => both.iter().map(|f| f.device_s).sum(),
            Part::Graph => return None,
        };
        Some(s * 1e3)
    };
    let timed: f64 = st.profile.iter().map(|p| p.ms).sum();
    println!(
        "  where one step's time goes (CUDA events around each launch; a launch-bound step's parts hold the driver's launch calls too): the parts sum to {timed:.2} ms of its {:.2} ms wall time; the rest, {:.2} ms, the GPU waits between launches (at least)",
        st.profiled_ms,
        (st.profiled_ms - timed).max(0.0)
    );
    println!(
        "    {:<34} {:>8} {:>11} {:>11} {:>9}",
        "part", "launches", "measured ms", "forecast ms", "meas/fcst"
    );
    for p in st.profile.iter().take(16) {
        let label = match p.part {
            Part::Kernel(k) => k.to_string(),
            Part::Products => "products".into(),
            Part::BatchedProducts => "batched (per-head) products".into(),
            Part::Device => "copies and zeroings".into(),
            Part::Graph => "graphs (replayed whole)".into(),
        };
        match forecast_ms(p.part) {
            Some(f) if f > 0.0 => println!(
                "    {label:<34} {:>8} {:>11.3} {:>11.3} {:>9.2}",
                p.launches,
                p.ms,
                f,
                p.ms / f
            ),
            _ => println!(
                "    {label:<34} {:>8} {:>11.3} {:>11}",
                p.launches, p.ms, "-"
            ),
        }
    }
    // The fractions of peak this step reached, fitted to its parts (a graphed step's
    // launches are timed as one replay: nothing to fit).
    let measured = stoker_gpu::efficiency_fit::MeasuredParts {
        products_s: st
            .profile
            .iter()
            .filter(|p| p.part == Part::Products)
            .map(|p| p.ms / 1e3)
            .sum(),
        kernels_s: st
            .profile
            .iter()
            .filter_map(|p| match p.part {
                Part::Kernel(k) => Some((k, p.ms / 1e3)),
                _ => None,
            })
            .collect(),
    };
    let all: Vec<_> = work
        .micro_batch
        .iter()
        .chain(&work.update)
        .cloned()
        .collect();
    let fitted = stoker_gpu::efficiency_fit::fit(&all, &figures, &measured);
    let e = &fitted.efficiencies;
    let ratio = |r: Option<f64>| r.map_or_else(|| "not measured".into(), |r| format!("{r:.2}"));
    println!(
        "  fitted (stoker_gpu::efficiency_fit): products at {:.0}% of peak (measured/forecast {}), streaming kernels at {:.0}% of the bandwidth ({}), tensor-core kernels at {:.0}% of peak ({})",
        100.0 * e.product,
        ratio(fitted.products),
        100.0 * e.memory,
        ratio(fitted.memory),
        100.0 * e.tensor_kernel,
        ratio(fitted.tensor_kernels)
    );
    Some(fitted)
}

/// FP8 products (cuBLASLt, Hopper's tensor cores) against the host build, then GPT-2
/// 124M's linear layers timed in bf16 and in FP8.
#[cfg(feature = "cuda")]
fn fp8_products(
    dev: &stoker_gpu::device::Device,
    batch: usize,
    reps: usize,
    failed: &mut Vec<&str>,
) {
    use stoker_gpu::device::fp8_check::{
        compare_fp8_products, time_fp8_products, FP8_PRODUCT_TOLERANCE,
    };
    println!("\nFP8 products (cuBLASLt, per-tensor delayed scales) against the host build (largest difference over the largest value):");
    match compare_fp8_products(dev) {
        Ok(rows) => {
            for r in rows {
                let ok = r.rel <= FP8_PRODUCT_TOLERANCE; // false for NaN
                println!(
                    "  {:<36} {:>10.2e} (tolerance {FP8_PRODUCT_TOLERANCE:.0e}) {}",
                    r.name,
                    r.rel,
                    if ok { "OK" } else { "FAILED" }
                );
                if !ok {
                    failed.push("FP8 products against the host build");
                }
            }
        }
        Err(e) => {
            println!("  did not run: {e}");
            failed.push("FP8 products against the host build");
            return;
        }
    }
    println!(
        "GPT-2 124M's linear layers' forward products at {batch} x 1024 rows, bf16 against FP8 (median of {reps}; FP8's two casts apart):"
    );
    match time_fp8_products(dev, batch, reps.max(1)) {
        Ok(rows) => {
            println!(
                "{:<44} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "product", "bf16 us", "fp8 us", "casts us", "fp8 TF/s", "(fp8+casts)/bf16"
            );
            for r in rows {
                println!(
                    "{:<44} {:>9.1} {:>9.1} {:>9.1} {:>9.0} {:>9.3}",
                    r.name,
                    r.bf16_micros,
                    r.fp8_micros,
                    r.cast_micros,
                    r.flops / (r.fp8_micros * 1e-6) / 1e12,
                    (r.fp8_micros + r.cast_micros) / r.bf16_micros
                );
            }
        }
        Err(e) => {
            println!("  did not run: {e}");
            failed.push("FP8 products' timing");
        }
    }
}

/// GPT-2 124M's products through cuBLASLt and through cuBLAS: their outputs' distance and
/// times. Where cuBLASLt fails or disagrees, the rest of the run uses cuBLAS and the
/// part fails, so one device call still measures everything else.
#[cfg(feature = "cuda")]
fn gemm_libraries(
    dev: &stoker_gpu::device::Device,
    batch: usize,
    reps: usize,
    failed: &mut Vec<&str>,
) {
    use stoker_gpu::device::{gemm_check, GemmLibrary};
    // Both round a f32 sum once to bf16 (or keep f32): a bf16 rounding apart at most.
    const TOLERANCE: f64 = 1e-2;
    println!(
        "\nGPT-2 124M's products (micro-batch {batch} x 1024, bf16, f32 sums): cuBLASLt (bias in the epilogue) against cuBLAS (bias by add_bias), median of {reps}:"
    );
    match gemm_check::compare_gemm_libraries(dev, batch, reps.max(1)) {
        Ok(rows) => {
            println!(
                "{:<36} {:>10} {:>10} {:>8} {:>9} {:>11}",
                "product", "Lt us", "cuBLAS us", "Lt/cuB", "Lt TF/s", "max diff"
            );
            let mut bad = false;
            for r in &rows {
                let ok = r.rel_diff <= TOLERANCE; // false for NaN
                bad |= !ok;
                println!(
                    "{:<36} {:>10.1} {:>10.1} {:>8.3} {:>9.0} {:>11.2e}{}",
                    r.name,
                    r.lt_micros,
                    r.cublas_micros,
                    r.lt_micros / r.cublas_micros,
                    r.flops / (r.lt_micros * 1e-6) / 1e12,
                    r.rel_diff,
                    match (ok, r.lt_ran) {
                        (false, _) => "  FAILED",
                        (true, false) =>
                            "  (not run by cuBLASLt: no algorithm, or refused; both through cuBLAS)",
                        (true, true) => "",
                    }
                );
            }
            let (lt, cublas) = rows.iter().fold((0.0, 0.0), |(l, c), r| {
                (l + r.lt_micros, c + r.cublas_micros)
            });
            println!(
                "all products: cuBLASLt {lt:.1} us, cuBLAS {cublas:.1} us, ratio {:.3}",
                lt / cublas
            );
            if bad {
                println!("cuBLASLt disagrees with cuBLAS beyond {TOLERANCE:e}: the rest runs through cuBLAS");
                dev.set_gemm_library(GemmLibrary::Cublas);
                failed.push("cuBLASLt's products");
            }
        }
        Err(e) => {
            println!("cuBLASLt's products did not run: {e}; the rest runs through cuBLAS");
            dev.set_gemm_library(GemmLibrary::Cublas);
            failed.push("cuBLASLt's products");
        }
    }
}
