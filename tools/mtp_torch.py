"""Plain-PyTorch reference of moeserve's speculative-decoding pieces (no
transformers): safetensors read/write by hand (JSON header + raw bytes), the
Qwen3-MoE target forward (as transformers' Qwen3MoeForCausalLM, default RoPE
only) returning the last hidden state after the final norm, and the MTP layer
of src/model/mtp.h (Qwen3.5 / DeepSeek-V3 style). Used by tools/train_mtp.py
and tools/make_mtp_golden.py; runs on CPU with torch 1.13 (Debian python3-torch).
"""
import json
import math
import struct

import torch
import torch.nn.functional as F

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
NAMES = {v: k for k, v in DTYPES.items()}


def read_safetensors(path):
    """name -> float32 tensor."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin:base + end])
        t = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).float()
    return out


def write_safetensors(path, tensors, dtype=torch.bfloat16):
    """tensors: name -> tensor, stored in `dtype`, names sorted."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to(dtype).contiguous()
        raw = t.view(torch.int16).numpy().tobytes() if dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": NAMES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def bf16_round(t):
    return t.to(torch.bfloat16).float()


class Cfg:
    def __init__(self, c):
        self.vocab = c["vocab_size"]
        self.hidden = c["hidden_size"]
        self.layers = c["num_hidden_layers"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or self.hidden // self.heads
        self.inter = c.get("intermediate_size", 0)
        self.moe_inter = c.get("moe_intermediate_size", 0)
        self.experts = c.get("num_experts", c.get("num_local_experts", 0))
        self.topk = c.get("num_experts_per_tok", 0)
        self.norm_topk = c.get("norm_topk_prob", False)
        self.eps = c.get("rms_norm_eps", 1e-6)
        rope = c.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        assert rope.get("rope_type", "default") == "default", "default RoPE only"
        self.tied = c.get("tie_word_embeddings", False)
        self.sparse_step = c.get("decoder_sparse_step", 1)
        self.mlp_only = c.get("mlp_only_layers", [])

    def layer_is_moe(self, l):
        return self.experts > 0 and l not in self.mlp_only and (l + 1) % self.sparse_step == 0


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    # x [B, H, T, D]; rotate-half form.
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(cfg, w, prefix, x, positions):
    """Causal GQA self-attention of one sequence batch x [B, T, hidden]."""
    B, T, _ = x.shape
    q = (x @ w[prefix + "self_attn.q_proj.weight"].t()).view(B, T, cfg.heads, cfg.head_dim)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].t()).view(B, T, cfg.kv_heads, cfg.head_dim)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].t()).view(B, T, cfg.kv_heads, cfg.head_dim)
    q = rms_norm(q, w[prefix + "self_attn.q_norm.weight"], cfg.eps).transpose(1, 2)
    k = rms_norm(k, w[prefix + "self_attn.k_norm.weight"], cfg.eps).transpose(1, 2)
    v = v.transpose(1, 2)
    q, k = rope(q, positions, cfg.theta), rope(k, positions, cfg.theta)
    rep = cfg.heads // cfg.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
    mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, cfg.heads * cfg.head_dim)
    return out @ w[prefix + "self_attn.o_proj.weight"].t()


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def mlp(cfg, w, prefix, x, moe):
    if not moe:
        return swiglu(x, w[prefix + "mlp.gate_proj.weight"], w[prefix + "mlp.up_proj.weight"],
                      w[prefix + "mlp.down_proj.weight"])
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    probs = (x @ w[prefix + "mlp.gate.weight"].t()).softmax(-1)
    top_w, top_i = probs.topk(cfg.topk, -1)
    if cfg.norm_topk:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg.experts):
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        p = f"{prefix}mlp.experts.{e}."
        y = swiglu(x[rows], w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])
        out.index_add_(0, rows, y * top_w[rows, slot][:, None])
    return out.reshape(shape)


def decoder_layer(cfg, w, prefix, h, positions, moe):
    h = h + attention(cfg, w, prefix, rms_norm(h, w[prefix + "input_layernorm.weight"], cfg.eps), positions)
    return h + mlp(cfg, w, prefix, rms_norm(h, w[prefix + "post_attention_layernorm.weight"], cfg.eps), moe)


def lm_head(cfg, w):
    return w["model.embed_tokens.weight"] if cfg.tied else w["lm_head.weight"]


@torch.no_grad()
def target_hidden(cfg, w, ids):
    """ids [B, T] -> the last hidden state after the final norm [B, T, hidden] (what lm_head reads)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    h = w["model.embed_tokens.weight"][ids]
    for l in range(cfg.layers):
        h = decoder_layer(cfg, w, f"model.layers.{l}.", h, positions, cfg.layer_is_moe(l))
    return rms_norm(h, w["model.norm.weight"], cfg.eps)


def mtp_forward(cfg, w, mtp, hidden, next_ids, positions):
    """The MTP layer (src/model/mtp.h): hidden [B, T, hidden] (target's h_t), next_ids [B, T]
    (token t + 1) -> (normed output [B, T, hidden], logits [B, T, vocab] for token t + 2)."""
    e = rms_norm(w["model.embed_tokens.weight"][next_ids], mtp["mtp.pre_fc_norm_embedding.weight"], cfg.eps)
    g = rms_norm(hidden, mtp["mtp.pre_fc_norm_hidden.weight"], cfg.eps)
    u = torch.cat([e, g], -1) @ mtp["mtp.fc.weight"].t()
    moe = "mtp.layers.0.mlp.gate.weight" in mtp
    u = decoder_layer(cfg, mtp, "mtp.layers.0.", u, positions, moe)
    o = rms_norm(u, mtp["mtp.norm.weight"], cfg.eps)
    return o, o @ lm_head(cfg, w).t()


def random_mtp(cfg, gen, moe):
    """Random MTP weights (names of src/model/mtp.h), bf16-representable."""
    h = cfg.hidden

    def uni(*shape, center=0.0, scale=None):
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return bf16_round(center + scale * (torch.rand(*shape, generator=gen) * 2 - 1))

    m = {
        "mtp.pre_fc_norm_embedding.weight": uni(h, center=1.0, scale=0.1),
        "mtp.pre_fc_norm_hidden.weight": uni(h, center=1.0, scale=0.1),
        "mtp.fc.weight": uni(h, 2 * h),
        "mtp.norm.weight": uni(h, center=1.0, scale=0.1),
    }
    p = "mtp.layers.0."
    m[p + "input_layernorm.weight"] = uni(h, center=1.0, scale=0.1)
    m[p + "post_attention_layernorm.weight"] = uni(h, center=1.0, scale=0.1)
    m[p + "self_attn.q_proj.weight"] = uni(cfg.heads * cfg.head_dim, h)
    m[p + "self_attn.k_proj.weight"] = uni(cfg.kv_heads * cfg.head_dim, h)
    m[p + "self_attn.v_proj.weight"] = uni(cfg.kv_heads * cfg.head_dim, h)
    m[p + "self_attn.o_proj.weight"] = uni(h, cfg.heads * cfg.head_dim)
    m[p + "self_attn.q_norm.weight"] = uni(cfg.head_dim, center=1.0, scale=0.1)
    m[p + "self_attn.k_norm.weight"] = uni(cfg.head_dim, center=1.0, scale=0.1)
    if moe:
        m[p + "mlp.gate.weight"] = uni(cfg.experts, h)
        for e in range(cfg.experts):
            q = f"{p}mlp.experts.{e}."
            m[q + "gate_proj.weight"] = uni(cfg.moe_inter, h)
            m[q + "up_proj.weight"] = uni(cfg.moe_inter, h)
            m[q + "down_proj.weight"] = uni(h, cfg.moe_inter)
    else:
        m[p + "mlp.gate_proj.weight"] = uni(cfg.inter, h)
        m[p + "mlp.up_proj.weight"] = uni(cfg.inter, h)
        m[p + "mlp.down_proj.weight"] = uni(h, cfg.inter)
    return m
