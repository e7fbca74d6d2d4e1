"""What the statistics level costs per byte: `tensor_stats` against one plain pass and a CRC-32 over the same data.

    python bench/bench_stats.py                # 28 tensors of 8x64x112x112 float32 (resnet18 b8's largest), 720 MB
    python bench/bench_stats.py --dtype bfloat16 --count 14

Prints the median and range of `--repeat` passes over all the tensors: `x.sum()` (one read of the data, the floor
for anything that reads it), `zlib.crc32` of the bytes (the checksum a CPU stats file held before `rowcol32`),
and `format.stats.tensor_stats` (min, max, mean, L2 norm, sum |x|, the NaN/Inf check and the `rowcol32`
checksum). The tensors are distinct (720 MB exceeds any cache), as a recording's are.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

import torch

from oneiter.format.stats import tensor_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=28)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(8, 64, 112, 112, generator=gen).to(getattr(torch, args.dtype)) for _ in range(args.count)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    passes = {
        "one pass (x.sum())": lambda t: t.sum(),
        "zlib.crc32 of the bytes": lambda t: zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()),
        "tensor_stats (stats + rowcol32)": tensor_stats,
    }
    print(f"{args.count} tensors, {nbytes / 1e6:.0f} MB of {args.dtype}, {torch.get_num_threads()} threads")
    for name, fn in passes.items():
        for t in tensors[:2]:
            fn(t)  # warm
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for t in tensors:
                fn(t)
            times.append(time.perf_counter() - start)
        med = statistics.median(times)
        print(f"  {name:34s} {med:6.3f} s [{min(times):.3f}-{max(times):.3f}]  {nbytes / med / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
