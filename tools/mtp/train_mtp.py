#!/usr/bin/python3
"""Train DeepSeek-V3-style MTP (multi-token prediction) modules for a llama2.c checkpoint
by self-distillation, and write them as a GGUF side file (llama.cpp "nextn" tensor names).

Not part of the serving build or `make test`; the trained side file is committed.
Run under Debian's Python (apt-get install -y python3-torch):

  /usr/bin/python3 tools/mtp/train_mtp.py \\
      --checkpoint ../shared/models/stories260K/stories260K.bin \\
      --out models/mtp/stories260K-mtp.gguf [--steps N --seed S --threads T --eval-only]

Semantics (docs/mtp.md has the full statement):
  h_0[i]      = the main model's residual stream at position i after the last block,
                before the final RMSNorm.
  module k    (k = 1..K, K = 2): at position i, with input h_{k-1}[i] and token t_{i+k}:
    h'_k[i]   = eh_proj_k @ concat(rmsnorm(h_{k-1}[i]) * hnorm_k, rmsnorm(embed(t_{i+k})) * enorm_k)
    h_k[i]    = Block_k(h'_k)[i]   (an ordinary llama block; its attention is causal over the
                module's own K/V at positions 0..i of the same sequence; RoPE position = i)
    logits_k[i] = embed @ (rmsnorm(h_k[i]) * rms_final)   (main model's final norm and head)
    predicts t_{i+k+1}.
"""
import argparse
import hashlib
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_writer import GGUFWriter, read_gguf  # noqa: E402

RMS_EPS = 1e-5
ROPE_THETA = 10000.0
BOS, EOS = 1, 2
N_MTP = 2


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------
# checkpoint, tokenizer


class Config:
    def __init__(self, dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len):
        self.dim, self.hidden_dim, self.n_layers = dim, hidden_dim, n_layers
        self.n_heads, self.n_kv_heads, self.vocab_size, self.seq_len = \
            n_heads, n_kv_heads, vocab_size, seq_len
        self.head_dim = dim // n_heads
        self.kv_dim = n_kv_heads * self.head_dim
        self.kv_mul = n_heads // n_kv_heads


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_checkpoint(path):
    """llama2.c legacy (version 0) fp32 checkpoint -> (Config, dict of float32 tensors)."""
    with open(path, "rb") as f:
        raw = f.read()
    hdr = struct.unpack_from("<7i", raw, 0)
    dim, hidden, L, H, KVH, vocab, seq_len = hdr
    shared = vocab > 0
    vocab = abs(vocab)
    c = Config(dim, hidden, L, H, KVH, vocab, seq_len)
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        if pos + n > data.size:
            raise ValueError(path + ": truncated checkpoint")
        a = torch.from_numpy(data[pos:pos + n].reshape(shape).copy())
        pos += n
        return a

    w = {}
    w["tok_embd"] = take(vocab, dim)
    w["rms_att"] = take(L, dim)
    w["wq"] = take(L, dim, dim)
    w["wk"] = take(L, c.kv_dim, dim)
    w["wv"] = take(L, c.kv_dim, dim)
    w["wo"] = take(L, dim, dim)
    w["rms_ffn"] = take(L, dim)
    w["w1"] = take(L, hidden, dim)
    w["w2"] = take(L, dim, hidden)
    w["w3"] = take(L, hidden, dim)
    w["rms_final"] = take(dim)
    take(seq_len, c.head_dim // 2)  # freq_cis_real (unused)
    take(seq_len, c.head_dim // 2)  # freq_cis_imag (unused)
    w["output"] = w["tok_embd"] if shared else take(vocab, dim)
    if pos != data.size:
        raise ValueError("%s: %d trailing floats" % (path, data.size - pos))
    return c, w


class Tokenizer:
    """llama2.c tokenizer.bin + run.c's encode (dummy prefix, byte fallback, score merges)."""

    def __init__(self, path, vocab_size):
        with open(path, "rb") as f:
            raw = f.read()
        (self.max_len,) = struct.unpack_from("<I", raw, 0)
        pos = 4
        self.vocab, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, pos)
            pos += 8
            self.vocab.append(raw[pos:pos + n])
            pos += n
            self.scores.append(score)
        self.lookup = {}
        for i, v in enumerate(self.vocab):
            self.lookup.setdefault(v, i)

    def encode(self, text, bos=True):
        ids = [BOS] if bos else []
        if not text:
            return ids
        toks = [self.lookup[b" "]]
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.lookup:
                toks.append(self.lookup[b])
            else:
                toks.extend(x + 3 for x in b)
        while True:
            best, best_id, best_i = -1e10, -1, -1
            for i in range(len(toks) - 1):
                m = self.vocab[toks[i]] + self.vocab[toks[i + 1]]
                j = self.lookup.get(m)
                if j is not None and self.scores[j] > best:
                    best, best_id, best_i = self.scores[j], j, i
            if best_i < 0:
                break
            toks[best_i:best_i + 2] = [best_id]
        return ids + toks

    def decode(self, ids):
        out = b""
        for i, t in enumerate(ids):
            p = self.vocab[t]
            if i > 0 and ids[i - 1] == BOS and p.startswith(b" "):
                p = p[1:]
            if p.startswith(b"<0x") and p.endswith(b">") and len(p) == 6:
                p = bytes([int(p[3:5], 16)])
            out += p
        return out.decode("utf-8", "replace")


# ------------------------------------------------------------------------------------
# model math (llama2.c run.c, fp32)


def rmsnorm(x, w):
    return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + RMS_EPS))


def rope_tables(T, head_dim):
    """cos/sin (T, head_dim/2) exactly as run.c / model.c compute them in float32."""
    i = np.arange(0, head_dim, 2, dtype=np.float32)
    freq = (np.float32(1.0) / np.power(np.float32(ROPE_THETA), i / np.float32(head_dim))
            ).astype(np.float32)
    val = np.arange(T, dtype=np.float32)[:, None] * freq[None, :]
    return torch.from_numpy(np.cos(val)), torch.from_numpy(np.sin(val))


def apply_rope(x, cos, sin):
    """x (B, T, n_heads, head_dim); rotate adjacent pairs (2j, 2j+1) by pos * freq_j."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def block_qkv(c, lw, x, cos, sin):
    B, T, _ = x.shape
    xb = rmsnorm(x, lw["attn_norm"])
    q = (xb @ lw["wq"].t()).view(B, T, c.n_heads, c.head_dim)
    k = (xb @ lw["wk"].t()).view(B, T, c.n_kv_heads, c.head_dim)
    v = (xb @ lw["wv"].t()).view(B, T, c.n_kv_heads, c.head_dim)
    q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
    # GQA: query head h uses kv head h // kv_mul
    k = k.repeat_interleave(c.kv_mul, dim=2)
    v = v.repeat_interleave(c.kv_mul, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)


def block_ffn(lw, x):
    xb = rmsnorm(x, lw["ffn_norm"])
    return x + (F.silu(xb @ lw["w1"].t()) * (xb @ lw["w3"].t())) @ lw["w2"].t()


def block_forward(c, lw, x, cos, sin):
    """One llama block over a whole sequence (causal attention over positions 0..t)."""
    B, T, D = x.shape
    q, k, v = block_qkv(c, lw, x, cos, sin)
    H = q.shape[1]
    # scores / sqrt(head_dim) + causal mask, fused (baddbmm), then softmax over s <= t
    s = torch.baddbmm(causal_mask(T), q.reshape(B * H, T, -1),
                      k.reshape(B * H, T, -1).transpose(1, 2), alpha=1.0 / math.sqrt(c.head_dim))
    p = torch.softmax(s, dim=-1)
    o = torch.bmm(p, v.reshape(B * H, T, -1)).view(B, H, T, -1).transpose(1, 2).reshape(B, T, D)
    return block_ffn(lw, x + o @ lw["wo"].t())


_MASKS = {}


def causal_mask(T):
    """(T, T) additive mask: 0 where s <= t, -inf above the diagonal."""
    if T not in _MASKS:
        _MASKS[T] = torch.full((T, T), float("-inf")).triu(1)
    return _MASKS[T]


def block_forward_draft(c, lw, x_real, x_draft, cos, sin):
    """Position t's output when its own input is x_draft[t] while positions s < t hold the
    K/V computed from x_real[s] (what a decode step sees: history from real tokens, the
    current position from the draft token). Returns (B, T, D)."""
    B, T, D = x_real.shape
    qr, kr, vr = block_qkv(c, lw, x_real, cos, sin)
    qd, kd, vd = block_qkv(c, lw, x_draft, cos, sin)
    s = qd @ kr.transpose(-1, -2)
    own = (qd * kd).sum(-1)  # (B, H, T)
    s = s - torch.diag_embed(torch.diagonal(s, dim1=-2, dim2=-1)) + torch.diag_embed(own)
    s = s / math.sqrt(c.head_dim)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
    pd = torch.diagonal(p, dim1=-2, dim2=-1).unsqueeze(-1)  # (B, H, T, 1)
    o = p @ vr - pd * vr + pd * vd
    o = o.transpose(1, 2).reshape(B, T, D)
    return block_ffn(lw, x_draft + o @ lw["wo"].t())


class Base:
    """The frozen main model."""

    def __init__(self, c, w):
        self.c, self.w = c, w
        self.layers = []
        for l in range(c.n_layers):
            self.layers.append({
                "attn_norm": w["rms_att"][l], "wq": w["wq"][l], "wk": w["wk"][l],
                "wv": w["wv"][l], "wo": w["wo"][l], "ffn_norm": w["rms_ffn"][l],
                "w1": w["w1"][l], "w2": w["w2"][l], "w3": w["w3"][l]})
        self.cos, self.sin = rope_tables(c.seq_len, c.head_dim)

    def logits(self, h):
        return rmsnorm(h, self.w["rms_final"]) @ self.w["output"].t()

    @torch.no_grad()
    def forward(self, tokens):
        """tokens (B, T) -> (h_0 (B, T, dim): residual after the last block, before the
        final norm; logits (B, T, vocab))."""
        x = self.w["tok_embd"][tokens]
        for lw in self.layers:
            x = block_forward(self.c, lw, x, self.cos, self.sin)
        return x, self.logits(x)

    @torch.no_grad()
    def generate(self, prompts, total, temperature, gen):
        """Batched incremental generation with a KV cache. prompts: list of id lists (may
        differ in length); each row is continued to `total` tokens. temperature 0 = greedy;
        a per-row list/tensor is allowed. Returns (B, total) int64."""
        c = self.c
        B, T = len(prompts), total
        assert T <= c.seq_len and all(0 < len(p) <= T for p in prompts)
        plen = torch.tensor([len(p) for p in prompts])
        out = torch.zeros(B, T, dtype=torch.long)
        for r, p in enumerate(prompts):
            out[r, :len(p)] = torch.tensor(p)
        kc = [torch.zeros(B, c.n_kv_heads, T, c.head_dim) for _ in self.layers]
        vc = [torch.zeros(B, c.n_kv_heads, T, c.head_dim) for _ in self.layers]
        temp = torch.as_tensor(temperature, dtype=torch.float32).expand(B)
        any_sample = bool((temp > 0).any())
        for pos in range(T - 1):
            x = self.w["tok_embd"][out[:, pos]][:, None, :]  # (B, 1, D)
            cs, sn = self.cos[pos:pos + 1], self.sin[pos:pos + 1]
            for l, lw in enumerate(self.layers):
                xb = rmsnorm(x, lw["attn_norm"])
                q = apply_rope((xb @ lw["wq"].t()).view(B, 1, c.n_heads, c.head_dim), cs, sn)
                k = apply_rope((xb @ lw["wk"].t()).view(B, 1, c.n_kv_heads, c.head_dim), cs, sn)
                v = (xb @ lw["wv"].t()).view(B, 1, c.n_kv_heads, c.head_dim)
                kc[l][:, :, pos] = k[:, 0]
                vc[l][:, :, pos] = v[:, 0]
                K = kc[l][:, :, :pos + 1]  # (B, KVH, pos+1, hd)
                V = vc[l][:, :, :pos + 1]
                # GQA without copies: query head h = g * kv_mul + j uses kv head g
                qh = q[:, 0].view(B, c.n_kv_heads, c.kv_mul, c.head_dim)
                att = torch.softmax((qh @ K.transpose(-1, -2)) / math.sqrt(c.head_dim), -1)
                o = (att @ V).reshape(B, 1, c.dim)
                x = block_ffn(lw, x + o @ lw["wo"].t())
            free = plen <= pos + 1  # rows whose next token is generated, not forced
            if not bool(free.any()):
                continue
            lg = self.logits(x[:, 0])
            nxt = lg.argmax(-1)
            if any_sample:
                t = torch.where(temp > 0, temp, torch.ones_like(temp))
                sampled = torch.multinomial(torch.softmax(lg / t[:, None], -1), 1,
                                            generator=gen)[:, 0]
                nxt = torch.where(temp > 0, sampled, nxt)
            out[:, pos + 1] = torch.where(free, nxt, out[:, pos + 1])
        return out


# ------------------------------------------------------------------------------------
# MTP modules

BLOCK_KEYS = ["attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]
GGUF_BLOCK_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
                    "wo": "attn_output", "ffn_norm": "ffn_norm", "w1": "ffn_gate",
                    "w2": "ffn_down", "w3": "ffn_up"}


class MTP(torch.nn.Module):
    def __init__(self, c, n_mtp=N_MTP):
        super().__init__()
        self.c, self.n_mtp = c, n_mtp
        D, Hd, KV = c.dim, c.hidden_dim, c.kv_dim
        shapes = {"attn_norm": (D,), "wq": (D, D), "wk": (KV, D), "wv": (KV, D), "wo": (D, D),
                  "ffn_norm": (D,), "w1": (Hd, D), "w2": (D, Hd), "w3": (Hd, D),
                  "eh_proj": (D, 2 * D), "enorm": (D,), "hnorm": (D,)}
        self.mods = torch.nn.ModuleList()
        for _ in range(n_mtp):
            p = torch.nn.ParameterDict()
            for k, s in shapes.items():
                p[k] = torch.nn.Parameter(torch.zeros(s))
            self.mods.append(p)

    def init_weights(self, base, gen, mode):
        """mode 'copy': block from the main model's last block, eh_proj = [I, I] / 2 plus
        noise; 'random': llama2.c-style N(0, 0.02) (output projections scaled down)."""
        c = self.c
        with torch.no_grad():
            for p in self.mods:
                for k in ("attn_norm", "ffn_norm", "enorm", "hnorm"):
                    p[k].fill_(1.0)
                for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "eh_proj"):
                    std = 0.02 / math.sqrt(2) if k in ("wo", "w2") else 0.02
                    p[k].copy_(torch.randn(p[k].shape, generator=gen) * std)
                if mode == "copy":
                    last = base.layers[-1]
                    for k in BLOCK_KEYS:
                        p[k].copy_(last[k])
                    eye = torch.eye(c.dim)
                    p["eh_proj"].add_(torch.cat([eye, eye], 1) * 0.5)

    def module_input(self, p, base, h_prev, toks):
        e = base.w["tok_embd"][toks]
        cat = torch.cat([rmsnorm(h_prev, p["hnorm"]), rmsnorm(e, p["enorm"])], -1)
        return cat @ p["eh_proj"].t()

    def forward_tf(self, base, h0, tokens):
        """Teacher-forced: module k at positions 0..T-1-k with tokens t_{i+k}.
        Returns list of (h_k (B, T-k, D), logits_k (B, T-k, V))."""
        out, h = [], h0
        T = tokens.shape[1]
        for k, p in enumerate(self.mods, start=1):
            x = self.module_input(p, base, h[:, :T - k], tokens[:, k:])
            h = block_forward(self.c, p, x, base.cos, base.sin)
            out.append((h, base.logits(h)))
        return out

    @torch.no_grad()
    def draft(self, base, h0, tokens):
        """Serving semantics for a decode step at each position i (all positions at once):
        d1[i] = argmax module 1 with (h_0[i], t_{i+1}); d2[i] = argmax module 2 with
        (h_1[i], embed(d1[i])) at position i, its history positions s < i holding K/V from the
        real tokens t_{s+2}. Returns (d1 (B, T-1), d2 (B, T-2) for i <= T-3, h1, logits...)."""
        p1, p2 = self.mods[0], self.mods[1]
        T = tokens.shape[1]
        x1 = self.module_input(p1, base, h0[:, :T - 1], tokens[:, 1:])
        h1 = block_forward(self.c, p1, x1, base.cos, base.sin)
        l1 = base.logits(h1)
        d1 = l1.argmax(-1)  # (B, T-1)
        xr = self.module_input(p2, base, h1[:, :T - 2], tokens[:, 2:])
        xd = self.module_input(p2, base, h1[:, :T - 1], d1)
        # position T-2 has no real token t_T: give it its draft input as "real" too (it is
        # never used as history by an earlier position)
        xr = torch.cat([xr, xd[:, T - 2:]], 1)
        h2d = block_forward_draft(self.c, p2, xr, xd, base.cos, base.sin)
        l2d = base.logits(h2d)
        return d1, l2d.argmax(-1), h1, l1, l2d

    # ---- GGUF
    def to_gguf(self, path, base, meta):
        c = self.c
        w = GGUFWriter()
        w.add_string("general.architecture", "llama")
        w.add_string("general.name", meta["name"])
        w.add_string("general.description",
                     "MTP (nextn) modules for %s; side file, not a full model" % meta["base_name"])
        w.add_uint32("llama.nextn_predict_layers", self.n_mtp)
        w.add_uint32("llama.block_count", c.n_layers)
        w.add_uint32("llama.context_length", c.seq_len)
        w.add_uint32("llama.embedding_length", c.dim)
        w.add_uint32("llama.feed_forward_length", c.hidden_dim)
        w.add_uint32("llama.attention.head_count", c.n_heads)
        w.add_uint32("llama.attention.head_count_kv", c.n_kv_heads)
        w.add_uint32("llama.vocab_size", c.vocab_size)
        w.add_uint32("llama.rope.dimension_count", c.head_dim)
        w.add_float32("llama.rope.freq_base", ROPE_THETA)
        w.add_float32("llama.attention.layer_norm_rms_epsilon", RMS_EPS)
        w.add_string("tidepool.rope.pairing", "adjacent")
        w.add_string("tidepool.mtp.base_sha256", meta["base_sha256"])
        w.add_uint32("tidepool.mtp.base_size", meta["base_bytes"])
        w.add_string("tidepool.mtp.rope_position", "hidden")
        w.add_string("tidepool.mtp.hidden_input", "pre_final_norm")
        w.add_string("tidepool.mtp.head", "shared")
        w.add_float32("tidepool.mtp.acceptance_length", meta["acceptance_length"])
        w.add_array("tidepool.mtp.acceptance_rate", 6, meta["acceptance_rate"])
        w.add_float32("tidepool.mtp.acceptance_length_unseen", meta["acceptance_length_unseen"])
        w.add_uint32("tidepool.mtp.eval_prompts", meta["eval_prompts"])
        w.add_uint32("tidepool.mtp.eval_tokens", meta["eval_tokens"])
        w.add_uint32("tidepool.mtp.seed", meta["seed"])
        w.add_uint32("tidepool.mtp.steps", meta["steps"])
        w.add_string("tidepool.mtp.recipe", meta["recipe"])
        for k, p in enumerate(self.mods, start=1):
            n = c.n_layers + k - 1
            pre = "blk.%d." % n
            w.add_tensor_f32(pre + "nextn.eh_proj.weight", p["eh_proj"].detach().numpy())
            w.add_tensor_f32(pre + "nextn.enorm.weight", p["enorm"].detach().numpy())
            w.add_tensor_f32(pre + "nextn.hnorm.weight", p["hnorm"].detach().numpy())
            for key in BLOCK_KEYS:
                w.add_tensor_f32(pre + GGUF_BLOCK_NAMES[key] + ".weight",
                                 p[key].detach().numpy())
        tmp = path + ".tmp"
        w.write(tmp)
        os.replace(tmp, path)

    def from_gguf(self, path):
        meta, t = read_gguf(path)
        c = self.c
        n = meta.get("llama.nextn_predict_layers")
        if n != self.n_mtp or meta.get("llama.block_count") != c.n_layers or \
                meta.get("llama.embedding_length") != c.dim:
            raise ValueError(path + ": does not match the base model")
        with torch.no_grad():
            for k, p in enumerate(self.mods, start=1):
                pre = "blk.%d." % (c.n_layers + k - 1)
                for key in ("eh_proj", "enorm", "hnorm"):
                    p[key].copy_(torch.from_numpy(t[pre + "nextn.%s.weight" % key]))
                for key in BLOCK_KEYS:
                    p[key].copy_(torch.from_numpy(t[pre + GGUF_BLOCK_NAMES[key] + ".weight"]))
        return meta


# ------------------------------------------------------------------------------------
# data


def sample_corpus(base, n_seq, seq_len, seed, greedy_frac, low_temp_frac, batch=500):
    """Sequences sampled from the base model: BOS + tokens. A fraction are greedy after a
    short (2..24 token) temperature-1 prefix (the regime the acceptance evaluation
    measures), a fraction at temperature 0.7, the rest at 1.0. Returns (tokens (N, T)
    int64, valid lengths (N,)): a row is valid up to and including its first BOS/EOS after
    position 0 (the end of the story)."""
    gen = torch.Generator().manual_seed(seed)
    n_greedy = int(round(n_seq * greedy_frac))
    n_low = int(round(n_seq * low_temp_frac))
    temps = torch.tensor([0.0] * n_greedy + [0.7] * n_low + [1.0] * (n_seq - n_greedy - n_low))
    temps = temps[torch.randperm(n_seq, generator=gen)]
    rows = []
    for s in range(0, n_seq, batch):
        tb = temps[s:s + batch]
        B = tb.shape[0]
        pre_len = torch.randint(2, 25, (B,), generator=gen)
        pre = base.generate([[BOS]] * B, 24, 1.0, gen)
        prompts = [pre[r, :int(pre_len[r])].tolist() if tb[r] == 0 else [BOS]
                   for r in range(B)]
        rows.append(base.generate(prompts, seq_len, tb, gen))
        log("  sampled %d/%d sequences" % (s + B, n_seq))
    toks = torch.cat(rows)
    valid = torch.full((toks.shape[0],), toks.shape[1], dtype=torch.long)
    for r in range(toks.shape[0]):
        stop = ((toks[r, 1:] == BOS) | (toks[r, 1:] == EOS)).nonzero()
        if len(stop):
            valid[r] = int(stop[0]) + 2
    return toks, valid


def teacher(base, toks, batch=64):
    """h_0 and the base model's log-probabilities (fp16) for every position."""
    hs, lps = [], []
    for s in range(0, toks.shape[0], batch):
        h, lg = base.forward(toks[s:s + batch])
        hs.append(h)
        lps.append(torch.log_softmax(lg, -1).half())
    return torch.cat(hs), torch.cat(lps)


# ------------------------------------------------------------------------------------
# evaluation


def sampled_prompts(base, n, seed):
    """Prefixes (8..24 tokens, BOS first) of stories sampled from the base model at
    temperature 1.0 with a seed that the training data does not use."""
    gen = torch.Generator().manual_seed(seed)
    samp = base.generate([[BOS]] * n, 24, 1.0, gen)
    lens = torch.randint(8, 25, (n,), generator=gen)
    return [samp[r, :int(lens[r])].tolist() for r in range(n)]


def eval_prompts(base, tok, n_prompts, seed):
    """Standard evaluation set: the two reference prompts plus n_prompts - 2 sampled
    prefixes (held-out seed)."""
    return [tok.encode("Once upon a time"), tok.encode("Tom and Sue went to the")] + \
        sampled_prompts(base, n_prompts - 2, seed)


def unseen_prompts(base, n_prompts, seed, toks):
    """Stricter set: sampled prefixes (another held-out seed) that are not a prefix of any
    training sequence. Story openings are stereotyped ("Once upon a time, there was a
    little girl named ..."), so many sampled prompts also start some training sequence."""
    heads = set()
    for row in toks[:, :25].tolist():
        for L in range(8, 26):
            heads.add(tuple(row[:L]))
    out = []
    for p in sampled_prompts(base, 8 * n_prompts, seed):
        if tuple(p) not in heads:
            out.append(p)
            if len(out) == n_prompts:
                break
    return out


@torch.no_grad()
def evaluate(base, mtp, prompts, n_gen=128):
    """Greedy draft-and-verify simulation. After the prefill the main model has sampled
    t_p; a decode step with last sampled token t_n drafts d1 (module 1 at position n-1,
    input t_n) and d2 (module 2 at n-1, input d1), the main model verifies [t_n, d1, d2]
    in one pass; accepted = longest prefix of [d1, d2] equal to the greedy continuation
    [t_{n+1}, t_{n+2}]; the step emits 1 + accepted tokens. Runs until n_gen tokens are
    generated. Greedy decoding makes the output identical to plain greedy decoding, so the
    greedy sequence is computed first and the drafts compared against it."""
    steps = acc1 = acc2 = emitted = 0
    hist = [0, 0, 0]
    total = max(len(p) for p in prompts) + n_gen + 3
    seqs = base.generate(prompts, total, 0.0, None)
    h0, _ = base.forward(seqs)
    d1s, d2s, _, _, _ = mtp.draft(base, h0, seqs)
    for r, pr in enumerate(prompts):
        P = len(pr)
        d1, d2, s = d1s[r].tolist(), d2s[r].tolist(), seqs[r].tolist()
        n = P  # t_P is the token sampled by the prefill
        while n - P + 1 < n_gen:
            a = 0
            if d1[n - 1] == s[n + 1]:
                a = 1
                if d2[n - 1] == s[n + 2]:
                    a = 2
            steps += 1
            acc1 += a >= 1
            acc2 += a >= 2
            hist[a] += 1
            emitted += 1 + a
            n += 1 + a
    return {"mean_acceptance_length": emitted / steps, "steps": steps,
            "rate_d1": acc1 / steps, "rate_d2_given_d1": acc2 / max(acc1, 1),
            "rate_d2": acc2 / steps, "hist_accepted_0_1_2": hist, "prompts": len(prompts),
            "tokens_per_prompt": n_gen}


@torch.no_grad()
def tf_accuracy(base, mtp, toks, valid, h0, lp):
    """Teacher-forced top-1 agreement with the base model's argmax, per module."""
    outs = mtp.forward_tf(base, h0, toks)
    res = []
    T = toks.shape[1]
    for k, (_, lg) in enumerate(outs, start=1):
        tgt = lp[:, k:].float().argmax(-1)
        m = (torch.arange(T - k)[None, :] + k) < valid[:, None]
        res.append(float(((lg.argmax(-1) == tgt) & m).sum()) / float(m.sum()))
    return res


# ------------------------------------------------------------------------------------
# training


def train(base, mtp, toks, valid, h0, lp, args):
    T = toks.shape[1]
    N = toks.shape[0]
    opt = torch.optim.AdamW(mtp.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.wd)
    gen = torch.Generator().manual_seed(args.seed + 17)
    warm = max(1, args.steps // 20)
    t0 = time.time()
    perm = torch.randperm(N, generator=gen)
    cur = 0
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warm) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        if cur + args.batch > N:
            perm = torch.randperm(N, generator=gen)
            cur = 0
        idx = perm[cur:cur + args.batch]
        cur += args.batch
        tb, vb, hb, lpb = toks[idx], valid[idx], h0[idx], lp[idx]
        outs = mtp.forward_tf(base, hb, tb)
        loss = 0.0
        parts = []
        for k, (_, lg) in enumerate(outs, start=1):
            tlp = lpb[:, k:].float()
            slp = torch.log_softmax(lg, -1)
            m = ((torch.arange(T - k)[None, :] + k) < vb[:, None]).float()
            kl = (tlp.exp() * (tlp - slp)).sum(-1)
            ce = F.nll_loss(slp.transpose(1, 2), tlp.argmax(-1), reduction="none")
            lk = ((kl + args.hard * ce) * m).sum() / m.sum()
            parts.append(float(lk))
            loss = loss + args.depth_w[k - 1] * lk
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            log("step %5d  lr %.2e  loss1 %.4f  loss2 %.4f  (%.0fs)" %
                (step, lr, parts[0], parts[1], time.time() - t0))
    return time.time() - t0


# ------------------------------------------------------------------------------------
# reference outputs for the C implementation


@torch.no_grad()
def reference(base, mtp, prompt, n_total, path, gguf_path):
    seq = base.generate([prompt], n_total, 0.0, None)
    h0, lg0 = base.forward(seq)
    d1, d2d, h1, l1, l2d = mtp.draft(base, h0, seq)
    tf = mtp.forward_tf(base, h0, seq)
    l2 = tf[1][1]
    T = seq.shape[1]

    def margin(lg):
        top = lg.topk(2, -1).values
        return [round(float(x), 6) for x in (top[..., 0] - top[..., 1])[0]]

    def f8(x):
        return [float("%.7g" % v) for v in x[:8].tolist()]

    probe = [0, 4, 10, 20, T - 3]
    ref = {
        "description": "Reference values for the MTP modules in %s, from tools/mtp/train_mtp.py "
                       "(PyTorch fp32; compare argmax ids exactly where the top1-top2 margin is "
                       "not tiny, floats with a tolerance ~1e-4 relative)."
                       % os.path.basename(gguf_path),
        "tokens": seq[0].tolist(),
        "prompt_len": len(prompt),
        "semantics": {
            "h0": "main model residual at position i after the last block, before rms_final",
            "mtp1[i]": "module 1 at position i (RoPE pos i) with h0[i] and t[i+1]; predicts "
                       "t[i+2]",
            "mtp2[i]": "module 2 at position i with h1[i] and t[i+2] (teacher-forced); "
                       "predicts t[i+3]",
            "mtp2_draft[i]": "module 2 at position i with h1[i] and mtp1_argmax[i], its K/V "
                             "history at positions s < i computed from the real t[s+2]",
        },
        "main_argmax": lg0[0].argmax(-1).tolist(),
        "h0": [[float("%.7g" % v) for v in row] for row in h0[0].tolist()],
        "mtp1_argmax": d1[0].tolist(),
        "mtp1_margin": margin(l1),
        "mtp2_argmax": l2[0].argmax(-1).tolist(),
        "mtp2_margin": margin(l2),
        "mtp2_draft_argmax": d2d[0].tolist(),
        "mtp2_draft_margin": margin(l2d),
        "h1_first8": {str(i): f8(h1[0, i]) for i in probe},
        "mtp1_logits_first8": {str(i): f8(l1[0, i]) for i in probe},
        "mtp2_logits_first8": {str(i): f8(l2[0, i]) for i in probe},
        "mtp2_draft_logits_first8": {str(i): f8(l2d[0, i]) for i in probe},
    }
    with open(path, "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    log("wrote %s" % path)


# ------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="llama2.c .bin (version 0)")
    ap.add_argument("--tokenizer", help="tokenizer .bin (default: tok*.bin beside the "
                    "checkpoint; used for the reference prompts only)")
    ap.add_argument("--out", required=True, help="output GGUF side file")
    ap.add_argument("--ref", help="reference JSON path (default: OUT with .ref.json)")
    ap.add_argument("--cache", default="build/mtp", help="where sampled data is cached")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-only", action="store_true",
                    help="load OUT, evaluate acceptance and rewrite the reference JSON")
    ap.add_argument("--n-seq", type=int, default=4000, help="training sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--greedy-frac", type=float, default=0.4)
    ap.add_argument("--low-temp-frac", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.0)
    ap.add_argument("--hard", type=float, default=0.0, help="weight of hard CE to the "
                    "teacher argmax, added to the KL")
    ap.add_argument("--depth-w", type=float, nargs=2, default=[1.0, 1.0])
    ap.add_argument("--init", choices=["copy", "random"], default="copy")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()

    c, w = load_checkpoint(args.checkpoint)
    base = Base(c, w)
    base_sha = sha256_file(args.checkpoint)
    base_name = os.path.splitext(os.path.basename(args.checkpoint))[0]
    tok_path = args.tokenizer
    if not tok_path:
        d = os.path.dirname(os.path.abspath(args.checkpoint))
        cands = sorted(f for f in os.listdir(d) if f.startswith("tok") and f.endswith(".bin"))
        if not cands:
            sys.exit("no tok*.bin beside the checkpoint; pass --tokenizer")
        tok_path = os.path.join(d, cands[0])
    tok = Tokenizer(tok_path, c.vocab_size)
    log("base %s: dim %d hidden %d layers %d heads %d/%d vocab %d seq %d sha256 %s" %
        (base_name, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size,
         c.seq_len, base_sha[:16]))

    # sanity: the reimplementation must reproduce run.c's greedy output
    if base_sha == "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696":
        want = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]
        pr = tok.encode("Once upon a time")
        assert pr == [1, 403, 407, 261, 378], pr
        got = base.generate([pr], len(pr) + len(want), 0.0, None)[0, len(pr):].tolist()
        if got != want:
            sys.exit("reimplementation check FAILED: %s != %s" % (got, want))
        log("reimplementation check OK (greedy 'Once upon a time' matches run.c)")

    mtp = MTP(c)
    ref_path = args.ref or (os.path.splitext(args.out)[0] + ".ref.json")
    prompts = eval_prompts(base, tok, args.eval_prompts, args.seed + 1000003)
    cache = os.path.join(args.cache, "data-%s-s%d-n%d-T%d-g%g-l%g.pt" % (
        base_sha[:12], args.seed, args.n_seq, args.seq_len, args.greedy_frac,
        args.low_temp_frac))

    if args.eval_only:
        meta = mtp.from_gguf(args.out)
        if meta.get("tidepool.mtp.base_sha256") != base_sha:
            log("WARNING: side file was trained for base sha256 %s" %
                meta.get("tidepool.mtp.base_sha256"))
        r = evaluate(base, mtp, prompts)
        log("eval (standard, %d prompts): %s" % (len(prompts), json.dumps(r)))
        if os.path.exists(cache):
            toks = torch.load(cache)["toks"][:args.n_seq]
            unseen = unseen_prompts(base, args.eval_prompts, args.seed + 2000003, toks)
            ru = evaluate(base, mtp, unseen)
            log("eval (unseen, %d prompts): %s" % (len(unseen), json.dumps(ru)))
        else:
            log("(no data cache %s: skipping the unseen-prompt evaluation)" % cache)
        reference(base, mtp, [1, 403, 407, 261, 378], 40, ref_path, args.out)
        return

    os.makedirs(args.cache, exist_ok=True)
    if os.path.exists(cache):
        d = torch.load(cache)
        toks, valid = d["toks"], d["valid"]
        log("loaded %d cached sequences from %s" % (toks.shape[0], cache))
    else:
        t0 = time.time()
        n_all = args.n_seq + 128  # + a held-out slice for teacher-forced accuracy
        toks, valid = sample_corpus(base, n_all, args.seq_len, args.seed,
                                    args.greedy_frac, args.low_temp_frac)
        torch.save({"toks": toks, "valid": valid}, cache)
        log("sampled %d sequences in %.0fs -> %s" % (toks.shape[0], time.time() - t0, cache))
    unseen = unseen_prompts(base, args.eval_prompts, args.seed + 2000003, toks[:args.n_seq])
    log("eval prompts: standard %d; unseen %d" % (len(prompts), len(unseen)))
    t0 = time.time()
    h0, lp = teacher(base, toks)
    log("teacher pass %.0fs; mean valid length %.1f" % (time.time() - t0, valid.float().mean()))
    ho = slice(args.n_seq, toks.shape[0])
    tr = slice(0, args.n_seq)

    gen = torch.Generator().manual_seed(args.seed)
    mtp.init_weights(base, gen, args.init)
    secs = train(base, mtp, toks[tr], valid[tr], h0[tr], lp[tr], args)
    acc = tf_accuracy(base, mtp, toks[ho], valid[ho], h0[ho], lp[ho])
    log("held-out teacher-forced top-1 agreement: module1 %.3f module2 %.3f" % tuple(acc))
    r = evaluate(base, mtp, prompts)
    log("eval (standard, %d prompts): %s" % (len(prompts), json.dumps(r)))
    ru = evaluate(base, mtp, unseen)
    log("eval (unseen, %d prompts): %s" % (len(unseen), json.dumps(ru)))
    log("training %.0fs, total %.0fs" % (secs, time.time() - t_start))

    recipe = ("self-distillation: %d seqs x %d tokens sampled from the base (%.0f%% greedy "
              "after a 2-24 token temp-1 prefix, %.0f%% temp 0.7, rest temp 1.0); loss = "
              "KL(base || module) at position i+k%s, depth weights %s; AdamW lr %g cosine, "
              "batch %d, init %s" % (args.n_seq, args.seq_len, 100 * args.greedy_frac,
                                     100 * args.low_temp_frac,
                                     " + %g CE(argmax)" % args.hard if args.hard else "",
                                     args.depth_w, args.lr, args.batch, args.init))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    mtp.to_gguf(args.out, base, {
        "name": "%s-mtp" % base_name, "base_name": base_name, "base_sha256": base_sha,
        "base_bytes": os.path.getsize(args.checkpoint),
        "acceptance_length": r["mean_acceptance_length"],
        "acceptance_rate": [r["rate_d1"], r["rate_d2_given_d1"]],
        "acceptance_length_unseen": ru["mean_acceptance_length"],
        "eval_prompts": r["prompts"], "eval_tokens": r["tokens_per_prompt"],
        "seed": args.seed, "steps": args.steps, "recipe": recipe})
    log("wrote %s (%d bytes)" % (args.out, os.path.getsize(args.out)))
    # reference values from the weights as written
    mtp2 = MTP(c)
    mtp2.from_gguf(args.out)
    reference(base, mtp2, [1, 403, 407, 261, 378], 40, ref_path, args.out)


if __name__ == "__main__":
    main()
