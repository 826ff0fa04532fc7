//! The WGSL sources of the decode kernels: `shaders/decode.wgsl` (shared declarations)
//! followed by the parts each module needs (see the module docs of [`crate::ops::decode`]) and
//! the declaration of the block states (`decode_parts.wgsl`, or `decode_parts_coherent.wgsl`),
//! and `shaders/decode_append.wgsl`.

use crate::runtime::pipeline::ShaderSource;

/// The WGSL of a decode module: `shaders/decode.wgsl`, the named files of `shaders/` in order,
/// then the block states' declaration, `decode_parts.wgsl` (`plain`) or
/// `decode_parts_coherent.wgsl` (`coherent`).
macro_rules! decode_module {
    (plain; $($f:literal),* $(,)?) => {
        decode_module!(@ "decode_parts.wgsl"; $($f),*)
    };
    (coherent; $($f:literal),* $(,)?) => {
        decode_module!(@ "decode_parts_coherent.wgsl"; $($f),*)
    };
    (@ $parts:literal; $($f:literal),*) => {
        concat!(
            include_str!("../../../../shaders/decode.wgsl"),
            $(include_str!(concat!("../../../../shaders/", $f)),)*
            include_str!(concat!("../../../../shaders/", $parts))
        )
    };
}

/// `shaders/decode.wgsl`, `decode_levels.wgsl` (the routing, shared with the fused step),
/// `decode_levels_nosg.wgsl` and `decode_route.wgsl`: split step dispatch 1 (`route`), its
/// levels through workgroup memory (SGR = 0).
pub const ROUTE_SHADER: ShaderSource = ShaderSource {
    name: "decode_route",
    wgsl: decode_module!(
        plain;
        "decode_levels.wgsl", "decode_levels_nosg.wgsl", "decode_route.wgsl",
    ),
};
/// [`ROUTE_SHADER`] with the level steps of `decode_levels_sg.wgsl` (SGR = 1: lane sums, the
/// children's LSEs and the rank counts by subgroup shuffles), for devices with
/// `Features::SUBGROUP`.
pub const ROUTE_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_sg",
    wgsl: decode_module!(plain; "decode_levels.wgsl", "decode_levels_sg.wgsl", "decode_route.wgsl"),
};
/// `shaders/decode.wgsl`, `decode_levels.wgsl`, `decode_levels_nosg.wgsl`,
/// `decode_attend.wgsl`, `decode_attend_nosg.wgsl` and `decode_route_leaf.wgsl`: split step
/// dispatches 1 and 2 as one (`route_leaf`), its levels and block attention through workgroup
/// memory.
pub const ROUTE_LEAF_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf",
    wgsl: decode_module!(
        plain;
        "decode_levels.wgsl", "decode_levels_nosg.wgsl", "decode_attend.wgsl",
        "decode_attend_nosg.wgsl", "decode_route_leaf.wgsl",
    ),
};
/// [`ROUTE_LEAF_SHADER`] with the level steps of `decode_levels_sg.wgsl` and the block
/// attention of `decode_attend_sg.wgsl` (used where SGA = 1).
pub const ROUTE_LEAF_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf_sg",
    wgsl: decode_module!(
        plain;
        "decode_levels.wgsl", "decode_levels_sg.wgsl", "decode_attend.wgsl",
        "decode_attend_sg.wgsl", "decode_route_leaf.wgsl",
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
    wgsl: decode_module!(
        coherent;
        "decode_levels.wgsl", "decode_levels_nosg.wgsl", "decode_attend.wgsl",
        "decode_attend_nosg.wgsl", "decode_route_leaf.wgsl", "decode_cut.wgsl", "decode_merge.wgsl",
        "decode_route_leaf_merge.wgsl",
    ),
};
/// [`ROUTE_LEAF_MERGE_SHADER`] with the level steps of `decode_levels_sg.wgsl` and the block
/// attention of `decode_attend_sg.wgsl` (used where SGA = 1).
pub const ROUTE_LEAF_MERGE_SG_SHADER: ShaderSource = ShaderSource {
    name: "decode_route_leaf_merge_sg",
    wgsl: decode_module!(
        coherent;
        "decode_levels.wgsl", "decode_levels_sg.wgsl", "decode_attend.wgsl",
        "decode_attend_sg.wgsl", "decode_route_leaf.wgsl", "decode_cut.wgsl", "decode_merge.wgsl",
        "decode_route_leaf_merge.wgsl",
    ),
};
/// `shaders/decode.wgsl` followed by `shaders/decode_attend.wgsl` and
/// `decode_attend_nosg.wgsl`: step dispatch 2 (`leaf`).
pub const SHADER: ShaderSource = ShaderSource {
    name: "decode",
    wgsl: decode_module!(plain; "decode_attend.wgsl", "decode_attend_nosg.wgsl"),
};
/// `shaders/decode.wgsl`, `decode_cut.wgsl` (the top-K cut, shared with the fused step) and
/// `decode_merge.wgsl`: split step dispatch 3 (`merge`).
pub const MERGE_SHADER: ShaderSource = ShaderSource {
    name: "decode_merge",
    wgsl: decode_module!(plain; "decode_cut.wgsl", "decode_merge.wgsl"),
};
/// `shaders/decode.wgsl`, `decode_levels.wgsl`, `decode_cut.wgsl` and `decode_fused.wgsl`: the
/// fused step (`fused`), one dispatch.
pub const FUSED_SHADER: ShaderSource = ShaderSource {
    name: "decode_fused",
    wgsl: decode_module!(
        plain;
        "decode_levels.wgsl", "decode_levels_nosg.wgsl", "decode_cut.wgsl", "decode_fused.wgsl",
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
