//! Library input validation: every validating constructor of `pisa-core` returns a
//! typed [`PisaError`] naming the bad value, and its `Display` names the accepted range.
//! Inputs at the edges of `usize` must give an error, never a panic or a wrapped size.
#![cfg(feature = "alloc")] // the CPU reference needs `alloc`

use pisa_core::reference::{dense_attention, sparse_attention, DecodeState};
use pisa_core::{
    grid_for, AttentionShape, PisaError, PyramidLayout, Schedule, SelectionConfig, TensorLayout,
};

/// Runs `f`, turning a panic into `Err(message)`, so one test can check many edge inputs and
/// report every one that panics.
fn no_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

#[test]
fn shape_zero_sizes_are_named() {
    let names = ["batch", "q_heads", "kv_heads", "q_len", "k_len", "head_dim"];
    for (i, want) in names.iter().enumerate() {
        let mut d = [1usize, 2, 1, 3, 4, 64];
        d[i] = 0;
        let e = AttentionShape::new(d[0], d[1], d[2], d[3], d[4], d[5]).unwrap_err();
        assert_eq!(e, PisaError::Zero { what: want });
        let msg = e.to_string();
        assert!(msg.contains(want) && msg.contains("at least 1"), "{msg}");
    }
}

#[test]
fn shape_gqa_and_lengths() {
    let e = AttentionShape::new(1, 6, 4, 8, 8, 64).unwrap_err();
    assert_eq!(
        e,
        PisaError::GqaNotDivisible {
            q_heads: 6,
            kv_heads: 4
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains('6') && msg.contains('4') && msg.contains("multiple"),
        "{msg}"
    );
    // kv_heads > q_heads is also not a divisor.
    assert!(matches!(
        AttentionShape::new(1, 2, 4, 8, 8, 64),
        Err(PisaError::GqaNotDivisible { .. })
    ));
    let e = AttentionShape::new(1, 4, 2, 9, 8, 64).unwrap_err();
    assert_eq!(e, PisaError::QueryLongerThanKeys { q_len: 9, k_len: 8 });
    let msg = e.to_string();
    assert!(msg.contains('9') && msg.contains('8'), "{msg}");
    // Valid edge cases.
    let s = AttentionShape::new(1, 32, 8, 1, 100_000, 128).unwrap();
    assert_eq!(s.gqa_group(), 4);
    assert_eq!(s.query_position(0), 99_999);
    assert!(AttentionShape::prefill(3, 1, 1, 1, 1).is_ok());
}

#[test]
fn config_validation_names_values() {
    assert_eq!(
        SelectionConfig::new(0, 4).unwrap_err(),
        PisaError::Zero { what: "block_size" }
    );
    assert_eq!(
        SelectionConfig::new(64, 0).unwrap_err(),
        PisaError::Zero { what: "top_k" }
    );
    for g in [0, 1] {
        let e = SelectionConfig::default()
            .with_merge_factor(g)
            .validate()
            .unwrap_err();
        assert_eq!(e, PisaError::MergeFactor { merge_factor: g });
        assert!(e.to_string().contains("at least 2"), "{e}");
    }
    // Forced = own + sink + local; top_k must cover them.
    let e = SelectionConfig::new(64, 4)
        .unwrap()
        .with_forced(2, 2)
        .validate()
        .unwrap_err();
    assert_eq!(
        e,
        PisaError::TopKBelowForced {
            top_k: 4,
            forced: 5
        }
    );
    let msg = e.to_string();
    assert!(msg.contains("top_k 4") && msg.contains('5'), "{msg}");
    assert!(SelectionConfig::new(64, 5)
        .unwrap()
        .with_forced(2, 2)
        .validate()
        .is_ok());
    for s in [0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let e = SelectionConfig::default()
            .with_scale(Some(s))
            .validate()
            .unwrap_err();
        assert!(
            matches!(e, PisaError::InvalidValue { .. }),
            "scale {s}: {e:?}"
        );
        assert!(e.to_string().contains("scale"), "{e}");
    }
    assert!(SelectionConfig::default()
        .with_scale(Some(f32::MIN_POSITIVE))
        .validate()
        .is_ok());
}

#[test]
fn layout_validation() {
    assert_eq!(
        PyramidLayout::new(0, 64, 2).unwrap_err(),
        PisaError::Zero { what: "k_len" }
    );
    assert_eq!(
        PyramidLayout::new(10, 0, 2).unwrap_err(),
        PisaError::Zero { what: "block_size" }
    );
    assert_eq!(
        PyramidLayout::new(10, 4, 1).unwrap_err(),
        PisaError::MergeFactor { merge_factor: 1 }
    );
    // Lengths that are not multiples of C nor powers of two.
    let l = PyramidLayout::new(1000, 64, 3).unwrap();
    assert_eq!(l.leaves(), 16);
    assert_eq!(l.nodes(l.num_levels() - 1), 1);
    // A long but real cache: 2^40 keys in blocks of 1.
    let l = PyramidLayout::new(1 << 40, 1, 2).unwrap();
    assert_eq!(l.num_levels(), 41);
}

#[test]
fn grid_for_limits() {
    assert_eq!(grid_for(0, 65535).unwrap(), [0, 1, 1]);
    assert_eq!(grid_for(65535, 65535).unwrap(), [65535, 1, 1]);
    assert_eq!(grid_for(65536, 65535).unwrap(), [65535, 2, 1]);
    let m = 65535u64;
    assert_eq!(grid_for(m * m * m, 65535).unwrap(), [65535, 65535, 65535]);
    let e = grid_for(m * m * m + 1, 65535).unwrap_err();
    assert_eq!(
        e,
        PisaError::TooLarge {
            what: "workgroups of one dispatch",
            value: m * m * m + 1,
            limit: m * m * m
        }
    );
    let msg = e.to_string();
    assert!(msg.contains(&(m * m * m + 1).to_string()) && msg.contains(&(m * m * m).to_string()));
    // A zero or tiny per-dimension limit gives an error, not a division by zero or a panic.
    assert!(grid_for(2, 0).is_err());
    assert_eq!(grid_for(8, 2).unwrap(), [2, 2, 2]);
    assert!(grid_for(9, 2).is_err());
    // The largest per-dimension limit: no overflow computing m^3.
    assert!(no_panic(|| grid_for(u64::MAX, u32::MAX)).unwrap().is_ok());
    assert!(no_panic(|| grid_for(u64::MAX, 1)).unwrap().is_err());
}

#[test]
fn reference_buffer_lengths_are_checked() {
    let shape = AttentionShape::new(1, 2, 1, 4, 8, 16).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let q = vec![0.1f32; shape.q_elems()];
    let k = vec![0.2f32; shape.kv_elems()];
    let v = vec![0.3f32; shape.kv_elems()];
    let sel = vec![0i32; 4 * 2];
    assert!(sparse_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, &cfg, &sel).is_ok());
    let e = sparse_attention(&q[1..], &k, &v, &shape, TensorLayout::Bhnd, &cfg, &sel).unwrap_err();
    assert!(
        matches!(e, PisaError::BufferLen { expected, actual, .. } if expected == q.len() && actual == q.len() - 1),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains(&q.len().to_string()), "{msg}");
    let e = sparse_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, &cfg, &sel[1..]).unwrap_err();
    assert!(
        matches!(
            e,
            PisaError::BufferLen {
                what: "selection",
                ..
            }
        ),
        "{e:?}"
    );
    // Out-of-range block indices.
    for bad in [-2, 2, i32::MAX, i32::MIN] {
        let mut s = sel.clone();
        s[3] = bad;
        let e = sparse_attention(&q, &k, &v, &shape, TensorLayout::Bnhd, &cfg, &s).unwrap_err();
        assert!(matches!(e, PisaError::InvalidValue { .. }), "{bad}: {e:?}");
    }
    for s in [0.0, f32::NAN, -2.0] {
        assert!(dense_attention(&q, &k, &v, &shape, TensorLayout::Bhnd, true, s).is_err());
    }
    // A shape built by hand, bypassing AttentionShape::new, is re-validated.
    let mut bad = shape;
    bad.kv_heads = 3;
    let e = sparse_attention(&q, &k, &v, &bad, TensorLayout::Bhnd, &cfg, &sel).unwrap_err();
    assert!(matches!(e, PisaError::GqaNotDivisible { .. }), "{e:?}");
}

#[test]
fn decode_state_validation() {
    let cfg = SelectionConfig::new(4, 2).unwrap();
    assert!(matches!(
        DecodeState::new(3, 2, 8, cfg),
        Err(PisaError::GqaNotDivisible { .. })
    ));
    assert!(matches!(
        DecodeState::new(2, 1, 0, cfg),
        Err(PisaError::Zero { what: "head_dim" })
    ));
    let mut st = DecodeState::new(2, 1, 8, cfg).unwrap();
    // A step before any key: typed error.
    assert!(st.step(&[0.0; 16]).is_err());
    let e = st.append(&[0.0; 7], &[0.0; 8]).unwrap_err();
    assert!(
        matches!(
            e,
            PisaError::BufferLen {
                expected: 8,
                actual: 7,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(st.len(), 0, "a rejected append leaves the cache unchanged");
    st.append(&[0.0; 8], &[0.0; 8]).unwrap();
    let e = st.step(&[0.0; 15]).unwrap_err();
    assert!(
        matches!(
            e,
            PisaError::BufferLen {
                expected: 16,
                actual: 15,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(st.step(&[0.0; 16]).is_ok());
}

/// Sizes near `usize::MAX`: each call must return a typed [`PisaError::TooLarge`], not panic.
/// Found by the reliability review (docs/reliability.md): `PyramidLayout::new(usize::MAX, 1, 2)`
/// overflowed the node total (and would need 65 levels, one past `MAX_LEVELS`);
/// `SelectionConfig::validate` overflowed `1 + sink + local` for huge forced counts;
/// `AttentionShape::new` accepted shapes whose element counts overflow, so `q_elems()` panicked
/// (debug) or wrapped (release).
#[test]
fn huge_sizes_give_errors_not_panics() {
    let mut bad = Vec::new();
    let mut check = |what: &str, r: Result<Option<PisaError>, String>| match r {
        Ok(Some(PisaError::TooLarge { .. })) => {}
        Ok(Some(e)) => bad.push(format!("{what}: {e:?}, expected TooLarge")),
        Ok(None) => bad.push(format!("{what}: accepted")),
        Err(m) => bad.push(format!("{what}: panicked: {m}")),
    };
    for (n, c, g) in [
        (usize::MAX, 1, 2),
        (usize::MAX, 1, 3),
        (usize::MAX, 1, usize::MAX),
    ] {
        check(
            &format!("PyramidLayout::new({n}, {c}, {g})"),
            no_panic(|| PyramidLayout::new(n, c, g).err()),
        );
    }
    for (sink, local) in [
        (usize::MAX, 0),
        (0, usize::MAX),
        (usize::MAX / 2 + 1, usize::MAX / 2),
    ] {
        check(
            &format!("SelectionConfig with_forced({sink}, {local})"),
            no_panic(|| {
                SelectionConfig::default()
                    .with_forced(sink, local)
                    .validate()
                    .err()
            }),
        );
    }
    for dims in [
        [1 << 40, 1 << 40, 1, 1, 1, 1],
        [1, 1, 1, 1 << 40, 1 << 40, 1 << 40],
        [1, 1, 1, 1, usize::MAX, 2],
        [usize::MAX, 1, 1, 1, 1, 2],
    ] {
        let [b, hq, hkv, nq, nk, d] = dims;
        check(
            &format!("AttentionShape::new{dims:?}"),
            no_panic(|| AttentionShape::new(b, hq, hkv, nq, nk, d).err()),
        );
    }
    assert!(bad.is_empty(), "{bad:#?}");
    // A hand-built shape (public fields) saturates rather than wrapping.
    let s = AttentionShape {
        batch: 1 << 40,
        q_heads: 1 << 40,
        kv_heads: 1,
        q_len: 1,
        k_len: 1,
        head_dim: 1,
    };
    assert_eq!(s.q_elems(), usize::MAX);
    assert_eq!(s.lse_elems(), usize::MAX);
    assert_eq!(s.kv_elems(), 1 << 40);
    // The largest counts that fit are still accepted.
    assert!(AttentionShape::new(1, 1, 1, 1, usize::MAX, 1).is_ok());
    assert!(PyramidLayout::new(usize::MAX, 2, 2).is_ok());
}

/// Large sizes that fit, and the reference's own checks.
#[test]
fn large_but_valid_sizes() {
    let cfg = SelectionConfig::new(1, 16).unwrap();
    let l = no_panic(|| PyramidLayout::new(1 << 62, 1, 2))
        .unwrap()
        .unwrap();
    assert_eq!(l.num_levels(), 63);
    assert!(no_panic(|| Schedule::new(&l, &cfg)).unwrap().is_ok());
    // A layout of another block size or merge factor than the configuration's: refused (the
    // schedule mixed the layout's levels with the configuration's sizes).
    for other in [
        SelectionConfig::new(64, 16).unwrap(),
        cfg.with_merge_factor(4),
    ] {
        let r = Schedule::new(&l, &other);
        assert!(matches!(r, Err(PisaError::InvalidValue { .. })), "{r:?}");
    }
    // Spans near usize::MAX saturate instead of wrapping: the last leaf holds one token, the
    // top node all of them.
    let big = PyramidLayout::new(usize::MAX, 2, 2).unwrap();
    let (top, last) = (big.num_levels() - 1, big.leaves() - 1);
    assert_eq!(big.token_span(0, last), usize::MAX - 1..usize::MAX);
    assert_eq!(big.node_len(0, last), 1);
    assert_eq!(big.node_len(top, 0), usize::MAX);
    assert_eq!(big.leaves_per_node(1 << 32), usize::MAX);
    assert_eq!(big.ancestor(77, 1 << 32), 0);
    // Element counts past usize: refused by `AttentionShape::new`, and the reference re-checks a
    // hand-built shape (public fields) before allocating.
    let r = AttentionShape::new(1 << 20, 1 << 20, 1, 1 << 20, 1 << 20, 1 << 20);
    assert!(matches!(r, Err(PisaError::TooLarge { .. })), "{r:?}");
    // Its message says the count overflows, not that u64::MAX is above usize::MAX.
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("overflows 64 bits"), "{msg}");
    let shape = AttentionShape {
        batch: 1 << 20,
        q_heads: 1 << 20,
        kv_heads: 1,
        q_len: 1 << 20,
        k_len: 1 << 20,
        head_dim: 1 << 20,
    };
    let r = no_panic(|| {
        sparse_attention(&[], &[], &[], &shape, TensorLayout::Bhnd, &cfg, &[]).map(|_| ())
    })
    .unwrap();
    assert!(matches!(r, Err(PisaError::TooLarge { .. })), "{r:?}");
    // A valid shape whose leaf count is past i32 indices.
    let shape = AttentionShape::new(1, 1, 1, 1, 1 << 40, 16).unwrap();
    let r = no_panic(|| {
        sparse_attention(&[], &[], &[], &shape, TensorLayout::Bhnd, &cfg, &[]).map(|_| ())
    })
    .unwrap();
    assert!(matches!(r, Err(PisaError::TooLarge { .. })), "{r:?}");
}

/// Regressions found by a review of the reference's edges: a backward pass on a shape that does
/// not hold (its fields are public), sizes whose products pass `usize` (the oracle from mass,
/// the recall metrics, the schedule's buffer sizes), and a selection listing a leaf twice.
#[test]
fn reference_edges_are_typed_errors_and_counted_once() {
    use pisa_core::reference::{
        recall, select_oracle_from_mass, sparse_attention_backward, try_recall, Selection,
    };
    let cfg = SelectionConfig::new(2, 1).unwrap();
    // GQA not divisible, then 0 KV heads, then more queries than keys: typed errors.
    let shape = |kv_heads, k_len| AttentionShape {
        batch: 1,
        q_heads: 2,
        kv_heads,
        q_len: 4,
        k_len,
        head_dim: 2,
    };
    let bad = [shape(4, 4), shape(0, 4), shape(1, 2)];
    for s in bad {
        let v = vec![0.5f32; 64];
        let (o, l) = (vec![0.5f64; 64], vec![0.0f64; 16]);
        let r = no_panic(|| {
            sparse_attention_backward(
                &v,
                &v,
                &v,
                &o,
                &l,
                &v,
                &s,
                TensorLayout::Bhnd,
                &cfg,
                &[0; 32],
            )
        });
        assert!(
            matches!(r, Ok(Err(_))),
            "backward on {s:?}: {:?}",
            r.map(|x| x.is_ok())
        );
    }
    // 2^34 queries and keys of one dim: the mass matrix is past usize.
    let huge = AttentionShape::new(1, 1, 1, 1 << 34, 1 << 34, 1).unwrap();
    let c16 = SelectionConfig::new(16, 1).unwrap();
    let r = no_panic(|| select_oracle_from_mass(&[], &huge, &c16).map(|_| ()));
    assert!(matches!(r, Ok(Err(_))), "oracle from mass: {r:?}");
    // A top_k past usize / 2 in a recall.
    let small = AttentionShape::new(1, 1, 1, 2, 2, 1).unwrap();
    let c1 = SelectionConfig::new(1, 1).unwrap();
    let wild = Selection {
        top_k: usize::MAX / 2 + 1,
        indices: vec![],
        margin: vec![],
        scored_nodes: vec![],
    };
    let r = no_panic(|| try_recall(&wild, &wild, &[0.0, 0.0], &small, &c1).map(|_| ()));
    assert!(matches!(r, Ok(Err(_))), "recall: {r:?}");
    // The schedule's sizes saturate rather than wrap.
    let layout = PyramidLayout::new(1 << 40, 64, 64).unwrap();
    let sched = Schedule::new(
        &layout,
        &SelectionConfig::new(64, 16).unwrap().with_merge_factor(64),
    )
    .unwrap();
    let huge = AttentionShape::new(1 << 20, 1, 1, 1 << 40, 1 << 40, 1).unwrap();
    assert_eq!(no_panic(|| sched.selection_len(&huge)), Ok(usize::MAX));
    assert_eq!(no_panic(|| sched.candidates_len(&huge)), Ok(usize::MAX));
    // A row listing leaf 1 twice against an oracle row [0, 1] (4 leaves, K 2, C 1; the last
    // query sees 4 leaves): one hit, half the recall, not all of it.
    let s = AttentionShape::new(1, 1, 1, 1, 4, 1).unwrap();
    let c = SelectionConfig::new(1, 2).unwrap();
    let row = |a: i32, b: i32| Selection {
        top_k: 2,
        indices: vec![a, b],
        margin: vec![0.0],
        scored_nodes: vec![0],
    };
    let mass = [0.4, 0.3, 0.2, 0.1];
    let r = try_recall(&row(1, 1), &row(0, 1), &mass, &s, &c).unwrap();
    assert_eq!(r.recall_at_k, 0.5);
    assert!((r.mass_recall - 0.3).abs() < 1e-12, "{}", r.mass_recall);
    // A block index below -1 or past the last leaf, in either selection, is refused as
    // `sparse_attention` refuses it (it was skipped: [0, 99] against [0, 1] gave Ok(0.5)).
    assert!(try_recall(&row(0, -1), &row(0, 1), &mass, &s, &c).is_ok());
    for (a, b) in [
        (row(0, 99), row(0, 1)),
        (row(-7, 0), row(0, 1)),
        (row(0, 1), row(0, 4)),
    ] {
        let e = try_recall(&a, &b, &mass, &s, &c).unwrap_err();
        assert!(matches!(e, PisaError::InvalidValue { .. }), "{e}");
        assert!(no_panic(|| recall(&a, &b, &mass, &s, &c).queries) == Ok(0));
    }
    let e = try_recall(&row(i32::MIN, i32::MAX), &row(0, 1), &mass, &s, &c).unwrap_err();
    assert!(e.to_string().contains("selection holds"), "{e}");
}

/// Regressions: `Pyramid::mean` and `var` read another node, sequence or head for an index past
/// its range (documented to panic, they did not); `kv_head_of` divided by zero on a hand-built
/// shape of fewer query heads than KV heads; `try_locality` with a tile past the rows tried to
/// reserve tile x K entries and aborted; `PyramidLayout::leaf_span`, `token_span` and
/// `node_len` of a node past its level (2026-12-07).
#[test]
fn indices_past_their_range_and_hand_built_shapes() {
    use pisa_core::reference::metrics::try_locality;
    use pisa_core::reference::{build_pyramid, select_pisa};
    let s = AttentionShape::prefill(2, 2, 1, 3, 1).unwrap(); // B 2, Hq 2, Hkv 1, N 3, D 1
    let cfg = SelectionConfig::new(2, 1).unwrap();
    let k: Vec<f32> = (0..6).map(|x| x as f32).collect();
    let p = build_pyramid(&k, &s, TensorLayout::Bhnd, &cfg).unwrap();
    assert_eq!(p.mean(1, 0, 0, 1), &[5.0]); // sequence 1's last leaf: token 5 alone
    assert_eq!(p.mean(0, 0, 1, 0), &[1.0]); // sequence 0's top node: tokens 0..3
    for (b, h, level, j) in [
        (0, 0, 0, 2),
        (2, 0, 0, 0),
        (0, 1, 0, 0),
        (0, 0, 2, 0),
        (0, 0, 1, 1),
    ] {
        let m = no_panic(|| p.mean(b, h, level, j).to_vec());
        assert!(m.is_err(), "mean({b}, {h}, {level}, {j}) = {m:?}");
        assert!(no_panic(|| p.var(b, h, level, j).to_vec()).is_err());
        // (`offset` too: KV head 1 of one gave sequence 1's node, b past the batch overflowed)
        assert!(no_panic(|| p.offset(b, h, level, j)).is_err(), "offset");
    }
    assert!(no_panic(|| p.offset(usize::MAX, 0, 0, 0)).is_err());
    // (3 nodes a sequence, D 1)
    assert_eq!(p.offset(1, 0, 0, 1), p.offset(0, 0, 0, 0) + 4);

    // A batch set by hand past the buffers (the fields are public): the documented panic, not
    // an overflow (debug) or a wrapped offset into another node (release).
    let mut big = p.clone();
    big.batch = usize::MAX;
    let e = no_panic(|| big.offset(usize::MAX - 1, 0, 0, 0)).unwrap_err();
    assert!(e.contains("past the pyramid's size"), "{e}");
    let lay = &p.layout;
    assert!(no_panic(|| lay.offset(9)).is_err());
    for (level, j) in [(0, 0), (9, 0), (1, 3)] {
        assert!(
            no_panic(|| lay.children(level, j)).is_err(),
            "children({level}, {j})"
        );
    }
    // Spans of a node past its level panicked on overflow (debug) or claimed leaves the node
    // does not cover (release: `leaf_span(1, usize::MAX / 2 + 1)` was every leaf); they panic
    // as documented, as `flat` does.
    let l = pisa_core::PyramidLayout::new(10, 2, 2).unwrap();
    assert_eq!(l.leaf_span(1, 2), 4..5);
    for (level, j) in [(1, usize::MAX / 2 + 1), (70, 3), (5, 0), (0, 5), (1, 3)] {
        assert!(
            no_panic(|| l.leaf_span(level, j)).is_err(),
            "leaf_span({level}, {j})"
        );
        assert!(
            no_panic(|| l.node_len(level, j)).is_err(),
            "node_len({level}, {j})"
        );
    }
    let mut hand = s;
    (hand.q_heads, hand.kv_heads) = (1, 2);
    assert_eq!(no_panic(|| hand.kv_head_of(1)), Ok(1));
    let q: Vec<f32> = (0..12).map(|x| (x as f32).sin()).collect();
    let sel = select_pisa(&q, &k, &s, TensorLayout::Bhnd, &cfg).unwrap();
    let r = no_panic(|| try_locality(&sel, &s, &cfg, usize::MAX));
    assert!(matches!(r, Ok(Ok(_))), "{:?}", r.map(|x| x.map(|_| ())));
}

/// `Selection::rows` counts the rows of its indices: a selection built by hand, without
/// margins, counted 0.
#[test]
fn selection_rows_of_a_hand_built_selection() {
    let s = pisa_core::reference::Selection {
        top_k: 2,
        indices: vec![0, 1, 0, 1, 2, -1],
        margin: Vec::new(),
        scored_nodes: Vec::new(),
    };
    assert_eq!(s.rows(), 3);
    assert_eq!(s.row(2), [2, -1]);
    let empty = pisa_core::reference::Selection { top_k: 0, ..s };
    assert_eq!(empty.rows(), 0);
}

/// A NaN or an infinity in any input tensor of a reference function is
/// [`PisaError::NonFinite`] naming the tensor and the first bad element (it was `Ok`: a +inf key
/// scored as masked, a NaN ranked by its sign bit); an LSE of -inf (a row that attended to
/// nothing) stays accepted by the backward pass.
#[test]
fn non_finite_inputs_are_named() {
    use pisa_core::reference::{
        block_mass, build_pyramid, select_bsa, select_oracle, select_oracle_from_mass, select_pisa,
        sparse_attention_backward,
    };
    let l = TensorLayout::Bhnd;
    let s = AttentionShape::prefill(1, 2, 1, 20, 4).unwrap();
    let cfg = SelectionConfig::new(4, 2).unwrap();
    let x = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + seed) % 11) as f32 * 0.1 - 0.5)
            .collect()
    };
    let (q, k, v) = (x(s.q_elems(), 1), x(s.kv_elems(), 2), x(s.kv_elems(), 3));
    let sel = select_pisa(&q, &k, &s, l, &cfg).unwrap();
    let (o, lse) = sparse_attention(&q, &k, &v, &s, l, &cfg, &sel.indices).unwrap();
    let d_o = x(s.q_elems(), 4);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let at = 7;
        let poison = |t: &[f32]| {
            let mut t = t.to_vec();
            t[at] = bad;
            t
        };
        let want = |what| Err::<(), _>(PisaError::NonFinite { what, index: at });
        let (qb, kb, vb) = (poison(&q), poison(&k), poison(&v));
        let i = &sel.indices;
        assert_eq!(
            dense_attention(&qb, &k, &v, &s, l, true, 0.5).map(|_| ()),
            want("q")
        );
        assert_eq!(
            dense_attention(&q, &kb, &v, &s, l, true, 0.5).map(|_| ()),
            want("k")
        );
        assert_eq!(
            dense_attention(&q, &k, &vb, &s, l, true, 0.5).map(|_| ()),
            want("v")
        );
        assert_eq!(
            sparse_attention(&q, &k, &vb, &s, l, &cfg, i).map(|_| ()),
            want("v")
        );
        assert_eq!(select_pisa(&qb, &k, &s, l, &cfg).map(|_| ()), want("q"));
        assert_eq!(select_pisa(&q, &kb, &s, l, &cfg).map(|_| ()), want("k"));
        assert_eq!(select_bsa(&q, &kb, &s, l, &cfg).map(|_| ()), want("k"));
        assert_eq!(select_oracle(&qb, &k, &s, l, &cfg).map(|_| ()), want("q"));
        assert_eq!(block_mass(&q, &kb, &s, l, &cfg).map(|_| ()), want("k"));
        assert_eq!(build_pyramid(&kb, &s, l, &cfg).map(|_| ()), want("k"));
        let bw = |q: &[f32], v: &[f32], o: &[f64], lse: &[f64], d_o: &[f32]| {
            sparse_attention_backward(q, &k, v, o, lse, d_o, &s, l, &cfg, i).map(|_| ())
        };
        assert_eq!(bw(&qb, &v, &o, &lse, &d_o), want("q"));
        assert_eq!(bw(&q, &vb, &o, &lse, &d_o), want("v"));
        assert_eq!(bw(&q, &v, &o, &lse, &poison(&d_o)), want("d_o"));
        let mut ob = o.clone();
        ob[at] = bad as f64;
        assert_eq!(bw(&q, &v, &ob, &lse, &d_o), want("o"));
        let mut lb = lse.clone();
        lb[at] = bad as f64;
        let got = bw(&q, &v, &o, &lb, &d_o);
        if bad == f32::NEG_INFINITY {
            assert!(
                got.is_ok(),
                "an LSE of -inf is a row that attended to nothing: {got:?}"
            );
        } else {
            assert_eq!(got, want("lse"));
        }
        let mut st = DecodeState::new(2, 1, 4, cfg).unwrap();
        assert_eq!(
            st.append(&[0.0, 1.0, bad, 0.5], &[0.0; 4]),
            Err(PisaError::NonFinite {
                what: "k_row",
                index: 2
            })
        );
        assert_eq!(
            st.append(&[0.0; 4], &[bad, 0.0, 0.0, 0.0]),
            Err(PisaError::NonFinite {
                what: "v_row",
                index: 0
            })
        );
        assert_eq!(st.len(), 0, "a refused row is not appended");
        st.append(&[0.5; 4], &[0.25; 4]).unwrap();
        let e = st
            .step(&[0.0, 0.0, 0.0, 0.0, 1.0, bad, 0.0, 0.0])
            .unwrap_err();
        assert_eq!(
            e,
            PisaError::NonFinite {
                what: "q_row",
                index: 5
            }
        );
        assert!(
            e.to_string().contains("q_row") && e.to_string().contains("index 5"),
            "{e}"
        );
    }
    // The oracle's masses: probabilities, so NaN, infinite or negative is refused.
    let mass = block_mass(&q, &k, &s, l, &cfg).unwrap();
    assert!(select_oracle_from_mass(&mass, &s, &cfg).is_ok());
    for bad in [f64::NAN, f64::INFINITY, -0.25] {
        let mut m = mass.clone();
        m[3] = bad;
        let e = select_oracle_from_mass(&m, &s, &cfg).unwrap_err();
        assert_eq!(
            e,
            PisaError::NonFinite {
                what: "mass",
                index: 3
            }
        );
    }
    assert_eq!(pisa_core::check_finite("x", &[0.0, -1.0, 3.0e38]), Ok(()));
}

/// A pyramid or a selection too large to allocate is [`PisaError::TooLarge`] (it aborted the
/// process: `vec!` of a size past the memory); a pyramid of 0 sequences, KV heads or dims is
/// [`PisaError::Zero`].
#[test]
fn allocations_past_memory_and_empty_pyramids_are_errors() {
    use pisa_core::reference::Pyramid;
    // 2^41 nodes of 2^21 dims: 2^62 f64, past what an allocation may hold (2^60 of 8 bytes).
    let big = PyramidLayout::new(1 << 40, 1, 2).unwrap();
    let e = no_panic(|| Pyramid::zeros(big, 1, 1, 1 << 21))
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            e,
            PisaError::TooLarge {
                what: "pyramid means",
                ..
            }
        ),
        "{e:?}"
    );
    let small = PyramidLayout::new(10, 2, 2).unwrap();
    for (dims, what) in [
        ([0, 1, 4], "batch"),
        ([1, 0, 4], "kv_heads"),
        ([1, 1, 0], "head_dim"),
    ] {
        let e = Pyramid::zeros(small, dims[0], dims[1], dims[2]).unwrap_err();
        assert_eq!(e, PisaError::Zero { what });
    }
    assert!(Pyramid::zeros(small, 1, 2, 4).is_ok());
}

/// The ancestor path of a leaf past the layout's leaves panics, as `leaf_span` of a node past
/// its level does (it named nodes past their levels' ends).
#[test]
fn ancestor_path_of_a_leaf_past_the_layout_panics() {
    let l = PyramidLayout::new(10, 2, 2).unwrap(); // 5 leaves
    assert_eq!(l.ancestor_path(4).count(), l.num_levels());
    let e = no_panic(|| l.ancestor_path(5).count()).unwrap_err();
    assert!(e.contains("leaf 5 of 5 leaves"), "{e}");
}
