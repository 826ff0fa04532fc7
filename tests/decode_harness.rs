//! The step-by-step harness of `tests/decode.rs`: a GPU [`KvCache`] and one CPU
//! [`DecodeState`] per sequence fed the same random (or tied) inputs, every step compared:
//! selection exactly except within the reference's tie margin, output and LSE within tolerance.
#![allow(dead_code)]

use super::common::*;
use pisa_core::reference::{self, DecodeState};
use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::{DecodeOutput, KvCache};
use pisa_wgpu::Storage;
use rand::Rng;

/// Selection differences are accepted only where the reference's margin (the gap at some
/// cut, natural-log units summed over the group) is below this: f32 rounding of scores of
/// magnitude ~10 is ~1e-5, so 1e-3 is generous yet far below a real mismatch. f16 runs compare
/// against the reference on f16-rounded inputs, so the same bound holds.
pub const TIE: f64 = 1e-3;

#[derive(Clone)]
pub struct Case {
    pub name: &'static str,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub cfg: SelectionConfig,
    pub storage: Storage,
    pub prefill: Vec<usize>,
    pub steps: usize,
    pub layout: TensorLayout,
    /// Probability that a sequence appends at a step (1.0: all, every step).
    pub active: f64,
    /// Every key is the same vector: all complete-past nodes of a level tie exactly, so the
    /// selection must follow the tie rule (lower block first) with no margin allowance.
    pub tied: bool,
}

pub fn cfg(c: usize, k: usize, g: usize, s: Scoring) -> SelectionConfig {
    SelectionConfig::new(c, k)
        .unwrap()
        .with_merge_factor(g)
        .with_scoring(s)
}

pub struct Run {
    pub case: Case,
    pub cache: KvCache,
    pub refs: Vec<DecodeState>,
    pub rng: rand_chacha::ChaCha8Rng,
    pub seed: u64,
    pub ties: usize,
}

impl Run {
    pub fn new(case: Case, capacity: usize) -> Self {
        Self::new_in(ctx(), case, capacity)
    }

    /// [`Self::new`] on context `ctx` (e.g. one with a lowered storage-binding limit).
    pub fn new_in(ctx: &'static pisa_wgpu::Context, case: Case, capacity: usize) -> Self {
        let seed = seed(case.name);
        let c = &case;
        let cache = KvCache::new(
            ctx,
            c.prefill.len(),
            capacity,
            c.hq,
            c.hkv,
            c.d,
            c.cfg,
            c.storage,
        )
        .unwrap();
        if ctx.tuning().decode_fused && !cache.is_fused() {
            eprintln!(
                "{}: PISA_DECODE=fused, but the fused step does not fit: split",
                c.name
            );
        }
        let refs = (0..c.prefill.len())
            .map(|_| DecodeState::new(c.hq, c.hkv, c.d, c.cfg).unwrap())
            .collect();
        let mut r = Self {
            case,
            cache,
            refs,
            rng: rng(seed),
            seed,
            ties: 0,
        };
        for b in 0..r.case.prefill.len() {
            let p = r.case.prefill[b];
            if p > 0 {
                r.prefill(b, p);
            }
        }
        r
    }

    /// `n` random values, rounded through f16 for an f16 cache (what it stores).
    fn rand(&mut self, n: usize, scale: f32) -> Vec<f32> {
        let x = random(&mut self.rng, n, scale);
        self.round_vec(x)
    }

    /// `n` key elements (any `[.., D]` layout): random, or one fixed row when `tied`.
    fn keys(&mut self, n: usize) -> Vec<f32> {
        if !self.case.tied {
            return self.rand(n, 1.0);
        }
        let d = self.case.d;
        let mut r = rng(self.seed ^ 0x7ded);
        let row = random(&mut r, d, 1.0);
        let row = self.round_vec(row);
        (0..n).map(|i| row[i % d]).collect()
    }

    fn round_vec(&self, x: Vec<f32>) -> Vec<f32> {
        through_storage(&x, self.case.storage)
    }

    pub fn prefill(&mut self, b: usize, p: usize) {
        let (hkv, d, lay) = (self.case.hkv, self.case.d, self.case.layout);
        let k = self.keys(hkv * p * d);
        let v = self.rand(hkv * p * d, 1.0);
        self.cache.prefill(b, &k, &v, lay).unwrap();
        self.refs[b] = DecodeState::new(self.case.hq, hkv, d, self.case.cfg).unwrap();
        for t in 0..p {
            let row = |x: &[f32]| -> Vec<f32> {
                (0..hkv)
                    .flat_map(|h| {
                        let i = lay.index(hkv, p, d, 0, h, t, 0);
                        x[i..i + d].to_vec()
                    })
                    .collect()
            };
            self.refs[b].append(&row(&k), &row(&v)).unwrap();
        }
        assert_eq!(self.cache.len(b).unwrap(), p);
    }

    /// One append-and-step of every sequence (active ones append), checked per sequence.
    pub fn step(&mut self, step: usize) {
        let (bn, hq, hkv, d) = (self.refs.len(), self.case.hq, self.case.hkv, self.case.d);
        let p = self.case.active;
        let active: Vec<bool> = (0..bn).map(|_| self.rng.random_bool(p)).collect();
        let kr = self.keys(bn * hkv * d);
        let vr = self.rand(bn * hkv * d, 1.0);
        let q = self.rand(bn * hq * d, 1.5);
        let o = self
            .cache
            .append_and_step(&kr, &vr, &active, &q, true)
            .unwrap();
        for b in 0..bn {
            if active[b] {
                let r = b * hkv * d..(b + 1) * hkv * d;
                self.refs[b].append(&kr[r.clone()], &vr[r]).unwrap();
            }
            assert_eq!(self.cache.len(b).unwrap(), self.refs[b].len());
            self.check(step, b, &q[b * hq * d..(b + 1) * hq * d], &o);
        }
    }

    pub fn check(&mut self, step: usize, b: usize, q: &[f32], o: &DecodeOutput) {
        let c = &self.case;
        let k = c.cfg.top_k;
        let (hq, hkv, d) = (c.hq, c.hkv, c.d);
        let out = &o.out[b * hq * d..(b + 1) * hq * d];
        let lse = &o.lse[b * hq..(b + 1) * hq];
        let sel = &o.selection.as_ref().unwrap()[b * hkv * k..(b + 1) * hkv * k];
        let st = &self.refs[b];
        let ctx = format!(
            "{} step {step} seq {b} len {} seed {}",
            c.name,
            st.len(),
            self.seed
        );
        if st.is_empty() {
            assert!(out.iter().all(|&x| x == 0.0), "{ctx}: empty output");
            assert!(
                lse.iter().all(|&x| x == f32::NEG_INFINITY),
                "{ctx}: empty lse"
            );
            assert!(sel.iter().all(|&x| x == -1), "{ctx}: empty selection");
            return;
        }
        let r = st.step_detailed(q).unwrap();
        let shape = AttentionShape::new(1, hq, hkv, 1, st.len(), d).unwrap();
        let lay = TensorLayout::Bnhd;
        let mut same = true;
        for h in 0..hkv {
            let (g, want) = (&sel[h * k..(h + 1) * k], &r.selection[h * k..(h + 1) * k]);
            if g != want {
                // The tie margin of `select_pisa` on the same prefix (and of the decode state).
                let prefix = reference::select_pisa(q, st.keys(), &shape, lay, &c.cfg).unwrap();
                let m = prefix.margin[h].min(r.margin[h]);
                assert!(
                    m < TIE && !c.tied,
                    "{ctx}: kv head {h} selection {g:?}, reference {want:?} (margin {m})"
                );
                self.ties += 1;
                same = false;
            }
        }
        let (want_o, want_l) = if same {
            (r.out, r.lse)
        } else {
            reference::sparse_attention(q, st.keys(), st.values(), &shape, lay, &c.cfg, sel)
                .unwrap()
        };
        let tol = match c.storage {
            Storage::F32 | Storage::Bf16 => 1e-4,
            Storage::F16 => 5e-3,
        };
        let e = rel_err(out, &want_o);
        assert!(e <= tol, "{ctx}: output rel err {e}");
        for (x, y) in lse.iter().zip(&want_l) {
            let e = (*x as f64 - y).abs() / (1.0 + y.abs());
            assert!(e <= tol, "{ctx}: lse {x} vs {y}");
        }
    }

    pub fn run(mut self) -> Self {
        for s in 0..self.case.steps {
            self.step(s);
        }
        if self.ties > 0 {
            eprintln!(
                "{}: {} selections differed within the tie margin",
                self.case.name, self.ties
            );
        }
        self
    }
}

pub fn base(name: &'static str, hq: usize, hkv: usize, d: usize, cfg: SelectionConfig) -> Case {
    Case {
        name,
        hq,
        hkv,
        d,
        cfg,
        storage: Storage::F32,
        prefill: vec![37],
        steps: 250,
        layout: TensorLayout::Bhnd,
        active: 1.0,
        tied: false,
    }
}

/// A step with top_k above the workgroup size (K = 300, C = 1, g_q = 1, D = 4) of an empty
/// sequence beside a non-empty one: every one of the empty row's K selection entries is -1
/// (and its output zeros, its LSE -inf), none left as the buffer's poison; the other row as
/// the reference. `fused` pins the path; every step kernel's workgroup is capped at 256
/// invocations (K above it), which also makes the cut count ranks in one part (CPM = 1).
pub fn empty_beside_top_k_past_workgroup(name: &'static str, fused: bool) {
    let mut c = base(name, 1, 1, 4, cfg(1, 300, 2, Scoring::Lse));
    c.prefill = vec![0, 400];
    let mut r = Run::new(c, 400);
    r.cache.set_fused(fused);
    r.cache.set_workgroup_size_limit(256).unwrap();
    assert_eq!(
        r.cache.is_fused(),
        fused,
        "{name}: the fused step does not fit"
    );
    let q = random(&mut r.rng, 2 * 4, 1.0);
    let o = r.cache.step(&q, true).unwrap();
    r.check(0, 0, &q[..4], &o);
    r.check(0, 1, &q[4..], &o);
}
