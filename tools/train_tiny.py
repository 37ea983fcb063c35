#!/usr/bin/env python3
"""Trains moeserve's bundled demo model: a tiny Qwen3-MoE that writes
fortune-cookie English, with its own byte-level BPE tokenizer and a ChatML
chat template. Runs where PyTorch, transformers and tokenizers are installed
(an H200 machine; about two minutes of training).

Training text: the fortune databases of the Debian package `fortunes`
(/usr/share/games/fortunes, public domain and freely redistributable quotes),
copied into DATA_DIR. Each fortune is used twice: as plain text, and as the
assistant's answer in a ChatML conversation whose user turn asks for a fortune
(sometimes naming the database's topic), so the model learns the chat format.

Outputs (OUT_DIR): config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json (with the chat template), generation_config.json, and
golden.json: transformers' token ids of a few chat prompts (rendered with
apply_chat_template) and text prompts, and their greedy continuations computed
in float32 from the saved bf16 weights (manual argmax loop, eos not treated
specially), with the top-1/top-2 margin of every step.

Usage: python3 tools/train_tiny.py DATA_DIR OUT_DIR [--seconds 120]
"""
import argparse
import json
import math
import os
import random
import re
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM

SEED = 20261130
VOCAB = 4096
SEQ = 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pretokenizer pattern (what moeserve's tokenizer implements).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
ASKS = ["Tell me a fortune.", "Give me a quote.", "Say something wise.", "Tell me something.",
        "What does my fortune cookie say?", "Share a saying.", "Tell me a joke.", "Any words of wisdom?"]
TOPIC_ASKS = ["Tell me something about {t}.", "Give me a quote about {t}.", "Say something about {t}."]

GOLDEN_CHATS = [
    [{"role": "user", "content": "Tell me a fortune."}],
    [{"role": "user", "content": "Give me a quote about science."}],
    [{"role": "system", "content": "You are a fortune cookie."},
     {"role": "user", "content": "Say something wise."}],
    [{"role": "user", "content": "Tell me something about love."},
     {"role": "assistant", "content": "Love is a many splendored thing."},
     {"role": "user", "content": "Tell me a joke."}],
]
GOLDEN_TEXTS = ["The best way to predict the future is", "A computer", "Q: Why did the chicken cross the road?\nA:"]


def log(msg):
    print(f"[train_tiny {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_fortunes(data_dir):
    items = []
    for name in sorted(os.listdir(data_dir)):
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        for f in re.split(r"\n%\n", text):
            f = f.strip("\n")
            if 20 <= len(f) <= 700 and "\ufffd" not in f:
                items.append((name.replace("-", " "), f))
    return items


def render(messages, add_generation_prompt=False):
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def build_documents(fortunes, rng):
    docs = []
    for topic, f in fortunes:
        docs.append(f + "<|endoftext|>")
        ask = rng.choice(TOPIC_ASKS).format(t=topic) if rng.random() < 0.4 else rng.choice(ASKS)
        msgs = [{"role": "user", "content": ask}, {"role": "assistant", "content": f}]
        if rng.random() < 0.15:
            msgs.insert(0, {"role": "system", "content": "You are a fortune cookie."})
        docs.append(render(msgs) + "<|endoftext|>")
    rng.shuffle(docs)
    return docs


def train_tokenizer(docs):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def model_config(tok):
    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=tok.get_vocab_size(), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=192, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"),
        output_router_logits=True, router_aux_loss_coef=0.01, attention_dropout=0.0)


def train(model, ids, seconds, device):
    data = torch.tensor(ids, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batch, step, start = 64, 0, time.time()
    g = torch.Generator().manual_seed(SEED)
    model.train()
    while True:
        elapsed = time.time() - start
        if elapsed > seconds:
            break
        frac = elapsed / seconds
        lr = 3e-3 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        # transformers shifts labels itself; the +1 column is unused.
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            log(f"step {step} loss {out.loss.item():.3f} lr {lr:.2e} ({elapsed:.0f} s)")
        step += 1
    log(f"trained {step} steps, {step * batch * SEQ / 1e6:.1f} M tokens")


def greedy(model, ids, n):
    seq, out, margins = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(out[-1])
    return out, margins


def write_tokenizer_files(tok, out_dir):
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                        "single_word": False, "special": True} for s in SPECIALS}
    config = {"added_tokens_decoder": added, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "errors": "replace", "split_special_tokens": False}
    json.dump(config, open(os.path.join(out_dir, "tokenizer_config.json"), "w"), indent=2)
    gen = {"bos_token_id": None, "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
           "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    json.dump(gen, open(os.path.join(out_dir, "generation_config.json"), "w"), indent=2)


class HfTokenizer:
    """transformers' tokenizer when it loads; else the tokenizers library on the same files."""

    def __init__(self, out_dir):
        self.raw = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
        try:
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(out_dir)
        except Exception as e:  # noqa: BLE001
            log(f"[warn] AutoTokenizer failed ({e}); using the tokenizers library")
            self.hf = None

    def chat_ids(self, msgs):
        ids = self.raw.encode(render(msgs, True)).ids
        if self.hf is not None:
            hf_ids = self.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(hf_ids, "keys"):
                hf_ids = hf_ids["input_ids"]
            assert [int(i) for i in hf_ids] == ids, (hf_ids, ids)
        return ids

    def text_ids(self, text):
        return self.raw.encode(text).ids

    def decode(self, ids):
        return self.raw.decode(ids, skip_special_tokens=False)


def make_golden(out_dir, n=32):
    hf_tok = HfTokenizer(out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    golden = {"model": "moeserve-demo", "n_greedy": n, "chats": [], "texts": []}
    for msgs in GOLDEN_CHATS:
        ids = hf_tok.chat_ids(msgs)
        out, margins = greedy(model, ids, n)
        golden["chats"].append({"messages": msgs, "prompt_text": render(msgs, True), "ids": ids, "greedy": out,
                                "greedy_margins": margins, "greedy_text": hf_tok.decode(out)})
        log(f"chat {msgs[-1]['content']!r} -> {hf_tok.decode(out)!r} (min margin {min(margins):.3g})")
    for text in GOLDEN_TEXTS:
        ids = hf_tok.text_ids(text)
        out, margins = greedy(model, ids, n)
        golden["texts"].append({"text": text, "ids": ids, "greedy": out, "greedy_margins": margins,
                                "greedy_text": hf_tok.decode(out)})
        log(f"text {text!r} -> {hf_tok.decode(out)!r} (min margin {min(margins):.3g})")
    import transformers
    golden["transformers_version"] = transformers.__version__
    golden["torch_version"] = torch.__version__
    json.dump(golden, open(os.path.join(out_dir, "golden.json"), "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--seconds", type=float, default=120)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    fortunes = read_fortunes(args.data_dir)
    docs = build_documents(fortunes, rng)
    log(f"{len(fortunes)} fortunes, {sum(map(len, docs)) / 1e6:.1f} M characters of documents")
    tok = train_tokenizer(docs)
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, {len(ids) / 1e6:.2f} M training tokens")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = model_config(tok)
    model = AutoModelForCausalLM.from_config(config).to(device)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {device}")
    train(model, ids, args.seconds, device)
    model.config.output_router_logits = False
    model = model.to(torch.bfloat16).cpu()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out_dir, safe_serialization=True)
    write_tokenizer_files(tok, args.out_dir)
    make_golden(args.out_dir)
    log("done")


if __name__ == "__main__":
    main()
