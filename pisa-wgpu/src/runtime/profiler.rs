//! GPU time per stage from timestamp queries (where the adapter has TIMESTAMP_QUERY).
//!
//! Built on `wgpu-profiler` (its pass timestamp queries, query pools, resolve and readback);
//! this module keeps pisa's stage labels, the pass cap of a recording and the two ways of
//! reading the times.
//!
//! Each timed compute pass writes a begin and an end timestamp; [`Profiler::finish`] resolves
//! them and sums the time per stage label (the passes alone, not the gaps between them);
//! [`Profiler::finish_span`] instead gives the span of a label's passes, first begin to last
//! end, gaps included (a burst of passes recorded back to back). Both block on the readback;
//! [`Profiler::finish_async`] and [`Profiler::finish_span_async`] await it (the browser).
//! Without timestamps every method is a no-op and [`StageTimes::gpu`] is false, so callers
//! can fall back to wall-clock and say so.

use super::context::Context;
use crate::error::{GpuError, Result};

/// Milliseconds per stage label, in first-seen order.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StageTimes {
    /// `(stage, milliseconds)`.
    pub stages: Vec<(String, f64)>,
    /// True when the times come from GPU timestamps.
    pub gpu: bool,
    /// Passes recorded past the profiler's capacity, untimed: where this is not 0, the stages'
    /// times (and [`Self::total`]) leave them out.
    #[serde(skip_serializing_if = "is_zero")]
    pub untimed: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl StageTimes {
    /// Sum over all stages, ms (0 without stages: Rust's sum of no f64 is -0).
    pub fn total(&self) -> f64 {
        self.stages.iter().fold(0.0, |t, s| t + s.1)
    }
    /// Time of one stage (+0 if absent), ms.
    pub fn get(&self, stage: &str) -> f64 {
        self.stages
            .iter()
            .filter(|s| s.0 == stage)
            .fold(0.0, |t, s| t + s.1)
    }
    /// Whether stage `stage` was timed.
    pub fn has(&self, stage: &str) -> bool {
        self.stages.iter().any(|s| s.0 == stage)
    }
    /// Time of sparse attention, ms: the "attention" stage, plus leaf-major attention's parts
    /// where it was timed in parts ([`crate::ops::attention::by_leaf::PARTS`]).
    pub fn attention(&self) -> f64 {
        let parts = crate::ops::attention::by_leaf::PARTS;
        self.get("attention") + parts.iter().map(|s| self.get(s)).sum::<f64>()
    }
    fn add(&mut self, stage: &str, ms: f64) {
        match self.stages.iter_mut().find(|s| s.0 == stage) {
            Some(s) => s.1 += ms,
            None => self.stages.push((stage.to_string(), ms)),
        }
    }
}

/// Timed compute passes of one recording and their times, on `wgpu-profiler`'s
/// [`GpuProfiler`](wgpu_profiler::GpuProfiler) (pass timestamp queries, resolved and read back
/// by it). Make one per recording, time passes with [`Profiler::compute_pass`], submit, then
/// [`Profiler::finish`] or [`Profiler::finish_span`].
pub struct Profiler {
    inner: Option<wgpu_profiler::GpuProfiler>,
    /// The context whose operations it times (its [`Context`]'s identity; `None` when
    /// disabled). Not the device: wgpu compares devices by an index that devices of two
    /// instances can share, and a pass given another device's query set panics inside
    /// wgpu-core (30.0) instead of failing validation.
    ctx_id: Option<usize>,
    /// Passes of another context's operations it was handed (recorded untimed; `finish`
    /// refuses).
    foreign: usize,
    /// One word, 1 when made, cleared by a command recorded before the first timed pass: still
    /// 1 at `finish` means the encoder holding the passes was not submitted, so their queries
    /// are not resolved (resolving queries that were never written may wait forever on some
    /// drivers: Vulkan's copy of query results waits for them to become available).
    submitted: Option<wgpu::Buffer>,
    capacity: u32,
    /// Labels of the timed passes, in recording order.
    labels: Vec<&'static str>,
    /// Passes asked for past `capacity` (recorded untimed).
    untimed: usize,
}

impl Profiler {
    /// Most timed passes of one profiler (the cap of the `pisa bench` recordings: two
    /// timestamps a pass, as one wgpu query set holds).
    pub const MAX_PASSES: u32 = wgpu::QUERY_SET_MAX_QUERIES / 2;

    /// A profiler for up to `passes` timed passes, at most [`Self::MAX_PASSES`] (no-op without
    /// TIMESTAMP_QUERY); passes past that are recorded untimed (see [`Self::finish_span`]).
    /// A prefill run takes about ten passes per chunk of KV heads (a pass per stage, three
    /// for leaf-major attention; a plan runs as one chunk), a decode step one, an append one:
    /// size `passes` for the runs recorded before [`Self::finish`] (pisa's own host
    /// conveniences ask for 512).
    pub fn new(ctx: &Context, passes: u32) -> Self {
        let settings = wgpu_profiler::GpuProfilerSettings {
            enable_timer_queries: ctx.has_timestamps(),
            enable_debug_groups: false,
            max_num_pending_frames: 1,
        };
        Self {
            inner: ctx
                .has_timestamps()
                .then(|| wgpu_profiler::GpuProfiler::new(&ctx.device, settings).ok())
                .flatten(),
            ctx_id: Some(ctx.id()),
            foreign: 0,
            submitted: ctx.has_timestamps().then(|| {
                let b = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("profiler submitted mark"),
                    size: 4,
                    // (STORAGE: finish_async reads it through a view, Context::read_async)
                    usage: wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: true,
                });
                if let Ok(mut m) = b.slice(..).get_mapped_range_mut() {
                    m.copy_from_slice(&1u32.to_le_bytes());
                }
                b.unmap();
                b
            }),
            capacity: passes.min(Self::MAX_PASSES),
            labels: Vec::new(),
            untimed: 0,
        }
    }

    /// A profiler that records nothing.
    pub fn disabled() -> Self {
        Self {
            inner: None,
            ctx_id: None,
            foreign: 0,
            submitted: None,
            capacity: 0,
            labels: Vec::new(),
            untimed: 0,
        }
    }

    /// Timed passes this profiler still records (0 when disabled or without timestamps): a
    /// recorder that can time its work in parts or as one pass asks before choosing.
    pub fn remaining(&self) -> u32 {
        match self.inner {
            Some(_) => self.capacity.saturating_sub(self.labels.len() as u32),
            None => 0,
        }
    }

    /// [`Self::compute_pass`] for a library operation of `ctx`: a pass of another context
    /// than the profiler's is recorded untimed (on another device, its timestamp writes would
    /// fail the application's submission, or panic inside wgpu) and counted, so that
    /// [`Self::finish`] refuses.
    pub(crate) fn pass_on<'e>(
        &mut self,
        ctx: &Context,
        enc: &'e mut wgpu::CommandEncoder,
        stage: &'static str,
    ) -> wgpu::ComputePass<'e> {
        if self.ctx_id.is_some_and(|id| id != ctx.id()) {
            self.foreign += 1;
            return enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(stage),
                timestamp_writes: None,
            });
        }
        self.compute_pass(enc, stage)
    }

    /// Begins a compute pass on `enc`, timed as `stage` (its begin and end timestamps are
    /// written by the pass itself; untimed when disabled or full). `enc` must be of the
    /// device of the profiler's context.
    pub fn compute_pass<'e>(
        &mut self,
        enc: &'e mut wgpu::CommandEncoder,
        stage: &'static str,
    ) -> wgpu::ComputePass<'e> {
        let full = self.labels.len() as u32 >= self.capacity;
        if let (true, Some(_), Some(mark)) = (self.labels.is_empty(), &self.inner, &self.submitted)
        {
            enc.clear_buffer(mark, 0, None);
        }
        let query = match &self.inner {
            Some(p) if !full => Some(p.begin_pass_query(stage, enc)),
            Some(_) => {
                self.untimed += 1;
                None
            }
            None => None,
        };
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(stage),
            timestamp_writes: query
                .as_ref()
                .and_then(|q| q.compute_pass_timestamp_writes()),
        });
        if let (Some(p), Some(q)) = (&self.inner, query) {
            // A pass query's timestamps are the pass's own writes: closing it records nothing.
            p.end_query(&mut pass, q);
            self.labels.push(stage);
        }
        pass
    }

    /// Resolves the timestamps of a finished submission (call after the work was submitted).
    /// Sums the time of the passes per label, ms. Without timestamps: empty, `gpu` false.
    /// Passes recorded past the profiler's capacity are not timed (a warning says how many):
    /// their stages are under-reported. Blocks until the timestamps are read back; in a
    /// browser use [`Self::finish_async`].
    ///
    /// Errors: [`GpuError::Misuse`] when the profiler was handed to operations of another
    /// context than the one it was made on, or `ctx` is another (the passes of such
    /// operations go untimed; make a profiler per context, even on a shared device), or it is
    /// asked for its times before the work
    /// it timed was submitted (its passes' timestamps were never written);
    /// [`GpuError::Poll`] when reading the timestamps fails; [`GpuError::Unsupported`] on
    /// wasm32 with timestamps (it would wait for their readback, which a browser does not
    /// allow).
    pub fn finish(mut self, ctx: &Context) -> Result<StageTimes> {
        let results = self.results(ctx)?;
        Ok(self.stage_times(results))
    }

    /// [`Self::finish`] without blocking, for the browser (and async native code): the
    /// timestamps' readback is awaited, not waited for. Errors: those of [`Self::finish`] but
    /// `Unsupported`; in a browser, [`GpuError::Poll`] also when the readback did not complete
    /// within a bounded number of event-loop turns.
    pub async fn finish_async(mut self, ctx: &Context) -> Result<StageTimes> {
        let results = self.results_async(ctx).await?;
        Ok(self.stage_times(results))
    }

    /// Resolves the timestamps of a finished submission and returns the span of the passes
    /// labelled `stage`, ms: from the earliest begin to the latest end timestamp of those
    /// passes, so the gaps between them (pass boundaries, barriers, idle time) count, where
    /// [`Self::finish`] sums the passes alone. For a burst of steps recorded back to back in
    /// one command encoder this is the burst's GPU time, as two CUDA events around the burst
    /// would measure it. `None` without timestamps, when no pass has that label, or when a
    /// pass went untimed because more passes were recorded than the profiler was made for
    /// (the span would be cut short). Errors: those of [`Self::finish`].
    pub fn finish_span(mut self, ctx: &Context, stage: &str) -> Result<Option<f64>> {
        if self.span_cut_short(ctx)? {
            return Ok(None);
        }
        let results = self.results(ctx)?;
        Ok(results.and_then(|r| span_ms(&self.labels, &r, stage)))
    }

    /// [`Self::finish_span`] without blocking, as [`Self::finish_async`].
    pub async fn finish_span_async(mut self, ctx: &Context, stage: &str) -> Result<Option<f64>> {
        if self.span_cut_short(ctx)? {
            return Ok(None);
        }
        let results = self.results_async(ctx).await?;
        Ok(results.and_then(|r| span_ms(&self.labels, &r, stage)))
    }

    /// Whether a span would be cut short (a pass went untimed: [`Self::finish_span`] is then
    /// `None`), after the checks of the results (a profiler of another context is refused
    /// first).
    fn span_cut_short(&self, ctx: &Context) -> Result<bool> {
        self.check_results(ctx)?;
        Ok(self.untimed > 0)
    }

    /// The stage sums of `results` (`None`: no timestamps, empty and `gpu` false).
    fn stage_times(&self, results: Option<Vec<(f64, f64)>>) -> StageTimes {
        if self.untimed > 0 {
            log::warn!(
                "{} passes past the profiler's capacity of {} went untimed: their stages' times \
                 are under-reported",
                self.untimed,
                self.capacity
            );
        }
        let Some(results) = results else {
            return StageTimes::default();
        };
        let mut t = StageTimes {
            stages: Vec::new(),
            gpu: true,
            untimed: self.untimed,
        };
        for (label, r) in self.labels.iter().zip(&results) {
            t.add(label, r.1 - r.0);
        }
        t
    }

    /// `(begin, end)` ms of every timed pass in recording order, `None` without timestamps,
    /// blocking on the readback. Errors: those of [`Self::finish`].
    fn results(&mut self, ctx: &Context) -> Result<Option<Vec<(f64, f64)>>> {
        if !self.check_results(ctx)? {
            return Ok(self.inner.as_ref().map(|_| Vec::new()));
        }
        // (named here: the wait below would name Context::wait, not the caller's call)
        super::block::refuse_on_wasm("Profiler::finish (reading the timestamps back)")?;
        if let Some(mark) = &self.submitted {
            self.check_submitted(ctx.read_bytes(mark)?)?;
        }
        self.resolve(ctx)?;
        loop {
            ctx.wait()?;
            if let Some(t) = self.read_frame(ctx)? {
                return Ok(Some(t));
            }
        }
    }

    /// [`Self::results`] awaiting the readback: each turn awaits a read of the submitted mark
    /// ([`Context::read_async`], queued after the timestamps' resolve and mapping), which in a
    /// browser yields to the event loop that completes the mappings, and natively polls the
    /// device.
    async fn results_async(&mut self, ctx: &Context) -> Result<Option<Vec<(f64, f64)>>> {
        if !self.check_results(ctx)? {
            return Ok(self.inner.as_ref().map(|_| Vec::new()));
        }
        let Some(mark) = self.submitted.clone() else {
            return Ok(None);
        };
        let view = crate::TensorView::new(&mark, 0, crate::DType::I32, [1; 4], [1; 4])?;
        self.check_submitted(ctx.read_async(&view).await?)?;
        self.resolve(ctx)?;
        // (a bound on the turns, so that a readback that never completes is an error, not a
        // page that waits for ever: each turn is a queue round trip)
        for _ in 0..1000 {
            ctx.read_async(&view).await?;
            if let Some(t) = self.read_frame(ctx)? {
                return Ok(Some(t));
            }
        }
        Err(GpuError::Poll(
            "profiler timestamps: not read back after 1000 queue round trips".into(),
        ))
    }

    /// Whether there are timestamps to read: `false` without timestamps or timed passes.
    /// Errors: [`GpuError::Misuse`] for a profiler of another context.
    fn check_results(&self, ctx: &Context) -> Result<bool> {
        if self.foreign > 0 || self.ctx_id.is_some_and(|id| id != ctx.id()) {
            return Err(GpuError::Misuse(format!(
                "a profiler used with another context than the one it was made on ({} passes went untimed); make the profiler with Profiler::new on the context whose operations it times",
                self.foreign
            )));
        }
        Ok(self.inner.is_some() && !self.labels.is_empty())
    }

    /// Errors ([`GpuError::Misuse`]) when the submitted mark read back as `mark` is still set:
    /// the encoder holding the timed passes was not submitted.
    fn check_submitted(&self, mark: Vec<u8>) -> Result<()> {
        if mark != [0; 4] {
            return Err(GpuError::Misuse(format!(
                "profiler times read before the work they time ran (the encoder holding its {} passes, from `{}` on, was not submitted): submit it, then call finish",
                self.labels.len(),
                self.labels[0]
            )));
        }
        Ok(())
    }

    /// Submits the resolve of the timestamp queries and asks for their readback.
    fn resolve(&mut self, ctx: &Context) -> Result<()> {
        let Some(p) = self.inner.as_mut() else {
            return Ok(());
        };
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        p.resolve_queries(&mut enc);
        ctx.queue.submit([enc.finish()]);
        p.end_frame()
            .map_err(|e| crate::GpuError::Poll(format!("timestamps: {e}")))
    }

    /// The timestamps, ms, once their readback has completed (`None` before).
    fn read_frame(&mut self, ctx: &Context) -> Result<Option<Vec<(f64, f64)>>> {
        let Some(p) = self.inner.as_mut() else {
            return Ok(None);
        };
        let Some(r) = p.process_finished_frame(ctx.queue.get_timestamp_period()) else {
            return Ok(None);
        };
        let times: Vec<(f64, f64)> = r
            .iter()
            .map(|q| {
                q.time
                    .clone()
                    .map_or((0.0, 0.0), |t| (t.start * 1e3, t.end * 1e3))
            })
            .collect();
        // A timestamp the GPU wrote is a clock reading, never 0; a pass whose timestamps are
        // both 0 was never run: the application's encoder holding it was not submitted (yet).
        if let Some(i) = times.iter().position(|t| t.0 == 0.0 && t.1 == 0.0) {
            return Err(GpuError::Misuse(format!(
                "profiler times read before the work they time ran (pass {i}, `{}`, has no timestamps): submit the encoder the operations recorded into, then call finish",
                self.labels[i]
            )));
        }
        Ok(Some(times))
    }
}

/// The span of the passes labelled `stage`: earliest begin to latest end, ms.
fn span_ms(labels: &[&str], times: &[(f64, f64)], stage: &str) -> Option<f64> {
    let (begin, end) = labels
        .iter()
        .zip(times)
        .filter(|(l, _)| **l == stage)
        .map(|(_, t)| *t)
        .fold(None, |acc: Option<(f64, f64)>, (b, e)| {
            Some(acc.map_or((b, e), |(b0, e0)| (b0.min(b), e0.max(e))))
        })?;
    Some((end - begin).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::{span_ms, StageTimes};

    /// No stages (a device without timestamp queries) total +0, not -0.
    #[test]
    fn total_of_no_stages_is_positive_zero() {
        let t = StageTimes {
            stages: vec![],
            gpu: false,
            untimed: 0,
        };
        assert!(t.total() == 0.0 && t.total().is_sign_positive());
        let t = StageTimes {
            stages: vec![("a".into(), 1.5), ("b".into(), 2.0)],
            gpu: true,
            untimed: 0,
        };
        assert_eq!(t.total(), 3.5);
    }

    #[test]
    fn span_is_first_begin_to_last_end_of_the_label() {
        // Three "burst" passes with gaps between them, and another label in the middle.
        let labels = ["burst", "other", "burst", "burst"];
        let times = [
            (100.0, 110.0),
            (111.0, 500.0),
            (120.0, 130.0),
            (140.0, 175.0),
        ];
        assert_eq!(span_ms(&labels, &times, "burst"), Some(75.0));
        // Summing the passes alone (what `finish` does) would give 10 + 10 + 35 = 55.
        assert_eq!(span_ms(&labels, &times, "other"), Some(389.0));
        assert_eq!(span_ms(&labels, &times, "absent"), None);
        assert_eq!(span_ms(&[], &[], "burst"), None);
    }
}
