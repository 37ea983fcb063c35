#!/usr/bin/env python3
"""Penalties, logit_bias, min_tokens and prompt logprobs through a running
server against transformers' float32 model: the goldens of
tools/make_penalty_golden.py and make_golden.py's logits at every position.

  python3 tools/gpu/logits_check.py URL MODEL_DIR [--disagg]

Posts every case of MODEL_DIR/penalties.json to URL/v1/completions (greedy,
token-id prompts) and compares the token ids. On a GPU the model runs in bf16,
so a case whose smallest top1 - top2 margin is under BF16_MARGIN may flip
there: such a difference is reported, not counted as a failure. Then asks for
the echoed prompt's logprobs (echo + logprobs, as lm-eval) of golden.json's
all_positions prompt and compares them with the log-softmax of its logits
(tolerance LOGPROB_TOL: bf16 on the GPU), also with --disagg (a router in
front of prefill and decode instances: the prefill instance computes them and
the router hands them out with the first token, since 2026-12-02). Exit status
1 when any other case differs, a logprob is off, or a request fails.
"""
import json
import math
import sys
import urllib.request

BF16_MARGIN = 0.05
LOGPROB_TOL = 0.05


def post(url, body):
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=60))


def check_prompt_logprobs(url, golden, where):
    """The echoed prompt's logprobs against the log-softmax of every position's logits; 1 if off."""
    all_positions = golden["all_positions"]
    ids = golden["prompts"][all_positions["prompt_index"]]["ids"]
    lp = post(url, {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True})
    lp = lp["choices"][0]["logprobs"]["token_logprobs"]
    worst = 0.0
    for p in range(len(ids) - 1):
        row = all_positions["logits"][p]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        worst = max(worst, abs(lp[p + 1] - (row[ids[p + 1]] - log_z)))
    ok = lp[0] is None and worst <= LOGPROB_TOL
    print(f"{'equal' if ok else 'FAIL'} prompt logprobs{where} of {len(ids) - 1} positions: largest error {worst:.2e}")
    return 0 if ok else 1


def main():
    url, model_dir = sys.argv[1], sys.argv[2]
    disagg = "--disagg" in sys.argv[3:]
    golden = json.load(open(f"{model_dir}/golden.json"))
    penalties = json.load(open(f"{model_dir}/penalties.json"))
    failed = 0
    for case in penalties["cases"]:
        body = {"prompt": golden["prompts"][case["prompt_index"]]["ids"], "max_tokens": penalties["n_greedy"],
                "temperature": 0, "return_token_ids": True, **case["params"]}
        label = f"{case['name']} prompt {case['prompt_index']} (margin {case['min_margin']:.3g})"
        try:
            ids = post(url, body)["choices"][0]["token_ids"]
        except Exception as e:  # noqa: BLE001 -- reported and counted
            print(f"FAIL {label}: {e}")
            failed += 1
            continue
        if ids == case["greedy"]:
            print(f"equal {label}")
        elif case["min_margin"] < BF16_MARGIN:
            print(f"differ, margin below bf16 rounding: {label}: {ids} vs {case['greedy']}")
        else:
            print(f"FAIL {label}: {ids} vs {case['greedy']}")
            failed += 1
    try:
        failed += check_prompt_logprobs(url, golden, " (through the router)" if disagg else "")
    except Exception as e:  # noqa: BLE001 -- reported and counted
        print(f"FAIL prompt logprobs: {e}")
        failed += 1
    print(f"penalty cases: {len(penalties['cases'])} and the prompt logprobs, failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
