#!/usr/bin/env python3
"""Perplexity against resident bits of the routed experts on small-moe: ISP plans
(`dynmoe compress --scope experts`, two rounds and one round) beside uniform VQ rungs.

Each plan is probed on the five domains' calib splits (`--chunks` per text and probe)
and evaluated with `dynmoe eval ppl --plan` on the first `--eval-chunks` chunks of each
domain's test split; the uniform rungs on the same chunks. Writes JSON and prints a table.

    cargo build --release
    python3 bench/quality.py --bits 1.5,2 --uniform vq1.25,vq1.5 --out bench/results/quality_v2.json
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["en", "code", "zh", "math", "json"]


def run(binary, *args):
    return json.loads(subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout)


def ppl(binary, model, extra, chunks):
    return {d: run(binary, "eval", "ppl", "--model", str(model), "--text",
                   str(ROOT / "data/corpus" / d / "test.txt"), "--chunks", str(chunks), "--json", *extra)["ppl"]
            for d in DOMAINS}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(ROOT / "target/release/dynmoe"))
    ap.add_argument("--model", default=str(ROOT / "fixtures/models/small-moe"))
    ap.add_argument("--bits", default="1.5,2")
    ap.add_argument("--uniform", default="vq1,vq1.25,vq1.5,vq1.75,vq2.25")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--eval-chunks", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/quality.json"))
    args = ap.parse_args()
    calib = ",".join(str(ROOT / "data/corpus" / d / "calib.txt") for d in DOMAINS)
    work = Path(tempfile.mkdtemp(prefix="dynmoe-quality-"))
    rows = []
    for bits in args.bits.split(","):
        for rounds in [2, 1]:
            out = work / f"isp-{bits}-{rounds}"
            plan = run(args.binary, "compress", "--model", args.model, "--bits", bits, "--scope", "experts",
                       "--calib", calib, "--chunks", str(args.chunks), "--rounds", str(rounds), "-o", str(out), "--json")
            row = {"method": f"ISP, {len(plan['rounds']['rounds'])} round(s) (limit {rounds})", "budget_bits": float(bits),
                   "expert_bits": plan["resident_bytes"] * 8 / plan["params_total"],
                   "layers": [(l["codec"], l["resident"]) for l in plan["layers"]],
                   "ppl": ppl(args.binary, args.model, ["--plan", str(out / "plan.json")], args.eval_chunks)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for codec in args.uniform.split(","):
        info = run(args.binary, "inspect", args.model, "--codec", codec, "--json")
        experts = info["params_by_kind"]["routed_experts"]
        b = info["bits"]
        resident = sum(l["resident_bytes"] for l in b["layers"]) + b["codebook_bytes"]
        row = {"method": f"uniform {codec}", "expert_bits": resident * 8 / experts,
               "ppl": ppl(args.binary, args.model, ["--codec", codec], args.eval_chunks)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'method':<32} {'bits':>6} " + " ".join(f"{d:>9}" for d in DOMAINS))
    for r in rows:
        print(f"{r['method']:<32} {r['expert_bits']:>6.3f} " + " ".join(f"{r['ppl'][d]:>9.3f}" for d in DOMAINS))
    Path(args.out).write_text(json.dumps({"model": args.model, "scope": "routed experts (and their codebooks)",
                                          "calib_chunks_per_text": args.chunks,
                                          "eval_chunks_per_text": args.eval_chunks, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
