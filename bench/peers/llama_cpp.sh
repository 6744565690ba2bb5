#!/usr/bin/env bash
# Benchmark llama.cpp's CPU engine on a Hugging Face OLMoE checkpoint, for the dynmoe comparison table.
#
#   bash bench/peers/llama_cpp.sh CHECKPOINT_DIR OUT.json        (e.g. after olmoe_shape.py --out DIR)
#
# Environment: REPEATS (llama-bench -r, default 3), THREADS (default 2), DEPTHS (llama-bench -d:
#              context already in the cache when each test starts, comma-separated, default 0),
#              LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (build parallelism, default 2).
#
# llama.cpp's source comes from the llama-cpp-python sdist on PyPI (it vendors llama.cpp under
# vendor/llama.cpp), because PyPI is a registry this project's machines can reach and GitHub is not.
# cmake also comes from PyPI, into the venv, so nothing is installed system-wide.
#
# GGUF conversion uses olmoe_to_gguf.py (numpy + the sdist's own gguf-py), not the sdist's
# convert_hf_to_gguf.py: that one imports torch and transformers, and PyPI's Linux torch drags in
# several GB of CUDA wheels. Quantisation uses the sdist's own llama-quantize.
#
# Everything lands in bench/peers/.cache/ and is reused on the next run; only the benchmark reruns.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 CHECKPOINT_DIR OUT.json" >&2
    exit 2
fi
CKPT=$(cd "$1" && pwd)
OUT_JSON=$2
REPEATS=${REPEATS:-3}
THREADS=${THREADS:-2}
DEPTHS=${DEPTHS:-0}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
TYPES=(f32 q4_k_m q2_k)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=$HERE/.cache
VENV=$CACHE/venv
SRC=$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$CACHE/build-$VERSION
BIN=$BUILD/bin

say() { echo "llama_cpp.sh: $*" >&2; }
# Run a command with its output in a log; show the log's tail only when it fails.
logged() {
    local log=$1; shift
    "$@" >"$log" 2>&1 || { tail -n 30 "$log" >&2; say "failed: $* (full log: $log)"; exit 1; }
}

# --- Python venv: cmake for the build; numpy, tokenizers and gguf-py's deps for conversion.
if [[ ! -x $VENV/bin/python ]]; then
    say "creating venv $VENV"
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import numpy, tokenizers, yaml, tqdm' 2>/dev/null || [[ ! -x $VENV/bin/cmake ]]; then
    say "installing cmake numpy tokenizers pyyaml tqdm into the venv"
    "$VENV/bin/pip" install -q cmake numpy tokenizers pyyaml tqdm
fi
export PATH=$VENV/bin:$PATH

# --- Source. `--no-binary` names only this package: with `:all:` pip would also build the
# sdist's build requirements (cmake, ninja) from source just to read its metadata.
if [[ ! -f $SRC/CMakeLists.txt ]]; then
    say "fetching llama-cpp-python==$VERSION sdist"
    mkdir -p "$CACHE/sdist" "$CACHE/src"
    pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
    tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
fi

# --- Build only the two tools. Static so the binaries do not depend on the build tree's .so
# files; OpenSSL off and the tests/server/UI off so nothing in the configure step reaches the
# network (LLAMA_CURL is gone from recent llama.cpp: passed only for older versions).
# -mno-amx-int8: with GGML_NATIVE on an AMX Xeon, ggml routes Q4_K matmuls through its AMX
# kernels, which segfault on this model (ggml_backend_amx_mul_mat; llama.cpp issue #20824).
# Without the macro ggml uses its AVX-512 kernels and the runtime repacking, as on other CPUs.
NO_AMX=()
if [[ $(uname -m) == x86_64 ]]; then NO_AMX=(-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8); fi
if [[ ! -x $BIN/llama-bench || ! -x $BIN/llama-quantize ]]; then
    say "building llama-bench and llama-quantize in $BUILD (-j$JOBS)"
    start=$SECONDS
    logged "$CACHE/cmake-configure.log" cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF "${NO_AMX[@]}" \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    logged "$CACHE/cmake-build.log" cmake --build "$BUILD" -j"$JOBS" --target llama-bench llama-quantize
    say "built in $((SECONDS - start)) s"
fi

# --- Convert and quantise, keyed by the checkpoint's content so a regenerated checkpoint
# is never benchmarked through a stale GGUF.
key=$(cat "$CKPT/config.json" "$CKPT/tokenizer.json" "$CKPT/model.safetensors" | sha256sum | cut -c1-12)
GGUF_DIR=$CACHE/gguf/$(basename "$CKPT")-$key-$VERSION
mkdir -p "$GGUF_DIR"
if [[ ! -f $GGUF_DIR/f32.gguf ]]; then
    say "converting $CKPT to $GGUF_DIR/f32.gguf"
    PYTHONPATH=$SRC/gguf-py python "$HERE/olmoe_to_gguf.py" "$CKPT" "$GGUF_DIR/f32.gguf.tmp"
    mv "$GGUF_DIR/f32.gguf.tmp" "$GGUF_DIR/f32.gguf"
fi
for t in "${TYPES[@]:1}"; do
    if [[ ! -f $GGUF_DIR/$t.gguf ]]; then
        say "quantising to ${t^^} (log: $GGUF_DIR/$t.quantize.log)"
        logged "$GGUF_DIR/$t.quantize.log" "$BIN/llama-quantize" "$GGUF_DIR/f32.gguf" "$GGUF_DIR/$t.gguf.tmp" "${t^^}"
        mv "$GGUF_DIR/$t.gguf.tmp" "$GGUF_DIR/$t.gguf"
    fi
done

# --- Benchmark: one llama-bench run per type, a prefill (pp512) and a decode (tg128) test each.
# The machine is shared: on 2 cores llama-bench -t 2 spins in its thread barriers, so a busy
# neighbour cuts prefill tenfold. Each run therefore waits for an idle CPU, measures what other
# processes used during it (CPU time from /proc/stat less llama-bench's own), and is retried
# when that exceeds 5%; the share is kept in the summary.
say "benchmarking ${TYPES[*]}: llama-bench -t $THREADS -p 512 -n 128 -d $DEPTHS -r $REPEATS"
python - "$BIN/llama-bench" "$GGUF_DIR" "$OUT_JSON" "$VERSION" "$CKPT" "$THREADS" "$REPEATS" "$DEPTHS" "GGML_NATIVE=ON ${NO_AMX[*]}" "${TYPES[@]}" <<'EOF'
import json, os, resource, statistics, subprocess, sys, time
bench, gguf_dir, out, version, ckpt, threads, repeats, depths, flags, *types = sys.argv[1:]
args = ["-t", threads, "-p", "512", "-n", "128", "-d", depths, "-r", repeats, "-o", "json"]
hz = os.sysconf("SC_CLK_TCK")

def cpu():  # (busy, total) seconds of the whole machine; idle and iowait count as free
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(f) - f[3] - f[4]) / hz, sum(f) / hz

def own():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime

def wait_idle(limit=600):
    deadline = time.time() + limit
    while time.time() < deadline:
        b0, t0 = cpu()
        time.sleep(2)
        b1, t1 = cpu()
        if (b1 - b0) / (t1 - t0) < 0.05:
            return
    print(f"llama_cpp.sh: CPU still busy after {limit} s; benchmarking anyway", file=sys.stderr)

summary = {"engine": "llama.cpp", "llama_cpp_python": version, "checkpoint": ckpt,
           "llama_bench_args": " ".join(args), "build_flags": flags, "models": {}}
for t in types:
    for attempt in range(1, 4):
        wait_idle()
        (b0, t0), o0 = cpu(), own()
        res = subprocess.run([bench, "-m", f"{gguf_dir}/{t}.gguf", *args], capture_output=True, text=True)
        (b1, t1), o1 = cpu(), own()
        if res.returncode:
            sys.exit(f"llama-bench failed on {t}:\n{res.stderr[-3000:]}")
        others = max(0.0, (b1 - b0) - (o1 - o0)) / (t1 - t0)
        print(f"llama_cpp.sh: {t}: other processes used {others:.0%} of the CPU (attempt {attempt})", file=sys.stderr)
        if others < 0.05:
            break
    open(f"{gguf_dir}/{t}.bench.json", "w").write(res.stdout)
    rows = json.loads(res.stdout)
    r0 = rows[0]
    summary.update(version=f"llama.cpp {r0['build_commit']} (build {r0['build_number']}, llama-cpp-python {version})",
                   cpu_info=r0["cpu_info"], n_threads=r0["n_threads"])
    m = summary["models"][t] = {"model_type": r0["model_type"], "model_size_bytes": r0["model_size"],
                                "n_params": r0["model_n_params"], "cpu_share_of_other_processes": round(others, 3)}
    for r in rows:
        # At depth 0 the keys llama-bench's plain pp512 and tg128 had; deeper, `_at_<depth>`.
        depth = r.get("n_depth", 0)
        key = ("prefill" if r["n_gen"] == 0 else "decode") + (f"_at_{depth}" if depth else "")
        m[key] = {
            "n_tokens": r["n_prompt"] or r["n_gen"], "avg_tok_s": r["avg_ts"], "stddev_tok_s": r["stddev_ts"],
            "median_tok_s": statistics.median(r["samples_ts"]), "samples_tok_s": r["samples_ts"]}
json.dump(summary, open(out, "w"), indent=2)
print(f"{'type':8} {'prefill tok/s (avg ± sd)':>26} {'decode tok/s (avg ± sd)':>26}")
for t, m in summary["models"].items():
    p, d = m["prefill"], m["decode"]
    print(f"{t:8} {p['avg_tok_s']:17.0f} ± {p['stddev_tok_s']:6.0f} {d['avg_tok_s']:17.0f} ± {d['stddev_tok_s']:6.0f}")
EOF
say "wrote $OUT_JSON"
