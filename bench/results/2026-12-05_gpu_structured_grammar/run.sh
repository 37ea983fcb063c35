#!/bin/bash
# Thirty-sixth session: guided_grammar (EBNF, e8dd977) and the token-set cache
# on the GPU server -- speculative_cuda_test, then `serve --device cuda` on the
# demo model with and without MTP drafts (k = 2): greedy and sampled outputs of
# an arithmetic grammar checked by a recursive-descent checker, of a SQL
# grammar by Python's re, and a patterned json_schema by re and json; greedy
# text equal with and without drafts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; for f in .device/new3/*.xz; do python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $f > /tmp/new/$(basename $f .xz); done; chmod +x /tmp/new/*
[ -e /work/main ] || { mkdir -p /work; ln -s $(pwd) /work/main; }
nvidia-smi --query-gpu=name --format=csv,noheader > $S
git log --oneline -1 >> $S 2>/dev/null
timeout 200 /tmp/new/speculative_cuda_test --gtest_color=no > $OUT/speculative_cuda_test.log 2>&1; echo "speculative_cuda_test rc $?" >> $S
grep -E "PASSED|FAILED|OK \] CudaStructured" $OUT/speculative_cuda_test.log >> $S
for spec in "" "--speculative-config {\"method\":\"mtp\",\"num_speculative_tokens\":2} --speculative-model models/moeserve-demo-mtp"; do
  /tmp/new/moeserve serve --device cuda --kv-cache-gb 2 --port 18570 $spec > /dev/null 2> $OUT/serve${spec:+_mtp}.log &
  server=$!
  for _ in $(seq 1 150); do curl -sf localhost:18570/health > /dev/null && break; sleep 0.2; done
  python3 - "${spec:+mtp}" "$OUT" >> $S 2>&1 <<'PY'
import json, re, sys, time, urllib.request
label, out = sys.argv[1] or "plain", sys.argv[2]
def post(body):
    req = urllib.request.Request("http://localhost:18570/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
arith = '''
  root   ::= expr " = " [0-9]+
  expr   ::= term (("+" | "-") term)*
  term   ::= factor ("*" factor)*
  factor ::= [0-9]{1,3} | "(" expr ")"
'''
def follows(t):
    i = 0
    def factor():
        nonlocal i
        if i < len(t) and t[i] == "(":
            i += 1
            if not expr() or i >= len(t) or t[i] != ")": return False
            i += 1; return True
        m = re.match(r"[0-9]{1,3}(?![0-9])", t[i:])
        if not m: return False
        i += len(m.group(0)); return True
    def term():
        nonlocal i
        if not factor(): return False
        while i < len(t) and t[i] == "*":
            i += 1
            if not factor(): return False
        return True
    def expr():
        nonlocal i
        if not term(): return False
        while i < len(t) and t[i] in "+-":
            i += 1
            if not term(): return False
        return True
    return expr() and re.fullmatch(r" = [0-9]+", t[i:]) is not None
sql = 'root ::= "SELECT " cols " FROM " ("users" | "orders") (" WHERE " [a-z_]+ " = " [0-9]{1,4})? ";"\ncols ::= "*" | [a-z_]+ (", " [a-z_]+)*'
sql_re = re.compile(r"SELECT (\*|[a-z_]+(, [a-z_]+)*) FROM (users|orders)( WHERE [a-z_]+ = [0-9]{1,4})?;")
ok = bad = unfinished = 0
greedy = {}
t0 = time.time()
for name, grammar, check in (("arith", arith, follows), ("sql", sql, lambda s: sql_re.fullmatch(s) is not None)):
    for body in ({"temperature": 0}, {"temperature": 1, "seed": 4, "n": 16}):
        r = post({"model": "moeserve-demo", "prompt": "Query:", "max_tokens": 64, "guided_grammar": grammar, **body})
        for c in r["choices"]:
            if body["temperature"] == 0: greedy[name] = c["text"]
            if c["finish_reason"] != "stop":
                unfinished += 1; continue
            good = check(c["text"]); ok += good; bad += not good
            if not good: print("INVALID", name, repr(c["text"]))
with open(f"{out}/greedy_{label}.json", "w") as f: json.dump(greedy, f, indent=1)
print(f"{label}: {ok} finished outputs valid, {bad} not, {unfinished} cut by max_tokens; {time.time() - t0:.1f} s")
PY
  kill -INT $server; wait $server; echo "serve (${spec:+mtp}) exit $?" >> $S
done
python3 - "$OUT" >> $S <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/greedy_{l}.json")) for l in ("plain", "mtp"))
print("greedy text equal with and without MTP drafts:", a == b, a)
PY
cat $S
