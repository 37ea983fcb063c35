// Speculative decoding in disaggregated serving (docs/speculative.md,
// docs/disagg.md) through the official `openai` client. Oracle: colocated
// `serve` without speculation; greedy outputs (text, token ids, finish
// reasons, completion tokens) must be identical.
// - `serve --disagg` with an MTP layer, k = 1..4: the decode instance drafts
//   from the state the prefill instance sends (usage.speculative, the decode
//   instance's spec_decode metrics, drafts accepted on the demo's trained MTP
//   layer; one request at a time, the same drafts and accepted drafts as
//   colocated `serve` with the same k); a logprobs request drafts and its
//   logprobs (token, value, top 2) equal the oracle's; max_tokens 1 and
//   eos-first requests decode without drafts; every instance back at its KV
//   baseline.
// - `moeserve prefill` + `moeserve decode --router URL`, also with the MTP
//   layer on one side only (plain decoding, counted on the decode side),
//   `prefill --tp 2 --ep 2` and `decode --dp 2 --ep 2` with speculation.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { startProcess, routerInstances, atBaseline, waitFor, runPool, scrape } from './disagg_harness.mjs';

const modelsDir = fileURLToPath(new URL('../../models', import.meta.url));
const engineFlags = ['--kv-cache-gb', '0.05', '--threads', '1', '--max-num-batched-tokens', '32', '--max-num-seqs', '16'];
const speculate = (k) => ['--speculative-config', JSON.stringify({ method: 'mtp', num_speculative_tokens: k }),
                          '--speculative-model', `${modelsDir}/moeserve-demo-mtp`];
const client = (url) => new OpenAI({ baseURL: `${url}/v1`, apiKey: 'x', maxRetries: 0, timeout: 120000 });

const texts = ['Tell me a fortune.', 'Give me a quote about science.', 'A computer', 'Money and time',
               'The sea is', `Love is a window ${'cookie wisdom money time '.repeat(12)}`];

// Chat and completions, streaming or not; one with logprobs, one with max_tokens 1, one with a stop string.
function makeRequests() {
  const out = texts.map((text, i) => {
    const req = { max_tokens: 24 + 3 * i, temperature: 0, ignore_eos: i % 2 === 0 };
    if (i % 2 === 0) req.messages = [{ role: 'user', content: text }];
    else { req.prompt = text; req.return_token_ids = true; }
    req.stream = i % 3 === 1;
    if (req.stream) req.stream_options = { include_usage: true };
    return req;
  });
  out.push({ prompt: texts[0], max_tokens: 12, temperature: 0, logprobs: 2, ignore_eos: true, return_token_ids: true });
  out.push({ prompt: texts[1], max_tokens: 1, temperature: 0, return_token_ids: true });
  out.push({ messages: [{ role: 'user', content: texts[0] }], max_tokens: 30, temperature: 0, stop: [' you'] });
  return out;
}
const requests = makeRequests();
const logprobsIndex = requests.length - 3;

async function run(c, req) {
  const chat = !!req.messages;
  const api = chat ? c.chat.completions : c.completions;
  const params = { model: 'moeserve-demo', ...req };
  if (!req.stream) {
    const r = await api.create(params);
    const ch = r.choices[0];
    return { text: chat ? ch.message.content : ch.text, finish: ch.finish_reason, ids: ch.token_ids ?? null,
             tokens: r.usage.completion_tokens, speculative: r.usage.speculative ?? null,
             logprobs: ch.logprobs ?? null };
  }
  const out = { text: '', finish: null, ids: null, tokens: null, speculative: null, logprobs: null };
  for await (const chunk of await api.create(params)) {
    if (chunk.usage) { out.tokens = chunk.usage.completion_tokens; out.speculative = chunk.usage.speculative ?? null; }
    for (const ch of chunk.choices) {
      out.text += chat ? (ch.delta.content ?? '') : ch.text;
      if (ch.token_ids) out.ids = [...(out.ids ?? []), ...ch.token_ids];
      if (ch.finish_reason) out.finish = ch.finish_reason;
    }
  }
  return out;
}

// Completions logprobs against the oracle's: the same tokens and top-2 tokens,
// values within float noise (a draft's row is the position's own logits).
function sameLogprobs(got, want, what) {
  if (want === null) return assert.equal(got, null, what);
  assert.deepEqual(got.tokens, want.tokens, `${what}: logprobs tokens`);
  assert.equal(got.token_logprobs.length, want.token_logprobs.length);
  got.token_logprobs.forEach((v, t) => assert.ok(Math.abs(v - want.token_logprobs[t]) < 1e-4,
                                                 `${what}: token ${t} logprob ${v} vs ${want.token_logprobs[t]}`));
  got.top_logprobs.forEach((top, t) => {
    assert.deepEqual(Object.keys(top), Object.keys(want.top_logprobs[t]), `${what}: token ${t} top logprobs`);
    for (const [tok, v] of Object.entries(top)) assert.ok(Math.abs(v - want.top_logprobs[t][tok]) < 1e-4);
  });
}

// Every request through `url`, compared with the oracle's; returns the results.
async function checkAgainstOracle(url, what) {
  const results = await runPool(requests, 4, (r) => run(client(url), r));
  results.forEach((r, i) => {
    assert.ok(r.ok, `${what}: request ${i}: ${r.error}`);
    const { speculative, logprobs, ...got } = r.value;
    const { speculative: none, logprobs: wantLogprobs, ...want } = oracle.results[i];
    assert.deepEqual(got, want, `${what}: request ${i} (${JSON.stringify(requests[i]).slice(0, 100)})`);
    assert.equal(none, null, 'the oracle does not speculate');
    sameLogprobs(logprobs, wantLogprobs, `${what}: request ${i}`);
  });
  return results.map((r) => r.value);
}

const sum = (urls, metric) => Promise.all(urls.map(async (u) => (await scrape(u))[metric] ?? 0))
  .then((v) => v.reduce((a, b) => a + b, 0));

let oracle;
before(async () => {
  const proc = await startProcess('serve', engineFlags);
  const results = await runPool(requests, 4, (r) => run(client(proc.url), r));
  results.forEach((r, i) => assert.ok(r.ok, `oracle request ${i}: ${r.error}`));
  oracle = { proc, results: results.map((r) => r.value) };
});
after(async () => { assert.equal(await oracle.proc.stop(), 0); });

for (const k of [1, 2, 3, 4]) {
  test(`serve --disagg with MTP k=${k}: plain greedy output, the decode instance drafts`, async () => {
    const cluster = await startProcess('serve', ['--disagg', ...engineFlags, ...speculate(k)]);
    try {
      const got = await checkAgainstOracle(cluster.url, `k=${k}`);
      let drafts = 0, accepted = 0;
      got.forEach((r, i) => {
        // Drafts follow the first token unless the request ends there (max_tokens 1, or eos first:
        // request 1's prompt) or leaves no room for one. The logprobs request drafts too.
        const drafting = r.tokens >= 2 && requests[i].max_tokens >= 3;
        if (requests[i].stop) return;  // ended by the router at the stop string: either way
        if (!drafting) {
          assert.equal(r.speculative, null, `request ${i} decodes without drafts`);
          return;
        }
        assert.ok(r.speculative && r.speculative.draft_tokens > 0, `request ${i}: usage.speculative`);
        drafts += r.speculative.draft_tokens;
        accepted += r.speculative.accepted_tokens;
      });
      assert.equal(got[1].tokens, 1, 'request 1 ends at its first token (eos)');
      assert.ok(got[logprobsIndex].logprobs !== null && got[logprobsIndex].speculative?.draft_tokens > 0,
                'the logprobs request drafts, with its logprobs');
      // One at a time, the drafts and accepted drafts of each request equal colocated speculation's
      // (a lost or misplaced MTP layer or hidden state changes them, not the greedy tokens).
      const colocated = await startProcess('serve', [...engineFlags, ...speculate(k)]);
      try {
        const one = (url) => runPool(requests, 1, (r) => run(client(url), r));
        const [mine, theirs] = [await one(cluster.url), await one(colocated.url)];
        mine.forEach((r, i) => {
          assert.ok(r.ok && theirs[i].ok, `request ${i}`);
          if (!requests[i].stop) assert.deepEqual(r.value, theirs[i].value, `k=${k}: request ${i} as colocated`);
        });
      } finally {
        assert.equal(await colocated.stop(), 0);
      }
      assert.ok(accepted > 0, `the trained MTP layer's drafts are accepted (k=${k}: ${accepted} of ${drafts})`);
      const inst = await routerInstances(cluster.url);
      const stopped = got.filter((r, i) => requests[i].stop).map((r) => r.speculative ?? { draft_tokens: 0, accepted_tokens: 0 });
      const decoded = await sum(inst.decode, 'moeserve:spec_decode_num_draft_tokens_total');
      assert.ok(decoded >= drafts + stopped.reduce((a, r) => a + r.draft_tokens, 0), `${decoded} drafts verified`);
      assert.ok(await sum(inst.decode, 'moeserve:spec_decode_num_accepted_tokens_total') >= accepted);
      assert.equal(await sum(inst.decode, 'moeserve:disagg_commits_without_mtp_total'), 0);
      assert.equal(await sum(inst.prefill, 'moeserve:spec_decode_num_drafts_total'), 0, 'prefill never verifies');
      assert.ok(await waitFor(() => atBaseline([...inst.prefill, ...inst.decode]), 10000), 'KV usage back at baseline');
    } finally {
      assert.equal(await cluster.stop(), 0, cluster.stderr().slice(-2000));
    }
  });
}

// One prefill and one decode instance registered with a router; `prefillFlags`
// and `decodeFlags` add speculation on either side.
async function withInstances(prefillFlags, decodeFlags, fn) {
  const router = await startProcess('router', ['--request-timeout', '120']);
  const prefill = await startProcess('prefill', [...engineFlags, ...prefillFlags, '--router', router.url]);
  const decode = await startProcess('decode', [...engineFlags, ...decodeFlags, '--router', router.url]);
  try {
    const expected = decodeFlags.includes('--dp') ? 2 : 1;
    assert.ok(await waitFor(async () => {
      const r = await routerInstances(router.url);
      return r.prefill.length === 1 && r.decode.length === expected && Object.values(r.healthy).every((h) => h);
    }, 60000), 'registered');
    const inst = await routerInstances(router.url);
    await fn(router.url, inst);
    assert.ok(await waitFor(() => atBaseline([...inst.prefill, ...inst.decode]), 10000), 'KV usage back at baseline');
  } finally {
    for (const p of [decode, prefill, router]) assert.equal(await p.stop(), 0, p.stderr().slice(-2000));
  }
}

test('prefill + decode --router with MTP k=3: plain greedy output, drafts accepted', async () => {
  await withInstances(speculate(3), speculate(3), async (url, inst) => {
    const got = await checkAgainstOracle(url, 'prefill + decode');
    assert.ok(got.some((r) => r.speculative?.accepted_tokens > 0));
    assert.ok(await sum(inst.decode, 'moeserve:spec_decode_num_accepted_tokens_total') > 0);
  });
});

test('MTP on one side only: plain greedy output without drafts', async () => {
  // The decode instance advertises no MTP layer: the prefill instance sends none.
  await withInstances(speculate(2), [], async (url, inst) => {
    const got = await checkAgainstOracle(url, 'MTP on prefill only');
    assert.ok(got.every((r) => r.speculative === null));
    assert.equal(await sum(inst.decode, 'moeserve:spec_decode_num_draft_tokens_total'), 0);
  });
  // No MTP state comes with the commits: the decode instance counts them and decodes plainly.
  await withInstances([], speculate(2), async (url, inst) => {
    const got = await checkAgainstOracle(url, 'MTP on decode only');
    assert.ok(got.every((r) => r.speculative === null));
    assert.equal(await sum(inst.decode, 'moeserve:spec_decode_num_draft_tokens_total'), 0);
    assert.equal(await sum(inst.decode, 'moeserve:disagg_commits_without_mtp_total'), requests.length - 1,
                 'every commit of a request that could draft (not the max_tokens 1 one)');
  });
});

test('prefill --tp 2 --ep 2 with MTP (whole on the leader) + decode with MTP: plain greedy output, drafts accepted',
     async () => {
  await withInstances(['--tp', '2', '--ep', '2', ...speculate(2)], speculate(2), async (url, inst) => {
    const got = await checkAgainstOracle(url, 'prefill --tp 2');
    assert.ok(got.some((r) => r.speculative?.accepted_tokens > 0));
    assert.equal(await sum(inst.decode, 'moeserve:disagg_commits_without_mtp_total'), 0);
  });
});

test('decode --dp 2 --ep 2 with MTP k=2: plain greedy output, drafts accepted', async () => {
  await withInstances(speculate(2), ['--dp', '2', '--ep', '2', ...speculate(2)], async (url, inst) => {
    const got = await checkAgainstOracle(url, 'decode --dp 2');
    assert.ok(got.some((r) => r.speculative?.accepted_tokens > 0));
    assert.ok(await sum(inst.decode, 'moeserve:spec_decode_num_accepted_tokens_total') > 0);
  });
});
