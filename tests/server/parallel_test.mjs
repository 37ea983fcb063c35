// `moeserve serve --tp N --ep N` on the CPU (docs/parallel.md): rank 0 serves
// the API and drives ranks 1..N-1, separate processes joined by shared
// memory. Oracle: the single-rank server on the same model, through the
// official `openai` client (greedy ids must be identical: the ranks add the
// same terms in another order, and the demo model's greedy margins are far
// above float32 rounding).
// - TP 2 + EP 2 and TP 4 (k/v heads replicated) give the single-rank output,
//   under concurrency;
// - kill -9 of a follower, between steps and while a request decodes: the
//   requests fail with an explicit error within seconds, none hangs, the
//   server reports itself unhealthy;
// - SIGTERM to the leader stops every rank; kill -9 of the leader makes the
//   followers exit on their own.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';
import { fileURLToPath } from 'node:url';
import { startProcess, waitFor, scrape, routerInstances } from './disagg_harness.mjs';

const modelsDir = fileURLToPath(new URL('../../models', import.meta.url));
const base = ['--kv-cache-gb', '0.05', '--threads', '1', '--max-num-seqs', '16'];
let oracle;
before(async () => { oracle = await startProcess('serve', base); });
after(async () => { assert.equal(await oracle.stop(), 0); });

const client = (url) => new OpenAI({ baseURL: `${url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120000 });
const prompts = ['Tell me a fortune.', 'The sea is', 'Money and time', 'A computer once said', 'Love is a window'];

async function ids(url, prompt, max_tokens = 24) {
  const r = await client(url).completions.create({ model: 'moeserve-demo', prompt, max_tokens, temperature: 0,
                                                   ignore_eos: true, return_token_ids: true });
  return r.choices[0].token_ids;
}

// The follower processes a leader started (it logs their pids).
const followerPids = (server) => [...server.stderr().matchAll(/started rank \d+ of \d+ \(pid (\d+)\)/g)].map((m) => Number(m[1]));
const alive = (pid) => { try { process.kill(pid, 0); return true; } catch { return false; } };
// Dead, or a zombie its parent has not reaped yet.
const gone = (pid) => { try { return /\) Z /.test(readFileSync(`/proc/${pid}/stat`, 'utf8')); } catch { return true; } };

for (const flags of [['--tp', '2', '--ep', '2'], ['--tp', '4'], ['--ep', '2']]) {
  test(`serve ${flags.join(' ')} gives the single-rank greedy output`, async () => {
    const server = await startProcess('serve', [...base, ...flags]);
    try {
      assert.equal(followerPids(server).length, Number(flags[1]) - 1);
      const got = await Promise.all(prompts.map((p) => ids(server.url, p)));
      const want = await Promise.all(prompts.map((p) => ids(oracle.url, p)));
      assert.deepEqual(got, want);
      // Streaming too.
      const stream = await client(server.url).chat.completions.create({
        model: 'moeserve-demo', messages: [{ role: 'user', content: prompts[0] }], max_tokens: 16, temperature: 0,
        stream: true });
      let text = '';
      for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
      const plain = await client(oracle.url).chat.completions.create({
        model: 'moeserve-demo', messages: [{ role: 'user', content: prompts[0] }], max_tokens: 16, temperature: 0 });
      assert.equal(text, plain.choices[0].message.content);
    } finally {
      const pids = followerPids(server);
      assert.equal(await server.stop(), 0, server.stderr().slice(-2000));
      assert.ok(await waitFor(() => pids.every((p) => !alive(p)), 10000), 'every rank stopped with the leader');
    }
  });
}

// --load-format dummy from a config.json file: every rank draws the same
// random weights (seed 0), so the ranks together equal one rank alone.
test('dummy weights: serve --tp 2 --ep 2 --load-format dummy gives the single-rank dummy output', async () => {
  const dummy = ['--model', fileURLToPath(new URL('../data/golden/moe_basic/config.json', import.meta.url)),
                 '--load-format', 'dummy'];
  const single = await startProcess('serve', [...base, ...dummy]);
  const ranks = await startProcess('serve', [...base, ...dummy, '--tp', '2', '--ep', '2']);
  try {
    for (const prompt of [[1, 2, 3, 4, 5], [40, 41]]) {
      const ask = (url) => client(url).completions.create({ model: 'config.json', prompt, max_tokens: 12,
                                                            temperature: 0, ignore_eos: true, return_token_ids: true });
      const [a, b] = await Promise.all([ask(ranks.url), ask(single.url)]);
      assert.deepEqual(a.choices[0].token_ids, b.choices[0].token_ids);
      assert.equal(a.choices[0].token_ids.length, 12);
    }
  } finally {
    assert.equal(await ranks.stop(), 0, ranks.stderr().slice(-2000));
    assert.equal(await single.stop(), 0);
  }
});

test('kill -9 of a follower: requests fail with an error, none hangs; the leader reports itself unhealthy', async () => {
  const server = await startProcess('serve', [...base, '--tp', '2', '--ep', '2']);
  try {
    assert.deepEqual(await ids(server.url, prompts[1], 8), await ids(oracle.url, prompts[1], 8));
    const victim = followerPids(server)[0];
    process.kill(victim, 'SIGKILL');
    // Dead before the next step: the leader learns it from the plan socket at
    // once. (A rank lost inside a step: the next test.)
    assert.ok(await waitFor(() => gone(victim), 10000));
    const started = Date.now();
    const results = await Promise.allSettled(prompts.map((p) => ids(server.url, p, 64)));
    assert.ok(results.every((r) => r.status === 'rejected'), 'no request completes without a rank');
    for (const r of results) assert.match(String(r.reason?.message ?? r.reason), /rank|engine|unavailable|503|500/i);
    assert.ok(Date.now() - started < 20000, 'the failure is prompt (seconds, not a timeout)');
    const health = await fetch(`${server.url}/health`);
    assert.notEqual(health.status, 200);
  } finally {
    await server.stop();
  }
});

// Killed while the ranks are stepping: the leader, waiting for it in a
// collective, sees its process gone within milliseconds (not at the
// communicator's 30 s deadline) and ends the stream with an error.
test('kill -9 of a follower while a request decodes: its stream ends with an error at once', async () => {
  const server = await startProcess('serve', [...base, '--tp', '2', '--ep', '2']);
  try {
    const victim = followerPids(server)[0];
    const stream = await client(server.url).completions.create({ model: 'moeserve-demo', prompt: prompts[2],
                                                                 max_tokens: 1000, ignore_eos: true, stream: true });
    let tokens = 0, killedAt = 0, error = null;
    try {
      for await (const chunk of stream) {
        tokens += chunk.choices.length;
        if (tokens === 4) { process.kill(victim, 'SIGKILL'); killedAt = Date.now(); }
      }
    } catch (e) { error = e; }
    assert.ok(killedAt > 0, 'the request was decoding when the rank was killed');
    assert.ok(error !== null || tokens < 1000, 'the stream did not complete');
    assert.ok(Date.now() - killedAt < 10000, `the stream ended ${Date.now() - killedAt} ms after the kill`);
    assert.match(server.stderr(), /rank|exited|gone/);
    const health = await fetch(`${server.url}/health`);
    assert.notEqual(health.status, 200);
  } finally {
    await server.stop();
  }
});

test('kill -9 of the leader: the followers exit on their own', async () => {
  const server = await startProcess('serve', [...base, '--tp', '2', '--ep', '2']);
  const pids = followerPids(server);
  assert.equal(pids.length, 1);
  await server.kill9();
  assert.ok(await waitFor(() => pids.every((p) => !alive(p)), 10000), 'no orphaned rank');
});

test('bad parallel flags are refused with a reason', async () => {
  for (const [flags, message] of [[['--tp', '3'], /attention heads do not split/],
                                  [['--tp', '2', '--ep', '4'], /must be equal/],
                                  [['--ep', '3'], /experts do not split/]]) {
    await assert.rejects(startProcess('serve', [...base, ...flags], { timeoutMs: 30000 }), message);
  }
});

test('decode --dp 2 --ep 2 behind the router: both ranks serve, outputs equal the single-rank server', async () => {
  const router = await startProcess('router', ['--request-timeout', '120']);
  const prefill = await startProcess('prefill', [...base, '--router', router.url]);
  const decode = await startProcess('decode', [...base, '--dp', '2', '--ep', '2', '--router', router.url]);
  try {
    const pids = followerPids(decode);
    assert.equal(pids.length, 1);
    assert.ok(await waitFor(async () => (await routerInstances(router.url)).decode.length === 2 &&
                            Object.values((await routerInstances(router.url)).healthy).every((h) => h), 60000),
              'both data-parallel ranks registered as decode endpoints');
    const many = [...prompts, ...prompts.map((p) => `${p} again`)];
    const got = await Promise.all(many.map((p) => ids(router.url, p)));
    const want = await Promise.all(many.map((p) => ids(oracle.url, p)));
    assert.deepEqual(got, want);
    // Both ranks decoded some of them (the router spreads by load).
    const served = await Promise.all((await routerInstances(router.url)).decode.map(
      async (u) => (await scrape(u))['moeserve:generation_tokens_total'] ?? 0));
    assert.ok(served.every((n) => n > 0), `tokens per rank: ${served}`);
    assert.equal(await decode.stop(), 0, decode.stderr().slice(-2000));
    assert.ok(await waitFor(() => pids.every((p) => !alive(p)), 15000), 'the follower rank stopped with the leader');
  } finally {
    for (const p of [decode, prefill, router]) await p.stop();
  }
});

test('bad --dp flags are refused with a reason', async () => {
  await assert.rejects(startProcess('serve', [...base, '--dp', '2', '--ep', '2'], { timeoutMs: 30000 }), /--router URL/);
  await assert.rejects(startProcess('decode', [...base, '--dp', '2', '--router', 'http://127.0.0.1:1'], { timeoutMs: 30000 }),
                       /needs --ep 2/);
});

for (const flags of [['--tp', '2', '--ep', '2'], ['--tp', '4'], ['--ep', '2']]) {
  test(`prefill ${flags.join(' ')} behind the router: every rank's KV heads reach the decode instance`, async () => {
    const router = await startProcess('router', ['--request-timeout', '120']);
    const prefill = await startProcess('prefill', [...base, ...flags, '--max-num-batched-tokens', '16',
                                                   '--router', router.url]);
    const decode = await startProcess('decode', [...base, '--router', router.url]);
    try {
      assert.ok(await waitFor(async () => {
        const r = await routerInstances(router.url);
        return r.prefill.length === 1 && r.decode.length === 1 && Object.values(r.healthy).every((h) => h);
      }, 60000), 'registered');
      // Long enough prompts for chunked prefill (the KV goes out with the last chunk).
      const long = prompts.map((p) => `${p} ${'cookie wisdom money time '.repeat(6)}`);
      const got = await Promise.all(long.map((p) => ids(router.url, p)));
      const want = await Promise.all(long.map((p) => ids(oracle.url, p)));
      assert.deepEqual(got, want);
    } finally {
      for (const p of [prefill, decode, router]) assert.equal(await p.stop(), 0, p.stderr().slice(-1500));
    }
  });
}

test('serve --tp 2 --ep 2 with MTP speculation: the single-rank greedy output, drafts verified', async () => {
  const server = await startProcess('serve', [...base, '--tp', '2', '--ep', '2', '--speculative-config',
                                              '{"method":"mtp","num_speculative_tokens":2}',
                                              '--speculative-model', `${modelsDir}/moeserve-demo-mtp`]);
  try {
    const got = await Promise.all(prompts.map((p) => ids(server.url, p)));
    const want = await Promise.all(prompts.map((p) => ids(oracle.url, p)));
    assert.deepEqual(got, want);
    const m = await scrape(server.url);
    assert.ok(m['moeserve:spec_decode_num_draft_tokens_total'] > 0, 'drafts were made and verified');
    assert.ok(m['moeserve:spec_decode_num_accepted_tokens_total'] > 0, 'some were accepted');
  } finally {
    assert.equal(await server.stop(), 0, server.stderr().slice(-2000));
  }
});
