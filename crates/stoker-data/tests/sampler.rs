//! Samplers: torch-compatible order and sharding, world-size-independent global batches.

use std::collections::BTreeMap;

use stoker_data::{Partition, Sampler, SamplerConfig};

fn cfg(shuffle: bool, rank: usize, world: usize, drop_last: bool) -> SamplerConfig {
    SamplerConfig {
        shuffle,
        seed: 7,
        rank,
        world,
        drop_last,
        partition: Partition::Strided,
    }
}

#[test]
fn sequential_and_seeded_shuffle() {
    let s = Sampler::new(10, SamplerConfig::default()).unwrap();
    assert_eq!(s.epoch_indices(3), (0..10).collect::<Vec<_>>());
    let s = Sampler::new(1000, cfg(true, 0, 1, false)).unwrap();
    let (e0, e1) = (s.epoch_indices(0), s.epoch_indices(1));
    let mut sorted = e0.clone();
    sorted.sort();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>(), "a permutation");
    assert_ne!(e0, e1, "re-drawn each epoch (set_epoch semantics)");
    assert_eq!(
        e0,
        Sampler::new(1000, cfg(true, 0, 1, false))
            .unwrap()
            .epoch_indices(0),
        "same (seed, epoch), same order"
    );
    let other = Sampler::new(
        1000,
        SamplerConfig {
            seed: 8,
            ..cfg(true, 0, 1, false)
        },
    )
    .unwrap();
    assert_ne!(e0, other.epoch_indices(0));
}

#[test]
fn distributed_matches_torch_padding_and_drop_last() {
    // torch: indices 0..10 padded to 12 with [0, 1], rank r takes r::3.
    let got: Vec<Vec<usize>> = (0..3)
        .map(|r| {
            Sampler::new(10, cfg(false, r, 3, false))
                .unwrap()
                .epoch_indices(0)
        })
        .collect();
    assert_eq!(
        got,
        vec![vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
    );
    let got: Vec<Vec<usize>> = (0..3)
        .map(|r| {
            Sampler::new(10, cfg(false, r, 3, true))
                .unwrap()
                .epoch_indices(0)
        })
        .collect();
    assert_eq!(got, vec![vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
    // Padding longer than the dataset repeats it.
    let got: Vec<usize> = (0..5)
        .flat_map(|r| {
            Sampler::new(2, cfg(false, r, 5, false))
                .unwrap()
                .epoch_indices(0)
        })
        .collect();
    assert_eq!(got, vec![0, 1, 0, 1, 0]);
}

#[test]
fn each_epoch_covers_the_data_once_plus_padding() {
    for (n, world) in [(103, 4), (100, 4), (7, 3), (1, 2)] {
        for epoch in 0..3 {
            let mut count = BTreeMap::new();
            let mut total = 0;
            for r in 0..world {
                let s = Sampler::new(n, cfg(true, r, world, false)).unwrap();
                let idx = s.epoch_indices(epoch);
                assert_eq!(idx.len(), n.div_ceil(world));
                total += idx.len();
                for i in idx {
                    *count.entry(i).or_insert(0) += 1;
                }
            }
            assert_eq!(count.len(), n, "every sample seen (n={n}, world={world})");
            let extra: usize = count.values().map(|c| c - 1).sum();
            assert_eq!(extra, total - n);
            assert_eq!(
                extra,
                n.div_ceil(world) * world - n,
                "only the padding repeats"
            );
        }
    }
}

#[test]
fn global_batches_are_independent_of_world_size() {
    let (n, g) = (103, 12);
    let steps = |world: usize, drop_last: bool| -> Vec<Vec<usize>> {
        let per = g / world;
        let ranks: Vec<Vec<usize>> = (0..world)
            .map(|r| {
                let c = SamplerConfig {
                    shuffle: true,
                    seed: 3,
                    rank: r,
                    world,
                    drop_last,
                    partition: Partition::GlobalBatch { global_batch: g },
                };
                Sampler::new(n, c).unwrap().epoch_indices(5)
            })
            .collect();
        let nsteps = ranks[0].len() / per;
        (0..nsteps)
            .map(|k| {
                let mut step: Vec<usize> = ranks
                    .iter()
                    .flat_map(|r| r[k * per..(k + 1) * per].to_vec())
                    .collect();
                step.sort();
                step
            })
            .collect()
    };
    for drop_last in [false, true] {
        let reference = steps(1, drop_last);
        assert_eq!(reference.len(), if drop_last { 8 } else { 9 });
        for world in [2, 3, 4, 6, 12] {
            assert_eq!(
                steps(world, drop_last),
                reference,
                "world {world}, drop_last {drop_last}"
            );
        }
    }
    let c = SamplerConfig {
        world: 5,
        partition: Partition::GlobalBatch { global_batch: 12 },
        ..SamplerConfig::default()
    };
    let e = Sampler::new(n, c).unwrap_err().to_string();
    assert!(
        e.contains("global_batch") && e.contains("12") && e.contains("5"),
        "{e}"
    );
}

#[test]
fn bad_sampler_configs() {
    let e = Sampler::new(10, cfg(false, 3, 3, false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank") && e.contains("world 3"), "{e}");
    assert!(Sampler::new(10, cfg(false, 0, 0, false))
        .unwrap_err()
        .to_string()
        .contains("world"));
    assert!(Sampler::new(0, SamplerConfig::default())
        .unwrap_err()
        .to_string()
        .contains("no samples"));
}
