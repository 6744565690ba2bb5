#!/usr/bin/env bash
# Fuzzes the targets of fuzz/ (cargo fuzz, libFuzzer with AddressSanitizer):
#
#   tools/fuzz/run.sh TARGET|all [SECONDS]    fuzz each for SECONDS (default 60)
#   tools/fuzz/run.sh TARGET|all 0            replay the committed corpus only
#
# Targets: checkpoint (safetensors shards and index), config (config.json), chat
# (tokenizer_config.json, chat templates, special tokens in messages), store (affine store
# manifests and records, VQ manifests), plan (plan.json), journal (the probe journal),
# http (the server's request bodies).
# What each does with an input is in fuzz/fuzz_targets/bodies.rs; `cargo test` replays
# fuzz/corpus through the same functions (crates/dynmoe/tests/fuzz_corpus.rs).
#
# New inputs go to a scratch directory, not to fuzz/corpus; a crash is written to
# fuzz/artifacts/TARGET/ and ends the script non-zero. Prints one JSON object per target
# on stdout (target, seconds, executions, executions per second, corpus kept, result);
# the logs are in fuzz/target/logs/. cargo fuzz passes -Z flags, which the one stable
# toolchain takes with RUSTC_BOOTSTRAP=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGETS="checkpoint config chat store plan journal http"
want=${1:?usage: tools/fuzz/run.sh TARGET|all [SECONDS]}
seconds=${2:-60}
[ "$want" = all ] && want=$TARGETS
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked >&2
fi
export RUSTC_BOOTSTRAP=1
mkdir -p fuzz/target/logs
(cd fuzz && cargo fuzz build -O >&2)
status=0
for t in $want; do
    work=$(mktemp -d)
    log=fuzz/target/logs/$t.log
    if [ "$seconds" = 0 ]; then
        limit=(-runs=0)
    else
        limit=(-max_total_time="$seconds")
    fi
    set +e
    (cd fuzz && cargo fuzz run -O "$t" "$work" "corpus/$t" -- "${limit[@]}" \
        -print_final_stats=1 -timeout=20 -rss_limit_mb=4096 -max_len=65536) >"$log" 2>&1
    rc=$?
    set -e
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    kept=$(ls "$work" | wc -l)
    if [ "$rc" = 0 ]; then result=ok; else result="failed (exit $rc; see $log and fuzz/artifacts/$t)"; status=1; fi
    printf '{"target": "%s", "seconds": %s, "executions": %s, "executions_per_second": %s, "new_corpus_inputs": %s, "result": "%s"}\n' \
        "$t" "$seconds" "${runs:-0}" "$(( ${runs:-0} / (seconds > 0 ? seconds : 1) ))" "$kept" "$result"
    rm -rf "$work"
done
exit $status
