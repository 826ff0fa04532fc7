//! Readable text (and machine-readable JSON) for shapes and configurations in user-facing
//! output, metadata and reports, in place of Rust `Debug` strings; and plurals for messages.

use pisa_core::{AttentionShape, Scoring, SelectionConfig, TensorLayout};
use pisa_wgpu::Storage;
use serde_json::{json, Value};

/// An f32 as a JSON number written as the f32's shortest decimal (0.088388346), not as its
/// f64 widening (0.08838834764831845); `null` for a value JSON has no number for.
pub fn f32_json(x: f32) -> Value {
    (x.to_string().parse::<f64>().ok())
        .and_then(serde_json::Number::from_f64)
        .map_or(Value::Null, Value::Number)
}

/// `x` as people read it in a message: plain for magnitudes from 1e-4 to below 1e6 (`0.125`,
/// `12`), in exponent form otherwise (`1e30`, `2.5e-7`), where plain formatting prints every
/// digit of a huge float.
pub fn number<T: Copy + Into<f64> + std::fmt::Display + std::fmt::LowerExp>(x: T) -> String {
    let a = x.into().abs();
    if a == 0.0 || !a.is_finite() || (1e-4..1e6).contains(&a) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// `1 step`, `2 steps`.
pub fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// The scoring's name as `--scoring` spells it: `lse`, `mean`, `meanvar`.
pub fn scoring(s: Scoring) -> &'static str {
    match s {
        Scoring::Lse => "lse",
        Scoring::Mean => "mean",
        Scoring::MeanVar => "meanvar",
    }
}

/// The storage precision's name as `--storage` spells it: `f32`, `f16`, `bf16`.
pub fn storage(s: Storage) -> &'static str {
    match s {
        Storage::F32 => "f32",
        Storage::F16 => "f16",
        Storage::Bf16 => "bf16",
    }
}

/// The layout's name as `--layout` spells it: `bhnd`, `bnhd`.
pub fn layout(l: TensorLayout) -> &'static str {
    match l {
        TensorLayout::Bhnd => "bhnd",
        TensorLayout::Bnhd => "bnhd",
    }
}

/// `B 1, Hq 32, Hkv 8, N 4096, D 128` (`Nq`/`Nk` when the query and key lengths differ).
pub fn shape(s: &AttentionShape) -> String {
    let n = if s.q_len == s.k_len {
        format!("N {}", s.q_len)
    } else {
        format!("Nq {}, Nk {}", s.q_len, s.k_len)
    };
    format!(
        "B {}, Hq {}, Hkv {}, {n}, D {}",
        s.batch, s.q_heads, s.kv_heads, s.head_dim
    )
}

/// The shape as a JSON object of numbers.
pub fn shape_json(s: &AttentionShape) -> Value {
    json!({
        "batch": s.batch, "q_heads": s.q_heads, "kv_heads": s.kv_heads,
        "q_len": s.q_len, "k_len": s.k_len, "head_dim": s.head_dim,
    })
}

/// `C 64, top_k 16, g 2, lse, causal, sink 0, local 0` (and `scale S` when one is set).
pub fn config(c: &SelectionConfig) -> String {
    let mut t = format!(
        "C {}, top_k {}, g {}, {}, {}, sink {}, local {}",
        c.block_size,
        c.top_k,
        c.merge_factor,
        scoring(c.scoring),
        if c.causal { "causal" } else { "non-causal" },
        c.sink_blocks,
        c.local_blocks
    );
    if let Some(s) = c.scale {
        t.push_str(&format!(", scale {s}"));
    }
    t
}

/// The configuration as a JSON object (numbers, booleans and the scoring's name).
pub fn config_json(c: &SelectionConfig) -> Value {
    json!({
        "block_size": c.block_size, "top_k": c.top_k, "merge_factor": c.merge_factor,
        "scoring": scoring(c.scoring), "causal": c.causal, "sink_blocks": c.sink_blocks,
        "local_blocks": c.local_blocks, "scale": c.scale.map(f32_json),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readable_shape_config_and_plurals() {
        let s = AttentionShape::new(1, 32, 8, 4096, 4096, 128).unwrap();
        assert_eq!(shape(&s), "B 1, Hq 32, Hkv 8, N 4096, D 128");
        assert_eq!(
            config(&SelectionConfig::default()),
            "C 64, top_k 16, g 2, lse, causal, sink 0, local 0"
        );
        assert_eq!(config_json(&SelectionConfig::default())["top_k"], 16);
        assert_eq!(shape_json(&s)["head_dim"], 128);
        assert_eq!(storage(Storage::Bf16), "bf16");
        assert_eq!(plural(1, "step"), "1 step");
        // The f32's own shortest digits, not its f64 widening's.
        let s = 1.0 / 128f32.sqrt();
        assert_eq!(f32_json(s).to_string(), s.to_string());
        assert_eq!(f32_json(0.25).to_string(), "0.25");
        assert_eq!(f32_json(f32::NAN), Value::Null);
        assert_eq!(plural(2, "token"), "2 tokens");
    }
}

#[cfg(test)]
mod number_tests {
    /// Huge and tiny values in exponent form (a scale of 1e30 printed 31 digits), the rest plain.
    #[test]
    fn numbers_read_as_written() {
        assert_eq!(super::number(1e30f32), "1e30");
        assert_eq!(super::number(2.5e-7f64), "2.5e-7");
        assert_eq!(super::number(0.125f32), "0.125");
        assert_eq!(super::number(12.0f64), "12");
        assert_eq!(super::number(f64::INFINITY), "inf");
    }
}
