"""Summarise an ncu per-instruction export by execution count (a development tool, no GPU needed).

`ncu -i REPORT --page source --csv --print-source sass > FILE.csv` (a report taken with `--section SourceCounters`,
as tools/dev/kernel_check/grouped_ab.sh does) lists every SASS instruction of the kernel with its warp-level execution
count and stall samples. Instructions executed equally often form one bucket, and a bucket's count names the loop it
belongs to: with 8 warps a block, count / 8 is the trip count, e.g. one per 64x64 tile (the tile loop), one per work
unit (the unit set-up), one per block (the prologue). This prints, per bucket, the instructions it holds, its share of
the executed instructions and of the stall samples, so that two builds or two kernels can be compared loop by loop.

Usage: python tools/dev/kernel_check/sass_counts.py FILE.csv [FILE.csv ...] [--top N] [--list COUNT,...]
(--list prints the instructions of the given buckets, in address order.)
"""

from __future__ import annotations

import argparse
import collections
import csv

EXEC, SAMPLES = "Instructions Executed", "Warp Stall Sampling (All Samples)"


def load(path: str) -> list[dict]:
    """The instruction rows of one ncu source-page CSV export."""
    rows, header = [], None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Address":
                header = r
            elif header and len(r) == len(header):
                rows.append(dict(zip(header, r, strict=True)))
    return rows


def summarise(path: str, top: int) -> None:
    ins = load(path)
    total = sum(int(d[EXEC]) for d in ins) or 1
    samples = sum(int(d[SAMPLES]) for d in ins) or 1
    print(f"{path}: {len(ins)} instructions, {total} executed, {samples} stall samples")
    count, share, stall = collections.Counter(), collections.Counter(), collections.Counter()
    for d in ins:
        c = int(d[EXEC])
        count[c] += 1
        share[c] += c
        stall[c] += int(d[SAMPLES])
    for c, v in share.most_common(top):
        print(
            f"  executed {c:>9} x {count[c]:>4} instructions: {100 * v / total:5.1f} % of executed, "
            f"{100 * stall[c] / samples:5.1f} % of stall samples"
        )


def listing(path: str, counts: set[int]) -> None:
    ins = load(path)
    base = int(ins[0]["Address"], 16) if ins else 0
    for d in ins:
        if int(d[EXEC]) in counts:
            print(f"{int(d['Address'], 16) - base:06x} {int(d[EXEC]):>9} {d[SAMPLES]:>5}  {d['Source'].strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=12, help="buckets to print per file")
    ap.add_argument("--list", default="", help="comma list of execution counts whose instructions to print")
    args = ap.parse_args()
    for path in args.files:
        if args.list:
            listing(path, {int(c) for c in args.list.split(",")})
        else:
            summarise(path, args.top)


if __name__ == "__main__":
    main()
