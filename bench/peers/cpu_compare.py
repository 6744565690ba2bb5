#!/usr/bin/env python3
"""dynmoe's CPU engine beside llama.cpp's on one OLMoE-shaped model, rounds interleaved.

    python3 bench/peers/cpu_compare.py [--rounds 3] [--out bench/results/cpu_vs_llama_cpp.json]

Each round runs llama-bench (llama_cpp.sh: F32, Q4_K_M, Q2_K; prefill of 512 tokens and 128
tokens decoded, at depth 0 and 512) and then `dynmoe bench decode` on the same checkpoint
converted (experts q4 with attention and head bf16, experts q4 with attention and head q4,
experts q2 with attention and head q4), both from depth 0 (a 1-token prompt, as llama-bench's
tg128) and after a 512-token prompt. Medians over the rounds; every sample is in the JSON.
Both engines use every core of the machine (llama-bench -t, dynmoe's pool).

The checkpoint is written by olmoe_shape.py (random weights, the shape the project's CPU
issue measured: 6 layers, 32 experts of width 64, top-4, hidden 256, vocabulary 4,096).
Python 3 standard library only (llama_cpp.sh makes its own venv).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# (label, --bits, --dense-codec, --head-codec)
SETTINGS = [
    ("experts q4, attention and head bf16", "4", "bf16", "bf16"),
    ("experts q4, attention and head q4", "4", "q4", "q4"),
    ("experts q2, attention and head q4", "2", "q4", "q4"),
]


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), file=sys.stderr)
    return subprocess.run(cmd, check=True, **kw)


def dynmoe_round(exe, model, bits, dense, head, prompt, generate):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run([exe, "bench", "decode", model, "--bits", bits, "--dense-codec", dense,
             "--head-codec", head, "--prompt", str(prompt), "--generate", str(generate),
             "--repeats", "1", "--json", f.name], stdout=subprocess.DEVNULL)
        case = json.load(open(f.name))["cases"][0]
    return case["prefill_tok_s"], case["decode_tok_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkpoint", default="/tmp/olmoe-13m")
    ap.add_argument("--dynmoe", default=str(ROOT / "target/release/dynmoe"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu_vs_llama_cpp.json"))
    a = ap.parse_args()
    ckpt = Path(a.checkpoint)
    if not (ckpt / "model.safetensors").exists():
        run([sys.executable, HERE / "olmoe_shape.py", "--out", ckpt])
    converted = Path(str(ckpt) + "-converted")
    if not (converted / "experts.json").exists():
        run([a.dynmoe, "convert", "-m", ckpt, "-o", converted], stdout=subprocess.DEVNULL)

    llama = {}
    ours = {label: {"prefill": [], "decode_at_0": [], "decode_at_512": []}
            for label, *_ in SETTINGS}
    for r in range(a.rounds):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, REPEATS="1", DEPTHS="0,512")
            run(["bash", HERE / "llama_cpp.sh", ckpt, f.name], env=env)
            summary = json.load(open(f.name))
        for t, m in summary["models"].items():
            d = llama.setdefault(t, {"size_bytes": m["model_size_bytes"], "prefill": [],
                                     "decode_at_0": [], "decode_at_512": []})
            d["prefill"].append(m["prefill"]["median_tok_s"])
            d["decode_at_0"].append(m["decode"]["median_tok_s"])
            d["decode_at_512"].append(m["decode_at_512"]["median_tok_s"])
        for label, bits, dense, head in SETTINGS:
            o = ours[label]
            _, dec0 = dynmoe_round(a.dynmoe, converted, bits, dense, head, 1, 128)
            pre, dec512 = dynmoe_round(a.dynmoe, converted, bits, dense, head, 512, 128)
            o["prefill"].append(pre)
            o["decode_at_0"].append(dec0)
            o["decode_at_512"].append(dec512)
        print(f"round {r + 1} of {a.rounds} done", file=sys.stderr)

    def medians(samples):
        return {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in samples.items()}

    report = {
        "checkpoint": str(ckpt),
        "params": summary["models"]["f32"]["n_params"],
        "cpu": summary.get("cpu_info"),
        "threads": summary.get("n_threads"),
        "rounds": a.rounds,
        "llama_cpp_version": summary.get("version"),
        "llama_cpp_build_flags": summary.get("build_flags"),
        "llama_cpp": {t: {"median": medians(v), "samples": v} for t, v in llama.items()},
        "dynmoe": {label: {"median": medians(v), "samples": v} for label, v in ours.items()},
    }
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'engine / setting':44} {'prefill 512':>12} {'decode @0':>10} {'decode @512':>12}")
    for name, rows in [("llama.cpp", report["llama_cpp"]), ("dynmoe", report["dynmoe"])]:
        for label, v in rows.items():
            m = v["median"]
            print(f"{name + ' ' + label:44} {m['prefill']:12.0f} {m['decode_at_0']:10.0f} "
                  f"{m['decode_at_512']:12.0f}")
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
