// vLLM's request extensions beyond OpenAI's fields, served by the bundled demo
// model through the official `openai` client: bad_words, allowed_token_ids,
// continue_final_message and chat echo. Oracles: Hugging Face tokenizers (the
// native build) for the words' token sequences under vLLM's rule and for the
// prompts; @huggingface/jinja for the templates, cut by transformers'
// continue_final_message rule; the same request without the extension.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';
import { Template } from '@huggingface/jinja';
import { startServer, repoRoot } from './server_harness.mjs';
import { load_tokenizer, QWEN3_DIR } from '../../tools/tokenizer/oracle.mjs';

const model = 'moeserve-demo';
const demoDir = path.join(repoRoot, 'models/moeserve-demo');
const tok = load_tokenizer(demoDir);
const encode = async (text) => Array.from((await tok.encode(text, null, { addSpecialTokens: false })).getIds());
let server;
let client;

before(async () => {
  server = await startServer(['--max-model-len', '512']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => { assert.equal(await server.stop(), 0); });

// vLLM's bad_words rule: each word without its leading whitespace, and after a
// space where that is as many tokens starting with another one.
async function badWordSequences(words) {
  const out = [];
  for (const w of words) {
    const bare = w.replace(/^\s+/, '');
    const alone = await encode(bare);
    out.push(alone);
    const spaced = await encode(' ' + bare);
    if (spaced.length === alone.length && spaced[0] !== alone[0]) out.push(spaced);
  }
  return out;
}

// Where in `ids` a sequence first ends (its last token's index), or -1.
function firstEnd(ids, sequences) {
  for (let p = 0; p < ids.length; ++p)
    for (const s of sequences)
      if (p + 1 >= s.length && s.every((t, k) => ids[p + 1 - s.length + k] === t)) return p;
  return -1;
}

const greedy = { model, prompt: 'A fortune cookie says', temperature: 0, max_tokens: 40, ignore_eos: true,
                 return_token_ids: true };

test('bad_words: the output follows the free one until a word would end, then goes around it (streamed too)', async () => {
  const free = (await client.completions.create(greedy)).choices[0];
  // Two words of the free text: one inside it (after a space), one at the very start of the output.
  const inner = free.text.trim().split(/\s+/).find((w, i) => i > 1 && /^[a-z]{3,}$/.test(w));
  assert.ok(inner, `a word to ban in '${free.text}'`);
  const first = free.text.replace(/^\s+/, '').split(/\s+/)[0];
  for (const words of [[inner], [` ${first}`, 'zzqx']]) {
    const sequences = await badWordSequences(words);
    const cut = firstEnd(free.token_ids, sequences);
    assert.ok(cut >= 0, `${JSON.stringify(words)} occurs in the free output's tokens ${free.token_ids}`);
    const r = (await client.completions.create({ ...greedy, bad_words: words })).choices[0];
    assert.deepEqual(r.token_ids.slice(0, cut), free.token_ids.slice(0, cut), `${words}: the same until the word`);
    assert.notEqual(r.token_ids[cut], free.token_ids[cut], `${words}: its last token is banned there`);
    assert.equal(firstEnd(r.token_ids, sequences), -1, `${words}: no word in '${r.text}'`);
    let streamed = '';
    for await (const chunk of await client.completions.create({ ...greedy, bad_words: words, stream: true }))
      streamed += chunk.choices[0]?.text ?? '';
    assert.equal(streamed, r.text);
  }
});

test('allowed_token_ids: every token is allowed; a left-out free token changes the output there', async () => {
  const free = (await client.completions.create(greedy)).choices[0];
  const allowed = new Set(free.token_ids);
  allowed.delete(free.token_ids[3]);
  for (let t = 100; t < 300; ++t) allowed.add(t);
  allowed.delete(free.token_ids[3]);
  const r = (await client.completions.create({ ...greedy, allowed_token_ids: [...allowed] })).choices[0];
  for (const t of r.token_ids) assert.ok(allowed.has(t), `token ${t} is not allowed`);
  const cut = free.token_ids.indexOf(free.token_ids[3]);
  assert.deepEqual(r.token_ids.slice(0, cut), free.token_ids.slice(0, cut));
  assert.notEqual(r.token_ids[cut], free.token_ids[cut]);
  // Sampled and in chat too.
  const chat = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Tell me a fortune.' }],
                                                      max_tokens: 30, seed: 3, allowed_token_ids: [...allowed],
                                                      return_token_ids: true, ignore_eos: true });
  for (const t of chat.choices[0].token_ids) assert.ok(allowed.has(t), `chat token ${t} is not allowed`);
});

// transformers' continue_final_message: the rendering cut after the final
// message's stripped text (after the whole message when the template kept it).
function continued(rendered, content) {
  const stripped = content.trim(), left = content.replace(/^\s+/, '');
  const at = rendered.lastIndexOf(stripped);
  assert.ok(at >= 0);
  return rendered.slice(0, at + (rendered.slice(at, at + left.length) === content ? left.length : stripped.length));
}

const demoTemplate = JSON.parse(fs.readFileSync(path.join(demoDir, 'tokenizer_config.json'))).chat_template;

test('continue_final_message: the prompt ends inside the final message (transformers\' rendering); echo leads with it',
     async () => {
  const messages = [{ role: 'user', content: 'Tell me a fortune.' }, { role: 'assistant', content: 'You will' }];
  const params = { model, messages, temperature: 0, max_tokens: 12, ignore_eos: true, return_token_ids: true,
                   add_generation_prompt: false, continue_final_message: true };
  const r = await client.chat.completions.create(params);
  const rendered = new Template(demoTemplate).render({ messages, add_generation_prompt: false, bos_token: '',
                                                       eos_token: '<|im_end|>' });
  assert.ok(rendered.endsWith('You will<|im_end|>\n'));
  assert.deepEqual(r.choices[0].prompt_token_ids, await encode(continued(rendered, 'You will')));
  assert.equal(r.choices[0].message.role, 'assistant');
  const echoed = await client.chat.completions.create({ ...params, echo: true });
  assert.equal(echoed.choices[0].message.content, 'You will' + r.choices[0].message.content);
  let streamed = '';
  let role = null;
  for await (const chunk of await client.chat.completions.create({ ...params, echo: true, stream: true })) {
    role ??= chunk.choices[0]?.delta?.role;
    streamed += chunk.choices[0]?.delta?.content ?? '';
  }
  assert.equal(streamed, echoed.choices[0].message.content);
  assert.equal(role, 'assistant');
  // vLLM's: without a generation prompt, the response takes the final message's role; echo then repeats it.
  const user = await client.chat.completions.create({ model, messages: messages.slice(0, 1), max_tokens: 2,
                                                      add_generation_prompt: false, echo: true });
  assert.equal(user.choices[0].message.role, 'user');
  assert.ok(user.choices[0].message.content.startsWith('Tell me a fortune.'));
  await assert.rejects(client.chat.completions.create({ ...params, add_generation_prompt: true }),
                       (e) => e instanceof OpenAI.BadRequestError && e.error?.param === 'continue_final_message');
});

test('continue_final_message under Qwen3\'s template: its whitespace handling, token for token', async () => {
  const source = JSON.parse(fs.readFileSync(path.join(QWEN3_DIR, 'tokenizer_config.json'))).chat_template;
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'moeserve-')), 'qwen3.jinja');
  fs.writeFileSync(file, source);
  const qwen = await startServer(['--max-model-len', '512', '--chat-template', file]);
  try {
    const template = new Template(source);
    // Kept as sent; trailing whitespace kept; leading newlines dropped by the template (cut after the
    // stripped text); reasoning inside the message; a final user message.
    const finals = [
      { role: 'assistant', content: 'Sure, here' },
      { role: 'assistant', content: 'Sure, here  ' },
      { role: 'assistant', content: '\n\nSure, here \n' },
      { role: 'assistant', content: '<think>\nhmm\n</think>\n\nThe answer' },
      { role: 'user', content: 'And also' },
    ];
    for (const final of finals) {
      const messages = [{ role: 'user', content: 'Hi' }, final];
      const rendered = template.render({ messages, add_generation_prompt: false, bos_token: '',
                                         eos_token: '<|im_end|>' });
      const want = await encode(continued(rendered, final.content));
      const got = await (await fetch(`${qwen.url}/tokenize`, { method: 'POST', body: JSON.stringify({
        messages, add_generation_prompt: false, continue_final_message: true }) })).json();
      assert.deepEqual(got.tokens, want, JSON.stringify(final.content));
    }
  } finally {
    assert.equal(await qwen.stop(), 0);
  }
});
