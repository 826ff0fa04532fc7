// The Q rows of one leaf-major chunk, shared by the NVIDIA leaf scorer (leaf_score.comp) and
// sparse attention (attention_leaf.comp). Row r of the chunk is entry r / gq (query bl.i0 +
// list[first + e] / p.mc) at head hkv * gq + r % gq; rows past the n entries are zeros.
// gather_q() prepares the chunk's rows (then a barrier), and LOAD_QA(qa, d0) loads columns
// d0 .. d0 + DC of the rows as an A operand.
// QDEC = 1 (the scorer, leaf_score.comp): gather_q() writes each row's element offset in Q to
// `qrow`, and the driver's tensor load reads the rows through a decode function (decode_q) that
// maps row r to that offset, as it reads the keys. On the H100 the pair scorer took 53.6
// against 60.9 ms at 256K tokens this way, and the chunk kernel 121.4 against 62.9, so only
// the scorer does (2026-12-05, docs/benchmarks.md A.57).
// QDEC = 0 (the default; the chunk kernel, attention_leaf.comp): the kernel gathers the rows
// into workgroup memory itself (16-byte loads into registers, all issued before the first
// store), rows at a stride of QS8 = HD / 8 + 1 words (the word of padding puts consecutive
// rows in different banks), loaded with coopMatLoad.
// `qsh` (RT rows of QS8 words) is declared with QDEC = 1 too where QSH is defined.
// Needs: RT, HD, DC, WG defined; `p`, `bl`, `list` (select_common.glsl); B_Q, the Vulkan
// binding of Q (default 1). ENTRY_INDEX(v), where defined, takes a list value to i * MC + o
// (flag bits cleared).
#ifndef ENTRY_INDEX
#define ENTRY_INDEX(v) (v)
#endif
#ifndef QDEC
#define QDEC 0
#endif
#ifndef B_Q
#define B_Q 1
#endif
const uint HD8 = HD / 8;
const uint QS8 = HD8 + 1;

#if !QDEC || defined(QSH)
shared uvec4 qsh[RT * QS8];
#endif

#if QDEC
#extension GL_EXT_buffer_reference : require
layout(set = 0, binding = B_Q, std430) readonly buffer BufQ { float16_t q16[]; };
// The block the driver addresses (a 1 x 1 block of an RT x HD tensor); not read: the row's
// place in Q is qrow's.
layout(buffer_reference, std430, buffer_reference_align = 2) buffer QElem { float16_t x; };
// Element offset in Q of each row of the chunk (0xffffffff: a row past the entries, zero).
shared uint qrow[RT];

float16_t decode_q(const in QElem e, const in uint block[2], const in uint in_block[2]) {
    const uint o = qrow[block[0]];
    return o == 0xffffffffu ? float16_t(0.0) : q16[o + block[1]];
}

void gather_q(const uint lid, const uint b, const uint hkv, const uint gq, const uint first,
              const uint n) {
    for (uint r = lid; r < RT; r += WG) {
        const uint e = r / gq;
        uint o = 0xffffffffu;
        if (e < n) {
            const uint i = bl.i0 + ENTRY_INDEX(list[first + e]) / p.mc;
            o = b * p.q_sb + (hkv * gq + r % gq) * p.q_sh + i * p.q_sn;
        }
        qrow[r] = o;
    }
}

#define LOAD_QA(qa, d0)                                                                    \
    coopMatLoadTensorNV(qa, q16, 0,                                                        \
                        sliceTensorLayoutNV(setTensorLayoutDimensionNV(                    \
                                                createTensorLayoutNV(2), RT, HD),          \
                                            0, RT, d0, DC),                                \
                        decode_q)
#else
layout(set = 0, binding = B_Q, std430) readonly buffer BufQ { uvec4 q4[]; };
const uint QG = (RT * HD8 + WG - 1) / WG; // 16-byte words per invocation

void gather_q(const uint lid, const uint b, const uint hkv, const uint gq, const uint first,
              const uint n) {
    uvec4 w[QG];
    [[unroll]] for (uint j = 0; j < QG; j++) {
        const uint x = lid + j * WG;
        const uint r = x / HD8, e = r / gq;
        w[j] = uvec4(0u);
        if (x < RT * HD8 && e < n) {
            const uint i = bl.i0 + ENTRY_INDEX(list[first + e]) / p.mc;
            const uint hq = hkv * gq + r % gq;
            w[j] = q4[(b * p.q_sb + hq * p.q_sh + i * p.q_sn) / 8u + x % HD8];
        }
    }
    [[unroll]] for (uint j = 0; j < QG; j++) {
        const uint x = lid + j * WG;
        if (x < RT * HD8) { qsh[(x / HD8) * QS8 + x % HD8] = w[j]; }
    }
}

#define LOAD_QA(qa, d0) coopMatLoad(qa, qsh, (d0) / 8, QS8, gl_CooperativeMatrixLayoutRowMajor)
#endif
