// Extensions every NVIDIA cooperative-matrix-2 kernel uses (VK_NV_cooperative_matrix2:
// workgroup-scope matrices, tensor-addressed loads and stores, row reductions, per-element
// operations). Built by tools/spirv into shaders/nv/spv; see runtime/nv.rs for the device.
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require

#define CLAMP gl_CooperativeMatrixClampModeConstantNV

// Binding numbers: wgpu's Vulkan backend gives the bindings of a bind group layout dense Vulkan
// binding numbers in order of their wgpu binding numbers (wgpu-hal 30, vulkan/device.rs,
// create_bind_group_layout) and rewrites the WGSL shaders to match, but not a passthrough
// module. So a kernel whose host binds wgpu bindings 0, 1, 7 declares bindings 0, 1, 2 here;
// runtime/nv.rs checks every binding a module declares against its layout (set 0, in range,
// uniform or storage buffer as the layout says).
