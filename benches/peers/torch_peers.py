#!/usr/bin/env python3
"""PyTorch peer benchmarks for PISA (see benches/peers/README.md and docs/PISA.md).

Measures what a PyTorch user gets on this GPU for the operations PISA competes with:
dense causal SDPA prefill, SDPA decode against a long KV cache, the conventional O(N^2/C)
BSA block selection (PISA.md section 3), and two hardware ceilings (copy bandwidth, bf16
matmul). Every time is the median over repetitions after warm-up, timed with CUDA events,
rotating between independent input sets so the 60 MB L2 cannot serve repeated calls.

`--check` runs everything at tiny sizes on the CPU in float32 and asserts correctness.
"""
import argparse, contextlib, datetime, json, math, platform, statistics, subprocess, sys, time

import torch
import torch.nn.functional as F


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def timeit(fns, dev, reps, budget_s, inner=1):
    """Median ms per call of fns (one closure per input set, used in rotation).
    Each repetition times `inner` back-to-back calls between two events (inner > 1 amortises
    event overhead for microsecond calls). On CUDA a spin kernel is queued before the start
    event so the CPU enqueues all calls ahead of the GPU: the events then bracket GPU work only,
    not Python/launch overhead (which would otherwise dominate decode). Repetitions are capped so the whole measurement
    takes about budget_s, but never fewer than 3."""
    fns[0](); sync(dev)                                  # warm-up: lazy init, allocator, autotune
    t0 = time.perf_counter()
    for f in fns:
        f()
    sync(dev)
    est = (time.perf_counter() - t0) / len(fns)          # one call, seconds
    n = max(3, min(reps, int(budget_s / max(est * inner, 1e-9))))
    times, k = [], 0
    for _ in range(n):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(3_000_000)                 # ~1.5 ms of GPU spin: lets the CPU get ahead
            a.record()
        else:
            t0 = time.perf_counter()
        for _ in range(inner):
            fns[k % len(fns)](); k += 1
        if dev == "cuda":
            b.record(); b.synchronize(); times.append(a.elapsed_time(b) / inner)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times), n


def kernel_names(fn, dev, top=3):
    """Names of the kernels (CPU ops on cpu) that took the most time in one call of fn:
    tells which SDPA backend actually ran (flash / cudnn / efficient / math)."""
    from torch.profiler import profile, ProfilerActivity
    try:
        act = ProfilerActivity.CUDA if dev == "cuda" else ProfilerActivity.CPU
        with profile(activities=[act]) as prof:
            fn(); sync(dev)
        attr = "self_device_time_total" if dev == "cuda" else "self_cpu_time_total"
        evs = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
        return [e.key[:120] for e in evs if not e.key.startswith(("cuda", "cuLaunch", "Memset", "Activity"))][:top]
    except Exception as ex:  # profiler (CUPTI) missing must not kill the benchmark
        return [f"profiler failed: {type(ex).__name__}: {ex}"[:200]]


def backend_ctx(name):
    """'default' lets PyTorch pick; otherwise force one SDPA backend."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]])


def sdpa(q, k, v, causal, backend):
    with backend_ctx(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def bsa_select(q, k, C, top_k, chunk, qsum=False):
    """Conventional BSA selection (PISA.md section 3), prefill (query i sits at position i).
    q [1,Hq,N,D], k [1,Hkv,N,D] -> int64 [Hkv, N, top_k]: per (KV head, query) the selected
    leaf blocks, ascending, padded with -1. Every complete-past block is scored with
    s * q.mu_block summed over the GQA group's query heads; the query's own block is forced.
    qsum=True sums the group's queries before the matmul (same scores by linearity, g x less
    matmul work): the faster variant a careful user would write."""
    _, Hq, N, D = q.shape
    Hkv = k.shape[1]; g = Hq // Hkv; nb = -(-N // C); scale = D ** -0.5
    # Mean-pool keys into blocks; the last block may be partial (divide by its real count).
    kp = k[0] if N == nb * C else F.pad(k[0], (0, 0, 0, nb * C - N))
    cnt = (N - torch.arange(nb, device=k.device) * C).clamp(max=C).to(k.dtype)
    mu = kp.view(Hkv, nb, C, D).sum(2) / cnt[:, None]                  # [Hkv, nb, D]
    qg = q[0].view(Hkv, g, N, D)
    out = torch.empty(Hkv, N, top_k, dtype=torch.long, device=q.device)
    for i0 in range(0, N, chunk):
        i1 = min(N, i0 + chunk)
        nbc = (i1 - 1) // C + 1            # blocks any query of this chunk can see: skip the rest
        muT = mu[:, :nbc].transpose(1, 2)  # [Hkv, D, nbc]
        if qsum:
            s = (qg[:, :, i0:i1].sum(1) @ muT) * scale                 # [Hkv, nq, nbc]
        else:
            s = ((qg[:, :, i0:i1] @ muT[:, None]) * scale).sum(1)      # [Hkv,g,nq,nbc] -> sum
        bq = torch.arange(i0, i1, device=q.device) // C                # own block per query
        s.masked_fill_(torch.arange(nbc, device=q.device)[None, :] > bq[:, None], -math.inf)
        s.scatter_(2, bq.view(1, -1, 1).expand(Hkv, -1, 1), math.inf)  # force own block
        kk = min(top_k, nbc)
        val, idx = torch.topk(s, kk, dim=2)
        idx = torch.where(val == -math.inf, nb, idx).sort(dim=2).values  # unseen -> sentinel
        out[:, i0:i1, :kk] = torch.where(idx == nb, -1, idx)
        out[:, i0:i1, kk:] = -1
    return out


def check_bsa(sel, q, k, C, top_k):
    """Asserts on a bsa_select result: causal, own block selected, right count, top-scored."""
    Hkv, N, K = sel.shape
    bq = torch.arange(N) // C
    valid = sel >= 0
    assert (sel <= bq[None, :, None]).all(), "selected a future block"
    assert (sel == bq[None, :, None]).any(2).all(), "own block not selected"
    assert (valid.sum(2) == (bq + 1).clamp(max=K)[None]).all(), "wrong number of blocks"
    # Brute force for sampled queries: own block + best (K-1) past blocks by group-summed score.
    g = q.shape[1] // Hkv
    mu = torch.stack([k[0, :, b * C:(b + 1) * C].mean(1) for b in range(-(-N // C))], 1)
    for i in range(0, N, max(1, N // 37)):
        for h in range(Hkv):
            b = i // C
            sc = sum(q[0, h * g + j, i] @ mu[h, :b].T for j in range(g)) * q.shape[-1] ** -0.5
            want = sorted([b] + torch.topk(sc, min(K - 1, b)).indices.tolist())
            got = sel[h, i][sel[h, i] >= 0].tolist()
            assert got == want, f"query {i} head {h}: got {got} want {want}"


def naive_attn(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:  # query i sits at position Nk - Nq + i
        Nq, Nk = s.shape[-2:]
        s = s.masked_fill(torch.arange(Nk)[None] > torch.arange(Nq)[:, None] + Nk - Nq, -math.inf)
    return s.softmax(-1) @ v


def gpu_meta():
    m = {"torch": torch.__version__, "python": platform.python_version(), "device": "cpu"}
    try:
        import triton
        m["triton"] = triton.__version__
    except Exception:
        m["triton"] = None
    if torch.cuda.is_available():
        m.update(device="cuda", gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version(),
                 gpu_mem_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        try:
            m["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                          "--format=csv,noheader"], capture_output=True,
                                         text=True, timeout=20).stdout.strip().splitlines()[0]
        except Exception:
            m["driver"] = None
    return m


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p.add_argument("--sizes", type=ints, default=ints("4096,16384,65536,131072,262144"), help="prefill N")
    p.add_argument("--decode-sizes", type=ints, default=ints("65536,262144,1048576"), help="KV cache length")
    p.add_argument("--hq", type=int, default=32); p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128); p.add_argument("--block", type=int, default=64)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--backends", default="default,flash",
                   help="SDPA backends: default,flash,cudnn,efficient,math (torch 2.11 on H200: default = cuDNN)")
    p.add_argument("--reps", type=int, default=20, help="max repetitions per measurement")
    p.add_argument("--budget-s", type=float, default=4.0, help="target seconds per measurement (min 3 reps)")
    p.add_argument("--backward-max", type=int, default=65536, help="largest N of sdpa_backward")
    p.add_argument("--skip-dense-above", type=int, default=None, help="skip sdpa_prefill for N above this")
    p.add_argument("--chunk", type=int, default=8192, help="bsa_select queries per chunk")
    p.add_argument("--sets", type=int, default=2, help="input sets rotated between repetitions")
    p.add_argument("--copy-gb", type=float, default=4.0); p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--out", default=None, help="JSON output (default peers.json; none with --check)")
    p.add_argument("--check", action="store_true", help="tiny CPU float32 correctness run")
    a = p.parse_args()
    if a.check:  # tiny shapes, partial last blocks, several chunks, K > blocks for early queries
        a.sizes, a.decode_sizes, a.hq, a.hkv, a.d, a.block, a.top_k = [256, 1000], [512, 777], 4, 2, 16, 16, 4
        a.dtype, a.backends, a.reps, a.budget_s, a.chunk, a.copy_gb, a.matmul_n = "fp32", "default,math", 3, 0.5, 100, 0.01, 256
        dev = "cpu"
    else:
        dev = "cuda" if torch.cuda.is_available() else sys.exit("no CUDA device (use --check on CPU)")
        a.out = a.out or "peers.json"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    esz = torch.tensor([], dtype=dt).element_size()
    backends = a.backends.split(",")
    meta = gpu_meta(); meta.update(args=vars(a), utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
    res, ceil = [], {}
    torch.manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt)

    def record(bench, variant, n, fn, inner=1, **metric):
        """Time fn list, add a result; metric maps name -> (amount, unit divisor) -> rate."""
        r = {"bench": bench, "variant": variant, "n": n}
        try:
            ms, reps = timeit(fn, dev, a.reps, a.budget_s, inner)
            r.update(ms=round(ms, 5), reps=reps)
            for key, amount in metric.items():  # amount / seconds, in units of 1e12 or 1e9
                r[key] = round(amount / (ms * 1e-3) / (1e12 if key == "tflops" else 1e9), 3)
        except Exception as ex:  # e.g. a backend that does not support GQA or this size
            r["error"] = f"{type(ex).__name__}: {ex}"[:300]
            if dev == "cuda":
                torch.cuda.empty_cache()
        res.append(r)
        print(json.dumps(r), flush=True)
        return r

    # 1. sdpa_prefill: dense causal attention; FLOPs = 2 matmuls * 2 flop/MAC * Hq*N*N*D / 2 (causal).
    for n in a.sizes:
        if a.skip_dense_above is not None and n > a.skip_dense_above:
            res.append({"bench": "sdpa_prefill", "variant": "skipped", "n": n}); continue
        sets = [(rnd(1, a.hq, n, a.d), rnd(1, a.hkv, n, a.d), rnd(1, a.hkv, n, a.d)) for _ in range(a.sets)]
        for be in backends:
            fns = [lambda s=s, be=be: sdpa(*s, True, be) for s in sets]
            record("sdpa_prefill", be, n, fns, tflops=4 * a.hq * n * n * a.d / 2)
            if a.check and be == backends[0]:
                assert torch.allclose(fns[0](), naive_attn(*sets[0], True), atol=1e-4), "prefill mismatch"
        # 3. bsa_select on the same q/k (pooling + scoring + mask + topk + sort, all chunks).
        for qs in (False, True):
            fns = [lambda s=s, qs=qs: bsa_select(s[0], s[1], a.block, a.top_k, a.chunk, qs) for s in sets]
            record("bsa_select", "group_qsum" if qs else "per_head", n, fns)
            if a.check:
                check_bsa(fns[0](), sets[0][0], sets[0][1], a.block, a.top_k)
        del sets
        if dev == "cuda":
            torch.cuda.empty_cache()

    # 1b. sdpa_backward: dQ, dK, dV of dense causal attention (default backend), forward graph
    # kept and only autograd.grad timed; FLOPs = 5 matmuls * 2 * Hq*N*N*D / 2 (causal).
    for n in [x for x in a.sizes if x <= a.backward_max]:
        sets = []
        for _ in range(a.sets):
            q, k, v = (rnd(1, h, n, a.d).requires_grad_(True) for h in (a.hq, a.hkv, a.hkv))
            o = sdpa(q, k, v, True, backends[0])
            sets.append((o, (q, k, v), torch.randn_like(o)))
        fns = [lambda s=s: torch.autograd.grad(s[0], s[1], s[2], retain_graph=True) for s in sets]
        record("sdpa_backward", backends[0], n, fns, tflops=10 * a.hq * n * n * a.d / 2)
        del sets, fns
        if dev == "cuda":
            torch.cuda.empty_cache()

    # 2. sdpa_decode: 1 query token vs N cached keys; GB/s counts the K and V bytes read (2*Hkv*N*D).
    for n in a.decode_sizes:
        sets = [(rnd(1, a.hq, 1, a.d), rnd(1, a.hkv, n, a.d), rnd(1, a.hkv, n, a.d)) for _ in range(a.sets)]
        for be in backends:
            fns = [lambda s=s, be=be: sdpa(*s, False, be) for s in sets]
            record("sdpa_decode", be, n, fns, inner=10, gbps=2 * a.hkv * n * a.d * esz)
            if a.check and be == backends[0]:
                assert torch.allclose(fns[0](), naive_attn(*sets[0], False), atol=1e-4), "decode mismatch"
        del sets
        if dev == "cuda":
            torch.cuda.empty_cache()

    # 4. Ceilings. Copy: GB/s counts bytes read + bytes written. Matmul: 2*n^3 FLOP, two input sets.
    nel = int(a.copy_gb * 1e9) // esz
    src, dst = torch.empty(nel, device=dev, dtype=dt).normal_(), torch.empty(nel, device=dev, dtype=dt)
    ceil["copy"] = record("copy", "d2d", nel * esz, [lambda: dst.copy_(src)], gbps=2 * nel * esz)
    del src, dst
    m = a.matmul_n
    mats = [(rnd(m, m), rnd(m, m)) for _ in range(a.sets)]
    ceil["matmul"] = record("matmul", a.dtype, m, [lambda s=s: s[0] @ s[1] for s in mats], tflops=2 * m ** 3)
    del mats

    # Which kernels each SDPA backend ran (first size), profiled last so that the profiler
    # cannot perturb any timing. Attached to that size's record as "kernels".
    probes = ([("sdpa_prefill", a.sizes[0], a.sizes[0], True)] if a.sizes else []) + \
             ([("sdpa_decode", a.decode_sizes[0], 1, False)] if a.decode_sizes else [])
    for bench, n, nq, causal in probes:
        s = (rnd(1, a.hq, nq, a.d), rnd(1, a.hkv, n, a.d), rnd(1, a.hkv, n, a.d))
        for r in res:
            if r["bench"] == bench and r["n"] == n and "ms" in r:
                r["kernels"] = kernel_names(lambda: sdpa(*s, causal, r["variant"]), dev)

    # Compact table.
    print(f"\n{meta.get('gpu', 'cpu')}  torch {meta['torch']}  driver {meta.get('driver')}  "
          f"Hq={a.hq} Hkv={a.hkv} D={a.d} C={a.block} K={a.top_k} {a.dtype}")
    print(f"{'bench':<14}{'variant':<12}{'N':>12}{'ms':>14}{'rate':>20}{'reps':>6}")
    for r in res:
        rate = (f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r else f"{r['gbps']:.1f} GB/s" if "gbps" in r else "")
        ms = f"{r['ms']:.4f}" if "ms" in r else r.get("error", "skipped")[:12]
        print(f"{r['bench']:<14}{r['variant']:<12}{r['n']:>12}{ms:>14}{rate:>20}{r.get('reps', ''):>6}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "ceilings": ceil, "results": res}, f, indent=1)
        print(f"wrote {a.out}")
    errs = [r for r in res if "error" in r]
    if a.check:
        assert not [r for r in errs if r["variant"] != "math"], errs
        print("CHECK PASSED")


if __name__ == "__main__":
    main()
