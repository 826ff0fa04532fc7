//! Kernel paths: the [`KernelPath`] a context runs and the cooperative-matrix (tensor-core)
//! support check [`coop_supported`] that decides whether [`KernelPath::CoopMat`] is available.

/// Which family of attention kernels a context runs (chosen at [`Context::new`] from the
/// adapter's features; see [`Context::kernel_path`]).
///
/// [`Context::new`]: super::context::Context::new
/// [`Context::kernel_path`]: super::context::Context::kernel_path
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum KernelPath {
    /// The portable WGSL kernels (any adapter, lavapipe included).
    Portable,
    /// Tensor cores through WGSL cooperative matrices (`coop_mat16x16`, f16 inputs, f32
    /// accumulators) for f16-storage attention; everything else stays portable.
    CoopMat,
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KernelPath::Portable => "portable",
            KernelPath::CoopMat => "coopmat",
        })
    }
}

/// Subgroups per workgroup of the cooperative-matrix kernels.
pub const COOP_SUBGROUPS: u32 = 4;

/// Whether a device with these features, limits, subgroup sizes and cooperative-matrix
/// configurations can run the cooperative-matrix kernels: EXPERIMENTAL_COOPERATIVE_MATRIX,
/// SHADER_F16 and SUBGROUP enabled, a 16x16x16 configuration with f16 inputs and f32
/// accumulators, one fixed subgroup size (min = max, 4..=64, so the workgroup's subgroup count
/// is known), [`COOP_SUBGROUPS`] subgroups per workgroup within the invocation limit, and at
/// least 16 KiB of workgroup memory.
pub fn coop_supported(
    features: wgpu::Features,
    limits: &wgpu::Limits,
    subgroup_size: (u32, u32),
    props: &[wgpu::CooperativeMatrixProperties],
) -> bool {
    let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    let f16_f32 = props.iter().any(|p| {
        (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    });
    let (lo, hi) = subgroup_size;
    features.contains(need)
        && f16_f32
        && lo == hi
        && (4..=64).contains(&lo)
        && lo * COOP_SUBGROUPS <= limits.max_compute_invocations_per_workgroup
        && lo * COOP_SUBGROUPS <= limits.max_compute_workgroup_size_x
        && limits.max_compute_workgroup_storage_size >= 16 * 1024
}

/// How stage 2 of PISA prefill selection (exact-LSE leaf scoring) and block-sparse attention
/// walk their work (see [`Context::leaf_order`]).
///
/// [`Context::leaf_order`]: super::context::Context::leaf_order
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum LeafOrder {
    /// The default: [`LeafOrder::Leaves`] where the kernels run on tensor cores and the
    /// leaf-major plan fits (buffers within the binding limit, workgroup memory, 16-byte
    /// aligned strides; for attention also at least 512 queries), else [`LeafOrder::Tiles`],
    /// but for a stage whose tile kernel does not fit the device (workgroup memory, loop
    /// cap), which then runs leaf-major where that fits.
    Auto,
    /// Query tiles (PISA.md 5): a workgroup per Qtile consecutive queries over the union of
    /// their candidates (stage 2) or selected leaves (attention).
    Tiles,
    /// Leaf-major: candidates (or the selection) bucketed by (b, KV head, leaf); a workgroup
    /// per chunk of a leaf's queries computes only rows that listed it, and attention merges the
    /// per-leaf partial states per query (on tensor cores where they exist, else the portable
    /// kernels; query tiles only where neither plan fits).
    Leaves,
}
