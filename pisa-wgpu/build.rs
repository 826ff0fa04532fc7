//! Names the targets where wgpu has its native Vulkan backend (wgpu-hal's `vulkan` targets), so
//! the raw-Vulkan code (runtime/checks.rs, runtime/nv.rs) says `cfg(native_vulkan)` once
//! instead of repeating the target list. Keep it equal to the target list of the `ash`
//! dependency in Cargo.toml (a cfg alias cannot be used there).
fn main() {
    cfg_aliases::cfg_aliases! {
        native_vulkan: {
            any(windows, target_os = "linux", target_os = "android", target_os = "freebsd")
        },
    }
}
