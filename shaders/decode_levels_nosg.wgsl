// The decode route without subgroups (SGR = 0, appended to decode_levels.wgsl): score_lse_sg
// and rank_cut_sg are never called there; these definitions let the shader validate on devices
// without subgroups.
const_assert SGR == 0u;
const QRN: u32 = 1u;
fn lane_queries(lid: u32) -> array<vec4<f32>, QRN> { return array<vec4<f32>, QRN>(); }
fn score_lse_sg(bh: u32, l: u32, len: u32, nchild: u32, w: u32, co: u32, lid: u32,
                qr: array<vec4<f32>, QRN>) {}
fn rank_cut_sg(co: u32, cn: u32, l: u32, nchild: u32, bq: u32, lid: u32) {}
