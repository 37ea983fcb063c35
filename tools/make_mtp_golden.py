#!/usr/bin/env python3
"""Golden draft logits for the C++ MTP module (tests/model/mtp_test.cc), from
the plain-PyTorch reference in tools/mtp_torch.py.

Target: tests/data/golden/moe_basic (a tiny Qwen3-MoE). MTP: random weights
(seeded, MoE MLP like the target's, stored bf16) written to
OUT/model.safetensors. For a fixed prompt x_0..x_{P-1} it records, in float32:
  - next_token: the target's greedy token x_P;
  - logits[t] for t = 0..P-1: the MTP at position t with the target's last
    hidden state h_t and token x_{t+1} (x_P for the last row);
  - chained_logits: one chained step at position P, with the MTP's own output
    at P-1 as h and its argmax draft as the token (draft recorded).

Usage: python3 tools/make_mtp_golden.py [--out tests/data/mtp_golden]
Runs on CPU in a few seconds (torch only).
       python3 tools/make_mtp_golden.py --check tests/data/mtp_golden [--device cuda]
recomputes the golden from the stored MTP weights (on a GPU with --device
cuda, float32 with TF32 off) and compares: same next token and draft, logits
within 1e-4 of the largest. Exit status 1 when they differ.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtp_torch as M  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1, 17, 99, 250, 3, 77, 402, 12, 64, 300, 5, 188]


def compute(cfg, w, mtp, device):
    """next token, MTP logits [P, vocab], draft, chained logits [vocab] on `device`."""
    dev = torch.device(device)
    w = {k: v.to(dev) for k, v in w.items()}
    mtp = {k: v.to(dev) for k, v in mtp.items()}
    ids = torch.tensor([PROMPT], device=dev)
    P = len(PROMPT)
    with torch.no_grad():
        h = M.target_hidden(cfg, w, ids)
        next_token = int((h[0, -1] @ M.lm_head(cfg, w).t()).argmax())
        next_ids = torch.tensor([PROMPT[1:] + [next_token]], device=dev)
        o, logits = M.mtp_forward(cfg, w, mtp, h, next_ids, torch.arange(P, device=dev))
        draft = int(logits[0, -1].argmax())
        # The chained step: row P sees h = o_{P-1} and the draft; causal, so rows < P are unchanged.
        h2 = torch.cat([h, o[:, -1:]], 1)
        ids2 = torch.cat([next_ids, torch.tensor([[draft]], device=dev)], 1)
        _, logits2 = M.mtp_forward(cfg, w, mtp, h2, ids2, torch.arange(P + 1, device=dev))
    return next_token, logits[0].cpu(), draft, logits2[0, -1].cpu()


def check(args, cfg, w):
    stored = json.load(open(os.path.join(args.check, "golden.json")))
    mtp = M.read_safetensors(os.path.join(args.check, "model.safetensors"))
    next_token, logits, draft, chained = compute(cfg, w, mtp, args.device)
    want, want_chained = torch.tensor(stored["logits"]), torch.tensor(stored["chained_logits"])
    scale = float(want.abs().max())
    err = max(float((logits - want).abs().max()), float((chained - want_chained).abs().max())) / scale
    ok = next_token == stored["next_token"] and draft == stored["draft"] and err <= 1e-4
    print(f"{args.check}: recomputed on {args.device} with torch {torch.__version__} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}): next token {next_token} "
          f"(stored {stored['next_token']}), draft {draft} (stored {stored['draft']}), largest logit difference "
          f"{err:.2e} of the largest logit: {'MATCH' if ok else 'DIFFER'} (stored by: {stored['tool']})")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=os.path.join(ROOT, "tests/data/golden/moe_basic"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/data/mtp_golden"))
    ap.add_argument("--check", default="", help="a golden directory to recompute and compare instead of writing")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (--check only)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = M.Cfg(json.load(open(os.path.join(args.target, "config.json"))))
    w = M.read_safetensors(os.path.join(args.target, "model.safetensors"))
    if args.check:
        return check(args, cfg, w)
    mtp = M.random_mtp(cfg, torch.Generator().manual_seed(20261130), moe=True)
    os.makedirs(args.out, exist_ok=True)
    M.write_safetensors(os.path.join(args.out, "model.safetensors"), mtp)
    mtp = M.read_safetensors(os.path.join(args.out, "model.safetensors"))  # exactly what C++ reads
    next_token, logits, draft, logits2 = compute(cfg, w, mtp, "cpu")
    golden = {
        "target": "tests/data/golden/moe_basic",
        "prompt": PROMPT,
        "next_token": next_token,
        "logits": [[round(float(v), 6) for v in row] for row in logits],
        "draft": draft,
        "chained_logits": [round(float(v), 6) for v in logits2],
        "tool": "tools/make_mtp_golden.py (torch %s, float32 on CPU)" % torch.__version__,
    }
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
    print(f"wrote {args.out}: next token {next_token}, draft {draft}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
