#!/usr/bin/env python3
"""Capture per-layer attention inputs Q, K, V of a Hugging Face causal LM for the `pisa` CLI.

Q, K and V are recorded exactly as each selected layer's attention function receives them:
after the projections, any q/k norms and the rotary embedding, before attention; GQA is not
expanded. The recording is a custom attention function registered with
`transformers.AttentionInterface`: it stores (query, key, value, scaling, sliding window) and
then calls the stock SDPA implementation, so the model's forward pass is unchanged. The SDPA
mask function is registered under the same name with `AttentionMaskInterface`; without it,
transformers builds no mask for an unknown implementation, and sliding-window layers would
silently get a plain causal mask.

Output (safetensors, the layout `pisa` reads): `layer{i}.q` [Hq, N, D], `layer{i}.k` and
`layer{i}.v` [Hkv, N, D] (batch 1 implied), `token_ids` [N] (i32). Metadata: `layer{i}.scale`,
`scale` (of the first captured layer), `layers` (JSON: {"i": {"scale", "sliding_window"}}),
`model`, `gguf_file`, `text`, `tokens`, `dtype`, `transformers`.

Examples:
    python3 scripts/capture_qkv.py --model HuggingFaceTB/SmolLM2-135M-Instruct \\
        --text-file book.txt --max-tokens 8192 --layers 0,15,29 --dtype bf16 --out qkv.safetensors
    python3 scripts/capture_qkv.py --gguf-file /models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text "Hello world" --layers all --out qkv.safetensors
"""
import argparse
import json
import math
from pathlib import Path

import torch

CAPTURE_NAME = "pisa_capture"
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def register_capture(store, layers=None, name=CAPTURE_NAME):
    """Register the recording attention (and its SDPA mask) under `name`; return `name`.

    `store` is a dict filled with `layer_idx -> dict(q, k, v, scale, sliding_window)`, tensors
    on the CPU in float32 with the batch dimension dropped. `layers` (a set of layer indices)
    limits what is recorded; None records every layer. Recording assumes batch size 1.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def capture_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if layers is None or idx in layers:
            window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
            store[idx] = {
                "q": query[0].detach().float().cpu(),
                "k": key[0].detach().float().cpu(),
                "v": value[0].detach().float().cpu(),
                "scale": float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
                "sliding_window": int(window) if window is not None else None,
            }
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, capture_attention)
    try:  # transformers >= 4.53: masks are built per attention implementation.
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    except ImportError:  # older versions build the mask independently of the implementation
        pass
    return name


@torch.no_grad()
def capture(model, input_ids, layers=None):
    """Run `model` once on `input_ids` ([1, N]) and return the recorded layers (see
    `register_capture`). The model must have been loaded with `attn_implementation=CAPTURE_NAME`
    or switched to it with `model.set_attn_implementation`."""
    store = {}
    register_capture(store, layers)
    model(input_ids=input_ids, use_cache=False)
    missing = sorted(set(layers or ()) - set(store))
    if missing:
        raise RuntimeError(f"layers {missing} were not captured (model has fewer layers, or no layer_idx)")
    return store


def to_tensors(store, token_ids, dtype):
    """Tensors and metadata entries for the output file, from a `capture` result."""
    tensors = {"token_ids": token_ids.reshape(-1).to(torch.int32).contiguous()}
    meta, layers = {}, {}
    for i in sorted(store):
        rec = store[i]
        for part in "qkv":
            tensors[f"layer{i}.{part}"] = rec[part].to(DTYPES[dtype]).contiguous()
        meta[f"layer{i}.scale"] = repr(rec["scale"])
        layers[str(i)] = {"scale": rec["scale"], "sliding_window": rec["sliding_window"]}
    if store:
        meta["scale"] = repr(store[min(store)]["scale"])
    meta["layers"] = json.dumps(layers)
    meta["dtype"] = dtype
    return tensors, meta


def parse_layers(spec, n_layers):
    """`all`, or comma-separated indices (negative counts from the end)."""
    if spec == "all":
        return set(range(n_layers))
    out = set()
    for s in spec.split(","):
        i = int(s)
        i = i + n_layers if i < 0 else i
        if not 0 <= i < n_layers:
            raise SystemExit(f"layer {s} out of range (model has {n_layers} layers)")
        out.add(i)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="hub name or local directory (default: the GGUF file's directory)")
    ap.add_argument("--gguf-file", help="GGUF file (dequantized by transformers on load)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the input text")
    src.add_argument("--text-file", type=Path, help="file holding the input text (UTF-8)")
    src.add_argument("--token-ids-from", type=Path, help="take `token_ids` from an earlier capture (.safetensors)")
    ap.add_argument("--max-tokens", type=int, help="keep only the first N tokens")
    ap.add_argument("--no-special-tokens", action="store_true", help="do not add BOS/special tokens")
    ap.add_argument("--layers", default="all", help="'all' or e.g. 0,15,-1 (default: all)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="stored dtype (default bf16)")
    ap.add_argument("--compute-dtype", choices=sorted(DTYPES), default="f32", help="model dtype (default f32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True, help="output .safetensors file")
    args = ap.parse_args()

    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not args.model and not args.gguf_file:
        ap.error("give --model, --gguf-file, or both")
    model_id, gguf = args.model, args.gguf_file
    if gguf and not model_id:
        model_id, gguf = str(Path(gguf).resolve().parent), Path(gguf).name
    load_kw = {"gguf_file": gguf} if gguf else {}
    register_capture({})  # so that loading accepts the implementation name
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(
        model_id, attn_implementation=CAPTURE_NAME, **{dtype_kw: DTYPES[args.compute_dtype]}, **load_kw
    )
    model.to(args.device).eval()

    if args.token_ids_from:
        from safetensors import safe_open

        with safe_open(str(args.token_ids_from), "pt") as f:
            ids = f.get_tensor("token_ids").reshape(1, -1).long()
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **load_kw)
        text = args.text if args.text is not None else args.text_file.read_text(encoding="utf-8")
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not args.no_special_tokens).input_ids
    if args.max_tokens:
        ids = ids[:, : args.max_tokens]
    layers = parse_layers(args.layers, model.config.num_hidden_layers)
    store = capture(model, ids.to(args.device), layers)
    tensors, meta = to_tensors(store, ids.cpu(), args.dtype)
    meta.update(
        model=str(args.model or ""),
        gguf_file=Path(args.gguf_file).name if args.gguf_file else "",
        text=args.text_file.name if args.text_file else "(--text)" if args.text else f"token_ids of {args.token_ids_from.name}",
        tokens=str(ids.shape[1]),
        transformers=transformers.__version__,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(args.out)
    print(f"wrote {args.out}: {ids.shape[1]} tokens, layers {sorted(store)}, {args.dtype}")


if __name__ == "__main__":
    main()
