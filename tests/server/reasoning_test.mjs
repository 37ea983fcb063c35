// --reasoning-parser qwen3 where the chat template opens the reasoning in the
// prompt, as Qwen3-*-Thinking-2507's and Qwen3.5's do ("<think>\n" after the
// assistant header; "<think>\n\n</think>\n\n" with enable_thinking false):
// the bundled demo model served with such a template, through the official
// `openai` client. The oracle is the same prompt sent as token ids to
// /v1/completions: its greedy text split at the first "</think>".
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';
import { startServer, repoRoot } from './server_harness.mjs';

const model = 'moeserve-demo';
const messages = [{ role: 'user', content: 'What is the most important service rendered by the press?' }];
let server;
let client;
let dir;

before(async () => {
  const demo = path.join(repoRoot, 'models/moeserve-demo');
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'moeserve-thinking-'));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json'])
    fs.symlinkSync(path.join(demo, f), path.join(dir, f));
  const config = JSON.parse(fs.readFileSync(path.join(demo, 'tokenizer_config.json')));
  const header = "{{- '<|im_start|>assistant\\n' }}";
  assert.ok(config.chat_template.includes(header));
  config.chat_template = config.chat_template.replace(header, header +
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}" +
    "{%- else %}{{- '<think>\\n' }}{%- endif %}");
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  server = await startServer(['--model', dir, '--served-model-name', model, '--max-model-len', '512',
                              '--reasoning-parser', 'qwen3']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => {
  assert.equal(await server.stop(), 0);
  fs.rmSync(dir, { recursive: true, force: true });
});

// The chat's rendered prompt and the greedy text of that prompt sent as ids.
async function oracle(extra) {
  const chat = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 1,
                                                      return_token_ids: true, ...extra });
  const ids = chat.choices[0].prompt_token_ids;
  const prompt = (await (await fetch(`${server.url}/detokenize`,
                                     { method: 'POST', body: JSON.stringify({ tokens: ids }) })).json()).prompt;
  const r = await client.completions.create({ model, prompt: ids, temperature: 0, max_tokens: 24, ignore_eos: true });
  return { prompt, text: r.choices[0].text };
}

// Reasoning and content of one chat, streamed or not.
async function chat(stream, extra) {
  const params = { model, messages, temperature: 0, max_tokens: 24, ignore_eos: true, ...extra };
  if (!stream) {
    const m = (await client.chat.completions.create(params)).choices[0].message;
    assert.equal(m.reasoning, m.reasoning_content);
    return { reasoning: m.reasoning_content, content: m.content };
  }
  let reasoning = null, content = null;
  for await (const chunk of await client.chat.completions.create({ ...params, stream: true })) {
    const d = chunk.choices[0]?.delta ?? {};
    if (d.reasoning_content) reasoning = (reasoning ?? '') + d.reasoning_content;
    if (d.content) content = (content ?? '') + d.content;
  }
  return { reasoning, content };
}

test('a prompt that opens <think>: the output is reasoning up to </think>, then content', async () => {
  const { prompt, text } = await oracle({});
  assert.ok(prompt.endsWith('<|im_start|>assistant\n<think>\n'), JSON.stringify(prompt));
  assert.ok(text.length > 0);
  const end = text.indexOf('</think>');
  const expected = end < 0 ? { reasoning: text, content: null }
                           : { reasoning: text.slice(0, end) || null, content: text.slice(end + 8) || null };
  for (const stream of [false, true]) assert.deepEqual(await chat(stream, {}), expected, `stream ${stream}`);
});

test('enable_thinking false closes the reasoning in the prompt: all content', async () => {
  const extra = { chat_template_kwargs: { enable_thinking: false } };
  const { prompt, text } = await oracle(extra);
  assert.ok(prompt.endsWith('<think>\n\n</think>\n\n'), JSON.stringify(prompt));
  for (const stream of [false, true])
    assert.deepEqual(await chat(stream, extra), { reasoning: null, content: text }, `stream ${stream}`);
});

test('the Responses API: the reasoning is a reasoning item, streamed as reasoning_text events', async () => {
  const { accumulateResponse } = await import('openai/lib/responses/ResponseAccumulator');
  const { text } = await oracle({});
  const expected = await chat(false, {});
  const params = { model, input: messages, temperature: 0, max_output_tokens: 24, ignore_eos: true };
  const r = await client.responses.create(params);
  const wanted = [];
  if (expected.reasoning) wanted.push({ type: 'reasoning', text: expected.reasoning });
  if (expected.content) wanted.push({ type: 'message', text: expected.content });
  const items = (output) => output.map((i) => ({ type: i.type, text: (i.content ?? []).map((c) => c.text).join('') }));
  assert.deepEqual(items(r.output), wanted, text);
  let snapshot = null;
  let final = null;
  for await (const event of await client.responses.create({ ...params, stream: true })) {
    if (event.type === 'response.incomplete' || event.type === 'response.completed') final = event.response;
    else snapshot = accumulateResponse(event, snapshot);
  }
  assert.deepEqual(items(snapshot.output), wanted);
  assert.deepEqual(items(final.output), wanted);
  const plain = await client.responses.create({ ...params, chat_template_kwargs: { enable_thinking: false } });
  assert.deepEqual(plain.output.map((i) => i.type), ['message']);
});
