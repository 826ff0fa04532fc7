//! Every shader family parses and validates with naga, for the f32 and the f16 variant, and the
//! bf16 variant where the shader reads bf16 (the
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

/// The bf16 variant (`Storage::Bf16`: inputs bound as 16-bit words, read through the generated
/// `in_*` accessors) of every shader either parses and validates, or is refused with a typed
/// error because the shader indexes an input directly (so it never reads bf16 words as f32).
/// The prefill's portable kernels and the decode kernels are among those accepted; the baseline,
/// backward and split-K kernels (which bind raw words) among those refused.
#[test]
fn bf16_variants_validate_or_are_refused() {
    let shaders = pisa_wgpu::ops::all_shaders();
    let split_k = [
        pisa_wgpu::ops::attention::split_k::SHADER,
        pisa_wgpu::ops::attention::split_k::MERGE_SHADER,
    ];
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    for s in shaders.into_iter().chain(split_k) {
        match preprocess(&s, Storage::Bf16, &[]) {
            Ok(src) => {
                assert!(!src.contains("enable f16"), "{}: bf16 needs no f16", s.name);
                let module = naga::front::wgsl::parse_str(&src)
                    .unwrap_or_else(|e| panic!("{} bf16: {}", s.name, e.emit_to_string(&src)));
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    naga::valid::Capabilities::all(),
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("{} bf16: {}", s.name, e.emit_to_string(&src)));
                accepted.push(s.name);
            }
            Err(pisa_wgpu::GpuError::Unsupported(m)) if m.contains("bf16") => refused.push(s.name),
            Err(e) => panic!("{} bf16: unexpected error {e}", s.name),
        }
    }
    let prefill = [
        "pyramid",
        "route",
        "leaf_select",
        "leaf_score",
        "attention",
        "attention_leaf",
    ];
    let decode = [
        "decode_route",
        "decode",
        "decode_merge",
        "decode_fused",
        "decode_append",
    ];
    for name in prefill.into_iter().chain(decode).chain([
        "attention_leaf_merge",
        "leaf_bucket",
        "leaf_pick",
        "fill",
    ]) {
        assert!(
            accepted.contains(&name),
            "{name} refuses bf16 ({refused:?})"
        );
    }
    // (gather binds raw words in every variant and is built once, as f32.)
    for name in ["oracle", "bsa", "backward", "attention_split"] {
        assert!(refused.contains(&name), "{name} accepts bf16");
    }
}

/// The generated accessors index the bound words of the bf16 variant, and plain elements of the
/// others.
#[test]
fn bf16_inputs_are_bound_as_words() {
    let s = pisa_wgpu::ops::pyramid::SHADER;
    let bf = preprocess(&s, Storage::Bf16, &[]).unwrap();
    assert!(bf.contains("var<storage, read> k: array<u32>;"));
    assert!(bf.contains("fn in_k(i: u32) -> f32 { let w = k[i >> 1u];"));
    let f = preprocess(&s, Storage::F16, &[]).unwrap();
    assert!(f.contains("var<storage, read> k: array<store_t>;"));
    assert!(f.contains("fn in_k(i: u32) -> f32 { return f32(k[i]); }"));
    let c = preprocess(&pisa_wgpu::ops::decode::APPEND_SHADER, Storage::Bf16, &[]).unwrap();
    assert!(c.contains("var<storage, read_write> kc: array<u32>;"));
    assert!(c.contains("fn out2_kc(i: u32, a: f32, b: f32) { kc[i >> 1u] = bf16_bits(a)"));
    assert_eq!(c.matches("fn bf16_bits").count(), 1);
    let a = preprocess(&pisa_wgpu::ops::attention::SHADER, Storage::Bf16, &[]).unwrap();
    assert!(a.contains("var<storage, read> q: array<vec2<u32>>;"));
    assert!(a.contains("fn in4_q(i: u32) -> vec4<f32>"));
}

/// Every kernel marks "no score" with the same finite value, -3.0e38 (`NEG`, `NEG_SCORE`), and
/// the decode kernels' "masked" threshold `NEG_T` lies above it and below every real score the
/// reference keeps. A kernel with its own larger sentinel once dropped rows whose scores were
/// all below it (`docs/reliability.md` entry 19: -1e30 emptied rows of scores near -7e29); this test
/// fails when one shader's constant drifts from the others'. At least 10 shaders declare one,
/// so the test cannot pass on an empty list.
#[test]
fn every_no_score_sentinel_is_the_same() {
    let split_k = [
        pisa_wgpu::ops::attention::split_k::SHADER,
        pisa_wgpu::ops::attention::split_k::MERGE_SHADER,
    ];
    let value = |line: &str| -> f32 {
        let v = line.split('=').nth(1).unwrap().split(';').next().unwrap();
        v.trim().parse().unwrap_or_else(|e| panic!("{line}: {e}"))
    };
    let mut declared = 0;
    for s in pisa_wgpu::ops::all_shaders().into_iter().chain(split_k) {
        for line in s.wgsl.lines().map(str::trim) {
            if line.starts_with("const NEG: f32") || line.starts_with("const NEG_SCORE: f32") {
                assert_eq!(value(line), -3.0e38, "{}: {line}", s.name);
                declared += 1;
            } else if line.starts_with("const NEG_T: f32") {
                let t = value(line);
                assert!(t > -3.0e38 && t <= -1.0e38, "{}: {line}", s.name);
            }
        }
    }
    assert!(declared >= 10, "only {declared} shaders declare a sentinel");
}
