//! The allocation arena of a plan (FlashInfer's plan/run split, for operations written as
//! "allocate what you need, bind, dispatch").
//!
//! A plan runs its operation once at construction with an arena *recording*: every buffer the
//! operation creates ([`Context::alloc`], [`Context::scratch`], [`Context::uniform`], uploads
//! of small tables) and every bind group is kept, in order. Each later run *replays* the arena:
//! the same calls, in the same order, take the recorded buffers and bind groups instead of
//! creating new ones, and skip the host fill of poisoned outputs in release builds (debug
//! builds keep it, so tests still see unwritten elements). Small host writes (uniforms,
//! tables) are compared with what was recorded and written again only when they differ.
//!
//! Invariant: an operation's sequence of allocations and bindings is a function of its shape,
//! options, the context's tuning (`Context::tuning`: kernel path, leaf order, NVIDIA switches,
//! the other knobs) and its binding limit; a plan records those
//! and refuses to run once they changed ([`crate::GpuError::Unsupported`]), and a replay that
//! still meets a different request (size, usage or count) stops with an error instead of
//! binding the wrong buffer.
//!
//! A bind group is created inside its own validation and out-of-memory scopes
//! (`Context::bind_group`; native backends report at creation) and kept only when valid: a run
//! that would bind another device's buffer, or a destroyed one, stops with
//! [`GpuError::Validation`] (a failed allocation with [`GpuError::OutOfMemory`]) before it
//! records the group, and so does every later run with those buffers, instead of replaying an
//! invalid group and failing only at the application's submit. (wasm32 has no scopes that
//! resolve at once: there the error goes to the device's uncaptured-error handler when the
//! group is made, and the group is kept.)
//!
//! The arena is installed per thread ([`with_arena`]), so other threads using the same
//! context meanwhile allocate as usual.

use std::cell::RefCell;

use crate::error::{GpuError, Result};

/// Host writes up to this size are compared on replay (uniforms, index tables); larger ones
/// (poison fills) are skipped in release builds.
const COMPARE_MAX: usize = 1 << 16;

/// Alternatives kept per allocation or bind group: a plan used with several sets of views
/// (the layers of a model) keeps one per set, up to this many, then makes new ones each run.
const ALTS: usize = 16;

/// One recorded allocation: its size and usage, and the buffers made for it, each with its
/// contents when small. A replay whose contents differ takes another buffer rather than
/// overwriting one that a run recorded earlier into the same submission may still read.
#[derive(Debug)]
struct Slot {
    size: u64,
    usage: wgpu::BufferUsages,
    alts: Vec<(Option<Vec<u8>>, wgpu::Buffer)>,
}

/// A bind group's pipeline (auto layouts are per pipeline) and bindings.
type GroupKey = (wgpu::ComputePipeline, Vec<(u32, wgpu::Buffer, u64, u64)>);

/// The buffers and bind groups of one plan's recorded run.
#[derive(Default, Debug)]
pub(crate) struct Arena {
    buffers: Vec<Slot>,
    groups: Vec<Vec<(GroupKey, wgpu::BindGroup)>>,
    next_buffer: usize,
    next_group: usize,
    replay: bool,
    diverged: Option<String>,
}

struct Active {
    ctx: usize,
    arena: Arena,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// Runs `f` with `arena` installed for the context at address `ctx` on this thread: recording
/// on its first use, replaying afterwards. Errors: what `f` returns (among them the error of a
/// bind group it made that failed, `Context::bind_group`: [`GpuError::Validation`],
/// [`GpuError::OutOfMemory`]); [`GpuError::Unsupported`] when the replay met a request the
/// recording did not make.
pub(crate) fn with_arena<T>(
    ctx: usize,
    arena: &mut Arena,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let mut a = std::mem::take(arena);
    a.next_buffer = 0;
    a.next_group = 0;
    a.diverged = None;
    ACTIVE.with(|s| *s.borrow_mut() = Some(Active { ctx, arena: a }));
    // A panic in `f` (caught by the application) must not leave the arena installed: later
    // calls on this thread would take their buffers from it. The plan's own arena is then
    // empty, so its next run records again.
    struct Uninstall;
    impl Drop for Uninstall {
        fn drop(&mut self) {
            if std::thread::panicking() {
                ACTIVE.with(|s| s.borrow_mut().take());
            }
        }
    }
    let _uninstall = Uninstall;
    let out = f();
    let mut a = ACTIVE
        .with(|s| s.borrow_mut().take())
        .map(|x| x.arena)
        .unwrap_or_default();
    let replayed = a.replay;
    let mut diverged = a.diverged.take();
    if replayed
        && diverged.is_none()
        && out.is_ok()
        && (a.next_buffer != a.buffers.len() || a.next_group != a.groups.len())
    {
        diverged = Some("fewer allocations than recorded".into());
    }
    // A failed recording is not kept: the next run records again from an empty arena.
    if !a.replay && out.is_err() {
        a = Arena::default();
    }
    a.replay = a.replay || out.is_ok();
    *arena = a;
    if let Some(m) = diverged {
        return Err(GpuError::Unsupported(format!(
            "plan replay diverged from its recording ({m}): make a new plan"
        )));
    }
    out
}

fn with_active<R>(ctx: usize, f: impl FnOnce(&mut Arena) -> R) -> Option<R> {
    ACTIVE.with(|s| {
        let mut s = s.borrow_mut();
        match s.as_mut() {
            Some(a) if a.ctx == ctx => Some(f(&mut a.arena)),
            _ => None,
        }
    })
}

/// What the arena has for a buffer request.
pub(crate) enum Lookup {
    /// No arena: allocate as usual.
    None,
    /// Make the buffer (and write its contents), then [`insert_buffer`] it.
    Miss,
    /// The recorded buffer; `true` when its (large) contents must still be written.
    Hit(wgpu::Buffer, bool),
}

/// The arena's buffer for a request of `size` bytes, `usage`, host contents `contents`.
pub(crate) fn lookup_buffer(
    ctx: usize,
    size: u64,
    usage: wgpu::BufferUsages,
    contents: Option<&[u8]>,
) -> Lookup {
    with_active(ctx, |a| {
        if !a.replay || a.diverged.is_some() {
            return Lookup::Miss;
        }
        let Some(slot) = a.buffers.get(a.next_buffer) else {
            a.diverged = Some("more allocations than recorded".into());
            return Lookup::Miss;
        };
        if slot.size != size || slot.usage != usage {
            a.diverged = Some(format!(
                "allocation {} is {size} bytes {usage:?}, recorded {} bytes {:?}",
                a.next_buffer, slot.size, slot.usage
            ));
            return Lookup::Miss;
        }
        let small = contents.filter(|c| c.len() <= COMPARE_MAX);
        let hit = match small {
            Some(c) => slot.alts.iter().find(|(k, _)| k.as_deref() == Some(c)),
            None => slot.alts.first(),
        };
        match hit {
            Some((_, b)) => {
                let b = b.clone();
                a.next_buffer += 1;
                // Large fills (poison): written in debug builds only.
                Lookup::Hit(
                    b,
                    small.is_none() && contents.is_some() && cfg!(debug_assertions),
                )
            }
            None => Lookup::Miss,
        }
    })
    .unwrap_or(Lookup::None)
}

/// Whether a replay is active for `ctx` (the caller may then skip building large host
/// contents that [`lookup_buffer`] would not write).
pub(crate) fn replaying(ctx: usize) -> bool {
    with_active(ctx, |a| a.replay && a.diverged.is_none()).unwrap_or(false)
}

/// Keeps a buffer made after a [`Lookup::Miss`] (with its contents when small).
pub(crate) fn insert_buffer(
    ctx: usize,
    buffer: &wgpu::Buffer,
    usage: wgpu::BufferUsages,
    contents: Option<&[u8]>,
) {
    with_active(ctx, |a| {
        let kept = contents
            .filter(|c| c.len() <= COMPARE_MAX)
            .map(|c| c.to_vec());
        if !a.replay {
            a.buffers.push(Slot {
                size: buffer.size(),
                usage,
                alts: vec![(kept, buffer.clone())],
            });
        } else if a.diverged.is_none() {
            let slot = &mut a.buffers[a.next_buffer];
            if slot.alts.len() < ALTS {
                slot.alts.push((kept, buffer.clone()));
            }
            a.next_buffer += 1;
        }
    });
}

/// The recorded bind group for `bindings` (`None`: make one and [`insert_group`] it, or no
/// arena).
pub(crate) fn lookup_group(
    ctx: usize,
    pipeline: &wgpu::ComputePipeline,
    bindings: &[(u32, &wgpu::Buffer, u64, u64)],
) -> Option<wgpu::BindGroup> {
    with_active(ctx, |a| {
        if !a.replay || a.diverged.is_some() {
            return None;
        }
        let Some(alts) = a.groups.get(a.next_group) else {
            a.diverged = Some("more bind groups than recorded".into());
            return None;
        };
        let same = |(p, key): &GroupKey| {
            p == pipeline
                && key.len() == bindings.len()
                && key
                    .iter()
                    .zip(bindings)
                    .all(|(x, y)| x.0 == y.0 && &x.1 == y.1 && x.2 == y.2 && x.3 == y.3)
        };
        let g = alts.iter().find(|(k, _)| same(k)).map(|(_, g)| g.clone())?;
        a.next_group += 1;
        Some(g)
    })
    .flatten()
}

/// Keeps a bind group made after [`lookup_group`] found none.
pub(crate) fn insert_group(
    ctx: usize,
    pipeline: &wgpu::ComputePipeline,
    bindings: &[(u32, &wgpu::Buffer, u64, u64)],
    group: &wgpu::BindGroup,
) {
    with_active(ctx, |a| {
        let key: GroupKey = (
            pipeline.clone(),
            bindings
                .iter()
                .map(|&(i, b, o, n)| (i, b.clone(), o, n))
                .collect(),
        );
        if !a.replay {
            a.groups.push(vec![(key, group.clone())]);
        } else if a.diverged.is_none() {
            if let Some(alts) = a.groups.get_mut(a.next_group) {
                if alts.len() < ALTS {
                    alts.push((key, group.clone()));
                }
            }
            a.next_group += 1;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside a recording leaves no arena installed on the thread, and the plan's
    /// arena empty (its next run records again).
    #[test]
    fn a_panic_inside_uninstalls_the_arena() {
        let mut arena = Arena {
            replay: true,
            ..Default::default()
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_arena(7, &mut arena, || -> Result<()> {
                assert!(with_active(7, |_| ()).is_some());
                panic!("inside a recording")
            })
        }));
        assert!(r.is_err());
        assert!(
            with_active(7, |_| ()).is_none(),
            "the arena stayed installed"
        );
        assert!(!arena.replay, "the plan's arena kept a replay state");
    }
}
