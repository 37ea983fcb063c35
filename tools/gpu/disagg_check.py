#!/usr/bin/env python3
"""Client side of tools/gpu/disagg_check.sh (standard library only).

reference: greedy tokens of every golden prompt from `moeserve generate
  --device cuda`, one prompt per run (so its prefill and decode steps have the
  shapes a disaggregated request has when requests come one at a time).
serve: the same prompts through a running router (prefill on one GPU, decode
  on the other): first one at a time (must equal the reference token for
  token, and transformers' goldens up to the first step whose golden top-1 /
  top-2 margin is below bf16 noise), then every prompt twice at once (the
  goldens rule; the prefill side's prefix cache is hit); then the instances'
  metrics must show their KV in device memory moved by CUDA IPC.

Prints one line per check and exits non-zero when one fails.
"""
import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import urllib.request

BF16_MARGIN = 0.1  # as tests/gpu/model_cuda_test.cc: a smaller golden margin may flip in bf16
MAX_TOKENS = 24


def golden_prompts(model_dir):
    with open(os.path.join(model_dir, "golden.json")) as f:
        golden = json.load(f)
    prompts = []
    for kind in ("prompts", "texts", "chats"):
        for p in golden.get(kind, []):
            robust = 0
            while robust < len(p["greedy_margins"]) and p["greedy_margins"][robust] >= BF16_MARGIN:
                robust += 1
            prompts.append({"ids": p["ids"], "greedy": p["greedy"], "robust": min(robust, MAX_TOKENS)})
    return prompts


def reference(args):
    out = []
    with open(args.log, "a") as log:
        for i, p in enumerate(golden_prompts(args.model)):
            cmd = [os.path.join(args.bin, "moeserve"), "generate", "--model", args.model, "--device", "cuda",
                   "--gpu", str(args.gpu), "--gpu-memory-utilization", "0.3", "--prompt-ids",
                   ",".join(map(str, p["ids"])), "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--output", "json"]
            log.write(f"=== {' '.join(cmd)}\n")
            log.flush()
            run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=300)
            if run.returncode != 0:
                print(f"FAILED generate --device cuda on prompt {i} (exit {run.returncode}, see {args.log})")
                return 1
            out.append(json.loads(run.stdout.strip().splitlines()[-1])["token_ids"])
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"generate --device cuda --gpu {args.gpu}: {len(out)} prompts")
    return 0


def post(url, body, timeout=120):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def complete(router, name, ids):
    try:
        r = post(f"{router}/v1/completions", {"model": name, "prompt": ids, "max_tokens": MAX_TOKENS,
                                              "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        return r["choices"][0]["token_ids"]
    except Exception as e:  # the verdict names it
        return f"error: {e}"


def metric(text, name):
    """Sum of a metric's samples (all label sets), None when absent."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(values) if values else None


def decode_instances(router):
    """The decode endpoints registered with the router (its instance gauges)."""
    urls = []
    for line in get(f"{router}/metrics").splitlines():
        found = re.match(r'moeserve:router_instance_healthy\{.*role="decode",instance="([^"]+)"', line)
        if found:
            url = found.group(1)
            urls.append(url if url.startswith("http") else f"http://{url}")
    return urls


def serve(args):
    name = os.path.basename(os.path.normpath(args.model))
    prompts = golden_prompts(args.model)
    with open(args.reference) as f:
        ref = json.load(f)
    failures = []
    divergent = []  # steps where sequential outputs leave the reference (allowed from --match-tokens on)
    results = {"model": name, "sequential": [], "concurrent": [], "reference": ref}

    def check_golden(tag, i, got):
        p = prompts[i]
        if isinstance(got, str):
            failures.append(f"{tag} prompt {i}: {got}")
            return
        if args.no_golden:  # a quantized copy of the model: its own reference is the oracle
            return
        if got[:p["robust"]] != p["greedy"][:p["robust"]]:
            failures.append(f"{tag} prompt {i}: first {p['robust']} tokens {got[:p['robust']]} != transformers "
                            f"{p['greedy'][:p['robust']]}")

    # One at a time: the reference's shapes.
    for i, p in enumerate(prompts):
        got = complete(args.router, name, p["ids"])
        results["sequential"].append(got)
        check_golden("sequential", i, got)
        if got != ref[i] and not isinstance(got, str):
            first = next((k for k, (a, b) in enumerate(zip(got, ref[i])) if a != b), min(len(got), len(ref[i])))
            divergent.append(first)
            if first < args.match_tokens:
                failures.append(f"sequential prompt {i} ({len(p['ids'])} tokens): differs from generate --device cuda "
                                f"at step {first}: {got} vs {ref[i]}")
        elif isinstance(got, str):
            failures.append(f"sequential prompt {i}: {got}")
    # Every prompt twice, all at once: batched prefills and decodes, prefix-cache hits.
    order = list(range(len(prompts))) * 2
    with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
        got_all = list(pool.map(lambda i: complete(args.router, name, prompts[i]["ids"]), order))
    for slot, (i, got) in enumerate(zip(order, got_all)):
        results["concurrent"].append(got)
        check_golden(f"concurrent (copy {slot // len(prompts)})", i, got)
    num_golden = sum(p["robust"] for p in prompts)
    # Where the KV was and how it moved.
    # Decode endpoints: the one given, or (data-parallel ranks) every one the router knows.
    decode_urls = decode_instances(args.router) if args.decode == "router" else [args.decode]
    prefill_metrics = get(f"{args.prefill}/metrics")
    decode_all = [get(f"{url}/metrics") for url in decode_urls]
    with open(args.metrics, "a") as f:
        f.write(f"=== {name}: prefill {args.prefill}\n{prefill_metrics}\n")
        for url, text in zip(decode_urls, decode_all):
            f.write(f"=== {name}: decode {url}\n{text}\n")
    wanted = 'memory="device",transport="cuda_ipc"'
    seen = {}
    for role, text in [("prefill", prefill_metrics)] + [(f"decode {u}", t) for u, t in zip(decode_urls, decode_all)]:
        info = [line for line in text.splitlines() if line.startswith("moeserve:disagg_kv_transport_info{")]
        seen[role] = info[0].split("{", 1)[1].split("}", 1)[0] if info else "none"
        if wanted not in seen[role]:
            failures.append(f"{role}: KV transport info {{{seen[role]}}}, expected {wanted}")
    kv_bytes = metric(prefill_metrics, "moeserve:disagg_kv_bytes_sent_total") or 0
    per_rank = [metric(text, "moeserve:disagg_activated_total") or 0 for text in decode_all]
    activated = sum(per_rank)
    if len(decode_urls) > 1:
        results["activated_per_decode_rank"] = per_rank
    hits = metric(prefill_metrics, "moeserve:prefix_cache_hits_total")
    if kv_bytes <= 0:
        failures.append("prefill: moeserve:disagg_kv_bytes_sent_total is 0")
    if activated != 3 * len(prompts):
        failures.append(f"decode: {activated:.0f} sequences activated, expected {3 * len(prompts)}")
    results["transfer"] = {"kv_bytes_sent": kv_bytes, "activated": activated, "prefill_prefix_cache_hits": hits,
                           "transport_info": seen}
    drafted = ""
    if args.speculative:  # the decode instance drafts from what the prefill instance sent (docs/speculative.md)
        def summed(name):  # over the decode endpoints (data-parallel ranks each draft)
            return sum(metric(text, name) or 0 for text in decode_all)
        drafts = summed("moeserve:spec_decode_num_draft_tokens_total")
        accepted = summed("moeserve:spec_decode_num_accepted_tokens_total")
        without = summed("moeserve:disagg_commits_without_mtp_total")
        results["speculation"] = {"draft_tokens": drafts, "accepted_tokens": accepted, "commits_without_mtp": without}
        drafted = f"; decode drafted {drafts:.0f} tokens, accepted {accepted:.0f}"
        if drafts <= 0:
            failures.append("decode: no draft tokens verified")
        if args.expect_accepted and accepted <= 0:
            failures.append(f"decode: none of {drafts:.0f} draft tokens accepted (a trained MTP layer)")
        if without > 0:
            failures.append(f"decode: {without:.0f} commits came without the MTP state")
    results["failures"] = failures
    with open(args.out, "a") as f:
        f.write(json.dumps(results) + "\n")
    same = 'yes' if not divergent else f"NO ({len(divergent)} leave it, at steps {divergent})"
    if divergent and args.match_tokens < MAX_TOKENS and not any(x.startswith('sequential') for x in failures):
        same += f", first {args.match_tokens} tokens all equal as required"
    print(f"{name}: {len(prompts)} prompts one at a time == generate --device cuda token for token: {same}; "
          f"{num_golden} tokens per pass compared with transformers; {len(order)} concurrent requests; "
          f"KV sent {kv_bytes / 1e6:.2f} MB ({seen['prefill']}), {activated:.0f} activations, prefix-cache hits "
          f"{hits if hits is not None else 'n/a'}{drafted}")
    for failure in failures:
        print(f"  FAILED {failure}")
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--bin", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--gpu", type=int, default=0)
    r.add_argument("--out", required=True)
    r.add_argument("--log", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--router", required=True)
    s.add_argument("--prefill", required=True)
    s.add_argument("--decode", required=True, help="a decode instance's URL, or 'router': every one registered there")
    s.add_argument("--model", required=True)
    s.add_argument("--reference", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--metrics", required=True)
    s.add_argument("--speculative", action="store_true", help="the instances speculate: the decode side must draft")
    s.add_argument("--expect-accepted", action="store_true", help="with --speculative: drafts must be accepted")
    s.add_argument("--match-tokens", type=int, default=MAX_TOKENS,
                   help="tokens that must equal the reference (the rest is reported); default all")
    s.add_argument("--no-golden", action="store_true",
                   help="skip transformers' goldens (a quantized model; generate --device cuda stays the oracle)")
    args = parser.parse_args()
    return reference(args) if args.command == "reference" else serve(args)


if __name__ == "__main__":
    sys.exit(main())
