//! The WGSL sources of the decode kernels: `shaders/decode.wgsl` (shared declarations)
//! followed by the parts each module needs (see the module docs of [`crate::ops::decode`]) and
//! the declaration of the block states (`decode_parts.wgsl`, or `decode_parts_coherent.wgsl`),
//! and `shaders/decode_append.wgsl`.

use crate::runtime::pipeline::ShaderSource;

/// `shaders/decode.wgsl`, `decode_levels.wgsl` (the routing, shared with the fused step),
/// `decode_levels_nosg.wgsl` and `decode_route.wgsl`: split step dispatch 1 (`route`), its
/// levels through workgroup memory (SGR = 0).
pub const ROUTE_SHADER: ShaderSource = ShaderSource {
    name: "decode_route",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_nosg.wgsl"),
        include_str!("../../../../shaders/decode_route.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// [`ROUTE_SHADER`] with the level steps of `decode_levels_sg.wgsl` (SGR = 1: lane sums, the
/// children's LSEs and the rank counts by subgroup shuffles), for devices with
/// `Features::SUBGROUP`.
pub const ROUTE_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_sg",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_sg.wgsl"),
        include_str!("../../../../shaders/decode_route.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// `shaders/decode.wgsl`, `decode_levels.wgsl`, `decode_levels_nosg.wgsl`,
/// `decode_attend.wgsl`, `decode_attend_nosg.wgsl` and `decode_route_leaf.wgsl`: split step
/// dispatches 1 and 2 as one (`route_leaf`), its levels and block attention through workgroup
/// memory.
pub const ROUTE_LEAF_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_nosg.wgsl"),
        include_str!("../../../../shaders/decode_attend.wgsl"),
        include_str!("../../../../shaders/decode_attend_nosg.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// [`ROUTE_LEAF_SHADER`] with the level steps of `decode_levels_sg.wgsl` and the block
/// attention of `decode_attend_sg.wgsl` (used where SGA = 1).
pub const ROUTE_LEAF_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf_sg",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_sg.wgsl"),
        include_str!("../../../../shaders/decode_attend.wgsl"),
        include_str!("../../../../shaders/decode_attend_sg.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// `shaders/decode.wgsl`, `decode_levels.wgsl`, `decode_levels_nosg.wgsl`,
/// `decode_attend.wgsl`, `decode_attend_nosg.wgsl`, `decode_route_leaf.wgsl`,
/// `decode_cut.wgsl`, `decode_merge.wgsl`, `decode_route_leaf_merge.wgsl` and
/// `decode_parts_coherent.wgsl`: the split step as one dispatch (`route_leaf_merge`: route,
/// leaf and, in the last workgroup of each (sequence, KV head), merge), its levels and block
/// attention through workgroup memory. Needs `Features::MEMORY_DECORATION_COHERENT`.
pub const ROUTE_LEAF_MERGE_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf_merge",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_nosg.wgsl"),
        include_str!("../../../../shaders/decode_attend.wgsl"),
        include_str!("../../../../shaders/decode_attend_nosg.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf.wgsl"),
        include_str!("../../../../shaders/decode_cut.wgsl"),
        include_str!("../../../../shaders/decode_merge.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf_merge.wgsl"),
        include_str!("../../../../shaders/decode_parts_coherent.wgsl")
    ),
};
/// [`ROUTE_LEAF_MERGE_SHADER`] with the level steps of `decode_levels_sg.wgsl` and the block
/// attention of `decode_attend_sg.wgsl` (used where SGA = 1).
pub const ROUTE_LEAF_MERGE_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf_merge_sg",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_sg.wgsl"),
        include_str!("../../../../shaders/decode_attend.wgsl"),
        include_str!("../../../../shaders/decode_attend_sg.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf.wgsl"),
        include_str!("../../../../shaders/decode_cut.wgsl"),
        include_str!("../../../../shaders/decode_merge.wgsl"),
        include_str!("../../../../shaders/decode_route_leaf_merge.wgsl"),
        include_str!("../../../../shaders/decode_parts_coherent.wgsl")
    ),
};
/// `shaders/decode.wgsl` followed by `shaders/decode_attend.wgsl` and
/// `decode_attend_nosg.wgsl`: step dispatch 2 (`leaf`).
pub const SHADER: ShaderSource = ShaderSource {
    name: "decode",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_attend.wgsl"),
        include_str!("../../../../shaders/decode_attend_nosg.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// `shaders/decode.wgsl`, `decode_cut.wgsl` (the top-K cut, shared with the fused step) and
/// `decode_merge.wgsl`: split step dispatch 3 (`merge`).
pub const MERGE_SHADER: ShaderSource = ShaderSource {
    name: "decode_merge",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_cut.wgsl"),
        include_str!("../../../../shaders/decode_merge.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// `shaders/decode.wgsl`, `decode_levels.wgsl`, `decode_cut.wgsl` and `decode_fused.wgsl`: the
/// fused step (`fused`), one dispatch.
pub const FUSED_SHADER: ShaderSource = ShaderSource {
    name: "decode_fused",
    wgsl: concat!(
        include_str!("../../../../shaders/decode.wgsl"),
        include_str!("../../../../shaders/decode_levels.wgsl"),
        include_str!("../../../../shaders/decode_levels_nosg.wgsl"),
        include_str!("../../../../shaders/decode_cut.wgsl"),
        include_str!("../../../../shaders/decode_fused.wgsl"),
        include_str!("../../../../shaders/decode_parts.wgsl")
    ),
};
/// `shaders/decode_append.wgsl`: append with ancestor-path update, prefill copy.
pub const APPEND_SHADER: ShaderSource = ShaderSource {
    name: "decode_append",
    wgsl: include_str!("../../../../shaders/decode_append.wgsl"),
};
/// `shaders/decode_lens.wgsl`: the append's positions and length advance on the GPU.
pub const LENS_SHADER: ShaderSource = ShaderSource {
    name: "decode_lens",
    wgsl: include_str!("../../../../shaders/decode_lens.wgsl"),
};
