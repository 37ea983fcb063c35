#!/usr/bin/env python3
"""Build tiny random Hugging Face models and their float32 golden outputs.

These goldens are the oracle that moeserve's C++ CPU reference forward pass
(Qwen3-MoE / Qwen3) is tested against.  For each model this script:

  1. builds a small random model with transformers (fixed torch seed,
     larger-than-default init so logits have spread),
  2. saves it in bfloat16 with save_pretrained (safetensors),
  3. reloads it from disk in float32 (so the weights are exactly the bf16
     values upcast), eval mode, on CPU, eager attention,
  4. computes last-position logits, top1-top2 margins and 24 greedy tokens
     (manual loop of full forward passes, argmax; no generate(), so eos is
     not special) for random prompts, keeping only prompts whose margins are
     all >= MARGIN_THRESHOLD,
  5. writes golden.json next to config.json.

Needs torch + transformers (written against torch 2.11 / transformers 5.17).
Usage:  python3 tools/make_golden.py --out /tmp/golden [--sources FILE]
See tools/README.md.
"""

import argparse
import inspect
import json
import math
import os
import shutil
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

VOCAB = 512
MARGIN_THRESHOLD = 1e-3
PROMPT_LENGTHS = [1, 3, 8, 17, 33, 60]
N_GREEDY = 24
MAX_TRIES = 100
INIT_STD = 0.08
NORM_STD = 0.1


def log(*a):
    print(*a, flush=True)


def f32(x):
    """Shortest decimal that round-trips the float32 value x."""
    return float(str(np.float32(x)))


def f32_list(t):
    return [f32(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


# --------------------------------------------------------------------------
# model specs
# --------------------------------------------------------------------------

COMMON = dict(
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
    use_sliding_window=False,
    attention_bias=False,
    hidden_act="silu",
)

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}

MODELS = [
    dict(
        name="moe_basic",
        model_type="qwen3_moe",
        seed=1001,
        cfg=dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=dict(DEFAULT_ROPE),
        ),
    ),
    dict(
        name="moe_dense_layer",
        model_type="qwen3_moe",
        seed=1002,
        cfg=dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
            rope_parameters=dict(DEFAULT_ROPE),
        ),
    ),
    dict(
        name="moe_sparse_step",
        model_type="qwen3_moe",
        seed=1003,
        sharded=True,
        single_copy="moe_sparse_step_single",
        cfg=dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=4,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            intermediate_size=96,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters=dict(DEFAULT_ROPE),
        ),
    ),
    dict(
        name="moe_yarn",
        model_type="qwen3_moe",
        seed=1004,
        cfg=dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=96,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    dict(
        name="dense_qwen3",
        model_type="qwen3",
        seed=1005,
        cfg=dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_hidden_layers=2,
            intermediate_size=128,
            tie_word_embeddings=True,
            rope_parameters=dict(DEFAULT_ROPE),
        ),
    ),
]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def make_config(spec):
    kw = dict(COMMON)
    kw.update(spec["cfg"])
    try:
        cfg = AutoConfig.for_model(spec["model_type"], **kw)
    except Exception as e:  # fall back to legacy rope spelling
        log(f"  [warn] config with rope_parameters failed ({type(e).__name__}: {e}); trying legacy keys")
        rp = kw.pop("rope_parameters")
        kw["rope_theta"] = rp["rope_theta"]
        if rp["rope_type"] != "default":
            kw["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        cfg = AutoConfig.for_model(spec["model_type"], **kw)
    # make sure attributes that may not be dataclass fields really are set
    for k in ("head_dim", "num_experts", "mlp_only_layers", "decoder_sparse_step"):
        if k in spec["cfg"] and getattr(cfg, k, None) != spec["cfg"][k]:
            log(f"  [warn] config.{k}={getattr(cfg, k, None)!r} != {spec['cfg'][k]!r}; setting it")
            setattr(cfg, k, spec["cfg"][k])
    return cfg


def reinit_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.rsplit(".", 1)[0].split(".")[-1] if "." in name else ""
            if "norm" in owner:  # input_layernorm, post_attention_layernorm, q_norm, k_norm, model.norm
                p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))


def save_model(model, path, max_shard_size=None):
    os.makedirs(path, exist_ok=True)
    kw = {}
    if max_shard_size is not None:
        kw["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(path, safe_serialization=True, **kw)
    except TypeError as e:
        log(f"  [warn] save_pretrained(safe_serialization=True) failed: {e}; retrying without")
        model.save_pretrained(path, **kw)


def load_f32(path):
    try:
        out = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    except TypeError:
        out = AutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    model, info = out
    bad = {k: v for k, v in info.items() if v}
    if bad:
        log(f"  [warn] loading info for {path}: {bad}")
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(k):
            raise RuntimeError(f"{k} when reloading {path}: {info[k]}")
    model.eval()
    return model


def safetensors_manifest(path):
    from safetensors import safe_open

    tensors = {}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                try:
                    dt = str(sl.get_dtype())
                except Exception:
                    dt = str(f.get_tensor(k).dtype).replace("torch.", "")
                tensors[k] = {"shape": list(sl.get_shape()), "dtype": dt, "file": fn}
    return files, tensors


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


@torch.no_grad()
def logits_of(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    return out.logits[0].to(torch.float32)  # [T, V]


def margin(v):
    t = torch.topk(v, 2)
    return float(t.values[0] - t.values[1]), int(t.indices[0])


def find_rotary(model):
    for name, m in model.named_modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            return name, m
    return None, None


def layer_mlp_types(model):
    return [type(layer.mlp).__name__ for layer in model.model.layers]


@torch.no_grad()
def debug_trace(model, ids):
    """Per-layer residual stream and routing at the last position."""
    layers = model.model.layers
    caps = {}
    hooks = []

    def mk(key):
        def hook(mod, inp, out):
            caps[key] = out

        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(mk(("layer", i))))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            hooks.append(gate.register_forward_hook(mk(("gate", i))))
    hooks.append(model.model.norm.register_forward_hook(mk(("norm", 0))))
    try:
        logits_of(model, ids)
    finally:
        for h in hooks:
            h.remove()

    def first(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    res = {"layer_output_last_pos": [], "final_norm_last_pos": None, "router_last_pos": []}
    for i in range(len(layers)):
        h = first(caps[("layer", i)])
        res["layer_output_last_pos"].append(f32_list(h[0, -1]))
    res["final_norm_last_pos"] = f32_list(first(caps[("norm", 0)])[0, -1])
    top_k = getattr(model.config, "num_experts_per_tok", None)
    for i in range(len(layers)):
        if ("gate", i) not in caps:
            continue
        o = caps[("gate", i)]
        if isinstance(o, (tuple, list)) and len(o) >= 3:
            # transformers 5.x router: (router_probs_or_logits, top_weights, top_indices)
            w = o[1].reshape(-1, o[1].shape[-1])[-1]
            idx = o[2].reshape(-1, o[2].shape[-1])[-1]
        else:
            lg = first(o).reshape(-1, first(o).shape[-1])[-1].float()
            pr = torch.softmax(lg, dim=-1)
            w, idx = torch.topk(pr, top_k)
            if model.config.norm_topk_prob:
                w = w / w.sum()
        res["router_last_pos"].append(
            {"layer": i, "experts": [int(v) for v in idx.tolist()], "weights": f32_list(w)}
        )
    return res


# --------------------------------------------------------------------------
# golden generation
# --------------------------------------------------------------------------


@torch.no_grad()
def make_golden(model, name, model_type, seed, vocab):
    g = torch.Generator().manual_seed(seed + 7777)
    prompts = []
    tries = 0
    rejected = 0
    for L in PROMPT_LENGTHS:
        while tries < MAX_TRIES:
            tries += 1
            ids = torch.randint(3, vocab, (L,), generator=g).tolist()
            lg = logits_of(model, ids)
            last = lg[-1]
            m0, _ = margin(last)
            if m0 < MARGIN_THRESHOLD:
                rejected += 1
                continue
            seq = list(ids)
            greedy, gm = [], []
            ok = True
            for _step in range(N_GREEDY):
                v = logits_of(model, seq)[-1]
                m, tok = margin(v)
                if m < MARGIN_THRESHOLD:
                    ok = False
                    break
                greedy.append(tok)
                gm.append(f32(m))
                seq.append(tok)
            if not ok:
                rejected += 1
                continue
            prompts.append(
                {
                    "ids": ids,
                    "last_logits": f32_list(last),
                    "top2_margin": f32(m0),
                    "greedy": greedy,
                    "greedy_margins": gm,
                }
            )
            break
        else:
            log(f"  [WARNING] {name}: gave up after {MAX_TRIES} tries (length {L})")
    if len(prompts) < len(PROMPT_LENGTHS):
        log(f"  [WARNING] {name}: only {len(prompts)} prompts kept")
    ap = None
    for i, p in enumerate(prompts):
        if len(p["ids"]) >= 8:
            lg = logits_of(model, p["ids"])
            ap = {"prompt_index": i, "logits": [f32_list(row) for row in lg]}
            break
    dbg = None
    if ap is not None:
        dbg = {"prompt_index": ap["prompt_index"]}
        dbg.update(debug_trace(model, prompts[ap["prompt_index"]]["ids"]))
    stats = {"tries": tries, "rejected": rejected}
    return prompts, ap, dbg, stats


def build_one(spec, out_root, summary):
    name = spec["name"]
    t0 = time.time()
    log(f"=== {name} ({spec['model_type']}) seed={spec['seed']}")
    torch.manual_seed(spec["seed"])
    cfg = make_config(spec)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    reinit_(model, spec["seed"])
    if getattr(cfg, "tie_word_embeddings", False):
        # make sure the tie really holds after re-init
        if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            raise RuntimeError("tie_word_embeddings set but lm_head is not tied")
    model = model.to(torch.bfloat16)
    try:
        model.config.dtype = torch.bfloat16
    except Exception:
        pass
    model.eval()
    ref_sd = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    att = model.model.layers[0].self_attn
    want_q = cfg.num_attention_heads * spec["cfg"]["head_dim"]
    if att.q_proj.out_features != want_q or att.k_proj.out_features != cfg.num_key_value_heads * spec["cfg"]["head_dim"]:
        raise RuntimeError(f"head_dim not honoured: q_proj {att.q_proj.weight.shape} k_proj {att.k_proj.weight.shape}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  params={n_params} layer mlp types={layer_mlp_types(model)}")

    path = os.path.join(out_root, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    if spec.get("sharded"):
        for mss in ("100KB", "60KB", "30KB"):
            if os.path.exists(path):
                shutil.rmtree(path)
            save_model(model, path, max_shard_size=mss)
            nsh = len([f for f in os.listdir(path) if f.endswith(".safetensors")])
            log(f"  saved sharded with max_shard_size={mss}: {nsh} shards")
            if nsh >= 3 and os.path.exists(os.path.join(path, "model.safetensors.index.json")):
                break
        else:
            raise RuntimeError("could not get >= 3 shards")
    else:
        save_model(model, path)

    single_path = None
    if spec.get("single_copy"):
        single_path = os.path.join(out_root, spec["single_copy"])
        if os.path.exists(single_path):
            shutil.rmtree(single_path)
        save_model(model, single_path)
        nsh = len([f for f in os.listdir(single_path) if f.endswith(".safetensors")])
        if nsh != 1:
            raise RuntimeError(f"single copy has {nsh} safetensors files")
    del model

    # ---- reload in float32 from the bf16 files
    m32 = load_f32(path)
    sd = m32.state_dict()
    for k, v in ref_sd.items():
        if k not in sd:
            raise RuntimeError(f"reloaded model lacks {k}")
        if not torch.equal(sd[k].to(torch.float32), v):
            raise RuntimeError(f"reloaded weight {k} differs from bf16 original")
    log(f"  reload ok: {len(ref_sd)} tensors bit-identical to bf16 originals (dtype {next(m32.parameters()).dtype})")
    mlp_types = layer_mlp_types(m32)
    rname, rot = find_rotary(m32)
    rope = None
    if rot is not None:
        rope = {
            "module": rname,
            "inv_freq": f32_list(rot.inv_freq),
            "attention_scaling": float(getattr(rot, "attention_scaling", 1.0)),
        }
        log(f"  rope: {rname} attention_scaling={rope['attention_scaling']} inv_freq[:4]={rope['inv_freq'][:4]}")

    prompts, ap, dbg, stats = make_golden(m32, name, spec["model_type"], spec["seed"], VOCAB)

    if single_path is not None:
        ms = load_f32(single_path)
        for p in prompts[:2]:
            a = logits_of(m32, p["ids"])
            b = logits_of(ms, p["ids"])
            if not torch.equal(a, b):
                raise RuntimeError("single-file and sharded models disagree")
        log("  single-file copy reloads to identical logits")
        del ms

    files, tensors = safetensors_manifest(path)
    with open(os.path.join(path, "config.json")) as f:
        saved_cfg = json.load(f)
    golden = {
        "model": name,
        "model_type": spec["model_type"],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "margin_threshold": MARGIN_THRESHOLD,
        "seed": spec["seed"],
        "n_greedy": N_GREEDY,
        "layer_mlp_types": mlp_types,
        "safetensors_files": files,
        "tensors": tensors,
        "rope": rope,
        "prompts": prompts,
        "all_positions": ap,
        "debug": dbg,
    }
    with open(os.path.join(path, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
    if single_path is not None:
        g2 = dict(golden)
        g2["model"] = spec["single_copy"]
        g2["safetensors_files"], g2["tensors"] = safetensors_manifest(single_path)
        with open(os.path.join(single_path, "golden.json"), "w") as f:
            json.dump(g2, f, separators=(",", ":"))

    min_m0 = min((p["top2_margin"] for p in prompts), default=float("nan"))
    min_g = min((min(p["greedy_margins"]) for p in prompts), default=float("nan"))
    row = dict(
        name=name,
        type=spec["model_type"],
        layers=mlp_types,
        params=n_params,
        kept=len(prompts),
        tries=stats["tries"],
        rejected=stats["rejected"],
        min_top2=min_m0,
        min_greedy=min_g,
        disk_kb=dir_size(path) / 1024.0,
        nfiles=len(files),
        secs=time.time() - t0,
    )
    summary.append(row)
    if single_path is not None:
        summary.append(
            dict(row, name=spec["single_copy"], disk_kb=dir_size(single_path) / 1024.0, nfiles=1)
        )
    log(f"  saved config keys: {sorted(saved_cfg.keys())}")
    log(f"  done in {time.time() - t0:.1f}s")
    del m32


def dump_sources(path):
    import transformers.modeling_rope_utils as ru
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    parts = []
    for obj_name in (
        "Qwen3MoeDecoderLayer",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeTopKRouter",
        "Qwen3MoeExperts",
        "Qwen3MoeMLP",
        "Qwen3MoeRMSNorm",
        "Qwen3MoeAttention",
        "Qwen3MoeRotaryEmbedding",
    ):
        obj = getattr(mq, obj_name, None)
        if obj is None:
            parts.append(f"### {obj_name}: not found\n")
            continue
        try:
            parts.append(f"### {obj_name}\n{inspect.getsource(obj)}\n")
        except Exception as e:
            parts.append(f"### {obj_name}: {e}\n")
    for fn in ("_compute_yarn_parameters", "_compute_default_rope_parameters"):
        obj = getattr(ru, fn, None)
        if obj is not None:
            try:
                parts.append(f"### modeling_rope_utils.{fn}\n{inspect.getsource(obj)}\n")
            except Exception as e:
                parts.append(f"### {fn}: {e}\n")
    try:
        from transformers.models.qwen3_moe import configuration_qwen3_moe as cq

        parts.append(f"### configuration_qwen3_moe\n{inspect.getsource(cq)}\n")
    except Exception as e:
        parts.append(f"### configuration_qwen3_moe: {e}\n")
    try:
        import transformers.conversion_mapping as cm

        parts.append(f"### conversion_mapping\n{inspect.getsource(cm)}\n")
    except Exception as e:
        parts.append(f"### conversion_mapping: {e}\n")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (one sub-directory per model)")
    ap.add_argument("--only", default=None, help="comma-separated model names to build")
    ap.add_argument("--sources", default=None, help="also dump relevant transformers source to this file")
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    log(f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} numpy {np.__version__}")
    os.makedirs(args.out, exist_ok=True)
    if args.sources:
        try:
            dump_sources(args.sources)
            log(f"sources dumped to {args.sources}")
        except Exception as e:
            log(f"[warn] dump_sources failed: {e}")

    only = set(args.only.split(",")) if args.only else None
    summary = []
    failures = []
    for spec in MODELS:
        if only and spec["name"] not in only:
            continue
        try:
            build_one(spec, args.out, summary)
        except Exception as e:
            import traceback

            traceback.print_exc()
            failures.append((spec["name"], f"{type(e).__name__}: {e}"))

    log("")
    log("SUMMARY (margin threshold %g, %d greedy steps)" % (MARGIN_THRESHOLD, N_GREEDY))
    hdr = f"{'model':<24} {'type':<10} {'params':>7} {'kept':>4} {'tries':>5} {'min_top2':>10} {'min_greedy':>10} {'files':>5} {'disk_KB':>8}  layers"
    log(hdr)
    log("-" * len(hdr))
    for r in summary:
        lt = ",".join("moe" if "Sparse" in t else "dense" for t in r["layers"])
        log(
            f"{r['name']:<24} {r['type']:<10} {r['params']:>7} {r['kept']:>4} {r['tries']:>5} "
            f"{r['min_top2']:>10.5f} {r['min_greedy']:>10.5f} {r['nfiles']:>5} {r['disk_kb']:>8.1f}  {lt}"
        )
    if failures:
        log("FAILURES:")
        for n, e in failures:
            log(f"  {n}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
