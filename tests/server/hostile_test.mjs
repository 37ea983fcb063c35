// Hostile and malformed requests against a live server (the demo model): each
// gets its documented status (docs/server.md), the server never crashes, and
// it still serves normal requests afterwards.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, rawRequest, httpPost, waitFor } from './server_harness.mjs';

let server;
const model = 'moeserve-demo';

before(async () => {
  server = await startServer(['--max-model-len', '256', '--read-timeout', '1', '--max-body-bytes', '65536',
                              '--max-n', '8', '--max-logprobs', '10']);
});
after(async () => { assert.equal(await server.stop(), 0); });

const completion = (body) => httpPost('/v1/completions', body);
const chat = (body) => httpPost('/v1/chat/completions', body);
const ok = { model, prompt: 'Hello', max_tokens: 2 };

// [name, request chunks, expected status, expected error param (optional)]
const cases = [
  ['invalid JSON', completion('{"prompt": "x",'), 400],
  ['JSON array body', completion('[1,2,3]'), 400],
  ['JSON string body', completion('"hello"'), 400],
  ['empty body', completion(''), 400],
  ['prompt missing', completion({ model, max_tokens: 2 }), 400, 'prompt'],
  ['prompt is a number', completion({ ...ok, prompt: 42 }), 400, 'prompt'],
  ['prompt is an object', completion({ ...ok, prompt: { a: 1 } }), 400, 'prompt'],
  ['negative token id', completion({ ...ok, prompt: [1, -5] }), 400, 'prompt'],
  ['token id past the vocabulary', completion({ ...ok, prompt: [1, 999999] }), 400, 'prompt'],
  ['float token id', completion({ ...ok, prompt: [1, 2.5] }), 400, 'prompt'],
  ['empty prompt', completion({ ...ok, prompt: '' }), 400, 'prompt'],
  ['batch mixing text and token ids', completion({ ...ok, prompt: ['a', [1, 2]] }), 400, 'prompt'],
  ['batch with an empty prompt', completion({ ...ok, prompt: ['a', ''] }), 400, 'prompt'],
  ['batch over 256 choices', completion({ ...ok, prompt: Array(129).fill('a'), n: 2 }), 400, 'prompt'],
  ['max_tokens is a string', completion({ ...ok, max_tokens: '10' }), 400, 'max_tokens'],
  ['max_tokens 0', completion({ ...ok, max_tokens: 0 }), 400, 'max_tokens'],
  ['max_tokens negative', completion({ ...ok, max_tokens: -1 }), 400, 'max_tokens'],
  ['max_tokens 1e12', completion({ ...ok, max_tokens: 1e12 }), 400, 'max_tokens'],
  ['max_tokens over the context', completion({ ...ok, max_tokens: 100000 }), 400, 'prompt'],
  ['max_completion_tokens huge', chat({ model, messages: [{ role: 'user', content: 'x' }], max_completion_tokens: 5000 }), 400, 'messages'],
  ['over-long prompt', completion({ ...ok, prompt: Array(300).fill(5) }), 400, 'prompt'],
  ['n 1000', completion({ ...ok, n: 1000 }), 400, 'n'],
  ['n 0', completion({ ...ok, n: 0 }), 400, 'n'],
  ['n as a string', completion({ ...ok, n: 'two' }), 400, 'n'],
  ['logprobs 1000', completion({ ...ok, logprobs: 1000 }), 400, 'logprobs'],
  ['top_logprobs 1000', chat({ model, messages: [{ role: 'user', content: 'x' }], logprobs: true, top_logprobs: 1000 }), 400, 'top_logprobs'],
  ['top_logprobs without logprobs', chat({ model, messages: [{ role: 'user', content: 'x' }], top_logprobs: 2 }), 400, 'top_logprobs'],
  ['temperature negative', completion({ ...ok, temperature: -1 }), 400, 'temperature'],
  ['temperature a string', completion({ ...ok, temperature: 'hot' }), 400, 'temperature'],
  ['top_p 0', completion({ ...ok, top_p: 0 }), 400, 'top_p'],
  ['top_p 2', completion({ ...ok, top_p: 2 }), 400, 'top_p'],
  ['top_k -5', completion({ ...ok, top_k: -5 }), 400, 'top_k'],
  ['min_p 1.5', completion({ ...ok, min_p: 1.5 }), 400, 'min_p'],
  ['seed a string', completion({ ...ok, seed: 'abc' }), 400, 'seed'],
  ['stop a number', completion({ ...ok, stop: 5 }), 400, 'stop'],
  ['stop with 100 strings', completion({ ...ok, stop: Array(100).fill('a') }), 400, 'stop'],
  ['empty stop string', completion({ ...ok, stop: [''] }), 400, 'stop'],
  ['stop_token_ids of strings', completion({ ...ok, stop_token_ids: ['a'] }), 400, 'stop_token_ids'],
  ['stream not a boolean', completion({ ...ok, stream: 'yes' }), 400, 'stream'],
  ['stream_options not an object', completion({ ...ok, stream: true, stream_options: 3 }), 400, 'stream_options'],
  ['unknown model', completion({ ...ok, model: 'gpt-4' }), 404, 'model'],
  ['messages not an array', chat({ model, messages: 'hi' }), 400, 'messages'],
  ['messages empty', chat({ model, messages: [] }), 400, 'messages'],
  ['message without a role', chat({ model, messages: [{ content: 'hi' }] }), 400, 'messages'],
  ['message content a number', chat({ model, messages: [{ role: 'user', content: 7 }] }), 400, 'messages'],
  ['image content part', chat({ model, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] }), 400, 'messages'],
  ['content part type a number', chat({ model, messages: [{ role: 'user', content: [{ type: 7, text: 'x' }] }] }), 400, 'messages'],
  ['tokenize add_special_tokens a string', httpPost('/tokenize', { prompt: 'x', add_special_tokens: 'yes' }), 400, 'add_special_tokens'],
  ['role a number', chat({ model, messages: [{ role: 5, content: 'x' }] }), 400, 'messages'],
  ['messages of numbers', chat({ model, messages: [1, 2] }), 400, 'messages'],
  ['chat_template_kwargs not an object', chat({ model, messages: [{ role: 'user', content: 'x' }], chat_template_kwargs: [] }), 400, 'chat_template_kwargs'],
  ['deeply nested JSON', completion('{"prompt": ' + '['.repeat(20000) + ']'.repeat(20000) + '}'), 400],
  ['invalid UTF-8 in JSON', [Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\nConnection: close\r\n\r\n'),
                             Buffer.from([0x7b, 0x22, 0x70, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20])], 400],
  ['oversized body', completion({ ...ok, prompt: 'x'.repeat(100000) }), 413],
  ['oversized headers', [Buffer.from(`GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(40000)}\r\n\r\n`)], 431],
  ['malformed request line', [Buffer.from('HELLO WORLD\r\n\r\n')], 400],
  ['bad chunked body', [Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n')], 400],
  ['unknown route', [Buffer.from('GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')], 404],
  ['GET on a POST route', [Buffer.from('GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')], 405],
  ['presence_penalty out of range', completion({ ...ok, presence_penalty: 2.5 }), 400, 'presence_penalty'],
  ['logit_bias with a non-numeric key', completion({ ...ok, logit_bias: { eleven: 5 } }), 400, 'logit_bias'],
  ['logit_bias past the vocabulary', completion({ ...ok, logit_bias: { 1000000000: 5 } }), 400],
  ['min_tokens over max_tokens', completion({ ...ok, max_tokens: 2, min_tokens: 3 }), 400, 'min_tokens'],
  ['length_penalty (beam search, not implemented)', completion({ ...ok, length_penalty: 0.5 }), 400, 'length_penalty'],
  ['response_format with a schema keyword not served', chat({ model, messages: [{ role: 'user', content: 'x' }],
    max_tokens: 2, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', format: 'iri' } } } }),
   400, 'response_format'],
  ['a schema nested past the limit', chat({ model, messages: [{ role: 'user', content: 'x' }], max_tokens: 2,
    guided_json: JSON.parse('{"items":'.repeat(100) + '{}' + '}'.repeat(100)) }), 400, 'guided_json'],
  ['guided_regex with a backreference', completion({ ...ok, guided_regex: '(a)\\1' }), 400, 'guided_regex'],
  ['guided_regex of a pathological size', completion({ ...ok, guided_regex: '(a|b)*a' + '[ab]'.repeat(40) }), 400,
   'guided_regex'],
  ['guided_grammar with an undefined rule', completion({ ...ok, guided_grammar: 'root ::= item' }), 400, 'guided_grammar'],
  ['guided_grammar left-recursive', completion({ ...ok, guided_grammar: 'root ::= root "a" | "a"' }), 400, 'guided_grammar'],
  ['guided_grammar past the size limit', completion({ ...ok, guided_grammar: 'root ::= "a"{1000}' + ' | "b"{1000}'.repeat(150) }),
   400, 'guided_grammar'],
  ['guided_grammar nested past the limit', completion({ ...ok, guided_grammar: 'root ::= ' + '('.repeat(100) + '"a"' + ')'.repeat(100) }),
   400, 'guided_grammar'],
  ['guided_grammar not a string', completion({ ...ok, guided_grammar: 7 }), 400, 'guided_grammar'],
  ['guided_grammar served', completion({ ...ok, guided_grammar: 'root ::= [a-z]+' }), 200],
  ['structural_tag whose begin starts with no trigger',
   completion({ ...ok, structural_tag: { structures: [{ begin: 'x', schema: {} }], triggers: ['<'] } }), 400, 'structural_tag'],
  ['structural_tag with too many structures',
   completion({ ...ok, structural_tag: { triggers: ['<'], structures: Array.from({ length: 65 }, (_, i) => ({ begin: `<${i}>` })) } }),
   400, 'structural_tag'],
  ['structural_tag as invalid JSON text', completion({ ...ok, structured_outputs: { structural_tag: '{"structures": [' } }),
   400, 'structured_outputs'],
  ['structural_tag served', completion({ ...ok, structural_tag: { structures: [{ begin: '<a>', end: '</a>' }], triggers: ['<a'] } }),
   200],
  ['numeric bounds that leave nothing', completion({ ...ok, guided_json: { type: 'integer', minimum: 3, maximum: 2 } }), 400,
   'guided_json'],
  ['neutral penalties and logit_bias are accepted', completion({ ...ok, presence_penalty: 0, frequency_penalty: 0,
                                                                 logit_bias: {} }), 200],
  ['penalties, logit_bias and min_tokens are applied', completion({ ...ok, presence_penalty: 0.5, frequency_penalty: -1,
                                                                    repetition_penalty: 1.2, min_tokens: 1,
                                                                    logit_bias: { 11: 5 } }), 200],
  ['detokenize ids past the vocabulary', httpPost('/detokenize', { tokens: [1, 1e9] }), 400, 'tokens'],
  ['tokenize without a prompt', httpPost('/tokenize', { nothing: 1 }), 400, 'prompt'],
  ['tokenize for another model', httpPost('/tokenize', { model: 'nope', prompt: 'Hi' }), 404, 'model'],
  ['logit_bias names a token past the vocabulary', completion({ ...ok, logit_bias: { 1000000: 1 } }), 400, 'logit_bias'],
  ['POST on a GET route (models)', httpPost('/v1/models', {}), 405],
  ['beam search', completion({ ...ok, use_beam_search: true }), 400, 'use_beam_search'],
  ['continue_final_message', chat({ model, messages: [{ role: 'user', content: 'Hi' }], continue_final_message: true }),
   400, 'continue_final_message'],
  ['chat echo served', chat({ model, messages: [{ role: 'user', content: 'Hi' }], echo: true, max_tokens: 2 }), 200],
  ['continue_final_message of a message without text',
   chat({ model, messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: null }],
          continue_final_message: true, add_generation_prompt: false }), 400, 'messages'],
  ['continue_final_message served',
   chat({ model, messages: [{ role: 'user', content: 'Hi' }, { role: 'assistant', content: 'Well,' }],
          continue_final_message: true, add_generation_prompt: false, max_tokens: 2 }), 200],
  ['bad_words not an array', completion({ ...ok, bad_words: 'no' }), 400, 'bad_words'],
  ['bad_words with an empty word', completion({ ...ok, bad_words: ['a', ''] }), 400, 'bad_words'],
  ['bad_words past the limit', completion({ ...ok, bad_words: Array.from({ length: 129 }, (_, i) => `w${i}`) }), 400,
   'bad_words'],
  ['bad_words past the token limit', completion({ ...ok, bad_words: Array.from({ length: 100 }, (_, i) => `w${i} `.repeat(12)) }),
   400, 'bad_words'],
  ['bad_words served', completion({ ...ok, bad_words: ['the', ' a b'] }), 200],
  ['allowed_token_ids empty', completion({ ...ok, allowed_token_ids: [] }), 400, 'allowed_token_ids'],
  ['allowed_token_ids negative', completion({ ...ok, allowed_token_ids: [1, -1] }), 400, 'allowed_token_ids'],
  ['allowed_token_ids past the vocabulary', completion({ ...ok, allowed_token_ids: [1, 1000000] }), 400,
   'allowed_token_ids'],
  ['allowed_token_ids served', completion({ ...ok, allowed_token_ids: [11, 12, 11] }), 200],
  ['responses: invalid JSON', httpPost('/v1/responses', '{"input": "x",'), 400],
  ['responses: a body that is not an object', httpPost('/v1/responses', [1, 2]), 400],
  ['responses without input', httpPost('/v1/responses', { model }), 400, 'input'],
  ['responses with an empty input array', httpPost('/v1/responses', { model, input: [] }), 400, 'input'],
  ['responses: a function_call without call_id', httpPost('/v1/responses', { model, input: [{ type: 'function_call',
                                                                                         name: 'f', arguments: '{}' }] }),
   400, 'input'],
  ['responses: a message of an unknown role', httpPost('/v1/responses', { model, input: [{ role: 'robot', content: 'x' }] }),
   400, 'input'],
  ['responses: tool_choice of another kind', httpPost('/v1/responses', { model, input: 'x', tool_choice: { type: 'mcp' } }),
   400, 'tool_choice'],
  ['responses: max_output_tokens 0', httpPost('/v1/responses', { model, input: 'x', max_output_tokens: 0 }), 400,
   'max_output_tokens'],
  ['responses: an item type that is not a string', httpPost('/v1/responses', { model, input: [{ type: 5 }] }), 400, 'input'],
  ['responses: a part type that is not a string',
   httpPost('/v1/responses', { model, input: [{ role: 'user', content: [{ type: 7, text: 'x' }] }] }), 400, 'input'],
  ['responses: a tool type that is not a string', httpPost('/v1/responses', { model, input: 'x', tools: [{ type: 5 }] }),
   400, 'tools'],
  ['responses: a text.format type that is not a string',
   httpPost('/v1/responses', { model, input: 'x', text: { format: { type: 5 } } }), 400, 'text'],
  ['responses: a json_schema name that is not a string',
   httpPost('/v1/responses', { model, input: 'x', text: { format: { type: 'json_schema', name: 5, schema: {} } } }), 400,
   'text'],
  ['responses: parallel_tool_calls not a boolean',
   httpPost('/v1/responses', { model, input: 'x', parallel_tool_calls: 'no' }), 400, 'parallel_tool_calls'],
  ['responses served', httpPost('/v1/responses', { model, input: 'x', max_output_tokens: 2 }), 200],
  ['GET on a POST route (responses)', [Buffer.from('GET /v1/responses HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')],
   405],
  ['truncate_prompt_tokens 0', completion({ ...ok, truncate_prompt_tokens: 0 }), 400, 'truncate_prompt_tokens'],
  ['POST on a GET route (health)', httpPost('/health', {}), 405],
  ['an unknown model by name', [Buffer.from('GET /v1/models/nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')], 404,
   'model'],
];

test(`${cases.length} hostile requests get their documented status`, async () => {
  assert.ok(cases.length >= 30);
  for (const [name, chunks, status, param] of cases) {
    const r = await rawRequest(server.port, chunks);
    assert.equal(r.status, status, `${name}: got ${r.status} ${r.body.slice(0, 200)}`);
    if (status >= 400 && r.headers['content-type'] === 'application/json') {
      const body = JSON.parse(r.body);
      assert.equal(typeof body.error.message, 'string', name);
      assert.ok('type' in body.error && 'param' in body.error && 'code' in body.error, name);
      if (param) assert.equal(body.error.param, param, `${name}: ${body.error.message}`);
    }
  }
});

test('HEAD answers as GET without the body (load balancers probe /health so)', async () => {
  for (const [target, status] of [['/health', 200], ['/v1/models', 200], ['/v1/completions', 405]]) {
    const r = await rawRequest(server.port, [Buffer.from(`HEAD ${target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n`)]);
    const get = await fetch(`${server.url}${target}`);
    const body = await get.text();
    assert.equal(r.status, status, target);
    assert.equal(get.status, status, target);
    assert.equal(r.body, '', `${target}: no body`);
    assert.equal(Number(r.headers['content-length']), Buffer.byteLength(body), `${target}: GET's Content-Length`);
  }
});

test('context overflow uses OpenAI\'s wording', async () => {
  const r = await rawRequest(server.port, completion({ ...ok, prompt: Array(200).fill(5), max_tokens: 100 }));
  const e = JSON.parse(r.body).error;
  assert.equal(e.message, 'This model\'s maximum context length is 256 tokens. However, you requested 300 tokens ' +
                          '(200 in the prompt, 100 in the completion). Please reduce the length of the prompt or completion.');
  assert.equal(e.code, 'context_length_exceeded');
});

test('slow headers (slowloris) are cut off by the read timeout', async () => {
  const start = Date.now();
  const head = 'GET /health HTTP/1.1\r\nHost: x\r\n'.split('');
  const r = await rawRequest(server.port, head.map((c) => Buffer.from(c)), { delayMs: 200, endAfter: false, timeoutMs: 8000 });
  assert.equal(r.status, 0);
  assert.ok(r.closed, 'the server closed the connection');
  assert.ok(Date.now() - start < 4000, `closed after ${Date.now() - start} ms`);
});

test('a connection that sends half a body and leaves does not hurt the server', async () => {
  const r = await rawRequest(server.port, [Buffer.from('POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro')]);
  assert.equal(r.status, 0);
});

test('the server is healthy and serves normally after all of it', async () => {
  assert.equal((await fetch(`${server.url}/health`)).status, 200);
  const res = await fetch(`${server.url}/v1/completions`, { method: 'POST', body: JSON.stringify({ ...ok, temperature: 0 }) });
  assert.equal(res.status, 200);
  const body = await res.json();
  assert.equal(body.usage.completion_tokens, 2);
  assert.equal(server.proc.exitCode, null);
});

test('Expect: 100-continue gets the interim answer at once (curl waits 1 s otherwise)', async () => {
  const net = await import('node:net');
  const body = JSON.stringify({ ...ok, temperature: 0 });
  const reply = await new Promise((resolve, reject) => {
    const socket = net.connect(server.port, '127.0.0.1');
    let data = '';
    const start = Date.now();
    socket.on('data', (d) => {
      data += d;
      if (data.startsWith('HTTP/1.1 100 Continue\r\n\r\n') && !socket.sentBody) {
        socket.sentBody = true;
        socket.write(body);
        socket.continueMs = Date.now() - start;
      }
      if (data.includes('"usage"')) { socket.destroy(); resolve({ data, continueMs: socket.continueMs }); }
    });
    socket.on('error', reject);
    socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: ${body.length}\r\n\r\n`);
  });
  assert.ok(reply.continueMs < 500, `100 Continue after ${reply.continueMs} ms`);
  assert.match(reply.data, /HTTP\/1\.1 200 OK/);
});

test('connections over --max-connections get 503 and the server recovers', async () => {
  const net = await import('node:net');
  const limited = await startServer(['--max-connections', '3', '--read-timeout', '5']);
  try {
    const idle = await Promise.all([0, 1, 2].map(() => new Promise((resolve) => {
      const s = net.connect(limited.port, '127.0.0.1', () => resolve(s));
    })));
    await new Promise((r) => setTimeout(r, 100));
    const refused = await rawRequest(limited.port, [Buffer.from('GET /health HTTP/1.1\r\nHost: x\r\n\r\n')]);
    assert.equal(refused.status, 503);
    assert.equal(refused.headers['retry-after'], '1');
    for (const s of idle) s.destroy();
    assert.ok(await waitFor(async () => (await rawRequest(limited.port,
      [Buffer.from('GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')])).status === 200, 5000));
  } finally {
    assert.equal(await limited.stop(), 0);
  }
});
