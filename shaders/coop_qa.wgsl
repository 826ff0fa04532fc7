// Shared by the tensor-core kernels (appended by their hosts: attention_coop.wgsl,
// attention_leaf_coop.wgsl, leaf_score_coop.wgsl, leaf_select_coop.wgsl): the HD / 16 A
// matrices of a subgroup's 16 Q rows, in eight private variables behind qa_get / qa_set instead
// of a private array. On the H200 (driver 580) the driver kept a private array of cooperative
// matrices in local memory, although every index is the counter of a constant-trip loop: 256
// bytes per invocation in leaf-major attention, 0 with this form, at the same register count
// (VK_KHR_pipeline_executable_properties, tests/shader_stats.rs; docs/benchmarks.md, A.7:
// 2026-11-29, commit d77f45f). The switches fold away once the driver unrolls the loops.
// Needs HD16 <= 8 (D <= 128).
const_assert HD16 <= 8u;

var<private> qa_0: coop_mat16x16<f16, A>;
var<private> qa_1: coop_mat16x16<f16, A>;
var<private> qa_2: coop_mat16x16<f16, A>;
var<private> qa_3: coop_mat16x16<f16, A>;
var<private> qa_4: coop_mat16x16<f16, A>;
var<private> qa_5: coop_mat16x16<f16, A>;
var<private> qa_6: coop_mat16x16<f16, A>;
var<private> qa_7: coop_mat16x16<f16, A>;

// A matrix i (< HD16) of this subgroup's Q rows.
fn qa_get(i: u32) -> coop_mat16x16<f16, A> {
    switch i {
        case 0u: { return qa_0; }
        case 1u: { return qa_1; }
        case 2u: { return qa_2; }
        case 3u: { return qa_3; }
        case 4u: { return qa_4; }
        case 5u: { return qa_5; }
        case 6u: { return qa_6; }
        default: { return qa_7; }
    }
}

fn qa_set(i: u32, v: coop_mat16x16<f16, A>) {
    switch i {
        case 0u: { qa_0 = v; }
        case 1u: { qa_1 = v; }
        case 2u: { qa_2 = v; }
        case 3u: { qa_3 = v; }
        case 4u: { qa_4 = v; }
        case 5u: { qa_5 = v; }
        case 6u: { qa_6 = v; }
        default: { qa_7 = v; }
    }
}
