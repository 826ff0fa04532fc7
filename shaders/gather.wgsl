// Gather and scatter between a strided tensor view [B, H, N, D] of any element type (f32, f16,
// bf16) and a contiguous BHND tensor of the kernels' storage (f32, f16 or bf16), converting on the
// way. Both sides are bound as arrays of u32 words, so a 2-byte element at any element offset
// is a half-word (element i of a 2-byte array: word i >> 1, bits 16 * (i & 1)), and every
// conversion is integer arithmetic on the bits (no SHADER_F16, no denormal flushing, the same
// results on every device): f16 -> f32 and bf16 -> f32 are exact, f32 -> f16 and f32 -> bf16
// round to nearest even (overflow to infinity, NaN stays NaN), bf16 -> f16 and f16 -> bf16 go
// through the exact f32 value, f16 -> f16 and f32 -> f32 copy the bits.
//
// One dispatch covers one box of the tensor (all of it, or whole batches, heads of one batch or
// tokens of one head, as the host splits it to fit the bindings), the box being a contiguous
// range of the BHND order; (b, h, n, d) below are coordinates inside the box, whose extents
// are [*, p.nh, p.nn, p.d].
//
// gather: dst = contiguous BHND of DST_KIND (F32, F16 or BF16), src = the view (SRC_KIND).
//   Element (b, h, n, d) of the box is read at source element
//   p.base + b * p.sb + h * p.sh + n * p.sn + d * p.sd and written at destination element
//   p.first + its index in the box; p.count elements. F32: one invocation per element. F16, BF16:
//   one invocation per destination word (p.units words), writing it whole; a word holding an
//   element outside this dispatch's range (an odd first or end) keeps that half as it is (read,
//   modified, written: the dispatches of the neighbouring ranges run before or after, never
//   at the same time).
// scatter: src = contiguous BHND of SRC_KIND (F32, F16 or BF16), dst = the view (DST_KIND, any of
//   the three). Element p.first + i of the source goes to destination element
//   p.base + b * p.sb + h * p.sh + n * p.sn + d * p.sd. F32: one invocation per element
//   (p.count elements). F16, BF16: one invocation per pair (d, d + 1), d even (p.count pairs),
//   writing one whole word: the host checks that D is even, d's stride is 1 and the base and
//   every other stride are even, so a pair is exactly one word and no two invocations share one.
//
// find_nonfinite: src = the view (SRC_KIND); no dst. Each element l < p.count of the box whose
//   value is NaN or infinite takes part in an atomicMin of (l << 2 | cls) into found[p.first]
//   (p.first is the box's slot here; cls 0 NaN, 1 +inf, 2 -inf), so the slot ends holding
//   the box's first non-finite element, or 0xFFFFFFFF when there is none. A box holds at most
//   2^30 elements (the host checks), so the key fits.
//
// Bindings: 0 uniform Params, 1 src (read), 2 dst (read_write), both array<u32> bound from
// offsets aligned to min_storage_buffer_offset_alignment (p.base and p.first are relative to
// those); find_nonfinite binds 3 found instead of dst. Overrides: SRC_KIND, DST_KIND (0 = f32,
// 1 = f16, 2 = bf16).

const F32: u32 = 0u;
const F16: u32 = 1u;
const BF16: u32 = 2u;

override SRC_KIND: u32 = 0u;
override DST_KIND: u32 = 0u;

struct Params {
    count: u32, units: u32, first: u32, base: u32,
    d: u32, nn: u32, nh: u32, pad: u32,
    sb: u32, sh: u32, sn: u32, sd: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read_write> found: array<atomic<u32>>;

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x + wid.z * nwg.x * nwg.y) * 256u + lid;
}

// Strided element index of the box's element `l` (its index in BHND order inside the box).
fn view_index(l: u32) -> u32 {
    let d = l % p.d;
    let r = l / p.d;
    let n = r % p.nn;
    let r2 = r / p.nn;
    let h = r2 % p.nh;
    let b = r2 / p.nh;
    return p.base + b * p.sb + h * p.sh + n * p.sn + d * p.sd;
}

// The 16 bits of element i of a 2-byte array of words.
fn src_half(i: u32) -> u32 {
    return (src[i >> 1u] >> ((i & 1u) * 16u)) & 0xFFFFu;
}

fn f16_to_f32(h: u32) -> u32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1Fu;
    let m = h & 0x3FFu;
    if (e == 0x1Fu) {
        return sign | 0x7F800000u | (m << 13u);
    }
    if (e == 0u) {
        if (m == 0u) {
            return sign;
        }
        // Subnormal m * 2^-24: shift the leading one up to the hidden bit (bit 10).
        let sh = countLeadingZeros(m) - 21u;
        return sign | ((113u - sh) << 23u) | (((m << sh) & 0x3FFu) << 13u);
    }
    return sign | ((e + 112u) << 23u) | (m << 13u);
}

// Round to nearest even: `man`'s bits below `round` are dropped; `round` is the highest of them.
fn round_up(man: u32, round: u32) -> u32 {
    return select(0u, 1u, (man & round) != 0u && (man & (3u * round - 1u)) != 0u);
}

fn f32_to_f16(x: u32) -> u32 {
    let sign = (x >> 16u) & 0x8000u;
    let e = (x >> 23u) & 0xFFu;
    let m = x & 0x7FFFFFu;
    if (e == 0xFFu) {
        return sign | 0x7C00u | select(0u, 0x200u | (m >> 13u), m != 0u);
    }
    let he = i32(e) - 112;
    if (he >= 0x1F) {
        return sign | 0x7C00u;
    }
    if (he <= 0) {
        if (14 - he > 24) {
            return sign;
        }
        let full = m | 0x800000u;
        let shift = u32(14 - he);
        return sign | ((full >> shift) + round_up(full, 1u << (shift - 1u)));
    }
    // The carry of a rounding may run into the exponent: that is the correct result.
    return (sign | (u32(he) << 10u) | (m >> 13u)) + round_up(m, 0x1000u);
}

fn f32_to_bf16(x: u32) -> u32 {
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (x >> 16u) | 0x40u;
    }
    return (x >> 16u) + round_up(x, 0x8000u);
}

// Element i of the source, as bits of f32 (F32 src, or F32 dst), or of a 2-byte DST_KIND.
fn src_f32(i: u32) -> u32 {
    if (SRC_KIND == F32) {
        return src[i];
    }
    let h = src_half(i);
    if (SRC_KIND == BF16) {
        return h << 16u;
    }
    return f16_to_f32(h);
}

fn src_as_dst16(i: u32) -> u32 {
    if (SRC_KIND == DST_KIND) {
        return src_half(i);
    }
    let x = src_f32(i);
    if (DST_KIND == BF16) {
        return f32_to_bf16(x);
    }
    return f32_to_f16(x);
}

@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let i = linear_id(wid, nwg, lid);
    if (DST_KIND == F32) {
        if (i >= p.count) { return; }
        dst[p.first + i] = src_f32(view_index(i));
        return;
    }
    if (i >= p.units) { return; }
    let w = (p.first >> 1u) + i;
    // Box indices of the word's two elements (l0 wraps past the top when the range starts at
    // the word's upper half).
    let l0 = 2u * w - p.first;
    let l1 = l0 + 1u;
    let in0 = l0 < p.count;
    let in1 = l1 < p.count;
    var lo = 0u;
    var hi = 0u;
    if (in0) { lo = src_as_dst16(view_index(l0)); }
    if (in1) { hi = src_as_dst16(view_index(l1)); }
    if (!(in0 && in1)) {
        let old = dst[w];
        if (!in0) { lo = old & 0xFFFFu; }
        if (!in1) { hi = old >> 16u; }
    }
    dst[w] = lo | (hi << 16u);
}

@compute @workgroup_size(256)
fn scatter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let i = linear_id(wid, nwg, lid);
    if (i >= p.count) { return; }
    if (DST_KIND == F32) {
        dst[view_index(i)] = src_f32(p.first + i);
        return;
    }
    let l = 2u * i;
    let j = view_index(l);
    let lo = src_as_dst16(p.first + l);
    let hi = src_as_dst16(p.first + l + 1u);
    dst[j >> 1u] = lo | (hi << 16u);
}

@compute @workgroup_size(256)
fn find_nonfinite(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    let l = linear_id(wid, nwg, lid);
    if (l >= p.count) { return; }
    // f16 and bf16 widen exactly, NaN and infinities included.
    let x = src_f32(view_index(l));
    if ((x & 0x7F800000u) == 0x7F800000u) {
        var cls = 0u;
        if ((x & 0x7FFFFFu) == 0u) { cls = select(1u, 2u, (x >> 31u) != 0u); }
        atomicMin(&found[p.first], (l << 2u) | cls);
    }
}
