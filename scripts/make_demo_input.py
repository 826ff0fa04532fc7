#!/usr/bin/env python3
"""Cut the embedded demo input of the `pisa` CLI out of the SmolLM2 capture.

Reads one layer of `smollm2-rustbook-8k.safetensors` (bf16 Q/K/V in head, token, dim layout),
keeps the first N tokens, converts bf16 -> f32 -> f16 and writes `q`, `k`, `v` (f16) and
`token_ids` (i32) with the softmax scale and provenance in the metadata.

Needs numpy only: bf16 is decoded by hand, and the output is written by `write_safetensors`
below with sorted keys, so the file is byte-for-byte reproducible (the `safetensors` package
writes metadata in hash order).

    python3 scripts/make_demo_input.py \
        --src ../shared/data/smollm2-rustbook-8k.safetensors \
        --layer 15 --tokens 4096 --out data/demo-smollm2-layer15-4096.safetensors
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SRC = REPO.parent / "shared" / "data" / "smollm2-rustbook-8k.safetensors"


def read_raw(path):
    """Return (header dict, bytes of the data section) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    if n + 8 > len(blob):
        sys.exit(f"{path}: header length {n} exceeds the file size {len(blob)}")
    return json.loads(blob[8 : 8 + n]), memoryview(blob)[8 + n :]


def load(header, data, name):
    """Load tensor `name` as a numpy array (bf16 widened to float32)."""
    info = header[name]
    start, end = info["data_offsets"]
    raw = data[start:end]
    shape = info["shape"]
    if info["dtype"] == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    dtypes = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8"}
    return np.frombuffer(raw, dtype=dtypes[info["dtype"]]).reshape(shape)


def write_safetensors(path, tensors, metadata):
    """Write numpy arrays as a safetensors file: keys sorted, header padded to 8 bytes."""
    names = {np.dtype("<f2"): "F16", np.dtype("<f4"): "F32", np.dtype("<i4"): "I32"}
    header, offset = {"__metadata__": dict(sorted(metadata.items()))}, 0
    for name in sorted(tensors):
        x = tensors[name]
        header[name] = {"dtype": names[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).astype(tensors[name].dtype.newbyteorder("<")).tobytes())
    tmp.replace(path)


def layer_scale(meta, layer):
    """The softmax scale of `layer` from the capture's metadata."""
    if f"layer{layer}.scale" in meta:
        return float(meta[f"layer{layer}.scale"])
    if "layers" in meta:
        return float(json.loads(meta["layers"])[str(layer)]["scale"])
    return float(meta["scale"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC)
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=REPO / "data" / "demo-smollm2-layer15-4096.safetensors")
    args = ap.parse_args()

    header, data = read_raw(args.src)
    meta = header.get("__metadata__", {})
    n, layer = args.tokens, args.layer
    tensors = {}
    for part in "qkv":
        x = load(header, data, f"layer{layer}.{part}")
        if x.shape[1] < n:
            sys.exit(f"layer{layer}.{part} has only {x.shape[1]} tokens, asked for {n}")
        x = np.ascontiguousarray(x[:, :n, :]).astype(np.float16)
        if not np.isfinite(x).all():
            sys.exit(f"layer{layer}.{part}: values overflow f16")
        tensors[part] = x
    tensors["token_ids"] = np.ascontiguousarray(load(header, data, "token_ids")[:n]).astype(np.int32)

    scale = layer_scale(meta, layer)
    out_meta = {
        "scale": repr(scale),
        "layer": str(layer),
        "tokens": f"0..{n}",
        "layout": "q [Hq, N, D], k/v [Hkv, N, D] (head, token, dim; batch 1 implied); causal",
        "source": f"{args.src.name} (layer{layer}.q/k/v, bf16 -> f32 -> f16)",
        "model": f"SmolLM2-135M-Instruct (Apache-2.0), {meta.get('model', '?')}",
        "text": 'The Rust Programming Language (MIT / Apache-2.0), first tokens of the single-page HTML, tags stripped',
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(args.out, tensors, out_meta)
    for k, v in tensors.items():
        print(f"{k}: {v.dtype} {list(v.shape)} max|x| {np.abs(v.astype(np.float64)).max():.4g}")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes), scale {scale}")


if __name__ == "__main__":
    main()
