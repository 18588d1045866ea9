#!/usr/bin/env bash
# The README's one-host vLLM example, exactly as the README gives it: `make vllm-one-host` runs it with
# a tiny model built here. Run from the repository root. Every process it starts is stopped by its pid
# on the way out.
#   MODEL           the model directory vLLM serves
#   PDPUSH_MODEL    the same directory, exported: the receiver reads the model's KV layout from it over
#                   configs/receiver.toml, and so do the connectors that read that file (PDPUSH_DTYPE
#                   too where vLLM serves another dtype than the model's config.json says)
#   VLLM_PY         a python with vLLM and pdpush installed (default: .venv-vllm/bin/python)
set -euo pipefail
: "${MODEL:?set MODEL to the model directory}"
: "${PDPUSH_MODEL:?export PDPUSH_MODEL=\$MODEL: the receiver and the connectors read the KV layout from it}"
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait' EXIT

# --- the README's commands start here ---
.venv/bin/pdpush-receiver --config configs/receiver.toml & pids+=($!)     # decode node
.venv/bin/pdpush-sender --config configs/sender.toml --staging-bytes 268435456 & pids+=($!)   # prefill node
"$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name m --port 8100 \
    --kv-transfer-config "$(cat configs/vllm/kv_producer.json)" & pids+=($!)   # prefill instance
"$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name m --port 8200 \
    --kv-transfer-config "$(cat configs/vllm/kv_consumer.json)" & pids+=($!)   # decode instance
.venv/bin/pdpush router --config configs/router.toml & pids+=($!)     # the front, on port 8000
for url in http://127.0.0.1:8100/health http://127.0.0.1:8200/health http://127.0.0.1:8000/health; do
    curl -sf --retry 120 --retry-delay 2 --retry-all-errors --max-time 5 -o /dev/null "$url"
done
curl -sf --max-time 120 localhost:8000/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model": "m", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 16}'
echo
# --- end of the README's commands ---

committed=$(.venv/bin/pdpush status --config configs/receiver.toml --json | .venv/bin/python -c \
    'import json, sys; print(json.load(sys.stdin)["requests_committed"])')
echo "receiver: requests_committed = $committed"
test "$committed" -ge 1
