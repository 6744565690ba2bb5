#!/usr/bin/env python3
"""Two ISP rounds against one on small-moe, at two calibration sizes.

For each budget and number of calibration chunks per domain, runs `dynmoe compress
--plan-only` with two rounds, then with one round starting from the two-round run's probe
journal (so the first round is the same), and scores both plans:

- the probes' objective: mean calibration NLL over the five domains, resident sets held
  (as the probes ran) and following the text (as the model runs);
- the mean NLL and geometric-mean perplexity over the five test splits (8 chunks each),
  run as `eval ppl --plan` runs a plan (dynamic residency).

Probe journals are kept in --work, so a rerun only re-scores.

    cargo build --release
    python3 bench/isp_rounds.py                       # -> bench/results/isp_rounds.json
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["en", "code", "zh", "math", "json"]


def compress(binary, model, bits, chunks, rounds, out):
    # Paths relative to the repository: they are part of the probe journal's context.
    calib = ",".join(f"data/corpus/{d}/calib.txt" for d in DOMAINS)
    subprocess.run([binary, "compress", "-m", model, "--bits", f"{bits:g}", "--scope", "experts",
                    "--calib", calib, "--chunks", str(chunks), "--rounds", str(rounds), "--plan-only",
                    "-o", str(out)], check=True, capture_output=True, cwd=ROOT)
    return out / "plan.json"


def nll(binary, model, plan, text, chunks, residency):
    out = subprocess.run([binary, "eval", "ppl", "-m", model, "--plan", str(plan), "--residency", residency,
                          "--text", str(text), "--chunks", str(chunks), "--json"],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out)["nll_mean"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(ROOT / "target/release/dynmoe"))
    ap.add_argument("--model", default="fixtures/models/small-moe", help="relative to the repository")
    ap.add_argument("--budgets", default="1.5,2")
    ap.add_argument("--calib-chunks", default="2,6")
    ap.add_argument("--work", default=str(ROOT / "target/isp-rounds"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/isp_rounds.json"))
    args = ap.parse_args()
    work = Path(args.work).resolve()
    rows = []
    for chunks in map(int, args.calib_chunks.split(",")):
        for bits in map(float, args.budgets.split(",")):
            tag = f"c{chunks}-{bits:g}"
            plans = {2: compress(args.binary, args.model, bits, chunks, 2, work / f"{tag}-r2")}
            one = work / f"{tag}-r1"
            one.mkdir(parents=True, exist_ok=True)
            if not (one / "probes.jsonl").exists():
                shutil.copy(work / f"{tag}-r2" / "probes.jsonl", one / "probes.jsonl")
            plans[1] = compress(args.binary, args.model, bits, chunks, 1, one)
            for rounds, plan in sorted(plans.items()):
                p = json.loads(plan.read_text())
                calib = {mode: sum(nll(args.binary, args.model, plan, ROOT / "data/corpus" / d / "calib.txt",
                                       chunks, mode) for d in DOMAINS) / len(DOMAINS)
                         for mode in ("static", "dynamic")}
                test = {d: nll(args.binary, args.model, plan, ROOT / "data/corpus" / d / "test.txt", 8, "dynamic")
                        for d in DOMAINS}
                row = {
                    "calib_chunks": chunks, "budget_bits": bits, "rounds": rounds,
                    "resident_bytes": p["resident_bytes"],
                    "layers": [[str(l["codec"]), l["resident"]] for l in p["layers"]],
                    "calib_nll_static": calib["static"], "calib_nll_dynamic": calib["dynamic"],
                    "test_nll": sum(test.values()) / len(test),
                    "test_geomean_ppl": math.exp(sum(test.values()) / len(test)),
                    "test_ppl": {d: math.exp(v) for d, v in test.items()},
                }
                rows.append(row)
                print(f"calib {chunks} chunks  {bits:g} b  {rounds} round(s)  calib NLL static "
                      f"{row['calib_nll_static']:.4f} dynamic {row['calib_nll_dynamic']:.4f}  "
                      f"test geomean ppl {row['test_geomean_ppl']:.3f}  {row['layers']}", flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
