//! How much the route's scored candidates share across consecutive queries, per level
//! (docs/benchmarks.md A.51). One KV head, its GQA group's query heads; C 64, K 16, g 2,
//! `lse`, causal, no sink or local blocks: PISA.md section 3's descent in f64 over
//! pisa_core's reference pyramid, for tiles of 64 consecutive queries (starting 7 tokens into
//! a block) at evenly spaced positions. Per scored level: the pyramid rows the candidates'
//! scores need (`lse`: the children of the candidates; level 0: the leaf candidates), per
//! query, and the distinct rows of tiles of 4, 16 and 64 queries over the mean per query.
//! Usage: `routeshare random N _ TILES` (uniform [-1, 1) inputs, D 128, GQA 4, as
//! `pisa bench`'s) or `routeshare FILE.safetensors LAYER KV_HEAD TILES` (bf16 `layer{L}.q/k`).
use pisa_core::reference::{build_pyramid, Pyramid};
use pisa_core::{AttentionShape, SelectionConfig, TensorLayout};
use std::collections::{BTreeMap, HashSet};

fn lae(a: f64, b: f64) -> f64 {
    if a == f64::NEG_INFINITY { return b; }
    let m = a.max(b);
    m + ((a - m).exp() + (b - m).exp()).ln()
}

struct Src { k: Vec<f32>, q: Vec<f32>, n: usize, d: usize, g: usize, scale: f64 }

/// Per level (level index; 0 = leaves): the rows (level l-1 node ids, or leaf ids at 0) the
/// query's scored candidates need.
fn route(p: &Pyramid, s: &Src, qi: usize, k: usize) -> BTreeMap<usize, Vec<usize>> {
    let l = &p.layout;
    let d = s.d;
    let qrows: Vec<&[f32]> = (0..s.g).map(|h| &s.q[(h * s.n + qi) * d..][..d]).collect();
    let mut out = BTreeMap::new();
    let bq = l.block_of(qi);
    if bq + 1 <= k { return out; }
    // The coarsest level whose node count exceeds K (PISA.md 3.1).
    let start = (0..l.num_levels()).rev().find(|&lv| l.nodes(lv) > k).unwrap_or(0);
    let mut cands: Vec<usize> = (0..l.ancestor(bq, start)).collect();
    let dotm = |q: &[f32], m: &[f64]| q.iter().zip(m).map(|(&a, &b)| a as f64 * b).sum::<f64>();
    for level in (1..=start).rev() {
        if cands.len() > k {
            let mut rows = vec![];
            let mut sc: Vec<(f64, usize)> = cands.iter().map(|&j| {
                let mut t = 0.0;
                for q in &qrows {
                    let mut a = f64::NEG_INFINITY;
                    for c in l.children(level, j) {
                        let n = l.node_len(level - 1, c) as f64;
                        a = lae(a, s.scale * dotm(q, p.mean(0, 0, level - 1, c)) + n.ln());
                    }
                    t += a;
                }
                (t, j)
            }).collect();
            for &j in &cands { rows.extend(l.children(level, j)); }
            out.insert(level, rows);
            sc.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
            cands = sc[..k].iter().map(|x| x.1).collect();
        }
        let mut next: Vec<usize> = cands.iter().flat_map(|&j| l.children(level, j)).collect();
        let below = l.ancestor(bq, level - 1);
        next.extend(l.children(level, l.ancestor(bq, level)).filter(|&c| c < below));
        cands = next;
    }
    cands.retain(|&j| j != bq);
    if cands.len() > k - 1 { out.insert(0, cands); }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let k = 16;
    let cfg = SelectionConfig::new(64, k).unwrap();
    let src = if args[1] == "random" {
        let n: usize = args[2].parse().unwrap();
        let (d, g) = (128, 4);
        let mut x = 0x9E3779B97F4A7C15u64;
        let mut r = move || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0 };
        let k: Vec<f32> = (0..n * d).map(|_| r()).collect();
        let q: Vec<f32> = (0..g * n * d).map(|_| r()).collect();
        Src { k, q, n, d, g, scale: 1.0 / (d as f64).sqrt() }
    } else {
        let bytes = std::fs::read(&args[1]).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let layer = &args[2];
        let kvh: usize = args[3].parse().unwrap();
        let get = |name: &str| { let t = st.tensor(name).unwrap(); let sh = t.shape().to_vec();
            let v: Vec<f32> = t.data().chunks(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(); (v, sh) };
        let (kk, ks) = get(&format!("layer{layer}.k"));
        let (qq, qs) = get(&format!("layer{layer}.q"));
        let (n, d) = (ks[1], ks[2]);
        let g = qs[0] / ks[0];
        let k: Vec<f32> = kk[kvh * n * d..(kvh + 1) * n * d].to_vec();
        let q: Vec<f32> = qq[kvh * g * n * d..(kvh + 1) * g * n * d].to_vec();
        Src { k, q, n, d, g, scale: 0.125 }
    };
    let shape = AttentionShape::prefill(1, 1, 1, src.n, src.d).unwrap();
    let p = build_pyramid(&src.k, &shape, TensorLayout::Bhnd, &cfg).unwrap();
    let tiles: usize = args.get(4).map(|x| x.parse().unwrap()).unwrap_or(8);
    let tile_sizes = [4usize, 16, 64];
    // per level: (sum of per-query rows, sum over tiles of union) for each tile size
    let mut stats: BTreeMap<usize, Vec<(f64, f64, usize)>> = BTreeMap::new();
    for t in 0..tiles {
        let q0 = ((t + 1) * src.n / (tiles + 1)) / 64 * 64 + 7; // a tile starting inside a block
        let q0 = q0.min(src.n - 64);
        let per: Vec<_> = (q0..q0 + 64).map(|qi| route(&p, &src, qi, k)).collect();
        for (ti, &ts) in tile_sizes.iter().enumerate() {
            for c in per.chunks(ts) {
                let mut levels: HashSet<usize> = HashSet::new();
                for m in c { levels.extend(m.keys()); }
                for &lv in &levels {
                    let sum: usize = c.iter().map(|m| m.get(&lv).map_or(0, |r| r.len())).sum();
                    let uni: HashSet<usize> = c.iter().flat_map(|m| m.get(&lv).into_iter().flatten().copied()).collect();
                    let e = stats.entry(lv).or_insert_with(|| vec![(0.0, 0.0, 0); 3]);
                    e[ti].0 += sum as f64; e[ti].1 += uni.len() as f64; e[ti].2 += c.len();
                }
            }
        }
    }
    println!("level | rows/query | union/(per-query rows) for tiles of 4 | 16 | 64");
    for (lv, e) in stats.iter().rev() {
        let perq = e[0].0 / e[0].2 as f64;
        let f: Vec<String> = e.iter().zip(tile_sizes).map(|(x, ts)| format!("{:.2}", x.1 / (x.0 / ts as f64))).collect();
        println!("{lv} | {perq:.1} | {}", f.join(" | "));
    }
}
