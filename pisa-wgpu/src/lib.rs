//! PISA attention on the GPU through wgpu.
