// Disaggregated serving (docs/disagg.md) against its oracle, colocated
// `serve`: 100 greedy requests (chat and completions, streaming and not, long
// prompts prefilled in chunks, stop strings, n = 2, structured outputs, one
// schema with its properties out of alphabetical order, which the output
// follows on both instances) at concurrency 16 through
// the real `openai` client give the same text, token ids, finish reasons and
// usage through `serve --disagg` with 1x1 and 2x2 instances; afterwards every
// instance is back at its KV baseline. The golden model moe_basic through
// `serve --disagg` gives transformers' greedy tokens, with and without
// penalties / logit_bias / min_tokens.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import OpenAI from 'openai';
import { repoRoot } from './server_harness.mjs';
import { startProcess, routerInstances, atBaseline, waitFor, runPool, rng, scrape } from './disagg_harness.mjs';

const engineFlags = ['--kv-cache-gb', '0.05', '--threads', '1', '--max-num-batched-tokens', '64', '--max-num-seqs', '32'];
const words = ('the a fortune cookie says you will find great love and wisdom in unexpected places today ' +
               'never trust a computer you cannot throw out of a window money is the root of all evil ' +
               'life is what happens while you are busy making other plans').split(' ');

const fortuneSchema = {
  type: 'object',
  properties: { z: { type: 'string', maxLength: 12 }, a: { enum: [1, 2, 3] }, ok: { type: 'boolean' } },
  required: ['z', 'a'],
};

function makeRequests() {
  const next = rng(20261130);
  const out = [];
  for (let i = 0; i < 100; i++) {
    const n = 3 + Math.floor(next() * (i % 5 === 0 ? 300 : 40));  // every fifth prompt is long (chunked prefill)
    const text = Array.from({ length: n }, () => words[Math.floor(next() * words.length)]).join(' ');
    const kind = i % 4;
    const req = { max_tokens: 4 + ((i * 7) % 33), temperature: 0 };
    if (i % 3 === 0) req.ignore_eos = true;
    if (i % 7 === 0) req.stop = ['\n\n', ' love'];
    if (i % 10 === 5 && kind === 0) req.n = 2;
    if (i === 17) req.max_tokens = 1;
    if (kind <= 1) req.messages = [{ role: 'user', content: text }];
    else { req.prompt = text; req.return_token_ids = true; }
    if (i % 9 === 4) {  // structured outputs: the grammar travels to both instances
      if (kind <= 1 && i % 2 === 0) req.response_format = { type: 'json_object' };
      else if (kind <= 1) req.response_format = { type: 'json_schema', json_schema: { name: 'f', schema: fortuneSchema } };
      else req.guided_choice = ['yes', 'no', 'a fortune cookie'];
    }
    if (i % 11 === 3) req.bad_words = ['the', 'you will'];  // vLLM's sampling restrictions travel too
    if (i % 13 === 6 && i % 9 !== 4) req.allowed_token_ids = Array.from({ length: 1300 }, (_, t) => 3 * t + (i % 3));
    req.stream = kind % 2 === 1;
    if (req.stream) req.stream_options = { include_usage: true };
    out.push(req);
  }
  return out;
}

async function run(client, req) {
  const chat = !!req.messages;
  const api = chat ? client.chat.completions : client.completions;
  const params = { model: 'moeserve-demo', ...req };
  if (!req.stream) {
    const r = await api.create(params);
    return {
      choices: r.choices.map((c) => ({ text: chat ? c.message.content : c.text, finish: c.finish_reason,
                                       ids: c.token_ids ?? null })),
      usage: r.usage.completion_tokens, prompt: r.usage.prompt_tokens,
    };
  }
  const stream = await api.create(params);
  const choices = [];
  let usage = null, prompt = null;
  for await (const chunk of stream) {
    if (chunk.usage) { usage = chunk.usage.completion_tokens; prompt = chunk.usage.prompt_tokens; }
    for (const c of chunk.choices) {
      const slot = choices[c.index] ??= { text: '', finish: null, ids: null };
      slot.text += chat ? (c.delta.content ?? '') : c.text;
      if (c.token_ids) slot.ids = [...(slot.ids ?? []), ...c.token_ids];  // each chunk's new ids
      if (c.finish_reason) slot.finish = c.finish_reason;
    }
  }
  return { choices, usage, prompt };
}

const requests = makeRequests();
let oracle;
let oracleResults;

before(async () => {
  oracle = await startProcess('serve', engineFlags);
  const client = new OpenAI({ baseURL: `${oracle.url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120000 });
  oracleResults = await runPool(requests, 16, (r) => run(client, r));
  for (const [i, r] of oracleResults.entries()) assert.ok(r.ok, `oracle request ${i}: ${r.error}`);
});
after(async () => { assert.equal(await oracle.stop(), 0); });

async function checkCluster(numPrefill, numDecode, extraFlags = []) {
  const cluster = await startProcess('serve', ['--disagg', '--prefill-instances', String(numPrefill),
                                               '--decode-instances', String(numDecode), ...engineFlags, ...extraFlags]);
  let instances = [];
  try {
    const client = new OpenAI({ baseURL: `${cluster.url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120000 });
    const results = await runPool(requests, 16, (r) => run(client, r));
    let stopped = 0;
    results.forEach((r, i) => {
      assert.ok(r.ok, `request ${i}: ${r.error}`);
      assert.deepEqual(r.value, oracleResults[i].value, `request ${i} (${JSON.stringify(requests[i]).slice(0, 120)})`);
      stopped += r.value.choices.filter((c) => c.finish === 'stop').length;
    });
    assert.ok(stopped > 0 && stopped < results.length, 'both stop and length finishes are covered');
    const inst = await routerInstances(cluster.url);
    instances = [...inst.prefill, ...inst.decode];
    assert.equal(inst.prefill.length, numPrefill);
    assert.equal(inst.decode.length, numDecode);
    assert.ok(await waitFor(() => atBaseline([...inst.prefill, ...inst.decode]), 10000), 'KV usage back at baseline');
    // No request was cancelled: the stop strings' cuts end on the decode instances as stop, not abort.
    for (const url of inst.decode) {
      const m = await scrape(url);
      assert.equal(m['moeserve:request_success_total{finished_reason="abort"}'], 0, `${url} counted aborts`);
      assert.ok(m['moeserve:request_success_total{finished_reason="stop"}'] > 0, `${url} counted no stop`);
    }
  } finally {
    assert.equal(await cluster.stop(), 0);
  }
  // SIGTERM stopped every child too: no instance answers any more.
  for (const url of instances) await assert.rejects(fetch(`${url}/health`), `${url} is gone`);
}

test('serve --disagg 1x1: 100 greedy requests at concurrency 16 equal colocated serve', async () => {
  await checkCluster(1, 1);
});

test('serve --disagg 2x2: 100 greedy requests at concurrency 16 equal colocated serve', async () => {
  await checkCluster(2, 2);
});

test('serve --disagg --tp 2 --ep 2: prefill instances of two ranks, the same output as colocated serve', async () => {
  await checkCluster(1, 1, ['--tp', '2', '--ep', '2']);
});

test('router --model takes a config.json as the instances do with dummy weights, and its max_model_len', async () => {
  const config = path.join(repoRoot, 'tests/data/configs/qwen3-235b-a22b.config.json');
  const router = await startProcess('router', ['--model', config]);
  try {
    const models = await (await fetch(`${router.url}/v1/models`)).json();
    assert.deepEqual(models.data.map((m) => m.id), ['qwen3-235b-a22b.config.json']);
    // The model's whole context, as GPU instances default to (CPU ones: at most 4096).
    assert.equal(models.data[0].max_model_len, 40960);
  } finally {
    assert.equal(await router.stop(), 0);
  }
});

test('serve --disagg --dp is refused with where data-parallel decode ranks run', async () => {
  await assert.rejects(startProcess('serve', ['--disagg', '--dp', '2', '--ep', '2', ...engineFlags], { timeoutMs: 30000 }),
                       /single-rank decode instances.*moeserve decode --dp N --ep N --router URL/s);
});

test('serve --disagg on the golden model moe_basic gives transformers greedy tokens', async () => {
  const dir = path.join(repoRoot, 'tests/data/golden/moe_basic');
  const golden = JSON.parse(fs.readFileSync(path.join(dir, 'golden.json')));
  const cluster = await startProcess('serve', ['--disagg', '--model', dir, '--max-model-len', '256', '--page-size', '4',
                                               '--max-num-batched-tokens', '8', '--kv-cache-gb', '0.01', '--threads', '1']);
  try {
    const client = new OpenAI({ baseURL: `${cluster.url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 60000 });
    const results = await Promise.all(golden.prompts.map((p) => client.completions.create({
      model: 'moe_basic', prompt: p.ids, max_tokens: 24, temperature: 0, ignore_eos: true, return_token_ids: true })));
    results.forEach((r, i) => assert.deepEqual(r.choices[0].token_ids, golden.prompts[i].greedy, `prompt ${i}`));
    // The logits adjustments reach both instances: the prefill instance
    // samples the first token, the decode instance the rest.
    const penalties = JSON.parse(fs.readFileSync(path.join(dir, 'penalties.json')));
    const adjusted = await Promise.all(penalties.cases.map((c) => client.completions.create({
      model: 'moe_basic', prompt: golden.prompts[c.prompt_index].ids, max_tokens: penalties.n_greedy, temperature: 0,
      return_token_ids: true, ...c.params })));
    adjusted.forEach((r, i) => assert.deepEqual(r.choices[0].token_ids, penalties.cases[i].greedy,
                                                `${penalties.cases[i].name} prompt ${penalties.cases[i].prompt_index}`));
    // Prompt logprobs come from the prefill instance with the first token
    // (echo + logprobs, lm-eval's loglikelihood request; and vLLM's
    // prompt_logprobs): transformers' log-softmax at every prompt position.
    const all = golden.all_positions;
    const ids = golden.prompts[all.prompt_index].ids;
    const echoed = await client.completions.create({ model: 'moe_basic', prompt: ids, max_tokens: 2, temperature: 0,
                                                     echo: true, logprobs: 1, prompt_logprobs: 1 });
    const lp = echoed.choices[0].logprobs;
    assert.equal(lp.tokens.length, ids.length + 2);
    assert.equal(lp.token_logprobs[0], null);
    const pl = echoed.choices[0].prompt_logprobs;
    for (let p = 0; p + 1 < ids.length; p++) {
      const row = all.logits[p];
      const max = Math.max(...row);
      const logZ = Math.log(row.reduce((acc, x) => acc + Math.exp(x - max), 0)) + max;
      assert.ok(Math.abs(lp.token_logprobs[p + 1] - (row[ids[p + 1]] - logZ)) < 2e-3, `position ${p + 1}`);
      const rank = 1 + row.filter((x, i) => x > row[ids[p + 1]] || (x === row[ids[p + 1]] && i < ids[p + 1])).length;
      assert.equal(pl[p + 1][ids[p + 1]].rank, rank, `position ${p + 1}`);
    }
    assert.deepEqual(lp.tokens.slice(ids.length), golden.prompts[all.prompt_index].greedy.slice(0, 2).map((t) => `token_id:${t}`));
  } finally {
    assert.equal(await cluster.stop(), 0);
  }
});
