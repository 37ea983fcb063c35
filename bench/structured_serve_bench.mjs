// Structured outputs against plain decoding on the demo model (CPU): 4 requests x n = 8
// sampled choices of up to 96 tokens at once, three rounds; prints output tokens per
// second. Run: MOESERVE_BIN=build/bin/moeserve node bench/structured_serve_bench.mjs
import OpenAI from 'openai';
import { startServer } from '../tests/server/server_harness.mjs';
const server = await startServer(['--max-model-len', '512', '--max-num-seqs', '64']);
const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'x', maxRetries: 0 });
const messages = [{ role: 'user', content: 'Tell me a fortune as JSON.' }];
const schema = { type: 'object', properties: { mood: { enum: ['good', 'bad'] }, luck: { type: 'integer' },
  fortune: { type: 'string' } }, required: ['mood', 'luck', 'fortune'] };
async function round(extra, label) {
  const t0 = performance.now();
  const rs = await Promise.all(Array.from({ length: 4 }, (_, i) => client.chat.completions.create({
    model: 'moeserve-demo', messages, temperature: 1, seed: i, n: 8, max_tokens: 96, ...extra })));
  const s = (performance.now() - t0) / 1e3;
  const tokens = rs.reduce((a, r) => a + r.usage.completion_tokens, 0);
  console.log(`${label}: ${tokens} tokens in ${s.toFixed(2)} s = ${(tokens / s).toFixed(0)} tok/s`);
}
for (let k = 0; k < 3; k++) {
  await round({}, 'plain');
  await round({ response_format: { type: 'json_schema', json_schema: { name: 'f', schema } } }, 'json_schema');
  await round({ response_format: { type: 'json_object' } }, 'json_object');
}
await server.stop();
