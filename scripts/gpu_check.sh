#!/usr/bin/env bash
# GPU check at real model size (bench/gpu_check.py, docs/GPU_CHECK.md): SD3.5-medium's
# transformer with random weights on one GPU, in-process, at 512x512 and 1024x1024 -- the
# embedded engine's step-wise batching vs one request at a time vs the plain (diffusers-style)
# loop, the learner's bf16 step with gradient checkpointing (time, peak memory), and on-policy
# log-prob parity rollout vs learner. Results: bench/results/gpu_check.json.
#
#   bash scripts/gpu_check.sh --fetch-wheels    # where PyPI is reachable: the wheels the GPU
#                                               # machine lacks (bench/gpu_env.py) -> .gpu_wheels/
#   bash scripts/gpu_check.sh --tiny [--out F]  # the same code at a tiny size on the CPU
#   bash scripts/gpu_check.sh [--out F]         # full size on the GPU machine, under 8 minutes
#
# On the GPU machine (python3 3.12 + torch, no diffusers / pydantic, no network) the carried
# wheels are installed into a target folder put on PYTHONPATH when this python lacks them.
# The device run, after --fetch-wheels here (the wheels are git-ignored, so they are carried):
#
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=540)
#
# Its $OUT gets gpu_check.json, gpu_check.png and gpu_check.log; copy the JSON and the PNG to
# bench/results/.
# Other options go to bench.gpu_check (--budget-s S, --dtype D). Exit status: 0 when every
# measurement ran (parity beyond its tolerance is a recorded finding, not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu_wheels
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mode=full
out=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --fetch-wheels) mode=fetch ;;
        --tiny) mode=tiny; args+=(--tiny) ;;
        --out) out=$2; shift ;;
        *) args+=("$1") ;;
    esac
    shift
done

if [ "$mode" = fetch ]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS" || exit 2
    # shellcheck disable=SC2046  # the pinned requirements, one word each
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" \
        $("$PY" -m bench.gpu_env --requirements) || exit 2
    exec "$PY" -m bench.gpu_env --check-wheels "$WHEELS"
fi

if ! "$PY" -c "import diffusers, pydantic" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: $PY lacks diffusers / pydantic and $WHEELS/ holds no wheels" \
             "(run --fetch-wheels where PyPI is reachable and carry $WHEELS)" >&2
        exit 2
    fi
    site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
    echo "gpu_check: installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

if [ "$mode" = tiny ]; then
    out=${out:-runs/gpu_check_tiny.json}
    limit_s=${GPU_CHECK_LIMIT_S:-300}
else
    out=${out:-bench/results/gpu_check.json}
    # 8 minutes in all: the measurements' own budget ends a minute before the hard stop
    limit_s=$(( ${GPU_CHECK_LIMIT_S:-470} - SECONDS ))
    case " ${args[*]:-} " in *" --budget-s "*) ;; *) args+=(--budget-s $(( limit_s - 60 ))) ;; esac
fi
logdir=${OUT:-runs}
mkdir -p "$logdir" "$(dirname "$out")"
log="$logdir/gpu_check.log"

timeout -k 10 "$limit_s" "$PY" -m bench.gpu_check "${args[@]}" --out "$out" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check: stopped at the ${limit_s} s limit; $out holds every measurement that finished"
fi
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -f "$out" ] && \
        [ "$(realpath "$out")" != "$(realpath "$OUT")/$(basename "$out")" ]; then
    cp "$out" "$OUT/gpu_check.json"
    [ -f "${out%.json}.png" ] && cp "${out%.json}.png" "$OUT/gpu_check.png"
fi
exit "$rc"
