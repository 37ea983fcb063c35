#!/usr/bin/env python3
"""Many greedy requests at once against two servers of the same model, token
for token (standard library only):

  python3 tools/gpu/concurrent_compare.py URL_A URL_B [--requests 48] [--max-tokens 96]

Each request is a distinct text prompt, sent to both servers all at once
(one thread per request). serve_check.sh runs it with A a GPU server whose KV
pool is too small for the batch (sequences are preempted and recomputed) and
B one with room: the outputs must be equal, and A's
moeserve:num_preemptions_total must have grown, or nothing was tested. Exit
status 1 otherwise.
"""
import argparse
import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

WORDS = ["cookie", "wisdom", "love", "money", "time", "window", "computer", "sea", "river", "friend"]


def complete(url, prompt, max_tokens):
    body = {"model": "moeserve-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["token_ids"]


def preemptions(url):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(r"^moeserve:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url_a")
    parser.add_argument("url_b")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    prompts = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(20 + i % 17)) for i in range(args.requests)]
    before = preemptions(args.url_a)
    results = {}
    with ThreadPoolExecutor(max_workers=2 * args.requests) as pool:
        for url in (args.url_a, args.url_b):
            results[url] = pool.map(lambda p, u=url: complete(u, p, args.max_tokens), prompts)
        a, b = list(results[args.url_a]), list(results[args.url_b])
    grown = preemptions(args.url_a) - before
    differ = [i for i in range(len(prompts)) if a[i] != b[i]]
    print(f"{len(prompts)} concurrent requests of {args.max_tokens} tokens: {len(prompts) - len(differ)} equal, "
          f"{len(differ)} differ; {grown:.0f} preemptions on the small pool")
    for i in differ[:3]:
        print(f"  DIFFER request {i}: {a[i][:12]}... vs {b[i][:12]}...")
    return 1 if differ or grown <= 0 else 0


if __name__ == "__main__":
    sys.exit(main())
