// The KV cache's lengths on the GPU (PISA.md section 5, decode): `lens` [B] u32 is the number
// of tokens each sequence holds, read by every step kernel; `append_mask` [B] u32 (0 or 1) says which
// sequences append a token. An append is recorded as three dispatches of one pass:
// `positions` (pos[b] = lens[b] for an appending sequence, 0xffffffff otherwise: where its new key
// goes), the append itself (`decode_append.wgsl`), then `advance` (lens[b] += append_mask[b]). So a
// recorded append-and-step needs no host write: several of them recorded into one submission
// see each other's lengths in order.
//
// One workgroup of WG invocations, each owning sequences b = lid, lid + WG, ...; B is the
// length of `append_mask`.
//
// `advance` stops a length at CAPACITY (the cache's tokens a sequence): the host refuses an
// append to a full sequence, so a length reaches past it only when the host's lengths ran
// behind the GPU's (an encoder holding a recorded reset dropped, or a submitting call mixed
// with a recorded append). Such a sequence's outputs are unspecified until a reset, but its
// step then reads its own rows only, never the next sequence's (the append kernel skips a
// position past the capacity for the same reason).
override CAPACITY: u32 = 0xffffffffu;

// Reads its inputs through the generated accessors: the bf16 variant may be built.
const BF16_READY: bool = true;
const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> append_mask: array<u32>;
@group(0) @binding(1) var<storage, read> lens_in: array<u32>;
@group(0) @binding(2) var<storage, read_write> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> lens_out: array<u32>;

@compute @workgroup_size(WG)
fn positions(@builtin(local_invocation_index) lid: u32) {
    for (var b = lid; b < arrayLength(&append_mask); b += WG) {
        pos[b] = select(0xffffffffu, lens_in[b], append_mask[b] != 0u);
    }
}

@compute @workgroup_size(WG)
fn advance(@builtin(local_invocation_index) lid: u32) {
    for (var b = lid; b < arrayLength(&append_mask); b += WG) {
        lens_out[b] = min(lens_out[b] + append_mask[b], CAPACITY);
    }
}
