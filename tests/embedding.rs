//! pisa embedded in an application that owns its wgpu instance, device, queue and buffers
//! (`Context::from_device`, `TensorView`): a varlen prefill read straight from one packed QKV
//! buffer (at a non-zero offset, three sequences of lengths that are not multiples of the block
//! size) into the application's O / LSE / selection buffers, then a batched decode loop whose
//! appended K/V, queries and outputs all live in the application's buffers; every result
//! against pisa-core's CPU reference. Also: the cache's own step outputs read by the
//! application through their public views (`KvCache::outputs`); misused tensors come back as
//! typed errors (`GpuError::View`, and `GpuError::Validation` for a buffer of another device);
//! a destroyed device of the application's gives `GpuError::DeviceLost`, and the probe that
//! notices it runs once per public call.
//!
//! Tie rule (as tests/prefill.rs and tests/decode_harness.rs): a selection row may differ from
//! the reference's only where the reference's margin is within rounding (`common::tie_tol`); the output is
//! then compared with the reference attention over the GPU's own selection.
mod common;

use common::{check_selection_ties, random, rel_err, rng, seed, tie_tol_of};
use pisa_core::reference::{select_pisa, sparse_attention, DecodeState};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use pisa_wgpu::ops::decode::{ChunkOutputs, KvCache, StepOutputs};
use pisa_wgpu::ops::prefill::{
    PlanViews, PrefillOptions, PrefillOutputs, PrefillPlan, VarlenPrefillPlan,
};
use pisa_wgpu::{wgpu, Context, DType, GpuError, Storage, TensorView};

const TOL: f64 = 1e-4;
const HQ: usize = 6;
const HKV: usize = 2;
const D: usize = 32;
const LENS: [usize; 3] = [150, 97, 230];
const ROW: usize = (HQ + 2 * HKV) * D;
/// Bytes before the packed QKV rows in the application's buffer.
const PAD: u64 = 256;
const STEPS: usize = 64;

fn cfg() -> SelectionConfig {
    SelectionConfig::new(32, 4).unwrap()
}

/// A planned prefill of `n` tokens of the tests' heads and head dim, with its shape and options.
fn plan_of(ctx: &Context, n: usize) -> (AttentionShape, PrefillOptions, PrefillPlan) {
    let shape = AttentionShape::prefill(1, HQ, HKV, n, D).unwrap();
    let opts = PrefillOptions {
        cfg: cfg(),
        ..Default::default()
    };
    let plan = PrefillPlan::new(ctx, &shape, &opts).unwrap();
    (shape, opts, plan)
}

/// The message of a caught panic, where it is a string.
fn panic_text(p: &(dyn std::any::Any + Send)) -> Option<&str> {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or(p.downcast_ref::<&str>().copied())
}

/// Runs `f` and checks that it returns `GpuError::Validation`: not `Ok`, another error, or a
/// panic inside wgpu (`what` names the call in the failure).
fn expect_validation<T: std::fmt::Debug>(what: &str, f: impl FnOnce() -> Result<T, GpuError>) {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Err(GpuError::Validation { .. })) => {}
        Ok(other) => panic!("{what}: {other:?}"),
        Err(p) => panic!("{what} panicked inside wgpu: {:?}", panic_text(&*p)),
    }
}

/// The application: its own instance, adapter, device and queue, and pisa's context on them.
struct App {
    instance: wgpu::Instance,
    adapter: wgpu::Adapter,
    device: wgpu::Device,
    queue: wgpu::Queue,
    ctx: Context,
}

fn open_device(adapter: &wgpu::Adapter) -> (wgpu::Device, wgpu::Queue) {
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("app"),
        required_features: pisa_wgpu::wanted_features(adapter)
            - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("a device (install mesa-vulkan-drivers)")
}

impl App {
    fn new() -> Self {
        // The application's own instance (each test its own: wgpu-hal's GL backend shares one
        // EGL context among the devices of an instance, which threads cannot use at once).
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        if wgpu::Backends::from_env().is_none() {
            desc.backends = wgpu::Backends::PRIMARY;
        }
        let instance = wgpu::Instance::new(desc);
        let adapter = pollster::block_on(instance.request_adapter(&Default::default()))
            .expect("a GPU adapter (install mesa-vulkan-drivers)");
        let (device, queue) = open_device(&adapter);
        let ctx = Context::from_device(&adapter, device.clone(), queue.clone()).unwrap();
        assert!(!ctx.owns_device());
        Self {
            instance,
            adapter,
            device,
            queue,
            ctx,
        }
    }

    fn buffer(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// Fills `buf` with 0xFF bytes (NaN as f32).
    fn poison(&self, buf: &wgpu::Buffer) {
        self.queue
            .write_buffer(buf, 0, &vec![0xFFu8; buf.size() as usize]);
    }

    /// Fills `buf` with i32::MIN words: no selection entry (an index or the -1 padding) is
    /// that, so an entry left unwritten shows.
    fn poison_i32(&self, buf: &wgpu::Buffer) {
        let words = vec![i32::MIN; buf.size() as usize / 4];
        self.queue
            .write_buffer(buf, 0, bytemuck::cast_slice(&words));
    }

    /// `bytes` bytes of `buf` from `offset`, through the application's own staging buffer.
    fn read(&self, buf: &wgpu::Buffer, offset: u64, bytes: u64) -> Vec<u8> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("app staging"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| tx.send(r).unwrap());
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .unwrap();
        rx.recv().unwrap().unwrap();
        let out = slice.get_mapped_range().unwrap().to_vec();
        staging.unmap();
        out
    }

    fn read_f32(&self, buf: &wgpu::Buffer, offset: u64, n: usize) -> Vec<f32> {
        bytemuck::cast_slice(&self.read(buf, offset, n as u64 * 4)).to_vec()
    }

    fn read_i32(&self, buf: &wgpu::Buffer, offset: u64, n: usize) -> Vec<i32> {
        bytemuck::cast_slice(&self.read(buf, offset, n as u64 * 4)).to_vec()
    }

    fn align(&self) -> u64 {
        self.device.limits().min_storage_buffer_offset_alignment as u64
    }
}

/// Start of each sequence in the packed batch (cumulative lengths).
fn cu_lens() -> [usize; 4] {
    let mut cu = [0; 4];
    for i in 0..3 {
        cu[i + 1] = cu[i] + LENS[i];
    }
    cu
}

/// The application's packed QKV buffer: `PAD` bytes, then rows `[total, (Hq + 2 Hkv) * D]`.
struct Packed {
    buf: wgpu::Buffer,
    host: Vec<f32>,
    total: usize,
}

impl Packed {
    fn new(app: &App, r: &mut rand_chacha::ChaCha8Rng) -> Self {
        let total: usize = LENS.iter().sum();
        let host = random(r, total * ROW, 1.0);
        let buf = app.buffer("qkv", PAD + (total * ROW * 4) as u64);
        app.poison(&buf);
        app.queue
            .write_buffer(&buf, PAD, bytemuck::cast_slice(&host));
        Self { buf, host, total }
    }

    /// Part 0 (Q), 1 (K) or 2 (V) of the rows `cu .. cu + len` as a `[1, H, len, D]` view.
    fn view(&self, part: usize, cu: usize, len: usize) -> TensorView {
        let (col, h) = [(0, HQ), (HQ * D, HKV), ((HQ + HKV) * D, HKV)][part];
        let t = self.total;
        TensorView::new(
            &self.buf,
            PAD + (col * 4) as u64,
            DType::F32,
            [1, h, t, D],
            [t * ROW, D, ROW, 1],
        )
        .unwrap()
        .tokens(cu, len)
        .unwrap()
    }

    /// The same part on the host, `[1, H, len, D]` row-major (BHND).
    fn host(&self, part: usize, cu: usize, len: usize) -> Vec<f32> {
        let (col, h) = [(0, HQ), (HQ * D, HKV), ((HQ + HKV) * D, HKV)][part];
        let mut x = Vec::with_capacity(h * len * D);
        for hh in 0..h {
            for t in cu..cu + len {
                let o = t * ROW + col + hh * D;
                x.extend_from_slice(&self.host[o..o + D]);
            }
        }
        x
    }
}

#[test]
fn app_owned_device_varlen_prefill_and_decode() {
    let app = App::new();
    let seed = seed("embedding");
    let mut r = rng(seed);
    let cfg = cfg();
    let kk = cfg.top_k;
    let cu = cu_lens();
    let qkv = Packed::new(&app, &mut r);
    let total = qkv.total;

    // Prefill: outputs in the application's buffers, O [total, Hq, D], LSE [total, Hq],
    // selection [seq][1, Hkv, len, K] packed one sequence after another.
    let o_buf = app.buffer("o", (total * HQ * D * 4) as u64);
    let lse_buf = app.buffer("lse", (total * HQ * 4) as u64);
    let sel_buf = app.buffer("selection", (total * HKV * kk * 4) as u64);
    for b in [&o_buf, &lse_buf] {
        app.poison(b);
    }
    app.poison_i32(&sel_buf);
    let o_all = TensorView::new(
        &o_buf,
        0,
        DType::F32,
        [1, HQ, total, D],
        [total * HQ * D, D, HQ * D, 1],
    )
    .unwrap();
    let lse_all = TensorView::new(
        &lse_buf,
        0,
        DType::F32,
        [1, HQ, total, 1],
        [total * HQ, 1, HQ, 1],
    )
    .unwrap();
    let opts = PrefillOptions {
        cfg,
        return_selection: true,
        ..Default::default()
    };
    let mut enc = app.device.create_command_encoder(&Default::default());
    let mut plans = Vec::new();
    for i in 0..3 {
        let shape = AttentionShape::prefill(1, HQ, HKV, LENS[i], D).unwrap();
        let (q, k, v) = (
            qkv.view(0, cu[i], LENS[i]),
            qkv.view(1, cu[i], LENS[i]),
            qkv.view(2, cu[i], LENS[i]),
        );
        // Rows of ROW * 4 = 1280 bytes (a multiple of 256) after PAD = 256 bytes: every view
        // starts on a binding boundary of any device (the limit is at most 256), so the kernels
        // read the packed buffer in place, without a gather, and the plan needs no staging. O
        // rows of Hq * D * 4 = 768 bytes from byte 0 of their own buffer: written in place too.
        let out = o_all.tokens(cu[i], LENS[i]).unwrap();
        let views = PlanViews {
            q: &q,
            k: &k,
            v: &v,
            out: Some(&out),
        };
        let plan = PrefillPlan::new_in_place(&app.ctx, &shape, &opts, &views).unwrap();
        let sel = TensorView::contiguous(
            &sel_buf,
            (cu[i] * HKV * kk * 4) as u64,
            DType::I32,
            [1, HKV, LENS[i], kk],
            TensorLayout::Bhnd,
        )
        .unwrap();
        let outs = PrefillOutputs {
            out: &out,
            lse: &lse_all.tokens(cu[i], LENS[i]).unwrap(),
            selection: Some(&sel),
        };
        for view in [&q, &k, &v] {
            assert!(
                plan.reads_in_place(view),
                "sequence {i}: a packed view is gathered"
            );
        }
        plan.run(&mut enc, &q, &k, &v, &outs, None).unwrap();
        plans.push(plan);
    }
    app.queue.submit([enc.finish()]);
    let o_got = app.read_f32(&o_buf, 0, total * HQ * D);
    let lse_got = app.read_f32(&lse_buf, 0, total * HQ);
    let sel_got = app.read_i32(&sel_buf, 0, total * HKV * kk);
    let mut ties = 0;
    for i in 0..3 {
        let n = LENS[i];
        let shape = AttentionShape::prefill(1, HQ, HKV, n, D).unwrap();
        let (q, k, v) = (
            qkv.host(0, cu[i], n),
            qkv.host(1, cu[i], n),
            qkv.host(2, cu[i], n),
        );
        let want = select_pisa(&q, &k, &shape, TensorLayout::Bhnd, &cfg).unwrap();
        let sel = &sel_got[cu[i] * HKV * kk..cu[i + 1] * HKV * kk];
        let tie = tie_tol_of(&shape, &cfg, &q, &k, Storage::F32);
        ties += check_selection_ties(&format!("seq {i} (seed {seed})"), sel, &want, kk, tie);
        let (o_ref, lse_ref) =
            sparse_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, &cfg, sel).unwrap();
        // The application's [total, Hq, D] rows of this sequence, as BHND.
        let mut o = Vec::with_capacity(HQ * n * D);
        let mut lse = Vec::with_capacity(HQ * n);
        for h in 0..HQ {
            for t in cu[i]..cu[i + 1] {
                let at = (t * HQ + h) * D;
                o.extend_from_slice(&o_got[at..at + D]);
                lse.push(lse_got[t * HQ + h]);
            }
        }
        let e = rel_err(&o, &o_ref);
        assert!(e < TOL, "seq {i}: O rel err {e} (seed {seed})");
        let e = rel_err(&lse, &lse_ref);
        assert!(e < TOL, "seq {i}: LSE rel err {e} (seed {seed})");
    }
    eprintln!("prefill: {ties} selection rows differ within a tie");
    drop(plans);
    // Decode steps of the prefilled sequences (no append), outputs in the application's buffers.
    decode(&app, &qkv, &mut r, seed, 8, false);
}

#[test]
fn app_owned_decode_loop_with_appends() {
    let app = App::new();
    let seed = seed("embedding decode");
    let mut r = rng(seed);
    let qkv = Packed::new(&app, &mut r);
    decode(&app, &qkv, &mut r, seed, STEPS, true);
}

/// A decode batch of the three sequences, K/V loaded from the packed buffer (`prefill_view`),
/// then `steps` steps whose K/V rows (appended when `append`), queries and outputs are in the
/// application's buffers, each checked against one reference `DecodeState` per sequence.
fn decode(
    app: &App,
    qkv: &Packed,
    r: &mut rand_chacha::ChaCha8Rng,
    seed: u64,
    steps: usize,
    append: bool,
) {
    let cfg = cfg();
    let kk = cfg.top_k;
    let cu = cu_lens();
    // Decode: a batch of the three sequences, K/V loaded from the same packed buffer.
    let capacity = LENS.iter().max().unwrap() + steps;
    let mut cache = KvCache::new(&app.ctx, 3, capacity, HQ, HKV, D, cfg, Storage::F32).unwrap();
    let mut refs: Vec<DecodeState> = (0..3)
        .map(|_| DecodeState::new(HQ, HKV, D, cfg).unwrap())
        .collect();
    for i in 0..3 {
        let n = LENS[i];
        cache
            .prefill_view(i, &qkv.view(1, cu[i], n), &qkv.view(2, cu[i], n))
            .unwrap();
        let (k, v) = (qkv.host(1, cu[i], n), qkv.host(2, cu[i], n));
        for t in 0..n {
            let row = |x: &[f32]| -> Vec<f32> {
                (0..HKV)
                    .flat_map(|h| x[(h * n + t) * D..(h * n + t + 1) * D].to_vec())
                    .collect()
            };
            refs[i].append(&row(&k), &row(&v)).unwrap();
        }
        assert_eq!(cache.len(i).unwrap(), n);
    }
    // The application's step buffers: inputs K, V [3, Hkv, 1, D] and Q [3, Hq, 1, D], outputs
    // O [3, Hq, 1, D], LSE [3, Hq, 1, 1], selection [3, Hkv, 1, K], each at an aligned
    // (non-zero) offset.
    let a = app.align().max(4);
    let slot = (3 * HQ * D * 4).div_ceil(a as usize) as u64 * a;
    let at = |i: u64| (i + 1) * slot;
    let in_buf = app.buffer("step in", at(3));
    let out_buf = app.buffer("step out", at(3));
    let view = |buf, off, h, dd, dt| {
        TensorView::contiguous(buf, off, dt, [3, h, 1, dd], TensorLayout::Bhnd).unwrap()
    };
    let (kv_, vv_, qv_) = (
        view(&in_buf, at(0), HKV, D, DType::F32),
        view(&in_buf, at(1), HKV, D, DType::F32),
        view(&in_buf, at(2), HQ, D, DType::F32),
    );
    let (ov, lv, sv) = (
        view(&out_buf, at(0), HQ, D, DType::F32),
        view(&out_buf, at(1), HQ, 1, DType::F32),
        view(&out_buf, at(2), HKV, kk, DType::I32),
    );
    let outs = StepOutputs {
        out: &ov,
        lse: &lv,
        selection: Some(&sv),
    };
    // An LSE of another float dtype is refused, naming the LSE (a step writes it in f32).
    let l16 = view(&out_buf, at(1), HQ, 1, DType::F16);
    let bad = StepOutputs { lse: &l16, ..outs };
    let mut enc = app.device.create_command_encoder(&Default::default());
    let e = cache
        .record_step_into(&mut enc, &qv_, Some(&bad), None)
        .unwrap_err();
    assert!(
        matches!(e, GpuError::View(ref m) if m.contains("decode lse: must be f32")),
        "{e}"
    );
    let mut dec_ties = 0;
    for step in 0..steps {
        let kr = random(r, 3 * HKV * D, 1.0);
        let vr = random(r, 3 * HKV * D, 1.0);
        let q = random(r, 3 * HQ * D, 1.5);
        app.poison(&out_buf);
        app.queue
            .write_buffer(&in_buf, at(0), bytemuck::cast_slice(&kr));
        app.queue
            .write_buffer(&in_buf, at(1), bytemuck::cast_slice(&vr));
        app.queue
            .write_buffer(&in_buf, at(2), bytemuck::cast_slice(&q));
        let mut enc = app.device.create_command_encoder(&Default::default());
        if append {
            cache
                .record_append_view(&mut enc, &kv_, &vv_, &[true; 3], None)
                .unwrap();
        }
        cache
            .record_step_into(&mut enc, &qv_, Some(&outs), None)
            .unwrap();
        app.queue.submit([enc.finish()]);
        let o = app.read_f32(&out_buf, at(0), 3 * HQ * D);
        let lse = app.read_f32(&out_buf, at(1), 3 * HQ);
        let sel = app.read_i32(&out_buf, at(2), 3 * HKV * kk);
        for b in 0..3 {
            let rows = b * HKV * D..(b + 1) * HKV * D;
            if append {
                refs[b].append(&kr[rows.clone()], &vr[rows]).unwrap();
            }
            assert_eq!(cache.len(b).unwrap(), refs[b].len());
            let st = &refs[b];
            let qb = &q[b * HQ * D..(b + 1) * HQ * D];
            let want = st.step_detailed(qb).unwrap();
            let shape = AttentionShape::new(1, HQ, HKV, 1, st.len(), D).unwrap();
            let lay = TensorLayout::Bnhd;
            let sel_b = &sel[b * HKV * kk..(b + 1) * HKV * kk];
            let mut same = true;
            for h in 0..HKV {
                let (g, w) = (
                    &sel_b[h * kk..(h + 1) * kk],
                    &want.selection[h * kk..(h + 1) * kk],
                );
                if g != w {
                    let prefix = select_pisa(qb, st.keys(), &shape, lay, &cfg).unwrap();
                    let m = prefix.margin[h].min(want.margin[h]);
                    let tie = tie_tol_of(&shape, &cfg, qb, st.keys(), Storage::F32);
                    assert!(
                        m < tie,
                        "step {step} seq {b} kv head {h}: selection {g:?}, reference {w:?} \
                         (margin {m}, seed {seed})"
                    );
                    dec_ties += 1;
                    same = false;
                }
            }
            let (want_o, want_l) = if same {
                (want.out, want.lse)
            } else {
                sparse_attention(qb, st.keys(), st.values(), &shape, lay, &cfg, sel_b).unwrap()
            };
            let e = rel_err(&o[b * HQ * D..(b + 1) * HQ * D], &want_o);
            assert!(
                e <= TOL,
                "step {step} seq {b}: output rel err {e} (seed {seed})"
            );
            for (x, y) in lse[b * HQ..(b + 1) * HQ].iter().zip(&want_l) {
                let e = (*x as f64 - y).abs() / (1.0 + y.abs());
                assert!(
                    e <= TOL,
                    "step {step} seq {b}: lse {x} vs {y} (seed {seed})"
                );
            }
        }
    }
    eprintln!("decode: {dec_ties} selections differ within a tie");
}

#[test]
fn misused_views_are_typed_errors() {
    let app = App::new();
    let cfg = cfg();
    // A buffer without STORAGE usage.
    let plain = app.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("not storage"),
        size: 4096,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let e = TensorView::contiguous(&plain, 0, DType::F32, [1, 1, 4, D], TensorLayout::Bhnd);
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
    // A view past the buffer's end, directly and by a token range.
    let buf = app.buffer("small", 4096);
    let e = TensorView::contiguous(&buf, 256, DType::F32, [1, 1, 32, D], TensorLayout::Bhnd);
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
    let ok = TensorView::contiguous(&buf, 0, DType::F32, [1, 1, 32, D], TensorLayout::Bhnd);
    let v = ok.unwrap();
    let e = v.tokens(20, 13);
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
    // A range whose end overflows says where it starts and how long it is.
    match v.tokens(usize::MAX, 2) {
        Err(GpuError::View(m)) => assert!(
            m.contains(&format!("from {}, 2 of them", usize::MAX)),
            "{m}"
        ),
        e => panic!("{e:?}"),
    }
    // A decode output at an offset the device cannot bind in place is written through the
    // cache's own and a scatter, as a query there is gathered: both accepted (the values are
    // checked by tests/decode.rs, step_outputs_that_cannot_be_bound_are_scattered).
    let cache = KvCache::new(&app.ctx, 3, 64, HQ, HKV, D, cfg, Storage::F32).unwrap();
    let a = app.align();
    let big = app.buffer("step", 2 * a + (3 * HQ * D * 4) as u64);
    if a > 4 {
        let at = |off: u64, shape| {
            TensorView::contiguous(&big, off, DType::F32, shape, TensorLayout::Bhnd).unwrap()
        };
        let q = at(a + 4, [3, HQ, 1, D]);
        let mut enc = app.device.create_command_encoder(&Default::default());
        cache.record_step_into(&mut enc, &q, None, None).unwrap();
        let (ob, lb) = (
            app.buffer("step out", 4 + (3 * HQ * D * 4) as u64),
            app.buffer("step lse", (3 * HQ * 4) as u64),
        );
        let o = TensorView::contiguous(&ob, 4, DType::F32, [3, HQ, 1, D], TensorLayout::Bhnd);
        let lse = TensorView::contiguous(&lb, 0, DType::F32, [3, HQ, 1, 1], TensorLayout::Bhnd);
        let (o, lse) = (o.unwrap(), lse.unwrap());
        let outs = StepOutputs {
            out: &o,
            lse: &lse,
            selection: None,
        };
        cache
            .record_step_into(&mut enc, &q, Some(&outs), None)
            .unwrap();
    } else {
        eprintln!("min_storage_buffer_offset_alignment is {a}: every f32 offset binds");
    }
    // A query of the wrong shape.
    let q =
        TensorView::contiguous(&big, 0, DType::F32, [3, HKV, 1, D], TensorLayout::Bhnd).unwrap();
    let mut enc = app.device.create_command_encoder(&Default::default());
    let e = cache.record_step_into(&mut enc, &q, None, None);
    assert!(matches!(e, Err(GpuError::View(_))), "{e:?}");
}

/// The cache's own step outputs (`KvCache::outputs`) are public views that describe their
/// buffers (shape, dtype, BHND from the view's offset) well enough for the application to copy
/// them with its own commands: the application's copy of each view's bytes is bitwise the
/// step's own read-back.
#[test]
fn cache_outputs_are_views_the_app_can_read() {
    let app = App::new();
    let cfg = cfg();
    let b = 3;
    let mut r = rng(seed("cache outputs"));
    let mut cache = KvCache::new(&app.ctx, b, 64, HQ, HKV, D, cfg, Storage::F32).unwrap();
    for s in 0..b {
        let n = 40 + 7 * s;
        let (k, v) = (
            random(&mut r, HKV * n * D, 1.0),
            random(&mut r, HKV * n * D, 1.0),
        );
        cache.prefill(s, &k, &v, TensorLayout::Bhnd).unwrap();
    }
    let q = random(&mut r, b * HQ * D, 1.5);
    let want = cache.step(&q, true).unwrap();
    let outs = cache.outputs();
    let sel = outs.selection.expect("the cache's selection view");
    let described = [
        (outs.out, [b, HQ, 1, D], DType::F32),
        (outs.lse, [b, HQ, 1, 1], DType::F32),
        (sel, [b, HKV, 1, cfg.top_k], DType::I32),
    ];
    for (view, shape, dtype) in described {
        assert_eq!((view.shape(), view.dtype()), (shape, dtype));
        assert_eq!(view.contiguous_layout(), Some(TensorLayout::Bhnd));
    }
    // The application's own copy of each view's byte range.
    let app_words = |v: &TensorView| -> Vec<u32> {
        let bytes = v.elems() as u64 * v.dtype().bytes();
        bytemuck::cast_slice(&app.read(v.buffer(), v.offset(), bytes)).to_vec()
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(app_words(outs.out), bits(&want.out));
    assert_eq!(app_words(outs.lse), bits(&want.lse));
    let want_sel = want.selection.unwrap();
    assert_eq!(app_words(sel), bytemuck::cast_slice::<i32, u32>(&want_sel));
    assert!(want_sel.iter().any(|&x| x >= 0), "{want_sel:?}");
}

/// An application's device opened without `MEMORY_DECORATION_COHERENT` on an adapter that has
/// it: the context's report gives the device's feature flags, not the adapter's, and a cache
/// asked for the one-dispatch decode step (`decode_merge_in_route`, with `route_leaf` allowed
/// everywhere) runs the two dispatches there, where the same cache on a device with the feature
/// runs one (on a Vulkan adapter with it: lavapipe in CI, asserted there so that the test cannot
/// pass without its case; off Vulkan both run two).
#[test]
fn app_device_without_coherent_memory_decodes_in_two_dispatches() {
    let app = App::new();
    let coherent = wgpu::Features::MEMORY_DECORATION_COHERENT;
    let info = app.adapter.get_info();
    // (lavapipe: llvmpipe on Vulkan; CI also runs these tests on llvmpipe through wgpu's GL
    // backend, where the one dispatch does not run)
    let lavapipe = info.name.contains("llvmpipe") && info.backend == wgpu::Backend::Vulkan;
    if lavapipe {
        assert!(
            app.adapter.features().contains(coherent),
            "lavapipe lost the feature"
        );
    }
    let mut t = pisa_wgpu::Tuning::default();
    t.decode_route_workgroups = 4096;
    t.decode_merge_in_route = true;
    let (device, queue) = pollster::block_on(app.adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("app without coherent memory"),
        required_features: pisa_wgpu::wanted_features(&app.adapter)
            - wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
            - coherent,
        required_limits: app.adapter.limits(),
        ..Default::default()
    }))
    .unwrap();
    let plain = Context::from_device_with_tuning(&app.adapter, device, queue, t.clone()).unwrap();
    assert!(
        !plain.report().memory_coherent,
        "the report kept the adapter's feature"
    );
    assert!(plain.one_dispatch_decode().is_err());
    assert_eq!(
        plain.report().one_dispatch_decode(),
        plain.one_dispatch_decode()
    );
    let full =
        Context::from_device_with_tuning(&app.adapter, app.device.clone(), app.queue.clone(), t)
            .unwrap();
    assert_eq!(
        full.report().memory_coherent,
        app.adapter.features().contains(coherent)
    );
    let cache = |ctx: &Context| KvCache::new(ctx, 2, 200, HQ, HKV, D, cfg(), Storage::F32).unwrap();
    assert!(!cache(&plain).merges_in_route());
    assert_eq!(
        cache(&full).merges_in_route(),
        full.one_dispatch_decode().is_ok()
    );
    if lavapipe {
        assert!(
            cache(&full).merges_in_route(),
            "no one-dispatch step to compare with"
        );
    }
}

/// A destroyed device of the application's (`Context::from_device`: no device-lost callback of
/// pisa's on it): pisa's later calls, the recording ones of a plan and a cache made before
/// included, return `GpuError::DeviceLost`, neither a validation error about invalid objects
/// nor a panic in wgpu's default uncaptured-error handler (the application here installs none),
/// and the application's own device-lost callback still runs.
#[test]
fn destroyed_app_device_gives_device_lost() {
    let app = App::new();
    let cfg = cfg();
    let n = 40;
    let (shape, opts, plan) = plan_of(&app.ctx, n);
    let mut cache = KvCache::new(&app.ctx, 3, 64, HQ, HKV, D, cfg, Storage::F32).unwrap();
    let own = app.buffer("own", (HQ * n * D * 4) as u64);
    let own_lse = app.buffer("own lse", (HQ * n * 4) as u64);
    let view = |b, shape| TensorView::contiguous(b, 0, DType::F32, shape, TensorLayout::Bhnd);
    let (x, kv, lse) = (
        view(&own, [1, HQ, n, D]).unwrap(),
        view(&own, [1, HKV, n, D]).unwrap(),
        view(&own_lse, [1, HQ, n, 1]).unwrap(),
    );
    let q1 = view(&own, [3, HQ, 1, D]).unwrap();
    let (hkv_rows, q_rows) = (vec![0.1; 3 * HKV * D], vec![0.1; 3 * HQ * D]);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen2 = seen.clone();
    app.device.set_device_lost_callback(move |reason, _| {
        *seen2.lock().unwrap() = Some(reason);
    });
    app.device.destroy();
    let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut enc = app.device.create_command_encoder(&Default::default());
        let outs = PrefillOutputs {
            out: &x,
            lse: &lse,
            selection: None,
        };
        let run = plan.run(&mut enc, &x, &kv, &kv, &outs, None);
        let record = cache.record_step_into(&mut enc, &q1, None, None);
        let step = cache.append_and_step(&hkv_rows, &hkv_rows, &[true; 3], &q_rows, true);
        vec![
            ("PrefillPlan::run", run),
            ("record_step_into", record),
            ("append_and_step", step.map(|_| ())),
            ("check_alive", app.ctx.check_alive()),
            ("read_bytes", app.ctx.read_bytes(&own).map(|_| ())),
            (
                "KvCache::new",
                KvCache::new(&app.ctx, 3, 64, HQ, HKV, D, cfg, Storage::F32).map(|_| ()),
            ),
            (
                "PrefillPlan::new",
                PrefillPlan::new(&app.ctx, &shape, &opts).map(|_| ()),
            ),
        ]
    }))
    .unwrap_or_else(|p| {
        panic!(
            "a call on the destroyed device panicked: {:?}",
            panic_text(&*p)
        )
    });
    for (what, r) in results {
        match r {
            Err(GpuError::DeviceLost(m)) => assert!(m.contains("lost or destroyed"), "{m}"),
            other => panic!("{what} on the destroyed device: {other:?}, not DeviceLost"),
        }
    }
    assert!(
        matches!(
            *seen.lock().unwrap(),
            Some(wgpu::DeviceLostReason::Destroyed)
        ),
        "the application's device-lost callback did not run"
    );
}

/// `f()`, checking that it probed the application's device for its loss once.
fn probed_once<T>(ctx: &Context, what: &str, f: impl FnOnce() -> T) -> T {
    let before = ctx.device_probes();
    let out = f();
    assert_eq!(ctx.device_probes() - before, 1, "device probes of {what}");
    out
}

/// The application's device is probed for its loss (a queue write in an error scope) once per
/// public call, however many allocations, uploads, dispatches, gathers, scatters and reads the
/// call makes: a plan's making and a run that gathers its inputs and scatters its output, a
/// varlen run that makes its sequences' plans on the way, a decode cache's making, loading,
/// append, step and host step, a read, and the stage-level selection and backward.
#[test]
fn one_device_probe_per_public_call() {
    let app = App::new();
    let ctx = &app.ctx;
    let n = 40;
    let (_, opts, plan) = probed_once(ctx, "PrefillPlan::new", || plan_of(ctx, n));
    // Q, K, V at a 4-byte offset (gathered) and a BNHD O (scattered).
    let qkv = app.buffer("qkv", 4 + (HQ * n * D * 4) as u64);
    let o_buf = app.buffer("o", (HQ * n * D * 4) as u64);
    let lse_buf = app.buffer("lse", (HQ * n * 4) as u64);
    let view = |b, off, h, dd, layout| {
        TensorView::contiguous(b, off, DType::F32, [1, h, n, dd], layout).unwrap()
    };
    let (q, k) = (
        view(&qkv, 4, HQ, D, TensorLayout::Bhnd),
        view(&qkv, 4, HKV, D, TensorLayout::Bhnd),
    );
    let (o, lse) = (
        view(&o_buf, 0, HQ, D, TensorLayout::Bnhd),
        view(&lse_buf, 0, HQ, 1, TensorLayout::Bhnd),
    );
    assert!(!plan.reads_in_place(&q));
    let outs = PrefillOutputs {
        out: &o,
        lse: &lse,
        selection: None,
    };
    let mut enc = app.device.create_command_encoder(&Default::default());
    probed_once(ctx, "PrefillPlan::run", || {
        plan.run(&mut enc, &q, &k, &k, &outs, None).unwrap()
    });
    // Three sequences of the packed buffer, each with its own plan made in the run.
    let packed = Packed::new(&app, &mut rng(seed("embedding probes")));
    let total = packed.total;
    let varlen = VarlenPrefillPlan::new(ctx, HQ, HKV, D, &opts).unwrap();
    let vo_buf = app.buffer("varlen o", (HQ * total * D * 4) as u64);
    let vl_buf = app.buffer("varlen lse", (HQ * total * 4) as u64);
    let vview = |b, h, dd| {
        TensorView::contiguous(b, 0, DType::F32, [1, h, total, dd], TensorLayout::Bhnd).unwrap()
    };
    let (vo, vl) = (vview(&vo_buf, HQ, D), vview(&vl_buf, HQ, 1));
    let vouts = PrefillOutputs {
        out: &vo,
        lse: &vl,
        selection: None,
    };
    let [vq, vk, vv] = [0, 1, 2].map(|part| packed.view(part, 0, total));
    probed_once(ctx, "VarlenPrefillPlan::run", || {
        varlen
            .run(&mut enc, &cu_lens(), &vq, &vk, &vv, &vouts, None)
            .unwrap()
    });
    app.queue.submit([enc.finish()]);
    // A decode cache of the three sequences.
    let mut cache = probed_once(ctx, "KvCache::new", || {
        KvCache::new(ctx, 3, 256, HQ, HKV, D, opts.cfg, Storage::F32).unwrap()
    });
    let (ck, cv) = (packed.view(1, 0, LENS[0]), packed.view(2, 0, LENS[0]));
    probed_once(ctx, "KvCache::prefill_view", || {
        cache.prefill_view(0, &ck, &cv).unwrap()
    });
    let step = app.buffer("step", (3 * HQ * D * 4) as u64);
    let row =
        |h| TensorView::contiguous(&step, 0, DType::F32, [3, h, 1, D], TensorLayout::Bhnd).unwrap();
    let (kr, qr) = (row(HKV), row(HQ));
    let mut enc = app.device.create_command_encoder(&Default::default());
    probed_once(ctx, "KvCache::record_append_view", || {
        cache
            .record_append_view(&mut enc, &kr, &kr, &[true; 3], None)
            .unwrap()
    });
    probed_once(ctx, "KvCache::record_step_into", || {
        cache.record_step_into(&mut enc, &qr, None, None).unwrap()
    });
    app.queue.submit([enc.finish()]);
    let (k_rows, q_rows) = (vec![0.1; 3 * HKV * D], vec![0.1; 3 * HQ * D]);
    probed_once(ctx, "KvCache::append_and_step", || {
        cache
            .append_and_step(&k_rows, &k_rows, &[true; 3], &q_rows, true)
            .unwrap()
    });
    let lse_bytes = probed_once(ctx, "Context::read_bytes", || {
        ctx.read_bytes(&lse_buf).unwrap()
    });
    assert!(bytemuck::cast_slice::<u8, f32>(&lse_bytes)
        .iter()
        .all(|x| x.is_finite()));
    // The stage-level operations (hidden from the docs, used by tests and benchmarks) too.
    use pisa_wgpu::ops::{backward::backward_host, select::select_host, select::Method};
    let shape = AttentionShape::prefill(1, HQ, HKV, n, D).unwrap();
    let mut r = rng(seed("embedding stage probes"));
    let [q, k, v, o, d_o] = [HQ, HKV, HKV, HQ, HQ].map(|h| random(&mut r, h * n * D, 1.0));
    let lse = random(&mut r, HQ * n, 1.0);
    let (lay, st) = (TensorLayout::Bhnd, Storage::F32);
    let sel = probed_once(ctx, "select::select_host", || {
        select_host(ctx, &q, &k, &shape, lay, &opts.cfg, st, Method::Pisa, 4).unwrap()
    });
    probed_once(ctx, "backward::backward_host", || {
        backward_host(
            ctx, &q, &k, &v, &o, &lse, &d_o, &shape, lay, &opts.cfg, st, &sel,
        )
        .unwrap()
    });
}

#[test]
fn buffer_of_another_device_is_a_validation_error() {
    let app = App::new();
    let _ = &app.instance;
    let cfg = cfg();
    // A second device of the same instance and adapter, and a buffer of it.
    let (other, _other_queue) = open_device(&app.adapter);
    let foreign = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device"),
        size: (3 * HQ * D * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let q =
        TensorView::contiguous(&foreign, 0, DType::F32, [3, HQ, 1, D], TensorLayout::Bhnd).unwrap();
    let mut cache = KvCache::new(&app.ctx, 3, 64, HQ, HKV, D, cfg, Storage::F32).unwrap();
    expect_validation("record_step_into with another device's buffer", || {
        let mut enc = app.device.create_command_encoder(&Default::default());
        cache.record_step_into(&mut enc, &q, None, None)
    });
    // The same for a planned prefill reading another device's buffer.
    let n = 40;
    let (_, _, plan) = plan_of(&app.ctx, n);
    let own = app.buffer("own", (HQ * n * D * 4) as u64);
    let lse = app.buffer("own lse", (HQ * n * 4) as u64);
    let fq = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device q"),
        size: (HQ * n * D * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let v = |b, h, dd| {
        TensorView::contiguous(b, 0, DType::F32, [1, h, n, dd], TensorLayout::Bhnd).unwrap()
    };
    let (qv, kv, ov, lv) = (
        v(&fq, HQ, D),
        v(&own, HKV, D),
        v(&own, HQ, D),
        v(&lse, HQ, 1),
    );
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    // Every run: the plan keeps the bind groups of the views it ran on, never an invalid one
    // (a replayed invalid group had made the second run Ok, and the submit fail). And nothing
    // invalid is recorded: a cache's append recorded before the refused run submits cleanly
    // with the encoder, as the cache's docs tell the application to do (the run had set its
    // invalid bind group in the encoder, so the submit failed and the append with it, while
    // the cache's host lengths counted it).
    let rows =
        TensorView::contiguous(&own, 0, DType::F32, [3, HKV, 1, D], TensorLayout::Bhnd).unwrap();
    for run in 0..3 {
        let what = format!("run {run} of a plan with another device's buffer");
        let mut enc = app.device.create_command_encoder(&Default::default());
        cache
            .record_append_view(&mut enc, &rows, &rows, &[true; 3], None)
            .unwrap();
        expect_validation(&what, || plan.run(&mut enc, &qv, &kv, &kv, &outs, None));
        let scope = app.device.push_error_scope(wgpu::ErrorFilter::Validation);
        app.queue.submit([enc.finish()]);
        let err = pollster::block_on(scope.pop());
        assert!(err.is_none(), "submit after {what}: {err:?}");
    }
    // A plan recorded on views that read another device's buffer in place fails the same way
    // (its recording is discarded, not kept).
    let shape = AttentionShape::prefill(1, HQ, HKV, n, D).unwrap();
    let opts = PrefillOptions {
        cfg,
        ..Default::default()
    };
    let views = PlanViews {
        q: &qv,
        k: &kv,
        v: &kv,
        out: None,
    };
    expect_validation("a plan recorded on another device's buffer", || {
        PrefillPlan::new_in_place(&app.ctx, &shape, &opts, &views).map(|_| ())
    });
    // An O of another device that the run would copy into: a typed error, and nothing
    // recorded, so that the commands recorded before it (a cache's append) still submit (the
    // copy, recorded before, failed the submit and every command with it).
    let fo = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device o"),
        size: (HQ * n * D * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let (fov, own_q) = (v(&fo, HQ, D), v(&own, HQ, D));
    let foreign_out = PrefillOutputs {
        out: &fov,
        lse: &lv,
        selection: None,
    };
    let mut enc = app.device.create_command_encoder(&Default::default());
    cache
        .record_append_view(&mut enc, &rows, &rows, &[true; 3], None)
        .unwrap();
    let r = plan.run(&mut enc, &own_q, &kv, &kv, &foreign_out, None);
    assert!(
        matches!(&r, Err(GpuError::Validation { op, .. }) if op.contains("output copy")),
        "{r:?}"
    );
    let scope = app.device.push_error_scope(wgpu::ErrorFilter::Validation);
    app.queue.submit([enc.finish()]);
    let err = pollster::block_on(scope.pop());
    assert!(err.is_none(), "submit after a refused output: {err:?}");
    // The plan still runs on the application's own buffers, and the submit is clean.
    let mut enc = app.device.create_command_encoder(&Default::default());
    plan.run(&mut enc, &own_q, &kv, &kv, &outs, None).unwrap();
    let scope = app.device.push_error_scope(wgpu::ErrorFilter::Validation);
    app.queue.submit([enc.finish()]);
    let err = pollster::block_on(scope.pop());
    assert!(err.is_none(), "submit after the failed runs: {err:?}");
}

/// Reading back a buffer of another device of the same instance (`Context::read_bytes`, and
/// `Context::read_async` of a view of it) is a `GpuError::Validation` of the call, not a panic
/// in wgpu's uncaptured-error handler where the copy's encoder finishes; so is reading a
/// destroyed buffer (refused where the copy is submitted); the context reads its own device's
/// buffers after.
#[test]
fn reading_a_buffer_of_another_device_is_a_validation_error() {
    let app = App::new();
    let (other, _other_queue) = open_device(&app.adapter);
    let foreign = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device"),
        size: 256,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let view =
        TensorView::contiguous(&foreign, 0, DType::F32, [1, 1, 64, 1], TensorLayout::Bhnd).unwrap();
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let read = app.ctx.read_bytes(&foreign);
        // Refused before anything is awaited: ready at its first poll, no device polling needed.
        let mut fut = std::pin::pin!(app.ctx.read_async(&view));
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let read_async = match std::future::Future::poll(fut.as_mut(), &mut cx) {
            std::task::Poll::Ready(r) => r,
            std::task::Poll::Pending => panic!("read_async of another device's buffer waits"),
        };
        [("read_bytes", read), ("read_async", read_async)]
    }))
    .unwrap_or_else(|p| {
        panic!(
            "reading another device's buffer panicked inside wgpu: {:?}",
            panic_text(&*p)
        )
    });
    for (what, r) in got {
        match r {
            Err(GpuError::Validation { .. }) => {}
            other => panic!("{what} of another device's buffer: {other:?}"),
        }
    }
    let own = app.buffer("own", 256);
    app.queue.write_buffer(&own, 0, &[7; 256]);
    assert_eq!(app.ctx.read_bytes(&own).unwrap(), vec![7; 256]);
    // A destroyed buffer of the context's own device: the same (wgpu refuses it where the copy
    // is submitted), and the context still reads after.
    let gone = app.buffer("destroyed", 256);
    let gone_view =
        TensorView::contiguous(&gone, 0, DType::F32, [1, 1, 64, 1], TensorLayout::Bhnd).unwrap();
    gone.destroy();
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let read = app.ctx.read_bytes(&gone);
        let read_async = pollster::block_on(app.ctx.read_async(&gone_view));
        [("read_bytes", read), ("read_async", read_async)]
    }))
    .unwrap_or_else(|p| panic!("reading a destroyed buffer panicked: {:?}", panic_text(&*p)));
    for (what, r) in got {
        match r {
            Err(GpuError::Validation { .. }) => {}
            other => panic!("{what} of a destroyed buffer: {other:?}"),
        }
    }
    assert_eq!(app.ctx.read_bytes(&own).unwrap(), vec![7; 256]);
    // A buffer whose size is not a multiple of 4 (copies are of whole words): a View error
    // that says so, not wgpu's validation message; a 4-byte view of it still reads.
    let odd = app.buffer("6 bytes", 6);
    app.queue.write_buffer(&odd, 0, &[1, 2, 3, 4]);
    match app.ctx.read_bytes(&odd) {
        Err(GpuError::View(m)) if m.contains("multiple of 4") => {}
        other => panic!("read_bytes of a 6-byte buffer: {other:?}"),
    }
    let word = TensorView::contiguous(&odd, 0, DType::F32, [1, 1, 1, 1], TensorLayout::Bhnd);
    let word = pollster::block_on(app.ctx.read_async(&word.unwrap())).unwrap();
    assert_eq!(word, vec![1, 2, 3, 4]);
}

/// An output that a planned prefill only copies into (contiguous BHND of the plan's dtype, in a
/// buffer with `COPY_DST`) in a buffer of another device is refused at the call, as a bound one
/// is, not left to fail when the application finishes the encoder: O, LSE and the selection in
/// turn.
#[test]
fn copied_output_of_another_device_is_a_validation_error() {
    let app = App::new();
    let cfg = cfg();
    let (other, _other_queue) = open_device(&app.adapter);
    let n = 40;
    let (_, _, plan) = plan_of(&app.ctx, n);
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
    let on = |device: &wgpu::Device, label, elems: usize| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (elems * 4) as u64,
            usage,
            mapped_at_creation: false,
        })
    };
    let kk = cfg.top_k;
    let v = |b: &wgpu::Buffer, h, dd, dtype| {
        TensorView::contiguous(b, 0, dtype, [1, h, n, dd], TensorLayout::Bhnd).unwrap()
    };
    let qkv = app.buffer("own qkv", (HQ * n * D * 4) as u64);
    let (q, k) = (v(&qkv, HQ, D, DType::F32), v(&qkv, HKV, D, DType::F32));
    for foreign in ["out", "lse", "selection"] {
        let device = |which| {
            if which == foreign {
                &other
            } else {
                &app.device
            }
        };
        let o = on(device("out"), "o", HQ * n * D);
        let l = on(device("lse"), "lse", HQ * n);
        let s = on(device("selection"), "selection", HKV * n * kk);
        let (ov, lv, sv) = (
            v(&o, HQ, D, DType::F32),
            v(&l, HQ, 1, DType::F32),
            v(&s, HKV, kk, DType::I32),
        );
        let outs = PrefillOutputs {
            out: &ov,
            lse: &lv,
            selection: Some(&sv),
        };
        expect_validation(&format!("{foreign} of another device"), || {
            let mut enc = app.device.create_command_encoder(&Default::default());
            plan.run(&mut enc, &q, &k, &k, &outs, None)
        });
    }
    // The same outputs, all of the application's device, are written.
    let (o, l) = (
        on(&app.device, "o", HQ * n * D),
        on(&app.device, "lse", HQ * n),
    );
    let (ov, lv) = (v(&o, HQ, D, DType::F32), v(&l, HQ, 1, DType::F32));
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    let mut enc = app.device.create_command_encoder(&Default::default());
    plan.run(&mut enc, &q, &k, &k, &outs, None).unwrap();
    app.queue.submit([enc.finish()]);
}

/// The WGSL dump (`Tuning::dump_wgsl`, a diagnostic): a context on the application's device
/// with the defaults builds its pipelines without writing them, even with `PISA_DUMP_WGSL`
/// set (the library reads no variable there); one given the folder in its tuning writes
/// them, as `Context::new` does from the variable; and the folder cannot change on a live
/// context. (No other test of this binary opens a context with `Context::new` or a dump
/// folder, so none writes there meanwhile.)
#[test]
fn wgsl_dump_goes_where_the_tuning_says() {
    let count = |dir: &std::path::Path| std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0);
    let base = std::env::temp_dir().join(format!("pisa-dump-{}", std::process::id()));
    let (by_env, by_tuning) = (base.join("env"), base.join("tuning"));
    let _ = std::fs::remove_dir_all(&base);
    std::env::set_var("PISA_DUMP_WGSL", &by_env);
    let app = App::new();
    let _ = plan_of(&app.ctx, 100);
    let written_by_app = count(&by_env);
    let own = Context::new(&pisa_wgpu::AdapterChoice::HighPerformance).unwrap();
    let _ = plan_of(&own, 100);
    std::env::remove_var("PISA_DUMP_WGSL");
    let written_by_new = count(&by_env);

    let mut t = app.ctx.tuning();
    t.dump_wgsl = Some(by_tuning.clone());
    let refused = app.ctx.set_tuning(t.clone());
    let ctx =
        Context::from_device_with_tuning(&app.adapter, app.device.clone(), app.queue.clone(), t)
            .unwrap();
    let _ = plan_of(&ctx, 100);
    let written_by_tuning = count(&by_tuning);
    let _ = std::fs::remove_dir_all(&base);
    assert_eq!(written_by_app, 0, "a context from from_device wrote WGSL");
    assert!(
        written_by_new > 0,
        "Context::new wrote no WGSL from PISA_DUMP_WGSL"
    );
    assert!(
        written_by_tuning > 0,
        "a context given dump_wgsl in its tuning wrote no WGSL"
    );
    assert!(
        matches!(refused, Err(pisa_wgpu::GpuError::Unsupported(_))),
        "set_tuning changed the dump folder of a live context: {refused:?}"
    );
}

/// A `Profiler` used wrongly is an error of its `finish`, not a failed submission, a panic
/// inside wgpu or times of zero: one made on another device's context, handed to a run on the application's device
/// (the run's passes go untimed, so the application's submission stays valid and its outputs
/// right); one asked for its times before the encoder holding its passes was submitted
/// (where the device has timestamps). Used rightly, it times the run.
#[test]
fn profiler_misuse_is_an_error_of_finish() {
    let (app, other) = (App::new(), App::new());
    let n = 100;
    let (_, _, plan) = plan_of(&app.ctx, n);
    let view = |b: &wgpu::Buffer, h: usize, dd: usize| {
        TensorView::contiguous(b, 0, DType::F32, [1, h, n, dd], TensorLayout::Bhnd).unwrap()
    };
    let qk = app.buffer("qk", (HQ * n * D * 4) as u64);
    let data = random(&mut rng(seed("profiler_misuse")), HQ * n * D, 1.0);
    app.queue.write_buffer(&qk, 0, bytemuck::cast_slice(&data));
    let (o, l) = (
        app.buffer("o", (HQ * n * D * 4) as u64),
        app.buffer("lse", (HQ * n * 4) as u64),
    );
    let (q, k, ov, lv) = (
        view(&qk, HQ, D),
        view(&qk, HKV, D),
        view(&o, HQ, D),
        view(&l, HQ, 1),
    );
    let outs = PrefillOutputs {
        out: &ov,
        lse: &lv,
        selection: None,
    };
    let run = |prof: Option<&mut pisa_wgpu::Profiler>| {
        app.poison(&o);
        let mut enc = app.device.create_command_encoder(&Default::default());
        plan.run(&mut enc, &q, &k, &k, &outs, prof).unwrap();
        enc
    };
    let misuse = |r: Result<pisa_wgpu::StageTimes, GpuError>, what: &str| match r {
        Err(GpuError::Misuse(m)) => m,
        other => panic!("{what}: {other:?}"),
    };

    // Another device's profiler.
    let mut p = pisa_wgpu::Profiler::new(&other.ctx, 64);
    let scope = app.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let enc = run(Some(&mut p));
    app.queue.submit([enc.finish()]);
    let err = pollster::block_on(scope.pop());
    assert!(err.is_none(), "the submission failed: {err:?}");
    let m = misuse(p.finish(&other.ctx), "finish of another device's profiler");
    assert!(m.contains("another context"), "{m}");
    let bytes = app.ctx.read_bytes(&o).unwrap();
    let out: &[f32] = bytemuck::cast_slice(&bytes);
    assert!(out.iter().all(|x| x.is_finite()), "O not written");

    if app.ctx.has_timestamps() {
        // Read before the submit.
        let mut p = pisa_wgpu::Profiler::new(&app.ctx, 64);
        let enc = run(Some(&mut p));
        let m = misuse(p.finish(&app.ctx), "finish before the submit");
        assert!(m.contains("was not submitted"), "{m}");
        app.queue.submit([enc.finish()]);
        // Rightly.
        let mut p = pisa_wgpu::Profiler::new(&app.ctx, 64);
        let enc = run(Some(&mut p));
        app.queue.submit([enc.finish()]);
        let t = p.finish(&app.ctx).unwrap();
        assert!(t.gpu && t.total() > 0.0, "{t:?}");
        // The same through finish_async and finish_span_async (the browser's way, awaited
        // here): the misuse, the times, and the span of the first stage's passes.
        let mut p = pisa_wgpu::Profiler::new(&app.ctx, 64);
        let enc = run(Some(&mut p));
        let early = pollster::block_on(p.finish_async(&app.ctx));
        let m = misuse(early, "finish_async before the submit");
        assert!(m.contains("was not submitted"), "{m}");
        app.queue.submit([enc.finish()]);
        let mut p = pisa_wgpu::Profiler::new(&app.ctx, 64);
        let enc = run(Some(&mut p));
        app.queue.submit([enc.finish()]);
        let ta = pollster::block_on(p.finish_async(&app.ctx)).unwrap();
        assert!(ta.gpu && ta.total() > 0.0, "{ta:?}");
        let names =
            |t: &pisa_wgpu::StageTimes| t.stages.iter().map(|s| s.0.clone()).collect::<Vec<_>>();
        assert_eq!(names(&ta), names(&t), "stages of finish_async");
        let stage = &t.stages[0].0;
        let mut p = pisa_wgpu::Profiler::new(&app.ctx, 64);
        let enc = run(Some(&mut p));
        app.queue.submit([enc.finish()]);
        let span = pollster::block_on(p.finish_span_async(&app.ctx, stage)).unwrap();
        assert!(span.is_some_and(|s| s > 0.0), "{stage}: {span:?}");
        let mut p = pisa_wgpu::Profiler::new(&other.ctx, 64);
        drop(run(Some(&mut p)));
        let m = misuse(
            pollster::block_on(p.finish_async(&other.ctx)),
            "another device's, async",
        );
        assert!(m.contains("another context"), "{m}");
        // A span asked of another context is refused too when passes went past the
        // profiler's capacity (it returned Ok(None), the cut-short span's answer, first).
        for asynchronous in [false, true] {
            let mut p = pisa_wgpu::Profiler::new(&app.ctx, 1);
            app.queue.submit([run(Some(&mut p)).finish()]);
            let span = match asynchronous {
                false => p.finish_span(&other.ctx, stage),
                true => pollster::block_on(p.finish_span_async(&other.ctx, stage)),
            };
            assert!(
                matches!(span, Err(GpuError::Misuse(ref m)) if m.contains("another context")),
                "async {asynchronous}: {span:?}"
            );
        }
    } else {
        eprintln!("adapter without TIMESTAMP_QUERY: the read-before-submit case not run");
    }
}

/// A profiler whose context was dropped refuses the contexts made after it (a context's
/// identity is never reused, where an address could be: a new context often took the dropped
/// one's address, and the profiler then put its old device's query set into the new device's
/// passes).
#[test]
fn profiler_of_a_dropped_context_refuses_later_ones() {
    for i in 0..8 {
        let a = App::new();
        let p = pisa_wgpu::Profiler::new(&a.ctx, 8);
        drop(a);
        let b = App::new();
        match p.finish(&b.ctx) {
            Err(GpuError::Misuse(_)) => {}
            other => panic!("iteration {i}: {other:?}"),
        }
    }
}

/// Views in a buffer of another device of the same instance, given to the finiteness check
/// and to a decode append that gathers its rows (bind groups the library builds and, for the
/// append, keeps), are `Validation` errors of the calls: not a panic of wgpu's default error
/// handler, and no kept bind group.
#[test]
fn gathers_and_checks_of_another_devices_buffer_are_validation_errors() {
    let app = App::new();
    let (other, _q) = open_device(&app.adapter);
    let buf = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device"),
        size: 4096,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let f16 = TensorView::new(&buf, 2, DType::F16, [1, 2, 4, 8], [64, 32, 8, 1]).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pisa_wgpu::ops::check_finite_view(&app.ctx, "x", &f16)
    }));
    match r {
        Ok(Err(GpuError::Validation { .. })) => {}
        Ok(other) => panic!("finiteness check: {other:?}"),
        Err(p) => panic!("finiteness check panicked: {:?}", panic_text(&*p)),
    }
    let (bn, d) = (2usize, 32usize);
    let mut cache = KvCache::new(&app.ctx, bn, 64, 1, 1, d, cfg(), Storage::F32).unwrap();
    // Rows of a packed projection (strided: gathered).
    let rows = TensorView::new(&buf, 0, DType::F32, [bn, 1, 1, d], [3 * d, d, 3 * d, 1]).unwrap();
    for attempt in 0..2 {
        let mut enc = app.device.create_command_encoder(&Default::default());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cache.record_append_view(&mut enc, &rows, &rows, &[true, true], None)
        }));
        match r {
            Ok(Err(GpuError::Validation { .. })) => {}
            Ok(other) => panic!("append, attempt {attempt}: {other:?}"),
            Err(p) => panic!("append panicked: {:?}", panic_text(&*p)),
        }
    }
    assert_eq!(cache.kept_dispatch_sets()[2], 0, "a failed gather was kept");
}

/// A chunk (`KvCache::record_chunk`) or a prompt (`record_prefill_view`) whose views lie in a
/// buffer of another device is a `Validation` error of the call, with nothing recorded and no
/// length advanced: not a panic of wgpu's default error handler (the application's device), and
/// not an `Ok` whose commands fail at submit. Each view in turn: the chunk's O and LSE (written
/// by scatters), its q (bound in place, and strided: gathered), its K; the prompt's V after a
/// K of the application's own. The cache then records a chunk of its own buffers, and the
/// submit is clean.
#[test]
fn chunks_and_prompts_of_another_devices_buffer_are_validation_errors() {
    let app = App::new();
    let (other, _q) = open_device(&app.adapter);
    let t = 3;
    let foreign = other.create_buffer(&wgpu::BufferDescriptor {
        label: Some("other device"),
        size: (2 * HQ * t * D * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let own = app.buffer("own", (HQ * t * D * 4) as u64);
    let own_out = app.buffer("own out", (HQ * t * D * 4) as u64);
    let own_lse = app.buffer("own lse", (HQ * t * 4) as u64);
    let view = |b: &wgpu::Buffer, h: usize, d: usize| {
        TensorView::contiguous(b, 0, DType::F32, [1, h, t, d], TensorLayout::Bhnd).unwrap()
    };
    // [1, HQ, T, D] at twice the head stride: gathered, not bound.
    let strided =
        TensorView::new(&foreign, 0, DType::F32, [1, HQ, t, D], [0, 2 * t * D, D, 1]).unwrap();
    let (q, kv, o, lse) = (
        view(&own, HQ, D),
        view(&own, HKV, D),
        view(&own_out, HQ, D),
        view(&own_lse, HQ, 1),
    );
    let (fq, fkv, fo, flse) = (
        view(&foreign, HQ, D),
        view(&foreign, HKV, D),
        view(&foreign, HQ, D),
        view(&foreign, HQ, 1),
    );
    let mut cache = KvCache::new(&app.ctx, 1, 64, HQ, HKV, D, cfg(), Storage::F32).unwrap();
    // Every call records into one encoder, submitted at the end: a failed call that recorded
    // anything of another device's buffer fails that submit.
    let mut enc = app.device.create_command_encoder(&Default::default());
    let chunks: [(&str, &TensorView, &TensorView, &TensorView, &TensorView); 5] = [
        ("O", &q, &kv, &fo, &lse),
        ("LSE", &q, &kv, &o, &flse),
        ("q in place", &fq, &kv, &o, &lse),
        ("q gathered", &strided, &kv, &o, &lse),
        ("K", &q, &fkv, &o, &lse),
    ];
    for (what, q, k, out, lse) in chunks {
        expect_validation(&format!("a chunk with another device's {what}"), || {
            let outs = ChunkOutputs { out, lse };
            cache.record_chunk(&mut enc, q, k, &kv, &outs, None)
        });
        assert_eq!(cache.lens(), &[0], "{what}: the lengths advanced");
    }
    let prompt = |b: &wgpu::Buffer| {
        TensorView::contiguous(b, 0, DType::F32, [1, HKV, t, D], TensorLayout::Bhnd).unwrap()
    };
    expect_validation("a prompt with another device's V", || {
        cache.record_prefill_view(&mut enc, 0, &prompt(&own), &prompt(&foreign))
    });
    assert_eq!(cache.lens(), &[0], "the prompt set a length");
    let outs = ChunkOutputs { out: &o, lse: &lse };
    cache
        .record_chunk(&mut enc, &q, &kv, &kv, &outs, None)
        .unwrap();
    assert_eq!(cache.lens(), &[t]);
    let scope = app.device.push_error_scope(wgpu::ErrorFilter::Validation);
    app.queue.submit([enc.finish()]);
    let err = pollster::block_on(scope.pop());
    assert!(err.is_none(), "the encoder of the failed calls: {err:?}");
}
