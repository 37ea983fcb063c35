// `moeserve serve` as a process: bad flags fail with a message and exit code
// 1 (or 2 for usage errors) before binding; a busy port fails; SIGINT and
// SIGTERM stop it cleanly (exit 0), ending the requests in flight with errors.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { startServer, moeserveBin, metrics, waitFor, repoRoot } from './server_harness.mjs';

function serve(args) {
  return spawnSync(moeserveBin, ['serve', ...args], { encoding: 'utf8', timeout: 60000 });
}

test('bad flags fail before serving, saying why', () => {
  const cases = [
    [['--model', '/nonexistent/model'], 1, /config\.json/],
    [['--device', 'cuda'], 1, /no usable GPU|no CUDA backend/],  // CI has no GPU
    [['--device', 'tpu'], 2, /device/],
    [['--reasoning-parser', 'deepseek_r1'], 1, /only qwen3/],
    [['--max-model-len', '100000'], 1, /max_position_embeddings/],
    [['--kv-cache-gb', '0.0001'], 1, /kv-cache-gb/],
    [['--host', 'not-an-ip', '--port', '0'], 1, /not an IP address/],
    [['--port', '70000'], 2, /port/],
    [['--no-such-flag'], 2, /no-such-flag/],
    [['--enable-auto-tool-choice'], 1, /needs --tool-call-parser/],
    [['--dtype', 'float16'], 1, /--dtype: auto or bfloat16/],
    [['--chat-template', '/nonexistent/template.jinja'], 1, /--chat-template: no file/],
    [['--chat-template', '{{ messages'], 1, /--chat-template does not parse/],
    [['models/moeserve-demo', '--model', '/elsewhere'], 1, /the model is given twice/],
    [['--tp', '2', '--ep', '4', '--enable-expert-parallel'], 1, /--tp x --dp = 2 ranks, but --ep is 4/],
  ];
  for (const [args, code, message] of cases) {
    const r = serve(args);
    assert.equal(r.status, code, `${args.join(' ')}: ${r.stderr}`);
    assert.match(r.stderr, message, args.join(' '));
  }
});

test('the batch limits: the CPU defaults (64 sequences, 512 tokens a step) and the flags, in the startup config line',
     async () => {
  for (const [args, seqs, tokens] of [[[], 64, 512], [['--max-num-seqs', '8', '--max-num-batched-tokens', '100'], 8, 100]]) {
    const server = await startServer(args);
    try {
      assert.match(server.stderr(), new RegExp(`max_num_seqs=${seqs}, .*max_num_batched_tokens=${tokens},`));
    } finally {
      assert.equal(await server.stop(), 0);
    }
  }
});

// A vLLM launch line, unchanged but for the binary: `serve MODEL` and the flags
// vLLM users pass for Qwen3 (--chat-template replaces the model's template).
test('a vLLM command line runs: serve MODEL, --enable-auto-tool-choice, --chat-template, --enable-expert-parallel',
     async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'moeserve-cli-'));
  const template = path.join(dir, 'template.jinja');
  fs.writeFileSync(template, "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]");
  const server = await startServer([path.join(repoRoot, 'models/moeserve-demo'), '--served-model-name', 'qwen3',
                                    '--enable-auto-tool-choice', '--tool-call-parser', 'hermes',
                                    '--reasoning-parser', 'qwen3', '--trust-remote-code', '--dtype', 'auto',
                                    '--chat-template', template, '--tp', '2', '--enable-expert-parallel',
                                    '--enable-prefix-caching', '--enable-chunked-prefill', '--disable-log-requests',
                                    '--disable-log-stats']);
  try {
    assert.match(server.stderr(), /2 ranks ready \(tp 2, ep 2, dp 1\)/);
    assert.match(server.stderr(), /tool_call_parser=hermes/);
    const models = await (await fetch(`${server.url}/v1/models`)).json();
    assert.deepEqual(models.data.map((m) => m.id), ['qwen3']);
    const tokenize = async (body) => (await (await fetch(`${server.url}/tokenize`, {
      method: 'POST', body: JSON.stringify(body) })).json()).tokens;
    const chat = await tokenize({ messages: [{ role: 'user', content: 'Hi there' }] });
    assert.deepEqual(chat, await tokenize({ prompt: '[user] Hi there\n[assistant]', add_special_tokens: false }));
  } finally {
    assert.equal(await server.stop(), 0);
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('a port in use fails with exit code 1', async () => {
  const first = await startServer([]);
  try {
    const r = serve(['--port', String(first.port)]);
    assert.equal(r.status, 1);
    assert.match(r.stderr, /cannot listen/);
  } finally {
    assert.equal(await first.stop(), 0);
  }
});

test('SIGINT stops the server with exit code 0', async () => {
  const s = await startServer([]);
  const exited = new Promise((resolve) => s.proc.on('exit', (code) => resolve(code)));
  s.proc.kill('SIGINT');
  assert.equal(await exited, 0);
  await s.stop();
});

test('SIGTERM ends the requests in flight with an error (a stream: an error event, then [DONE]) and exits 0',
     async () => {
  const s = await startServer(['--max-num-seqs', '1']);  // one runs, the others wait
  const post = (body) => fetch(`${s.url}/v1/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt: 'hi', max_tokens: 1000, ignore_eos: true, ...body }) });
  const streamed = await post({ stream: true, n: 4 });
  const plain = post({ n: 4 });
  const reader = streamed.body.getReader();
  const first = await reader.read();  // the stream has started
  assert.ok(!first.done);
  assert.ok(await waitFor(async () => (await metrics(s.url))['moeserve:num_requests_waiting'] > 0),
            'the second request is queued');
  const exited = new Promise((resolve) => s.proc.on('exit', (code) => resolve(code)));
  s.proc.kill('SIGTERM');
  let text = new TextDecoder().decode(first.value);
  for (let r = await reader.read(); !r.done; r = await reader.read()) text += new TextDecoder().decode(r.value);
  const events = text.split('\n\n').filter((e) => e.startsWith('data: ')).map((e) => e.slice(6));
  assert.equal(events.at(-1), '[DONE]');
  assert.match(JSON.parse(events.at(-2)).error.message, /shutting down/);
  const answer = await plain;
  assert.equal(answer.status, 503);
  assert.match((await answer.json()).error.message, /shutting down/);
  assert.equal(await exited, 0);
  await s.stop();
});

test('bench serve prints vLLM\'s result block and saves JSON that adds up', async () => {
  const s = await startServer(['--max-model-len', '256']);
  try {
    const fs = await import('node:fs');
    const os = await import('node:os');
    const path = await import('node:path');
    const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'moebench-')), 'result.json');
    const r = spawnSync(moeserveBin, ['bench', 'serve', '--url', s.url, '--random-input-len', '12', '--random-output-len', '5',
                                      '--num-prompts', '6', '--max-concurrency', '3', '--request-rate', '50', '--seed', '3',
                                      '--save-result', file], { encoding: 'utf8', timeout: 60000 });
    assert.equal(r.status, 0, r.stderr);
    for (const label of ['Successful requests:', 'Benchmark duration (s):', 'Output token throughput (tok/s):',
                         'Mean TTFT (ms):', 'P99 TPOT (ms):', 'Median ITL (ms):', 'P99 E2EL (ms):'])
      assert.ok(r.stdout.includes(label), label);
    const j = JSON.parse(fs.readFileSync(file, 'utf8'));
    assert.equal(j.completed, 6);
    assert.equal(j.total_input_tokens, 72);
    assert.equal(j.total_output_tokens, 30);
    assert.equal(j.max_concurrency, 3);
    assert.ok(j.mean_ttft_ms > 0 && j.mean_e2el_ms >= j.mean_ttft_ms && j.p99_ttft_ms >= j.median_ttft_ms);
    assert.deepEqual(j.errors, []);
    assert.equal(j.failed, 0);
    const bench = (args, env = {}) => spawnSync(moeserveBin, ['bench', 'serve', ...args],
                                                { encoding: 'utf8', timeout: 60000, env: { ...process.env, ...env } });
    // vLLM's spelling: --host/--port, --dataset-name, the percentiles chosen, goodput. Oracle: the
    // saved per-request TTFTs, with numpy's linear-interpolation percentile and population std.
    const vllmFile = path.join(path.dirname(file), 'vllm.json');
    const port = new URL(s.url).port;
    const v = bench(['--host', '127.0.0.1', '--port', port, '--dataset-name', 'random', '--random-input-len', '8',
                     '--random-output-len', '4', '--num-prompts', '7', '--percentile-metrics', 'ttft,tpot',
                     '--metric-percentiles', '50,90,99.9', '--goodput', 'ttft:1000000', 'e2el:1000000',
                     '--save-result', vllmFile]);
    assert.equal(v.status, 0, v.stderr);
    for (const label of ['P90 TTFT (ms):', 'P99.9 TPOT (ms):', 'P50 TTFT (ms):', 'Request goodput (req/s):'])
      assert.ok(v.stdout.includes(label), label);
    assert.ok(!v.stdout.includes('ITL') && !v.stdout.includes('P99 TTFT'), v.stdout);
    const jv = JSON.parse(fs.readFileSync(vllmFile, 'utf8'));
    const sorted = [...jv.ttfts].sort((a, b) => a - b);
    const pct = (q) => {
      const pos = q * (sorted.length - 1), lo = Math.floor(pos), hi = Math.min(lo + 1, sorted.length - 1);
      return (sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo)) * 1e3;
    };
    const mean = sorted.reduce((a, b) => a + b, 0) / sorted.length;
    const std = Math.sqrt(sorted.reduce((a, b) => a + (b - mean) ** 2, 0) / sorted.length) * 1e3;
    assert.ok(Math.abs(jv.p90_ttft_ms - pct(0.9)) < 1e-6, `${jv.p90_ttft_ms} vs ${pct(0.9)}`);
    assert.ok(Math.abs(jv['p99.9_ttft_ms'] - pct(0.999)) < 1e-6);
    assert.ok(Math.abs(jv.std_ttft_ms - std) < 1e-6, `${jv.std_ttft_ms} vs ${std}`);
    assert.equal(jv.mean_itl_ms, undefined);
    assert.equal(jv.request_goodput, jv.request_throughput);  // every request met SLOs that loose
    const strict = bench(['--url', s.url, '--num-prompts', '2', '--random-input-len', '8', '--goodput', 'tpot:0',
                          '--save-result', vllmFile]);
    assert.equal(strict.status, 0, strict.stderr);
    assert.equal(JSON.parse(fs.readFileSync(vllmFile, 'utf8')).request_goodput, 0);
    for (const [flags, message] of [[['--goodput', 'ttft'], /--goodput: 'ttft'/],
                                    [['--percentile-metrics', 'ttft,foo'], /'foo'/],
                                    [['--metric-percentiles', '0'], /'0'/]]) {
      const bad = bench(['--url', s.url, '--num-prompts', '1', ...flags]);
      assert.equal(bad.status, 1);
      assert.match(bad.stderr, message);
    }
    const down = bench(['--url', 'http://127.0.0.1:1', '--num-prompts', '1']);
    assert.equal(down.status, 1);
    // Runs that cannot measure anything fail at once (exit 1), saying why, as vLLM's initial test request does.
    const tooLong = bench(['--url', s.url, '--random-input-len', '300', '--num-prompts', '2']);
    assert.equal(tooLong.status, 1);
    assert.match(tooLong.stderr, /initial test request failed: HTTP 400: This model's maximum context length is 256/);
    const noDir = bench(['--url', s.url, '--num-prompts', '1', '--save-result', '/nonexistent/dir/r.json']);
    assert.equal(noDir.status, 1);
    assert.match(noDir.stderr, /--save-result: no directory/);
    // A server that accepts and never answers: --timeout ends the wait.
    const net = await import('node:net');
    const mute = net.createServer(() => {});
    await new Promise((resolve) => mute.listen(0, '127.0.0.1', resolve));
    const hung = await new Promise((resolve) => {
      const child = spawn(moeserveBin, ['bench', 'serve', '--url', `http://127.0.0.1:${mute.address().port}`,
                                        '--model', 'm', '--num-prompts', '1', '--timeout', '1']);
      let stderr = '';
      child.stderr.on('data', (d) => { stderr += d; });
      child.on('exit', (code) => resolve({ code, stderr }));
    });
    mute.close();
    assert.equal(hung.code, 1);
    assert.match(hung.stderr, /no answer for 1 s \(--timeout\)/);
  } finally {
    assert.equal(await s.stop(), 0);
  }
  // A server with --api-key: the key from --api-key or $OPENAI_API_KEY, a 401 named as such without it.
  const keyed = await startServer(['--api-key', 'sekrit']);
  try {
    const run = (args, env) => spawnSync(moeserveBin, ['bench', 'serve', '--url', keyed.url, '--num-prompts', '2',
                                                       '--random-output-len', '2', ...args],
                                         { encoding: 'utf8', timeout: 60000, env: { ...process.env, OPENAI_API_KEY: '', ...env } });
    const without = run([], {});
    assert.equal(without.status, 1);
    assert.match(without.stderr, /HTTP 401.*--api-key, or \$OPENAI_API_KEY/);
    assert.equal(run(['--api-key', 'sekrit'], {}).status, 0);
    assert.equal(run([], { OPENAI_API_KEY: 'sekrit' }).status, 0);
  } finally {
    assert.equal(await keyed.stop(), 0);
  }
});
