//! How an attention dispatch is cut into workgroups (PISA.md section 5): query heads and queries
//! per workgroup, keys per workgroup-memory tile, and the shader constants that follow, sized to
//! the device's workgroup-memory and invocation limits.

use crate::error::{GpuError, Result};
use crate::runtime::context::Context;

/// Work decomposition of one attention dispatch. Each workgroup owns `head_chunk` query heads of
/// one KV head times `query_tile` consecutive queries, and streams the keys through workgroup
/// memory `key_tile` at a time, so every loaded key serves all of those rows (PISA.md section 5,
/// "GQA" and "Qtile").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    /// GH: query heads per workgroup (a GQA group larger than this is split into
    /// `ceil(g_q / GH)` chunks; values above g_q are clamped to it). 1..=32.
    pub head_chunk: usize,
    /// QT: consecutive queries per workgroup; 1..=32. Sparse: their selections are merged and a
    /// block serves every query of the tile that chose it.
    pub query_tile: usize,
    /// KT: keys per workgroup-memory tile, 1..=128; above the kernel's key group D / RM (32 for
    /// D = 128 and RM = 4) it is rounded up to a multiple of it. Sparse: a leaf block of C keys is
    /// walked in `ceil(C / KT)` tiles.
    pub key_tile: usize,
    /// RM: query rows each invocation accumulates, 4 or 8; 0 picks 4 unless that needs more
    /// than 256 invocations.
    pub rows_per_thread: usize,
}

/// Shader constants of one pipeline variant (see `shaders/attention.wgsl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Variant {
    pub hd4: u32,
    pub rm: u32,
    pub rp: u32,
    pub kt: u32,
    pub qt: u32,
    pub selk: u32,
    pub wg: u32,
    pub gh: u32,
}

impl Variant {
    /// Workgroup memory the shader declares, bytes (mirrors its `var<workgroup>` list).
    pub fn shared_bytes(&self) -> u64 {
        let row4 = (self.hd4 + 1) as u64;
        let (rp, kt, wg) = (self.rp as u64, self.kt as u64, self.wg as u64);
        let maxu4 = (self.qt * self.selk).div_ceil(4) as u64 * 4;
        // attention_common.wgsl: five arrays of MAXU4 words and the count.
        16 * (rp + kt) * row4 + 4 * (kt * rp + wg + rp) + 20 * maxu4 + 16
    }

    /// Loop iterations one invocation of `shaders/attention.wgsl` runs, at most (every loop of
    /// every function it calls counted, for the invocation that runs the most): the union of
    /// `attention_common.wgsl` (sparse), then the key tiles it walks, `tiles` of them. Some
    /// drivers cap this count: llvmpipe stops every loop of an invocation after 65535 iterations
    /// in all ([`crate::Context::loop_limit`]), silently, so the host checks it there.
    /// `distinct`: at most this many distinct blocks in the union (sparse: the leaf blocks).
    pub fn loop_iterations(&self, sparse: bool, tiles: u64, distinct: u64) -> u64 {
        let (hd4, kt, wg, rm) = (
            self.hd4 as u64,
            self.kt as u64,
            self.wg as u64,
            self.rm as u64,
        );
        let split = hd4 / rm;
        let ng = kt.div_ceil(4 * split);
        // process_tile: two tile loads, the S phase (groups x head-dim vec4s), the row max, the
        // exponentials, the rows' flags, the P V keys; and the outer loops' own iterations.
        let tile = 2 * (kt * hd4).div_ceil(wg) + ng * (1 + hd4) + split + 4 * ng + rm + kt + 2;
        // setup's Q load and finish's sum.
        let fixed = (self.rp as u64 * hd4).div_ceil(wg) + split + 1;
        let mut union = 0;
        if sparse {
            let (maxu, selk) = ((self.qt * self.selk) as u64, self.selk.max(1) as u64);
            // build_union, invocation `lid`: per entry x = lid, lid + WG, ...: its pass-1 load,
            // the x % SELK entries before it in its list, the x entries before it in the tile,
            // and (a first occurrence) all MAXU; invocation 0 also counts the union.
            let first = distinct.min(maxu.div_ceil(wg));
            union = (0..wg.min(maxu))
                .map(|lid| {
                    let xs = (lid..maxu).step_by(wg as usize);
                    xs.map(|x| 3 + x % selk + x).sum::<u64>()
                        + first * maxu
                        + if lid == 0 { maxu } else { 0 }
                })
                .max()
                .unwrap_or(0);
        }
        union + tiles * tile + fixed
    }

    /// The `(name, value)` constants for [`crate::runtime::pipeline::preprocess`].
    pub fn consts(&self) -> [(&'static str, u32); 6] {
        [
            ("HD4", self.hd4),
            ("RM", self.rm),
            ("RP", self.rp),
            ("KT", self.kt),
            ("QT", self.qt),
            ("SELK", self.selk),
        ]
    }
}

/// Largest workgroup the kernels use (WebGPU's default limit).
const MAX_WG: u32 = 256;

impl Tiling {
    /// The default tiling: sparse (`top_k` given) GH = min(g_q, 8), QT = 4 (the paper's Qtile),
    /// KT = min(C, 64); dense GH = min(g_q, 8), QT = min(64 / GH, 32), KT = 32 (64 rows per
    /// workgroup: each loaded key serves them all).
    pub fn default_for(group: usize, sparse_block: Option<usize>) -> Self {
        let gh = group.clamp(1, 8);
        match sparse_block {
            Some(c) => Self {
                head_chunk: gh,
                query_tile: 4,
                key_tile: c.clamp(1, 64),
                rows_per_thread: 0,
            },
            None => Self {
                head_chunk: gh,
                query_tile: (64 / gh).clamp(1, 32),
                key_tile: 32,
                rows_per_thread: 0,
            },
        }
    }

    /// The shader variant of this tiling for head dim `head_dim` (a multiple of 16), GQA group
    /// `group` and `top_k` (1 for dense), or `None` when no thread layout fits the invocation
    /// limit. Rows per PV thread (RM) are 4, or 8 when 4 would need more than 256 invocations
    /// (or `rows_per_thread` asks for 8); KT is rounded up to a multiple of the S-phase key
    /// group KG = D / RM (a smaller KT leaves some S-phase invocations idle).
    pub(crate) fn variant(
        &self,
        l: &wgpu::Limits,
        head_dim: usize,
        group: usize,
        top_k: usize,
    ) -> Option<Variant> {
        let hd4 = (head_dim / 4) as u32;
        let gh = self.head_chunk.clamp(1, 32).min(group) as u32;
        let qt = self.query_tile.clamp(1, 32) as u32;
        let rows = gh * qt;
        let wg_max = MAX_WG
            .min(l.max_compute_invocations_per_workgroup)
            .min(l.max_compute_workgroup_size_x);
        let wg_of = |rm: u32| hd4 * rows.div_ceil(rm);
        let ok = |rm: u32| hd4.is_multiple_of(rm) && wg_of(rm) <= wg_max;
        let rm = match self.rows_per_thread {
            8 if ok(8) => 8,
            _ if ok(4) => 4,
            _ if ok(8) => 8,
            _ => return None,
        };
        let kg = 4 * hd4 / rm;
        let want = self.key_tile.clamp(1, 128) as u32;
        let kt = if want >= kg {
            want.div_ceil(kg) * kg
        } else {
            want
        };
        Some(Variant {
            hd4,
            rm,
            rp: rows.div_ceil(rm) * rm,
            kt,
            qt,
            selk: top_k as u32,
            wg: wg_of(rm),
            gh,
        })
    }

    /// This tiling if it fits the device, else the nearest smaller one: the larger of KT and QT
    /// halves (KT while it is the larger), down to both 1, then GH halves. Errors with [`GpuError::Limit`] when even GH = QT = KT = 1
    /// does not fit the workgroup memory.
    pub(crate) fn fit(
        self,
        ctx: &Context,
        head_dim: usize,
        group: usize,
        top_k: usize,
    ) -> Result<(Tiling, Variant)> {
        self.fit_limits(ctx.limits(), head_dim, group, top_k)
    }

    /// [`Self::fit`] for a device with limits `l`.
    pub(crate) fn fit_limits(
        mut self,
        l: &wgpu::Limits,
        head_dim: usize,
        group: usize,
        top_k: usize,
    ) -> Result<(Tiling, Variant)> {
        let budget = l.max_compute_workgroup_storage_size as u64;
        loop {
            if let Some(v) = self.variant(l, head_dim, group, top_k) {
                if v.shared_bytes() <= budget {
                    return Ok((self, v));
                }
            }
            // The larger of the two tiles first, so that neither ends at 1 while the other is
            // large: halving the key tile alone took dense attention at D 128 on a 32 KiB
            // device (llvmpipe) to 1 key x 8 queries, 6x slower than its sparse kernel's 32 x 4.
            if self.key_tile > self.query_tile {
                self.key_tile /= 2;
            } else if self.query_tile > 1 {
                self.query_tile /= 2;
            } else if self.key_tile > 1 {
                self.key_tile /= 2;
            } else if self.head_chunk > 1 {
                self.head_chunk /= 2;
            } else {
                let need = self
                    .variant(l, head_dim, group, top_k)
                    .map_or(u64::MAX, |v| v.shared_bytes());
                return Err(GpuError::Limit {
                    what: format!(
                        "attention workgroup memory (head dim {head_dim}, top_k {top_k})"
                    ),
                    needed: need,
                    limit: budget,
                    unit: "bytes",
                    hint: "use a smaller head dim or top_k",
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::SHADER;
    use crate::runtime::pipeline::{assert_workgroup_fits, Storage};

    /// The workgroup variables of both entry points (naga's sizes, the variant's constants
    /// substituted) fit what [`Variant::shared_bytes`] charges, for the tilings [`Tiling::fit`]
    /// picks: default sparse and dense tilings, explicit large ones (QT 32, KT 128, RM 8),
    /// head dims 16 to 256, GQA groups 1 to 32, top_k 1 to 64, at 16, 32 and 48 KiB and 256 or
    /// 1024 invocations.
    #[test]
    fn shared_bytes_covers_the_shader() {
        let mut checked = 0;
        for (d, g, top_k, c) in [
            (128, 4, 16, Some(64)),
            (128, 4, 1, None),
            (64, 1, 8, Some(32)),
            (80, 7, 64, Some(16)),
            (256, 8, 1, None),
            (16, 32, 4, Some(128)),
            (96, 2, 33, Some(8)),
        ] {
            let explicit = [
                Tiling::default_for(g, c),
                Tiling {
                    head_chunk: 32,
                    query_tile: 32,
                    key_tile: 128,
                    rows_per_thread: 8,
                },
                Tiling {
                    head_chunk: 1,
                    query_tile: 3,
                    key_tile: 5,
                    rows_per_thread: 0,
                },
            ];
            for (mem, inv) in [(16u32 << 10, 256u32), (32 << 10, 1024), (48 << 10, 256)] {
                let lim = wgpu::Limits {
                    max_compute_workgroup_storage_size: mem,
                    max_compute_invocations_per_workgroup: inv,
                    max_compute_workgroup_size_x: inv,
                    ..Default::default()
                };
                for t in explicit {
                    let Ok((_, v)) = t.fit_limits(&lim, d, g, top_k) else {
                        continue;
                    };
                    checked += 1;
                    for (entry, st) in [("sparse", Storage::F32), ("dense", Storage::F16)] {
                        let what = format!("D {d} g {g} top_k {top_k} {t:?} at {mem} bytes");
                        let charged = v.shared_bytes();
                        assert_workgroup_fits(&SHADER, entry, st, &v.consts(), charged, what);
                    }
                }
            }
        }
        assert!(checked >= 50, "only {checked} variants checked");
    }

    /// Where the default tiling does not fit, the larger tile shrinks first: dense attention
    /// at D 128, GQA 4, on llvmpipe's 32 KiB and 1024 invocations keeps a key tile of more
    /// than one key (it went to 1 key x 8 queries, 6x slower than 32 x 4), and no tile is more
    /// than twice the other's size unless the other is already 1.
    #[test]
    fn the_larger_tile_shrinks_first() {
        let lim = wgpu::Limits {
            max_compute_workgroup_storage_size: 32 << 10,
            max_compute_invocations_per_workgroup: 1024,
            max_compute_workgroup_size_x: 1024,
            ..Default::default()
        };
        for (d, g, c) in [
            (128, 4, None),
            (128, 4, Some(64)),
            (256, 8, None),
            (96, 2, None),
        ] {
            let start = Tiling::default_for(g, c);
            let (t, _) = start.fit_limits(&lim, d, g, 16).unwrap();
            let what = format!("D {d} g {g} C {c:?}: {start:?} -> {t:?}");
            if t.key_tile < start.key_tile || t.query_tile < start.query_tile {
                assert!(t.key_tile > 1 || t.query_tile == 1, "{what}");
                assert!(
                    t.key_tile <= 2 * t.query_tile.max(1) || t.query_tile == start.query_tile,
                    "{what}"
                );
            }
        }
    }
}
