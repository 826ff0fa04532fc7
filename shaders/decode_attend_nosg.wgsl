// The decode leaf attention without subgroups (SGA = 0, appended to decode_attend.wgsl):
// attend_block_sg is never called there; this definition lets the shader validate on devices
// without subgroups.
const_assert SGA == 0u;
fn attend_block_sg(bh: u32, t0: u32, n: u32, po: u32, al: u32, ib: u32) {}
