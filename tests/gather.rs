//! `ops::gather`: gathering a strided tensor view of any dtype into a contiguous BHND tensor of
//! f32 or f16 storage, and scattering one back into a caller's view, against a host reference
//! on random data (with rounding ties, f16 subnormals and overflow, f32 subnormals, infinities
//! and NaN mixed in). Every conversion is compared bit for bit: the GPU rounds to nearest even
//! as the `half` crate does. Gather destinations are poisoned first (0xFFFFFFFF words) so an
//! unwritten element shows; scatter destinations are filled with random bytes first, and every
//! byte outside the view must come back unchanged. The split path (a lowered binding limit)
//! must give the same bytes; bad views give typed errors.
mod common;

use half::{bf16, f16};
use pisa_wgpu::ops::gather::{record_gather, record_scatter};
use pisa_wgpu::{wgpu, Context, DType, GpuError, Storage, TensorView};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const STORAGES: [Storage; 2] = [Storage::F32, Storage::F16];

/// A random value: uniform in [-4, 4), or one time in eight a value at an edge of the
/// conversions.
fn value(rng: &mut ChaCha8Rng) -> f32 {
    const EDGES: [f32; 14] = [
        1.0 + 1.0 / 2048.0,   // f16 tie, rounds down to even
        1.0 + 3.0 / 2048.0,   // f16 tie, rounds up to even
        -(1.0 + 1.0 / 256.0), // bf16 tie, rounds down to even
        1.0 + 3.0 / 256.0,    // bf16 tie, rounds up to even
        1.0e-6,               // f16 subnormal
        -3.0e-5,              // f16 subnormal
        6.0e-8,               // near the least f16 subnormal
        65504.0,              // largest f16
        -70000.0,             // past f16: infinity
        1.0e-40,              // f32 subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -0.0,
    ];
    if rng.random_range(0..8) == 0 {
        EDGES[rng.random_range(0..EDGES.len())]
    } else {
        rng.random_range(-4.0f32..4.0)
    }
}

/// The bits of `x` rounded to `dt` (the low 16 bits for 2-byte types).
fn bits_of(x: f32, dt: DType) -> u32 {
    match dt {
        DType::F32 | DType::I32 => x.to_bits(),
        DType::F16 => f16::from_f32(x).to_bits() as u32,
        DType::BF16 => bf16::from_f32(x).to_bits() as u32,
    }
}

/// An element of `from` converted to `to`, as the host reference does it: exactly to f32,
/// then rounded to nearest even; a copy of the bits when the types agree or both are 4 bytes
/// (i32 to and from f32 storage).
fn convert(bits: u32, from: DType, to: DType) -> u32 {
    if from == to || (from.bytes() == 4 && to.bytes() == 4) {
        return bits;
    }
    let x = match from {
        DType::F32 | DType::I32 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => bf16::from_bits(bits as u16).to_f32(),
    };
    bits_of(x, to)
}

/// Little-endian bytes of `elems` elements of `dt`.
fn pack(elems: &[u32], dt: DType) -> Vec<u8> {
    match dt.bytes() {
        4 => elems.iter().flat_map(|e| e.to_le_bytes()).collect(),
        _ => elems
            .iter()
            .flat_map(|e| (*e as u16).to_le_bytes())
            .collect(),
    }
}

/// Elements of `dt` from little-endian bytes.
fn unpack(bytes: &[u8], dt: DType) -> Vec<u32> {
    match dt.bytes() {
        4 => (bytes.chunks_exact(4))
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => (bytes.chunks_exact(2))
            .map(|c| u16::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect(),
    }
}

fn words(bytes: usize) -> usize {
    bytes.div_ceil(4) * 4
}

/// A storage buffer holding `bytes` (padded with 0xFF to whole words).
fn buffer(ctx: &Context, label: &str, bytes: &[u8]) -> wgpu::Buffer {
    let mut b = bytes.to_vec();
    b.resize(words(b.len()), 0xFF);
    common::bytes_buffer(ctx, label, &b)
}

/// A view: shape, strides and offset in elements, and the elements its buffer holds.
#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    shape: [usize; 4],
    strides: [usize; 4],
    offset: usize,
    len: usize,
}

impl Case {
    fn contiguous(name: &'static str, shape: [usize; 4], bnhd: bool, offset: usize) -> Self {
        let [_, h, n, d] = shape;
        let strides = if bnhd {
            [n * h * d, d, h * d, 1]
        } else {
            [h * n * d, n * d, d, 1]
        };
        Self {
            name,
            shape,
            strides,
            offset,
            len: offset + shape.iter().product::<usize>() + 5,
        }
    }

    /// Element index (from the buffer's start) of `(b, h, n, d)`.
    fn index(&self, i: [usize; 4]) -> usize {
        self.offset + (0..4).map(|k| i[k] * self.strides[k]).sum::<usize>()
    }

    /// Element indices of the view in BHND order.
    fn indices(&self) -> Vec<usize> {
        let [b, h, n, d] = self.shape;
        let mut out = Vec::with_capacity(b * h * n * d);
        for bi in 0..b {
            for hi in 0..h {
                for ni in 0..n {
                    for di in 0..d {
                        out.push(self.index([bi, hi, ni, di]));
                    }
                }
            }
        }
        out
    }
}

/// Q, K and V views of a packed projection `[B, N, (Hq + 2 Hkv) * D]` starting `pad` elements
/// into the buffer (Hq = 3, Hkv = 2, D = 24, so K starts at `pad + 72`).
fn qkv(pad: usize) -> Vec<Case> {
    let (b, n, hq, hkv, d) = (2, 37, 3, 2, 24);
    let row = (hq + 2 * hkv) * d;
    let len = pad + b * n * row + 3;
    let view = |name, heads, off| Case {
        name,
        shape: [b, heads, n, d],
        strides: [n * row, d, row, 1],
        offset: pad + off,
        len,
    };
    vec![
        view("packed qkv: q", hq, 0),
        view("packed qkv: k", hkv, hq * d),
        view("packed qkv: v", hkv, (hq + hkv) * d),
    ]
}

/// Views every gather must take: odd element offsets (the half-word path of 2-byte types),
/// offsets that are not multiples of 256 bytes, BHND and BNHD, packed QKV, odd D, and a
/// permuted layout with gaps where D's stride is the largest.
fn gather_cases() -> Vec<Case> {
    let mut v = vec![
        Case::contiguous("bhnd [2,3,37,24]", [2, 3, 37, 24], false, 37),
        Case::contiguous("bnhd [1,7,5,40]", [1, 7, 5, 40], true, 101),
        Case::contiguous("bhnd [2,3,19,5]", [2, 3, 19, 5], false, 7),
        Case::contiguous("bnhd [3,2,11,7] at 0", [3, 2, 11, 7], true, 0),
    ];
    v.extend(qkv(3));
    // Storage order D, B, N, H (slowest first), with gaps.
    let [b, h, n, d] = [3, 2, 5, 6];
    let (sh, sn) = (1, h + 1);
    let sb = sn * n + 3;
    let sd = sb * b + 5;
    v.push(Case {
        name: "permuted [3,2,5,6]",
        shape: [b, h, n, d],
        strides: [sb, sh, sn, sd],
        offset: 5,
        len: 5 + sd * d + 2,
    });
    v
}

/// Views a scatter into a 2-byte view can take: even element offsets (multiples of 4 bytes,
/// not of 256), even strides, D even with stride 1.
fn scatter16_cases() -> Vec<Case> {
    let mut v = vec![
        Case::contiguous("bhnd [2,3,37,24]", [2, 3, 37, 24], false, 38),
        Case::contiguous("bnhd [1,7,5,40]", [1, 7, 5, 40], true, 102),
        Case::contiguous("bhnd [2,3,19,6]", [2, 3, 19, 6], false, 2),
    ];
    v.extend(qkv(2));
    // Odd strides are allowed on dimensions of extent 1.
    v.push(Case {
        name: "odd strides of extent-1 dims",
        shape: [1, 1, 9, 4],
        strides: [7, 5, 6, 1],
        offset: 4,
        len: 4 + 8 * 6 + 4 + 3,
    });
    v
}

/// Scatter into an f32 view: any strides.
fn scatter32_cases() -> Vec<Case> {
    let mut v = gather_cases();
    v.extend(scatter16_cases());
    v
}

/// The caller's buffer of `case`, random elements of `dt`, and the view of it.
fn source(ctx: &Context, rng: &mut ChaCha8Rng, case: &Case, dt: DType) -> (Vec<u32>, TensorView) {
    let elems: Vec<u32> = (0..case.len).map(|_| bits_of(value(rng), dt)).collect();
    let buf = buffer(ctx, case.name, &pack(&elems, dt));
    let view = TensorView::new(
        &buf,
        (case.offset as u64) * dt.bytes(),
        dt,
        case.shape,
        case.strides,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    (elems, view)
}

/// Gathers `src` into a new poisoned buffer (16 bytes longer than the tensor) and returns its
/// bytes.
fn run_gather(ctx: &Context, src: &TensorView, storage: Storage) -> pisa_wgpu::Result<Vec<u8>> {
    let bytes = words(src.elems() * storage.bytes() as usize) + 16;
    let dst = buffer(ctx, "gathered", &vec![0xFF; bytes]);
    ctx.scoped("gather test", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        record_gather(ctx, &mut enc, src, &dst, storage)?;
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })?;
    ctx.read_bytes(&dst)
}

/// Scatters the contiguous tensor `src` (elements of `storage`) into `dst` and returns the
/// bytes of `dst`'s buffer.
fn run_scatter(
    ctx: &Context,
    src: &[u32],
    storage: Storage,
    dst: &TensorView,
) -> pisa_wgpu::Result<Vec<u8>> {
    let buf = buffer(ctx, "contiguous", &pack(src, storage.into()));
    ctx.scoped("scatter test", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        record_scatter(ctx, &mut enc, &buf, storage, dst)?;
        ctx.queue().submit([enc.finish()]);
        Ok(())
    })?;
    ctx.read_bytes(dst.buffer())
}

/// Panics at the first element where `got` differs from `want`, naming it.
fn assert_bits(what: &str, got: &[u32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} is {:#x}, the reference {:#x} ({} of {} elements differ)",
            got[i],
            want[i],
            (0..got.len()).filter(|&i| got[i] != want[i]).count(),
            got.len()
        );
    }
}

/// Checks a gather's output bytes against the reference: the tensor's elements, then poison.
fn check_gather(what: &str, out: &[u8], elems: &[u32], case: &Case, dt: DType, s: Storage) {
    let want: Vec<u32> = (case.indices().iter())
        .map(|&i| convert(elems[i], dt, s.into()))
        .collect();
    let n = want.len() * s.bytes() as usize;
    assert_bits(what, &unpack(&out[..n], s.into()), &want);
    assert!(
        out[n..].iter().all(|&b| b == 0xFF),
        "{what}: bytes past the tensor were written"
    );
}

#[test]
fn gather_matches_the_host_for_every_dtype_and_layout() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("gather"));
    eprintln!(
        "min_storage_buffer_offset_alignment {}, shader f16 {}",
        ctx.limits().min_storage_buffer_offset_alignment,
        ctx.has_f16()
    );
    for case in gather_cases() {
        for dt in DTYPES {
            let (elems, view) = source(ctx, &mut rng, &case, dt);
            for s in STORAGES {
                let what = format!("gather {} {dt:?} -> {s:?}", case.name);
                let out = run_gather(ctx, &view, s).unwrap_or_else(|e| panic!("{what}: {e}"));
                check_gather(&what, &out, &elems, &case, dt, s);
            }
        }
    }
}

#[test]
fn scatter_writes_exactly_the_view() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("scatter"));
    for dt in DTYPES {
        let cases = match dt {
            DType::F32 => scatter32_cases(),
            _ => scatter16_cases(),
        };
        for case in cases {
            for s in STORAGES {
                let what = format!("scatter {} {s:?} -> {dt:?}", case.name);
                // The caller's buffer: a random pattern the scatter must keep outside the view.
                let (before, view) = source(ctx, &mut rng, &case, dt);
                let n = case.shape.iter().product::<usize>();
                let src: Vec<u32> = (0..n).map(|_| bits_of(value(&mut rng), s.into())).collect();
                let mut want = before.clone();
                for (k, &i) in case.indices().iter().enumerate() {
                    want[i] = convert(src[k], s.into(), dt);
                }
                let out =
                    run_scatter(ctx, &src, s, &view).unwrap_or_else(|e| panic!("{what}: {e}"));
                let len = case.len * dt.bytes() as usize;
                assert_bits(&what, &unpack(&out[..len], dt), &want);
                assert!(
                    out[len..].iter().all(|&b| b == 0xFF),
                    "{what}: the buffer's padding was written"
                );
            }
        }
    }
}

/// Gather then scatter of the same view gives back the view's elements (f32 storage: exact for
/// every dtype).
#[test]
fn gather_then_scatter_round_trips_through_f32() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("round trip"));
    for dt in DTYPES {
        for case in qkv(2) {
            let (elems, view) = source(ctx, &mut rng, &case, dt);
            let g = run_gather(ctx, &view, Storage::F32).unwrap();
            let n = view.elems();
            let contiguous = unpack(&g[..n * 4], DType::F32);
            // Into a second, differently filled buffer of the same shape.
            let (mut want, back) = source(ctx, &mut rng, &case, dt);
            for &i in &case.indices() {
                want[i] = elems[i];
            }
            let out = run_scatter(ctx, &contiguous, Storage::F32, &back).unwrap();
            let len = case.len * dt.bytes() as usize;
            assert_bits(
                &format!("round trip {} {dt:?}", case.name),
                &unpack(&out[..len], dt),
                &want,
            );
        }
    }
}

/// i32 views (selections) are copied word for word to and from f32 storage, any strides; f16
/// storage is refused.
#[test]
fn integer_views_are_copied_word_for_word() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("i32"));
    let mut cases = vec![Case::contiguous("bnhd [2,3,19,5]", [2, 3, 19, 5], true, 3)];
    cases.extend(qkv(1));
    for case in cases {
        let words_of = |rng: &mut ChaCha8Rng| (0..case.len).map(|_| rng.random::<u32>()).collect();
        let elems: Vec<u32> = words_of(&mut rng);
        let buf = buffer(ctx, case.name, &pack(&elems, DType::I32));
        let view = TensorView::new(
            &buf,
            case.offset as u64 * 4,
            DType::I32,
            case.shape,
            case.strides,
        )
        .unwrap();
        let out = run_gather(ctx, &view, Storage::F32).unwrap();
        check_gather(case.name, &out, &elems, &case, DType::I32, Storage::F32);
        let contiguous = unpack(&out[..view.elems() * 4], DType::I32);
        let mut want: Vec<u32> = words_of(&mut rng);
        let back = buffer(ctx, case.name, &pack(&want, DType::I32));
        let back = TensorView::new(
            &back,
            case.offset as u64 * 4,
            DType::I32,
            case.shape,
            case.strides,
        )
        .unwrap();
        for (k, &i) in case.indices().iter().enumerate() {
            want[i] = contiguous[k];
        }
        let got = run_scatter(ctx, &contiguous, Storage::F32, &back).unwrap();
        assert_bits(case.name, &unpack(&got, DType::I32), &want);
        for r in [
            run_gather(ctx, &view, Storage::F16),
            run_scatter(ctx, &contiguous, Storage::F16, &back),
        ] {
            assert!(
                matches!(r, Err(GpuError::Unsupported(_))),
                "{}: i32 with f16 storage gives {:?}",
                case.name,
                r.map(|b| b.len())
            );
        }
    }
}

/// Lowered binding limits split the work into runs of batches, heads or tokens (so a word of
/// an f16 destination may be shared by two dispatches when D is odd): the same bytes as one
/// dispatch, for gather and scatter.
#[test]
fn split_bindings_give_identical_results() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("split"));
    let mut cases = vec![
        Case::contiguous("bhnd [40,2,3,8]", [40, 2, 3, 8], false, 3),
        Case::contiguous("bhnd [2,3,19,5]", [2, 3, 19, 5], false, 7),
        Case::contiguous("bnhd [3,2,11,7]", [3, 2, 11, 7], true, 1),
    ];
    cases.extend(qkv(3));
    let limits = [4096u64, 1024, 512];
    let result = || {
        for case in &cases {
            for dt in DTYPES {
                let (elems, view) = source(ctx, &mut rng, case, dt);
                for s in STORAGES {
                    let what = format!("split gather {} {dt:?} -> {s:?}", case.name);
                    ctx.set_max_binding_bytes(u64::MAX);
                    let whole = run_gather(ctx, &view, s).unwrap();
                    check_gather(&what, &whole, &elems, case, dt, s);
                    for limit in limits {
                        ctx.set_max_binding_bytes(limit);
                        let split = run_gather(ctx, &view, s)
                            .unwrap_or_else(|e| panic!("{what}, limit {limit}: {e}"));
                        assert!(split == whole, "{what}: limit {limit} differs");
                    }
                }
            }
        }
        // Scatter into f32 views (any case) and 2-byte views (even D and strides).
        for case in cases.iter().chain(&scatter16_cases()) {
            for dt in DTYPES {
                if dt != DType::F32 && (case.shape[3] % 2 != 0 || case.offset % 2 != 0) {
                    continue;
                }
                for s in STORAGES {
                    let what = format!("split scatter {} {s:?} -> {dt:?}", case.name);
                    let n = case.shape.iter().product::<usize>();
                    let src: Vec<u32> =
                        (0..n).map(|_| bits_of(value(&mut rng), s.into())).collect();
                    let (before, view) = source(ctx, &mut rng, case, dt);
                    let mut pattern = pack(&before, dt);
                    pattern.resize(words(pattern.len()), 0xFF);
                    ctx.set_max_binding_bytes(u64::MAX);
                    let whole = run_scatter(ctx, &src, s, &view).unwrap();
                    for limit in limits {
                        ctx.queue().write_buffer(view.buffer(), 0, &pattern);
                        ctx.set_max_binding_bytes(limit);
                        let split = run_scatter(ctx, &src, s, &view)
                            .unwrap_or_else(|e| panic!("{what}, limit {limit}: {e}"));
                        assert!(split == whole, "{what}: limit {limit} differs");
                    }
                }
            }
        }
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(result));
    ctx.set_max_binding_bytes(u64::MAX);
    if let Err(e) = outcome {
        std::panic::resume_unwind(e);
    }
}

fn view_error(r: pisa_wgpu::Result<Vec<u8>>, what: &str, needle: &str) {
    match r {
        Err(GpuError::View(m)) => {
            assert!(m.contains(needle), "{what}: message {m:?} lacks {needle:?}");
            eprintln!("{what}: {m}");
        }
        other => panic!(
            "{what}: expected GpuError::View, got {:?}",
            other.map(|b| b.len())
        ),
    }
}

#[test]
fn bad_views_give_typed_errors() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let buf = buffer(ctx, "caller", &[0x5A; 4096]);
    let src = vec![0x3C00u32; 64];
    let view = |dt, offset: u64, shape, strides| {
        TensorView::new(&buf, offset, dt, shape, strides).unwrap()
    };

    // Scatter into 2-byte views that would share words between invocations.
    let odd_d = view(DType::BF16, 0, [1, 2, 3, 5], [30, 15, 5, 1]);
    view_error(
        run_scatter(ctx, &src, Storage::F16, &odd_d),
        "odd D",
        "D = 5 is odd",
    );
    let strided_d = view(DType::F16, 0, [1, 1, 4, 4], [64, 64, 8, 2]);
    view_error(
        run_scatter(ctx, &src, Storage::F16, &strided_d),
        "D stride 2",
        "D stride is 2",
    );
    let odd_offset = view(DType::F16, 6, [1, 1, 4, 4], [16, 16, 4, 1]);
    view_error(
        run_scatter(ctx, &src, Storage::F32, &odd_offset),
        "odd offset",
        "byte offset 6",
    );
    let odd_token = view(DType::BF16, 0, [1, 1, 3, 4], [15, 15, 5, 1]);
    view_error(
        run_scatter(ctx, &src, Storage::F32, &odd_token),
        "odd token stride",
        "token stride 5",
    );
    let odd_batch = view(DType::F16, 0, [2, 1, 3, 4], [13, 12, 4, 1]);
    view_error(
        run_scatter(ctx, &src, Storage::F32, &odd_batch),
        "odd batch stride",
        "batch stride 13",
    );
    // Too short a contiguous source.
    let big = view(DType::F32, 0, [1, 1, 16, 8], [128, 128, 8, 1]);
    view_error(
        run_scatter(ctx, &src, Storage::F32, &big),
        "short source",
        "needs 512",
    );

    // Gather into too small, non-storage, or the view's own buffer.
    let v = view(DType::F16, 2, [1, 2, 3, 5], [30, 15, 5, 1]);
    let small = buffer(ctx, "small", &[0; 40]);
    let r = ctx.scoped("gather test", || {
        let mut enc = ctx.device().create_command_encoder(&Default::default());
        record_gather(ctx, &mut enc, &v, &small, Storage::F32)
    });
    view_error(r.map(|_| vec![]), "small destination", "needs 120");
    let copy_only = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("copy only"),
        size: 1024,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = ctx.device().create_command_encoder(&Default::default());
    let r = record_gather(ctx, &mut enc, &v, &copy_only, Storage::F16);
    view_error(r.map(|_| vec![]), "no STORAGE", "STORAGE");
    let r = record_gather(ctx, &mut enc, &v, &buf, Storage::F16);
    view_error(r.map(|_| vec![]), "own buffer", "lies in");
    let r = record_scatter(ctx, &mut enc, &buf, Storage::F16, &v);
    view_error(r.map(|_| vec![]), "own buffer", "lies in");

    // A view ending inside the partial last word of a 6-byte buffer.
    let six = ctx.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("six bytes"),
        size: 6,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let tail = TensorView::new(&six, 0, DType::F16, [1, 1, 1, 3], [3, 3, 3, 1]).unwrap();
    let r = record_gather(ctx, &mut enc, &tail, &small, Storage::F32);
    view_error(r.map(|_| vec![]), "partial word", "partial");
    drop(enc);

    // A row that does not fit in a binding.
    let wide = view(DType::F32, 0, [1, 1, 2, 256], [512, 512, 256, 1]);
    ctx.set_max_binding_bytes(256);
    let r = run_gather(ctx, &wide, Storage::F32);
    ctx.set_max_binding_bytes(u64::MAX);
    match r {
        Err(GpuError::Limit { needed, limit, .. }) => assert!(needed > limit),
        other => panic!(
            "wide row: expected GpuError::Limit, got {:?}",
            other.map(|b| b.len())
        ),
    }
}

/// `check_finite_view` (and its async twin) on every gather case and dtype, whole and split
/// over lowered binding limits: `Ok` on finite data (with a NaN planted outside the view, in
/// its gaps and padding, which it must not read); with one to three NaN or infinities planted
/// inside, `NonFinite` with the first one's BHND index and value. An i32 view is a `View`
/// error.
#[test]
fn finiteness_check_finds_the_first_nonfinite_element() {
    let _g = common::settings_lock();
    let ctx = common::ctx();
    let mut rng = common::rng(common::seed("finite_view"));
    let mut cases = gather_cases();
    cases.push(Case::contiguous("bhnd [40,2,3,8]", [40, 2, 3, 8], false, 3));
    let check = |view: &TensorView| -> pisa_wgpu::Result<()> {
        let a = pisa_wgpu::ops::check_finite_view(ctx, "x", view);
        let b = pollster::block_on(pisa_wgpu::ops::check_finite_view_async(ctx, "x", view));
        assert_eq!(
            format!("{a:?}"),
            format!("{b:?}"),
            "blocking and async differ"
        );
        a
    };
    let result = || {
        for case in &cases {
            for dt in DTYPES {
                let idx = case.indices();
                let inside: std::collections::HashSet<usize> = idx.iter().copied().collect();
                let mut elems: Vec<u32> = (0..case.len)
                    .map(|i| {
                        let x = if inside.contains(&i) {
                            rng.random_range(-4.0f32..4.0)
                        } else {
                            f32::NAN
                        };
                        bits_of(x, dt)
                    })
                    .collect();
                let view_of = |elems: &[u32]| {
                    let buf = buffer(ctx, case.name, &pack(elems, dt));
                    TensorView::new(
                        &buf,
                        (case.offset as u64) * dt.bytes(),
                        dt,
                        case.shape,
                        case.strides,
                    )
                    .unwrap()
                };
                let what = format!("{} {dt:?}", case.name);
                // (The permuted view's rows span more than the lowered limits: whole only.)
                let limits: &[u64] = match case.name.starts_with("permuted") {
                    true => &[u64::MAX],
                    false => &[u64::MAX, 1024, 512],
                };
                for &limit in limits {
                    ctx.set_max_binding_bytes(limit);
                    check(&view_of(&elems)).unwrap_or_else(|e| panic!("{what} {limit}: {e}"));
                }
                ctx.set_max_binding_bytes(u64::MAX);
                let planted = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
                let mut at: Vec<usize> = (0..rng.random_range(1..=3))
                    .map(|_| rng.random_range(0..idx.len()))
                    .collect();
                for (k, &p) in at.iter().enumerate() {
                    elems[idx[p]] = bits_of(planted[(k + p) % 3], dt);
                }
                at.sort();
                let first = at[0];
                let want = elems[idx[first]];
                let view = view_of(&elems);
                for &limit in limits {
                    ctx.set_max_binding_bytes(limit);
                    match check(&view) {
                        Err(GpuError::NonFinite {
                            tensor,
                            index,
                            value,
                        }) => {
                            assert_eq!((tensor, index), ("x", first), "{what} {limit}");
                            let w = f32::from_bits(convert(want, dt, DType::F32));
                            assert!(
                                value == w || (value.is_nan() && w.is_nan()),
                                "{what}: {value}, planted {w}"
                            );
                        }
                        other => panic!("{what} {limit}: {other:?}"),
                    }
                }
                ctx.set_max_binding_bytes(u64::MAX);
            }
        }
        let ints = buffer(ctx, "ints", &[0u8; 64]);
        let v = TensorView::new(&ints, 0, DType::I32, [1, 1, 4, 4], [16, 16, 4, 1]).unwrap();
        assert!(matches!(check(&v), Err(GpuError::View(_))));
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(result));
    ctx.set_max_binding_bytes(u64::MAX);
    if let Err(e) = outcome {
        std::panic::resume_unwind(e);
    }
}
