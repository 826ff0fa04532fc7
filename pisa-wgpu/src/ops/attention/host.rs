//! Host-slice attention (PISA.md section 4): upload, run, read back, with binding-size
//! splitting. A call whose tensors exceed [`Context::max_binding_bytes`] runs in chunks of
//! (batch, KV head) pairs (whole batches, or a range of KV heads of one sequence); each chunk's
//! Q, K, V, selection, O and LSE slices are separate buffers and the results are stitched.
//! Nothing is ever truncated: a single (batch, KV head) slice above the limit is an error.

use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};

use super::{record_attention, AttentionKind};
use crate::error::{GpuError, Result};
use crate::runtime::context::Context;
use crate::runtime::pipeline::Storage;

/// One chunk: sequences `b0..b1` and KV heads `h0..h1` (all heads, or one sequence).
#[derive(Debug, Clone, Copy)]
struct Chunk {
    b0: usize,
    b1: usize,
    h0: usize,
    h1: usize,
}

fn pad4(bytes: u64) -> u64 {
    bytes.div_ceil(4).max(1) * 4
}

/// The chunks of (batch, KV head) pairs whose every buffer fits the binding limit.
fn plan(ctx: &Context, s: &AttentionShape, storage: Storage, top_k: usize) -> Result<Vec<Chunk>> {
    let (g, d, e) = (s.gqa_group() as u64, s.head_dim as u64, storage.bytes());
    let per_pair = [
        g * s.q_len as u64 * d * e,
        g * s.q_len as u64 * d * storage.output().bytes(), // O (f32 for bf16)
        s.k_len as u64 * d * e,
        s.q_len as u64 * top_k as u64 * 4,
        g * s.q_len as u64 * 4,
    ];
    let limit = ctx.max_binding_bytes();
    let fits = |pairs: u64| per_pair.iter().all(|&b| pad4(b * pairs) <= limit);
    if !fits(1) {
        return Err(GpuError::Limit {
            what: "one (batch, KV head) slice of attention".into(),
            needed: per_pair.iter().copied().max().unwrap_or(0),
            limit,
            unit: "bytes",
            hint: "use a shorter sequence or a smaller head dim",
        });
    }
    let hkv = s.kv_heads;
    let mut ppc = 1u64;
    while ppc < (s.batch * hkv) as u64 && fits(ppc + 1) {
        ppc = if fits(ppc * 2) { ppc * 2 } else { ppc + 1 };
    }
    let ppc = (ppc as usize).min(s.batch * hkv);
    let mut out = Vec::new();
    if ppc >= hkv {
        let nb = ppc / hkv;
        for b0 in (0..s.batch).step_by(nb) {
            out.push(Chunk {
                b0,
                b1: (b0 + nb).min(s.batch),
                h0: 0,
                h1: hkv,
            });
        }
    } else {
        for b0 in 0..s.batch {
            for h0 in (0..hkv).step_by(ppc) {
                out.push(Chunk {
                    b0,
                    b1: b0 + 1,
                    h0,
                    h1: (h0 + ppc).min(hkv),
                });
            }
        }
    }
    Ok(out)
}

/// `(index in the full tensor, index in the part)` of every D-row of heads `h0..h1` of
/// sequences `b0..b1` of a `[B, heads, n, D]` tensor in `layout`; the part is the
/// `[b1-b0, h1-h0, n, D]` tensor in the same layout.
fn part_rows(
    layout: TensorLayout,
    heads: usize,
    n: usize,
    d: usize,
    (b0, b1, h0, h1): (usize, usize, usize, usize),
) -> impl Iterator<Item = (usize, usize)> {
    (b0..b1).flat_map(move |b| {
        (h0..h1).flat_map(move |h| {
            (0..n).map(move |t| {
                (
                    layout.index(heads, n, d, b, h, t, 0),
                    layout.index(h1 - h0, n, d, b - b0, h - h0, t, 0),
                )
            })
        })
    })
}

type Range4 = (usize, usize, usize, usize);

fn gather(
    full: &[f32],
    layout: TensorLayout,
    heads: usize,
    n: usize,
    d: usize,
    r: Range4,
) -> Vec<f32> {
    let mut part = vec![0.0; (r.1 - r.0) * (r.3 - r.2) * n * d];
    for (f, p) in part_rows(layout, heads, n, d, r) {
        part[p..p + d].copy_from_slice(&full[f..f + d]);
    }
    part
}

fn scatter(
    full: &mut [f32],
    part: &[f32],
    layout: TensorLayout,
    heads: usize,
    n: usize,
    d: usize,
    r: Range4,
) {
    for (f, p) in part_rows(layout, heads, n, d, r) {
        full[f..f + d].copy_from_slice(&part[p..p + d]);
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttentionShape,
    layout: TensorLayout,
    storage: Storage,
    sparse: Option<(&SelectionConfig, &[i32])>,
    dense: (bool, f32),
) -> Result<(Vec<f32>, Vec<f32>)> {
    // The shape's fields are public: checked before it sizes the chunks.
    s.validate()?;
    if let Some((cfg, _)) = sparse {
        cfg.validate()?;
    }
    let top_k = sparse.map_or(1, |(c, _)| c.top_k);
    let chunks = plan(ctx, s, storage, top_k)?;
    let whole = chunks.len() == 1;
    let g = s.gqa_group();
    let mut o_all = if whole {
        Vec::new()
    } else {
        vec![0.0; s.q_elems()]
    };
    let mut lse_all = if whole {
        Vec::new()
    } else {
        vec![0.0; s.lse_elems()]
    };
    for ch in chunks {
        let (nb, nh) = (ch.b1 - ch.b0, ch.h1 - ch.h0);
        let cs = AttentionShape::new(nb, nh * g, nh, s.q_len, s.k_len, s.head_dim)?;
        let qr = (ch.b0, ch.b1, ch.h0 * g, ch.h1 * g);
        let kr = (ch.b0, ch.b1, ch.h0, ch.h1);
        let (qc, kc, vc);
        let (qs, ks, vs): (&[f32], &[f32], &[f32]) = if whole {
            (q, k, v)
        } else {
            qc = gather(q, layout, s.q_heads, s.q_len, s.head_dim, qr);
            kc = gather(k, layout, s.kv_heads, s.k_len, s.head_dim, kr);
            vc = gather(v, layout, s.kv_heads, s.k_len, s.head_dim, kr);
            (&qc, &kc, &vc)
        };
        let (o, lse) = ctx.scoped("attention", || {
            let qt = ctx.upload("q", qs, storage)?;
            let kt = ctx.upload("k", ks, storage)?;
            let vt = ctx.upload("v", vs, storage)?;
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let out = match sparse {
                Some((cfg, sel)) => {
                    // [B, Hkv, Nq, K]: a chunk's pairs are contiguous.
                    let rows = s.q_len * cfg.top_k;
                    let first = (ch.b0 * s.kv_heads + ch.h0) * rows;
                    let part = &sel[first..first + nb * nh * rows];
                    let st = ctx.upload_u32("selection", part)?;
                    let kind = AttentionKind::Sparse {
                        selection: &st,
                        cfg,
                    };
                    record_attention(
                        ctx,
                        &mut enc,
                        &qt,
                        &kt,
                        &vt,
                        &cs,
                        layout.into(),
                        &kind,
                        None,
                        None,
                    )?
                }
                None => {
                    let kind = AttentionKind::Dense {
                        causal: dense.0,
                        scale: dense.1,
                    };
                    record_attention(
                        ctx,
                        &mut enc,
                        &qt,
                        &kt,
                        &vt,
                        &cs,
                        layout.into(),
                        &kind,
                        None,
                        None,
                    )?
                }
            };
            ctx.queue().submit([enc.finish()]);
            Ok(out)
        })?;
        let (o, lse) = (ctx.read_f32(&o)?, ctx.read_f32(&lse)?);
        if whole {
            return Ok((o, lse));
        }
        scatter(&mut o_all, &o, layout, s.q_heads, s.q_len, s.head_dim, qr);
        // LSE [B, Hq, Nq]: a chunk's rows are contiguous per sequence.
        let w = nh * g * s.q_len;
        for b in ch.b0..ch.b1 {
            let dst = (b * s.q_heads + ch.h0 * g) * s.q_len;
            let src = (b - ch.b0) * w;
            lse_all[dst..dst + w].copy_from_slice(&lse[src..src + w]);
        }
    }
    Ok((o_all, lse_all))
}

/// Block-sparse attention of host slices (PISA.md section 4): uploads `q` `[B, Hq, Nq, D]`,
/// `k`, `v` `[B, Hkv, Nk, D]` (all in `layout`) in `storage` precision and `selection`
/// `[B, Hkv, Nq, K]` (ascending, -1 padded; read as the kernels read it: a -1, an index past
/// the last leaf or an entry not above its predecessor is ignored, where the CPU reference
/// `pisa_core::reference::sparse_attention` sorts a row, counts a repeat once and refuses an
/// index below -1 or past the last leaf; the two agree on strictly ascending rows), runs
/// [`super::record_sparse_attention`]'s kernel
/// and returns `(O in Q's layout, LSE [B, Hq, Nq])` as f32. Splits into (batch, KV head) chunks
/// when a buffer exceeds the binding limit.
///
/// Errors: as [`super::record_sparse_attention`], plus [`pisa_core::PisaError::BufferLen`] for a
/// host slice of the wrong length and [`GpuError::Limit`] when one (batch, KV head) slice
/// alone exceeds the binding limit.
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    cfg: &SelectionConfig,
    storage: Storage,
    selection: &[i32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    cfg.validate()?;
    check_host(shape, q, k, v)?;
    let n = shape.batch * shape.kv_heads * shape.q_len * cfg.top_k;
    if selection.len() != n {
        return Err(pisa_core::PisaError::BufferLen {
            what: "selection",
            expected: n,
            actual: selection.len(),
        }
        .into());
    }
    run(
        ctx,
        q,
        k,
        v,
        shape,
        layout,
        storage,
        Some((cfg, selection)),
        (true, 1.0),
    )
}

/// Dense attention of host slices: every key (`t <= p_i` when `causal`), scores `scale * q.k`.
/// Shapes, splitting, returns and errors as [`sparse_attention_host`].
#[allow(clippy::too_many_arguments)]
pub fn dense_attention_host(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    layout: TensorLayout,
    causal: bool,
    scale: f32,
    storage: Storage,
) -> Result<(Vec<f32>, Vec<f32>)> {
    check_host(shape, q, k, v)?;
    run(ctx, q, k, v, shape, layout, storage, None, (causal, scale))
}

fn check_host(s: &AttentionShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<()> {
    for (what, len, want) in [
        ("q", q.len(), s.q_elems()),
        ("k", k.len(), s.kv_elems()),
        ("v", v.len(), s.kv_elems()),
    ] {
        if len != want {
            return Err(pisa_core::PisaError::BufferLen {
                what,
                expected: want,
                actual: len,
            }
            .into());
        }
    }
    Ok(())
}
