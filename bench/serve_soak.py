#!/usr/bin/env python3
"""A soak of `dynmoe serve` on loopback: many requests mixing good ones, bad bodies,
slow and idle connections and clients that leave mid-stream, while a probe times
`/health` throughout and the server's memory is sampled.

Passes when no request is answered 5xx, the server never panics, /health always
answers within 100 ms and resident memory ends close to where it was once warm.
Prints a table and writes bench/results/serve_soak.json.

    cargo build --release -p dynmoe-cli
    python3 bench/serve_soak.py --requests 10000

Standard library only.
"""

import argparse
import http.client
import json
import os
import random
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTH_LIMIT_MS = 100.0

# What each kind of client does, and how often (weights).
MIX = {
    "completion": 30,
    "chat": 15,
    "stream": 10,
    "bad_json": 6,
    "bad_field": 6,
    "bad_value": 6,
    "too_long": 4,
    "unknown_path": 3,
    "disconnect_mid_stream": 10,
    "slow_header": 1,
    "idle": 1,
    "stalled_body": 1,
    "keepalive_pair": 2,
}


def start(binary, model, header_timeout, body_timeout, max_seqs):
    args = [
        binary, "serve", "--model", model, "--port", "0", "--name", "soak",
        "--max-seqs", str(max_seqs),
        "--header-timeout", str(header_timeout),
        "--body-timeout", str(body_timeout),
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"serving soak on http://([\d.]+):(\d+)", line)
        if m:
            break
    else:
        sys.exit("the server did not start:\n" + "".join(lines))
    rest = []
    threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True).start()
    return proc, m.group(1), int(m.group(2)), rest


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Soak:
    def __init__(self, host, port, header_timeout, body_timeout):
        self.host, self.port = host, port
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.lock = threading.Lock()
        self.statuses = Counter()
        self.by_kind = Counter()
        self.unexpected = []
        self.failures = Counter()

    def record(self, kind, status, ok):
        with self.lock:
            self.by_kind[kind] += 1
            self.statuses[status] += 1
            if not ok and len(self.unexpected) < 20:
                self.unexpected.append((kind, status))
            if not ok:
                self.failures[kind] += 1

    def conn(self, timeout=30):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def post(self, path, body, c=None):
        own = c is None
        c = c or self.conn()
        try:
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            return r.status, data
        finally:
            if own:
                c.close()

    def raw(self, timeout):
        s = socket.create_connection((self.host, self.port), timeout=timeout)
        return s

    def read_all(self, s):
        """Reads until the server closes; returns what came."""
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        return data

    def one(self, kind, rng):
        prompt = rng.choice(["Once upon a time", "The cat", "def f(x):", "1 2 3", "Hello"])
        n = rng.randint(1, 8)
        if kind == "completion":
            st, _ = self.post("/v1/completions", json.dumps(
                {"prompt": prompt, "max_tokens": n, "temperature": rng.choice([0, 0.7])}))
            self.record(kind, st, st == 200 or st == 429)
        elif kind == "chat":
            st, _ = self.post("/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": prompt}], "max_tokens": n}))
            self.record(kind, st, st == 200 or st == 429)
        elif kind == "stream":
            st, data = self.post("/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                 "stream": True}))
            self.record(kind, st, (st == 200 and b"[DONE]" in data) or st == 429)
        elif kind in ("bad_json", "bad_field", "bad_value", "too_long"):
            body = {
                "bad_json": '{"prompt": "x", ',
                "bad_field": json.dumps({"prompt": "x", "frobnicate": 1}),
                "bad_value": json.dumps({"prompt": "x", "temperature": 9}),
                "too_long": json.dumps({"prompt": "word " * 150_000}),
            }[kind]
            st, data = self.post("/v1/completions", body)
            ok = 400 <= st < 500 and b'"error"' in data
            self.record(kind, st, ok)
        elif kind == "unknown_path":
            c = self.conn()
            c.request("GET", "/v2/nothing")
            r = c.getresponse()
            r.read()
            c.close()
            self.record(kind, r.status, r.status == 404)
        elif kind == "disconnect_mid_stream":
            s = self.raw(30)
            body = json.dumps({"prompt": prompt, "max_tokens": 64, "stream": True,
                               "temperature": 0.8})
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                       + body).encode())
            head = s.recv(4096)
            s.close()
            st = int(head[9:12]) if head.startswith(b"HTTP/1.1") else 0
            self.record(kind, st, st in (200, 429))
        elif kind == "slow_header":
            # A client that trickles its headers for longer than the header timeout.
            s = self.raw(self.header_timeout + 10)
            trickle = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
            t = time.monotonic()
            closed = False
            try:
                for b in trickle:
                    s.sendall(bytes([b]))
                    readable, _, _ = select.select([s], [], [], 0.2)
                    if readable:
                        s.recv(4096)
                        closed = True
                        break
                    if time.monotonic() - t > self.header_timeout + 5:
                        break
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            s.close()
            self.record(kind, "closed" if closed else "open", closed)
        elif kind == "idle":
            s = self.raw(self.header_timeout + 10)
            t = time.monotonic()
            data = self.read_all(s)
            waited = time.monotonic() - t
            s.close()
            closed = not data or data.startswith(b"HTTP/1.1 408")
            self.record(kind, "closed", closed and waited < self.header_timeout + 5)
        elif kind == "stalled_body":
            s = self.raw(self.body_timeout + 10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"prompt\":")
            data = self.read_all(s)
            s.close()
            st = int(data[9:12]) if data.startswith(b"HTTP/1.1") else 0
            self.record(kind, st, st == 408)
        elif kind == "keepalive_pair":
            c = self.conn()
            ok = True
            for _ in range(2):
                st, _ = self.post("/v1/completions",
                                  json.dumps({"prompt": prompt, "max_tokens": n}), c)
                ok = ok and st in (200, 429)
            c.close()
            self.record(kind, st, ok)


def health_probe(host, port, stop, samples, failures):
    while not stop.is_set():
        t = time.monotonic()
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            c.close()
            ms = (time.monotonic() - t) * 1000
            samples.append(ms)
            if r.status != 200:
                failures.append(f"/health answered {r.status}")
        except Exception as e:  # noqa: BLE001 - every failure is a finding here
            failures.append(f"/health: {e!r}")
        time.sleep(0.05)


def memory_probe(pid, stop, samples):
    while not stop.is_set():
        try:
            samples.append((time.monotonic(), rss_kib(pid)))
        except OSError:
            break
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(
        os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "dynmoe"))
    ap.add_argument("--model", default="fixtures/models/tiny-moe")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--max-seqs", type=int, default=4)
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--body-timeout", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/serve_soak.json"))
    a = ap.parse_args()

    proc, host, port, stderr = start(a.binary, a.model, a.header_timeout, a.body_timeout,
                                     a.max_seqs)
    soak = Soak(host, port, a.header_timeout, a.body_timeout)
    rng = random.Random(a.seed)
    kinds = list(MIX)
    weights = [MIX[k] for k in kinds]
    plan = [(k, random.Random(a.seed * 1_000_003 + i))
            for i, k in enumerate(rng.choices(kinds, weights, k=a.requests))]

    stop = threading.Event()
    health, health_fail, memory = [], [], []
    probes = [
        threading.Thread(target=health_probe, args=(host, port, stop, health, health_fail)),
        threading.Thread(target=memory_probe, args=(proc.pid, stop, memory)),
    ]
    for p in probes:
        p.start()
    started = time.monotonic()
    errors = Counter()

    def run(item):
        kind, r = item
        try:
            soak.one(kind, r)
        except Exception as e:  # noqa: BLE001
            errors[f"{kind}: {type(e).__name__}"] += 1
            soak.record(kind, "client error", False)

    with ThreadPoolExecutor(a.clients) as pool:
        list(pool.map(run, plan))
    elapsed = time.monotonic() - started
    time.sleep(1.0)
    stop.set()
    for p in probes:
        p.join()
    proc.terminate()
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 20 s"
    text = "".join(stderr)
    panicked = "panicked" in text

    fives = sum(n for s, n in soak.statuses.items() if isinstance(s, int) and s >= 500)
    # Memory once warm (after the first tenth of the run) against the end.
    warm_at = started + elapsed * 0.1
    warm = [kib for t, kib in memory if t >= warm_at] or [kib for _, kib in memory]
    rss_warm, rss_end, rss_max = warm[0], warm[-1], max(warm)
    health_sorted = sorted(health)

    def pct(q):
        return health_sorted[min(len(health_sorted) - 1, int(q * len(health_sorted)))]

    result = {
        "requests": a.requests,
        "clients": a.clients,
        "max_seqs": a.max_seqs,
        "header_timeout_s": a.header_timeout,
        "body_timeout_s": a.body_timeout,
        "seconds": round(elapsed, 1),
        "by_kind": dict(soak.by_kind),
        "statuses": {str(k): v for k, v in sorted(soak.statuses.items(), key=str)},
        "unexpected": [list(u) for u in soak.unexpected],
        "failures_by_kind": dict(soak.failures),
        "client_errors": dict(errors),
        "responses_5xx": fives,
        "server_panicked": panicked,
        "server_exit": code,
        "health": {
            "probes": len(health),
            "failed": len(health_fail),
            "failures": health_fail[:10],
            "p50_ms": round(pct(0.5), 2),
            "p99_ms": round(pct(0.99), 2),
            "max_ms": round(health_sorted[-1], 2),
        },
        "rss_kib": {"warm": rss_warm, "end": rss_end, "max": rss_max,
                    "growth_pct": round(100.0 * (rss_end - rss_warm) / rss_warm, 1),
                    # Twenty samples across the run, to tell a plateau from a climb.
                    "samples": [kib for _, kib in memory][::max(1, len(memory) // 20)]},
    }
    result["pass"] = (fives == 0 and not panicked and not health_fail
                      and health_sorted[-1] < HEALTH_LIMIT_MS
                      and not soak.failures and code == 0)

    print(f"{'kind':<24}{'requests':>10}{'unexpected':>12}")
    for k in kinds:
        print(f"{k:<24}{soak.by_kind[k]:>10}{soak.failures[k]:>12}")
    print()
    print(f"{'requests':<32}{a.requests} in {elapsed:.1f} s ({a.clients} clients, "
          f"--max-seqs {a.max_seqs})")
    print(f"{'statuses':<32}{result['statuses']}")
    print(f"{'5xx':<32}{fives}")
    print(f"{'server panicked':<32}{panicked}")
    print(f"{'server exit on SIGTERM':<32}{code}")
    h = result["health"]
    print(f"{'/health probes':<32}{h['probes']} (failed {h['failed']})")
    print(f"{'/health p50 / p99 / max ms':<32}{h['p50_ms']} / {h['p99_ms']} / {h['max_ms']}")
    r = result["rss_kib"]
    print(f"{'RSS warm / end / max MiB':<32}{r['warm'] / 1024:.1f} / {r['end'] / 1024:.1f} / "
          f"{r['max'] / 1024:.1f} ({r['growth_pct']:+.1f}%)")
    print(f"{'RSS across the run, MiB':<32}"
          + " ".join(f"{k / 1024:.1f}" for k in r["samples"]))
    print(f"{'pass':<32}{result['pass']}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
