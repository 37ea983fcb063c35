// The bundled demo model (models/moeserve-demo, tools/train_tiny.py) served
// with no --model, through the official `openai` client: chat rendered with
// the model's real ChatML template and text prompts give transformers' greedy
// ids (golden.json), batches of text prompts with echo, streaming equals
// non-streaming, stop strings (and min_tokens holding them off), logprobs,
// the API key, and 503 + Retry-After when the queue is full.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import OpenAI from 'openai';
import { startServer, repoRoot, metrics, waitFor } from './server_harness.mjs';

const golden = JSON.parse(fs.readFileSync(path.join(repoRoot, 'models/moeserve-demo/golden.json')));
const model = 'moeserve-demo';
let server;
let client;

before(async () => {
  server = await startServer(['--max-model-len', '512']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => { assert.equal(await server.stop(), 0); });

test('chat through the real template: greedy ids equal transformers', async () => {
  const results = await Promise.all(golden.chats.map((c) => client.chat.completions.create({
    model, messages: c.messages, temperature: 0, max_tokens: golden.n_greedy, ignore_eos: true, return_token_ids: true })));
  results.forEach((r, i) => {
    assert.deepEqual(r.choices[0].prompt_token_ids, golden.chats[i].ids, `chat ${i} prompt`);
    assert.deepEqual(r.choices[0].token_ids, golden.chats[i].greedy, `chat ${i}`);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(r.object, 'chat.completion');
  });
});

test('text prompts: tokenization and greedy ids equal transformers', async () => {
  for (const t of golden.texts) {
    const tok = await (await fetch(`${server.url}/tokenize`, { method: 'POST', body: JSON.stringify({ prompt: t.text }) })).json();
    assert.deepEqual(tok.tokens, t.ids);
    const r = await client.completions.create({ model, prompt: t.text, temperature: 0, max_tokens: golden.n_greedy,
                                                ignore_eos: true, return_token_ids: true });
    assert.deepEqual(r.choices[0].token_ids, t.greedy);
    const detok = await (await fetch(`${server.url}/detokenize`, { method: 'POST', body: JSON.stringify({ tokens: t.greedy }) })).json();
    assert.equal(detok.prompt, t.greedy_text);
  }
});

test('a batch of text prompts with echo: each choice is the prompt then its greedy text, streaming or not', async () => {
  const texts = golden.texts.slice(0, 3);
  const params = { model, prompt: texts.map((t) => t.text), temperature: 0, max_tokens: golden.n_greedy,
                   ignore_eos: true, echo: true, logprobs: 1 };
  const r = await client.completions.create(params);
  assert.equal(r.choices.length, texts.length);
  const alone = await Promise.all(texts.map((t) => client.completions.create({ ...params, prompt: t.text, echo: false })));
  texts.forEach((t, i) => {
    assert.equal(r.choices[i].text, t.text + alone[i].choices[0].text, `prompt ${i}`);
    // The echoed prompt's tokens lead the logprobs (offsets from 0), then the generated ones after the echo.
    const lp = r.choices[i].logprobs;
    assert.equal(lp.tokens.length, t.ids.length + golden.n_greedy);
    assert.equal(lp.tokens.slice(0, t.ids.length).join(''), t.text);
    assert.equal(lp.text_offset[0], 0);
    assert.equal(lp.token_logprobs[0], null);
    assert.equal(lp.text_offset[t.ids.length], t.text.length);
    assert.deepEqual(lp.token_logprobs.slice(t.ids.length), alone[i].choices[0].logprobs.token_logprobs);
  });
  const stream = await client.completions.create({ ...params, stream: true });
  const streamed = texts.map(() => '');
  const offsets = texts.map(() => []);
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      streamed[c.index] += c.text;
      if (c.logprobs) offsets[c.index].push(...c.logprobs.text_offset);
    }
  }
  texts.forEach((t, i) => {
    assert.equal(streamed[i], r.choices[i].text, `streamed prompt ${i}`);
    assert.deepEqual(offsets[i], r.choices[i].logprobs.text_offset, `streamed offsets ${i}`);
  });
});

test('streamed chat equals the same chat not streamed, with usage', async () => {
  const c = golden.chats[2];
  const full = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 40 });
  const stream = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 40,
                                                        stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.delta.content ?? '';
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(text, full.choices[0].message.content);
  assert.equal(finish, full.choices[0].finish_reason);
  assert.deepEqual(usage, full.usage);
  assert.ok(/[a-z]+ [a-z]+/.test(text), `recognisable English: ${text}`);
});

test('stop strings cut the text, streaming or not', async () => {
  const c = golden.chats[0];  // "The most important service rendered by the press ..."
  const key = (reason) => `moeserve:request_success_total{${reason}}`;
  const before = await metrics(server.url);
  const r = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 32, stop: ['press'] });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(r.choices[0].message.content, 'The most important service rendered by the ');
  const stream = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 32,
                                                        stop: ['xyz', 'rendered by'], stream: true });
  let text = '';
  for await (const chunk of stream) for (const ch of chunk.choices) text += ch.delta.content ?? '';
  assert.equal(text, 'The most important service ');
  // vLLM's include_stop_str_in_output keeps the stop string, streamed or not.
  for (const streamed of [false, true]) {
    const kept = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 32,
                                                        stop: ['xyz', 'rendered by'], include_stop_str_in_output: true,
                                                        stream: streamed });
    let keptText = '';
    if (streamed) for await (const chunk of kept) for (const ch of chunk.choices) keptText += ch.delta.content ?? '';
    else keptText = kept.choices[0].message.content;
    assert.equal(keptText, 'The most important service rendered by', `stream ${streamed}`);
  }
  // The metrics count the four as ended by a stop, not as aborted (the engine ends them when cut).
  const counted = await waitFor(async () => {
    const m = await metrics(server.url);
    return (m[key('stop')] ?? 0) === (before[key('stop')] ?? 0) + 4;
  });
  const after = await metrics(server.url);
  assert.ok(counted, `stop ${before[key('stop')] ?? 0} -> ${after[key('stop')] ?? 0}`);
  assert.equal(after[key('abort')] ?? 0, before[key('abort')] ?? 0);
});

test('no stop string ends within the first min_tokens tokens (as vLLM)', async () => {
  const c = golden.chats[0];  // "The most important service rendered by the press ..."
  const ask = (extra) => client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 32,
                                                         stop: ['The', 'press'], ...extra });
  const early = await ask({});
  assert.equal(early.choices[0].message.content, '');
  assert.equal(early.choices[0].finish_reason, 'stop');
  for (const stream of [false, true]) {
    const r = await ask({ min_tokens: 4, stream });
    let text = '';
    if (stream) {
      for await (const chunk of r) for (const ch of chunk.choices) text += ch.delta.content ?? '';
    } else {
      text = r.choices[0].message.content;
    }
    assert.equal(text, 'The most important service rendered by the ', `stream ${stream}`);
  }
});

test('chat with prompt_logprobs: one entry per prompt token of the rendered template', async () => {
  const c = golden.chats[1];
  const r = await client.chat.completions.create({ model, messages: c.messages, temperature: 0, max_tokens: 2,
                                                   prompt_logprobs: 1, return_token_ids: true });
  assert.equal(r.prompt_logprobs.length, c.ids.length);
  assert.equal(r.prompt_logprobs[0], null);
  r.prompt_logprobs.slice(1).forEach((entry, i) => {
    const token = entry[c.ids[i + 1]];
    assert.ok(token.logprob <= 0 && token.rank >= 1, `position ${i + 1}`);
    assert.equal(typeof token.decoded_token, 'string');
    assert.ok(Object.values(entry).some((e) => e.rank === 1));
  });
});

test('text_offset counts characters; chat logprobs carry each token\'s own bytes (non-ASCII text)', async () => {
  // Accented letters split into two byte-tokens each here: their offsets stay at the character, never go back.
  const r = await client.completions.create({ model, prompt: 'café naïve résumé', max_tokens: 8, temperature: 0,
                                              ignore_eos: true, echo: true, logprobs: 0 });
  const { text, logprobs: lp } = r.choices[0];
  const chars = Array.from(text);
  lp.text_offset.forEach((o, i) => {
    if (i > 0) assert.ok(o >= lp.text_offset[i - 1], `offsets ${lp.text_offset}`);
    const t = lp.tokens[i];
    if (!t.includes('\uFFFD') && text.includes(t))
      assert.equal(chars.slice(o, o + Array.from(t).length).join(''), t, `token ${i} ${JSON.stringify(t)} at ${o}`);
  });
  assert.equal(lp.text_offset[0], 0);
  assert.ok(lp.tokens.some((t) => t.includes('\uFFFD')), 'the prompt has tokens that split a character');
  const chat = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'café naïve résumé' }],
                                                      temperature: 0, max_tokens: 8, logprobs: true,
                                                      logit_bias: { 130: 100 } });  // a lone UTF-8 lead byte
  for (const e of chat.choices[0].logprobs.content) {
    assert.ok(e.bytes.length > 0);
    if (e.token.includes('\uFFFD')) assert.notDeepEqual(e.bytes, [0xEF, 0xBF, 0xBD], 'raw bytes, not U+FFFD');
    else assert.equal(Buffer.from(e.bytes).toString('utf8'), e.token);
  }
});

test('chat logprobs: one entry per token, the top alternative first', async () => {
  const r = await client.chat.completions.create({ model, messages: golden.chats[1].messages, temperature: 0, max_tokens: 6,
                                                   logprobs: true, top_logprobs: 3 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  for (const e of content) {
    assert.equal(e.top_logprobs.length, 3);
    assert.equal(e.top_logprobs[0].token, e.token);  // greedy
    assert.ok(e.logprob <= 0 && e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob);
  }
});

test('an API key is required when set', async () => {
  const keyed = await startServer(['--api-key', 'sekret', '--max-model-len', '256']);
  try {
    const bad = new OpenAI({ baseURL: `${keyed.url}/v1`, apiKey: 'wrong', maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
    const good = new OpenAI({ baseURL: `${keyed.url}/v1`, apiKey: 'sekret', maxRetries: 0 });
    const r = await good.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 3 });
    assert.ok(r.choices.length === 1);
    assert.equal((await fetch(`${keyed.url}/health`)).status, 200);  // health needs no key
    // The scheme is case-insensitive (RFC 9110), the key is not.
    const models = (auth) => fetch(`${keyed.url}/v1/models`, { headers: { Authorization: auth } });
    assert.equal((await models('bearer sekret')).status, 200);
    assert.equal((await models('BEARER sekret')).status, 200);
    assert.equal((await models('Bearer SEKRET')).status, 401);
    assert.equal((await models('Bearer sekret2')).status, 401);
  } finally {
    assert.equal(await keyed.stop(), 0);
  }
});

test('a full queue answers 503 with Retry-After, and the rest complete', async () => {
  const busy = await startServer(['--max-num-seqs', '1', '--max-waiting', '2', '--max-model-len', '256']);
  try {
    const c = new OpenAI({ baseURL: `${busy.url}/v1`, apiKey: 'x', maxRetries: 0 });
    const results = await Promise.allSettled(Array.from({ length: 12 }, () => c.completions.create({
      model, prompt: 'The', max_tokens: 100, ignore_eos: true }).withResponse()));
    const refused = results.filter((r) => r.status === 'rejected');
    const served = results.filter((r) => r.status === 'fulfilled');
    assert.ok(refused.length > 0 && served.length > 0, `${refused.length} refused, ${served.length} served`);
    for (const r of refused) {
      assert.equal(r.reason.status, 503);
      assert.equal(r.reason.headers.get('retry-after'), '1');
    }
    for (const r of served) assert.equal(r.value.data.choices[0].finish_reason, 'length');
    // A request with more choices than the queue holds could never be admitted: 400, not 503.
    await assert.rejects(c.completions.create({ model, prompt: 'The', max_tokens: 2, n: 3 }),
                         (e) => e instanceof OpenAI.BadRequestError && e.error?.param === 'n');
  } finally {
    assert.equal(await busy.stop(), 0);
  }
});
