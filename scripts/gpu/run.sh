#!/usr/bin/env bash
# Checks and benchmarks of the CUDA backend, on a machine with an NVIDIA GPU, from the
# repository root (the fixtures and data/ are read from there). No Rust is needed there:
# the executables are built on a Linux x86-64 machine and placed in $BIN by
# scripts/gpu/build.sh. Results go to $OUT (default gpu-results/).
#
#   bash scripts/gpu/run.sh [checks] [kernels] [cli] [model]     (these by default)
#
# checks   every kernel against the CPU reference, fixture perplexity and greedy decode;
#          with nvcc there, that no kernel touches memory before its launch wait
# kernels  quantized matvec GB/s against the copy kernel (cuda_kernels.json)
# cli      `dynmoe eval ppl` and `dynmoe run` with --backend cuda beside --backend cpu
# model    a converted directory of Qwen3-30B-A3B's shape with random weights (first $LAYERS
#          layers; LAYERS=48 is the whole model, about 41 GB under $WORK) written straight
#          as 4/3/2-bit stores by `dynmoe synth --bits`, decode and prefill tok/s at each
#          (model_speed.json); with DENSE=q4 its attention and LM head at that codec too
#          (model_speed_dense_q4.json)
# model-vq the same shape (or $LIKE's, e.g. LIKE=qwen3-coder-480b-a35b LAYERS=4) as a
#          compressed directory whose plan puts every MoE layer's experts at the VQ rung
#          $VQ (default vq1.5), random codes written straight by `dynmoe synth --vq`: decode
#          and prefill tok/s with those experts routed on the device (model_speed_vq.json,
#          or model_speed_vq_$LIKE.json)
# big      Qwen3-235B-A22B's shape with random weights, its 2-bit store only (no 4-bit
#          base: 94 layers are about 87 GB with the dense weights), or with BIG_VQ=vq1.5 a
#          compressed directory at that rung (about 60 GB), under /dev/shm: all 94 layers
#          if they fit in /dev/shm and in free memory less $BIG_MARGIN_GB (default 16) GB,
#          else as many as do (big.log; the directory is $BIG)
# residency after `model`, at 2 bits: decode with half (then 60%: 1.5 resident bits) of each
#          layer's experts resident in device memory, swapping from a RAM reservoir, beside
#          every expert resident (residency_30b*.json)
# residency-vq after `model-vq`: the same with that directory's VQ experts, their sets in
#          device slots, half of each layer's experts resident (residency_30b_vq.json)
# big-run  after `big`: that model fully resident, then within $BIG_BUDGET_GB (default 40) GB
#          of device memory with dynamic residency, the store read from /dev/shm
#          (residency_235b.json; with BIG_VQ, VQ sets in device slots, residency_235b_vq.json)
# cpu-vq   the CPU VQ matvec kernels against affine q2/q4 on this machine's CPU (vq_kernels.json)
# profile  a 2-layer model's 512-token prompt and 8 decode steps at 4 bits under Nsight
#          Compute: each kernel's time per prompt (profile.log, profile.csv)
# profile-routed  Nsight Compute's speed-of-light, occupancy and warp-state sections for the
#          routed expert, attention and one-row kernels of a decode step, 2-layer model at 4
#          bits (profile_routed.log)
# profile-source  the same model's routed gate/up and down kernels (q4, dense q4) under
#          Nsight Compute's source counters: stall samples by SASS instruction
#          (<kernel>.sass.csv, <kernel>.details.txt)
# tune     decode at each of $BITS bits (default 4) with each set in $TUNE (';'-separated
#          sets of kernel constants NAME=VALUE and DYNMOE_CUDA items such as pdl=0, '-' the
#          source's), dense layers at $TUNE_DENSE (q4; or bf16), and with nvcc ptxas's registers and
#          spills of the routed and dense kernels under each (tune_q<bits>[_bf16].log;
#          TUNE_PTXAS=0 skips ptxas, which takes about half a minute a set); TUNE_REPEATS
#          rounds over the sets in turn (default 1)
# resources ptxas's registers, stack, spills and shared memory of every kernel (ptxas.log;
#          needs nvcc)
# timeline each kernel's share of a decode token in the chain, from stamps taken as each
#          launch's wait returns (timeline_q<bits>.log; $BITS, default 4); with
#          TIMELINE_DEFINES="PHASES=512" also the last routed gate/up and down launches'
#          phases block by block (when their blocks waited, routed, staged, summed, wrote)
# variants after `model`, at 4 bits: without tensor cores (prompts through cuBLAS' f32
#          GEMM and the experts one by one, decode through the matrix-vector kernels),
#          kernels launched without programmatic dependent launch, and decode after a
#          16-token prompt (model_variants.log)
# batch    aggregate decode tok/s of 1 to 64 sequences at once, 4 and 2 bits
#          (cuda_decode_batched.json), and the timeline of a step of 8 sequences
# serve    `dynmoe serve --backend cuda` under bench/serve_load.py, all experts resident
#          and half (serve_load_cuda*.json)
# compare  after `model`: the same decode and prefill benchmark and a greedy generation with
#          $BEFORE (another build's dynmoe) and this one, ROUNDS (default 2) rounds in turn,
#          4 and 2 bits with q4 dense layers and head: each ratio and whether the tokens
#          are the same (compare.log, compare_*.json)
set -uo pipefail
BIN=${BIN:-.gpu}
OUT=${OUT:-gpu-results}
LAYERS=${LAYERS:-12}
WORK=${WORK:-/tmp/dynmoe-gpu}
BIG_VQ=${BIG_VQ:-}
BIG=${BIG:-/dev/shm/dynmoe-qwen3-235b-a22b-${BIG_VQ:-q2}}
BIG_MARGIN_GB=${BIG_MARGIN_GB:-16}
mkdir -p "$OUT" "$WORK"
steps=${*:-checks kernels cli model}

# NVRTC and cuBLAS are loaded by name: put the toolkit's library directories on the path.
for lib in libnvrtc.so libcublas.so; do
    d=$(find /usr/local /usr/lib /opt -name "$lib*" -not -path '*/stubs/*' 2>/dev/null | head -1)
    [ -n "$d" ] && LD_LIBRARY_PATH="$(dirname "$d"):${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
export DYNMOE_FIXTURES="$PWD/fixtures/models" DYNMOE_BENCH_OUT="$OUT"
{ nvidia-smi; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; } > "$OUT/device.txt" 2>&1
head -15 "$OUT/device.txt"

# The Qwen3-30B-A3B-shaped directory with its 4/3/2-bit stores, written once.
synth_model() {
    [ -e "$1/experts.json" ] && [ -e "$1/experts3.json" ] && [ -e "$1/experts2.json" ] && return
    time "$BIN/dynmoe" synth --like qwen3-30b-a3b --layers "$LAYERS" --bits 4,3,2 \
        -o "$1" --tokenizer-from fixtures/models/small-moe
}

status=0
for step in $steps; do
    case $step in
    checks)
        echo "== kernel checks and fixtures"
        # CHECKS: test name filters, to run only some (all by default).
        # shellcheck disable=SC2086
        "$BIN/cuda-tests" --test-threads=1 --nocapture ${CHECKS:-} 2>&1 | tee "$OUT/checks.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        # No kernel may read before its programmatic-launch wait (needs nvcc).
        if command -v nvcc > /dev/null; then
            bash "$BIN/pdl_order.sh" "$BIN/program.cu" 2>&1 | tee -a "$OUT/checks.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        fi
        ;;
    kernels)
        echo "== kernel bandwidth"
        "$BIN/cuda_kernels" 2>&1 | tee "$OUT/kernels.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    cli)
        echo "== command line, cpu then cuda"
        for b in cpu cuda; do
            "$BIN/dynmoe" eval ppl --model fixtures/models/small-moe --backend $b \
                --text data/corpus/en/test.txt --chunks 8 || status=1
            "$BIN/dynmoe" run --model fixtures/models/small-moe --backend $b -n 32 \
                --prompt "Call me Ishmael" || status=1
        done 2>&1 | tee "$OUT/cli.log"
        ;;
    model)
        echo "== Qwen3-30B-A3B shape, $LAYERS layers"
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        # DENSE=q4 (or another codec): attention projections and LM head at it too.
        dense=() name=model_speed
        [ -n "${DENSE:-}" ] && dense=(--dense-codec "$DENSE" --head-codec "$DENSE") &&
            name=model_speed_dense_$DENSE
        "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4,3,2 ${dense[@]+"${dense[@]}"} \
            --prompt 512 --generate 128 --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    compare)
        echo "== $BEFORE against $BIN/dynmoe, $LAYERS layers"
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        q4=(--dense-codec q4 --head-codec q4)
        for round in $(seq "${ROUNDS:-2}"); do
            for which in before after; do
                bin=$BIN/dynmoe
                [ "$which" = before ] && bin=$BEFORE
                "$bin" bench decode "$m" --backend cuda --bits 4,2 "${q4[@]}" --prompt 512 \
                    --generate 128 --json "$OUT/compare_${which}_$round.json" || status=1
            done
        done
        for which in before after; do
            bin=$BIN/dynmoe
            [ "$which" = before ] && bin=$BEFORE
            for bits in 4 2; do
                "$bin" run --model "$m" --backend cuda --expert-bits "$bits" "${q4[@]}" \
                    --prompt "Call me Ishmael" -n 64 --json > "$OUT/compare_tokens_${which}_$bits.json" ||
                    status=1
            done
        done
        python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/compare.log"
import glob, json, statistics, sys
out = sys.argv[1]
runs = {}
for which in ("before", "after"):
    for f in sorted(glob.glob(f"{out}/compare_{which}_[0-9]*.json")):
        for c in json.load(open(f))["cases"]:
            runs.setdefault((which, c["bits"]), []).append(c)
print(f"{'bits':>4} {'':>7} {'prefill':>9} {'decode':>8} {'sync':>8}")
for bits in (4, 2):
    med = {}
    for which in ("before", "after"):
        cs = runs.get((which, bits), [])
        med[which] = [statistics.median(c[k] for c in cs) if cs else float("nan")
                      for k in ("prefill_tok_s", "decode_tok_s", "decode_sync_tok_s")]
        print(f"{bits:>4} {which:>7} " + " ".join(f"{v:>8.1f}" for v in med[which]))
    print(f"{bits:>4} {'ratio':>7} " + " ".join(f"{a / b:>8.3f}" for a, b in zip(med["after"], med["before"])))
for bits in (4, 2):
    t = [json.load(open(f"{out}/compare_tokens_{w}_{bits}.json"))["tokens"] for w in ("before", "after")]
    print(f"greedy tokens at {bits} bits: {'identical' if t[0] == t[1] else 'DIFFERENT'} ({len(t[0])} tokens)")
PY
        ;;
    model-vq)
        vq=${VQ:-vq1.5}
        like=${LIKE:-qwen3-30b-a3b}
        name=$([ "$like" = qwen3-30b-a3b ] && echo vq || echo "vq_$like")
        echo "== $like shape, $LAYERS layers, every expert at $vq"
        m="$WORK/$like-l$LAYERS-$vq"
        if [ ! -e "$m/compressed.json" ]; then
            time "$BIN/dynmoe" synth --like "$like" --layers "$LAYERS" --vq "$vq" \
                -o "$m" --tokenizer-from fixtures/models/small-moe || status=1
        fi
        "$BIN/dynmoe" bench decode "$m" --backend cuda --prompt 512 --generate 128 \
            --json "$OUT/model_speed_$name.json" 2>&1 | tee "$OUT/model_$name.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    big)
        echo "== Qwen3-235B-A22B shape, 2-bit store only, under $(dirname "$BIG")"
        # A previous copy would count against the space (files are replaced by rename).
        rm -rf "$BIG"
        df -h "$(dirname "$BIG")"
        shm=$(df --output=avail -B1 "$(dirname "$BIG")" | tail -1)
        mem=$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) * 1024 ))
        # tmpfs pages are memory: the model's readers need room beside them.
        budget=$(( (shm < mem ? shm : mem) - BIG_MARGIN_GB * 1024 * 1024 * 1024 ))
        echo "budget $((budget / 1000000000)) GB (/dev/shm $((shm / 1000000000)) GB free, memory $((mem / 1000000000)) GB available, margin $BIG_MARGIN_GB GB)"
        if [ "$budget" -le 0 ]; then
            echo "no room for even one layer"; status=1
        else
            stores=(--bits 2)
            [ -n "$BIG_VQ" ] && stores=(--vq "$BIG_VQ")
            { time "$BIN/dynmoe" synth --like qwen3-235b-a22b "${stores[@]}" --fit-in "$budget" \
                -o "$BIG" --tokenizer-from fixtures/models/small-moe; } 2>&1 | tee "$OUT/big.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
            ls -l "$BIG" | tee -a "$OUT/big.log"
        fi
        ;;
    residency)
        echo "== resident sets in device memory, $LAYERS layers, 2 bits"
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        "$BIN/dynmoe" bench residency "$m" --bits 2 --resident-fraction 0.5 --reservoir ram \
            --swap-interval 32 --max-swaps 4 --swap-margin 0 --loader-threads 4 \
            --prompt 16 --generate 256 --json "$OUT/residency_30b.json" 2>&1 |
            tee "$OUT/residency_30b.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        # 1.5 resident bits per expert weight: 2-bit codes with their scales are 2.5 bits,
        # 60% of them resident.
        "$BIN/dynmoe" bench residency "$m" --bits 2 --resident-fraction 0.6 --reservoir ram \
            --swap-interval 32 --max-swaps 4 --swap-margin 0 --loader-threads 4 \
            --prompt 16 --generate 256 --json "$OUT/residency_30b_1p5.json" 2>&1 |
            tee "$OUT/residency_30b_1p5.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    residency-vq)
        vq=${VQ:-vq1.5}
        echo "== resident sets of $vq experts in device memory, $LAYERS layers"
        m="$WORK/qwen3-30b-a3b-l$LAYERS-$vq"
        "$BIN/dynmoe" bench residency "$m" --resident-fraction 0.5 \
            --reservoir ram --swap-interval 32 --max-swaps 4 --swap-margin 0 --loader-threads 4 \
            --prompt 16 --generate 256 --json "$OUT/residency_30b_vq.json" 2>&1 |
            tee "$OUT/residency_30b_vq.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    big-run)
        echo "== Qwen3-235B-A22B shape in ${BIG_BUDGET_GB:-40} GB of device memory"
        # A compressed directory runs at its plan; its VQ sets go to device slots.
        stores=(--bits 2) name=residency_235b
        [ -n "$BIG_VQ" ] && stores=() name=residency_235b_vq
        "$BIN/dynmoe" bench residency "$BIG" ${stores[@]+"${stores[@]}"} \
            --device-budget-gb "${BIG_BUDGET_GB:-40}" --reservoir disk --swap-interval 32 \
            --max-swaps 4 --swap-margin 0 --loader-threads 8 --prompt 16 --generate 128 \
            --repeats 2 --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    cpu-vq)
        echo "== CPU VQ kernels"
        "$BIN/vq_kernels" 2>&1 | tee "$OUT/cpu_vq_kernels.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    variants)
        echo "== decode variants, 4 bits"
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        # variant LABEL [VAR=VALUE]: 4-bit decode after a 512-token prompt, with VAR set.
        variant() {
            echo "-- $1"
            env ${2:+"$2"} "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4 \
                --prompt 512 --generate 128
        }
        {
            variant "without tensor cores (prompts through sgemm and the experts one by one, decode through the matrix-vector kernels)" \
                DYNMOE_CUDA=tensor_cores=0
            variant "kernels launched without programmatic dependent launch" DYNMOE_CUDA=pdl=0
            echo "-- 16-token prompt"
            "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4 --prompt 16 --generate 128
        } 2>&1 | tee "$OUT/model_variants.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        ;;
    profile)
        echo "== kernel times of a 2-layer prompt and decode, 4 bits (Nsight Compute)"
        m="$WORK/qwen3-30b-a3b-l2"
        [ -e "$m/experts.json" ] || "$BIN/dynmoe" synth --like qwen3-30b-a3b --layers 2 --bits 4 \
            -o "$m" --tokenizer-from fixtures/models/small-moe || status=1
        "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4 --prompt 512 --generate 8 \
            --repeats 1 2>&1 | tee "$OUT/profile.log"
        ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
            --log-file "$OUT/profile.csv" "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4 \
            --prompt 512 --generate 8 --repeats 1 > /dev/null 2>&1 || status=1
        # Four prompts ran (a warm-up and a timed run, with graphs and without): the
        # prompt's kernels read per prompt; decode kernels are totals over 4 × 2 × 8 steps / 4.
        python3 "$BIN/kernel_times.py" "$OUT/profile.csv" 4 2>&1 | tee -a "$OUT/profile.log"
        ;;
    resources)
        echo "== registers, spills and shared memory of every kernel (ptxas)"
        nvcc -std=c++17 -arch=sm_90 -cubin -Xptxas -v -o /dev/null "$BIN/program.cu" \
            > "$OUT/ptxas.log" 2>&1 || status=1
        grep -A1 -E "Compiling entry function '(dense_mma|routed_mma|moe_route)" \
            "$OUT/ptxas.log" | grep -E "entry|registers|spill" | head -40
        ;;
    profile-routed)
        echo "== where a decode step's routed expert kernels wait (Nsight Compute)"
        m="$WORK/qwen3-30b-a3b-l2"
        [ -e "$m/experts.json" ] || "$BIN/dynmoe" synth --like qwen3-30b-a3b --layers 2 --bits 4 \
            -o "$m" --tokenizer-from fixtures/models/small-moe || status=1
        # Skip the warm-up's eager steps: kernels of recorded steps, as decode runs them.
        ncu --clock-control none --cache-control none -k 'regex:(routed_mma_(gate_up|down)_q4|attention_group_128|attention_combine|matvec_bf16_one)' \
            --launch-skip 60 --launch-count 10 --section SpeedOfLight --section Occupancy \
            --section LaunchStats --section WarpStateStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis "$BIN/dynmoe" bench decode "$m" --backend cuda \
            --bits 4 --prompt 16 --generate 32 --repeats 1 > "$OUT/profile_routed.log" 2>&1 ||
            status=1
        tail -5 "$OUT/profile_routed.log"
        ;;
    profile-source)
        echo "== where the routed kernels' warps stall, by SASS instruction (Nsight Compute)"
        m="$WORK/qwen3-30b-a3b-l2"
        [ -e "$m/experts.json" ] || "$BIN/dynmoe" synth --like qwen3-30b-a3b --layers 2 --bits 4 \
            -o "$m" --tokenizer-from fixtures/models/small-moe || status=1
        for k in routed_mma_gate_up_q4 routed_mma_down_q4; do
            ncu --clock-control none --cache-control none -k "$k" --launch-skip 30 \
                --launch-count 1 --section SourceCounters --section WarpStateStats \
                --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
                -f -o "$OUT/$k" "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4 \
                --dense-codec q4 --head-codec q4 --prompt 16 --generate 32 --repeats 1 \
                > "$OUT/$k.ncu.log" 2>&1 || status=1
            ncu --import "$OUT/$k.ncu-rep" --page details > "$OUT/$k.details.txt" 2>&1 || status=1
            ncu --import "$OUT/$k.ncu-rep" --page source --csv --print-source sass \
                > "$OUT/$k.sass.csv" 2>&1 || status=1
            rm -f "$OUT/$k.ncu-rep"
            grep -E "Duration|Registers|Spill|Achieved Occupancy|Warp Cycles Per Issued" \
                "$OUT/$k.details.txt" | head
        done
        ;;
    tune)
        # TUNE: ';'-separated sets, each measured on the 12-layer model at each of $BITS
        # bits (default 4) with $TUNE_DENSE dense layers and head (q4 by default; bf16
        # leaves them as the checkpoint has them) into tune_q<bits>.log (tune_q<bits>_bf16.log
        # with bf16). A set is kernel constants (RMMA_GATE_UP_UNITS=2, given to the backend
        # as DYNMOE_CUDA=define=RMMA_GATE_UP_UNITS=2) and the backend's other DYNMOE_CUDA
        # items (pdl=0), space-separated; '-' is the source's own choice. With
        # nvcc (and TUNE_PTXAS not 0), ptxas's registers and spills of the routed and dense
        # kernels under each set. Each run's JSON is tune_q<bits>[_bf16]_<n>.json, n the set's
        # place in $TUNE from 1.
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        dense_flags=(--dense-codec "${TUNE_DENSE:-q4}" --head-codec "${TUNE_DENSE:-q4}")
        suffix=""
        [ "${TUNE_DENSE:-q4}" = bf16 ] && dense_flags=() && suffix=_bf16
        IFS=';' read -ra sets <<< "${TUNE:--}"
        # TUNE_REPEATS: rounds over the sets, in turn, so drift in the machine's speed
        # falls on every set alike (round r's JSON is tune_..._<n>_r<r>.json).
        repeats=${TUNE_REPEATS:-1}
        for bits in ${BITS:-4}; do
            log="$OUT/tune_q$bits$suffix.log"
            echo "== kernel constants and switches, $bits bits, dense ${TUNE_DENSE:-q4}" | tee "$log"
            for round in $(seq "$repeats"); do
                n=0
                for set in "${sets[@]}"; do
                    n=$((n + 1))
                    defs="" cuda=""
                    for word in $([ "$set" = - ] || echo "$set"); do
                        case $word in
                        [a-z]*) cuda="${cuda:+$cuda,}$word" ;;
                        *) defs="${defs:+$defs }$word" cuda="${cuda:+$cuda,}define=$word" ;;
                        esac
                    done
                    json="$OUT/tune_q$bits${suffix}_$n.json"
                    [ "$repeats" = 1 ] || json="${json%.json}_r$round.json"
                    echo "-- ${set/#-/source}" | tee -a "$log"
                    if command -v nvcc > /dev/null && [ "${TUNE_PTXAS:-1}" != 0 ] && [ "$round" = 1 ]; then
                        # shellcheck disable=SC2046
                        nvcc -std=c++17 -arch=sm_90 -cubin -Xptxas -v -o /dev/null \
                            $(for d in $defs; do echo "-D$d"; done) "$BIN/program.cu" 2>&1 |
                            grep -A3 -E "entry function '(routed_mma_(gate_up|down)|dense_mma(_norm)?)_(tiled_)?q($bits|4)'" |
                            grep -oE "(entry function '[a-z_0-9]+'|Used [0-9]+ registers|[0-9]+ bytes spill (stores|loads))" |
                            paste -sd' ' | tee -a "$log"
                    fi
                    DYNMOE_CUDA="$cuda" "$BIN/dynmoe" \
                        bench decode "$m" --backend cuda --bits "$bits" \
                        ${dense_flags[@]+"${dense_flags[@]}"} --prompt 512 --generate 128 \
                        --json "$json" 2>&1 | tail -1 | tee -a "$log"
                done
            done
        done
        ;;
    timeline)
        # Decode at each of $BITS bits (default 4) with the kernels built with TIMELINE:
        # after the usual runs, an eager decode whose launches stamp the time their waits
        # return, so each kernel's share of a token in the chain (timeline_q<bits>.log).
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        for bits in ${BITS:-4}; do
            cuda=define=TIMELINE=65536
            for d in ${TIMELINE_DEFINES:-}; do cuda="$cuda,define=$d"; done
            DYNMOE_CUDA="$cuda" "$BIN/dynmoe" bench decode \
                "$m" --backend cuda --bits "$bits" --dense-codec q4 --head-codec q4 --prompt 512 \
                --generate 64 --repeats 1 2>&1 | tee "$OUT/timeline_q$bits.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
        ;;
    batch)
        # Aggregate decode of B sequences at once (128-token prompts, 128 tokens each) at
        # 4 and 2 bits, dense layers and head q4 (cuda_decode_batched.json), then the
        # timeline of a step of 8 (batch_timeline.log).
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        q4=(--dense-codec q4 --head-codec q4)
        "$BIN/dynmoe" bench decode "$m" --backend cuda --bits 4,2 "${q4[@]}" --prompt 512 \
            --generate 128 --repeats 2 --batch "${BATCHES:-1,4,8,16,32,64}" \
            --json "$OUT/cuda_decode_batched.json" 2>&1 | tee "$OUT/batch.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        # Each kernel's share of a step of 8 sequences (kernels built with TIMELINE).
        DYNMOE_CUDA=define=TIMELINE=65536 "$BIN/dynmoe" bench decode "$m" --backend cuda \
            --bits 4 "${q4[@]}" --prompt 128 --generate 32 --repeats 1 --batch 8 \
            > "$OUT/batch_timeline.log" 2>&1 || status=1
        ;;
    serve)
        # `dynmoe serve --backend cuda` under bench/serve_load.py: 1, 8, 32 and 64
        # concurrent clients, 128-token prompts and completions, sampled; all experts
        # resident, then half of each layer's (serve_load_cuda*.json).
        m="$WORK/qwen3-30b-a3b-l$LAYERS"
        synth_model "$m" || status=1
        serve=(--backend cuda --expert-bits 2 --dense-codec q4 --head-codec q4 --max-seqs 64)
        for resident in 1 0.5; do
            extra=() name=serve_load_cuda
            [ "$resident" != 1 ] && extra=(--resident-fraction "$resident") &&
                name=serve_load_cuda_half
            python3 bench/serve_load.py --binary "$BIN/dynmoe" --model "$m" \
                --clients "${CLIENTS:-1,8,32,64}" --label "$name" --json "$OUT/$name.json" \
                -- "${serve[@]}" ${extra[@]+"${extra[@]}"} 2>&1 | tee "$OUT/$name.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
        ;;
    *) echo "unknown step $step"; status=1 ;;
    esac
done
exit $status
