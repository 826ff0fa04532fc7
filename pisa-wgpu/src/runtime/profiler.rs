//! GPU time per stage from timestamp queries (where the adapter has TIMESTAMP_QUERY).
//!
//! Each timed compute pass writes a begin and an end timestamp; [`Profiler::finish`] resolves
//! them and sums the time per stage label. Without timestamps every method is a no-op and
//! [`StageTimes::gpu`] is false, so callers can fall back to wall-clock and say so.

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
}

impl Profiler {
    /// A profiler for up to `passes` timed passes (no-op without TIMESTAMP_QUERY).
    pub fn new(ctx: &Context, passes: u32) -> Self {
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
        }
    }

    /// A profiler that records nothing.
    pub fn disabled() -> Self {
        Self {
            set: None,
            capacity: 0,
            labels: Vec::new(),
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
        let Some(set) = self.set else {
            return Ok(StageTimes::default());
        };
        let n = self.labels.len() as u32;
        if n == 0 {
            return Ok(StageTimes {
                stages: Vec::new(),
                gpu: true,
            });
        }
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.resolve_query_set(&set, 0..2 * n, &resolve, 0);
        ctx.queue.submit([enc.finish()]);
        let bytes = ctx.read_bytes(&resolve)?;
        let ticks: &[u64] = bytemuck::cast_slice(&bytes);
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
}
