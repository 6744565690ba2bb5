#!/usr/bin/env python3
"""Writes docs/RESULTS.md from the JSON in bench/results/.

Every table in docs/RESULTS.md is made here from one or more bench/results/*.json files,
and says which files and which command wrote them; the text between the tables is held
in this script. Every JSON file in bench/results/ must be read by some table: a new one
without a table here is an error.

    python3 bench/results_md.py           # write docs/RESULTS.md
    python3 bench/results_md.py --check   # exit 1 if docs/RESULTS.md is not what this writes

Python 3 standard library only.
"""

import argparse
import difflib
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench/results"
OUT = ROOT / "docs/RESULTS.md"
DOMAINS = ["en", "code", "zh", "math", "json"]
TEXTS = DOMAINS + ["wikitext2"]
TEXT_NAME = {"wikitext2": "WikiText-2"}

read = set()


def load(name):
    read.add(name)
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


# -- formatting ---------------------------------------------------------------------

def num(x, d=0):
    """x with d decimals and a space between thousands; '–' for a missing value."""
    if x is None:
        return "–"
    return f"{x:,.{d}f}".replace(",", " ")


def pct(x, d=1):
    return "–" if x is None else f"{100 * x:.{d}f}%"


def pm(r, d=3):
    return f"{r['ppl']:.{d}f} ± {r['ppl_stderr']:.{d}f}"


def table(header, rows, left=1):
    """A Markdown table; the first `left` columns are left-aligned, the rest right."""
    out = ["| " + " | ".join(header) + " |",
           "| " + " | ".join("---" if i < left else "---:" for i in range(len(header))) + " |"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def source(files, command):
    names = ", ".join(f"`bench/results/{f}`" for f in files)
    return [f"*Made from* {names}, *written by* {command}."]


def para(text):
    """Text held here, its whitespace folded, wrapped at 92 columns."""
    return textwrap.wrap(" ".join(text.split()), 92, break_long_words=False,
                         break_on_hyphens=False)


def section(title, *blocks):
    out = ["", f"### {title}"]
    for b in blocks:
        out += [""] + b
    return out


def sub(title, *blocks):
    out = ["", f"#### {title}"]
    for b in blocks:
        out += [""] + b
    return out


def by(results, *keys):
    return {tuple(r.get(k) for k in keys): r for r in results}


def in_order(results, key):
    seen = []
    for r in results:
        if r[key] not in seen:
            seen.append(r[key])
    return seen


# -- perplexity on the fixtures -----------------------------------------------------

def ppl_fixtures():
    d = load("ppl_fixtures.json")
    r = by(d["results"], "model", "text")
    rows = []
    for t in TEXTS:
        tiny, small = r[("tiny-moe", t)], r[("small-moe", t)]
        rows.append([TEXT_NAME.get(t, t), pm(tiny), num(tiny["transformers_ppl"], 3), pm(small),
                     num(small["transformers_ppl"], 3), f"{small['chunks']} × {small['ctx']}",
                     num(small["tokens_scored"])])
    return section(
        "Perplexity of the fixtures",
        para("""`dynmoe eval ppl` at ctx 512 over whole test splits (the definition is in
             [USAGE.md](USAGE.md#perplexity)), beside the perplexity transformers computed for
             the same checkpoint when it was trained (`–` where it has none). The vocabulary has
             8192 tokens. WikiText-2 is out of domain for these fixtures (their English is
             speeches, Moby-Dick and Shakespeare); the JSON domain is MDN's highly regular
             compatibility data, hence a perplexity near 1."""),
        table(["text", "tiny-moe", "transformers", "small-moe", "transformers", "chunks",
               "tokens scored"], rows),
        source(["ppl_fixtures.json"], "`python3 bench/ppl_fixtures.py`"))


def ppl_bits():
    d = load("ppl_bits.json")
    r = by(d["results"], "precision", "text")
    precisions = in_order(d["results"], "precision")
    rows = [[TEXT_NAME.get(t, t)] + [pm(r[(p, t)]) for p in precisions] for t in TEXTS]
    header = ["text"] + [p if p == "bf16" else f"{p}-bit store" for p in precisions]
    return section(
        "small-moe from its expert stores",
        para("""small-moe with its routed experts read from the affine stores of a converted
             copy (`dynmoe convert`, then `--expert-bits`; the rest of the model in bf16), whole
             test splits at ctx 512."""),
        table(header, rows),
        source(["ppl_bits.json"], "`python3 bench/ppl_fixtures.py --models small-moe --bits "
               "bf16,4,3,2 --out bench/results/ppl_bits.json`"))


def codec_rows(d, bit_keys):
    r = by(d["results"], "precision", "text")
    rows = []
    for p in in_order(d["results"], "precision"):
        first = r[(p, "en")]
        rows.append([f"`{p}`"] + [num(first[k], 2) for k in bit_keys]
                    + [num(r[(p, t)]["ppl"], 3) for t in TEXTS])
    return rows


def ppl_codecs():
    texts = [TEXT_NAME.get(t, t) for t in TEXTS]
    a = load("ppl_codecs.json")
    b = load("ppl_affine_dense.json")
    return section(
        "Codecs, dense layers and the LM head on small-moe",
        para("""small-moe with its routed experts at one VQ rung or affine width, and with
             its attention projections and LM head coded too, on the first 8 chunks of each
             test split. The first column is `bench/ppl_fixtures.py`'s `--bits` value: `bf16`;
             `4`, `3`, `2` the affine expert stores (q4, q3, q2); `vqB` a VQ rung; `+dense` the
             attention projections at the experts' rung; `+dense=q4` and `+head=q4` MLX's
             affine q4 quantized at load (`4+dense+head`: all three at q4, a "4-bit model" as
             MLX and llama.cpp have it). Bits are per routed expert weight, per attention
             weight and per LM head weight, with norms, scales and the padding of the 80-wide
             down projections."""),
        table(["codec", "expert bits", "dense bits"] + texts,
              codec_rows(a, ["expert_bits_per_weight", "dense_bits_per_weight"])),
        source(["ppl_codecs.json"], "`python3 bench/ppl_fixtures.py --models small-moe --chunks 8 "
               "--bits bf16,vq1,vq1.5,vq2,vq3,vq4,2,3,4,vq2+dense,vq3+dense,vq4+dense "
               "--out bench/results/ppl_codecs.json`"),
        table(["codec", "expert bits", "dense bits", "head bits"] + texts,
              codec_rows(b, ["expert_bits_per_weight", "dense_bits_per_weight",
                             "head_bits_per_weight"])),
        source(["ppl_affine_dense.json"], "`python3 bench/ppl_fixtures.py --models small-moe "
               "--chunks 8 --bits bf16,bf16+dense=q4,bf16+head=q4,bf16+dense=q4+head=q4,4,"
               "4+dense+head --out bench/results/ppl_affine_dense.json`"))


# -- allocation ---------------------------------------------------------------------

def quality():
    d = load("quality.json")
    rows = []
    for r in d["rows"]:
        rows.append([r["method"], num(r["expert_bits"], 3)]
                    + [num(r["ppl"][t], 3) for t in DOMAINS]
                    + [num(r["geomean_ppl"], 3), num(r["mean_kld"], 3),
                       num(r["ppl"]["wikitext2"], 1), num(r["kld"]["wikitext2"], 3),
                       pct(r["hit_rate"])])
    return section(
        "ISP plans against the baselines",
        para(f"""`dynmoe bench quality` on {d['model']} (one run on 16 CPU cores). Bits are
             resident bytes of the {d['scope']} over their parameters, here with the codebooks
             included once per rung, as they were counted when this run was made (they are
             now constants of the program, outside every budget, so a run today reports fewer
             bits for the VQ rows; and plans now price a VQ expert at its store record, whole
             16 KiB pages, and a partial layer's spare slots, so a run today makes other
             plans: see the whole-model section below); the probes ran on {d['calib_chunks_per_text']} calibration chunks per
             domain; perplexity and KL divergence to bf16 on the first
             {d['eval_chunks_per_text']} chunks of each domain's test split and of WikiText-2.
             Geomean and KLD summarise the five domains. WikiText-2 has its own columns: the
             fixtures never saw text like it and compression often *lowers* its perplexity, so
             there perplexity measures noise while its KL divergence still tracks fidelity. ISP
             rows run with dynamic residency (each layer starts from the experts the plan keeps,
             as many slots as it keeps, and follows the text); the static REAP rows are the
             two-round plans with their sets fixed; the heuristic spends its bits on the down
             projections. Each row's per-layer plan (codecs and resident count) and top-1
             agreement per text are in the JSON, left out here for width."""),
        table(["method", "bits"] + DOMAINS + ["geomean", "KLD", "WikiText-2", "WikiText-2 KLD",
                                              "hit rate"], rows),
        ["![Perplexity against resident bits](../bench/results/quality.svg)"],
        source(["quality.json"], "`dynmoe bench quality`, which also writes the plot "
               "(`bench/results/quality.svg`) and the table as text (`bench/results/quality.txt`)"))


def quality_model():
    d = load("quality_model.json")
    bf16 = next(r for r in d["rows"] if r["method"] == "bf16")
    rows = []
    for r in d["rows"]:
        ratio = max(r["ppl"][t] / bf16["ppl"][t] for t in DOMAINS)
        g = r.get("groups", {})
        dense = sorted({c for k, c in g.items() if k.startswith("layers.") or k == "dense"})
        rows.append([r["method"], num(r["model_bits"], 3)]
                    + [num(r["ppl"][t], 3) for t in DOMAINS]
                    + [num(r["geomean_ppl"], 3), f"{ratio:.2f}×", num(r["mean_kld"], 3),
                       g.get("embedding", "bf16"), g.get("lm_head", "bf16"),
                       "/".join(dense) or "bf16", pct(r["hit_rate"])])
    return section(
        "Whole-model budgets: every tensor allocated",
        para(f"""`dynmoe bench quality --scope model` on {d['model']} (one run on this
             project's 2-core CPU machine). Bits are resident bytes of every tensor over
             every parameter (embeddings, LM head, attention, routers, norms and routed
             experts; a VQ expert at its store record, whole 16 KiB pages; codebooks aside,
             as constants of the program). ISP rows allocate the embeddings, the untied LM
             head and each layer's attention a codec (affine q4/q3/q2 or a VQ rung) beside
             each MoE layer's expert codec and resident share, two rounds on
             {d['calib_chunks_per_text']} calibration chunks per domain, and run with
             dynamic residency from the plan's sets. The uniform rows code every tensor (the
             routers and norms aside) the same way: q4 everywhere, experts q2 with the rest
             q4, or one VQ rung everywhere. Perplexity and KL divergence to bf16 on the
             first {d['eval_chunks_per_text']} chunks of each domain's test split; "worst" is
             the largest ratio to bf16's perplexity over the five domains; hit rate counts
             the layers that keep only some experts. The shadow rows plan the same budgets
             with every such layer also holding every expert at the named rung (priced in
             the budget; the probes and the runs route unconfined through them). Per-layer
             codecs are in the JSON."""),
        table(["method", "bits"] + DOMAINS + ["geomean", "worst", "KLD", "embedding",
                                              "LM head", "attention", "hit rate"], rows),
        [f"Left out: {why}" for why in d.get("left_out", [])],
        ["![Perplexity against whole-model bits](../bench/results/quality_model.svg)"],
        source(["quality_model.json"], "`dynmoe bench quality --scope model --budgets "
               "1.5,2,2.5,3,4 --uniform vq1,vq1.5,vq2,vq2.5,vq3,vq4 --shadow vq1,vq0.7 --out "
               "bench/results/quality_model.json --svg bench/results/quality_model.svg "
               "--work target/bench-quality-model`"))


def isp_rounds():
    d = load("isp_rounds.json")
    rows = []
    for r in d["rows"]:
        rows.append([r["calib_chunks"], num(r["budget_bits"], 2), r["rounds"],
                     num(r["resident_bytes"]), num(r["calib_nll_static"], 4),
                     num(r["calib_nll_dynamic"], 4), num(r["test_nll"], 4),
                     num(r["test_geomean_ppl"], 3)] + [num(r["test_ppl"][t], 3) for t in DOMAINS])
    return section(
        "ISP: one round or two",
        para("""Whether ISP's second round pays on small-moe: each budget planned with two
             rounds, and with one round from the same first round's probes, on 2 and on 6
             calibration chunks per domain. Calibration NLL is what the rounds optimise, with
             the resident sets held (as the probes ran) and following the text (as the model
             runs); the test columns are the five test splits' first 8 chunks, run as
             `dynamic` residency runs a plan. Each plan's per-layer codecs are in the JSON."""),
        table(["calib chunks", "budget", "rounds", "resident bytes", "calib NLL, held",
               "calib NLL, following", "test NLL", "geomean"] + DOMAINS, rows, left=0),
        source(["isp_rounds.json"], "`python3 bench/isp_rounds.py`"))


# -- residency on small-moe ---------------------------------------------------------

def hitrate_grid(g):
    cells = {(c["calib"], c["test"]): c for c in g["cells"]}
    domains = in_order(g["cells"], "calib")
    hit = [[c] + [f"{100 * cells[(c, t)]['static']['hit_rate']:.1f} / "
                  f"{100 * cells[(c, t)]['dynamic']['hit_rate']:.1f}" for t in domains]
           for c in domains]
    def ceiling(t):
        runs = [cells[(c, t)][m]["oracle_hit_rate"] for c in domains
                for m in ("static", "dynamic")]
        return f"{100 * min(runs):.1f}–{100 * max(runs):.1f}"
    hit.append(["ceiling"] + [ceiling(t) for t in domains])
    ppl = [[c] + [f"{cells[(c, t)]['static']['ppl']:.2f} / {cells[(c, t)]['dynamic']['ppl']:.2f}"
                  for t in domains] for c in domains]
    ppl.append(["every expert"] + [f"{g['full_ppl'][t]:.2f}" for t in domains])
    dyn = [c["dynamic"] for c in g["cells"]]
    total = {k: sum(x[k] for x in dyn) for k in ("swaps", "bytes_moved", "stalls",
                                                 "late_boundaries", "tokens")}
    head = ["calibrated on ↓ / evaluated on →"] + domains
    return (table(["hit rate, static / dynamic, %"] + domains, hit),
            table(head, ppl),
            para(f"""Dynamic runs together: {total['swaps']} swaps, {num(total['bytes_moved'])}
                 bytes moved, {total['stalls']} stalls, {total['late_boundaries']} late
                 boundaries, over {num(total['tokens'])} routed tokens. Hit rates per layer
                 are in the JSON."""))


def residency_small():
    a = load("hitrate.json")
    b = load("hitrate_2bit.json")
    v = load("hitrate_vq.json")
    disk = load("residency_decode_disk.json")
    hit_cmd = ("`dynmoe eval hitrate --model fixtures/models/small-moe --resident-fraction 0.5 "
               "--domains data/corpus/{en,code,zh,math,json}/test.txt --calib-texts "
               "data/corpus/{en,code,zh,math,json}/calib.txt --chunks 16 --calib-chunks 16 "
               "--out bench/results/hitrate.json` (the brace lists spelled out, comma-separated)")
    out = section(
        "Resident sets on small-moe",
        para(f"""Half of each MoE layer's experts resident ({a['resident_per_layer']} of
             {a['experts_per_layer']}, +{a['spare_slots_per_layer']} spare slots): a static REAP
             set calibrated on {a['calib_chunks']} chunks of each domain's `calib.txt`, against
             a dynamic set at the default policy (swap interval {a['policy']['interval']},
             {a['policy']['max_swaps']} swaps at most, margin {a['policy']['margin']}, half-lives
             {' and '.join(f'{h:g}' for h in a['policy']['half_lives'])} tokens) starting from
             the same calibration, evaluated on the first {a['chunks']} chunks of
             {a['ctx']} tokens of each `test.txt` (a fixed number of chunks to fit a 2-core
             machine); the dynamic runs prefill in calls of {a['micro_batch']} tokens so swaps
             land inside a chunk. Hit rate is the share of the unmasked routing probability on
             resident experts; the ceiling is each token's own {a['resident_per_layer']} best
             experts, which no set of {a['resident_per_layer']} can beat (its range over the
             column's runs: the routing a token sees depends on the sets before it). Perplexity is static / dynamic on the same chunks."""))
    for title, g, files, cmd in [
            ("bf16 experts, reservoir in RAM", a, ["hitrate.json"], hit_cmd),
            ("Experts from the 2-bit store, reservoir in RAM", b, ["hitrate_2bit.json"],
             "`dynmoe convert --model fixtures/models/small-moe -o DIR`, then the same "
             "`dynmoe eval hitrate` with `--model DIR --expert-bits 2 --out "
             "bench/results/hitrate_2bit.json`"),
            ("Every MoE layer at vq2, reservoir on disk", v["grid"], ["hitrate_vq.json"],
             f"`{v['grid_command']}`")]:
        hit, ppl, totals = hitrate_grid(g)
        out += sub(title, hit, ppl, totals, source(files, cmd))
    rows = []
    for label, g, f in [("default: interval 256, 4 swaps, half-lives 100/1000",
                         load("hitrate_policy_default.json"), "hitrate_policy_default.json"),
                        ("checkpoints every 64 tokens", load("hitrate_policy_interval64.json"),
                         "hitrate_policy_interval64.json"),
                        ("half-lives 25/250 tokens", load("hitrate_policy_fast.json"),
                         "hitrate_policy_fast.json")]:
        dyn = [c["dynamic"] for c in g["cells"]]
        hit = sum(d["hit_rate"] for d in dyn) / len(dyn)
        ceil = sum(d["oracle_hit_rate"] for d in dyn) / len(dyn)
        over = [c["dynamic"]["ppl"] / g["full_ppl"][c["test"]] - 1 for c in g["cells"]]
        rows.append([label, pct(hit), pct(ceil), pct(hit / ceil), f"{100 * min(over):+.1f}%",
                     f"{100 * max(over):+.1f}%", sum(d["swaps"] for d in dyn),
                     num(sum(d["bytes_moved"] for d in dyn))])
    out += sub(
        "The dynamic policy's settings",
        para("""Why the dynamic set trails the ceiling, first measurements: the same 5×5 grid
             (bf16 experts, half resident, reservoir in RAM) with the policy's checkpoints
             four times as often, and with averages that forget four times faster, beside the
             default policy run again with this build (the grid above is an earlier run). Hit rate
             and ceiling are means over the 25 cells' dynamic runs; "above full" is the range
             of the dynamic runs' perplexity over every expert resident."""),
        table(["policy", "hit rate", "ceiling", "of ceiling", "above full, best",
               "above full, worst", "swaps", "bytes moved"], rows),
        source(["hitrate_policy_default.json", "hitrate_policy_interval64.json",
                "hitrate_policy_fast.json"],
               hit_cmd.replace("hitrate.json", "hitrate_policy_default.json")
               + "; the same with `--swap-interval 64` into `hitrate_policy_interval64.json`"
               + "; and with `--half-lives 25,250` into `hitrate_policy_fast.json`"))
    sh = load("hitrate_shadows.json")
    hit, ppl, totals = hitrate_grid(sh)
    per_expert = 2 * 3 * 256 * 80
    out += sub(
        f"Shadows: {sh['resident_per_layer']} of {sh['experts_per_layer']} bf16 experts "
        f"resident and every expert at {sh['shadow']}",
        para(f"""The same grid with every expert of each layer also held at {sh['shadow']}
             ({num(sh['shadow_bytes'])} bytes over the six layers, about
             {sh['shadow_bytes'] / 6 / per_expert:.1f} bf16 experts a layer), and
             {sh['resident_per_layer']} resident instead of {a['resident_per_layer']}: a layer
             holds {num(sh['resident_per_layer'] * per_expert + sh['shadow_bytes'] / 6)} bytes
             of experts and shadows against the 50% set's
             {num(a['resident_per_layer'] * per_expert)} (experts priced at bf16; both run
             their slots as f32, and both hold the same spare slots). A token routed outside the set runs the expert's shadow
             instead of being confined to the residents. Hit rate counts the residents
             only, as above."""),
        hit, ppl, totals,
        source(["hitrate_shadows.json"], hit_cmd.replace("--resident-fraction 0.5",
               "--resident-count 13 --shadow vq1").replace("hitrate.json", "hitrate_shadows.json")))
    rows = []
    for label, r, cmd in ([(x["precision"], x, x["command"]) for x in disk["runs"]]
                          + [("vq2", v["decode"], v["decode_command"])]):
        s = r["residency"]
        rows.append([label, num(s["tokens"]), pct(s["hit_rate"]), pct(s["oracle_hit_rate"]),
                     s["swaps"], num(s["bytes_moved"]), s["stalls"], s["late_boundaries"],
                     num(s["read_bandwidth_mb_s"])])
    out += sub(
        "Decoding 1500 tokens from a disk reservoir",
        para(disk["description"]),
        table(["experts", "routed tokens", "hit rate", "ceiling", "swaps", "bytes moved",
               "stalls", "late boundaries", "read MB/s"], rows),
        para("""Tokens per second are left out: the runs shared two CPU cores with other
             builds. The vq2 row is the decode run of `hitrate_vq.json`."""),
        source(["residency_decode_disk.json", "hitrate_vq.json"],
               "the `command` of each run in `residency_decode_disk.json` "
               f"(`{disk['runs'][0]['command']}`; the 2-bit run on a converted copy with "
               "`--expert-bits 2`), and `decode_command` in `hitrate_vq.json`"))
    return out


# -- CPU speed and codecs -----------------------------------------------------------

def cpu_model_speed_30b():
    d = load("cpu_model_speed_30b.json")
    c = d["cases"][0]
    rows = [[f"q{c['bits']}", c["dense_codec"], c["head_codec"], num(c["prefill_tok_s"], 1),
             num(c["decode_tok_s"], 1), num(c["decode_bytes_per_token"] / 1e6, 1),
             num(d["copy_gb_s"], 1), num(c["decode_floor_tok_s"], 1),
             pct(c["decode_tok_s"] / c["decode_floor_tok_s"], 0)]]
    experts = next(r for r in c["timeline"]["ops"] if r["op"].startswith("experts"))
    # top-8 experts of 3 × 768 × 2048 weights each, a layer
    expert_gw = 8 * 3 * 768 * 2048 / experts["us_each"] / 1e3
    ops = [[r["op"], f"{r['calls_per_token']:.0f}", f"{r['us_each']:.0f}",
            f"{r['us_per_token'] / 1e3:.1f}"] for r in c["timeline"]["ops"][:6]]
    return section(
        "The 30B shape on the CPU",
        para(f"""The 12-layer Qwen3-30B-A3B shape (`dynmoe synth --like qwen3-30b-a3b --layers
             12 --bits 2`, random records) on {d['device']}, batch 1, a {d['prompt']}-token
             prompt and {d['generate']} tokens decoded, medians of {d['repeats']}: decode
             against the floor the host's read bandwidth sets for the bytes a token reads
             (`testing::host_read_gb_s`: every thread summing a 1 GiB buffer). The products
             here are bound by the vector ports, not by memory: the float kernels take about as
             long a weight whatever its bits (the routed experts, top-8 of 128 a layer, run at
             {expert_gw:.1f} G weights/s on two cores;
             [notes/cpu-decode-2026-12-04.md](notes/cpu-decode-2026-12-04.md)). llama.cpp's
             Q2_K of this shape was not measured on the CPU (its GGUF would be converted
             from a 29 GB F32 file)."""),
        table(["experts", "attention", "LM head", "prefill t/s", "decode t/s", "MB a token",
               "read GB/s", "floor t/s", "of the floor"], rows, left=3),
        para("Where a decode token's time goes (`--timeline`), its six costliest ops:"),
        table(["op", "a token", "µs each", "ms a token"], ops),
        source(["cpu_model_speed_30b.json"], "`dynmoe bench decode /tmp/q30c --bits 2 "
               "--dense-codec q4 --head-codec q4 --prompt 64 --generate 32 --repeats 3 "
               "--timeline --json ...`"))


def cpu_forward():
    d = load("cpu_forward.json")
    rows = [[r["backend"], r["experts"], num(r["prefill_tok_s_median"]),
             num(r["decode_tok_s_median"])] for r in d["rows"]]
    r0 = d["rows"][0]
    return section(
        "CPU forward speed",
        para(f"""small-moe ({num(d['params_active_per_token'] / 1e6, 2)} M parameters active per
             token) on {d['threads']} threads of an {d['cpu']} (this project's shared development
             machine), from the bf16 checkpoint and from a converted copy with its experts read
             from the 4-, 3- and 2-bit stores; medians of {len(r0['prefill_runs_s'])} runs of a
             {r0['prefill_tokens']}-token prefill and {r0['decode_tokens']} decode steps, in
             tokens per second. `cpu` is the threaded fast backend, `cpu-reference` the plain
             f32 oracle: the fast one is {d['prefill_speedup']:.2f}× the reference at prefill
             and {d['decode_speedup']:.2f}× at decode."""),
        table(["backend", "experts", "prefill", "decode"], rows, left=2),
        source(["cpu_forward.json"], "`cargo bench -p dynmoe --bench cpu_forward`"))


def cpu_vs_llama_cpp():
    d = load("cpu_vs_llama_cpp.json")
    rows = []
    for name, group in [("llama.cpp", d["llama_cpp"]), ("dynmoe", d["dynmoe"])]:
        for label, v in group.items():
            m = v["median"]
            label = {"f32": "F32", "q4_k_m": "Q4_K_M", "q2_k": "Q2_K"}.get(label, label)
            rows.append([name, label, num(m["prefill"]), num(m["decode_at_0"]),
                         num(m["decode_at_512"])])
    return section(
        "The CPU engine beside llama.cpp",
        para(f"""An OLMoE-shaped model of the project's own ({num(d['params'] / 1e6, 1)} M
             parameters, random weights: 6 layers, 32 experts of width 64, top-4, hidden 256,
             vocabulary 4 096; `bench/peers/olmoe_shape.py`) on {d['threads']} threads of an
             {d['cpu']}, llama.cpp ({d['llama_cpp_version']}, built from the llama-cpp-python
             sdist with `{d['llama_cpp_build_flags']}`, and dynmoe, in {d['rounds']} interleaved
             rounds, medians, tokens per second. Prefill is a 512-token prompt; decode is 128
             tokens from an empty context (llama-bench's tg128; dynmoe after a 1-token prompt)
             and after 512 tokens of context (llama-bench `-d 512`). llama.cpp's F32 keeps
             every weight in f32; its Q4_K_M and Q2_K quantize the 64-column expert
             down-projections to q5_0/q8_0 and q4_0 (64 is not a multiple of its 256-wide
             K-quant blocks); dynmoe's routers and norms stay bf16."""),
        table(["engine", "weights", "prefill 512", "decode, empty context",
               "decode at depth 512"], rows, left=2),
        source(["cpu_vs_llama_cpp.json"], "`python3 bench/peers/cpu_compare.py` (a release "
               "build; it builds llama.cpp's tools through `bench/peers/llama_cpp.sh`)"))


def cpu_timeline():
    before, after = load("cpu_timeline_before.json"), load("cpu_timeline_after.json")
    cases = [(c["bits"], b, c) for b, c in zip(before["cases"], after["cases"])]
    ops = []
    for _, b, a in cases:
        for r in b["timeline"]["ops"] + a["timeline"]["ops"]:
            if r["op"] not in ops:
                ops.append(r["op"])

    def us(case, op):
        r = next((r for r in case["timeline"]["ops"] if r["op"] == op), None)
        return "–" if r is None else f"{r['us_per_token']:.1f}"

    header = ["op"]
    for bits, _, _ in cases:
        header += [f"q{bits} before", f"q{bits} after"]
    rows = [[op] + [us(c, op) for _, b, a in cases for c in (b, a)] for op in ops]
    rows.append(["**a token**"] + [f"{c['timeline']['us_per_token']:.1f}"
                                   for _, b, a in cases for c in (b, a)])
    return section(
        "A CPU decode token, op by op",
        para(f"""Microseconds a decode token spends in each op of the CPU backend
             (`bench decode --timeline`), on the model of the table above converted with its
             attention and head at q4, after a {after['prompt']}-token prompt, experts at 4
             and 2 bits: before the changes of
             [notes/cpu-decode-2026-12-04.md](notes/cpu-decode-2026-12-04.md) (the caller handing every parallel op to
             the pool and sleeping, a row of a product set up at a time, attention in one
             lane, the pool's threads asleep between ops) and after. A product is named by
             its shape and codec; `linear3` is q, k and v side by side; `experts x4` a MoE
             layer's four routed experts; "between ops" is the host's routing, sampling and
             the timing itself. Ops that are not listed in a column did not run there."""),
        table(header, rows),
        source(["cpu_timeline_before.json", "cpu_timeline_after.json"],
               "`dynmoe bench decode /tmp/olmoe-13m-converted --bits 4,2 --dense-codec q4 "
               "--head-codec q4 --timeline --json ...`, from the commit before this round "
               "(with the timeline added) and after it"))


def codecs():
    d = load("codecs.json")
    rows = []
    for r in d["rungs"]:
        rows.append([r["name"], r["symmetry"], r["dim"], r["index_bits"],
                     num(r["bits_per_weight"], 3), f"{r['gaussian_mse']:.4g}",
                     f"{r['gaussian_mse_exact']:.4g}", f"{100 * r['search_mismatch']:.2f}%",
                     "–" if r["reference"] is None else f"{r['reference']:g}",
                     f"{r['bound']:.4g}", f"{r['real_mse']:.4g}",
                     num(r["real_bits_per_weight"], 3), num(r["encode_weights_per_s"] / 1e6, 2),
                     num(r["decode_weights_per_s"] / 1e6), num(r["matvec_weights_per_s"] / 1e9, 1)])
    fits = "; ".join(f"{name} a = {d[k]['a']:.3f}, c = {d[k]['c']:.3f}" for name, k in
                     [("Gaussian", "fit"), ("small-moe", "fit_real"), ("the paper's", "paper_fit")])
    shape = " × ".join(str(x) for x in d["gaussian_shape"])
    return section(
        "The VQ ladder",
        para(f"""Each rung of the VQ codec ladder: codebook symmetry, vector dimension and index
             bits, bits per weight (with block norms), relative mean squared error on unit
             Gaussian data ({shape}) with the shipped codeword search and with a full scan, the
             share of vectors whose codeword differs between the two, beside the bitsandbytes
             constants where they exist and the bound 2^(−2b); the error on small-moe's routed expert weights (÷ their
             variance; {num(d['real_matrices'])} matrices, {num(d['real_weights'])} weights) and
             the bits per weight there (codebook included), and encode (M weights/s), decode
             (M weights/s) and matrix-vector (G weights/s) speed on {d['threads']} threads.
             The codebooks' training is described in `docs/FORMAT.md` §11. Fit of
             φ(b) = 2^(a − c·b) to the errors: {fits}."""),
        table(["rung", "symmetry", "dim", "index bits", "bits/weight", "Gaussian",
               "full scan", "differ", "bitsandbytes", "bound", "small-moe", "bits/weight there",
               "encode", "decode", "matvec"], rows, left=2),
        source(["codecs.json"], "`dynmoe bench codecs`"))


def vq_kernels():
    d = load("vq_kernels.json")
    cases = []
    for r in d["rows"]:
        c = (r["rows"], r["cols"], r["batch"])
        if c not in cases:
            cases.append(c)
    cell = {(r["kernel"], r["rows"], r["cols"], r["batch"]): r for r in d["rows"]}
    kernels = in_order(d["rows"], "kernel")
    rows = []
    for k in kernels:
        bits = cell[(k,) + cases[0]]["bits_per_weight"]
        rows.append([k, num(bits, 2)] + [f"{cell[(k,) + c]['median_us']:.1f} "
                                         f"({cell[(k,) + c]['over_affine_q2']:.2f})"
                                         for c in cases])
    return section(
        "VQ kernels on the CPU",
        para(f"""Batch-1 to batch-8 products straight from the VQ codes (rungs 1 to 4) beside
             the affine q2 and q4 kernels, at Qwen3-30B-A3B expert shapes, {d['threads']}
             threads of an {d['cpu']} with weights streamed from memory (copies spanning
             {num(d['working_set_bytes'] / 2**20)} MiB); median µs a call, and in brackets the
             time over affine q2 on the same shape and batch. The `vq2-*` rows bound the 2-bit
             product: `vq2-cw0` has every lookup on one codeword, `vq2-512k` and `vq2-32k`
             confine the lookups to the first 512 KiB or 32 KiB of the 1 MiB book, and
             `vq2-hot` reads its codes from cache."""),
        table(["kernel", "bits/weight"] + [f"{r}×{c}, batch {b}" for r, c, b in cases], rows),
        source(["vq_kernels.json"], "`cargo bench -p dynmoe --bench vq_kernels` (on a "
               "machine without Rust, the staged binary through `scripts/gpu/run.sh cpu-vq`)"))


def expert_kernels():
    d = load("expert_kernels.json")
    kernels = in_order(d["rows"], "kernel")
    cases = []
    for r in d["rows"]:
        c = (r["threads"], r["rows"], r["cols"], r["batch"])
        if c not in cases:
            cases.append(c)
    cell = {(r["kernel"], r["threads"], r["rows"], r["cols"], r["batch"]): r for r in d["rows"]}
    rows = [[t, f"{rr}×{cc}", b] + [f"{cell[(k, t, rr, cc, b)]['median_us']:.1f} "
                                   f"({cell[(k, t, rr, cc, b)]['gb_s']:.1f})" for k in kernels]
            for t, rr, cc, b in cases]
    ratio = [[r["threads"], f"{r['rows']}×{r['cols']}", r["batch"], f"{r['q2_over_q4']:.2f}",
              f"{r['q3_over_q4']:.2f}", f"{r['naive_q2_over_q2']:.2f}"] for r in d["ratios"]]
    bw = ", ".join(f"{b['read_gb_s']:.1f} GB/s on {b['threads']} thread{'s' * (b['threads'] > 1)}"
                   for b in d["bandwidth"])
    return section(
        "Affine expert kernels on the CPU",
        para(f"""The affine kernels (q4 in MLX's nibbles, q3 and q2 in seed 000's layout,
             `naive-q2` decoding one code at a time, and the f32 product) on Qwen3-30B-A3B
             expert shapes, weights streamed from memory (copies spanning
             {num(d['working_set_bytes'] / 2**20)} MiB) on an {d['cpu']}; read bandwidth
             measured in the same run: {bw}. Median µs a call, and in brackets GB/s of weights
             read; then the ratios of the same run."""),
        table(["threads", "shape", "batch"] + kernels, rows, left=2),
        table(["threads", "shape", "batch", "q2 / q4", "q3 / q4", "naive q2 / q2"], ratio,
              left=2),
        source(["expert_kernels.json"], "`cargo bench -p dynmoe --bench expert_kernels`"))


def server_args(command):
    """A server command line's arguments, the checkout's own paths made relative."""
    return re.sub(r"[^ ]*/(fixtures/)", r"\1", command.split(" serve ", 1)[-1])


def serve_load():
    runs = [load(f) for f in ("serve_load.json", "serve_load_cuda.json",
                              "serve_load_cuda_half.json")]
    rows = []
    for d in runs:
        where = "GPU" if "cuda" in d["server_command"] else "CPU"
        for r in d["rows"]:
            # Latencies are timed on text chunks: where most tokens gave no text (a random
            # model's ids past its tokenizer's vocabulary), they say nothing.
            timed = r["text_chunks"] >= 0.9 * r["tokens"]
            lat = [f"{r[k]['p50']:.1f} / {r[k]['p99']:.1f}" if timed else "–"
                   for k in ("ttft_ms", "itl_ms")]
            rows.append([f"{where}, {d['label'] or 'small-moe'}", r["clients"], r["requests"],
                         r["errors"], num(r["tokens_per_s"], 1), *lat,
                         f"{r['rss_mib']['before']} → {r['rss_mib']['after']}",
                         "–" if r["gpu_mib"]["before"] is None
                         else f"{r['gpu_mib']['before']} → {r['gpu_mib']['after']}"])
    cpu, gpu = runs[0], runs[1]
    s = cpu["settings"]
    return section(
        "Serving under load",
        para(f"""`dynmoe serve` as a second process on loopback, loaded by
             `bench/serve_load.py`: at each level that many clients at once, each sending
             {s['requests_per_client']} ({gpu['settings']['requests_per_client']} on the GPU)
             streamed completions one after another (prompts of
             about {s['prompt_tokens']} tokens, up to {s['completion_tokens']} generated,
             temperature {s['temperature']}, top-p {s['top_p']}), after a warm-up request.
             Tokens per second are all the level's generated tokens (the server's counter)
             over its wall time; time to first token (TTFT) and the gaps between a stream's
             tokens (ITL) are p50 / p99 in ms; memory is the server's before and after the
             level. CPU: `{server_args(cpu['server_command'])}` on {cpu.get('cpu') or
             cpu['hostname']}. GPU: one NVIDIA H200,
             `{server_args(gpu['server_command']).replace(gpu['model'], 'DIR')}`
             on the 12-layer Qwen3-30B-A3B shape (random weights, experts q2, attention and
             head q4), then with half of each layer's experts resident
             (`--resident-fraction 0.5`). Its random weights pick ids past the borrowed
             tokenizer's 8 192 entries, which stream no text, so its latencies are not shown
             (the JSON has them). The GPU server reaches a fifth of what `bench decode`
             measures for 64 sequences decoded together (11 794 tok/s): at 64 clients each
             stream advanced a token every 27 ms (256 tokens in 6.9 s), where a step of 64
             rows takes about 5.4 ms. Each scheduler round also prefills one new prompt and
             picks its first token on the host; where the rest goes was not measured in
             this call."""),
        table(["run", "clients", "requests", "errors", "tok/s", "TTFT ms", "ITL ms",
               "server RSS MiB", "GPU MiB"], rows),
        source(["serve_load.json", "serve_load_cuda.json", "serve_load_cuda_half.json"],
               "`python3 bench/serve_load.py " + cpu.get("args", "") + "`; on the GPU "
               "`scripts/gpu/run.sh serve`"))


def reservoir_disk():
    d = load("reservoir_disk.json")
    took = "here it did" if d["file_system_direct"] else "here it did not"
    rows = [[p["name"], num(p["median_mb_s"]), " / ".join(num(x) for x in p["mb_s"]),
             f"{p['ms_per_record']:.3f}"] for p in d["passes"]]
    return section(
        "Streaming experts from a cold disk",
        para(f"""The disk reservoir's reads against plain `pread`s of the same records, on
             this machine's disk: {d['records']} Qwen3-30B-A3B-sized 2-bit expert records of
             {num(d['record_bytes'])} bytes in a shuffled order, one thread, the file evicted
             from the page cache (`posix_fadvise(DONTNEED)`) before each cold pass; medians of
             {d['rounds']} rounds taken in turn. The reservoir reads with `O_DIRECT` where the
             file system takes it ({took}), so a cached file does not flatter it; plain reads of a cached file are
             what an earlier measurement of "streaming from disk" saw."""),
        table(["pass", "MB/s", "rounds", "ms a record"], rows),
        source(["reservoir_disk.json"], "`cargo bench -p dynmoe --bench reservoir_disk`"))


# -- robustness ---------------------------------------------------------------------

def fuzz():
    d = load("fuzz.json")
    rows = [[f"`{t['target']}`", t["what"], num(t["seconds"]), num(t["executions"]),
             num(t["executions_per_second"]), num(t["new_corpus_inputs"]), t["result"]]
            for t in d["targets"]]
    return section(
        "Fuzzing the readers",
        para(f"""Each cargo-fuzz (libFuzzer, AddressSanitizer) target of `fuzz/` run for the
             time given, one after another, from the committed seed corpus, on
             {d['machine']} ({d['date']}); inputs it kept are not committed. `cargo test`
             replays the committed corpus through the same functions."""),
        table(["target", "what it reads", "seconds", "executions", "per second",
               "inputs kept", "result"], rows, left=2),
        para(d["note"]),
        source(["fuzz.json"], f"`{d['command']}`"))


# -- GPU ----------------------------------------------------------------------------

MODEL_SPEED = [
    ("cuda_model_speed.json", "`bash scripts/gpu/run.sh model`",
     "the eighteenth round's tree; one call with the next file, the same binary"),
    ("cuda_model_speed_dense_q4.json", "`DENSE=q4 bash scripts/gpu/run.sh model`",
     "the eighteenth round's tree, the same call"),
    ("cuda_model_speed_dense_q4_dense_single.json",
     "`DENSE=q4 bash scripts/gpu/run.sh model` with `DYNMOE_CUDA_DENSE_SINGLE=1`",
     "the fifteenth round: dense matrices held only in tiles (not kept)"),
    ("cuda_model_speed_dense_q4_expert_tiles.json", "`DENSE=q4 bash scripts/gpu/run.sh model`",
     "the thirteenth round, when the experts' tiles were a second copy beside the rows"),
    ("cuda_model_speed_vq.json", "`bash scripts/gpu/run.sh model-vq`",
     "an earlier round, before the early starts and the folded norms"),
    ("cuda_model_speed_vq_480b.json",
     "`LIKE=qwen3-coder-480b-a35b LAYERS=4 bash scripts/gpu/run.sh model-vq`",
     "the third round of 2026-12-01"),
    ("cuda_model_speed_48.json", "`LAYERS=48 bash scripts/gpu/run.sh model`",
     "the third round of 2026-12-01, before the routed kernels' later changes"),
    ("cuda_model_speed_48_dense_q4.json", "`LAYERS=48 DENSE=q4 bash scripts/gpu/run.sh model`",
     "the third round of 2026-12-01, before the routed kernels' later changes"),
]

RESIDENCY = [
    ("residency_30b.json", "`bash scripts/gpu/run.sh model residency`",
     "the eighteenth round's tree, slots in tiles"),
    ("residency_30b_1p5.json", "`bash scripts/gpu/run.sh model residency` (its second run)",
     "the eighteenth round's tree, slots in tiles"),
    ("residency_30b_slot_rows.json",
     "`bash scripts/gpu/run.sh residency` with `DYNMOE_CUDA_SLOT_TILES=0`",
     "the fifteenth round, slots in rows"),
    ("residency_30b_1p5_slot_rows.json",
     "`bash scripts/gpu/run.sh residency` with `DYNMOE_CUDA_SLOT_TILES=0` (its second run)",
     "the fifteenth round, slots in rows"),
    ("residency_30b_vq.json", "`bash scripts/gpu/run.sh model-vq residency-vq`",
     "an earlier round"),
    ("residency_235b.json", "`bash scripts/gpu/run.sh big big-run`",
     "before the block route, the tiles and the subnormal codes"),
]


def experts_of(c):
    return c.get("plan") or f"q{c['bits']}"


def model_speed():
    rows, made, device = [], [], None
    for i, (name, cmd, when) in enumerate(MODEL_SPEED, 1):
        d = load(name)
        device = device or d["device"]
        made.append([str(i), f"`{name}`", cmd, when])
        for c in d["cases"]:
            lp, ld = c["llama_cpp_prefill_tok_s"], c["llama_cpp_decode_tok_s"]
            decode = " / ".join(num(c.get(k)) for k in ("decode_tok_s", "decode_sync_tok_s",
                                                         "decode_eager_tok_s",
                                                         "decode_logits_tok_s"))
            rows.append([str(i), f"{Path(d['model']).name}", experts_of(c), c["dense_codec"],
                         d["layers"], num(c["expert_bits_per_weight"], 2),
                         num(c["prefill_tok_s"]), decode,
                         num(c["decode_bytes_per_token"] / 1e6), num(c["decode_floor_tok_s"]),
                         "yes" if c["decode_paths_agree"] else "no",
                         "–" if lp is None else f"{num(lp)} / {num(ld)}",
                         "–" if lp is None else f"{c['prefill_tok_s'] / lp:.2f}× / "
                                                f"{c['decode_tok_s'] / ld:.2f}×"])
    return section(
        "Whole-model speed on the GPU",
        para(f"""One {device}, batch 1: `dynmoe bench decode --backend cuda` on model
             directories `dynmoe synth` writes with published models' shapes and random
             weights (`qwen3-30b-a3b-l12`: the first 12 layers of Qwen3-30B-A3B; `q48`: all 48;
             `qwen3-coder-480b-a35b-l4`: the first 4 of Qwen3-Coder-480B-A35B), a 512-token
             prompt then 128 greedy decode steps, medians of 3 runs, tokens per second.
             Experts `qB` are the affine stores, `vq1.5` a compressed directory whose plan puts
             every MoE layer at that rung; "dense" is the codec of the attention projections
             and the LM head. Decode is queued (`Model::decode` of many tokens: each step is
             queued before the host has read the last token) / token by token
             (`Model::decode` of one token a call) / eager (without the CUDA graph) / logits (through
             `Model::forward`, the logits read back every token), `–` where the run did not
             measure it. MB a token is what one decode step reads; the floor is those bytes at
             the copy kernel's bandwidth; "agree" says every decode path chose the same
             tokens. llama.cpp is the same GPU's llama.cpp on the same shape (Q4_K_M beside 4
             bits, Q2_K beside 2), prefill / decode, and dynmoe's speed over it."""),
        table(["file", "model", "experts", "dense", "layers", "bits/weight", "prefill",
               "decode: queued / token by token / eager / logits", "MB a token", "floor",
               "agree", "llama.cpp", "× llama.cpp"], rows, left=4),
        table(["file", "name", "command", "measured"], made, left=4),
        source([m[0] for m in MODEL_SPEED], "the commands above (`scripts/gpu/run.sh` runs "
               "`dynmoe synth` and `dynmoe bench decode --backend cuda --prompt 512 --generate "
               "128 --json FILE`; `DENSE=q4` adds `--dense-codec q4 --head-codec q4`)"))


# llama.cpp's llama-batched-bench on the same H200 and shape (128-token prompts, 128 tokens
# generated a sequence, flash-attention kernels not built), aggregate generation tok/s: the
# anchor the batched-decode table is read against, measured in an earlier call.
LLAMA_BATCHED = {4: {1: 763, 4: 1547, 8: 1884, 16: 1955, 32: 2319, 64: 2608},
                 2: {1: 684, 4: 1373, 8: 1640, 16: 1868, 32: 2084, 64: 2327}}


def decode_sampled_batched():
    d = load("cuda_decode_batched.json")
    # The same bench on the builds before: the first batched step (attention a row at a
    # time, dense products by the matrix-vector kernel), then with the rows' attention in
    # one launch.
    first = {(c["bits"], b["batch"]): b["decode_tok_s"]
             for c in load("cuda_decode_sampled_batched.json")["cases"] for b in c["batches"]}
    attention = {(c["bits"], b["batch"]): b["decode_tok_s"]
                 for c in load("gpu/cuda_decode_batched_attention_rows.json")["cases"]
                 for b in c["batches"]}
    sampled, batched = [], []
    for c in d["cases"]:
        sampled.append([f"q{c['bits']}", num(c["decode_tok_s"]), num(c["decode_sampled_tok_s"]),
                        f"{c['decode_sampled_tok_s'] / c['decode_tok_s']:.2f}"])
        anchor = LLAMA_BATCHED[c["bits"]]
        for b in c["batches"]:
            key, ll = (c["bits"], b["batch"]), anchor.get(b["batch"])
            batched.append([f"q{c['bits']}", b["batch"], num(b["decode_tok_s"]),
                            " / ".join(num(x) for x in b["decode_runs_tok_s"]),
                            num(attention.get(key)), num(first.get(key)), num(ll),
                            "–" if ll is None else f"{b['decode_tok_s'] / ll:.2f}×"])
    return section(
        "Sampled and batched decode on the GPU",
        para(f"""One {d['device']}, `dynmoe bench decode --backend cuda` on the 12-layer
             Qwen3-30B-A3B shape (random weights, experts at the bits given, attention and LM
             head q4), medians of {d['repeats']} runs. Sampled is temperature 0.8 and top-p
             0.95 through the same decode entry point as greedy, the token picked on the
             device; before the device sampler, `dynmoe run --temperature 0.8` on this model
             decoded at 94 tok/s (4 bits) and 82 (2 bits), the logits read back and sorted on
             the host every token."""),
        table(["experts", "greedy tok/s", "sampled tok/s", "sampled / greedy"], sampled),
        para("""Batched: that many sequences decoded together (`--batch`), each a 128-token
             prompt then 128 greedy tokens, aggregate tokens per second, beside the same bench
             on two builds before (the first batched step, whose attention ran a sequence at
             a time; then with every sequence's attention in one launch, but dense products
             of several rows on the matrix-vector kernel) and llama.cpp's
             `llama-batched-bench` at the same batch (Q4_K_M beside 4 bits, Q2_K beside 2;
             measured in an earlier call on the same GPU, not in this one; `–` where a build
             was not measured at that batch). Every row is shown. One sequence decodes by the
             recorded step; several run op by op."""),
        table(["experts", "sequences", "tok/s", "runs", "rows attention build",
               "first batched build", "llama.cpp", "× llama.cpp"], batched),
        source(["cuda_decode_batched.json", "gpu/cuda_decode_batched_attention_rows.json",
                "cuda_decode_sampled_batched.json"],
               "`dynmoe bench decode DIR --backend cuda --bits 4,2 --dense-codec q4 "
               "--head-codec q4 --batch 1,4,8,16,32,64 --repeats 2 --json FILE` on the "
               "directory of `dynmoe synth --like qwen3-30b-a3b --layers 12 --bits 4,3,2` "
               "(`scripts/gpu/run.sh batch`)"))


def residency_gpu():
    rows, made = [], []
    for i, (name, cmd, when) in enumerate(RESIDENCY, 1):
        d = load(name)
        s = d["residency"]
        made.append([str(i), f"`{name}`", cmd, when])
        experts = d.get("plan") or f"q{d['bits']}"
        rows.append([str(i), Path(d["model"]).name, experts,
                     f"{s['resident_per_layer']} of {s['experts_per_layer']}",
                     s["reservoir"], d["layers"], f"{(d['dense_bytes'] + s['device_bytes']) / 1e9:.1f} GB",
                     num(d["full_tok_s"], 1), num(d["resident_tok_s"], 1), f"{d['ratio']:.3f}",
                     pct(s["hit_rate"]), pct(s["oracle_hit_rate"]), s["swaps"],
                     f"{s['bytes_moved'] / 1e9:.2f} GB", s["stalls"], s["late_boundaries"]])
    p, big = load(RESIDENCY[0][0]), load(RESIDENCY[-1][0])
    pol = p["residency"]["policy"]
    return section(
        "Resident sets in device memory",
        para(f"""`dynmoe bench residency` on the GPU: decode with a dynamic resident set per
             MoE layer in device memory, swapping from the reservoir, beside the same model
             with every expert resident; a {p['prompt']}-token prompt, then
             {p['generate']} decode steps token by token ({big['generate']} on the 235B
             shape), medians of {p['repeats']} runs ({big['repeats']} on the 235B shape). Policy: swap interval {pol['interval']},
             {pol['max_swaps']} swaps at most, margin {pol['margin']:g}. Device memory is the
             dense weights and the resident sets; the 235B shape's set sizes come from
             `--device-budget-gb 40`. The routed kernels read the residents through a table;
             swaps are copied on a stream of their own and commit at a token boundary, so no
             token waits for a load (a stall would count one that had to); a late boundary is one at which a load was still in
             flight and the outgoing expert served once more."""),
        table(["file", "model", "experts", "resident", "reservoir", "layers", "device memory",
               "every expert, tok/s", "with the sets, tok/s", "ratio", "hit rate", "ceiling",
               "swaps", "moved", "stalls", "late boundaries"], rows, left=6),
        table(["file", "name", "command", "measured"], made, left=4),
        source([m[0] for m in RESIDENCY], "the commands above (`scripts/gpu/run.sh residency` "
               "runs `dynmoe bench residency DIR --bits 2 --resident-fraction 0.5` (0.6 in its "
               "second run) `--reservoir ram --swap-interval 32 --max-swaps 4 --swap-margin 0 "
               "--loader-threads 4 --prompt 16 --generate 256`; `big-run` the 235B shape with "
               "`--device-budget-gb 40 --reservoir disk` from /dev/shm)"))


def cuda_kernels():
    d = load("cuda_kernels.json")
    rows = [[r["kernel"], r["rows"], r["cols"], r["batch"], num(r["weight_bytes"] / 1e6, 2),
             f"{r['median_us_per_call']:.2f}", num(r["gb_s"], 1),
             f"{100 * r['fraction_of_copy']:.1f}%"] for r in d["rows"]]
    return section(
        "Kernel times on the GPU",
        para(f"""Single kernels and MoE steps on one {d['device']} ({d['arch']}) at
             Qwen3-30B-A3B shapes, each rotating over enough copies of its weights to exceed
             the L2 several times: CUDA-event medians of 15 passes, µs a call, and the
             weights' read bandwidth against the copy kernel's
             {num(d['copy_gb_s'])} GB/s (read + write, {d['copy_bytes'] >> 30} GiB each way).
             Measured before the early starts of the eighth round of 2026-12-02; the VQ rows
             at two blocks an SM, when those kernels spilled. The notes in
             [notes/](notes/README.md) say what each kernel is."""),
        table(["kernel", "rows", "cols", "batch", "weight MB", "µs", "GB/s", "of copy"], rows),
        source(["cuda_kernels.json"], "`cargo bench -p dynmoe --features cuda --bench "
               "cuda_kernels` (on the GPU machine: `bash scripts/gpu/run.sh kernels`)"))


def serve_soak():
    d = load("serve_soak.json")
    kinds = sorted(d["by_kind"].items(), key=lambda kv: -kv[1])
    rows = [[f"`{k}`", num(n), num(d["failures_by_kind"].get(k, 0))] for k, n in kinds]
    h, r = d["health"], d["rss_kib"]
    summary = [[num(d["requests"]), num(d["seconds"], 1), d["responses_5xx"],
                "yes" if d["server_panicked"] else "no", num(h["probes"]), h["failed"],
                f"{h['p50_ms']:.2f} / {h['p99_ms']:.2f} / {h['max_ms']:.2f} ms",
                f"{num(r['warm'])} → {num(r['end'])} KiB ({r['growth_pct']:+.1f}%)",
                "pass" if d["pass"] else "FAIL"]]
    return section(
        "Soaking the server",
        para(f"""`dynmoe serve` on loopback, the tiny fixture, `--max-seqs {d['max_seqs']}`,
             header and body timeouts of {d['header_timeout_s']:g} s, {d['clients']} client
             threads sending a seeded mix of good requests, bad bodies, unknown paths, slow
             and idle connections, stalled bodies and clients that leave mid-stream, while
             a probe times `/health` every 50 ms on a fresh connection. A kind's requests
             are unexpected when answered otherwise than it should be (a good request with
             anything but 200 or 429, a bad one without a 4xx error object, a slow or idle
             connection left open past the timeout)."""),
        table(["kind", "requests", "unexpected"], rows),
        table(["requests", "seconds", "5xx", "panic", "/health probes", "failed",
               "/health p50 / p99 / max", "server RSS warm → end", "result"], summary,
              left=0),
        para("The server's RSS in MiB through the run, from its start: "
             + ", ".join(f"{k / 1024:.1f}" for k in r["samples"]) + "."),
        source(["serve_soak.json"], "`python3 bench/serve_soak.py --requests 20000` (a "
               "release build)"))


# -- the document -------------------------------------------------------------------

PARTS = [
    ("Quality on the bundled fixtures",
     [ppl_fixtures, ppl_bits, ppl_codecs, quality, quality_model, isp_rounds, residency_small]),
    ("Speed on the CPU, and the codecs", [cpu_vs_llama_cpp, cpu_timeline, cpu_model_speed_30b,
                                          cpu_forward, codecs, vq_kernels, expert_kernels,
                                          reservoir_disk,
                                         serve_load]),
    ("The GPU", [model_speed, decode_sampled_batched, residency_gpu, cuda_kernels]),
    ("Robustness", [fuzz, serve_soak]),
]


def anchor(title):
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return keep.replace(" ", "-")


def render():
    read.clear()
    body, contents = [], []
    for part, sections in PARTS:
        body += ["", f"## {part}"]
        links = []
        for make in sections:
            lines = make()
            title = lines[1].lstrip("#").strip()
            links.append(f"[{title}](#{anchor(title)})")
            body += lines
        contents.append(f"- {part}: " + " · ".join(links))
    missing = sorted(p.name for p in RESULTS.glob("*.json") if p.name not in read)
    if missing:
        sys.exit(f"bench/results_md.py: no table reads {', '.join(missing)}; add one")
    head = [
        "<!-- generated by bench/results_md.py; do not edit -->",
        "# Results",
        "",
        *para("""Generated by `bench/results_md.py` from the JSON in `bench/results/`; do not
              edit: change the JSON or the script and run `python3 bench/results_md.py`
              (`--check` says whether this file is current). Every table names the files it
              is made from and the command that wrote them. A JSON written on another machine
              was copied into `bench/results/` under the name given. CPU numbers come from
              this project's shared 2-core development machine unless a table names another;
              GPU numbers from one NVIDIA H200. What was predicted and measured round by
              round, and the logs in `bench/results/gpu/`, are in [the notes](notes/README.md);
              [notes/measured-2026-12-03.md](notes/measured-2026-12-03.md) keeps the
              discussion that went with these tables in the README until then."""),
        "",
        *contents,
    ]
    return "\n".join(head + body) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/RESULTS.md differs from what this script writes")
    args = ap.parse_args()
    text = render()
    if args.check:
        have = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if have != text:
            diff = difflib.unified_diff(have.splitlines(), text.splitlines(), "docs/RESULTS.md",
                                        "bench/results_md.py", lineterm="", n=1)
            print("\n".join(list(diff)[:40]))
            print("docs/RESULTS.md is out of date: run python3 bench/results_md.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
