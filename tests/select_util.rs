//! Helpers of the selection tests (included with `#[path]` by `select*.rs`): test cases (and the
//! case lists `select.rs` and `select_by_leaf.rs` share: [`group_cases`], [`length_cases`]),
//! inputs, the comparison of a GPU selection with the CPU reference that accepts a differing row
//! only where the reference's own margin says it is a near-tie, and [`run_case`], one PISA case
//! of `select.rs` / `select_route.rs` / `select_by_leaf.rs` against `select_pisa`.
#![allow(dead_code)]

use pisa_core::reference::{select_pisa, Selection};
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::select::{select_host, Method};
use pisa_wgpu::Storage;
use rand_chacha::ChaCha8Rng;

use crate::common::{ctx, random, through_storage};

/// One selection test case.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub nq: usize,
    pub nk: usize,
    pub d: usize,
    pub c: usize,
    pub k: usize,
    pub g: usize,
    pub scoring: Scoring,
    pub causal: bool,
    pub sink: usize,
    pub local: usize,
    pub layout: TensorLayout,
    pub storage: Storage,
}

impl Case {
    /// A causal prefill case with `lse` scoring, g = 2, no forced extras, Bhnd, f32.
    pub fn new(b: usize, hq: usize, hkv: usize, n: usize, d: usize, c: usize, k: usize) -> Self {
        Self {
            b,
            hq,
            hkv,
            nq: n,
            nk: n,
            d,
            c,
            k,
            g: 2,
            scoring: Scoring::Lse,
            causal: true,
            sink: 0,
            local: 0,
            layout: TensorLayout::Bhnd,
            storage: Storage::F32,
        }
    }

    pub fn shape(&self) -> AttentionShape {
        AttentionShape::new(self.b, self.hq, self.hkv, self.nq, self.nk, self.d).unwrap()
    }

    pub fn cfg(&self) -> SelectionConfig {
        SelectionConfig::new(self.c, self.k)
            .unwrap()
            .with_merge_factor(self.g)
            .with_scoring(self.scoring)
            .with_causal(self.causal)
            .with_forced(self.sink, self.local)
    }

    /// Random Q and K (uniform in [-1, 1], plus a per-(head, block) key offset so blocks
    /// differ), rounded through f16 when the case stores f16 (both GPU and reference see it).
    pub fn inputs(&self, r: &mut ChaCha8Rng) -> (Vec<f32>, Vec<f32>) {
        let s = self.shape();
        let q = random(r, s.q_elems(), 1.0);
        let mut k = random(r, s.kv_elems(), 1.0);
        let nb = self.nk.div_ceil(self.c);
        let offs = random(r, self.b * self.hkv * nb * self.d, 0.5);
        for b in 0..self.b {
            for h in 0..self.hkv {
                for t in 0..self.nk {
                    for d in 0..self.d {
                        let i = self.layout.index(self.hkv, self.nk, self.d, b, h, t, d);
                        k[i] += offs[((b * self.hkv + h) * nb + t / self.c) * self.d + d];
                    }
                }
            }
        }
        (
            through_storage(&q, self.storage),
            through_storage(&k, self.storage),
        )
    }

    /// Tie tolerance on the reference margin: see [`tie_tol`].
    pub fn tol(&self, q: &[f32], k: &[f32]) -> f64 {
        let s = self.cfg().softmax_scale(self.d) as f64;
        tie_tol(self.hq / self.hkv, self.d, s, q, k, self.storage)
    }

    /// The GPU selection of this case by `method` on the shared context, query tile `tile`.
    pub fn select_gpu(
        &self,
        q: &[f32],
        k: &[f32],
        method: Method,
        tile: usize,
    ) -> pisa_wgpu::Result<Vec<i32>> {
        let (shape, cfg) = (self.shape(), self.cfg());
        select_host(
            ctx(),
            q,
            k,
            &shape,
            self.layout,
            &cfg,
            self.storage,
            method,
            tile,
        )
    }
}

pub use crate::common::tie_tol;

/// Compares a GPU selection with the reference row by row ([`crate::common::check_rows`]):
/// a row that differs is accepted only when the reference's margin is below `tol` and the GPU
/// row is still a valid selection. Returns the number of rows accepted as ties.
pub fn check(what: &str, gpu: &[i32], want: &Selection, tol: f64) -> usize {
    crate::common::check_rows(what, gpu, want, want.top_k, tol)
}

/// Prints the tie count of a case (ties must be rare; the test fails above 5% of the rows).
pub fn report(what: &str, ties: usize, rows: usize) {
    eprintln!("{what}: {rows} rows, {ties} accepted as near-ties");
    assert!(
        ties * 20 <= rows.max(20),
        "{what}: {ties} ties out of {rows} rows"
    );
}

/// Runs one case with Qtile 4 against the reference; with `tile1`, also Qtile 1, against the
/// same reference and tolerance (the two tilings sum a score's terms in different orders, so
/// they may order a near-tie differently: seed 1796515629828449768 did, and a bitwise equality
/// between them failed where both agreed with the reference up to near-ties).
pub fn run_case(name: &str, c: Case, r: &mut rand_chacha::ChaCha8Rng, tile1: bool) {
    let ctx = ctx();
    if c.storage == Storage::F16 && !ctx.has_f16() {
        eprintln!("{name}: skipped (adapter has no SHADER_F16)");
        return;
    }
    let (q, k) = c.inputs(r);
    let (shape, cfg) = (c.shape(), c.cfg());
    let t0 = std::time::Instant::now();
    let want = select_pisa(&q, &k, &shape, c.layout, &cfg).unwrap();
    let t_ref = t0.elapsed();
    let run = |tile| {
        select_host(
            ctx,
            &q,
            &k,
            &shape,
            c.layout,
            &cfg,
            c.storage,
            Method::Pisa,
            tile,
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let t0 = std::time::Instant::now();
    let got = run(4);
    eprintln!(
        "{name}: reference {t_ref:.2?}, gpu (Qtile 4) {:.2?}",
        t0.elapsed()
    );
    let ties = check(name, &got, &want, c.tol(&q, &k));
    report(name, ties, want.rows());
    if tile1 {
        let name1 = format!("{name} (Qtile 1)");
        let ties1 = check(&name1, &run(1), &want, c.tol(&q, &k));
        report(&name1, ties1, want.rows());
    }
}

/// Causal b = 2, Hq = Hkv = 2, N = 1000, D = 64, C = 16, K = 4, g = 2, `lse`, Bhnd, f32.
pub fn base() -> Case {
    Case::new(2, 2, 2, 1000, 64, 16, 4)
}

/// The GQA-group, head-dim and scoring cases that `select.rs` (query tiles) and
/// `select_by_leaf.rs` (leaf-major) both run, in the order both run them (so `PISA_SEED` replays
/// the same inputs): groups 1, 2, 3, 4, 7, 8, head dims 64 to 256, every scoring, forced blocks,
/// merge factor 3, both layouts, f32 and f16. Each file adds its own Qtile-1 flags, storages and
/// cases around them.
pub fn group_cases() -> [(&'static str, Case); 6] {
    use Scoring::{Mean, MeanVar};
    use Storage::F16;
    use TensorLayout::Bnhd;
    // Case::new(b, hq, hkv, n, d, c, k): causal, lse, g 2, no forced blocks, Bhnd, f32.
    [
        ("gq1 d64 lse b2", base()),
        (
            "gq2 d80 mean g3 sink+local bnhd",
            Case {
                g: 3,
                scoring: Mean,
                sink: 1,
                local: 1,
                layout: Bnhd,
                ..Case::new(1, 4, 2, 600, 80, 16, 6)
            },
        ),
        (
            "gq3 d96 meanvar non-causal f16",
            Case {
                scoring: MeanVar,
                causal: false,
                storage: F16,
                ..Case::new(1, 3, 1, 700, 96, 16, 5)
            },
        ),
        (
            "gq4 d128 lse local2 bnhd f16 C8",
            Case {
                local: 2,
                layout: Bnhd,
                storage: F16,
                ..Case::new(1, 8, 2, 333, 128, 8, 8)
            },
        ),
        (
            "gq7 d256 lse g3 sink1",
            Case {
                g: 3,
                sink: 1,
                ..Case::new(1, 7, 1, 130, 256, 8, 4)
            },
        ),
        (
            "gq8 d64 meanvar bnhd b2",
            Case {
                scoring: MeanVar,
                layout: Bnhd,
                ..Case::new(2, 8, 1, 150, 64, 4, 6)
            },
        ),
    ]
}

/// The length cases that `select.rs` and `select_by_leaf.rs` both run first, in their order:
/// few queries against many keys (Nq 37 of Nk 1000), and a partial last block, non-causal.
pub fn length_cases() -> [(&'static str, Case); 2] {
    [
        (
            "decode-like nq 37 of nk 1000, mean, local1, gq2",
            Case {
                nq: 37,
                scoring: Scoring::Mean,
                local: 1,
                ..Case::new(2, 4, 2, 1000, 64, 16, 4)
            },
        ),
        (
            "non-causal lse partial last block bnhd sink1",
            Case {
                causal: false,
                sink: 1,
                layout: TensorLayout::Bnhd,
                ..Case::new(1, 2, 1, 999, 64, 16, 4)
            },
        ),
    ]
}

/// Very short sequences of `lengths` tokens (g_q 2, K 2), causal and not, each against the
/// reference with Qtile 1 and 4: the queries that see K or fewer leaves and the first to choose.
pub fn run_short_lengths(r: &mut rand_chacha::ChaCha8Rng, lengths: &[usize]) {
    for &n in lengths {
        let c = Case {
            hq: 2,
            hkv: 1,
            nq: n,
            nk: n,
            k: 2,
            ..base()
        };
        run_case(&format!("n {n}"), c, r, true);
        let nc = Case { causal: false, ..c };
        run_case(&format!("n {n} non-causal"), nc, r, true);
    }
}
