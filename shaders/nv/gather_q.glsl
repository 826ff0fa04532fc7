// The Q rows of one leaf-major chunk gathered into workgroup memory, shared by the NVIDIA
// leaf scorer (leaf_score.comp) and sparse attention (attention_leaf.comp). Row r of the chunk
// is entry r / gq (query bl.i0 + list[first + e] / p.mc) at head hkv * gq + r % gq; rows past
// the n entries are zeros. Rows are 16-byte words at a stride of QS8 = HD / 8 + 1 words (the
// word of padding puts consecutive rows in different banks for the matrix loads); a matrix
// load reads columns d0.. of the rows with `coopMatLoad(m, qsh, d0 / 8, QS8, RowMajor)`.
// Every invocation issues all of its global loads before its first store to workgroup memory:
// in a loop that alternates them, each load waits behind the previous iteration's stores (the
// same change halved the WGSL scorer, docs/benchmarks.md A.3).
// Needs: RT, HD, WG defined; `p`, `bl`, `list` (select_common.glsl) and `q4` declared;
// ENTRY_INDEX(v), where defined, takes a list value to i * MC + o (flag bits cleared).
#ifndef ENTRY_INDEX
#define ENTRY_INDEX(v) (v)
#endif
const uint HD8 = HD / 8;
const uint QS8 = HD8 + 1;
const uint QG = (RT * HD8 + WG - 1) / WG; // 16-byte words per invocation

shared uvec4 qsh[RT * QS8];

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
