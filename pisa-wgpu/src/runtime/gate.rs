//! The settings gate of a context: a change of its settings ([`Context::set_tuning`] and the
//! setters that change one knob: kernel path, leaf order, NVIDIA kernels) waits until no
//! public call of the context is running on another thread, and public calls that start while
//! a change waits or runs wait for it to end.
//!
//! Why: an operation reads the settings more than once while it plans or records (a varlen
//! plan checks that a sequence's plan is current, then records it, reading the leaf order and
//! the kernel path again), so a change landing in between made a call fail half-recorded
//! ("plan replay diverged from its recording"), or refuse a plan it had just found current.
//! With the gate a call sees one set of settings from start to end: a varlen plan re-plans
//! for settings changed between its runs, and a [`crate::PrefillPlan`] refuses, before
//! recording anything, a run under settings changed since it was planned (as documented).
//!
//! A change made inside a public call of the same context on the same thread (a callback of
//! the application's run by wgpu during the call) does not wait, as it would wait for itself.
//! Changes are preferred: a call waits while a change waits, so a stream of calls on other
//! threads cannot hold a change off for ever. On wasm32 (one thread) nothing ever waits: the
//! only call in progress when a change comes is the changing thread's own.
//!
//! [`Context::set_tuning`]: super::context::Context::set_tuning

use std::sync::{Condvar, Mutex, MutexGuard};

/// See the module docs.
#[derive(Default)]
pub(crate) struct SettingsGate {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Outermost public calls running (on any thread).
    calls: usize,
    /// Changes waiting for the calls to end.
    waiting: usize,
    /// A change is being made.
    changing: bool,
}

impl SettingsGate {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(s).unwrap_or_else(|p| p.into_inner())
    }

    /// An outermost public call starts: waits while a change waits or runs.
    pub(crate) fn enter(&self) {
        let mut s = self.lock();
        while s.changing || s.waiting > 0 {
            s = self.wait(s);
        }
        s.calls += 1;
    }

    /// An outermost public call ends.
    pub(crate) fn leave(&self) {
        let mut s = self.lock();
        s.calls = s.calls.saturating_sub(1);
        if s.calls == 0 {
            self.changed.notify_all();
        }
    }

    /// Runs `change` once no public call runs (`own_call`: this thread is inside one of this
    /// context's calls, which is not waited for; then only other changes are).
    pub(crate) fn change<T>(&self, own_call: bool, change: impl FnOnce() -> T) -> T {
        {
            let mut s = self.lock();
            s.waiting += 1;
            while s.changing || (!own_call && s.calls > 0) {
                s = self.wait(s);
            }
            s.waiting -= 1;
            s.changing = true;
        }
        // Ends the change even if `change` panics, so that no call waits for ever.
        struct Done<'a>(&'a SettingsGate);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.lock().changing = false;
                self.0.changed.notify_all();
            }
        }
        let _done = Done(self);
        change()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A change waits for a running call, and a call that starts while the change waits waits
    /// for the change.
    #[test]
    fn a_change_waits_for_running_calls_and_holds_new_ones() {
        let gate = Arc::new(SettingsGate::default());
        let changed = Arc::new(AtomicBool::new(false));
        gate.enter();
        let (g, c) = (gate.clone(), changed.clone());
        let changer =
            std::thread::spawn(move || g.change(false, || c.store(true, Ordering::SeqCst)));
        // The change is waiting (not made while the call runs).
        while gate.lock().waiting == 0 {
            std::thread::yield_now();
        }
        assert!(!changed.load(Ordering::SeqCst));
        // A new call started now waits for the change.
        let (g, c) = (gate.clone(), changed.clone());
        let caller = std::thread::spawn(move || {
            g.enter();
            let saw = c.load(Ordering::SeqCst);
            g.leave();
            saw
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!changed.load(Ordering::SeqCst));
        gate.leave();
        changer.join().unwrap();
        assert!(changed.load(Ordering::SeqCst));
        assert!(
            caller.join().unwrap(),
            "the call started before the change was made"
        );
    }

    /// A change inside the thread's own call does not wait for it; a panicking change ends.
    #[test]
    fn own_call_and_panics_do_not_block() {
        let gate = SettingsGate::default();
        gate.enter();
        assert_eq!(gate.change(true, || 7), 7);
        gate.leave();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gate.change(false, || panic!("a change that panics"))
        }));
        assert!(r.is_err());
        gate.enter();
        gate.leave();
        assert!(!gate.lock().changing);
    }
}
