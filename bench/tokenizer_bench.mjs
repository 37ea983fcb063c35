// The Hugging Face side of the tokenizer benchmark (bench/tokenizer_bench.sh).
// Builds ~10 MB of mixed text (prose, code, CJK, Cyrillic, Arabic, emoji, random
// Unicode; seeded), encodes it one document at a time with Hugging Face tokenizers
// (native build, single-threaded: each call awaits the previous one), and writes
//   OUT_DIR/docs.jsonl   {"text": ..., "ids": [...]} per document
//   OUT_DIR/hf.json      {"bytes": N, "seconds": [per run], "mb_per_s": median}
import fs from "node:fs";
import path from "node:path";

import { make_corpus, mulberry32 } from "../tools/tokenizer/corpus.mjs";
import { load_tokenizer } from "../tools/tokenizer/oracle.mjs";

const WORDS = ("the of and to in is that it for was on are as with his they at be this from have or by one had not " +
  "but what all were when we there can an your which their said if do will each about how up out them then she many " +
  "some so these would other into has more her two like him see time could no make than first been its who now people " +
  "my made over did down only way find use may water long little very after words called just where most know get " +
  "through back much before go good new write our used me man too any day same right look think also around another " +
  "came come work three word must because does part even place well such here take why things help put years different " +
  "away again off went old number great tell men say small every found still between name should Home big give air line " +
  "set own under read last never us left end along while might next sound below saw something thought both few those " +
  "always looked show large often together asked house don't world going want school important until form food keep " +
  "children feet land side without boy once animals life enough took sometimes four head above kind began almost live " +
  "page got earth need far hand high year mother light parts country father let night following picture being study " +
  "second eyes soon times story boys since white days ever paper hard near sentence better best across during today").split(" ");
const CODE = [
  "def compute(values, scale=1.0):\n    total = 0\n    for v in values:\n        total += v * scale\n    return total\n\n",
  "for (size_t i = 0; i < n; ++i) {\n  out[i] = std::max(in[i], 0.0f);\n}\n",
  "const result = await fetch(`${base}/api/v1/items?limit=${limit}`);\nif (!result.ok) throw new Error(result.statusText);\n",
  "SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 100;\n",
  "{\"model\": \"qwen3\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 0.7}\n",
];
const CJK = ["人工智能正在改变我们的生活方式，", "今天天气很好，我们去公园散步吧。", "機械学習モデルの推論を高速化する。",
  "대규모 언어 모델은 많은 데이터로 학습된다. "];
const OTHER = ["Быстрая коричневая лиса прыгает через ленивую собаку. ", "مرحبا بك في عالم الذكاء الاصطناعي. ",
  "नमस्ते दुनिया, यह एक परीक्षण है। ", "Η γρήγορη καφέ αλεπού πηδά. ", "🚀 launch 🎉 party 👍🏽 ok 👨‍👩‍👧 family "];

function make_documents(total_bytes, doc_bytes) {
  const rng = mulberry32(99);
  const random_strings = make_corpus(2000, 4242);
  const docs = [];
  let size = 0;
  while (size < total_bytes) {
    let doc = "";
    while (Buffer.byteLength(doc) < doc_bytes) {
      const r = rng();
      if (r < 0.55) {
        const n = 5 + Math.floor(rng() * 20);
        const words = [];
        for (let i = 0; i < n; ++i) words.push(WORDS[Math.floor(rng() * WORDS.length)]);
        words[0] = words[0][0].toUpperCase() + words[0].slice(1);
        doc += words.join(" ") + (rng() < 0.8 ? ". " : ",\n");
      } else if (r < 0.7) doc += CODE[Math.floor(rng() * CODE.length)];
      else if (r < 0.82) doc += CJK[Math.floor(rng() * CJK.length)];
      else if (r < 0.94) doc += OTHER[Math.floor(rng() * OTHER.length)];
      else doc += random_strings[Math.floor(rng() * random_strings.length)] + " ";
    }
    docs.push(doc);
    size += Buffer.byteLength(doc);
  }
  return { docs, size };
}

async function main() {
  const out_dir = process.argv[2];
  const num_runs = Number(process.argv[3] || 5);
  fs.mkdirSync(out_dir, { recursive: true });
  const { docs, size } = make_documents(10 * 1000 * 1000, 10000);
  const tok = load_tokenizer();
  const all_ids = [];
  const seconds = [];
  for (let run = 0; run < num_runs; ++run) {
    const start = process.hrtime.bigint();
    for (let i = 0; i < docs.length; ++i) {
      const enc = await tok.encode(docs[i], null, { addSpecialTokens: false });
      if (run === 0) all_ids.push(Array.from(enc.getIds()));
    }
    seconds.push(Number(process.hrtime.bigint() - start) / 1e9);
  }
  const sorted = [...seconds].sort((a, b) => a - b);
  const median = sorted[Math.floor(sorted.length / 2)];
  fs.writeFileSync(path.join(out_dir, "docs.jsonl"), docs.map((t, i) => JSON.stringify({ text: t, ids: all_ids[i] })).join("\n") + "\n");
  const result = { bytes: size, num_docs: docs.length, seconds, mb_per_s: size / 1e6 / median };
  fs.writeFileSync(path.join(out_dir, "hf.json"), JSON.stringify(result));
  console.log(`HF tokenizers: ${(size / 1e6).toFixed(2)} MB in ${docs.length} documents, median ${median.toFixed(3)} s, ${result.mb_per_s.toFixed(2)} MB/s`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
