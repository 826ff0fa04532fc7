// The routing kernel without subgroups (route.wgsl SG = 0, appended to it): lanes_sum,
// groups_sum and score_lanes are never called there; these definitions let the shader validate
// on devices without subgroups.
fn lanes_sum(v: vec4<f32>) -> vec4<f32> { return v; }
fn groups_sum(x: f32) -> f32 { return x; }
fn score_lanes(acc: array<vec4<f32>, G>, lane: u32, l: u32, j: u32, hg: u32, on: bool,
               ln_full: f32) -> f32 {
    return 0.0;
}
