//! Errors of the GPU runtime. Every wgpu failure mode the library can meet (no adapter, device
//! request, validation, out of memory, device loss, limits) becomes a [`GpuError`] with a message
//! that says what to do, never a panic.

use pisa_core::PisaError;

/// Result alias of `pisa-wgpu`.
pub type Result<T> = std::result::Result<T, GpuError>;

/// What went wrong on the GPU side. More kinds may come: match with a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter matched (or none exists); the text says which was asked for and lists the
    /// adapters found, or how to install one when there are none.
    #[error("no GPU adapter found{0}")]
    NoAdapter(String),
    /// The adapter refused the device request.
    #[error("could not open the GPU device: {0}")]
    RequestDevice(String),
    /// wgpu reported a validation error (a bug in pisa or a limit the checks missed).
    #[error("GPU validation error in {op}: {message}")]
    Validation {
        /// Operation that was running.
        op: &'static str,
        /// wgpu's description.
        message: String,
    },
    /// The device ran out of memory.
    #[error(
        "GPU out of memory in {op}: {message}; try a shorter sequence or fewer heads per call"
    )]
    OutOfMemory {
        /// Operation that was running.
        op: &'static str,
        /// wgpu's description.
        message: String,
    },
    /// The device was lost (driver reset, removal); create a new [`crate::Context`].
    #[error("GPU device lost: {0}; create a new context")]
    DeviceLost(String),
    /// A size is above what this adapter allows, or a lower limit the caller set, and cannot be
    /// split further.
    #[error(
        "{what} needs {needed} {unit}, above the limit of {limit} {unit} in force (the device's, \
         or a lower one set on the context or cache; {hint})"
    )]
    Limit {
        /// The resource.
        what: String,
        /// Amount needed, in `unit`.
        needed: u64,
        /// The limit, in `unit`: the device's (as opened, by pisa with the adapter's limits or
        /// by the application with its own), or one an operation was given (e.g.
        /// [`crate::ops::decode::KvCache::set_workgroup_memory_limit`]).
        limit: u64,
        /// Unit of `needed` and `limit` ("bytes", "loop iterations", "elements", "bindings").
        unit: &'static str,
        /// What to do about it.
        hint: &'static str,
    },
    /// A tuning knob ([`crate::Tuning`]) with an unknown name or a value out of its range; the
    /// text names the knob (or its environment variable) and the value.
    #[error("bad tuning: {0}")]
    Tuning(String),
    /// The request is valid but this build or adapter does not support it.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A NaN or infinite input value, reported by the opt-in checks: the host-side ones
    /// ([`crate::ops::check_finite`], [`crate::ops::prefill::check_finite`]) and the GPU scan
    /// of a view ([`crate::ops::check_finite_view`] and its `_async` form); the
    /// operations themselves do not scan their inputs.
    #[error("non-finite input: {tensor} holds {value} at flat index {index} (its first non-finite value)")]
    NonFinite {
        /// The tensor, as named by the caller ("q", "k", "v", ...).
        tensor: &'static str,
        /// Flat index of the first non-finite element: in the slice as passed for the host
        /// checks (in the tensor's own layout, e.g. `((b * H + h) * N + n) * D + d` for
        /// `[B, H, N, D]` row-major); the logical `[B, H, N, D]` index in that order for a
        /// view, whatever its strides.
        index: usize,
        /// The value: NaN, `inf` or `-inf`.
        value: f32,
    },
    /// A tensor view the library cannot use ([`crate::TensorView`]): a buffer without the
    /// usage the operation needs, a range past the buffer's end, overlapping strides, a
    /// misaligned offset where one must be aligned, a shape or dtype the operation does not
    /// take. The text names the view and the problem.
    #[error("unusable tensor view: {0}")]
    View(String),
    /// A shape or configuration error from `pisa-core`.
    #[error(transparent)]
    Input(#[from] PisaError),
    /// Waiting for the GPU failed or timed out.
    #[error("waiting for the GPU failed: {0}")]
    Poll(String),
    /// Objects used together that do not belong together, or a call out of order: a
    /// [`crate::Profiler`] used with another context than the one it was made on (even on the
    /// same device), or its times read before the work it timed was submitted. The text says
    /// which and what to do.
    #[error("misuse: {0}")]
    Misuse(String),
}
