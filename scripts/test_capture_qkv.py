"""Tests of scripts/capture_qkv.py on tiny randomly initialised models (no download).

SDPA run on the captured Q/K/V (GQA expanded, causal or sliding-window mask, captured scale)
must reproduce the attention output each layer feeds into `o_proj`.

    python3 -m pytest scripts/test_capture_qkv.py
"""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture_qkv  # noqa: E402

N_TOKENS = 40


def tiny_model(kind="llama", sliding_window=None):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.MistralConfig(sliding_window=sliding_window, **kw)
        cls = transformers.MistralForCausalLM
    config._attn_implementation = capture_qkv.register_capture({})
    return cls(config).float().eval()


def o_proj_inputs(model):
    """Hooks recording the input of every layer's o_proj: layer -> [N, Hq * D]."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0][0]))
    return seen


def reference(rec, window=None):
    q, k, v = rec["q"], rec["k"], rec["v"]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=rec["scale"])
    return o.transpose(0, 1).reshape(n, -1)  # [N, Hq * D], as o_proj receives it


@pytest.mark.parametrize("kind,window", [("llama", None), ("mistral", 8)])
def test_capture_reproduces_attention(kind, window):
    model = tiny_model(kind, window)
    seen = o_proj_inputs(model)
    ids = torch.randint(0, 128, (1, N_TOKENS), generator=torch.Generator().manual_seed(1))
    store = capture_qkv.capture(model, ids, layers={0, 1})
    assert sorted(store) == [0, 1]
    for i, rec in store.items():
        assert rec["q"].shape == (4, N_TOKENS, 16)
        assert rec["k"].shape == rec["v"].shape == (2, N_TOKENS, 16)
        assert rec["scale"] == pytest.approx(16**-0.5)
        assert rec["sliding_window"] == window
        got = reference(rec, window)
        err = (got - seen[i]).abs().max().item()
        assert err < 1e-5, f"layer {i}: max abs error {err}"
        if window is not None:  # the window matters: a plain causal mask must not match
            assert (reference(rec) - seen[i]).abs().max().item() > 1e-3


def test_layer_subset_and_file_layout(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    model = tiny_model()
    ids = torch.arange(N_TOKENS)[None, :] % 128
    store = capture_qkv.capture(model, ids, layers={1})
    assert sorted(store) == [1]
    for dtype, tdtype in capture_qkv.DTYPES.items():
        tensors, meta = capture_qkv.to_tensors(store, ids, dtype)
        path = tmp_path / f"qkv-{dtype}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == ["layer1.k", "layer1.q", "layer1.v", "token_ids"]
            assert f.get_tensor("layer1.q").dtype == tdtype and f.get_tensor("layer1.q").shape == (4, N_TOKENS, 16)
            assert f.get_tensor("token_ids").dtype == torch.int32
            m = f.metadata()
        assert float(m["scale"]) == float(m["layer1.scale"]) == pytest.approx(0.25)
        assert '"1": {"scale": 0.25, "sliding_window": null}' in m["layers"]
    assert capture_qkv.parse_layers("0,-1", 30) == {0, 29}
    assert capture_qkv.parse_layers("all", 3) == {0, 1, 2}
    with pytest.raises(SystemExit):
        capture_qkv.parse_layers("30", 30)
