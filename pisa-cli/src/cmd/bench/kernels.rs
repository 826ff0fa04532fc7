//! The attention kernel behind each attention record of `pisa bench` ([`Record::kernel`];
//! for the PISA decode step, its dispatches):
//! named by [`pisa_wgpu::ops::attention::attention_kernel`], the rule `record_attention` itself dispatches on, for the
//! arguments of the timed calls (so the name is the kernel that ran); and the table line that
//! lists them.

use std::fmt::Write as _;

use pisa_wgpu::ops::attention::AttentionKernel;

use super::report::{Record, Report};

/// The attention kernels of one prefill measurement ([`super::measure::prefill`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Kernels {
    /// The sparse attention's (op `attention`).
    pub attention: Option<AttentionKernel>,
    /// The dense attention's (op `dense`), when it was timed.
    pub dense: Option<AttentionKernel>,
}

impl Kernels {
    /// The [`Record::kernel`] of op `op`: the kernel's name for `attention` and `dense`, else
    /// `None`.
    pub fn of(&self, op: &str) -> Option<String> {
        match op {
            "attention" => self.attention.map(|k| k.name().to_string()),
            "dense" => self.dense.map(|k| k.name().to_string()),
            _ => None,
        }
    }
}

/// The names of `kernels`, each once, in order, joined by `+` (calls split over several
/// caches may differ); `None` for none.
pub fn names(kernels: impl IntoIterator<Item = AttentionKernel>) -> Option<String> {
    let mut seen: Vec<&str> = Vec::new();
    for k in kernels {
        if !seen.contains(&k.name()) {
            seen.push(k.name());
        }
    }
    (!seen.is_empty()).then(|| seen.join("+"))
}

/// The table line naming the attention kernels of storage `st`'s records: per op, each kernel
/// with the sizes that ran it where they differ, e.g. `attention kernels: attention
/// portable-tile; decode_dense split-k`. `None` when no record names one (files written before
/// [`Record::kernel`] existed).
pub fn note(r: &Report, st: &str) -> Option<String> {
    let mut parts = Vec::new();
    for op in ["attention", "dense", "decode_pisa", "decode_dense"] {
        let mut by_kernel: Vec<(&str, Vec<usize>)> = Vec::new();
        let recs = r.records.iter().filter(|x| x.storage == st && x.op == op);
        for (k, n) in recs.filter_map(|x: &Record| Some((x.kernel.as_deref()?, x.n))) {
            match by_kernel.iter_mut().find(|e| e.0 == k) {
                Some(e) => e.1.push(n),
                None => by_kernel.push((k, vec![n])),
            }
        }
        let mut part = op.to_string();
        for (i, (k, ns)) in by_kernel.iter().enumerate() {
            let _ = write!(part, "{} {k}", if i == 0 { "" } else { "," });
            if by_kernel.len() > 1 {
                let ns: Vec<String> = ns.iter().map(usize::to_string).collect();
                let _ = write!(part, " (N {})", ns.join(", "));
            }
        }
        if !by_kernel.is_empty() {
            parts.push(part);
        }
    }
    (!parts.is_empty()).then(|| format!("attention kernels: {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pisa_wgpu::KernelPath;

    #[test]
    fn names_each_kernel_once() {
        use AttentionKernel::*;
        assert_eq!(names([]), None);
        assert_eq!(names([SplitK, SplitK]).as_deref(), Some("split-k"));
        let ks = [SplitK, PortableTile, SplitK];
        assert_eq!(names(ks).as_deref(), Some("split-k+portable-tile"));
        let lm = LeafMajor(KernelPath::CoopMat);
        let k = Kernels {
            attention: Some(lm),
            dense: None,
        };
        assert_eq!(k.of("attention").as_deref(), Some("leaf-major-coopmat"));
        assert_eq!(k.of("dense"), None);
        assert_eq!(k.of("pyramid"), None);
    }

    #[test]
    fn note_lists_kernels_by_op_with_sizes_where_they_differ() {
        let rec = |op: &str, n, st: &str, kernel: Option<&str>| Record {
            op: op.into(),
            n,
            storage: st.into(),
            ms: 1.0,
            reps: 1,
            gpu_timed: true,
            tflops: None,
            gbps: None,
            path: "portable".into(),
            kernel: kernel.map(Into::into),
        };
        let mut r = Report {
            adapter: "a".into(),
            vendor: 0,
            backend: "b".into(),
            driver: "d".into(),
            command: "c".into(),
            shape: "s".into(),
            params: None,
            records: vec![
                rec("route", 128, "f32", None),
                rec("attention", 128, "f32", Some("portable-tile")),
                rec("attention", 4096, "f32", Some("portable-tile")),
                rec("dense", 128, "f32", Some("portable-tile")),
                rec("dense", 4096, "f32", Some("split-k")),
                rec("decode_dense", 4096, "f16", Some("split-k")),
            ],
            decode_burst: 10,
        };
        let want = "attention kernels: attention portable-tile; dense portable-tile (N 128), \
                    split-k (N 4096)";
        assert_eq!(note(&r, "f32").as_deref(), Some(want));
        let want = "attention kernels: decode_dense split-k";
        assert_eq!(note(&r, "f16").as_deref(), Some(want));
        r.records.iter_mut().for_each(|x| x.kernel = None);
        assert_eq!(note(&r, "f32"), None);
    }
}
