//! Shared helpers of the GPU tests: one context per test binary, seeded random inputs (the
//! seed is printed, and `PISA_SEED` replays it), and comparison with stated tolerances.
#![allow(dead_code)]

use std::sync::OnceLock;

use pisa_wgpu::{AdapterChoice, Context};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The context all tests of a binary share (lavapipe in CI).
pub fn ctx() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| {
        Context::new(&AdapterChoice::HighPerformance)
            .expect("a GPU adapter (install mesa-vulkan-drivers)")
    })
}

/// Serialises the tests of one binary that change the shared context's settings (kernel path,
/// stage-2 order): hold the guard while setting and using them, so a parallel test cannot switch
/// them in between and let a case run on another path than it names.
pub fn settings_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fresh seed (time-based) unless `PISA_SEED` is set; printed so a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let s = std::env::var("PISA_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: seed {s} (replay with PISA_SEED={s})");
    s
}

/// A seeded generator.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in [-scale, scale] (never all zero).
pub fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Values rounded through f16 (what f16 storage holds), so the CPU reference sees the same input.
pub fn through_f16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// `v` rounded to bf16 (nearest even) and back: the values bf16 storage holds.
#[allow(dead_code)]
pub fn through_bf16(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

/// `v` as the 16-bit storage `storage` holds it (unchanged for f32).
#[allow(dead_code)]
pub fn through_storage(v: &[f32], storage: pisa_wgpu::Storage) -> Vec<f32> {
    match storage {
        pisa_wgpu::Storage::F32 => v.to_vec(),
        pisa_wgpu::Storage::F16 => through_f16(v),
        pisa_wgpu::Storage::Bf16 => through_bf16(v),
    }
}

/// The worst error of `got` = C = A B^T (A `[m, k]`, B `[n, k]`, C `[m, n]`, row-major) against
/// the f64 product of `a` and `b`, relative to the sum of the |products| of the element (so
/// cancellation does not inflate it), and where it is. A NaN (an unwritten, poisoned element)
/// counts as infinitely wrong.
#[allow(dead_code)]
pub fn worst_gemm_error(
    a: &[f32],
    b: &[f32],
    got: &[f32],
    (m, n, k): (usize, usize, usize),
) -> (f64, usize) {
    let (mut worst, mut at) = (0f64, 0);
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut mag) = (0f64, 0f64);
            for t in 0..k {
                let p = a[i * k + t] as f64 * b[j * k + t] as f64;
                s += p;
                mag += p.abs();
            }
            let e = (got[i * n + j] as f64 - s).abs() / mag.max(1e-30);
            let e = if e.is_nan() { f64::INFINITY } else { e };
            if e > worst {
                worst = e;
                at = i * n + j;
            }
        }
    }
    (worst, at)
}

/// Relative error `||a - b|| / ||b||` (L2); panics on NaN (poison left unwritten shows here).
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.is_finite(),
            "element {i} is {x} (unwritten or overflow), reference {y}"
        );
        num += (x as f64 - y) * (x as f64 - y);
        den += y * y;
    }
    (num / den.max(1e-300)).sqrt()
}

/// naga parses and validates `src` (every capability enabled, as for the cooperative-matrix
/// shaders) and writes SPIR-V 1.3 for each compute entry point in `entries` (the path wgpu takes
/// on Vulkan); panics naming `what` with naga's message otherwise.
pub fn assert_spirv(what: &str, src: &str, entries: &[&str]) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(src)));
    let mut val = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    );
    let info = val
        .validate(&module)
        .unwrap_or_else(|e| panic!("{what}: {}", e.emit_to_string(src)));
    let opts = naga::back::spv::Options {
        lang_version: (1, 3),
        ..Default::default()
    };
    for entry in entries {
        let pipe = naga::back::spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: (*entry).into(),
        };
        let words = naga::back::spv::write_vec(&module, &info, &opts, Some(&pipe))
            .unwrap_or_else(|e| panic!("{what} {entry}: {e}"));
        assert!(words.len() > 100, "{what} {entry}: {} words", words.len());
    }
}

/// A compute pipeline of WGSL text `wgsl` (entry `entry`, layout derived from it) built with
/// shader runtime checks `checks` (wgpu's default is `ShaderRuntimeChecks::checked()`; the
/// library's own pipelines use `Context::shader_checks`), for tests
/// that run a shader of their own.
pub fn compute_pipeline(
    label: &str,
    wgsl: &str,
    entry: &str,
    checks: wgpu::ShaderRuntimeChecks,
) -> wgpu::ComputePipeline {
    let dev = ctx().device();
    let desc = wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(wgsl.into()),
    };
    // SAFETY: the checks are the caller's choice, as with wgpu's own default; the tests'
    // shaders index only buffers their hosts size for them.
    let module = unsafe { dev.create_shader_module_trusted(desc, checks) };
    dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// A bind group of `pipe`'s group 0 binding each `(binding, buffer)` whole.
pub fn bind_group(
    pipe: &wgpu::ComputePipeline,
    entries: &[(u32, &wgpu::Buffer)],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = (entries.iter())
        .map(|&(binding, b)| wgpu::BindGroupEntry {
            binding,
            resource: b.as_entire_binding(),
        })
        .collect();
    ctx()
        .device()
        .create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        })
}

/// Reports a test (or case) skipped for want of `msg`'s hardware on stderr, unless the run
/// requires the NVIDIA path (`PISA_REQUIRE_NV_CM2=1`, set by the GPU runs of the test
/// binaries): such a device has tensor cores, timestamps and the `VK_NV_cooperative_matrix2`
/// kernels, so a skip there is a failure (the test would otherwise pass having run nothing).
pub fn skip_unless_required(msg: &str) {
    assert!(
        std::env::var("PISA_REQUIRE_NV_CM2").as_deref() != Ok("1"),
        "{msg} (PISA_REQUIRE_NV_CM2=1: this device must run it)"
    );
    eprintln!("{msg}: SKIPPED");
}

/// Tie tolerance on a reference margin (natural-log score units summed over the g_q heads of the
/// group): the f32 GPU arithmetic differs from the f64 reference by about
/// `eps_f32 * sqrt(D) * |s q.k|` per score, so a row may legitimately differ only where the
/// margin is below `2e-5 (4e-5 for f16 storage) * g_q * (1 + s * max|q| * max|k| * sqrt(D))`.
pub fn tie_tol(
    gq: usize,
    d: usize,
    scale: f64,
    q: &[f32],
    k: &[f32],
    storage: pisa_wgpu::Storage,
) -> f64 {
    use pisa_wgpu::Storage;
    let amax = |v: &[f32]| v.iter().fold(0f64, |m, &x| m.max(x.abs() as f64));
    let per_head = match storage {
        // bf16 inputs are widened exactly: f32 arithmetic as for f32 storage.
        Storage::F32 | Storage::Bf16 => 2e-5,
        Storage::F16 => 4e-5,
    };
    per_head * gq as f64 * (1.0 + scale * amax(q) * amax(k) * (d as f64).sqrt())
}

/// [`tie_tol`] of a case's shape and configuration.
pub fn tie_tol_of(
    shape: &pisa_core::AttentionShape,
    cfg: &pisa_core::SelectionConfig,
    q: &[f32],
    k: &[f32],
    storage: pisa_wgpu::Storage,
) -> f64 {
    let d = shape.head_dim;
    let scale = cfg.softmax_scale(d) as f64;
    tie_tol(shape.gqa_group(), d, scale, q, k, storage)
}

/// Compares `got`, rows of `kk`-wide selections, with the reference `want` row by row. A row
/// that differs is accepted only where the reference's K-th and (K+1)-th scores tie within
/// `tol` (its `margin`: a near-tie that f32 rounding may flip) and the GPU row is still a
/// valid selection (as many leaves as the reference's, ascending, so no repeats, then -1
/// padding); anything else panics, naming the case `what`. Returns the rows accepted as ties.
pub fn check_rows(
    what: &str,
    got: &[i32],
    want: &pisa_core::reference::Selection,
    kk: usize,
    tol: f64,
) -> usize {
    assert_eq!(got.len(), want.rows() * kk, "{what}: selection length");
    let mut ties = 0;
    for r in 0..want.rows() {
        let (g, w) = (&got[r * kk..(r + 1) * kk], want.row(r));
        if g == w {
            continue;
        }
        let m = want.margin[r];
        let count = |x: &[i32]| x.iter().filter(|&&v| v >= 0).count();
        let ascending = g[..count(g)].windows(2).all(|p| p[0] < p[1]);
        assert!(
            m < tol && count(g) == count(w) && ascending && g[count(g)..].iter().all(|&v| v == -1),
            "{what}: row {r}: gpu {g:?} reference {w:?}, reference margin {m:.3e} (tie tolerance {tol:.1e})"
        );
        ties += 1;
    }
    ties
}

/// [`check_rows`], and near-ties rare: at most 5% of the rows (of at least 20) may be
/// accepted as ties. Returns their count.
pub fn check_selection_ties(
    what: &str,
    got: &[i32],
    want: &pisa_core::reference::Selection,
    kk: usize,
    tol: f64,
) -> usize {
    let ties = check_rows(what, got, want, kk, tol);
    assert!(
        ties * 20 <= want.rows().max(20),
        "{what}: {ties} ties out of {} rows",
        want.rows()
    );
    ties
}

/// An application's buffer holding `bytes` (whole 4-byte words, at least one), usable as
/// storage, written and read back.
pub fn bytes_buffer(ctx: &Context, label: &str, bytes: &[u8]) -> pisa_wgpu::wgpu::Buffer {
    use pisa_wgpu::wgpu;
    assert!(
        bytes.len().is_multiple_of(4),
        "{label}: {} bytes",
        bytes.len()
    );
    let b = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.len().max(4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    ctx.queue().write_buffer(&b, 0, bytes);
    b
}

/// An application's buffer holding `data` (f32), usable as storage, written and read back.
pub fn app_buffer(ctx: &Context, data: &[f32]) -> pisa_wgpu::wgpu::Buffer {
    bytes_buffer(ctx, "app", bytemuck::cast_slice(data))
}

/// The contiguous f32 BHND view of `shape` at byte 0 of `b`.
pub fn bhnd_f32(b: &pisa_wgpu::wgpu::Buffer, shape: [usize; 4]) -> pisa_wgpu::TensorView {
    pisa_wgpu::TensorView::contiguous(
        b,
        0,
        pisa_wgpu::DType::F32,
        shape,
        pisa_core::TensorLayout::Bhnd,
    )
    .unwrap()
}

/// A storage buffer holding `data` in the dtype of `st` after `pad` bytes of 0x5A (and 64 more
/// after it, rounded to whole words).
pub fn storage_buffer(
    ctx: &Context,
    pad: usize,
    data: &[f32],
    st: pisa_wgpu::Storage,
) -> pisa_wgpu::wgpu::Buffer {
    use pisa_wgpu::Storage;
    let mut bytes = vec![0x5Au8; pad];
    match st {
        Storage::F16 => {
            let h: Vec<u16> = (data.iter().map(|&v| half::f16::from_f32(v).to_bits())).collect();
            bytes.extend_from_slice(bytemuck::cast_slice(&h));
        }
        Storage::Bf16 => {
            let h: Vec<u16> = (data.iter().map(|&v| half::bf16::from_f32(v).to_bits())).collect();
            bytes.extend_from_slice(bytemuck::cast_slice(&h));
        }
        Storage::F32 => bytes.extend_from_slice(bytemuck::cast_slice(data)),
    }
    bytes.resize(bytes.len().div_ceil(4) * 4 + 64, 0x5A);
    bytes_buffer(ctx, "app", &bytes)
}

/// BHND `[B, H, N, D]` data re-laid as BNHD.
pub fn to_bnhd(x: &[f32], b: usize, h: usize, n: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for t in 0..n {
                let s = ((bi * h + hi) * n + t) * d;
                let o = ((bi * n + t) * h + hi) * d;
                out[o..o + d].copy_from_slice(&x[s..s + d]);
            }
        }
    }
    out
}

/// The real activations the tests read: layer 15 of SmolLM2-135M in the repository's demo input
/// (f16 `q`, `k`, `v`), and the shared capture beside the repository (bf16 `layer{i}.q` ...,
/// `../shared/data`, not in it).
pub const DEMO_INPUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../data/demo-smollm2-layer15-4096.safetensors"
);
/// See [`DEMO_INPUT`].
pub const SHARED_CAPTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/smollm2-rustbook-8k.safetensors"
);

/// Tensors `names` of the safetensors file `path` (f16 or bf16 `[H, tokens, D]`): the first `n`
/// tokens of the heads `heads[i]` of each, as f32 `[1, H, n, D]` (Bhnd). Panics when the file, a
/// tensor or its dtype is missing or wrong.
pub fn real_tensors(
    path: &str,
    names: &[(&str, std::ops::Range<usize>)],
    n: usize,
) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path} not readable ({e})"));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors file");
    let get = |name: &str, heads: &std::ops::Range<usize>| {
        let t = st.tensor(name).expect("tensor present");
        let [_, tokens, d] = t.shape() else {
            panic!("{name}: shape {:?}", t.shape())
        };
        let value: fn([u8; 2]) -> f32 = match t.dtype() {
            safetensors::Dtype::BF16 => |b| half::bf16::from_le_bytes(b).to_f32(),
            safetensors::Dtype::F16 => |b| half::f16::from_le_bytes(b).to_f32(),
            other => panic!("{name}: dtype {other:?}"),
        };
        let data = t.data();
        let mut out = Vec::with_capacity(heads.len() * n * d);
        for hi in heads.clone() {
            let o = hi * tokens * d;
            out.extend(
                data[2 * o..2 * (o + n * d)]
                    .chunks_exact(2)
                    .map(|x| value([x[0], x[1]])),
            );
        }
        out
    };
    names.iter().map(|(name, heads)| get(name, heads)).collect()
}
