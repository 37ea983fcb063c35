#!/usr/bin/env bash
# The main job on a fresh Debian 12 machine: installs what is missing, builds,
# and starts the OpenAI-compatible server on the bundled demo model
# (models/moeserve-demo, a tiny Qwen3-MoE trained on fortune-cookie English)
# on the CPU, at http://127.0.0.1:${PORT:-8000}. Ctrl-C stops it.
# Extra arguments go to `moeserve serve` (e.g. --port 9000, --api-key KEY).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/install_deps.sh
make all
port=${PORT:-8000}
cat <<MSG

moeserve: serving the demo model 'moeserve-demo' at http://127.0.0.1:${port}

  curl http://127.0.0.1:${port}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "moeserve-demo", "messages": [{"role": "user", "content": "Tell me a fortune."}]}'

  curl -N http://127.0.0.1:${port}/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "moeserve-demo", "prompt": "The best way to", "max_tokens": 40, "stream": true}'

  # the openai client (npm install openai; or pip install openai with the same arguments)
  node --input-type=module -e "import OpenAI from 'openai';
    const c = new OpenAI({ baseURL: 'http://127.0.0.1:${port}/v1', apiKey: 'none' });
    const r = await c.chat.completions.create({ model: 'moeserve-demo',
      messages: [{ role: 'user', content: 'Say something wise.' }] });
    console.log(r.choices[0].message.content);"

  Also: /v1/models, /tokenize, /detokenize, /health, /metrics (Prometheus).
MSG
exec build/bin/moeserve serve --port "${port}" "$@"
