//! Waiting, in one place. Native targets block on futures with `pollster` (the conveniences:
//! [`Context::new`](super::context::Context::new), host-tensor calls, readback). On wasm32 the
//! browser's event loop cannot be blocked, so every such call returns
//! [`GpuError::Unsupported`] naming it instead of blocking: there, use the async entry points
//! (`Context::new_async`, `Context::read_async`) and the plans, which record without waiting.

use std::future::Future;
use std::pin::pin;
use std::task::{Context as TaskContext, Poll, Waker};

use crate::error::{GpuError, Result};

/// Blocks on `f` (native), or refuses (wasm32).
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn block_on<F: Future>(f: F) -> Result<F::Output> {
    Ok(pollster::block_on(f))
}

/// Blocks on `f` (native), or refuses (wasm32).
#[cfg(target_arch = "wasm32")]
pub(crate) fn block_on<F: Future>(_f: F) -> Result<F::Output> {
    refuse_on_wasm("a blocking pisa call").map(|_| unreachable!())
}

/// `Err(Unsupported)` on wasm32 for the blocking call `what`; `Ok` elsewhere.
pub(crate) fn refuse_on_wasm(what: &str) -> Result<()> {
    if cfg!(target_arch = "wasm32") {
        return Err(GpuError::Unsupported(format!(
            "{what} blocks, which the browser does not allow: use the async API (Context::new_async, Context::read_async) and plans"
        )));
    }
    Ok(())
}

/// The output of `f` if it is ready at its first poll (wgpu's error scopes are, on native
/// backends), else `None`. Never waits.
pub(crate) fn ready<F: Future>(f: F) -> Option<F::Output> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut TaskContext::from_waker(Waker::noop())) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}
