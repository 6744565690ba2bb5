"""Medians of the phase times routed_slices prints when built with SLICE_TIMES.

    DYNMOE_CUDA_DEFINES=SLICE_TIMES dynmoe bench decode ... | python3 slice_times.py

Each printed line is `slice-times BLOCK c1 .. c7`: SM cycles from the block's launch
wait to the end of each phase. Prints, per block position (first, middle, last), the
median of each phase's cycles over every launch, and the phases' own lengths.
"""

import statistics
import sys

PHASES = ["routed", "issued", "landed", "h staged", "down done", "barrier", "end"]
by_block = {}
for line in sys.stdin:
    f = line.split()
    if len(f) == 9 and f[0] == "slice-times":
        by_block.setdefault(int(f[1]), []).append([int(v) for v in f[2:]])
for block, rows in sorted(by_block.items()):
    med = [statistics.median(c) for c in zip(*rows)]
    own = [med[0]] + [b - a for a, b in zip(med, med[1:])]
    print(f"block {block}: {len(rows)} launches")
    for name, at, length in zip(PHASES, med, own):
        print(f"  {name:<10} at {at:8.0f} cycles, phase {length:7.0f}")
