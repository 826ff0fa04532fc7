//! The CLI as an embedder of pisa-wgpu's app-facing API: tensors in buffers the CLI owns
//! (written with `queue.write_buffer`, read back by mapping a staging buffer), passed to the
//! library as [`TensorView`]s. [`prefill`] runs a [`PrefillPlan`] on such buffers when the
//! call fits one storage binding and falls back to the host convenience
//! [`prefill_host`] (which splits the call by KV heads) when the plan refuses it with
//! [`GpuError::Limit`].

use pisa_core::{AttentionShape, TensorLayout};
use pisa_wgpu::ops::prefill::{
    prefill_host, PrefillOptions, PrefillOutput, PrefillOutputs, PrefillPlan,
};
use pisa_wgpu::{wgpu, Context, DType, GpuError, Profiler, Storage, TensorView};

/// Usage of the CLI's tensor buffers: bound as storage, written from the host, copied out.
const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::COPY_SRC);

/// The view dtype of a storage precision.
pub fn dtype(storage: Storage) -> DType {
    DType::from(storage)
}

/// `n` elements of `dtype`, in bytes rounded up to whole 4-byte words (buffer copies and
/// writes move whole words).
pub fn words(n: usize, dtype: DType) -> u64 {
    (n as u64 * dtype.bytes()).div_ceil(4) * 4
}

/// A tensor buffer of `bytes` (at least one word) owned by the caller.
pub fn buffer(ctx: &Context, label: &str, bytes: u64) -> wgpu::Buffer {
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.max(4).div_ceil(4) * 4,
        usage: USAGE,
        mapped_at_creation: false,
    })
}

/// `data` as bytes of `storage` (f16, bf16: rounded to nearest, as the library's own uploads),
/// padded with zeros to whole 4-byte words.
pub fn bytes_of(data: &[f32], storage: Storage) -> Vec<u8> {
    let mut out: Vec<u8> = match storage {
        Storage::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Storage::F16 => data
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        Storage::Bf16 => data
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
    };
    out.resize(out.len().div_ceil(4) * 4, 0);
    out
}

/// The first `n` elements of `bytes` (of `storage`) as f32.
pub fn f32_of(bytes: &[u8], storage: Storage, n: usize) -> Vec<f32> {
    match storage {
        Storage::F32 => bytes
            .chunks_exact(4)
            .take(n)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Storage::F16 => bytes
            .chunks_exact(2)
            .take(n)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Storage::Bf16 => bytes
            .chunks_exact(2)
            .take(n)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// The first `n` elements of `bytes` as i32.
pub fn i32_of(bytes: &[u8], n: usize) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .take(n)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A mappable buffer that readbacks copy into.
pub fn staging(ctx: &Context, bytes: u64) -> wgpu::Buffer {
    ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("cli readback"),
        size: bytes.max(4),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// Maps `staging` (after the submission that filled it) and returns its first `bytes` bytes;
/// unmaps it again, so it can be reused.
pub fn map_read(ctx: &Context, staging: &wgpu::Buffer, bytes: u64) -> pisa_wgpu::Result<Vec<u8>> {
    let slice = staging.slice(..bytes);
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    ctx.wait()?;
    match rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(GpuError::Poll(format!("mapping the readback: {e}"))),
        Err(_) => return Err(GpuError::Poll("the readback was never mapped".into())),
    }
    let out = slice
        .get_mapped_range()
        .map_err(|e| GpuError::Poll(format!("reading the readback: {e}")))?
        .to_vec();
    staging.unmap();
    Ok(out)
}

/// Records copies of `parts` (`(buffer, byte offset, bytes)`) one after another into
/// `staging`; returns the bytes copied.
pub fn copy_out(
    enc: &mut wgpu::CommandEncoder,
    parts: &[(&wgpu::Buffer, u64, u64)],
    staging: &wgpu::Buffer,
) -> u64 {
    let mut at = 0;
    for &(buf, off, bytes) in parts {
        enc.copy_buffer_to_buffer(buf, off, staging, at, bytes);
        at += bytes;
    }
    at
}

/// Prefill of host tensors (`q` `[B, Hq, Nq, D]`, `k`, `v` `[B, Hkv, Nk, D]` in `opts.layout`,
/// `Nq <= Nk`), as [`prefill_host`] returns it: through a [`PrefillPlan`] on buffers the CLI
/// owns when the call fits one storage binding, else (the plan refuses it with
/// [`GpuError::Limit`]) through [`prefill_host`], which splits it by KV heads. Same kernels
/// either way, so the same outputs.
///
/// With `warm_up`, the plan runs once untimed before the timed run, so that the stage times
/// leave out what a driver does on a pipeline's first dispatch (lavapipe compiles its kernels
/// there, not when the pipeline is built): one more prefill on the same buffers, nothing
/// allocated or read back for it. The [`prefill_host`] fallback is not warmed up (it runs
/// calls too large for one binding, where a second run would cost as much as the first).
pub fn prefill(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    opts: &PrefillOptions,
    warm_up: bool,
) -> pisa_wgpu::Result<PrefillOutput> {
    // The host path's own checks and errors for what a plan would refuse differently: input
    // lengths, f16 without SHADER_F16.
    let lens_ok = q.len() == shape.q_elems() && k.len() == shape.kv_elems() && k.len() == v.len();
    let f16_ok = opts.storage != Storage::F16 || ctx.has_f16();
    if !lens_ok || !f16_ok {
        return prefill_host(ctx, q, k, v, shape, opts);
    }
    let plan = match PrefillPlan::new(ctx, shape, opts) {
        Ok(p) => p,
        Err(GpuError::Limit { .. }) => return prefill_host(ctx, q, k, v, shape, opts),
        Err(e) => return Err(e),
    };
    let s = *plan.shape();
    let (b, hq, hkv, n, d, kk) = (
        s.batch,
        s.q_heads,
        s.kv_heads,
        s.q_len,
        s.head_dim,
        opts.cfg.top_k,
    );
    let (st, layout) = (opts.storage, opts.layout);
    let dt = dtype(st);
    // O in the kernels' output type (f32 for bf16 storage: no rounding of the result).
    let odt = dtype(st.output());
    let sel_elems = b * hkv * n * kk;
    let bytes = [
        words(s.q_elems(), odt),
        words(s.lse_elems(), DType::F32),
        words(sel_elems, DType::I32),
    ];
    let mut prof = Profiler::new(ctx, Profiler::MAX_PASSES);
    let total = bytes[0] + bytes[1] + if opts.return_selection { bytes[2] } else { 0 };
    let read = staging(ctx, total);
    ctx.scoped("prefill", || {
        let input = |label, data: &[f32]| {
            let buf = buffer(ctx, label, words(data.len(), dt));
            ctx.queue().write_buffer(&buf, 0, &bytes_of(data, st));
            buf
        };
        let (qb, kb, vb) = (input("cli q", q), input("cli k", k), input("cli v", v));
        let (ob, lb) = (
            buffer(ctx, "cli o", bytes[0]),
            buffer(ctx, "cli lse", bytes[1]),
        );
        let sb = buffer(ctx, "cli selection", bytes[2]);
        let view = |buf, dtype, shape| TensorView::contiguous(buf, 0, dtype, shape, layout);
        let (qv, kv, vv) = (
            view(&qb, dt, [b, hq, n, d])?,
            view(&kb, dt, [b, hkv, s.k_len, d])?,
            view(&vb, dt, [b, hkv, s.k_len, d])?,
        );
        let ov = view(&ob, odt, [b, hq, n, d])?;
        let bhnd =
            |buf, dtype, shape| TensorView::contiguous(buf, 0, dtype, shape, TensorLayout::Bhnd);
        let lv = bhnd(&lb, DType::F32, [b, hq, n, 1])?;
        let sv = bhnd(&sb, DType::I32, [b, hkv, n, kk])?;
        let outs = PrefillOutputs {
            out: &ov,
            lse: &lv,
            selection: opts.return_selection.then_some(&sv),
        };
        if warm_up {
            let t0 = std::time::Instant::now();
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            plan.run(&mut enc, &qv, &kv, &vv, &outs, None)?;
            ctx.queue().submit([enc.finish()]);
            ctx.wait()?;
            log::debug!(
                "prefill warm-up: one untimed run before the timed one, {:.1} ms",
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        plan.run(&mut enc, &qv, &kv, &vv, &outs, Some(&mut prof))?;
        let mut parts = vec![(&ob, 0, bytes[0]), (&lb, 0, bytes[1])];
        if opts.return_selection {
            parts.push((&sb, 0, bytes[2]));
        }
        copy_out(&mut enc, &parts, &read);
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })?;
    let times = prof.finish(ctx)?;
    let got = map_read(ctx, &read, total)?;
    let (o, rest) = got.split_at(bytes[0] as usize);
    let (lse, sel) = rest.split_at(bytes[1] as usize);
    Ok(PrefillOutput {
        out: f32_of(o, st.output(), s.q_elems()),
        lse: f32_of(lse, Storage::F32, s.lse_elems()),
        selection: opts.return_selection.then(|| i32_of(sel, sel_elems)),
        times,
        chunks: 1,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pisa_core::SelectionConfig;

    /// Deterministic values in [-1, 1) (xorshift of `seed`), for the CLI's GPU tests.
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Inputs of `shape` in `layout` as the CLI's GPU tests load them: Q, K and V from
    /// [`values`] with seeds `seed`, `seed + 1`, `seed + 2`, no file scale, and the dims a 4-D
    /// file in `layout` would give.
    pub(crate) fn loaded(
        shape: AttentionShape,
        layout: TensorLayout,
        seed: u64,
    ) -> crate::input::Loaded {
        let s = &shape;
        let dims = |h: usize, n: usize| match layout {
            TensorLayout::Bhnd => vec![s.batch, h, n, s.head_dim],
            TensorLayout::Bnhd => vec![s.batch, n, h, s.head_dim],
        };
        crate::input::Loaded {
            q: values(s.q_elems(), seed),
            k: values(s.kv_elems(), seed + 1),
            v: values(s.kv_elems(), seed + 2),
            shape,
            layout,
            file_scale: Ok(None),
            source: "test".into(),
            tensors: ["q".into(), "k".into(), "v".into()],
            q_dims: dims(s.q_heads, s.q_len),
            kv_dims: dims(s.kv_heads, s.k_len),
        }
    }

    /// The CLI's prefill (a plan on its own buffers, or `prefill_host` past one binding) is
    /// bitwise `prefill_host`'s, in both layouts, with and without the selection and the
    /// warm-up.
    #[test]
    fn prefill_on_cli_buffers_equals_prefill_host() {
        // A missing adapter fails the test (as the library's tests do), never skips it.
        let ctx = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)");
        let shape = AttentionShape::prefill(2, 4, 2, 200, 16).unwrap();
        let (q, k, v) = (
            values(shape.q_elems(), 1),
            values(shape.kv_elems(), 2),
            values(shape.kv_elems(), 3),
        );
        for (layout, sel) in [(TensorLayout::Bhnd, true), (TensorLayout::Bnhd, false)] {
            let opts = PrefillOptions {
                cfg: SelectionConfig::new(32, 3).unwrap(),
                layout,
                return_selection: sel,
                ..Default::default()
            };
            let want = prefill_host(&ctx, &q, &k, &v, &shape, &opts).unwrap();
            // (warmed up in one of the two: the untimed run changes nothing of the timed one's)
            let got = prefill(&ctx, &q, &k, &v, &shape, &opts, sel).unwrap();
            assert_eq!(got.chunks, 1);
            assert_eq!(got.out, want.out, "{layout:?}");
            assert_eq!(got.lse, want.lse, "{layout:?}");
            assert_eq!(got.selection, want.selection, "{layout:?}");
            let stages: Vec<&str> = got.times.stages.iter().map(|s| s.0.as_str()).collect();
            let attention = ["attention", "attention_leaf"];
            assert!(stages.iter().any(|s| attention.contains(s)), "{stages:?}");
        }
        // Past one binding the plan refuses the call and the host convenience splits it.
        ctx.set_max_binding_bytes(40_000);
        let opts = PrefillOptions {
            cfg: SelectionConfig::new(32, 3).unwrap(),
            return_selection: true,
            ..Default::default()
        };
        let got = prefill(&ctx, &q, &k, &v, &shape, &opts, false).unwrap();
        assert!(got.chunks > 1, "{} chunks", got.chunks);
        let want = prefill_host(&ctx, &q, &k, &v, &shape, &opts).unwrap();
        assert_eq!((got.out, got.lse), (want.out, want.lse));
        assert_eq!(got.selection, want.selection);
    }
}
