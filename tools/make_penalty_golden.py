#!/usr/bin/env python3
"""Greedy goldens for the logits adjustments of a request: repetition,
presence and frequency penalties, logit_bias and min_tokens.

For some golden models already in tests/data/golden (built by
make_golden.py), this script reloads the model in float32 with transformers
and, for three of the prompts in its golden.json, decodes N_GREEDY tokens by
a manual loop of full forward passes, adjusting the last position's logits
before each argmax in this order (vLLM's, which moeserve follows):

  1. min_tokens: while fewer than min_tokens tokens were generated, the stop
     tokens (eos and the request's stop_token_ids) get -inf
     (transformers' MinNewTokensLengthLogitsProcessor for eos);
  2. logit_bias: bias[t] is added to logit[t];
  3. repetition_penalty r: every token in the prompt or the output so far has
     its logit divided by r when positive, multiplied by r otherwise
     (transformers' RepetitionPenaltyLogitsProcessor, fed prompt + output);
  4. frequency / presence penalties (OpenAI's definition): logit[t] -=
     count[t] * frequency_penalty + (count[t] > 0) * presence_penalty, count
     over the output tokens only.

The loop stops after a stop token (it is the last id of `greedy`). A case is
kept only where every step's top1 - top2 margin after the adjustments is at
least MARGIN_THRESHOLD; otherwise it is reported and dropped.  Writes
penalties.json beside golden.json.

Needs torch + transformers (the device machine has them; the GPU is not used):
  python3 tools/make_penalty_golden.py --golden tests/data/golden --out /tmp/pen
then copy /tmp/pen/<model>/penalties.json into tests/data/golden/<model>/.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

MARGIN_THRESHOLD = 1e-3
N_GREEDY = 16
MODELS = ["moe_basic", "dense_qwen3"]
PROMPT_INDICES = [2, 3, 4]  # lengths 8, 17, 33 in make_golden.py's prompt list
EOS = 2

# The cases: every field a request may set; absent fields are neutral.
CASES = [
    {"name": "repetition", "repetition_penalty": 1.6},
    {"name": "repetition_below_one", "repetition_penalty": 0.7},
    {"name": "presence", "presence_penalty": 1.5},
    {"name": "frequency", "frequency_penalty": 0.9},
    {"name": "negative_frequency", "frequency_penalty": -1.2},
    {"name": "logit_bias", "logit_bias": {"17": 4.0, "300": 6.5, "5": -100.0}},
    {"name": "min_tokens", "logit_bias": {str(EOS): 100.0}, "min_tokens": 5},
    {"name": "min_tokens_stop_id", "logit_bias": {"7": 100.0}, "min_tokens": 3, "stop_token_ids": [7]},
    {
        "name": "all",
        "repetition_penalty": 1.2,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "logit_bias": {"40": 3.0},
    },
]


def log(*a):
    print(*a, flush=True)


def load_f32(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


@torch.no_grad()
def last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0, -1].to(torch.float32)


def adjust(case, logits, prompt, output):
    """The four adjustments in order; logits [V] f32, returned adjusted."""
    scores = logits.clone().unsqueeze(0)
    stop_ids = [EOS] + case.get("stop_token_ids", [])
    min_tokens = case.get("min_tokens", 0)
    if min_tokens > 0:
        # transformers' processor for eos counts generated tokens from
        # prompt_length_to_skip; the extra stop ids are banned the same way.
        ids = torch.tensor([prompt + output], dtype=torch.long)
        proc = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos_token_id=EOS)
        scores = proc(ids, scores)
        if len(output) < min_tokens:
            for t in stop_ids:
                scores[0, t] = -float("inf")
    for tok, bias in case.get("logit_bias", {}).items():
        scores[0, int(tok)] += bias
    r = case.get("repetition_penalty", 1.0)
    if r != 1.0:
        ids = torch.tensor([prompt + output], dtype=torch.long)
        scores = RepetitionPenaltyLogitsProcessor(r)(ids, scores)
    fp, pp = case.get("frequency_penalty", 0.0), case.get("presence_penalty", 0.0)
    if fp != 0.0 or pp != 0.0:
        counts = torch.zeros(scores.shape[1], dtype=torch.float32)
        for t in output:
            counts[t] += 1
        scores[0] -= counts * fp + (counts > 0).to(torch.float32) * pp
    return scores[0]


def decode(model, case, prompt):
    output, margins = [], []
    for _ in range(N_GREEDY):
        v = adjust(case, last_logits(model, prompt + output), prompt, output)
        top = torch.topk(v, 2)
        margins.append(float(top.values[0] - top.values[1]))
        tok = int(top.indices[0])
        output.append(tok)
        if tok == EOS or tok in case.get("stop_token_ids", []):
            break
    return output, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--golden", required=True, help="tests/data/golden (models built by make_golden.py)")
    ap.add_argument("--out", required=True, help="output directory (one sub-directory per model)")
    args = ap.parse_args()
    torch.set_num_threads(4)
    log(f"torch {torch.__version__} transformers {transformers.__version__}")
    dropped = 0
    for name in MODELS:
        src = os.path.join(args.golden, name)
        golden = json.load(open(os.path.join(src, "golden.json")))
        model = load_f32(src)
        cases = []
        for case in CASES:
            for index in PROMPT_INDICES:
                prompt = golden["prompts"][index]["ids"]
                plain, _ = decode(model, {}, prompt)
                greedy, margins = decode(model, case, prompt)
                if min(margins) < MARGIN_THRESHOLD:
                    log(f"  {name} {case['name']} prompt {index}: margin {min(margins):.2e}, dropped")
                    dropped += 1
                    continue
                params = {k: v for k, v in case.items() if k != "name"}
                cases.append(
                    {
                        "name": case["name"],
                        "prompt_index": index,
                        "params": params,
                        "greedy": greedy,
                        "min_margin": min(margins),
                        "differs_from_plain": greedy != plain[: len(greedy)],
                    }
                )
                log(f"  {name} {case['name']} prompt {index}: {greedy} (plain {plain}), min margin {min(margins):.3g}")
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        with open(os.path.join(args.out, name, "penalties.json"), "w") as f:
            json.dump(
                {
                    "model": name,
                    "transformers_version": transformers.__version__,
                    "torch_version": torch.__version__,
                    "margin_threshold": MARGIN_THRESHOLD,
                    "n_greedy": N_GREEDY,
                    "eos_token_id": EOS,
                    "cases": cases,
                },
                f,
                indent=1,
            )
    log(f"done, {dropped} cases dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
