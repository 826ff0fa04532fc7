// The routing kernel without subgroups (route.wgsl SG = 0, appended to it): lanes_sum and
// groups_sum are never called there; these definitions let the shader validate on devices
// without subgroups.
fn lanes_sum(v: vec4<f32>) -> vec4<f32> { return v; }
fn groups_sum(x: f32) -> f32 { return x; }
