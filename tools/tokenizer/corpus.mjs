// The tokenizer test corpus: hand-picked hard cases plus seeded random text, the
// same on every run (mulberry32 with fixed seeds). Used by oracle.mjs.

export function mulberry32(seed) {
  return function () {
    seed |= 0;
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const FIXED = [
  "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "Hello, world!", "hello world",
  "The quick brown fox jumps over the lazy dog.",
  "I'm you're he's she'd we'll they've it's don't I'D YOU'RE HE'S SHE'LL WE'VE THEY'D DON'T",
  "iT'S wE'Re tHeY'Ve i'M yOu'Ll sHe'D",
  "'s 't 're 've 'm 'll 'd", "''''''", "’s curly quote’s",
  "1234567890", "3.14159 2,718 1e-10 0x1F 1_000_000", "٣٤٥ ١٢ ๑๒๓ ১২৩ 一二三 Ⅻ ½ ²",
  "中文测试：你好，世界！这是一个测试。", "日本語のテキスト、カタカナとひらがな。", "한국어 텍스트 테스트입니다.",
  "Русский текст: съешь же ещё этих мягких французских булок.", "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
  "العربية: نص تجريبي مع أرقام ١٢٣", "עברית: טקסט לבדיקה", "हिन्दी: यह एक परीक्षण वाक्य है।", "தமிழ் உரை", "ไทย ภาษาไทย",
  "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇺🇸🇯🇵 ❤️ 🧑🏿‍💻 😀😃😄", "e\u0301 a\u0300\u0301 n\u0303 \u0041\u030A \u1E9B\u0323", "Zalgo: Z̴̡̢̛̛a̷̧̛l̸̢g̵̨o̶",
  "Å Å Å ﬁ ﬀ ㎏ ℃ Ω Ω", "\u00A0non-breaking\u00A0space\u2009thin\u3000ideographic",
  "def foo(x):\n    return x ** 2\n\n\nclass Bar:\n\tpass\n",
  "for (int i = 0; i < n; ++i) { sum += a[i]; }\n#include <vector>\n// comment",
  "if x == 1 and y != 2 or not z: print(f\"{x!r:>10}\")", "<html><body><div class=\"a\">text</div></body></html>",
  "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';", "https://example.com/path?query=1&b=2#frag",
  "    leading spaces", "trailing spaces    ", "mid    spaces   here", "tabs\t\t\tand\t\tmore", "\r\n\r\nwindows\r\nlines",
  "a\n\n\n\n\n\n\n\nb", " \n \n \n", "          \n", "\n          ", "x" + " ".repeat(200) + "y", "\n".repeat(100),
  "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more text", "<|im_end|><|im_end|>",
  "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<|im_start", "<|im_start|",
  "|im_start|>", "<<|im_start|>>", "<|fim_prefix|>def<|fim_suffix|>x<|fim_middle|>", "<|vision_start|><|image_pad|><|vision_end|>",
  "!!!???...,,,;;;", "$$$ %%% &&& *** @@@", "—–-‐ … «» „“ ‘’", "ab12cd34", "x=1+2*3/4-5", "a.b.c.d", "...hello...",
  "\u200B\u200C\u200D\uFEFF zero width", "\u180E mongolian vowel separator", "\u2028line\u2029para\u0085nel",
  "𝕳𝖊𝖑𝖑𝖔 𝓦𝓸𝓻𝓵𝓭 𝟙𝟚𝟛", "🀄🃏🎴 𐍈 𓀀 𝄞", "ſ's 'S 'ſ", "a".repeat(300), "ab".repeat(200), "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0123456789+/".repeat(5), "🙂".repeat(40), "é".repeat(100), "\u0000\u0001\u0007\u001b[0m", "ÀÉÎÕÜ àéîõü ñÑ çÇ ßẞ",
];

const POOLS = {
  latin: "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
  digits: "0123456789",
  punct: "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
  space: [" ", " ", " ", "  ", "\n", "\t", "\r\n", "\n\n", "   ", "\u00A0", "\u3000"],
  cjk: "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长",
  cyrillic: "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЁЖЗИЙКЛМНОПРСТУФХЦЧШЩЪЫЬЭЮЯ",
  arabic: "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
  devanagari: "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह\u093E\u093F\u0940\u0941\u0942\u0947\u0948\u094B\u094C\u094D\u0902",
  greek: "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩάέήίόύώ",
  combining: ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u0323", "\u0327", "\u0338", "\u20DD", "\u0345"],
  emoji: ["😀", "👍", "👍🏻", "👍🏿", "👨‍👩‍👧", "👩‍💻", "🏳️‍🌈", "🇫🇷", "❤️", "✨", "🔥", "🤖", "👋🏽", "🧑‍🤝‍🧑"],
  code: ["def ", "return ", "if ", "else:", "{", "}", "(", ")", "[]", "=>", "==", "!=", "++", "->", "::", "//", "/*", "*/",
         "#include", "std::vector<int>", "self.", "None", "null", "0x", "\"", "'", ";\n", "    ", "\t"],
  contractions: ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D", "'rE", "'lL"],
  specials: ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
             "<tool_response>", "<|fim_pad|>", "<|im_sta", "|>", "<|"],
};

function pick(rng, list) {
  return list[Math.floor(rng() * list.length)];
}

// A code point from all of Unicode, biased to the planes that hold text; never a
// surrogate (JSON and UTF-8 cannot carry a lone one).
function random_code_point(rng) {
  const r = rng();
  let cp;
  if (r < 0.3) cp = 0x20 + Math.floor(rng() * 0x5f);
  else if (r < 0.6) cp = 0x80 + Math.floor(rng() * (0x3000 - 0x80));
  else if (r < 0.85) cp = Math.floor(rng() * 0x10000);
  else cp = 0x10000 + Math.floor(rng() * 0x30000);
  if (cp >= 0xd800 && cp <= 0xdfff) cp = 0x41;
  return String.fromCodePoint(cp);
}

function random_fragment(rng) {
  const kind = pick(rng, Object.keys(POOLS).concat(["random", "random", "word", "number"]));
  if (kind === "random") return random_code_point(rng);
  if (kind === "word") {
    let w = rng() < 0.5 ? " " : "";
    const n = 1 + Math.floor(rng() * 10);
    for (let i = 0; i < n; ++i) w += pick(rng, POOLS.latin);
    return w;
  }
  if (kind === "number") return String(Math.floor(rng() * 10 ** (1 + Math.floor(rng() * 12))));
  const pool = POOLS[kind];
  return typeof pool === "string" ? [...pool][Math.floor(rng() * [...pool].length)] : pick(rng, pool);
}

// Returns the corpus: FIXED, then `count` seeded random strings of mixed fragments.
export function make_corpus(count = 2400, seed = 20261130) {
  const rng = mulberry32(seed);
  const out = [...FIXED];
  for (let i = 0; i < count; ++i) {
    const n = 1 + Math.floor(rng() ** 2 * 120);
    let s = "";
    // Most strings stay in one script; some mix everything.
    const mono = rng() < 0.4 ? pick(rng, ["latin", "cjk", "cyrillic", "arabic", "devanagari", "greek", "emoji"]) : null;
    for (let j = 0; j < n; ++j) {
      if (mono && rng() < 0.8) {
        const pool = POOLS[mono];
        s += typeof pool === "string" ? [...pool][Math.floor(rng() * [...pool].length)] : pick(rng, pool);
        if (rng() < 0.2) s += " ";
      } else {
        s += random_fragment(rng);
      }
    }
    out.push(s);
  }
  return out;
}
