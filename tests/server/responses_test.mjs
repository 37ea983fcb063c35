// OpenAI's Responses API (POST /v1/responses) on the bundled demo model,
// through the official `openai` client. Oracles: the same conversation sent to
// /v1/chat/completions (text, usage, tool calls), the client's own
// accumulator of stream events (openai/lib/responses/ResponseAccumulator: every
// event must apply to the snapshot, and the deltas must add up to the final
// response), ajv for the function calls' arguments.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import Ajv from 'ajv';
import OpenAI from 'openai';
import { accumulateResponse } from 'openai/lib/responses/ResponseAccumulator';
import { startServer } from './server_harness.mjs';

const model = 'moeserve-demo';
let server;
let client;

before(async () => {
  server = await startServer(['--max-model-len', '512', '--enable-auto-tool-choice', '--tool-call-parser', 'hermes']);
  client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => { assert.equal(await server.stop(), 0); });

// Items without their ids (each response names its own).
const withoutIds = (output) => output.map(({ id, ...rest }) => rest);

// Streams `params`: every event applied with the client's accumulator, the
// sequence numbers 0, 1, ...; returns the terminal event's response and the
// snapshot the events before it built.
async function streamed(params) {
  let snapshot = null;
  let final = null;
  let next = 0;
  for await (const event of await client.responses.create({ ...params, stream: true })) {
    assert.equal(event.sequence_number, next++, event.type);
    if (event.type === 'response.completed' || event.type === 'response.incomplete') {
      assert.equal(final, null, 'one terminal event');
      final = event.response;
      continue;
    }
    snapshot = accumulateResponse(event, snapshot);
  }
  assert.ok(final, 'a terminal event');
  return { final, snapshot };
}

const tellMe = [{ role: 'user', content: 'Tell me a fortune.' }];

test('a string input: the chat completion\'s text and usage, as a Response; streamed events add up to it', async () => {
  const chat = await client.chat.completions.create({ model, messages: tellMe, temperature: 0, max_tokens: 12 });
  const params = { model, input: 'Tell me a fortune.', temperature: 0, max_output_tokens: 12 };
  const r = await client.responses.create(params);
  assert.equal(r.object, 'response');
  assert.ok(r.id.startsWith('resp_'));
  assert.equal(r.output_text, chat.choices[0].message.content);
  assert.equal(r.status, 'incomplete');
  assert.deepEqual(r.incomplete_details, { reason: 'max_output_tokens' });
  assert.equal(r.usage.input_tokens, chat.usage.prompt_tokens);
  assert.equal(r.usage.output_tokens, 12);
  assert.equal(r.usage.total_tokens, chat.usage.total_tokens);
  assert.equal(r.max_output_tokens, 12);
  assert.equal(r.output.length, 1);
  assert.equal(r.output[0].type, 'message');
  const { final, snapshot } = await streamed(params);
  assert.equal(final.status, 'incomplete');
  assert.deepEqual(withoutIds(snapshot.output), withoutIds(final.output), 'the deltas add up to the response');
  assert.deepEqual(withoutIds(final.output), withoutIds(r.output));
  assert.deepEqual(final.usage, r.usage);
  const helper = await client.responses.stream(params).finalResponse();
  assert.equal(helper.output_text, r.output_text);
});

test('instructions and input items are the chat\'s messages', async () => {
  const messages = [{ role: 'system', content: 'Answer briefly.' }, ...tellMe,
                    { role: 'assistant', content: 'You will travel.' }, { role: 'user', content: 'And then?' }];
  const chat = await client.chat.completions.create({ model, messages, temperature: 0, max_tokens: 16, ignore_eos: true });
  const r = await client.responses.create({
    model, instructions: 'Answer briefly.', temperature: 0, max_output_tokens: 16, ignore_eos: true,
    input: [{ type: 'message', role: 'user', content: [{ type: 'input_text', text: 'Tell me ' }, { type: 'input_text', text: 'a fortune.' }] },
            { role: 'assistant', content: [{ type: 'output_text', text: 'You will travel.' }] },
            { role: 'user', content: 'And then?' }] });
  assert.equal(r.output_text, chat.choices[0].message.content);
  assert.equal(r.instructions, 'Answer briefly.');
  // A developer message is a system message.
  const dev = await client.responses.create({ model, input: [{ role: 'developer', content: 'Answer briefly.' }, ...tellMe],
                                              temperature: 0, max_output_tokens: 8 });
  const devChat = await client.chat.completions.create({ model, messages: [messages[0], ...tellMe], temperature: 0,
                                                         max_tokens: 8 });
  assert.equal(dev.output_text, devChat.choices[0].message.content);
});

const weather = { type: 'object', properties: { city: { type: 'string', maxLength: 12 }, days: { type: 'integer' } },
                  required: ['city'] };
const tools = [{ type: 'function', name: 'get_weather', description: 'The weather', parameters: weather }];

test('function tools: forced calls are function_call items, streamed as their events; a call and its output as input',
     async () => {
  const validate = new Ajv().compile(weather);
  for (const tool_choice of ['required', { type: 'function', name: 'get_weather' }]) {
    const params = { model, input: tellMe, tools, tool_choice, temperature: 0, max_output_tokens: 400 };
    const r = await client.responses.create(params);
    assert.equal(r.status, 'completed', JSON.stringify(r.output));
    assert.ok(r.output.length >= 1);
    for (const item of r.output) {
      assert.equal(item.type, 'function_call');
      assert.equal(item.name, 'get_weather');
      assert.ok(validate(JSON.parse(item.arguments)), item.arguments);
      assert.ok(item.call_id.length > 0);
    }
    const { final, snapshot } = await streamed(params);
    assert.deepEqual(withoutIds(snapshot.output).map(({ call_id, ...x }) => x),
                     withoutIds(final.output).map(({ call_id, ...x }) => x));
    assert.deepEqual(final.output.map((i) => i.arguments), r.output.map((i) => i.arguments));
  }
  // A model's text with a call (forced by a regex) under the hermes parser: a message, then a function_call.
  const text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>';
  const regex = text.replace(/[.{}]/g, '\\$&');
  const mixed = { model, input: tellMe, tools, temperature: 0, max_output_tokens: 80, guided_regex: regex };
  const r = await client.responses.create(mixed);
  assert.deepEqual(r.output.map((i) => i.type), ['message', 'function_call']);
  assert.equal(r.output_text.trim(), 'Let me check.');
  assert.deepEqual(JSON.parse(r.output[1].arguments), { city: 'Paris' });
  const { final, snapshot } = await streamed(mixed);
  assert.deepEqual(withoutIds(snapshot.output).map(({ call_id, ...x }) => x), withoutIds(final.output).map(({ call_id, ...x }) => x));
  assert.deepEqual(final.output.map((i) => i.type), ['message', 'function_call']);
  // Two calls; parallel_tool_calls false keeps the first (streamed too).
  const two = text + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>';
  const both = { ...mixed, guided_regex: two.replace(/[.{}]/g, '\\$&'), max_output_tokens: 250 };
  assert.deepEqual((await client.responses.create(both)).output.map((i) => i.type), ['message', 'function_call', 'function_call']);
  const single = await client.responses.create({ ...both, parallel_tool_calls: false });
  assert.deepEqual(single.output.map((i) => i.type), ['message', 'function_call']);
  assert.deepEqual(JSON.parse(single.output[1].arguments), { city: 'Paris' });
  assert.equal(single.parallel_tool_calls, false);
  const singleStreamed = await streamed({ ...both, parallel_tool_calls: false });
  assert.deepEqual(singleStreamed.final.output.map((i) => i.type), ['message', 'function_call']);
  assert.deepEqual(withoutIds(singleStreamed.snapshot.output).map(({ call_id, ...x }) => x),
                   withoutIds(singleStreamed.final.output).map(({ call_id, ...x }) => x));
  // The call and its output sent back: the chat's assistant tool_calls and tool message.
  const chat = await client.chat.completions.create({ model, temperature: 0, max_tokens: 10, ignore_eos: true, tools: [
    { type: 'function', function: { name: 'get_weather', parameters: weather } }], messages: [...tellMe,
    { role: 'assistant', content: '', tool_calls: [{ id: 'c1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
    { role: 'tool', tool_call_id: 'c1', content: 'sunny' }] });
  const back = await client.responses.create({ model, temperature: 0, max_output_tokens: 10, ignore_eos: true, tools,
    input: [...tellMe, { type: 'function_call', call_id: 'c1', name: 'get_weather', arguments: '{"city": "Paris"}' },
            { type: 'function_call_output', call_id: 'c1', output: 'sunny' }] });
  assert.equal(back.output_text, chat.choices[0].message.content);
});

test('text.format json_schema: the output parses and meets the schema', async () => {
  const validate = new Ajv().compile(weather);
  const r = await client.responses.create({ model, input: tellMe, max_output_tokens: 60, temperature: 0,
                                            text: { format: { type: 'json_schema', name: 'w', schema: weather, strict: true } } });
  assert.equal(r.status, 'completed');
  assert.ok(validate(JSON.parse(r.output_text)), r.output_text);
  assert.deepEqual(r.text.format.schema, weather);
});

test('what is not served is a 400 naming it; the request\'s fields echo in the response', async () => {
  const bad = async (params, param) => assert.rejects(client.responses.create({ model, input: 'Hi', ...params }),
    (e) => e instanceof OpenAI.BadRequestError && e.error?.param === param, JSON.stringify(params));
  await bad({ previous_response_id: 'resp_1' }, 'previous_response_id');
  await bad({ store: true }, 'store');
  await bad({ background: true }, 'background');
  await bad({ reasoning: { effort: 'high' } }, 'reasoning');
  await bad({ include: ['reasoning.encrypted_content'] }, 'include');
  await bad({ tools: [{ type: 'web_search' }] }, 'tools');
  await bad({ input: [{ type: 'input_image' }] }, 'input');
  await bad({ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'x' }] }] }, 'input');
  await bad({ input: 7 }, 'input');
  await bad({ text: { format: { type: 'grammar' } } }, 'text');
  await bad({ temperature: -1 }, 'temperature');
  await assert.rejects(client.responses.create({ model: 'nope', input: 'Hi' }), (e) => e.status === 404);
  const r = await client.responses.create({ model, input: 'Hi', max_output_tokens: 2, metadata: { k: 'v' }, store: false,
                                            top_p: 0.5, reasoning: {}, include: [] });
  assert.deepEqual(r.metadata, { k: 'v' });
  assert.equal(r.store, false);
  assert.equal(r.top_p, 0.5);
});
