//! The demo itself, target-independent: load a cut of the embedded real input, run a PISA
//! prefill and a few decode steps on a [`Context`] through the app-facing API (plans, views,
//! recorded appends and steps, [`Context::read_async`]), run the CPU reference on the same
//! input, and report both with timings. Nothing here blocks: in the browser every wait is an
//! `await` on a WebGPU promise.

use pisa_core::reference::{self, DecodeState};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::{
    wgpu, Context, DType, KvCache, LeafOrder, PrefillOptions, PrefillOutputs, PrefillPlan,
    StepOutputs, Storage, TensorView,
};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use web_time::Instant;

/// Largest relative L2 error of O against the f64 reference that counts as equal (f32).
pub const O_TOLERANCE: f64 = 1e-4;
/// Largest |LSE - reference LSE| (natural log) that counts as equal (f32; about 1e-6 seen).
pub const LSE_TOLERANCE: f64 = 1e-4;

/// What to run: the cut of the input and the selection configuration.
/// Parsed from the page's URL parameters: a name not listed here, or a value that is not a
/// count, is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Params {
    /// Tokens of the input (its first `tokens`, at most 4096).
    pub tokens: usize,
    /// KV heads (of 3), each with its 3 query heads.
    pub kv_heads: usize,
    /// Decode steps: the last `steps` tokens are decoded one by one after the first
    /// `tokens - steps` are appended to the cache.
    pub steps: usize,
    /// Leaf block size C.
    pub block_size: usize,
    /// Leaves selected per query K.
    pub top_k: usize,
    /// Pyramid merge factor g.
    pub merge: usize,
    /// Timed prefill runs after the first.
    pub repeats: usize,
    /// Consecutive queries per stage-2 tile (prefill).
    pub q_tile: usize,
    /// Order of selection stage 2 and attention: 0 auto, 1 query tiles, 2 leaf-major; absent:
    /// the context's, the adapter's default (`Tuning::for_adapter`: leaf-major on a browser's
    /// fallback adapter, SwiftShader, which does not finish compiling the query-tile kernel).
    pub leaf_order: Option<usize>,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            tokens: 1024,
            kv_heads: 1,
            steps: 8,
            block_size: 32,
            top_k: 8,
            merge: 2,
            repeats: 3,
            q_tile: 4,
            leaf_order: None,
        }
    }
}

/// The input cut: Q `[1, Hq, N, D]`, K and V `[1, Hkv, N, D]`, f32, BHND.
#[derive(Debug, Clone)]
pub struct Input {
    /// The shape (`q_len == k_len == N`).
    pub shape: AttentionShape,
    /// Softmax scale from the file's metadata.
    pub scale: Option<f32>,
    /// Q, K, V.
    pub q: Vec<f32>,
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
    /// Where it came from.
    pub source: String,
}

/// Reads the first `tokens` tokens of `kv_heads` KV heads (and their query heads) of a
/// safetensors file holding f16 `q` `[Hq, T, D]`, `k`, `v` `[Hkv, T, D]` (the demo input).
pub fn load(bytes: &[u8], p: &Params) -> Result<Input, String> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| format!("the input is not a safetensors file: {e}"))?;
    let meta = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| format!("safetensors header: {e}"))?
        .1;
    let info = meta.metadata().clone().unwrap_or_default();
    let scale = info.get("scale").and_then(|s| s.parse::<f32>().ok());
    let dims = |name: &str| -> Result<[usize; 3], String> {
        let t = st.tensor(name).map_err(|e| format!("tensor {name}: {e}"))?;
        if t.dtype() != safetensors::Dtype::F16 {
            return Err(format!("tensor {name}: {:?}, expected F16", t.dtype()));
        }
        match *t.shape() {
            [h, n, d] => Ok([h, n, d]),
            ref s => Err(format!("tensor {name}: shape {s:?}, expected [H, N, D]")),
        }
    };
    let [hq_all, n_all, d] = dims("q")?;
    let [hkv_all, nk, dk] = dims("k")?;
    if dims("v")? != [hkv_all, nk, dk] || nk != n_all || dk != d || hq_all % hkv_all != 0 {
        return Err("q, k, v shapes do not fit together".into());
    }
    let g = hq_all / hkv_all;
    if p.tokens < 2 || p.tokens > n_all {
        return Err(format!("tokens {}: between 2 and {n_all}", p.tokens));
    }
    if p.kv_heads == 0 || p.kv_heads > hkv_all {
        return Err(format!("kv_heads {}: between 1 and {hkv_all}", p.kv_heads));
    }
    let n = p.tokens;
    let get = |name: &str, heads: usize| -> Result<Vec<f32>, String> {
        let t = st.tensor(name).map_err(|e| format!("tensor {name}: {e}"))?;
        let data = t.data();
        let mut out = Vec::with_capacity(heads * n * d);
        for h in 0..heads {
            let o = h * n_all * d;
            for x in data[2 * o..2 * (o + n * d)].chunks_exact(2) {
                out.push(half::f16::from_le_bytes([x[0], x[1]]).to_f32());
            }
        }
        Ok(out)
    };
    let hkv = p.kv_heads;
    let shape = AttentionShape::prefill(1, g * hkv, hkv, n, d).map_err(|e| e.to_string())?;
    Ok(Input {
        shape,
        scale,
        q: get("q", g * hkv)?,
        k: get("k", hkv)?,
        v: get("v", hkv)?,
        source: format!(
            "{} layer {}, tokens 0..{n} of {n_all}, {} of {hq_all} query heads, {hkv} of {hkv_all} KV heads, D = {d}",
            info.get("model").map(String::as_str).unwrap_or("?"),
            info.get("layer").map(String::as_str).unwrap_or("?"),
            g * hkv,
        ),
    })
}

/// wgpu errors that reached the device's uncaptured-error handler, and a device loss.
pub type Errors = Arc<Mutex<Vec<String>>>;

/// Opens the high-performance adapter and a device of the page's own (with the features pisa
/// uses where the adapter has them, except the experimental cooperative matrices, and the
/// adapter's limits), with an uncaptured-error handler and a device-lost callback that collect
/// what they get into the returned [`Errors`], and hands it to pisa ([`Context::from_device`]).
pub async fn open() -> Result<(Context, Errors), String> {
    open_with(|limits| limits).await
}

/// [`open`] with the device's limits `limits(adapter's limits)` (a device of fewer resources
/// than its adapter offers, as some browsers give).
pub async fn open_with(
    limits: impl FnOnce(wgpu::Limits) -> wgpu::Limits,
) -> Result<(Context, Errors), String> {
    let adapter = pisa_wgpu::instance()
        .request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("no WebGPU adapter: {e}"))?;
    let features =
        pisa_wgpu::wanted_features(&adapter) - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("pisa-web"),
            required_features: features,
            required_limits: limits(adapter.limits()),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("requesting a device: {e}"))?;
    let errors: Errors = Default::default();
    let sink = errors.clone();
    device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
        let mut v = sink.lock().unwrap_or_else(|p| p.into_inner());
        let m = e.to_string();
        if v.len() < 16 && !v.contains(&m) {
            v.push(m);
        }
    }));
    let sink = errors.clone();
    device.set_device_lost_callback(move |reason, msg| {
        sink.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("device lost ({reason:?}): {msg}"));
    });
    let ctx = Context::from_device(&adapter, device, queue).map_err(err)?;
    Ok((ctx, errors))
}

/// The adapter and what it offers.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterInfo {
    /// Adapter name (may be empty in browsers that hide it).
    pub name: String,
    /// wgpu backend (BrowserWebGpu in a browser).
    pub backend: String,
    /// Device type.
    pub device_type: String,
    /// Driver / description.
    pub driver: String,
    /// SHADER_F16 on the device.
    pub shader_f16: bool,
    /// SUBGROUP on the adapter.
    pub subgroups: bool,
    /// TIMESTAMP_QUERY on the device.
    pub timestamps: bool,
    /// The kernel family pisa runs: "portable" or "coopmat".
    pub kernel_path: String,
    /// The order of selection stage 2 and attention (Auto, Tiles, Leaves).
    pub leaf_order: String,
    /// Storage precision of the demo.
    pub storage: String,
    /// Plain-language notes on missing features.
    pub notes: Vec<String>,
}

/// The adapter report of `ctx`.
pub fn adapter_info(ctx: &Context) -> AdapterInfo {
    let r = ctx.report();
    let mut notes = Vec::new();
    if !ctx.has_f16() {
        notes.push(
            "no shader-f16 on this adapter: f16 storage is unavailable, the f32 path runs"
                .to_string(),
        );
    } else {
        notes.push("shader-f16 available; this demo runs f32 storage (the precision the check is specified in)".to_string());
    }
    if !r.subgroups {
        notes.push(
            "subgroups are not available to pisa here (not reported through wgpu): the portable kernels, which do not need them, run"
                .to_string(),
        );
    }
    if !ctx.has_timestamps() {
        notes.push(
            "no timestamp-query: times are wall-clock times on the page (submit to readback)"
                .to_string(),
        );
    }
    let path = match ctx.kernel_path() {
        pisa_wgpu::KernelPath::Portable => "portable",
        pisa_wgpu::KernelPath::CoopMat => "coopmat",
    };
    AdapterInfo {
        name: r.name.clone(),
        backend: r.backend.clone(),
        device_type: r.device_type.clone(),
        driver: [r.driver.as_str(), r.driver_info.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" "),
        shader_f16: ctx.has_f16(),
        subgroups: r.subgroups,
        timestamps: ctx.has_timestamps(),
        kernel_path: path.into(),
        leaf_order: format!("{:?}", ctx.leaf_order()),
        storage: "f32".into(),
        notes,
    }
}

/// One comparison against the CPU reference.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Check {
    /// (query, KV head) selection rows equal to the reference's.
    pub rows_equal: usize,
    /// Rows compared.
    pub rows: usize,
    /// The first differing rows: (row, GPU, reference, reference margin).
    pub differing: Vec<(usize, Vec<i32>, Vec<i32>, f64)>,
    /// Relative L2 error of O against the f64 reference (on the GPU's selection).
    pub o_rel_err: f64,
    /// Largest |LSE - reference LSE|.
    pub lse_max_abs: f64,
}

impl Check {
    /// Whether the GPU's results equal the reference's (selection rows equal, O within
    /// [`O_TOLERANCE`], the LSE within [`LSE_TOLERANCE`]; a NaN fails both comparisons).
    pub fn pass(&self) -> bool {
        self.rows > 0
            && self.rows_equal == self.rows
            && self.o_rel_err <= O_TOLERANCE
            && self.lse_max_abs <= LSE_TOLERANCE
    }

    fn rows(&mut self, gpu: &[i32], want: &[i32], margins: &[f64], k: usize) {
        for (r, (a, b)) in gpu.chunks(k).zip(want.chunks(k)).enumerate() {
            self.rows += 1;
            if a == b {
                self.rows_equal += 1;
            } else if self.differing.len() < 8 {
                let m = margins.get(r).copied().unwrap_or(f64::NAN);
                self.differing.push((r, a.to_vec(), b.to_vec(), m));
            }
        }
    }
}

/// Timings, milliseconds (wall clock on the page: from recording to the readback's resolve).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Times {
    /// Opening the adapter and device.
    pub open_ms: f64,
    /// `PrefillPlan::new` (pipelines, buffers, bind groups).
    pub plan_ms: f64,
    /// The first prefill run, recorded, submitted and read back (O, LSE, selection).
    pub prefill_first_ms: f64,
    /// The fastest of the later runs.
    pub prefill_best_ms: f64,
    /// GPU time of the last run, from timestamp queries (`Profiler::finish_async`), summed
    /// over its stages; `None` where the adapter has no `timestamp-query`.
    pub prefill_gpu_ms: Option<f64>,
    /// That run's stages, `(stage, ms)`.
    pub prefill_gpu_stages: Vec<(String, f64)>,
    /// `KvCache::new`.
    pub cache_ms: f64,
    /// The prefix appended token by token (one submission).
    pub prefix_ms: f64,
    /// Each decode step: append + step, submitted and read back.
    pub step_ms: Vec<f64>,
    /// CPU reference (wasm, f64): selection of the prefill.
    pub cpu_select_ms: f64,
    /// CPU reference: sparse attention of the prefill.
    pub cpu_attention_ms: f64,
    /// CPU reference: the decode (appends and steps).
    pub cpu_decode_ms: f64,
}

/// Everything the page shows and the browser test checks.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Whether every check passed.
    pub ok: bool,
    /// The adapter.
    pub adapter: AdapterInfo,
    /// The input cut.
    pub input: String,
    /// The parameters.
    pub params: Params,
    /// The configuration in words.
    pub config: String,
    /// Prefill against the reference.
    pub prefill: Check,
    /// Decode steps against the reference (no rows where skipped).
    pub decode: Check,
    /// Why the decode did not run, where the device cannot hold a decode cache (a
    /// [`pisa_wgpu::GpuError::Limit`] of `KvCache::new`, e.g. fewer than 9 storage buffers per
    /// shader stage, WebGPU's default being 8); the prefill is still checked and reported.
    pub decode_skipped: Option<String>,
    /// Timings.
    pub times: Times,
    /// wgpu errors reported by the device (validation, a lost device); any fails the run.
    pub errors: Vec<String>,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Relative L2 error of `a` against `b`.
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let (mut n, mut d) = (0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        n += (x as f64 - y).powi(2);
        d += y * y;
    }
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    (n / d.max(1e-300)).sqrt()
}

/// Largest |a - b|; infinite where one is NaN or infinite and the other not (equal infinities,
/// -inf for an empty row, count as equal).
fn max_abs(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
        if x as f64 == y {
            m
        } else {
            let d = (x as f64 - y).abs();
            m.max(if d.is_nan() { f64::INFINITY } else { d })
        }
    })
}

/// The selection configuration of `p` with the input's scale.
pub fn config(p: &Params, input: &Input) -> Result<SelectionConfig, String> {
    let cfg = SelectionConfig::new(p.block_size, p.top_k)
        .map_err(err)?
        .with_merge_factor(p.merge)
        .with_scale(input.scale);
    cfg.validate().map_err(err)?;
    Ok(cfg)
}

struct Buffers<'a> {
    ctx: &'a Context,
}

impl Buffers<'_> {
    fn make(&self, label: &str, bytes: usize) -> wgpu::Buffer {
        self.ctx.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(4).next_multiple_of(4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }
    fn upload(&self, label: &str, data: &[f32]) -> wgpu::Buffer {
        let b = self.make(label, data.len() * 4);
        self.ctx
            .queue()
            .write_buffer(&b, 0, bytemuck::cast_slice(data));
        b
    }
}

fn view(b: &wgpu::Buffer, dt: DType, shape: [usize; 4]) -> Result<TensorView, String> {
    TensorView::contiguous(b, 0, dt, shape, TensorLayout::Bhnd).map_err(err)
}

async fn read_f32(ctx: &Context, v: &TensorView) -> Result<Vec<f32>, String> {
    let b = ctx.read_async(v).await.map_err(err)?;
    Ok(bytemuck::pod_collect_to_vec(&b))
}

async fn read_i32(ctx: &Context, v: &TensorView) -> Result<Vec<i32>, String> {
    let b = ctx.read_async(v).await.map_err(err)?;
    Ok(bytemuck::pod_collect_to_vec(&b))
}

/// Token-major rows `[N, H, D]` of a BHND tensor `[1, H, N, D]`.
fn token_major(x: &[f32], h: usize, n: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for hi in 0..h {
        for t in 0..n {
            let (s, o) = ((hi * n + t) * d, (t * h + hi) * d);
            out[o..o + d].copy_from_slice(&x[s..s + d]);
        }
    }
    out
}

/// Runs the prefill and the decode on `ctx` and the CPU reference, and compares them.
/// `progress` gets a line per phase.
pub async fn run(
    ctx: &Context,
    errors: &Errors,
    input: &Input,
    p: &Params,
    open_ms: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<Report, String> {
    let s = input.shape;
    let (hq, hkv, n, d) = (s.q_heads, s.kv_heads, s.q_len, s.head_dim);
    if p.steps == 0 || p.steps >= n {
        return Err(format!("steps {}: between 1 and {}", p.steps, n - 1));
    }
    let cfg = config(p, input)?;
    if let Some(order) = p.leaf_order {
        ctx.set_leaf_order(match order {
            0 => LeafOrder::Auto,
            1 => LeafOrder::Tiles,
            2 => LeafOrder::Leaves,
            x => {
                return Err(format!(
                    "leaf_order {x}: 0 (auto), 1 (query tiles) or 2 (leaf-major)"
                ))
            }
        });
    }
    let k_top = cfg.top_k;
    let mut times = Times {
        open_ms,
        ..Default::default()
    };
    let bufs = Buffers { ctx };

    // 1. Prefill through a plan on the page's own buffers.
    progress("prefill: planning (pipelines, buffers)");
    let t = Instant::now();
    let opts = PrefillOptions {
        cfg,
        layout: TensorLayout::Bhnd,
        storage: Storage::F32,
        q_tile: p.q_tile,
        return_selection: true,
    };
    let plan = PrefillPlan::new(ctx, &s, &opts).map_err(err)?;
    times.plan_ms = ms(t);
    let (qb, kb, vb) = (
        bufs.upload("q", &input.q),
        bufs.upload("k", &input.k),
        bufs.upload("v", &input.v),
    );
    let ob = bufs.make("o", hq * n * d * 4);
    let lb = bufs.make("lse", hq * n * 4);
    let sb = bufs.make("selection", hkv * n * k_top * 4);
    let (qv, kv, vv) = (
        view(&qb, DType::F32, [1, hq, n, d])?,
        view(&kb, DType::F32, [1, hkv, n, d])?,
        view(&vb, DType::F32, [1, hkv, n, d])?,
    );
    let (ov, lv, sv) = (
        view(&ob, DType::F32, [1, hq, n, d])?,
        view(&lb, DType::F32, [1, hq, n, 1])?,
        view(&sb, DType::I32, [1, hkv, n, k_top])?,
    );
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    let mut result = None;
    for run in 0..=p.repeats {
        progress(&format!("prefill: run {} of {}", run + 1, p.repeats + 1));
        let t = Instant::now();
        // The last run timed on the GPU too (stages from timestamp queries, read back without
        // blocking the page).
        let mut prof = (run == p.repeats).then(|| pisa_wgpu::Profiler::new(ctx, 64));
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        plan.run(&mut enc, &qv, &kv, &vv, &outs, prof.as_mut())
            .map_err(err)?;
        ctx.queue().submit([enc.finish()]);
        let o = read_f32(ctx, &ov).await?;
        let l = read_f32(ctx, &lv).await?;
        let sel = read_i32(ctx, &sv).await?;
        let took = ms(t);
        // (the time is informational: a failed readback of it is a note, not a failed run;
        // the browser test fails where the adapter has timestamps and no time came back)
        if let Some(prof) = prof {
            match prof.finish_async(ctx).await {
                Ok(st) if st.gpu => {
                    times.prefill_gpu_ms = Some(st.total());
                    times.prefill_gpu_stages = st.stages;
                }
                Ok(_) => {}
                Err(e) => progress(&format!("prefill: GPU time not read: {e}")),
            }
        }
        if run == 0 {
            times.prefill_first_ms = took;
            result = Some((o, l, sel));
        } else if run == 1 || took < times.prefill_best_ms {
            times.prefill_best_ms = took;
        }
    }
    let (o_gpu, lse_gpu, sel_gpu) = result.ok_or("no prefill run")?;

    progress("prefill: CPU reference (selection)");
    let t = Instant::now();
    let want =
        reference::select_pisa(&input.q, &input.k, &s, TensorLayout::Bhnd, &cfg).map_err(err)?;
    times.cpu_select_ms = ms(t);
    progress("prefill: CPU reference (attention)");
    let t = Instant::now();
    let (o_ref, lse_ref) = reference::sparse_attention(
        &input.q,
        &input.k,
        &input.v,
        &s,
        TensorLayout::Bhnd,
        &cfg,
        &sel_gpu,
    )
    .map_err(err)?;
    times.cpu_attention_ms = ms(t);
    let mut prefill = Check::default();
    prefill.rows(&sel_gpu, &want.indices, &want.margin, k_top);
    prefill.o_rel_err = rel_err(&o_gpu, &o_ref);
    prefill.lse_max_abs = max_abs(&lse_gpu, &lse_ref);

    // 2. Decode: the first P tokens appended one by one (recorded appends, one submission),
    // then `steps` tokens each appended and stepped, one submission and readback per step.
    let prefix = n - p.steps;
    progress(&format!(
        "decode: cache of {n} tokens, appending {prefix} tokens"
    ));
    let t = Instant::now();
    let mut cache = match KvCache::new(ctx, 1, n, hq, hkv, d, cfg, Storage::F32) {
        Ok(cache) => cache,
        Err(e @ pisa_wgpu::GpuError::Limit { .. }) => {
            let why = format!("this device cannot hold a decode cache: {e}");
            progress(&format!("decode skipped: {why}"));
            let decode = Check::default();
            return Ok(report(
                ctx,
                errors,
                input,
                p,
                &cfg,
                prefill,
                decode,
                Some(why),
                times,
            ));
        }
        Err(e) => return Err(err(e)),
    };
    times.cache_ms = ms(t);
    let (k_rows, v_rows, q_rows) = (
        token_major(&input.k, hkv, n, d),
        token_major(&input.v, hkv, n, d),
        token_major(&input.q, hq, n, d),
    );
    let (kall, vall, qall) = (
        bufs.upload("k rows", &k_rows),
        bufs.upload("v rows", &v_rows),
        bufs.upload("q rows", &q_rows),
    );
    let (kvb, qrow) = ((hkv * d * 4) as u64, (hq * d * 4) as u64);
    let (kst, vst, qst) = (
        bufs.make("k step", kvb as usize),
        bufs.make("v step", kvb as usize),
        bufs.make("q step", qrow as usize),
    );
    let (kstv, vstv, qstv) = (
        view(&kst, DType::F32, [1, hkv, 1, d])?,
        view(&vst, DType::F32, [1, hkv, 1, d])?,
        view(&qst, DType::F32, [1, hq, 1, d])?,
    );
    // The step's outputs, packed in one buffer (each part at an aligned offset) read once.
    let align = ctx.limits().min_storage_buffer_offset_alignment.max(4) as usize;
    let up = |x: usize| x.next_multiple_of(align);
    let (o_bytes, l_bytes, s_bytes) = (hq * d * 4, hq * 4, hkv * k_top * 4);
    let (o_at, l_at, s_at) = (0, up(o_bytes), up(o_bytes) + up(l_bytes));
    let res = bufs.make("step outputs", s_at + s_bytes);
    let part = |at: usize, dt, shape| {
        TensorView::contiguous(&res, at as u64, dt, shape, TensorLayout::Bhnd).map_err(err)
    };
    let (sov, slv, ssv) = (
        part(o_at, DType::F32, [1, hq, 1, d])?,
        part(l_at, DType::F32, [1, hq, 1, 1])?,
        part(s_at, DType::I32, [1, hkv, 1, k_top])?,
    );
    let resv = view(&res, DType::F32, [1, 1, 1, (s_at + s_bytes) / 4])?;
    let step_outs = StepOutputs {
        out: &sov,
        lse: &slv,
        selection: Some(&ssv),
    };
    let copy_token = |enc: &mut wgpu::CommandEncoder, t: usize| {
        let t = t as u64;
        enc.copy_buffer_to_buffer(&kall, t * kvb, &kst, 0, kvb);
        enc.copy_buffer_to_buffer(&vall, t * kvb, &vst, 0, kvb);
    };
    let t = Instant::now();
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    for tok in 0..prefix {
        copy_token(&mut enc, tok);
        cache
            .record_append_view(&mut enc, &kstv, &vstv, &[true], None)
            .map_err(err)?;
    }
    ctx.queue().submit([enc.finish()]);
    read_f32(ctx, &kstv).await?; // resolves after the appends ran
    times.prefix_ms = ms(t);

    let mut dec_gpu: Vec<(Vec<f32>, Vec<f32>, Vec<i32>)> = Vec::new();
    for tok in prefix..n {
        progress(&format!("decode: step {} of {}", tok - prefix + 1, p.steps));
        let t = Instant::now();
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        copy_token(&mut enc, tok);
        cache
            .record_append_view(&mut enc, &kstv, &vstv, &[true], None)
            .map_err(err)?;
        enc.copy_buffer_to_buffer(&qall, tok as u64 * qrow, &qst, 0, qrow);
        cache
            .record_step_into(&mut enc, &qstv, Some(&step_outs), None)
            .map_err(err)?;
        ctx.queue().submit([enc.finish()]);
        let bytes = ctx.read_async(&resv).await.map_err(err)?;
        times.step_ms.push(ms(t));
        let f: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        let i: Vec<i32> = bytemuck::pod_collect_to_vec(&bytes);
        dec_gpu.push((
            f[o_at / 4..o_at / 4 + hq * d].to_vec(),
            f[l_at / 4..l_at / 4 + hq].to_vec(),
            i[s_at / 4..s_at / 4 + hkv * k_top].to_vec(),
        ));
    }

    progress("decode: CPU reference");
    let t = Instant::now();
    let mut state = DecodeState::new(hq, hkv, d, cfg).map_err(err)?;
    let mut decode = Check::default();
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for tok in 0..n {
        let r = |x: &[f32], h: usize| x[tok * h * d..(tok + 1) * h * d].to_vec();
        state
            .append(&r(&k_rows, hkv), &r(&v_rows, hkv))
            .map_err(err)?;
        if tok < prefix {
            continue;
        }
        let want = state.step_detailed(&r(&q_rows, hq)).map_err(err)?;
        let (o, l, sel) = &dec_gpu[tok - prefix];
        decode.rows(sel, &want.selection, &want.margin, k_top);
        for (&x, &y) in o.iter().zip(&want.out) {
            num += (x as f64 - y).powi(2);
            den += y * y;
        }
        decode.lse_max_abs = decode.lse_max_abs.max(max_abs(l, &want.lse));
    }
    decode.o_rel_err = (num / den.max(1e-300)).sqrt();
    times.cpu_decode_ms = ms(t);

    Ok(report(
        ctx, errors, input, p, &cfg, prefill, decode, None, times,
    ))
}

/// The report of a run: `ok` when the prefill and (unless skipped) the decode pass and the
/// device reported no error.
#[allow(clippy::too_many_arguments)] // the parts of the report
fn report(
    ctx: &Context,
    errors: &Errors,
    input: &Input,
    p: &Params,
    cfg: &SelectionConfig,
    prefill: Check,
    decode: Check,
    decode_skipped: Option<String>,
    times: Times,
) -> Report {
    let d = input.shape.head_dim;
    let errors = errors.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Report {
        ok: prefill.pass() && (decode_skipped.is_some() || decode.pass()) && errors.is_empty(),
        errors,
        adapter: adapter_info(ctx),
        input: input.source.clone(),
        params: *p,
        config: format!(
            "C = {}, K = {}, g = {}, scoring {:?}, causal, scale {}",
            cfg.block_size,
            cfg.top_k,
            cfg.merge_factor,
            cfg.scoring,
            cfg.softmax_scale(d)
        ),
        prefill,
        decode,
        decode_skipped,
        times,
    }
}
