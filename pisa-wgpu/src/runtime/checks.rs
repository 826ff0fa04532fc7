//! The shader runtime checks the library's pipelines are built with, chosen per device.
//!
//! naga bounds-checks two kinds of indexing (its `BoundsCheckPolicies`): `buffer`, arrays in
//! storage and uniform buffers, and `index`, every other array (workgroup, private and function
//! memory). wgpu-hal's Vulkan backend already leaves `buffer` unchecked in the shader when the
//! device has `robustBufferAccess2` (VK_EXT_robustness2): the driver bounds every buffer access,
//! reads past a binding give zero, writes past it are dropped (wgpu-hal 30,
//! `vulkan/adapter.rs`, `bounds_check_policies`). What bounds checks add to our shaders on such
//! a device is only naga's `Restrict` clamp (a `min`) on every workgroup and private array
//! index, and that clamp costs 8-19% of every hot kernel on the H200 (route 128.1 -> 115.0 ms,
//! leaf scoring 163.3 -> 132.8 ms, sparse attention 220.9 -> 204.2 ms at 256K tokens:
//! `docs/benchmarks.md`, A.9: 2026-11-30, commit 4aba936), likely because it keeps the driver
//! from merging the staging stores.
//!
//! So, by default ([`ShaderChecks::for_device`]):
//! - with `robustBufferAccess2`: [`ShaderChecks::DriverBounded`], no checks in the shader.
//!   Buffer accesses stay bounded exactly as with wgpu's own default. Workgroup and private
//!   array indices are not clamped: each kernel keeps them in range by its own invariants
//!   (sizes from the host's plan, e.g. the route's `min(n, K) * g + g - 1 < MC`), which the
//!   reference tests exercise. An index out of range there would be undefined behaviour
//!   (wgpu's contract for unchecked shaders), not a clamped read;
//! - elsewhere (Metal, DX12, Vulkan without it): [`ShaderChecks::Bounds`], naga's bounds checks.
//!
//! Loop bounding and integer-division guards are off in both: the loop counters naga adds stop
//! NVIDIA's compiler from unrolling (sparse attention at 16K tokens: 543 ms with them, 84 ms
//! without), and our loops are counted loops over host-validated sizes, our divisors sizes the
//! host checked to be non-zero. [`crate::Tuning::shader_checks`] (`PISA_SHADER_CHECKS` for
//! [`crate::Context::new`]) overrides the choice for a context:
//! `all` (wgpu's default, every check), `bounds`, `none` (no checks even without the driver's
//! bounds: a diagnostic).

/// The runtime checks of the library's shaders (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShaderChecks {
    /// wgpu's default: bounds checks, loop bounding, integer-division guards.
    All,
    /// naga's bounds checks (array indices clamped; buffer indices too, unless wgpu-hal leaves
    /// them to the driver's robustBufferAccess2); no loop bounding or division guards.
    Bounds,
    /// No checks in the shader: the driver bounds buffer accesses (`robustBufferAccess2`).
    DriverBounded,
    /// No checks at all, with no driver bounds either (`shader_checks = none` on a device
    /// without `robustBufferAccess2`).
    None,
}

impl std::fmt::Display for ShaderChecks {
    /// The name `pisa bench` records (`all`, `bounds`, `driver_bounded`, `none`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::All => "all",
            Self::Bounds => "bounds",
            Self::DriverBounded => "driver_bounded",
            Self::None => "none",
        })
    }
}

impl ShaderChecks {
    /// The checks for a device whose driver does (`driver_bounds`) or does not bound buffer
    /// accesses: [`Self::DriverBounded`] or [`Self::Bounds`].
    pub fn for_device(driver_bounds: bool) -> Self {
        Self::choose(None, driver_bounds)
    }

    /// The checks `asked` for ([`crate::Tuning::shader_checks`]) on such a device: `All` and
    /// `Bounds` as asked; `None` only where the driver does not bound buffers (where it does,
    /// `DriverBounded` is the same shader code); `DriverBounded` only where it does (else
    /// `Bounds`: never fewer checks than the driver's bounds need); unset: [`Self::for_device`].
    pub fn choose(asked: Option<ShaderChecks>, driver_bounds: bool) -> Self {
        match (asked, driver_bounds) {
            (Some(Self::All), _) => Self::All,
            (Some(Self::Bounds), _) => Self::Bounds,
            (Some(Self::None), false) => Self::None,
            (_, true) => Self::DriverBounded,
            (_, false) => Self::Bounds,
        }
    }

    /// wgpu's runtime checks for this choice.
    pub fn runtime_checks(self) -> wgpu::ShaderRuntimeChecks {
        match self {
            Self::All => wgpu::ShaderRuntimeChecks::checked(),
            Self::Bounds => {
                let mut c = wgpu::ShaderRuntimeChecks::checked();
                c.force_loop_bounding = false;
                c.int_div_checks = false;
                c
            }
            Self::DriverBounded | Self::None => wgpu::ShaderRuntimeChecks::unchecked(),
        }
    }
}

/// Whether `adapter` (a Vulkan adapter) has `robustBufferAccess2` and `device`, opened on it,
/// enabled VK_EXT_robustness2: the condition under which wgpu-hal enables the feature and leaves
/// buffer bounds to the driver. The feature is read as wgpu-hal reads it, through
/// VK_KHR_get_physical_device_properties2 (wgpu-hal queries no robustness2 feature without that
/// instance extension, so neither do we). False on every other backend, and on targets where
/// wgpu has no native Vulkan backend.
pub(crate) fn driver_bounds_buffers(adapter: &wgpu::Adapter, device: &wgpu::Device) -> bool {
    #[cfg(native_vulkan)]
    {
        use ash::khr::get_physical_device_properties2 as props2;
        use wgpu::hal::api::Vulkan;
        let robustness2 = c"VK_EXT_robustness2";
        // SAFETY: the raw handles are only read (extension lists, one feature query), never
        // stored, while `adapter` and `device` are alive.
        unsafe {
            let Some(dev) = device.as_hal::<Vulkan>() else {
                return false;
            };
            if !dev.enabled_device_extensions().contains(&robustness2) {
                return false;
            }
            let Some(ad) = adapter.as_hal::<Vulkan>() else {
                return false;
            };
            let shared = ad.shared_instance();
            if !shared.extensions().contains(&props2::NAME) {
                return false;
            }
            let query = props2::Instance::new(shared.entry(), shared.raw_instance());
            let mut r2 = ash::vk::PhysicalDeviceRobustness2FeaturesEXT::default();
            let mut f2 = ash::vk::PhysicalDeviceFeatures2::default().push_next(&mut r2);
            query.get_physical_device_features2(ad.raw_physical_device(), &mut f2);
            r2.robust_buffer_access2 != 0
        }
    }
    #[cfg(not(native_vulkan))]
    {
        let _ = (adapter, device);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::ShaderChecks as C;

    #[test]
    fn an_asked_choice_overrides_and_none_needs_no_driver_bounds() {
        assert_eq!(C::choose(None, true), C::DriverBounded);
        assert_eq!(C::choose(None, false), C::Bounds);
        assert_eq!(C::choose(Some(C::All), true), C::All);
        assert_eq!(C::choose(Some(C::Bounds), true), C::Bounds);
        assert_eq!(C::choose(Some(C::None), true), C::DriverBounded);
        assert_eq!(C::choose(Some(C::None), false), C::None);
        assert_eq!(C::choose(Some(C::DriverBounded), false), C::Bounds);
        let b = C::Bounds.runtime_checks();
        assert!(b.bounds_checks && !b.force_loop_bounding);
        assert!(!C::DriverBounded.runtime_checks().bounds_checks);
        assert!(C::All.runtime_checks().force_loop_bounding);
    }
}
