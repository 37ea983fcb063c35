#!/usr/bin/env python3
"""Penalties, logit_bias and min_tokens through a running server against the
goldens of tools/make_penalty_golden.py (transformers' float32 model).

  python3 tools/gpu/penalty_check.py URL MODEL_DIR

Posts every case of MODEL_DIR/penalties.json to URL/v1/completions (greedy,
token-id prompts) and compares the token ids. On a GPU the model runs in bf16,
so a case whose smallest top1 - top2 margin is under BF16_MARGIN may flip
there: such a difference is reported, not counted as a failure. Exit status 1
when any other case differs or a request fails.
"""
import json
import sys
import urllib.request

BF16_MARGIN = 0.05


def main():
    url, model_dir = sys.argv[1], sys.argv[2]
    golden = json.load(open(f"{model_dir}/golden.json"))
    penalties = json.load(open(f"{model_dir}/penalties.json"))
    failed = 0
    for case in penalties["cases"]:
        body = {"prompt": golden["prompts"][case["prompt_index"]]["ids"], "max_tokens": penalties["n_greedy"],
                "temperature": 0, "return_token_ids": True, **case["params"]}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        label = f"{case['name']} prompt {case['prompt_index']} (margin {case['min_margin']:.3g})"
        try:
            ids = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["token_ids"]
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
    print(f"penalty cases: {len(penalties['cases'])}, failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
