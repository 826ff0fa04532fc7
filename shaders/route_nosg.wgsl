// The routing kernel without subgroups (route.wgsl SG = 0, appended to it): lanes_sum is never
// called there; this definition lets the shader validate on devices without subgroups.
fn lanes_sum(v: vec4<f32>) -> vec4<f32> { return v; }
