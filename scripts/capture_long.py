#!/usr/bin/env python3
"""Long real attention inputs (64K to 256K tokens) for `pisa bench -i` and `pisa recall -i`,
from SmolLM2-135M-Instruct's Q4_1 GGUF file, without `transformers`.

`scripts/capture_qkv.py` runs the whole model through `transformers`; a machine without network
access cannot load the 98 MB GGUF file that needs. This script splits the work in two:

  pack     (numpy, gguf, tokenizers; any machine): the GGUF file and text files -> a pack (.npz)
           with the first L layers' weights as the file stores them (Q4_1 blocks, f32 norms),
           the embedding rows (Q8_0) of the tokens the text uses only
           and the text's token ids; 40 MB for 16 layers and 256K tokens.
  capture  (torch; a GPU for long inputs): the pack -> Q, K, V of the chosen layers for the
           first N tokens, after rotary embedding, GQA not expanded, in the layout pisa reads
           (`layer{i}.q` [Hq, N, D], `layer{i}.k`, `layer{i}.v` [Hkv, N, D], `token_ids` [N];
           metadata as capture_qkv.py's).

The forward pass is the Llama architecture written out (RMSNorm, rotary embedding as
`transformers` applies it, causal GQA attention by SDPA, SwiGLU MLP) in float32 on the
dequantised weights; Q and K weights are taken back from the GGUF file's interleaved-RoPE row
order to the model's. A layer's inputs depend only on the layers below it and the tokens before,
so the first L layers of the file reproduce the model's first L layers exactly.

`capture --check FILE` compares the captured layers with the same layers and tokens of another
capture (e.g. the shared `smollm2-rustbook-8k.safetensors`) and fails on a mismatch beyond two
bf16 rounding steps.

SmolLM2 was trained on 8K-token contexts (rope theta 1e5); past them its attention is still the
trained model's, not a model tuned for that length.

Examples:
    D=~/.rustup/toolchains/1.95.0-x86_64-unknown-linux-gnu/share/doc/rust/html
    python3 scripts/capture_long.py pack --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text $D/book/print.html $D/reference/print.html $D/nomicon/print.html \\
        --start '\n                        The Rust Programming Language' \\
        --layers 12 --max-tokens 262144 --out smollm2-12.npz
    python3 scripts/capture_long.py capture --pack smollm2-12.npz --tokens 262144 \\
        --layers 0,5,11 --out qkv-256k.safetensors
"""
import argparse
import codecs
import html
import json
import math
import re

def pack(args):
    import gguf
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(args.gguf)

    def field(name):
        f = r.fields[name]
        return f.parts[f.data[0]]

    def strings(name):
        f = r.fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    # The file's own tokenizer (GPT-2 byte-level BPE; SmolLM2 splits digits one by one).
    toks, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(toks)},
                     merges=[tuple(m.split(" ", 1)) for m in merges])
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    text = "".join(read_text(p) for p in args.text)
    if args.start:
        start = codecs.decode(args.start, "unicode_escape")
        if start not in text:
            raise SystemExit(f"--start: {args.start!r} is not in the text")
        text = text[text.index(start):]
    ids = np.array(tk.encode(text).ids[: args.max_tokens], dtype=np.int32)
    used, local = np.unique(ids, return_inverse=True)

    out = {"ids": ids, "local_ids": local.astype(np.int32)}
    cfg = {k: float(field(f"llama.{k}")[0]) for k in (
        "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon")}
    cfg["layers"] = args.layers
    cfg["model"] = args.gguf.split("/")[-1]
    cfg["text"] = ",".join(p.split("/")[-1] for p in args.text)
    for t in r.tensors:
        if t.name == "token_embd.weight":
            if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
                raise SystemExit(f"{t.name}: {t.tensor_type.name} is not handled")
            out["embed"] = np.asarray(t.data, dtype=np.uint8)[used]
            out["embed.shape"] = np.array([len(used), int(t.shape[0])], dtype=np.int64)
            continue
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) >= args.layers:
            continue
        name = t.name.removesuffix(".weight")
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            out[name] = np.asarray(t.data, dtype=np.float32)
        elif t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            out[name] = np.asarray(t.data, dtype=np.uint8).reshape(-1)
            out[name + ".shape"] = np.array([int(t.shape[1]), int(t.shape[0])], dtype=np.int64)
        else:
            raise SystemExit(f"{t.name}: {t.tensor_type.name} is not handled")
    np.savez(args.out, cfg=np.frombuffer(json.dumps(cfg).encode(), dtype=np.uint8), **out)
    print(f"{args.out}: {len(ids)} tokens ({len(used)} distinct), {args.layers} layers")


def read_text(path):
    """A text file, or an HTML file's text (scripts, styles, navigation and the head dropped,
    tags stripped, entities decoded: the text of the shared 8K capture, for the Rust book's
    print.html)."""
    s = open(path, encoding="utf-8").read()
    if path.endswith(".html"):
        s = re.sub(r"(?is)<(script|style|nav|head)\b.*?</\1>", "", s)
        s = html.unescape(re.sub(r"(?s)<[^>]+>", "", s))
    return s


def dequant_q8_0(raw, shape):
    """Q8_0 blocks (f16 d, 32 int8 values) -> float32 `shape`."""
    import torch

    b = raw.reshape(-1, 34)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    return (b[:, 2:].contiguous().view(torch.int8).float() * d).reshape(*shape)


def dequant_q4_1(raw, shape):
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles: values j and j + 16) -> float32 `shape`."""
    import torch

    b = raw.reshape(-1, 20)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:20].to(torch.int32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).float()
    return (q * d + m).reshape(*shape)


def unpermute(w, heads):
    """The GGUF file's rows of a Q or K weight (pairs interleaved per head for llama.cpp's RoPE)
    back to the model's (each head's first halves, then its second halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def capture(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    z = np.load(args.pack)
    cfg = json.loads(bytes(z["cfg"]).decode())
    hidden, hq, hkv = (int(cfg[k]) for k in (
        "embedding_length", "attention.head_count", "attention.head_count_kv"))
    d, eps, theta = hidden // hq, cfg["attention.layer_norm_rms_epsilon"], cfg["rope.freq_base"]
    want = sorted(int(x) for x in args.layers.split(","))
    if want[-1] >= cfg["layers"]:
        raise SystemExit(f"the pack holds layers 0..{cfg['layers'] - 1}")
    n = args.tokens
    if n > len(z["ids"]):
        raise SystemExit(f"the pack holds {len(z['ids'])} tokens")

    def t(name):
        return torch.from_numpy(np.array(z[name])).to(dev)

    def weight(name, heads=None):
        w = dequant_q4_1(t(name), tuple(z[name + ".shape"]))
        return unpermute(w, heads) if heads else w

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    pos = torch.arange(n, device=dev, dtype=torch.float32)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = dequant_q8_0(t("embed"), tuple(z["embed.shape"]))[t("local_ids")[:n].long()]
    out, scale = {}, 1.0 / math.sqrt(d)
    for i in range(want[-1] + 1):
        p = f"blk.{i}."
        h = rms(x, t(p + "attn_norm"))
        q = rope((h @ weight(p + "attn_q", hq).T).view(n, hq, d).transpose(0, 1))
        k = rope((h @ weight(p + "attn_k", hkv).T).view(n, hkv, d).transpose(0, 1))
        v = (h @ weight(p + "attn_v").T).view(n, hkv, d).transpose(0, 1)
        if i in want:
            dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
            for nm, a in (("q", q), ("k", k), ("v", v)):
                out[f"layer{i}.{nm}"] = a.to(dt).contiguous().cpu()
        if i == want[-1]:
            break
        g = hq // hkv
        at = {"f32": torch.float32, "bf16": torch.bfloat16}[args.attention]
        a = F.scaled_dot_product_attention(
            q[None].to(at), k.repeat_interleave(g, 0)[None].to(at),
            v.repeat_interleave(g, 0)[None].to(at), is_causal=True, scale=scale)[0].float()
        x = x + a.transpose(0, 1).reshape(n, hidden) @ weight(p + "attn_output").T
        h = rms(x, t(p + "ffn_norm"))
        x = x + (F.silu(h @ weight(p + "ffn_gate").T) * (h @ weight(p + "ffn_up").T)) \
            @ weight(p + "ffn_down").T
    out["token_ids"] = torch.from_numpy(np.array(z["ids"][:n], dtype=np.int32))
    layers = {str(i): {"scale": scale, "sliding_window": None} for i in want}
    meta = {"layers": json.dumps(layers), "scale": str(scale), "tokens": str(n),
            "model": cfg["model"], "text": cfg["text"], "dtype": args.dtype,
            "source": "scripts/capture_long.py"}
    meta.update({f"layer{i}.scale": str(scale) for i in want})
    if args.check:
        check(out, args.check, want, n)
    if args.out:
        save_file(out, args.out, metadata=meta)
        print(f"{args.out}: layers {want}, {n} tokens")


def check(out, path, layers, n):
    """Fails unless each captured tensor is within two bf16 rounding steps of `path`'s."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(path)
    m = min(n, ref["token_ids"].shape[0])
    if not torch.equal(out["token_ids"][:m], ref["token_ids"][:m].to(torch.int32)):
        raise SystemExit("check: the token ids differ")
    for i in layers:
        for nm in "qkv":
            a = out[f"layer{i}.{nm}"][:, :m].float()
            b = ref[f"layer{i}.{nm}"][:, :m].float()
            tol = 2 * 2.0 ** -8 * b.abs().clamp(min=2.0 ** -6)
            bad = ((a - b).abs() > tol).float().mean().item()
            exact = (a == b).float().mean().item()
            print(f"check layer {i} {nm}: {exact:.4f} equal, {bad:.2e} beyond two bf16 steps")
            if bad > 1e-3:
                raise SystemExit(f"check: layer {i} {nm} differs")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--gguf", required=True)
    a.add_argument("--text", nargs="+", required=True)
    a.add_argument("--start", help="the text starts at this string's first occurrence "
                   "(backslash escapes decoded)")
    a.add_argument("--layers", type=int, default=12, help="the first L layers")
    a.add_argument("--max-tokens", type=int, default=262144)
    a.add_argument("--out", required=True)
    a.set_defaults(fn=pack)
    c = sub.add_parser("capture")
    c.add_argument("--pack", required=True)
    c.add_argument("--tokens", type=int, required=True)
    c.add_argument("--layers", required=True, help="comma-separated layer indices")
    c.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    c.add_argument("--attention", default="f32", choices=["f32", "bf16"],
                   help="the layers' attention in this precision (bf16: flash attention, for "
                   "long inputs; the rest stays float32)")
    c.add_argument("--device")
    c.add_argument("--check", help="a capture of the same model and text to compare with")
    c.add_argument("--out")
    c.set_defaults(fn=capture)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
