//! GPU time per stage from timestamp queries (where the adapter has TIMESTAMP_QUERY).
//!
//! Each timed compute pass writes a begin and an end timestamp; [`Profiler::finish`] resolves
//! them and sums the time per stage label (the passes alone, not the gaps between them);
//! [`Profiler::finish_span`] instead gives the span of a label's passes, first begin to last
//! end, gaps included (a burst of passes recorded back to back). Without timestamps every
//! method is a no-op and [`StageTimes::gpu`] is false, so callers can fall back to wall-clock
//! and say so.

use super::context::Context;
use crate::error::Result;

/// Milliseconds per stage label, in first-seen order.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StageTimes {
    /// `(stage, milliseconds)`.
    pub stages: Vec<(String, f64)>,
    /// True when the times come from GPU timestamps.
    pub gpu: bool,
}

impl StageTimes {
    /// Sum over all stages, ms.
    pub fn total(&self) -> f64 {
        self.stages.iter().map(|s| s.1).sum()
    }
    /// Time of one stage (0 if absent), ms.
    pub fn get(&self, stage: &str) -> f64 {
        self.stages
            .iter()
            .filter(|s| s.0 == stage)
            .map(|s| s.1)
            .sum()
    }
    fn add(&mut self, stage: &str, ms: f64) {
        match self.stages.iter_mut().find(|s| s.0 == stage) {
            Some(s) => s.1 += ms,
            None => self.stages.push((stage.to_string(), ms)),
        }
    }
}

/// Collects timestamp pairs for the passes of one submission.
pub struct Profiler {
    set: Option<wgpu::QuerySet>,
    capacity: u32,
    labels: Vec<&'static str>,
    /// Passes asked for past `capacity` (recorded untimed).
    untimed: usize,
}

impl Profiler {
    /// Most timed passes of one profiler: two timestamps a pass in one query set, which wgpu
    /// caps at `wgpu::QUERY_SET_MAX_QUERIES`.
    pub const MAX_PASSES: u32 = wgpu::QUERY_SET_MAX_QUERIES / 2;

    /// A profiler for up to `passes` timed passes, at most [`Self::MAX_PASSES`] (no-op without
    /// TIMESTAMP_QUERY); passes past that are recorded untimed (see [`Self::finish_span`]).
    pub fn new(ctx: &Context, passes: u32) -> Self {
        let passes = passes.min(Self::MAX_PASSES);
        let set = ctx.has_timestamps().then(|| {
            ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("pisa timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: passes * 2,
            })
        });
        Self {
            set,
            capacity: passes,
            labels: Vec::new(),
            untimed: 0,
        }
    }

    /// A profiler that records nothing.
    pub fn disabled() -> Self {
        Self {
            set: None,
            capacity: 0,
            labels: Vec::new(),
            untimed: 0,
        }
    }

    /// Timestamp writes for the next pass, labelled `stage` (None when disabled or full).
    pub fn pass_writes(
        &mut self,
        stage: &'static str,
    ) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let set = self.set.as_ref()?;
        let i = self.labels.len() as u32;
        if i >= self.capacity {
            self.untimed += 1;
            return None;
        }
        self.labels.push(stage);
        Some(wgpu::ComputePassTimestampWrites {
            query_set: set,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }

    /// Resolves the timestamps of a finished submission (call after the work was submitted).
    pub fn finish(self, ctx: &Context) -> Result<StageTimes> {
        let Some(ticks) = self.ticks(ctx)? else {
            return Ok(StageTimes::default());
        };
        let period = ctx.queue.get_timestamp_period() as f64;
        let mut t = StageTimes {
            stages: Vec::new(),
            gpu: true,
        };
        for (i, label) in self.labels.iter().enumerate() {
            let dt = ticks[2 * i + 1].saturating_sub(ticks[2 * i]) as f64 * period * 1e-6;
            t.add(label, dt);
        }
        Ok(t)
    }

    /// Resolves the timestamps of a finished submission and returns the span of the passes
    /// labelled `stage`, ms: from the earliest begin to the latest end timestamp of those
    /// passes, so the gaps between them (pass boundaries, barriers, idle time) count, where
    /// [`Self::finish`] sums the passes alone. For a burst of steps recorded back to back in
    /// one command encoder this is the burst's GPU time, as two CUDA events around the burst
    /// would measure it. `None` without timestamps, when no pass has that label, or when a
    /// pass went untimed because more passes were recorded than the profiler was made for
    /// (the span would be cut short).
    pub fn finish_span(self, ctx: &Context, stage: &str) -> Result<Option<f64>> {
        if self.untimed > 0 {
            return Ok(None);
        }
        let Some(ticks) = self.ticks(ctx)? else {
            return Ok(None);
        };
        let period = ctx.queue.get_timestamp_period() as f64;
        Ok(span_ticks(&self.labels, &ticks, stage).map(|t| t as f64 * period * 1e-6))
    }

    /// The resolved timestamps, begin and end per timed pass (`None` without timestamps).
    fn ticks(&self, ctx: &Context) -> Result<Option<Vec<u64>>> {
        let Some(set) = &self.set else {
            return Ok(None);
        };
        let n = self.labels.len() as u32;
        if n == 0 {
            return Ok(Some(Vec::new()));
        }
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.resolve_query_set(set, 0..2 * n, &resolve, 0);
        ctx.queue.submit([enc.finish()]);
        let bytes = ctx.read_bytes(&resolve)?;
        Ok(Some(bytemuck::cast_slice(&bytes).to_vec()))
    }
}

/// Ticks from the earliest begin to the latest end of the passes labelled `stage` (`ticks`:
/// begin and end per pass, in the order of `labels`); `None` when no pass has that label.
fn span_ticks(labels: &[&str], ticks: &[u64], stage: &str) -> Option<u64> {
    let pairs = labels
        .iter()
        .zip(ticks.chunks_exact(2))
        .filter(|(l, _)| **l == stage)
        .map(|(_, t)| (t[0], t[1]));
    let (begin, end) = pairs.fold(None, |acc: Option<(u64, u64)>, (b, e)| {
        Some(acc.map_or((b, e), |(b0, e0)| (b0.min(b), e0.max(e))))
    })?;
    Some(end.saturating_sub(begin))
}

#[cfg(test)]
mod tests {
    use super::span_ticks;

    #[test]
    fn span_is_first_begin_to_last_end_of_the_label() {
        // Three "burst" passes with gaps between them, and another label in the middle.
        let labels = ["burst", "other", "burst", "burst"];
        let ticks = [100, 110, 111, 500, 120, 130, 140, 175];
        assert_eq!(span_ticks(&labels, &ticks, "burst"), Some(75));
        // Summing the passes alone (what `finish` does) would give 10 + 10 + 35 = 55.
        assert_eq!(span_ticks(&labels, &ticks, "other"), Some(389));
        assert_eq!(span_ticks(&labels, &ticks, "absent"), None);
        assert_eq!(span_ticks(&[], &[], "burst"), None);
    }
}
