//! Helpers of `attention_split.rs` (included with `#[path]`): inputs uploaded in any Q / K / V
//! layouts, one split-K call (the default path or an explicit plan) checked against the f64
//! reference with the tolerances of `attention_util.rs`, and its output bits for bitwise
//! comparisons.
#![allow(dead_code)]

use pisa_core::{reference, AttentionShape, TensorLayout};
use pisa_wgpu::ops::attention::split_k::{self, SplitK};
use pisa_wgpu::ops::attention::{self, AttentionKind, QkvLayouts};
use pisa_wgpu::{Context, GpuTensor, Storage};
use rand_chacha::ChaCha8Rng;
use TensorLayout::{Bhnd, Bnhd};

use crate::attention_util::{check, inputs};

/// `x` `[B, H, N, D]` from Bhnd (how the inputs are generated) to layout `to`.
fn convert(x: &[f32], (b, h, n, d): (usize, usize, usize, usize), to: TensorLayout) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for t in 0..n {
                let f = Bhnd.index(h, n, d, bi, hi, t, 0);
                let g = to.index(h, n, d, bi, hi, t, 0);
                out[g..g + d].copy_from_slice(&x[f..f + d]);
            }
        }
    }
    out
}

/// One call: shape, layouts, storage, causal, and an explicit plan (`None`: `record_attention`
/// with the default tiling, which must choose split-K).
pub struct Call {
    pub s: AttentionShape,
    pub layouts: QkvLayouts,
    pub storage: Storage,
    pub causal: bool,
    pub plan: Option<SplitK>,
}

/// Uploaded inputs of a call and the reference result.
pub struct Prepared {
    t: [GpuTensor; 3],
    scale: f32,
    want: (Vec<f64>, Vec<f64>),
}

/// Random inputs for `c`, uploaded in its layouts, and the reference (O in Bhnd).
pub fn prepare(ctx: &Context, r: &mut ChaCha8Rng, c: &Call) -> Prepared {
    let s = &c.s;
    let x = inputs(r, s, c.storage);
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let want = reference::dense_attention(&x.q, &x.k, &x.v, s, Bhnd, c.causal, scale).unwrap();
    let qd = (s.batch, s.q_heads, s.q_len, s.head_dim);
    let kd = (s.batch, s.kv_heads, s.k_len, s.head_dim);
    let up = |d: &[f32], dims, l| ctx.upload("t", &convert(d, dims, l), c.storage).unwrap();
    let l = c.layouts;
    let c_of = |k: pisa_wgpu::runtime::view::KernelLayout| k.contiguous().unwrap();
    let t = [
        up(&x.q, qd, c_of(l.q)),
        up(&x.k, kd, c_of(l.k)),
        up(&x.v, kd, c_of(l.v)),
    ];
    Prepared { t, scale, want }
}

/// Runs `c` on prepared inputs and checks it against the reference; returns `(O, LSE)` bits.
pub fn exec(ctx: &Context, c: &Call, x: &Prepared, what: &str) -> (Vec<u32>, Vec<u32>) {
    let (s, l, [qt, kt, vt]) = (&c.s, c.layouts, &x.t);
    let (o, lse) = ctx
        .scoped("test", || {
            let mut enc = ctx.device().create_command_encoder(&Default::default());
            let e = &mut enc;
            let out = match &c.plan {
                None => {
                    let kind = AttentionKind::Dense {
                        causal: c.causal,
                        scale: x.scale,
                    };
                    attention::record_attention(ctx, e, qt, kt, vt, s, l, &kind, None, None)?
                }
                Some(p) => {
                    let cs = (c.causal, x.scale);
                    split_k::record_split_k(ctx, e, qt, kt, vt, s, l, cs, p, None)?
                }
            };
            ctx.queue().submit([enc.finish()]);
            Ok(out)
        })
        .unwrap();
    let (o, lse) = (ctx.read_f32(&o).unwrap(), ctx.read_f32(&lse).unwrap());
    // O comes back in its layout (Q's); the reference is in Bhnd.
    let mut ob = vec![0.0; o.len()];
    let (d, n) = (s.head_dim, s.q_len);
    for bi in 0..s.batch {
        for h in 0..s.q_heads {
            for t in 0..n {
                let f = l.o.index(s.q_heads, n, d, bi, h, t, 0);
                let g = Bhnd.index(s.q_heads, n, d, bi, h, t, 0);
                ob[g..g + d].copy_from_slice(&o[f..f + d]);
            }
        }
    }
    check(what, (&ob, &lse), (&x.want.0, &x.want.1), c.storage);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    (bits(&o), bits(&lse))
}

/// [`prepare`] then [`exec`].
pub fn run(ctx: &Context, r: &mut ChaCha8Rng, c: &Call, what: &str) -> (Vec<u32>, Vec<u32>) {
    exec(ctx, c, &prepare(ctx, r, c), what)
}

pub const LAYOUTS: [QkvLayouts; 4] = [
    QkvLayouts::contiguous(Bhnd, Bhnd, Bhnd),
    QkvLayouts::contiguous(Bnhd, Bnhd, Bnhd),
    QkvLayouts::contiguous(Bhnd, Bnhd, Bhnd),
    QkvLayouts::contiguous(Bnhd, Bhnd, Bnhd),
];
