#!/usr/bin/python3
"""Independent check of an MTP side file against its reference JSON, written the way the C
engine runs it: one position at a time (run.c style, numpy fp32), with a KV cache for the
main model and one per MTP module, and the serving loop of docs/mtp.md (greedy
draft-and-verify, module K/V history rewritten from the real tokens once they are known).

  /usr/bin/python3 tools/mtp/ref_outputs.py \\
      --checkpoint ../shared/models/stories260K/stories260K.bin \\
      --mtp models/mtp/stories260K-mtp.gguf [--ref models/mtp/stories260K-mtp.ref.json]
      [--prompt 1,403,407,261,378] [--n 128]

Checks h_0, main argmax, module-1 and module-2 (draft) argmax per position and the probed
logits against the JSON (written by train_mtp.py from PyTorch's batched forward), then
prints the acceptance of a greedy draft-and-verify run on the prompt. Needs numpy only.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf_writer import read_gguf  # noqa: E402

EPS = np.float32(1e-5)


def rmsnorm(x, w):
    ss = np.float32(np.dot(x, x) / np.float32(x.size)) + EPS
    return (w * (x * np.float32(1.0 / np.sqrt(ss)))).astype(np.float32)


def silu(x):
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


class Block:
    """One llama block with its own KV cache (run.c's layer body)."""

    def __init__(self, w, dim, n_heads, n_kv_heads, max_t):
        self.w = w
        self.dim, self.nh, self.nkv = dim, n_heads, n_kv_heads
        self.hs = dim // n_heads
        self.kv_dim = n_kv_heads * self.hs
        self.kc = np.zeros((max_t, self.kv_dim), np.float32)
        self.vc = np.zeros((max_t, self.kv_dim), np.float32)

    def rope(self, v, pos, n):
        v = v.copy()
        for i in range(0, n, 2):
            hi = i % self.hs
            freq = np.float32(1.0) / np.power(np.float32(10000.0), np.float32(hi) /
                                              np.float32(self.hs))
            val = np.float32(pos) * np.float32(freq)
            fcr, fci = np.float32(np.cos(val)), np.float32(np.sin(val))
            v0, v1 = v[i], v[i + 1]
            v[i], v[i + 1] = v0 * fcr - v1 * fci, v0 * fci + v1 * fcr
        return v

    def __call__(self, x, pos):
        """x: (dim,) input at position pos; writes K/V at pos, attends over 0..pos."""
        w = self.w
        xb = rmsnorm(x, w["attn_norm"])
        q = self.rope(w["wq"] @ xb, pos, self.dim)
        k = self.rope(w["wk"] @ xb, pos, self.kv_dim)
        self.kc[pos] = k
        self.vc[pos] = w["wv"] @ xb
        kv_mul = self.nh // self.nkv
        out = np.zeros(self.dim, np.float32)
        for h in range(self.nh):
            qh = q[h * self.hs:(h + 1) * self.hs]
            g = (h // kv_mul) * self.hs
            att = (self.kc[:pos + 1, g:g + self.hs] @ qh) / np.float32(np.sqrt(self.hs))
            att = np.exp(att - att.max())
            att /= att.sum()
            out[h * self.hs:(h + 1) * self.hs] = att @ self.vc[:pos + 1, g:g + self.hs]
        x = x + w["wo"] @ out
        xb = rmsnorm(x, w["ffn_norm"])
        return (x + w["w2"] @ (silu(w["w1"] @ xb) * (w["w3"] @ xb))).astype(np.float32)


def load_base(path):
    with open(path, "rb") as f:
        raw = f.read()
    dim, hid, L, H, KVH, vocab, seq = struct.unpack_from("<7i", raw, 0)
    shared = vocab > 0
    vocab = abs(vocab)
    kv = KVH * (dim // H)
    a = np.frombuffer(raw, "<f4", offset=28)
    pos = 0

    def take(*s):
        nonlocal pos
        n = int(np.prod(s))
        r = a[pos:pos + n].reshape(s)
        pos += n
        return r

    emb = take(vocab, dim)
    ra, wq, wk, wv, wo = take(L, dim), take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), \
        take(L, dim, dim)
    rf, w1, w2, w3 = take(L, dim), take(L, hid, dim), take(L, dim, hid), take(L, hid, dim)
    rfin = take(dim)
    take(seq, dim // H // 2)
    take(seq, dim // H // 2)
    out = emb if shared else take(vocab, dim)
    layers = [dict(attn_norm=ra[l], wq=wq[l], wk=wk[l], wv=wv[l], wo=wo[l], ffn_norm=rf[l],
                   w1=w1[l], w2=w2[l], w3=w3[l]) for l in range(L)]
    return dict(dim=dim, H=H, KVH=KVH, L=L, seq=seq, emb=emb, out=out, rms_final=rfin,
                layers=layers)


NAMES = dict(attn_norm="attn_norm", wq="attn_q", wk="attn_k", wv="attn_v", wo="attn_output",
             ffn_norm="ffn_norm", w1="ffn_gate", w2="ffn_down", w3="ffn_up")


class Engine:
    def __init__(self, base, mtp_path, max_t):
        self.b = base
        meta, t = read_gguf(mtp_path)
        self.meta = meta
        nl = meta["llama.block_count"]
        assert nl == base["L"] and meta["llama.embedding_length"] == base["dim"]
        mk = lambda w: Block(w, base["dim"], base["H"], base["KVH"], max_t)  # noqa: E731
        self.main = [mk(w) for w in base["layers"]]
        self.mods = []
        for k in range(meta["llama.nextn_predict_layers"]):
            pre = "blk.%d." % (nl + k)
            w = {key: t[pre + n + ".weight"] for key, n in NAMES.items()}
            self.mods.append(dict(block=mk(w), eh=t[pre + "nextn.eh_proj.weight"],
                                  enorm=t[pre + "nextn.enorm.weight"],
                                  hnorm=t[pre + "nextn.hnorm.weight"]))

    def logits(self, h):
        return self.b["out"] @ rmsnorm(h, self.b["rms_final"])

    def main_step(self, tok, pos):
        x = self.b["emb"][tok].copy()
        for blk in self.main:
            x = blk(x, pos)
        return x  # h_0[pos]

    def mod_step(self, k, h_prev, tok, pos):
        m = self.mods[k]
        cat = np.concatenate([rmsnorm(h_prev, m["hnorm"]), rmsnorm(self.b["emb"][tok], m["enorm"])])
        return m["block"](m["eh"] @ cat, pos)


def run(eng, prompt, n_gen):
    """Greedy draft-and-verify with MTP2, as docs/mtp.md describes the serving loop.
    Returns (tokens, per-position dict of values, steps [(n, d1, d2, accepted)])."""
    toks = list(prompt)
    h0, h1 = {}, {}
    rec = {"d1": {}, "d2": {}, "l1": {}, "l2": {}, "h1": {}}
    for p, t in enumerate(prompt):  # prefill
        h0[p] = eng.main_step(t, p)
    toks.append(int(np.argmax(eng.logits(h0[len(prompt) - 1]))))
    m1_next = m2_next = 0  # first module position not yet written from real tokens
    steps = []
    while len(toks) - len(prompt) < n_gen:
        n = len(toks) - 1  # t_n is the last sampled token; main processed 0..n-1
        for j in range(m1_next, n):  # module 1 at j: (h0[j], t_{j+1}); all real
            h1[j] = eng.mod_step(0, h0[j], toks[j + 1], j)
        m1_next = n
        l1 = eng.logits(h1[n - 1])
        d1 = int(np.argmax(l1))
        for j in range(m2_next, n - 1):  # module 2 at j: (h1[j], t_{j+2}); real history
            eng.mod_step(1, h1[j], toks[j + 2], j)
        m2_next = n - 1  # the draft entry at n-1 is rewritten next step
        l2 = eng.logits(eng.mod_step(1, h1[n - 1], d1, n - 1))
        d2 = int(np.argmax(l2))
        rec["d1"][n - 1], rec["d2"][n - 1] = d1, d2
        rec["l1"][n - 1], rec["l2"][n - 1], rec["h1"][n - 1] = l1, l2, h1[n - 1]
        # verify [t_n, d1, d2] at positions n, n+1, n+2 (one pass in the engine)
        acc = 0
        for i, tok in enumerate([toks[n], d1, d2]):
            h0[n + i] = eng.main_step(tok, n + i)
            g = int(np.argmax(eng.logits(h0[n + i])))
            toks.append(g)
            if i == 2 or g != [d1, d2][i]:
                break
            acc += 1
        steps.append((n, d1, d2, acc))
    return toks, h0, rec, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--mtp", required=True)
    ap.add_argument("--ref")
    ap.add_argument("--prompt", default="1,403,407,261,378")
    ap.add_argument("--n", type=int, default=128)
    args = ap.parse_args()
    prompt = [int(x) for x in args.prompt.split(",")]
    base = load_base(args.checkpoint)
    eng = Engine(base, args.mtp, len(prompt) + args.n + 4)
    toks, h0, rec, steps = run(eng, prompt, args.n)
    emitted = sum(1 + s[3] for s in steps)
    a1 = sum(s[3] >= 1 for s in steps)
    a2 = sum(s[3] >= 2 for s in steps)
    print("greedy draft-and-verify: %d steps, mean acceptance length %.3f, d1 %.3f, "
          "d2|d1 %.3f" % (len(steps), emitted / len(steps), a1 / len(steps), a2 / max(a1, 1)))
    ref_path = args.ref or os.path.splitext(args.mtp)[0] + ".ref.json"
    if not os.path.exists(ref_path) or args.prompt != "1,403,407,261,378":
        return 0
    ref = json.load(open(ref_path))
    bad = 0
    T = len(ref["tokens"])
    if toks[:T] != ref["tokens"]:
        print("FAIL tokens differ")
        bad += 1
    err = max(float(np.abs(h0[i] - np.array(ref["h0"][i], np.float32)).max())
              for i in range(T) if i in h0)
    print("h0 max abs diff %.2e" % err)
    bad += err > 1e-3
    for key, rk, mk in (("d1", "mtp1_argmax", "mtp1_margin"),
                        ("d2", "mtp2_draft_argmax", "mtp2_draft_margin")):
        cmp = [(i, v) for i, v in rec[key].items() if i < len(ref[rk])]
        diff = [(i, v, ref[rk][i]) for i, v in cmp if v != ref[rk][i] and ref[mk][i] > 1e-3]
        print("%s: %d positions compared, %d differ" % (key, len(cmp), len(diff)))
        bad += len(diff)
    for key, rk in (("l1", "mtp1_logits_first8"), ("l2", "mtp2_draft_logits_first8"),
                    ("h1", "h1_first8")):
        for i, v in ref[rk].items():
            if int(i) in rec[key]:
                e = float(np.abs(rec[key][int(i)][:8] - np.array(v, np.float32)).max())
                print("%s pos %s max abs diff %.2e" % (rk, i, e))
                bad += e > 1e-3
    print("OK" if not bad else "FAIL (%d)" % bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
