"""Per-kernel totals of an Nsight Compute CSV (gpu__time_duration.sum), largest first.

    python3 kernel_times.py profile.csv [runs]

`runs`: how many times the profiled program repeated the work (the totals and call
counts are divided by it, so they read as one repetition's).
"""
import csv
import sys
from collections import defaultdict

path = sys.argv[1]
runs = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
total = defaultdict(float)
count = defaultdict(int)
with open(path, newline="") as f:
    # ncu writes its own log lines before the CSV header.
    lines = [l for l in f if l.startswith('"')]
for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"].split("(")[0]
    v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "nsecond")
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
    total[name] += v * scale
    count[name] += 1
grand = sum(total.values())
print(f"{'kernel':<36} {'calls':>7} {'us/repeat':>10} {'share':>6}")
for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{name:<36} {count[name] / runs:>7.0f} {us / runs:>10.1f} {us / grand:>6.1%}")
print(f"{'all kernels':<36} {sum(count.values()) / runs:>7.0f} {grand / runs:>10.1f}")
