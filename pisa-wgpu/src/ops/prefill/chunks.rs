//! Host-side KV-head chunking of [`prefill_host`](super::prefill_host) (see the binding-size
//! splitting in the [parent module docs](super)): how many (batch, KV head) units fit one
//! storage binding ([`units_per_chunk`]), the copies of one chunk's heads out of the full
//! tensors and back ([`HeadRange`]), and the chunk loop ([`prefill_chunked`]).

use pisa_core::{AttentionShape, PyramidLayout, Schedule, TensorLayout};

use super::{run_once, PrefillOptions, PrefillOutput};
use crate::error::{GpuError, Result};
use crate::ops::select::every_leaf_selected;
use crate::runtime::context::Context;
use crate::runtime::profiler::StageTimes;

/// Largest number of (batch, KV head) units whose buffers all fit one binding.
pub(super) fn units_per_chunk(
    ctx: &Context,
    shape: &AttentionShape,
    opts: &PrefillOptions,
) -> Result<usize> {
    let lay = PyramidLayout::new(shape.k_len, opts.cfg.block_size, opts.cfg.merge_factor)?;
    let sched = Schedule::new(&lay, &opts.cfg)?;
    let (g, d, e) = (
        shape.gqa_group() as u64,
        shape.head_dim as u64,
        opts.storage.bytes(),
    );
    // (bytes, what a smaller one needs: top_k, f16 storage (f32 storage only), or neither)
    let f32_storage = e == 4;
    let (per_unit, by) = [
        (g * shape.q_len as u64 * d * e, Shrink::Storage), // Q
        (
            g * shape.q_len as u64 * d * opts.storage.output().bytes(),
            Shrink::Storage,
        ), // O (f32 for bf16)
        (shape.k_len as u64 * d * e, Shrink::Storage),     // K, V
        (lay.total_nodes() as u64 * d * 4, Shrink::Length), // pyramid (f32 means)
        (
            // (none where every query keeps every leaf it sees: no route runs)
            match every_leaf_selected(shape, &opts.cfg) {
                true => 0,
                false => shape.q_len as u64 * sched.max_candidates as u64 * 4,
            },
            Shrink::Candidates,
        ), // stage-1 candidates
        (shape.q_len as u64 * opts.cfg.top_k as u64 * 4, Shrink::TopK), // selection (i32)
        (g * shape.q_len as u64 * 4, Shrink::Length),      // LSE
    ]
    .into_iter()
    .max_by_key(|&(bytes, _)| bytes)
    .unwrap_or((1, Shrink::Length));
    let limit = ctx.max_binding_bytes();
    if per_unit > limit {
        return Err(GpuError::Limit {
            what: format!("one head of a {}-token prefill", shape.k_len),
            needed: per_unit,
            limit,
            unit: "bytes",
            hint: match by {
                Shrink::Candidates => {
                    "use a smaller top_k (the stage-1 candidates, g (top_k + 1) per query, are \
                     the largest tensor) or a shorter sequence"
                }
                Shrink::TopK => {
                    "use a smaller top_k (the selection, top_k entries per query, is the \
                     largest tensor) or a shorter sequence"
                }
                Shrink::Storage if f32_storage => "use f16 storage or a shorter sequence",
                _ => {
                    "use a shorter sequence (each tensor of one head must fit one storage \
                     binding of the device)"
                }
            },
        });
    }
    Ok((limit / per_unit) as usize)
}

/// Heads `h0..h1` (of `heads`) of batch entry `b` of a `[B, H, N, D]` tensor in `layout`: the
/// part of it that one chunk holds, as a `[1, h1-h0, N, D]` tensor of the same layout.
#[derive(Debug, Clone, Copy)]
struct HeadRange {
    layout: TensorLayout,
    heads: usize,
    n: usize,
    d: usize,
    b: usize,
    h0: usize,
    h1: usize,
}

impl HeadRange {
    /// Copies the range's heads out of `full` (`[B, H, N, D]`) into `chunk`
    /// (`[1, h1-h0, N, D]`).
    fn gather(&self, full: &[f32], chunk: &mut [f32]) {
        self.for_rows(|s, o, d| chunk[o..o + d].copy_from_slice(&full[s..s + d]));
    }

    /// Copies `chunk` (`[1, h1-h0, N, D]`) back into the range's heads of `full`
    /// (`[B, H, N, D]`).
    fn scatter(&self, chunk: &[f32], full: &mut [f32]) {
        self.for_rows(|s, o, d| full[s..s + d].copy_from_slice(&chunk[o..o + d]));
    }

    /// Calls `f(full offset, chunk offset, D)` for each of the range's `D`-element rows.
    fn for_rows(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (layout, n, d) = (self.layout, self.n, self.d);
        let hc = self.h1 - self.h0;
        for h in self.h0..self.h1 {
            for t in 0..n {
                let s = layout.index(self.heads, n, d, self.b, h, t, 0);
                let o = layout.index(hc, n, d, 0, h - self.h0, t, 0);
                f(s, o, d);
            }
        }
    }
}

/// The chunked path of [`prefill_host`](super::prefill_host), for a call whose (batch, KV head)
/// units do not all fit one binding: each chunk runs up to `units` KV heads (at least 1) of one
/// batch entry, with their query heads, and O, LSE and the selection are assembled in place.
/// `q`, `k`, `v` and `shape` as for `prefill_host` (already checked). Stage times are summed
/// over chunks; `chunks` counts them.
pub(super) fn prefill_chunked(
    ctx: &Context,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &AttentionShape,
    opts: &PrefillOptions,
    units: usize,
) -> Result<PrefillOutput> {
    let (g, d, hkv) = (shape.gqa_group(), shape.head_dim, shape.kv_heads);
    let heads_per = units.clamp(1, hkv);
    let (mut out, mut lse) = (vec![0f32; shape.q_elems()], vec![0f32; shape.lse_elems()]);
    let mut selection = vec![
        -1i32;
        if opts.return_selection {
            shape.batch * hkv * shape.q_len * opts.cfg.top_k
        } else {
            0
        }
    ];
    let mut times = StageTimes::default();
    let mut chunks = 0;
    for b in 0..shape.batch {
        for h0 in (0..hkv).step_by(heads_per) {
            let h1 = (h0 + heads_per).min(hkv);
            let s = AttentionShape::new(1, (h1 - h0) * g, h1 - h0, shape.q_len, shape.k_len, d)?;
            let q_at = HeadRange {
                layout: opts.layout,
                heads: shape.q_heads,
                n: shape.q_len,
                d,
                b,
                h0: h0 * g,
                h1: h1 * g,
            };
            let kv_at = HeadRange {
                layout: opts.layout,
                heads: hkv,
                n: shape.k_len,
                d,
                b,
                h0,
                h1,
            };
            let (mut qc, mut kc, mut vc) = (
                vec![0f32; s.q_elems()],
                vec![0f32; s.kv_elems()],
                vec![0f32; s.kv_elems()],
            );
            q_at.gather(q, &mut qc);
            kv_at.gather(k, &mut kc);
            kv_at.gather(v, &mut vc);
            let r = run_once(ctx, &qc, &kc, &vc, &s, opts)?;
            q_at.scatter(&r.out, &mut out);
            let lo = (b * shape.q_heads + h0 * g) * shape.q_len;
            lse[lo..lo + r.lse.len()].copy_from_slice(&r.lse);
            if opts.return_selection {
                let so = (b * hkv + h0) * shape.q_len * opts.cfg.top_k;
                selection[so..so + r.selection.len()].copy_from_slice(&r.selection);
            }
            for (name, ms) in r.times.stages {
                match times.stages.iter_mut().find(|x| x.0 == name) {
                    Some(x) => x.1 += ms,
                    None => times.stages.push((name, ms)),
                }
            }
            times.gpu = r.times.gpu;
            chunks += 1;
        }
    }
    Ok(PrefillOutput {
        out,
        lse,
        selection: opts.return_selection.then_some(selection),
        times,
        chunks,
    })
}

/// What would shrink the largest per-head tensor of a prefill (the `Limit` error's hint).
#[derive(Clone, Copy)]
enum Shrink {
    /// The stage-1 candidates: a smaller top_k.
    Candidates,
    /// The selection: a smaller top_k.
    TopK,
    /// Q, O, K, V: 2-byte storage, where the storage is f32.
    Storage,
    /// Only a shorter sequence.
    Length,
}
