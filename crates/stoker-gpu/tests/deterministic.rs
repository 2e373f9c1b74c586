//! Deterministic mode on the resident loop: a window of 8 micro-batches trained on 1, 2,
//! 4 and 8 in-process ranks (8 to 1 micro-batches each) ends on the same bits: every
//! report, every rank's master and compute copy, in f32, bf16 and f16 under a loss
//! scale, AdamW with clipping and SGD. The default window does not (its sums follow the
//! world size), which the last test shows, so the equality is the tree's doing.

mod ranks;

use half::{bf16, f16};
use ranks::*;
use stoker_comm::{run_local, Communicator, DEFAULT_TIMEOUT};
use stoker_gpu::parallel::{GradRule, Strategy, ThroughHost};
use stoker_gpu::sample::batch;
use stoker_gpu::step::optimizer::Optimizer;
use stoker_gpu::step::options::StepOptions;
use stoker_gpu::step::TokenBatch;
use stoker_gpu::{Act, Host};

/// Micro-batches of a window over all ranks: a power of two, whole subtrees at 1 to 8
/// ranks (and 8 on one rank: a tree three levels high).
const GLOBAL: usize = 8;

/// Window `w`'s 8 micro-batches: the shared helper's 6, and 2 of another window's.
fn window8(w: usize) -> Vec<(Vec<i64>, Vec<i64>)> {
    let mut all = window(w);
    all.extend(window(w + WINDOWS).into_iter().take(GLOBAL - MICRO));
    all
}

/// What a rank ends with: each window's (loss, tokens, norm) bits, its master's (under
/// ZeRO-1 its shard's) and the compute copy's bits, and where its master starts.
type End = (Vec<(u64, u64, u64)>, Vec<u32>, Vec<u32>, usize);

fn train<T: Act, C: Communicator>(
    comm: &C,
    strategy: Strategy,
    opt: Optimizer,
    rule: GradRule,
    deterministic: Option<usize>,
) -> Result<End, stoker_gpu::GpuError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut replica = replica::<T>((strategy, StepOptions::default()), opt, (rank, world))?;
    if let Some(chunk) = deterministic {
        replica = replica.with_deterministic(&Host, GLOBAL / world, world, chunk)?;
    }
    let coll = ThroughHost(comm);
    let per = GLOBAL / world;
    let mut reports = Vec::new();
    for w in 0..WINDOWS {
        let data = window8(w);
        let mine: Vec<TokenBatch> = data[rank * per..(rank + 1) * per]
            .iter()
            .map(batch)
            .collect();
        let r = replica.window(&Host, &coll, &mine, &scalars(opt, w as u64 + 1), rule)?;
        reports.push((r.loss.to_bits(), r.tokens, r.grad_norm.to_bits()));
    }
    let (range, master) = replica.state().master(&Host)?;
    let copy = replica.step().buffers().params(&Host)?;
    let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect();
    Ok((reports, bits(master), bits(copy), range.start))
}

/// `got`'s bits are `want`'s: as many elements, none differing.
fn same_bits(got: &[u32], want: &[u32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: elements");
    let differ = got.iter().zip(want).filter(|(x, y)| x != y).count();
    assert_eq!(differ, 0, "{what}: elements differing from one rank's");
}

/// Every rank of every world size (1, 2, 4, 8) ends where one rank does.
fn same_at_every_world<T: Act>(what: &str, opt: Optimizer, rule: GradRule, chunk: usize) {
    let mut want: Option<End> = None;
    for world in [1, 2, 4, 8] {
        let ends = run_local(world, DEFAULT_TIMEOUT, |comm| {
            train::<T, _>(&comm, Strategy::Ddp, opt, rule, Some(chunk)).unwrap()
        });
        for (rank, end) in ends.into_iter().enumerate() {
            let Some(w) = &want else {
                want = Some(end);
                continue;
            };
            assert_eq!(end.0, w.0, "{what}: reports of rank {rank} of {world}");
            let of = format!("of rank {rank} of {world}");
            same_bits(&end.1, &w.1, &format!("{what}: master {of}"));
            same_bits(&end.2, &w.2, &format!("{what}: compute copy {of}"));
        }
    }
}

#[test]
fn deterministic_ddp_gives_one_rank_s_bits_at_2_4_and_8_ranks() {
    // A chunk that does not divide the buffer: several rounds, the last one short.
    let chunk = 1000;
    same_at_every_world::<f32>("f32 adamw", Optimizer::AdamW, rule(Some(0.5)), chunk);
    same_at_every_world::<bf16>("bf16 adamw", Optimizer::AdamW, rule(Some(0.5)), chunk);
    let sgd = Optimizer::Sgd { momentum: true };
    same_at_every_world::<f32>("f32 sgd", sgd, rule(None), 1 << 22);
    let scaled = GradRule {
        clip: Some(1.0),
        loss_scale: Some(1024.0),
    };
    same_at_every_world::<f16>("f16 adamw, scale 1024", Optimizer::AdamW, scaled, chunk);
    // The optimizer offloaded to the host (DDP's ZeRO-Offload) takes the same gradient.
    let mut ends = Vec::new();
    for (world, strategy) in [(1, Strategy::Ddp), (2, Strategy::Offload)] {
        let got = run_local(world, DEFAULT_TIMEOUT, |comm| {
            train::<f32, _>(
                &comm,
                strategy,
                Optimizer::AdamW,
                rule(Some(0.5)),
                Some(chunk),
            )
            .unwrap()
        });
        ends.extend(got);
    }
    assert!(ends.iter().all(|e| e.1 == ends[0].1), "offloaded optimizer");
}

#[test]
fn deterministic_zero1_gives_one_rank_s_bits_at_2_4_and_8_ranks() {
    // Every rank holds the whole tree-summed gradient; the norm comes from it whole, and
    // each shard's optimizer step is element by element: one DDP rank's bits.
    let (adamw, clip) = (Optimizer::AdamW, rule(Some(0.5)));
    let one = run_local(1, DEFAULT_TIMEOUT, |comm| {
        train::<f32, _>(&comm, Strategy::Ddp, adamw, clip, Some(1000)).unwrap()
    })
    .remove(0);
    for (world, strategy) in [
        (2, Strategy::Zero1),
        (4, Strategy::Zero1),
        (8, Strategy::Zero1),
        (2, Strategy::Zero1Offload),
    ] {
        let ends = run_local(world, DEFAULT_TIMEOUT, |comm| {
            train::<f32, _>(&comm, strategy, adamw, clip, Some(1000)).unwrap()
        });
        for (rank, (reports, shard, copy, start)) in ends.into_iter().enumerate() {
            let what = format!("{strategy:?}, rank {rank} of {world}");
            assert_eq!(reports, one.0, "{what}: reports");
            assert_eq!(
                shard[..],
                one.1[start..start + shard.len()],
                "{what}: master shard"
            );
            assert_eq!(copy, one.2, "{what}: compute copy");
        }
    }
}

#[test]
fn the_default_window_s_bits_follow_the_world_size() {
    // Without the tree, 4 ranks sum through the collective and one rank in place: some
    // element of the master differs. (If this ever passes with equal bits, the test
    // above proves nothing about the tree.)
    let plain = |world| {
        run_local(world, DEFAULT_TIMEOUT, |comm| {
            let (ddp, adamw) = (Strategy::Ddp, Optimizer::AdamW);
            train::<f32, _>(&comm, ddp, adamw, rule(Some(0.5)), None).unwrap()
        })
    };
    let (one, four) = (plain(1), plain(4));
    let differing = one[0]
        .1
        .iter()
        .zip(&four[0].1)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differing > 0,
        "the default window matched one rank bit for bit"
    );
}

#[test]
fn deterministic_mode_refuses_what_its_tree_cannot_sum() {
    let err = |r: Result<End, stoker_gpu::GpuError>| r.unwrap_err().to_string();
    // ZeRO-2's gradients reduced block by block as the backward goes.
    let e = run_local(2, DEFAULT_TIMEOUT, |comm| {
        err(train::<f32, _>(
            &comm,
            Strategy::Zero2,
            Optimizer::AdamW,
            rule(None),
            Some(1000),
        ))
    });
    assert!(e[0].contains("parallel.deterministic"), "{}", e[0]);
    // A world that is not a power of two.
    let e = run_local(3, DEFAULT_TIMEOUT, |comm| {
        let ddp = (Strategy::Ddp, StepOptions::default());
        let replica = replica::<f32>(ddp, Optimizer::AdamW, (comm.rank(), 3)).unwrap();
        match replica.with_deterministic(&Host, 2, 3, 1000) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    });
    assert!(
        e.iter().all(|e| e.contains("power-of-two world size")),
        "{e:?}"
    );
}

#[test]
fn a_rank_whose_micro_batch_fails_fails_the_window_on_every_rank() {
    // Rank 1's token ids lie outside the vocabulary: its step refuses the micro-batch
    // before any collective. Rank 0 must not wait in the tree's all-gather for it.
    let errors = run_local(2, DEFAULT_TIMEOUT, |comm| {
        let rank = comm.rank();
        let ddp = (Strategy::Ddp, StepOptions::default());
        let replica = replica::<f32>(ddp, Optimizer::AdamW, (rank, 2))
            .unwrap()
            .with_deterministic(&Host, 1, 2, 1000)
            .unwrap();
        let mut data = window(0).remove(rank);
        if rank == 1 {
            data.0[3] = DIMS.vocab as i64;
        }
        let r = replica.window(
            &Host,
            &ThroughHost(&comm),
            &[batch(&data)],
            &scalars(Optimizer::AdamW, 1),
            rule(None),
        );
        r.unwrap_err().to_string()
    });
    assert!(errors[0].contains("1 of 2 ranks failed"), "{}", errors[0]);
    assert!(errors[1].contains("outside"), "{}", errors[1]);
}
