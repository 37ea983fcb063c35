#!/bin/bash
# Thirty-seventh session: structural tags, numeric bounds, tuples and
# disable_any_whitespace on the GPU server -- `serve --device cuda` on the demo
# model with and without MTP drafts (k = 2): sampled and greedy outputs checked
# by Python (a regular expression for the structures, the bounds and the
# tuple by hand, a scanner for the separators' spaces); greedy text equal with
# and without drafts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/summary.txt
mkdir -p /tmp/new; python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" .device/s37/moeserve.xz > /tmp/new/moeserve; chmod +x /tmp/new/moeserve
nvidia-smi --query-gpu=name --format=csv,noheader > $S
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
gap = r"(?: |\n[ \t]{0,20})?"
structure = re.compile(r"e=" + gap + r"(0|[1-9][0-9]*)" + gap + ";")
def tag_ok(text, finished):
    if not finished: text = re.sub(r"e(=\s*[0-9]*\s*)?$", "", text)
    values = [int(m.group(1)) for m in structure.finditer(text)]
    return all(0 <= v <= 99 for v in values) and "e" not in structure.sub("", text), len(values)
def separators_only(text):
    in_string = escaped = False
    for i, c in enumerate(text):
        if in_string:
            if escaped: escaped = False
            elif c == "\\": escaped = True
            elif c == '"': in_string = False
            continue
        if c == '"': in_string = True
        if c.isspace() != (c == " " and i > 0 and text[i - 1] in ",:"): return False
    return True
def bounded_ok(text, finished):
    if not finished: return True, 0
    v = json.loads(text)
    age, score, pair = v["age"], v["score"], v["pair"]
    ok = (isinstance(age, int) and 18 <= age <= 120 and 0 < score <= 1 and len(pair) == 2 and
          isinstance(pair[0], int) and -10 < pair[0] <= -3 and isinstance(pair[1], str) and len(pair[1]) <= 3 and
          set(v) <= {"age", "score", "pair"} and separators_only(text))
    return ok, 1
tag = {"type": "structural_tag", "triggers": ["e"],
       "structures": [{"begin": "e=", "schema": {"type": "integer", "minimum": 0, "maximum": 99}, "end": ";"}]}
schema = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 18, "maximum": 120},
    "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "pair": {"type": "array", "prefixItems": [{"type": "integer", "exclusiveMinimum": -10, "maximum": -3},
                                              {"type": "string", "maxLength": 3}], "items": False, "minItems": 2}},
    "required": ["age", "score", "pair"]}
cases = (("tag", {"structured_outputs": {"structural_tag": tag}}, tag_ok),
         ("bounded", {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, bounded_ok))
greedy = {}
t0 = time.time()
for name, constraint, check in cases:
    ok = bad = unfinished = counted = 0
    for body in ({"temperature": 0}, {"temperature": 1, "seed": 4, "n": 16}):
        r = post({"model": "moeserve-demo", "prompt": "Tell me:", "max_tokens": 64, **constraint, **body})
        for c in r["choices"]:
            if body["temperature"] == 0: greedy[name] = c["text"]
            finished = c["finish_reason"] == "stop"
            unfinished += not finished
            good, n = check(c["text"], finished)
            ok += good; bad += not good; counted += n
            if not good: print("INVALID", name, repr(c["text"]))
    print(f"{label} {name}: {ok} outputs valid ({unfinished} cut by max_tokens, checked as far as they go), "
          f"{bad} not; {counted} structures / finished objects")
with open(f"{out}/greedy_{label}.json", "w") as f: json.dump(greedy, f, indent=1)
print(f"{label}: {time.time() - t0:.1f} s")
PY
  kill -INT $server; wait $server; echo "serve (${spec:+mtp}) exit $?" >> $S
done
python3 - "$OUT" >> $S <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/greedy_{l}.json")) for l in ("plain", "mtp"))
print("greedy equal with and without drafts:", a == b, {k: (a[k] == b.get(k)) for k in a})
PY
cat $S
