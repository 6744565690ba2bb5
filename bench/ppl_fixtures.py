#!/usr/bin/env python3
"""Perplexity of the bundled fixture models on every corpus domain and WikiText-2.

Runs `dynmoe eval ppl --json` (llama.cpp semantics, ctx 512) for each model, precision
and text, prints a table, and writes JSON. Beside each bf16 number it puts the
perplexity transformers computed for the same checkpoint when it was trained (the table
in the model's README), so the two implementations can be compared. Precisions other
than bf16 run a converted copy of the model (`dynmoe convert`, `dynmoe store ensure`)
with its experts read from the 4-, 3- or 2-bit store.

    cargo build --release
    python3 bench/ppl_fixtures.py                                   # -> bench/results/ppl_fixtures.json
    python3 bench/ppl_fixtures.py --models small-moe --bits bf16,4,3,2 \
        --out bench/results/ppl_bits.json
    python3 bench/ppl_fixtures.py --models small-moe --chunks 16 \
        --bits bf16,vq1,vq1.5,vq2,vq3,vq4,2,3,4 --out bench/results/ppl_codecs.json

A precision written `vq3+dense` also runs the dense linear layers (attention, shared
experts) at the experts' codec (`--dense-codec`), `+head` the untied LM head
(`--head-codec`); `+dense=q4` and `+head=q4` name another codec (bf16 experts:
`bf16+dense=q4+head=q4`; an affine dense or head codec is quantized at load). Rows give the
bits per dense and per head weight too.

    python3 bench/ppl_fixtures.py --models small-moe --chunks 8 \
        --bits bf16,bf16+dense=q4,bf16+head=q4,bf16+dense=q4+head=q4,4+dense+head
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["en", "code", "zh", "math", "json"]


def transformers_ppl(model_dir: Path) -> dict:
    """Per-domain perplexity from the README table the training script wrote."""
    readme = model_dir / "README.md"
    if not readme.exists():
        return {}
    rows = re.findall(r"^\| (\w+) \| ([0-9.]+) \| ([0-9.]+) \| (\d+) \|$", readme.read_text(), re.M)
    return {d: float(p) for d, p, _, _ in rows}


def split(precision: str) -> tuple[str, str, str]:
    """(expert, dense, head codec) of a precision: `vq3+dense` puts the experts and the
    dense layers at vq3, `bf16+dense=q4+head=q4` the dense layers and the head at q4."""
    experts, *parts = precision.split("+")
    codec = "bf16" if experts == "bf16" else experts if experts.startswith("vq") else f"q{experts}"
    chosen = {"dense": "bf16", "head": "bf16"}
    for part in parts:
        what, _, other = part.partition("=")
        if what not in chosen:
            raise SystemExit(f"{precision}: {part!r} is not dense, head, dense=CODEC or head=CODEC")
        chosen[what] = other or codec
    return codec, chosen["dense"], chosen["head"]


def priced_bits(binary: str, model: Path, precision: str) -> tuple[float, float, float]:
    """Bits per routed-expert weight, per dense-linear weight and per LM head weight, as
    `dynmoe inspect` prices them."""
    codec, dense, head = split(precision)
    out = json.loads(subprocess.run([binary, "inspect", str(model), "--codec", codec, "--dense-codec", dense,
                                     "--head-codec", head, "--json"],
                                    check=True, capture_output=True, text=True).stdout)
    bits = out["bits"]
    expert_bytes = sum(l["resident_bytes"] for l in bits["layers"])
    params = out["params_by_kind"]

    def per_weight(kinds: tuple[str, ...]) -> float:
        n = sum(params.get(k, 0) for k in kinds)
        return round(sum(bits["resident_by_kind"].get(k, 0) for k in kinds) * 8 / n, 4) if n else 16.0

    return (round(expert_bytes * 8 / params["routed_experts"], 4),
            per_weight(("attention", "shared_experts", "dense_mlp")), per_weight(("lm_head",)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-moe,small-moe")
    ap.add_argument("--binary", default=str(ROOT / "target/release/dynmoe"))
    ap.add_argument("--wikitext", default=str(ROOT / "data/wikitext-2-raw/wiki.test.raw"))
    ap.add_argument("--bits", default="bf16",
                    help="precisions: bf16, expert bits 4, 3, 2 (affine stores) and/or VQ rungs vq1.5, vq2, ...")
    ap.add_argument("--chunks", type=int, default=None, help="evaluate at most this many chunks per text")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ppl_fixtures.json"))
    args = ap.parse_args()

    results = []
    work = tempfile.TemporaryDirectory(prefix="dynmoe-ppl-")
    for name in args.models.split(","):
        model = ROOT / "fixtures/models" / name
        reference = transformers_ppl(model)
        texts = [(d, ROOT / "data/corpus" / d / "test.txt") for d in DOMAINS]
        texts.append(("wikitext2", Path(args.wikitext)))
        converted = None
        for precision in args.bits.split(","):
            run_dir, extra = model, []
            codec, dense, head = split(precision)
            if codec.startswith("vq"):
                extra = ["--codec", codec]
            elif codec != "bf16":
                if converted is None:
                    converted = Path(work.name) / name
                    subprocess.run([args.binary, "convert", "--model", str(model), "-o", str(converted)],
                                   check=True, capture_output=True)
                run_dir, extra = converted, ["--expert-bits", codec[1:]]
            extra += ["--dense-codec", dense] if dense != "bf16" else []
            extra += ["--head-codec", head] if head != "bf16" else []
            for label, path in texts:
                t = time.time()
                out = subprocess.run(
                    [args.binary, "eval", "ppl", "--model", str(run_dir), "--text", str(path), "--json", *extra,
                     *(["--chunks", str(args.chunks)] if args.chunks else [])],
                    check=True, capture_output=True, text=True,
                ).stdout
                r = json.loads(out)
                expert_bpw, dense_bpw, head_bpw = priced_bits(args.binary, model, precision)
                r.update(model=name, precision=precision, text=label, wall_s=round(time.time() - t, 2),
                         expert_bits_per_weight=expert_bpw, dense_bits_per_weight=dense_bpw,
                         head_bits_per_weight=head_bpw,
                         transformers_ppl=reference.get(label) if precision == "bf16" else None)
                results.append(r)
                ref = f"{r['transformers_ppl']:.3f}" if r["transformers_ppl"] else "-"
                print(f"{name:<10} {precision:>4} {label:<10} ppl {r['ppl']:>9.3f} ± {r['ppl_stderr']:<7.3f} "
                      f"transformers {ref:>9}  {r['tokens_scored']:>7} tokens  {r['tokens_per_second']:>7.0f} tok/s",
                      flush=True)
    by = {}
    for r in results:
        by.setdefault((r["model"], r["precision"]), {})[r["text"]] = r["ppl"]
    labels = [t for t, _ in texts]
    width = max(10, *(len(p) for _, p in by))
    print(f"\n{'model':<10} {'codec':>{width}} {'experts':>7} {'dense':>7} {'head':>7} "
          + " ".join(f"{t:>9}" for t in labels))
    for (m, p), row in by.items():
        r0 = next(r for r in results if r["model"] == m and r["precision"] == p)
        print(f"{m:<10} {p:>{width}} {r0['expert_bits_per_weight']:>7.3f} {r0['dense_bits_per_weight']:>7.3f} "
              f"{r0['head_bits_per_weight']:>7.3f} " + " ".join(f"{row.get(t, float('nan')):>9.3f}" for t in labels))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ctx": 512, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
