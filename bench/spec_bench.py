#!/usr/bin/env python3
"""Speculative decoding: acceptance and decode speed of the demo model with its
trained MTP layer (models/moeserve-demo-mtp), k = 0 (plain) and 1..4, through
`moeserve generate` (greedy, one thread, the demo's golden chat and text
prompts as one batch) on --device cpu or cuda. Each setting runs --repeats
times; the median decode tokens/s is kept. Writes a JSON record (date,
commit, machine, command, results) to --out.

Usage: python3 bench/spec_bench.py --moeserve build-mtp/bin/moeserve \
           --out bench/results/2026-11-30_spec_cpu.json
       python3 bench/spec_bench.py --moeserve build-gpu/bin/moeserve --device cuda --out ...
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stderr + out.stdout
    tps = float(re.search(r"decode ([0-9.]+) tokens/s", log).group(1))
    spec = re.search(r"speculative: (\d+) draft tokens, (\d+) accepted .*?, ([0-9.]+) tokens per verification, "
                     r"(\d+) decode steps", log)
    tokens = [line for line in out.stdout.splitlines() if line.strip()]
    return tps, spec, tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeserve", default=os.path.join(ROOT, "build-mtp/bin/moeserve"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/moeserve-demo"))
    ap.add_argument("--mtp", default=os.path.join(ROOT, "models/moeserve-demo-mtp"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--commit", default="", help="the commit the binary was built from (default: git HEAD)")
    args = ap.parse_args()
    golden = json.load(open(os.path.join(args.model, "golden.json")))
    prompts = [",".join(map(str, p["ids"])) for p in golden["chats"] + golden["texts"]]
    base = [args.moeserve, "generate", "--model", args.model, "--max-tokens", str(args.max_tokens), "--threads", "1",
            "--ignore-eos", "--device", args.device]
    for p in prompts:
        base += ["--prompt-ids", p]
    results, reference = [], None
    for k in range(0, 5):
        cmd = base if k == 0 else base + [
            "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k}),
            "--speculative-model", args.mtp]
        runs = [run(cmd) for _ in range(args.repeats)]
        tps = statistics.median(r[0] for r in runs)
        tokens = runs[0][2]
        if k == 0:
            reference = tokens
        row = {"k": k, "decode_tokens_per_s": tps, "same_tokens_as_plain": tokens == reference,
               "runs_tokens_per_s": [r[0] for r in runs]}
        spec = runs[0][1]
        if spec:
            drafts, accepted, per_verify = int(spec.group(1)), int(spec.group(2)), float(spec.group(3))
            row.update({"draft_tokens": drafts, "accepted_tokens": accepted,
                        "acceptance_rate": accepted / max(1, drafts),
                        "mean_acceptance_length": per_verify, "decode_steps": int(spec.group(4))})
        results.append(row)
        print(json.dumps(row), flush=True)
    for row in results:
        row["speedup"] = row["decode_tokens_per_s"] / results[0]["decode_tokens_per_s"]
    commit = args.commit or subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    if args.device == "cuda":
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
        cpu = f"{gpu[0] if gpu else 'GPU'} (host CPU {cpu})"
    record = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": f"{platform.node()}: {cpu}, {os.cpu_count()} cores shared with other jobs, 1 thread used",
        "command": "python3 bench/spec_bench.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
        "batch": len(prompts), "max_tokens": args.max_tokens, "greedy": True,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
