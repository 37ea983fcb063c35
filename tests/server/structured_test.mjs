// Structured outputs through the official `openai` client on the bundled demo
// model: response_format json_schema / json_object (pattern and format
// included), vLLM's guided_choice, guided_regex, guided_grammar and structured_outputs,
// tool_choice "required" / a named function (tool_calls out of a grammar of
// the tools' parameters), streamed and not, and the 400s for what is not
// served.
// Oracle: ajv (a JSON Schema validator; ajv-formats for pattern and format) on every finished output, and
// JSON.parse. With --reasoning-parser qwen3 the grammar starts after the
// reasoning (a second server, with a template that can open it).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import Ajv from 'ajv';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';
import OpenAI from 'openai';
import { startServer, repoRoot } from './server_harness.mjs';

const model = 'moeserve-demo';
const messages = [{ role: 'user', content: 'Tell me a fortune as JSON.' }];
const schema = {
  type: 'object',
  properties: {
    mood: { enum: ['good', 'bad', 'mixed'] },
    luck: { type: 'integer' },
    fortune: { type: 'string', maxLength: 24 },
    lucky_numbers: { type: 'array', items: { type: 'integer' }, maxItems: 3 },
    certain: { type: 'boolean' },
    note: { anyOf: [{ type: 'string', maxLength: 8 }, { type: 'null' }] },
  },
  required: ['mood', 'luck', 'fortune'],
  additionalProperties: false,
};
const validate = new Ajv({ strict: false }).compile(schema);
let server;
let client;

before(async () => {
  server = await startServer(['--model', path.join(repoRoot, 'models/moeserve-demo'), '--served-model-name', model,
                              '--max-model-len', '512']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => assert.equal(await server.stop(), 0));

const responseFormat = { type: 'json_schema', json_schema: { name: 'fortune', schema } };

// Every finished choice parses and meets the schema; returns the finished ones.
function checkChoices(choices, text = (c) => c.message.content) {
  const finished = choices.filter((c) => c.finish_reason === 'stop');
  for (const c of finished) {
    const value = JSON.parse(text(c));
    assert.ok(validate(value), `${text(c)}: ${JSON.stringify(validate.errors)}`);
  }
  return finished;
}

test('json_schema: greedy and sampled choices meet the schema', async () => {
  const greedy = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 160,
                                                        response_format: responseFormat });
  assert.equal(checkChoices(greedy.choices).length, 1, greedy.choices[0].message.content);
  const sampled = await client.chat.completions.create({ model, messages, temperature: 1, seed: 5, n: 6,
                                                         max_tokens: 160, response_format: responseFormat });
  assert.ok(checkChoices(sampled.choices).length >= 3, JSON.stringify(sampled.choices.map((c) => c.finish_reason)));
  // Properties come in the schema's order.
  const keys = Object.keys(JSON.parse(greedy.choices[0].message.content));
  const order = Object.keys(schema.properties);
  assert.deepEqual(keys, order.filter((k) => keys.includes(k)));
});

test('the same grammar by vLLM spelling, streamed or not, gives the same greedy text', async () => {
  const base = { model, messages, temperature: 0, max_tokens: 160 };
  const openai = (await client.chat.completions.create({ ...base, response_format: responseFormat }))
    .choices[0].message.content;
  const guided = (await client.chat.completions.create({ ...base, guided_json: schema })).choices[0].message.content;
  const text = (await client.chat.completions.create({ ...base, guided_json: JSON.stringify(schema) }))
    .choices[0].message.content;
  const outputs = (await client.chat.completions.create({ ...base, structured_outputs: { json: schema } }))
    .choices[0].message.content;
  let streamed = '';
  for await (const chunk of await client.chat.completions.create({ ...base, response_format: responseFormat,
                                                                   stream: true }))
    streamed += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(guided, openai);
  assert.equal(text, openai);
  assert.equal(outputs, openai);
  assert.equal(streamed, openai);
  // Unconstrained, the demo model writes no JSON: the grammar made the difference.
  const free = (await client.chat.completions.create(base)).choices[0].message.content;
  assert.throws(() => JSON.parse(free));
});

// Schemas of every construct served, sampled: every finished output is valid by ajv.
const schemas = [
  { type: 'array', items: { type: 'object', properties: { id: { type: 'integer' }, tag: { enum: ['x', 'y', null] } },
                            required: ['id'] }, minItems: 1, maxItems: 3 },
  { $defs: { node: { type: 'object', properties: { v: { type: 'number' },
                                                   kids: { type: 'array', items: { $ref: '#/$defs/node' }, maxItems: 2 } },
                     required: ['v'] } },
    $ref: '#/$defs/node' },
  { anyOf: [{ type: 'string', minLength: 2, maxLength: 5 }, { type: 'boolean' }, { const: { a: [1, 'two'] } }] },
  { type: 'object', properties: { name: { type: ['string', 'null'], maxLength: 6 } }, required: ['name'],
    additionalProperties: { type: 'integer' } },
  { type: 'object', properties: { when: { oneOf: [{ type: 'integer' }, { type: 'string', maxLength: 4 }] },
                                  nested: { allOf: [{ type: 'object', properties: { ok: { type: 'boolean' } },
                                                      required: ['ok'] }] } },
    required: ['when', 'nested'], title: 'annotations are ignored', description: 'x' },
  // What Pydantic writes for Field(ge=, le=, gt=, lt=) and tuple[...]: bounds and prefixItems.
  { type: 'object', properties: { age: { type: 'integer', minimum: 18, maximum: 120 },
                                  score: { type: 'number', exclusiveMinimum: 0, maximum: 1 },
                                  delta: { type: 'number', minimum: -2.5, exclusiveMaximum: -0.5 },
                                  pair: { type: 'array', prefixItems: [{ type: 'integer', exclusiveMinimum: -10,
                                                                         maximum: -3 },
                                                                       { type: 'string', maxLength: 3 }],
                                          items: false, minItems: 2 },
                                  rest: { type: 'array', items: { type: 'number', minimum: 0.001 }, maxItems: 3 } },
    required: ['age', 'score', 'delta', 'pair', 'rest'] },
];

test('every construct served: samples that finish are valid by ajv', async () => {
  for (const [k, sch] of schemas.entries()) {
    const check = new Ajv2020({ strict: false }).compile(sch);
    const r = await client.chat.completions.create({ model, messages, temperature: 1, seed: 10 + k, n: 8,
                                                     max_tokens: 200, guided_json: sch });
    let finished = 0;
    for (const c of r.choices) {
      if (c.finish_reason !== 'stop') continue;
      finished++;
      const value = JSON.parse(c.message.content);
      assert.ok(check(value), `schema ${k}: ${c.message.content}: ${JSON.stringify(check.errors)}`);
    }
    assert.ok(finished >= 1, `schema ${k}: ${JSON.stringify(r.choices.map((c) => c.message.content))}`);
  }
});

// Whether JSON text has, outside its strings, exactly one space after each ',' and ':' and no other whitespace.
function separatorsOnly(text) {
  let inString = false;
  let escaped = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      if (escaped) escaped = false;
      else if (c === '\\') escaped = true;
      else if (c === '"') inString = false;
      continue;
    }
    if (c === '"') inString = true;
    const space = /\s/.test(c);
    if (space !== (c === ' ' && i > 0 && (text[i - 1] === ',' || text[i - 1] === ':'))) return false;
  }
  return true;
}

test("disable_any_whitespace: xgrammar's separators and no other whitespace; disable_additional_properties", async () => {
  const r = await client.chat.completions.create({ model, messages, temperature: 1, seed: 21, n: 6, max_tokens: 200,
                                                   structured_outputs: { json: schema, disable_any_whitespace: true } });
  const finished = r.choices.filter((c) => c.finish_reason === 'stop');
  assert.ok(finished.length >= 1, JSON.stringify(r.choices.map((c) => c.message.content)));
  for (const c of finished) {
    assert.ok(validate(JSON.parse(c.message.content)), c.message.content);
    assert.ok(separatorsOnly(c.message.content), JSON.stringify(c.message.content));
  }
  const closed = await client.chat.completions.create({ model, messages, temperature: 1, seed: 22, n: 4, max_tokens: 40,
                                                        guided_json: { type: 'object' },
                                                        structured_outputs: { disable_additional_properties: true } });
  assert.ok(closed.choices.some((c) => c.finish_reason === 'stop'), JSON.stringify(closed.choices));
  for (const c of closed.choices) if (c.finish_reason === 'stop') assert.deepEqual(JSON.parse(c.message.content), {});
});

test('json_object: an object', async () => {
  const r = await client.chat.completions.create({ model, messages, temperature: 1, seed: 3, n: 4, max_tokens: 200,
                                                   response_format: { type: 'json_object' } });
  const finished = r.choices.filter((c) => c.finish_reason === 'stop');
  assert.ok(finished.length >= 1, JSON.stringify(r.choices.map((c) => c.message.content)));
  for (const c of finished) {
    const value = JSON.parse(c.message.content);
    assert.equal(typeof value, 'object');
    assert.ok(value !== null && !Array.isArray(value));
  }
});

test('guided_choice on /v1/completions: one of the choices, then stop', async () => {
  const choices = ['A fortune cookie', 'Nothing at all', 'The press'];
  const r = await client.completions.create({ model, prompt: 'The most important service is', temperature: 1,
                                             seed: 1, n: 8, max_tokens: 20, guided_choice: choices });
  for (const c of r.choices) {
    assert.equal(c.finish_reason, 'stop');
    assert.ok(choices.includes(c.text), c.text);
  }
  const streamed = [];
  for await (const chunk of await client.completions.create({ model, prompt: 'The press', temperature: 0,
                                                              max_tokens: 20, stream: true,
                                                              structured_outputs: { choice: choices } }))
    streamed.push(chunk.choices[0]?.text ?? '');
  assert.ok(choices.includes(streamed.join('')), streamed.join(''));
});

// pattern and format: the regular expressions apply to the decoded string
// values. Oracle: ajv with ajv-formats (JavaScript's own RegExp for pattern).
test('pattern and format: every finished output meets them', async () => {
  const patterned = {
    type: 'object',
    properties: {
      code: { type: 'string', pattern: '^[A-Z]{2}-\\d{3}$' },
      when: { type: 'string', format: 'date-time' },
      day: { type: 'string', format: 'date' },
      id: { type: 'string', format: 'uuid' },
      host: { type: 'string', format: 'ipv4' },
      mail: { type: 'string', format: 'email', maxLength: 40 },
      word: { type: 'string', pattern: 'ab?c', maxLength: 12 },
    },
    required: ['code', 'when', 'day', 'id', 'host', 'mail', 'word'],
    additionalProperties: false,
  };
  const more = {
    type: 'object',
    properties: {
      link: { type: 'string', format: 'uri', maxLength: 48 },
      addr: { type: 'string', format: 'ipv6' },
      span: { type: 'string', format: 'duration', maxLength: 16 },
    },
    required: ['link', 'addr', 'span'],
    additionalProperties: false,
  };
  const ajv = new Ajv({ strict: true });
  addFormats(ajv);
  for (const schema of [patterned, more]) {
    const check = ajv.compile(schema);
    const rf = { type: 'json_schema', json_schema: { name: 'record', schema } };
    let finished = 0;
    for (const request of [{ temperature: 0 }, { temperature: 1, seed: 3, n: 6 }]) {
      const r = await client.chat.completions.create({ model, messages, max_tokens: 300, response_format: rf, ...request });
      for (const c of r.choices) {
        if (c.finish_reason !== 'stop') continue;
        const value = JSON.parse(c.message.content);
        assert.ok(check(value), `${c.message.content}: ${JSON.stringify(check.errors)}`);
        ++finished;
      }
    }
    assert.ok(finished >= 4, `${finished} of 7 choices finished`);
  }
});

// vLLM's guided_regex and structured_outputs.regex: the whole text matches
// (oracle: JavaScript's RegExp, anchored), streamed and not.
test('guided_regex and structured_outputs.regex: the whole output matches', async () => {
  const regex = '(yes|no), [0-9]{1,3} (apples|pears)\\.';
  const whole = new RegExp(`^(?:${regex})$`);
  const r = await client.completions.create({ model, prompt: 'The answer is', max_tokens: 40, temperature: 1, seed: 2,
                                              n: 6, guided_regex: regex });
  for (const c of r.choices) {
    assert.equal(c.finish_reason, 'stop', c.text);
    assert.match(c.text, whole);
  }
  const chat = await client.chat.completions.create({ model, messages, max_tokens: 40, temperature: 0,
                                                      structured_outputs: { regex } });
  assert.match(chat.choices[0].message.content, whole);
  const streamed = [];
  for await (const chunk of await client.completions.create({ model, prompt: 'Fruit:', temperature: 0, max_tokens: 40,
                                                              stream: true, guided_regex: regex }))
    streamed.push(chunk.choices[0]?.text ?? '');
  assert.match(streamed.join(''), whole);
});

// vLLM's guided_grammar and structured_outputs.grammar (EBNF, as xgrammar
// and llama.cpp's GBNF read it): the whole text follows the grammar (oracle:
// a recursive-descent checker written for this grammar), streamed and not.
test('guided_grammar and structured_outputs.grammar: the whole output follows the grammar', async () => {
  const grammar = `
    root   ::= expr " = " [0-9]+
    expr   ::= term (("+" | "-") term)*   # sums of products
    term   ::= factor ("*" factor)*
    factor ::= [0-9]{1,3} | "(" expr ")"
  `;
  const follows = (text) => {
    let i = 0;
    const factor = () => {
      if (text[i] === '(') { i++; if (!expr() || text[i] !== ')') return false; i++; return true; }
      const m = /^[0-9]{1,3}/.exec(text.slice(i));
      if (!m) return false;
      i += m[0].length;
      return !/^[0-9]/.test(text.slice(i));
    };
    const term = () => { if (!factor()) return false; while (text[i] === '*') { i++; if (!factor()) return false; } return true; };
    const expr = () => { if (!term()) return false; while (text[i] === '+' || text[i] === '-') { i++; if (!term()) return false; } return true; };
    return expr() && /^ = [0-9]+$/.test(text.slice(i));
  };
  const r = await client.completions.create({ model, prompt: 'Arithmetic:', max_tokens: 48, temperature: 1, seed: 4,
                                              n: 8, guided_grammar: grammar });
  let finished = 0;
  for (const c of r.choices) {
    if (c.finish_reason === 'stop') {
      assert.ok(follows(c.text), c.text);
      finished++;
    } else {
      assert.equal(c.finish_reason, 'length');
    }
  }
  assert.ok(finished >= 1, 'some sampled outputs finish within 48 tokens');
  const greedy = await client.chat.completions.create({ model, messages, max_tokens: 48, temperature: 0,
                                                        structured_outputs: { grammar } });
  const streamed = [];
  for await (const chunk of await client.chat.completions.create({ model, messages, max_tokens: 48, temperature: 0,
                                                                   stream: true, guided_grammar: grammar }))
    streamed.push(chunk.choices[0]?.delta?.content ?? '');
  assert.equal(streamed.join(''), greedy.choices[0].message.content);
  if (greedy.choices[0].finish_reason === 'stop') assert.ok(follows(greedy.choices[0].message.content));
});

// structural_tag: free text in which the trigger comes only as a structure's
// start. The trigger is a common letter, so that the demo model's sampled
// text holds many structures. Oracle: a JavaScript RegExp for the structure,
// the bounds checked on the numbers, and no trigger left once the structures are cut out.
test('structural_tag: free text, and a structure after every trigger', async () => {
  const tag = { type: 'structural_tag', triggers: ['e'],
                structures: [{ begin: 'e=', schema: { type: 'integer', minimum: 0, maximum: 99 }, end: ';' }] };
  const r = await client.chat.completions.create({ model, messages, temperature: 1, seed: 4, n: 6, max_tokens: 40,
                                                   structured_outputs: { structural_tag: JSON.stringify(tag) } });
  let structures = 0;
  for (const c of r.choices) {
    let text = c.message.content;
    if (c.finish_reason === 'length') text = text.replace(/e(=\s*\d*\s*)?$/, '');  // a structure the cut left open
    // The value as JSON between tokens: no whitespace, one space, or a newline and an indent around it.
    const structure = /e=(?: |\n[ \t]{0,20})?(0|[1-9]\d*)(?: |\n[ \t]{0,20})?;/g;
    const values = [...text.matchAll(structure)].map((m) => Number(m[1]));
    for (const v of values) assert.ok(v >= 0 && v <= 99, `${v} in ${JSON.stringify(c.message.content)}`);
    structures += values.length;
    assert.ok(!text.replace(structure, '').includes('e'), JSON.stringify(c.message.content));
  }
  assert.ok(structures >= 3, JSON.stringify(r.choices.map((c) => c.message.content)));
  // The response_format spelling, greedy, is the same grammar.
  const greedy = async (extra) => (await client.chat.completions.create({ model, messages, temperature: 0,
                                                                          max_tokens: 30, ...extra }))
    .choices[0].message.content;
  assert.equal(await greedy({ response_format: tag }), await greedy({ structured_outputs: { structural_tag: tag } }));
});

test('what is not served is a 400 naming it, and the server goes on', async () => {
  const cases = [
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: '(a)\\1' } } } },
     /backreferences/],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', format: 'iri' } } } },
     /'format' "iri"/],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', required: ['x'] } } } },
     /"x"/],
    [{ response_format: { type: 'json_schema', json_schema: { name: 'x' } } }, /schema/],
    [{ guided_json: { type: 'integer', multipleOf: 5 } }, /'multipleOf'/],
    [{ guided_json: { type: 'integer', minimum: 5, maximum: 4 } }, /leave no integer/],
    [{ response_format: { type: 'grammar' } }, /'grammar'/],
    [{ guided_regex: 'a(?=b)' }, /look-ahead/],
    [{ structured_outputs: { grammar: 'root ::= item' } }, /'item' is used but not defined/],
    [{ guided_grammar: 'root ::= e\ne ::= e "+" "1" | "1"' }, /left recursion/],
    [{ structured_outputs: { structural_tag: '{}' } }, /structures/],
    [{ structured_outputs: { whitespace_pattern: ' *' } }, /whitespace_pattern/],
    [{ guided_json: '{not json' }, /not valid JSON/],
    [{ guided_choice: [] }, /choice/],
    [{ guided_choice: ['a'], response_format: { type: 'json_object' } }, /one structured output/],
  ];
  for (const [extra, message] of cases) {
    await assert.rejects(client.chat.completions.create({ model, messages, max_tokens: 4, ...extra }), (e) => {
      assert.equal(e.status, 400, JSON.stringify(extra));
      assert.match(e.message, message);
      return true;
    });
  }
  // A grammar whose only way on is eos, which min_tokens bans: an error, not a cut output.
  await assert.rejects(client.completions.create({ model, prompt: 'Hello', max_tokens: 20, min_tokens: 8,
                                                  guided_choice: ['no'] }), (e) => {
    assert.equal(e.status, 400);
    assert.match(e.message, /cannot go on within the request's grammar/);
    return true;
  });
  const ok = await client.chat.completions.create({ model, messages, max_tokens: 4, response_format: { type: 'text' } });
  assert.equal(ok.choices.length, 1);
});

const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 },
                                                unit: { enum: ['celsius', 'fahrenheit'] } },
                  required: ['city'] } } },
  { type: 'function', function: { name: 'lucky_number', parameters: { type: 'object',
    properties: { n: { type: 'integer' } }, required: ['n'] } } },
  { type: 'function', function: { name: 'no_arguments' } },
];
const validators = Object.fromEntries(tools.map((t) => [t.function.name,
  new Ajv({ strict: false }).compile(t.function.parameters ?? { type: 'object', additionalProperties: false })]));

// Each call names a tool and its arguments meet that tool's parameters.
function checkCalls(calls, only) {
  assert.ok(calls.length >= 1);
  for (const call of calls) {
    assert.equal(call.type, 'function');
    assert.match(call.id, /^call_[0-9a-f]{24}$/);
    if (only) assert.equal(call.function.name, only);
    const validate = validators[call.function.name];
    assert.ok(validate, call.function.name);
    const args = JSON.parse(call.function.arguments);
    assert.ok(validate(args), `${call.function.arguments}: ${JSON.stringify(validate.errors)}`);
  }
}

test('tool_choice "required" and a named function come back as tool_calls, streamed or not', async () => {
  const base = { model, messages: [{ role: 'user', content: 'What is the weather in Paris?' }], tools,
                 max_tokens: 120 };
  for (const [tool_choice, only] of [[{ type: 'function', function: { name: 'get_weather' } }, 'get_weather'],
                                     [{ type: 'function', function: { name: 'no_arguments' } }, 'no_arguments'],
                                     ['required', null]]) {
    const r = await client.chat.completions.create({ ...base, tool_choice, temperature: 1, seed: 4, n: 3 });
    let called = 0;
    for (const c of r.choices) {
      if (c.finish_reason === 'length') continue;
      assert.equal(c.finish_reason, 'tool_calls');
      assert.equal(c.message.content, null);
      checkCalls(c.message.tool_calls, only);
      called++;
    }
    assert.ok(called >= 1, JSON.stringify(r.choices));
    // Streamed: the same calls, in the last chunk.
    const greedy = await client.chat.completions.create({ ...base, tool_choice, temperature: 0 });
    const calls = [];
    let content = '', finish = null;
    for await (const chunk of await client.chat.completions.create({ ...base, tool_choice, temperature: 0,
                                                                     stream: true })) {
      const d = chunk.choices[0]?.delta ?? {};
      content += d.content ?? '';
      for (const call of d.tool_calls ?? []) calls.push(call);
      finish = chunk.choices[0]?.finish_reason ?? finish;
    }
    assert.equal(finish, greedy.choices[0].finish_reason);
    if (finish === 'tool_calls') {
      assert.equal(content, '');
      assert.deepEqual(calls.map((c) => [c.function.name, c.function.arguments]),
                       greedy.choices[0].message.tool_calls.map((c) => [c.function.name, c.function.arguments]));
    }
  }
  const errors = [
    [{ tool_choice: 'required', tools: undefined }, /needs 'tools'/],
    [{ tool_choice: { type: 'function', function: { name: 'nope' } } }, /'nope'/],
    [{ tool_choice: 'required', response_format: { type: 'json_object' } }, /constrains the output itself/],
    [{ tool_choice: 'sometimes' }, /tool_choice/],
  ];
  for (const [extra, message] of errors) {
    await assert.rejects(client.chat.completions.create({ ...base, ...extra }), (e) => {
      assert.equal(e.status, 400, JSON.stringify(extra));
      assert.match(e.message, message);
      return true;
    });
  }
});

test('with --reasoning-parser qwen3 the grammar applies after the reasoning', async () => {
  const demo = path.join(repoRoot, 'models/moeserve-demo');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'moeserve-structured-'));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json'])
    fs.symlinkSync(path.join(demo, f), path.join(dir, f));
  const config = JSON.parse(fs.readFileSync(path.join(demo, 'tokenizer_config.json')));
  const header = "{{- '<|im_start|>assistant\\n' }}";
  config.chat_template = config.chat_template.replace(header, header +
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}" +
    "{%- else %}{{- '<think>\\n' }}{%- endif %}");
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  const thinking = await startServer(['--model', dir, '--served-model-name', model, '--max-model-len', '512',
                                      '--reasoning-parser', 'qwen3']);
  try {
    const c = new OpenAI({ baseURL: `${thinking.url}/v1`, apiKey: 'unused', maxRetries: 0 });
    const base = { model, messages, temperature: 0, max_tokens: 160, response_format: responseFormat };
    // The prompt closed the reasoning: JSON from the first token.
    const closed = await c.chat.completions.create({ ...base, chat_template_kwargs: { enable_thinking: false } });
    assert.equal(checkChoices(closed.choices).length, 1, closed.choices[0].message.content);
    // The prompt opened it. Qwen3's </think> is one token, and the grammar waits for it (the
    // engine's test, EngineSpeculation.StructuredOutputs*, covers that); the demo's tokenizer
    // spells it in five, so the grammar applies from the start, and the output is content.
    const tok = await (await fetch(`${thinking.url}/tokenize`,
                                   { method: 'POST', body: JSON.stringify({ prompt: '</think>' }) })).json();
    assert.ok(tok.tokens.length > 1);
    const open = await c.chat.completions.create(base);
    const m = open.choices[0].message;
    assert.equal(m.reasoning_content ?? null, null);
    assert.equal(checkChoices(open.choices).length, 1, JSON.stringify(m));
  } finally {
    assert.equal(await thinking.stop(), 0);
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
