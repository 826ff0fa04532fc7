//! The NVIDIA kernels' uniform blocks against the Rust structures the host writes into them.
//!
//! The GLSL of `shaders/nv/` restates each uniform block (`Params`, `Buckets`, `Dims`, `Table`) by hand,
//! beside the `#[repr(C)]` structure the host fills; a field added, removed or moved on one
//! side only would make a kernel read another field, silently. This test reads every embedded
//! module's uniform blocks from its SPIR-V (member names and `Offset` decorations, which
//! glslang keeps) and checks each member's offset against the Rust structure's field of the
//! same meaning (`std::mem::offset_of!`, so the Rust side is the real layout).

use std::mem::offset_of;

use crate::ops::attention::nv_dense::Params as DenseParams;
use crate::ops::leaf_select::by_leaf::Buckets;
use crate::ops::route::TableParams;
use crate::ops::select::SelParams;
use crate::runtime::nv::{embedded_kernels, instructions};

/// The text of a SPIR-V literal string starting at `words[0]`.
fn literal(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// `(block name, [(member name, byte offset)])` of every struct of `words` that has member
/// offsets and a name (the uniform and storage blocks).
fn blocks(words: &[u32]) -> Vec<(String, Vec<(String, u32)>)> {
    const OP_NAME: u32 = 5;
    const OP_MEMBER_NAME: u32 = 6;
    const OP_MEMBER_DECORATE: u32 = 72;
    const OFFSET: u32 = 35;
    use std::collections::BTreeMap;
    let mut names: BTreeMap<u32, String> = BTreeMap::new();
    let mut members: BTreeMap<(u32, u32), String> = BTreeMap::new();
    let mut offsets: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for w in instructions(words) {
        let w = w.unwrap();
        let count = w.len();
        match w[0] & 0xffff {
            OP_NAME if count >= 3 => {
                names.insert(w[1], literal(&w[2..]));
            }
            OP_MEMBER_NAME if count >= 4 => {
                members.insert((w[1], w[2]), literal(&w[3..]));
            }
            OP_MEMBER_DECORATE if count >= 5 && w[3] == OFFSET => {
                offsets.insert((w[1], w[2]), w[4]);
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (id, name) in names {
        let list: Vec<(String, u32)> = offsets
            .iter()
            .filter(|((t, _), _)| *t == id)
            .map(|(&(t, m), &off)| (members.get(&(t, m)).cloned().unwrap_or_default(), off))
            .collect();
        if !list.is_empty() {
            out.push((name, list));
        }
    }
    out
}

/// The byte offset, in the Rust structure the host writes, of member `m` of uniform block
/// `block` of kernel `kernel`; `None` for a member the host does not know (a test failure).
fn rust_offset(kernel: &str, block: &str, m: &str) -> Option<usize> {
    let dense = kernel.starts_with("attention_dense");
    Some(match (block, dense) {
        ("Params", false) => match m {
            "q_sb" => offset_of!(SelParams, q_sb),
            "q_sh" => offset_of!(SelParams, q_sh),
            "q_sn" => offset_of!(SelParams, q_sn),
            "k_sb" => offset_of!(SelParams, k_sb),
            "k_sh" => offset_of!(SelParams, k_sh),
            "k_sn" => offset_of!(SelParams, k_sn),
            "q_heads" => offset_of!(SelParams, q_heads),
            "kv_heads" => offset_of!(SelParams, kv_heads),
            "q_len" => offset_of!(SelParams, q_len),
            "k_len" => offset_of!(SelParams, k_len),
            "head_dim" => offset_of!(SelParams, head_dim),
            "block_size" => offset_of!(SelParams, block_size),
            "merge" => offset_of!(SelParams, merge),
            "top_k" => offset_of!(SelParams, top_k),
            "causal" => offset_of!(SelParams, causal),
            "sink" => offset_of!(SelParams, sink),
            "local_blocks" => offset_of!(SelParams, local),
            "nb0" => offset_of!(SelParams, nb0),
            "total_nodes" => offset_of!(SelParams, total_nodes),
            "start_level" => offset_of!(SelParams, start_level),
            "scoring" => offset_of!(SelParams, scoring),
            "tiles" => offset_of!(SelParams, tiles),
            "wg_count" => offset_of!(SelParams, wg_count),
            "scale" => offset_of!(SelParams, scale),
            "q_pos0" => offset_of!(SelParams, q_pos0),
            "mc" => offset_of!(SelParams, mc),
            "routed" => offset_of!(SelParams, routed),
            "pad1" => offset_of!(SelParams, pad1),
            "o_sb" => offset_of!(SelParams, o_sb),
            "o_sh" => offset_of!(SelParams, o_sh),
            "o_sn" => offset_of!(SelParams, o_sn),
            "pad2" => offset_of!(SelParams, pad2),
            "levels" => offset_of!(SelParams, levels),
            _ => return None,
        },
        ("Params", true) => match m {
            "q_sb" | "q_sh" | "q_sn" => offset_of!(DenseParams, q_s) + 4 * stride_index(m),
            "k_sb" | "k_sh" | "k_sn" => offset_of!(DenseParams, k_s) + 4 * stride_index(m),
            "v_sb" | "v_sh" | "v_sn" => offset_of!(DenseParams, v_s) + 4 * stride_index(m),
            "q_heads" => offset_of!(DenseParams, q_heads),
            "kv_heads" => offset_of!(DenseParams, kv_heads),
            "q_len" => offset_of!(DenseParams, q_len),
            "k_len" => offset_of!(DenseParams, k_len),
            "q_pos0" => offset_of!(DenseParams, q_pos0),
            "causal" => offset_of!(DenseParams, causal),
            "scale" => offset_of!(DenseParams, scale),
            "tiles" => offset_of!(DenseParams, tiles),
            "split" => offset_of!(DenseParams, split),
            "o_sb" | "o_sh" | "o_sn" => offset_of!(DenseParams, o_s) + 4 * stride_index(m),
            "pad1" | "pad2" | "pad3" => offset_of!(DenseParams, pad) + 4 * (pad_index(m) - 1),
            _ => return None,
        },
        ("Buckets", _) => match m {
            "items" => offset_of!(Buckets, items),
            "buckets" => offset_of!(Buckets, buckets),
            "i0" => offset_of!(Buckets, i0),
            "nq" => offset_of!(Buckets, nq),
            "bh0" => offset_of!(Buckets, bh0),
            "first" => offset_of!(Buckets, first),
            "heads" => offset_of!(Buckets, heads),
            "pad2" => offset_of!(Buckets, pad),
            _ => return None,
        },
        ("Table", _) => match m {
            "i0" => offset_of!(TableParams, i0),
            "nq" => offset_of!(TableParams, nq),
            "lt" => offset_of!(TableParams, lt),
            "tn" => offset_of!(TableParams, tn),
            "items" => offset_of!(TableParams, items),
            "tiles" => offset_of!(TableParams, tiles),
            "pad0" | "pad1" => offset_of!(TableParams, pad) + 4 * pad_index(m),
            _ => return None,
        },
        // ops/nv_gemm.rs writes [m, n, k, 0] as u32.
        ("Dims", _) => 4 * ["m", "n", "k"].iter().position(|&x| x == m)?,
        _ => return None,
    })
}

/// 0, 1, 2 for the batch, head and token stride (`*_sb`, `*_sh`, `*_sn`).
fn stride_index(m: &str) -> usize {
    ["b", "h", "n"].iter().position(|s| m.ends_with(s)).unwrap()
}

/// 0, 1, 2, 3 for `pad0`, `pad1`, `pad2`, `pad3`.
fn pad_index(m: &str) -> usize {
    m[3..].parse().unwrap()
}

#[test]
fn every_uniform_block_matches_the_host_structure() {
    let mut checked = 0;
    for k in embedded_kernels() {
        let words = k.words().unwrap();
        for (block, members) in blocks(&words) {
            // Storage blocks (runtime arrays at offset 0) are not the host's structures.
            if !["Params", "Buckets", "Dims", "Table"].contains(&block.as_str()) {
                continue;
            }
            for (m, off) in &members {
                assert_eq!(
                    rust_offset(k.name, &block, m),
                    Some(*off as usize),
                    "{}: member {m} of uniform block {block} is at byte {off} in the shader",
                    k.name
                );
                checked += 1;
            }
        }
    }
    // Every kernel family has a block: a parse that found none would pass vacuously.
    assert!(checked > 100, "only {checked} uniform members found");
}

#[test]
fn a_moved_field_is_caught() {
    // The check itself: the shader's offsets against another structure's fail.
    assert_ne!(
        rust_offset("leaf_score_d128", "Params", "k_sb"),
        rust_offset("leaf_score_d128", "Params", "k_sh")
    );
    assert_eq!(
        rust_offset("leaf_score_d128", "Params", "no_such_member"),
        None
    );
    assert_eq!(
        rust_offset("attention_dense_d128", "Params", "v_sn"),
        Some(32)
    );
    assert_eq!(rust_offset("gemm_64x64x64", "Dims", "k"), Some(8));
}
