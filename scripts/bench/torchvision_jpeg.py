#!/usr/bin/env python3
"""Baseline for the JPEG pipeline benchmark: torchvision ImageFolder + RandomResizedCrop(224) +
RandomHorizontalFlip + ToTensor + Normalize in a DataLoader, at several num_workers.

Usage: python3 scripts/bench/torchvision_jpeg.py DIR [--workers 0,1,2] [--batch 64] [--limit N]
Prints one RESULT line per worker count and a BEST line. Each count is timed over one whole
epoch, worker start-up included (a fork costs well under a second; the stoker side likewise
includes its thread start-up).
"""
import argparse
import time

import torch
import torchvision
import torchvision.transforms as T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    tf = T.Compose([
        T.RandomResizedCrop(224),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = torchvision.datasets.ImageFolder(args.dir, transform=tf)
    if args.limit:
        ds = torch.utils.data.Subset(ds, range(min(args.limit, len(ds))))
    # Warm-up, as the stoker side does: page cache, lazy torch/PIL initialization.
    for i in range(min(16, len(ds))):
        ds[i]
    best = 0.0
    for w in [int(x) for x in args.workers.split(",")]:
        loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=False, num_workers=w)
        start, count = time.perf_counter(), 0
        for images, _ in loader:
            count += images.shape[0]
        secs = time.perf_counter() - start
        rate = count / secs
        best = max(best, rate)
        print(f"RESULT torchvision num_workers={w} images={count} seconds={secs:.2f} "
              f"images_per_s={rate:.1f}", flush=True)
    print(f"BEST torchvision images_per_s={best:.1f}")


if __name__ == "__main__":
    main()
