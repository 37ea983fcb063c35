#!/usr/bin/env python3
"""Trains an MTP layer (src/model/mtp.h) for the bundled demo model, with the
target frozen, on CPU in plain PyTorch (no transformers), so speculative
decoding on the demo shows a real acceptance rate (docs/speculative.md).

Data: the fortunes of Debian's `fortunes` package (/usr/share/games/fortunes),
built into documents as tools/train_tiny.py does (plain text, and ChatML
conversations), tokenized with moeserve's own tokenizer (`moeserve tokenize`,
which matches Hugging Face tokenizers on this tokenizer.json).

Objective: distillation. At position t the MTP sees the target's last hidden
state h_t (after the final norm) and the data token x_{t+1}; it is trained to
predict the target's own greedy token for x_{t+2} (the argmax of the target's
logits at t + 1), which is what greedy verification accepts. The frozen
target's hidden states and greedy tokens are computed once for a sample of
sequences (--precompute-seconds), then the MTP trains on them. The MTP block
has a dense MLP (intermediate_size of the config); its attention starts from
the target's last layer.

Output: OUT_DIR/model.safetensors (bf16, tensor names of src/model/mtp.h) and
OUT_DIR/train_log.txt. About 8 minutes on one CPU thread (torch.set_num_threads(1)).

Usage: nice /usr/bin/python3 tools/train_mtp.py --model models/moeserve-demo --out models/moeserve-demo-mtp \
           --moeserve build-mtp/bin/moeserve [--seconds 420]
"""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_torch as M  # noqa: E402

SEED = 20261130
ASKS = ["Tell me a fortune.", "Give me a quote.", "Say something wise.", "Tell me something.",
        "What does my fortune cookie say?", "Share a saying.", "Tell me a joke.", "Any words of wisdom?"]
TOPIC_ASKS = ["Tell me something about {t}.", "Give me a quote about {t}.", "Say something about {t}."]
LOG = []


def log(msg):
    line = f"[train_mtp {time.strftime('%H:%M:%S')}] {msg}"
    LOG.append(line)
    print(line, flush=True)


def documents(data_dir, rng):
    docs = []
    for name in sorted(os.listdir(data_dir)):
        path = os.path.join(data_dir, name)
        if "." in name or not os.path.isfile(path):
            continue
        text = open(path, encoding="utf-8", errors="replace").read()
        for f in re.split(r"\n%\n", text):
            f = f.strip("\n")
            if not (20 <= len(f) <= 700) or "\ufffd" in f:
                continue
            docs.append(f + "<|endoftext|>")
            ask = rng.choice(TOPIC_ASKS).format(t=name.replace("-", " ")) if rng.random() < 0.4 else rng.choice(ASKS)
            docs.append(f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{f}<|im_end|>\n<|endoftext|>")
    rng.shuffle(docs)
    return docs


def tokenize(moeserve, model_dir, docs):
    text = "\n".join(json.dumps(d) for d in docs) + "\n"
    out = subprocess.run([moeserve, "tokenize", "--model", model_dir], input=text.encode(), capture_output=True,
                         check=True)
    ids = []
    for line in out.stdout.decode().splitlines():
        ids.extend(json.loads(line))
    return ids


def init_mtp(cfg, w, gen):
    m = M.random_mtp(cfg, gen, moe=False)
    last = f"model.layers.{cfg.layers - 1}."
    for suffix in ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                   "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                   "self_attn.q_norm.weight", "self_attn.k_norm.weight"]:
        m["mtp.layers.0." + suffix] = w[last + suffix].clone()
    return {k: v.clone().requires_grad_(True) for k, v in m.items()}


@torch.no_grad()
def precompute(cfg, w, data, seq, seconds, gen):
    """Random windows x [N, seq] with the target's hidden states [N, seq, hidden] and greedy tokens [N, seq]."""
    xs, hs, ys, start = [], [], [], time.time()
    while time.time() - start < seconds:
        starts = torch.randint(0, len(data) - seq - 1, (8,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts.tolist()])
        h = M.target_hidden(cfg, w, x)
        xs.append(x), hs.append(h), ys.append((h @ M.lm_head(cfg, w).t()).argmax(-1))
    return torch.cat(xs), torch.cat(hs), torch.cat(ys)


def batch_loss(cfg, w, mtp, x, h, y):
    """Loss and greedy agreement of the MTP with the target's token x_{t+2} (y at t + 1)."""
    T = x.shape[1]
    _, logits = M.mtp_forward(cfg, w, mtp, h[:, :T - 1], x[:, 1:T], torch.arange(T - 1))
    target = y[:, 1:T]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    agree = (logits.argmax(-1) == target).float().mean().item()
    return loss, agree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/moeserve-demo")
    ap.add_argument("--out", default="models/moeserve-demo-mtp")
    ap.add_argument("--data", default="/usr/share/games/fortunes")
    ap.add_argument("--moeserve", default="build-mtp/bin/moeserve")
    ap.add_argument("--seconds", type=float, default=360)
    ap.add_argument("--precompute-seconds", type=float, default=90)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    cfg = M.Cfg(json.load(open(os.path.join(args.model, "config.json"))))
    w = M.read_safetensors(os.path.join(args.model, "model.safetensors"))
    ids = tokenize(args.moeserve, args.model, documents(args.data, rng))
    log(f"{len(ids)} tokens of fortunes")
    split = int(len(ids) * 0.98)
    train, held = torch.tensor(ids[:split]), torch.tensor(ids[split:])
    gen = torch.Generator().manual_seed(SEED)
    X, H, Y = precompute(cfg, w, train, args.seq, args.precompute_seconds, gen)
    Xh, Hh, Yh = precompute(cfg, w, held, args.seq, 1, gen)
    log(f"target states of {X.numel()} training and {Xh.numel()} held-out tokens")
    mtp = init_mtp(cfg, w, gen)
    opt = torch.optim.AdamW(list(mtp.values()), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    start, step = time.time(), 0
    while time.time() - start < args.seconds:
        frac = (time.time() - start) / args.seconds
        lr = 3e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(0, X.shape[0], (args.batch,), generator=gen)
        loss, agree = batch_loss(cfg, w, mtp, X[pick], H[pick], Y[pick])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(mtp.values()), 1.0)
        opt.step()
        if step % 25 == 0:
            log(f"step {step} loss {loss.item():.3f} greedy agreement {agree:.3f} lr {lr:.1e} ({time.time() - start:.0f} s)")
        step += 1
    with torch.no_grad():
        loss, agree = batch_loss(cfg, w, {k: M.bf16_round(v) for k, v in mtp.items()}, Xh, Hh, Yh)
    log(f"trained {step} steps; held-out (bf16 weights): loss {loss.item():.3f}, greedy agreement {agree:.3f}")
    os.makedirs(args.out, exist_ok=True)
    M.write_safetensors(os.path.join(args.out, "model.safetensors"), mtp)
    with open(os.path.join(args.out, "train_log.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
