//! Every shader family parses and validates with naga, for the f32 and the f16 variant (the
//! split-K attention shaders are listed here beside `ops::all_shaders`).

use pisa_wgpu::runtime::pipeline::{preprocess, Storage};

#[test]
fn every_shader_validates_in_f32_and_f16() {
    let shaders = pisa_wgpu::ops::all_shaders();
    assert!(!shaders.is_empty());
    let split_k = [
        pisa_wgpu::ops::attention::split_k::SHADER,
        pisa_wgpu::ops::attention::split_k::MERGE_SHADER,
    ];
    for s in shaders.into_iter().chain(split_k) {
        for storage in [Storage::F32, Storage::F16] {
            let src = preprocess(&s, storage, &[]).unwrap();
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{} {storage:?}: {}", s.name, e.emit_to_string(&src)));
            let mut v = naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            );
            v.validate(&module)
                .unwrap_or_else(|e| panic!("{} {storage:?}: {}", s.name, e.emit_to_string(&src)));
        }
    }
}
