#!/usr/bin/env python3
"""Load benchmark of `dynmoe serve` on loopback: at each concurrency level C, C
clients at once each send streamed `/v1/completions` requests one after another. Per
level: generated tokens per second (all completion tokens over the wall time from the
first request sent to the last stream ended), time to first token and inter-token
latency (p50, p99 of the gaps between a stream's text chunks), errors, and the
server's resident memory (and GPU memory where nvidia-smi lists it) before and after.

The server is started here (`<binary> serve --model <dir> --port 0 <extra args>`) and
stopped at the end. Its tokenizer is used through it: the usage of sizing requests
sets the prompts' word count, and each level's tokens are `/metrics`'
`dynmoe_generated_tokens_total` (streamed text chunks where /metrics is missing).
`ignore_eos` is sent only if the server takes it (probed; dynmoe does not), so a
reply may end at EOS before max_tokens: the `eos` column counts those.

    cargo build --release -p dynmoe-cli
    python3 bench/serve_load.py --model fixtures/models/small-moe --clients 1,4
    python3 bench/serve_load.py --binary target/release/dynmoe --model DIR \\
        --label half-resident -- --backend cuda --max-seqs 64 --resident-fraction 0.5

Prints a markdown table and writes bench/results/serve_load.json. Exits 1 if any
request failed. Standard library only.
"""

import argparse
import datetime
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCE = "The old sailor mends his nets by the harbour and tells of the storms he saw."


def cpu_name():
    """The processor's model name, where /proc says it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def start(cmd):
    """Starts the server; returns it, its address and a list collecting its stderr."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines, m = [], None
    try:
        for line in proc.stderr:
            lines.append(line)
            if m := re.search(r"serving .* on http://(\S+):(\d+)", line):
                break
    finally:
        if not m:
            stop(proc)
    if not m:
        sys.exit("the server did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, m.group(1).strip("[]"), int(m.group(2)), lines


def stop(proc):
    """SIGTERM, then SIGKILL after 10 s; returns the exit status."""
    try:
        proc.terminate()
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = [int(l.split()[1]) for l in f if l.startswith("VmRSS:")]
        return round(kib[0] / 1024, 1) if kib else None
    except OSError:
        return None


def gpu_mib(pid):
    """The server's GPU memory from nvidia-smi, or None where it does not answer or
    does not list the server (a CPU backend, or a PID namespace that hides it)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [int(m) for p, m in (l.split(",")[:2] for l in out.splitlines() if "," in l)
            if p.strip() == str(pid) and m.strip().isdigit()]
    return sum(used) if used else None


def request(host, port, method, path, body=None, timeout=60):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def metrics(host, port):
    """The server's Prometheus counters as a dict ({} without /metrics)."""
    try:
        st, data = request(host, port, "GET", "/metrics")
    except OSError:
        return {}
    pairs = [l.split() for l in data.decode().splitlines() if not l.startswith("#")]
    return {p[0]: float(p[1]) for p in pairs
            if st == 200 and len(p) == 2 and re.fullmatch(r"[-+.\deE]+|NaN", p[1])}


def stream(host, port, body, timeout):
    """One streamed completion: status, send time, text-chunk times, tokens, error."""
    res = {"status": 0, "sent": time.monotonic(), "times": [], "usage": None,
           "finish": None, "error": None}
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        res["status"] = r.status
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
            return res
        done = False
        while not done and (line := r.readline()):
            if not line.startswith(b"data:"):
                continue
            now, payload = time.monotonic(), line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            obj = json.loads(payload)
            if "error" in obj:
                res["error"] = "error object: " + json.dumps(obj["error"])[:200]
                return res
            if obj.get("usage"):
                res["usage"] = obj["usage"].get("completion_tokens")
            for ch in obj.get("choices") or []:
                text = ch.get("text") or (ch.get("delta") or {}).get("content")
                if text:
                    res["times"].append(now)
                if ch.get("finish_reason"):
                    res["finish"] = ch["finish_reason"]
        if not done:
            res["error"] = "the stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - a broken stream is a finding
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
        res["end"] = time.monotonic()
    return res


def pct(xs, q):
    """The q-quantile of xs by linear interpolation, or None."""
    if not xs:
        return None
    xs, i = sorted(xs), q * (len(xs) - 1)
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (i - lo), 3)


def prompts(path, n_words):
    """A function k -> a prompt of n_words words of text lines, a different place for
    each k."""
    lines = []
    if path and os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [l.split() for l in f if l.strip()]
    lines = lines or [SENTENCE.split()]

    def make(k):
        i, words, out = (k * 7919) % len(lines), 0, []
        while words < n_words:
            take = lines[i % len(lines)][:n_words - words]
            out.append(" ".join(take))
            words += len(take)
            i += 1
        return "\n".join(out)
    return make


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [options] [-- extra server arguments]")
    ap.add_argument("--binary", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "dynmoe"))
    ap.add_argument("--model", default="fixtures/models/small-moe")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--completion-tokens", type=int, default=128)
    ap.add_argument("--text", default=os.path.join(ROOT, "data/corpus/en/test.txt"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench/results/serve_load.json"))
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.clients.split(",") if c.strip()]
    binary, model = os.path.abspath(a.binary), os.path.abspath(a.model)
    cmd = [binary, "serve", "--model", model, "--port", "0"] + extra

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, host, port, stderr = start(cmd)
    rows, failed = [], []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if request(host, port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit("/health did not answer 200 within 60 s")
            time.sleep(0.2)

        # ignore_eos only where the server takes it; it names the field it refuses.
        st, data = request(host, port, "POST", "/v1/completions",
                           {"prompt": "Hello", "max_tokens": 1, "ignore_eos": True})
        ignore_eos = st == 200
        # Size the prompts with the server's tokenizer: words per token of the text,
        # from the usage of a few prompts taken where the levels' prompts are.
        probe_words, probe_tokens = max(8, a.prompt_tokens), 0
        make = prompts(a.text, probe_words)
        for k in range(4):
            st, data = request(host, port, "POST", "/v1/completions",
                               {"prompt": make(k), "max_tokens": 1}, timeout=a.timeout)
            if st != 200:
                sys.exit(f"the sizing request was answered {st}: {data[:300]!r}")
            probe_tokens += json.loads(data)["usage"]["prompt_tokens"]
        n_words = max(1, round(a.prompt_tokens * 4 * probe_words / probe_tokens))
        make = prompts(a.text, n_words)

        def body(k, seed):
            b = {"prompt": make(k), "max_tokens": a.completion_tokens, "stream": True,
                 "temperature": 0.8, "top_p": 0.95, "seed": seed}
            return dict(b, ignore_eos=True) if ignore_eos else b

        warm = stream(host, port, body(10_000_019, a.seed), a.timeout)
        if warm["error"]:
            sys.exit("the warm-up request failed: " + warm["error"])

        label = f" ({a.label})" if a.label else ""
        print(f"dynmoe serve load{label}: {shlex.join(cmd)}")
        print(f"prompts of ~{a.prompt_tokens} tokens ({n_words} words), max_tokens "
              f"{a.completion_tokens}, {a.requests_per_client} request(s) per client, "
              f"ignore_eos {'sent' if ignore_eos else 'not accepted'}\n", flush=True)
        for li, clients in enumerate(levels):
            results = [[] for _ in range(clients)]
            gate = threading.Barrier(clients)

            def client(ci):
                gate.wait()
                for ri in range(a.requests_per_client):
                    k = (li * 1000 + ci) * a.requests_per_client + ri
                    seed = a.seed + li * 1_000_000 + ci * 1000 + ri
                    results[ci].append(stream(host, port, body(k, seed), a.timeout))

            before = metrics(host, port)
            rss0, gpu0 = rss_mib(proc.pid), gpu_mib(proc.pid)
            threads = [threading.Thread(target=client, args=(i,), daemon=True)
                       for i in range(clients)]
            [t.start() for t in threads]
            while any(t.is_alive() for t in threads):
                time.sleep(0.05)
            after = metrics(host, port)
            rss1, gpu1 = rss_mib(proc.pid), gpu_mib(proc.pid)
            res = [r for rs in results for r in rs]
            ok = [r for r in res if not r["error"]]
            errs = [r["error"] for r in res if r["error"]]
            failed += errs
            wall = max(r["end"] for r in res) - min(r["sent"] for r in res)
            chunks = sum(len(r["times"]) for r in ok)
            streamed = sum(r["usage"] if r["usage"] is not None else len(r["times"])
                           for r in ok)
            def delta(key):
                return after[key] - before[key] if key in after and key in before else None
            server = delta("dynmoe_generated_tokens_total")
            server = None if server is None else int(server)
            prompt_mean = delta("dynmoe_prompt_tokens_total")
            tokens = server if server is not None else streamed
            ttft = [(r["times"][0] - r["sent"]) * 1000 for r in ok if r["times"]]
            itl = [(y - x) * 1000 for r in ok for x, y in zip(r["times"], r["times"][1:])]
            rows.append({
                "clients": clients, "requests": len(res), "errors": len(errs),
                "error_samples": errs[:5], "wall_s": round(wall, 3), "tokens": tokens,
                "tokens_server": server, "tokens_streamed": streamed, "text_chunks": chunks,
                "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
                "tokens_per_request": round(tokens / max(1, len(ok)), 1),
                "ended_early": sum(1 for r in ok if r["finish"] == "stop"),
                "prompt_tokens_mean": (round(prompt_mean / max(1, len(ok)), 1)
                                       if prompt_mean is not None else None),
                "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
                "itl_ms": {"p50": pct(itl, 0.5), "p99": pct(itl, 0.99)}, "itl_n": len(itl),
                "rss_mib": {"before": rss0, "after": rss1},
                "gpu_mib": {"before": gpu0, "after": gpu1},
            })
            print(f"{clients} client(s): {len(res)} requests, {len(errs)} errors, "
                  f"{tokens} tokens in {wall:.2f} s", file=sys.stderr, flush=True)
            if proc.poll() is not None:
                failed.append(f"the server exited ({proc.returncode})")
                break
    except KeyboardInterrupt:
        sys.exit("interrupted; the server is stopped")
    finally:
        code = stop(proc)

    def ms(v):
        return "-" if v is None else f"{v:.1f}"
    print(f"| clients | requests | errors | tokens | tok/s | tok/req | eos | "
          f"TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | RSS MiB | GPU MiB |")
    print("|" + "---:|" * 13)
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['tokens']} | "
              f"{r['tokens_per_s']} | {r['tokens_per_request']} | {r['ended_early']} | "
              f"{ms(r['ttft_ms']['p50'])} | {ms(r['ttft_ms']['p99'])} | "
              f"{ms(r['itl_ms']['p50'])} | {ms(r['itl_ms']['p99'])} | "
              + " | ".join(" → ".join(str(r[m][k]) if r[m][k] is not None else "-"
                                       for k in ("before", "after"))
                           for m in ("rss_mib", "gpu_mib")) + " |")
    result = {
        "label": a.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu": cpu_name(),
        "args": shlex.join(sys.argv[1:]),
        "server_command": shlex.join(cmd), "server_argv": cmd, "model": model,
        "settings": {
            "clients": levels, "requests_per_client": a.requests_per_client,
            "prompt_tokens": a.prompt_tokens, "prompt_words": n_words,
            "completion_tokens": a.completion_tokens, "temperature": 0.8, "top_p": 0.95,
            "seed": a.seed, "ignore_eos": ignore_eos,
            "text": a.text if os.path.exists(a.text) else None,
        },
        "rows": rows, "errors": len(failed), "server_exit": code,
        "server_panicked": "panicked" in "".join(stderr),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    if failed:
        print(f"\n{len(failed)} request(s) failed, e.g. {failed[0]}", file=sys.stderr)
    sys.exit(1 if failed or result["server_panicked"] else 0)


if __name__ == "__main__":
    main()
