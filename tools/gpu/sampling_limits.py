#!/usr/bin/env python3
"""Sampling filters at their limits through a running server (the GPU's
sampler; tests/server/api_test.mjs checks the CPU's the same way):

  python3 tools/gpu/sampling_limits.py URL MODEL_DIR

For every prompt of MODEL_DIR/golden.json: a filter that keeps only the most
likely token (top_k 1, top_p 1e-6, min_p 1, all three) makes sampling at
temperature 1.5 give the server's own greedy tokens, for any seed; a filter
that keeps every token (top_k 2^31 - 1 or -1, top_p 1, min_p 0) changes
nothing (the same seed gives the same tokens). And the unfiltered samples do
leave the greedy path, or the check would prove nothing. Exit status 1 on any
difference or failed request.
"""
import json
import sys
import urllib.request


def complete(url, body):
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request, timeout=60))
    return [c["token_ids"] for c in reply["choices"]]


def main():
    url, model_dir = sys.argv[1:3]
    prompts = [p["ids"] for p in json.load(open(f"{model_dir}/golden.json"))["prompts"]]
    base = {"max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    failures = cases = left_greedy = 0
    for i, ids in enumerate(prompts):
        greedy = complete(url, {**base, "prompt": ids, "temperature": 0})[0]
        free = complete(url, {**base, "prompt": ids, "temperature": 1.5, "seed": 11 + i, "n": 2})
        left_greedy += sum(c != greedy for c in free)
        for f in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1}, {"top_k": 1, "top_p": 0.5, "min_p": 0.9}):
            for c in complete(url, {**base, "prompt": ids, "temperature": 1.5, "seed": 11 + i, "n": 2, **f}):
                cases += 1
                if c != greedy:
                    failures += 1
                    print(f"DIFFER prompt {i} {f}: {c} vs greedy {greedy}")
        plain = complete(url, {**base, "prompt": ids, "temperature": 1, "seed": 3})[0]
        for f in ({"top_k": 2147483647}, {"top_k": -1}, {"top_p": 1}, {"min_p": 0}):
            cases += 1
            c = complete(url, {**base, "prompt": ids, "temperature": 1, "seed": 3, **f})[0]
            if c != plain:
                failures += 1
                print(f"DIFFER prompt {i} {f}: {c} vs unfiltered {plain}")
    if left_greedy < len(prompts):
        failures += 1
        print(f"only {left_greedy} unfiltered samples left the greedy path: the check proves nothing")
    print(f"sampling limits: {cases} cases, {failures} failed ({left_greedy} unfiltered samples left greedy)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
