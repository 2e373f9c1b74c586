"""torch.utils.data.DataLoader over the same .npy files through np.memmap: the baseline of
`stoker bench loader`. Prints one line per num_workers and the best.
Usage: torch_loader.py PREFIX --batch 256 --workers 0,1,2,4 --seconds 3"""
import argparse
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class MemmapDataset(Dataset):
    def __init__(self, prefix):
        self.prefix = prefix
        self.images = np.load(prefix + ".image.npy", mmap_mode="r")
        self.labels = np.load(prefix + ".label.npy", mmap_mode="r")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.images[i])), int(self.labels[i])


def measure(ds, batch, workers, seconds):
    kw = dict(batch_size=batch, shuffle=True, num_workers=workers, drop_last=False,
              generator=torch.Generator().manual_seed(0))
    if workers > 0:
        kw.update(prefetch_factor=2, persistent_workers=True)
    loader = DataLoader(ds, **kw)
    samples, t0, warm = 0, None, True
    while True:
        for x, y in loader:
            if warm:
                warm, t0 = False, time.perf_counter()
                continue
            samples += x.shape[0]
            if time.perf_counter() - t0 >= seconds:
                el = time.perf_counter() - t0
                return samples / el, samples * (x[0].numel() * 4 + 8) / el / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", default="0,1,2,4")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    ds = MemmapDataset(a.prefix)
    best = (0.0, 0.0, -1)
    print(f"torch {torch.__version__} DataLoader over np.memmap, batch {a.batch}, shuffled")
    for w in [int(x) for x in a.workers.split(",")]:
        sps, mbs = measure(ds, a.batch, w, a.seconds)
        print(f"  num_workers {w}: {sps:12.0f} samples/s {mbs:10.1f} MB/s")
        if sps > best[0]:
            best = (sps, mbs, w)
    print(f"best: num_workers {best[2]}: {best[0]:.0f} samples/s {best[1]:.1f} MB/s")


if __name__ == "__main__":
    main()
