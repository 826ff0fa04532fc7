//! Operations, one module per kernel family; each names its shader file in `shaders/`.

pub mod attention;
pub mod fill;
pub mod pyramid;

use crate::runtime::pipeline::ShaderSource;

/// Every shader family, for the naga validation test.
pub fn all_shaders() -> Vec<ShaderSource> {
    vec![attention::SHADER, fill::SHADER, pyramid::SHADER]
}
