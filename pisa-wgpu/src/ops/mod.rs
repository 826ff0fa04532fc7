//! Operations, one module per kernel family; each names its shader file in `shaders/`.

pub mod attention;
pub mod backward;
pub mod bsa;
pub mod decode;
pub mod fill;
pub mod leaf_select;
pub mod oracle;
pub mod prefill;
pub mod pyramid;
pub mod route;
pub mod select;

use crate::runtime::pipeline::ShaderSource;

/// Every shader family, for the naga validation test.
pub fn all_shaders() -> Vec<ShaderSource> {
    vec![
        attention::SHADER,
        backward::SHADER,
        backward::index::SHADER,
        fill::SHADER,
        pyramid::SHADER,
        route::SHADER,
        leaf_select::SHADER,
        bsa::SHADER,
        oracle::SHADER,
        decode::SHADER,
        decode::APPEND_SHADER,
    ]
}
