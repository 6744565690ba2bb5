//! Finding a vector's nearest codeword: a scan of every codeword in groups of eight,
//! a k-d tree for books of at most four dimensions, and cells of codewords for the
//! eight-dimensional books (see the module above for when each is used).

use super::*;

/// Codewords (or cell centroids) in groups of 8, transposed within a group (`[group,
/// dim, lane]`), so that one pass scores 8 of them with vector arithmetic. Groups are
/// padded with entries that never win.
#[derive(Debug)]
pub(super) struct Scan {
    pub(super) dim: usize,
    /// `[groups, dim, 8]`.
    pub(super) values: Vec<f32>,
    /// Half squared norm per entry, `+inf` for padding.
    half_norms: Vec<f32>,
    /// The codeword index of each entry.
    pub(super) ids: Vec<u32>,
}

impl Scan {
    /// Entries `ids` of the `[n, dim]` matrix `values`, in that order.
    pub(super) fn new(dim: usize, values: &[f32], ids: &[u32]) -> Scan {
        let mut s = Scan {
            dim,
            values: Vec::new(),
            half_norms: Vec::new(),
            ids: Vec::new(),
        };
        s.push(values, ids);
        s
    }

    pub(super) fn groups(&self) -> usize {
        self.ids.len() / 8
    }

    /// Appends entries, padded to a whole group.
    pub(super) fn push(&mut self, values: &[f32], ids: &[u32]) {
        let dim = self.dim;
        for chunk in ids.chunks(8) {
            let mut block = vec![0.0f32; dim * 8];
            for l in 0..8 {
                match chunk.get(l) {
                    Some(&id) => {
                        let c = &values[id as usize * dim..(id as usize + 1) * dim];
                        for d in 0..dim {
                            block[d * 8 + l] = c[d];
                        }
                        self.half_norms
                            .push(0.5 * c.iter().map(|v| v * v).sum::<f32>());
                        self.ids.push(id);
                    }
                    None => {
                        self.half_norms.push(f32::INFINITY);
                        self.ids.push(u32::MAX);
                    }
                }
            }
            self.values.extend_from_slice(&block);
        }
    }

    /// `½‖c‖² − v·c` (smaller is nearer) of every entry of `groups` into `out`.
    ///
    /// Each lane's sum runs over the dimensions in the same order whatever the vector
    /// width, and no multiply-add is fused, so the AVX2 build gives the same bits as
    /// the portable one: codebooks built on any x86-64 machine are identical.
    pub(super) fn scores(&self, v: &[f32], groups: std::ops::Range<usize>, out: &mut [f32]) {
        macro_rules! by_dim {
            ($f:ident) => {
                match self.dim {
                    1 => $f::<1>(self, v, groups, out),
                    2 => $f::<2>(self, v, groups, out),
                    4 => $f::<4>(self, v, groups, out),
                    8 => $f::<8>(self, v, groups, out),
                    16 => $f::<16>(self, v, groups, out),
                    d => unreachable!("no codebook of dimension {d}"),
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            by_dim!(scores_avx2);
            return;
        }
        by_dim!(scores_p)
    }

    /// The best (score, id) over `groups`; ties go to the lowest id (ids ascend within
    /// each lane of a range).
    pub(super) fn best(&self, v: &[f32], groups: std::ops::Range<usize>) -> (f32, u32) {
        let mut buf = [0.0f32; 8 * 64];
        let mut bs = [f32::INFINITY; 8];
        let mut bg = [0u32; 8];
        let mut g = groups.start;
        while g < groups.end {
            let n = (groups.end - g).min(64);
            self.scores(v, g..g + n, &mut buf[..8 * n]);
            // Per-lane minimum with selects rather than branches, so it vectorises.
            for (i, s) in buf[..8 * n].chunks_exact(8).enumerate() {
                for l in 0..8 {
                    let better = s[l] < bs[l];
                    bs[l] = if better { s[l] } else { bs[l] };
                    bg[l] = if better { (g + i) as u32 } else { bg[l] };
                }
            }
            g += n;
        }
        let mut best = (f32::INFINITY, u32::MAX);
        for l in 0..8 {
            if bs[l] < f32::INFINITY {
                let id = self.ids[8 * bg[l] as usize + l];
                if bs[l] < best.0 || (bs[l] == best.0 && id < best.1) {
                    best = (bs[l], id);
                }
            }
        }
        best
    }
}

#[inline(always)]
pub(super) fn scores_p<const P: usize>(
    scan: &Scan,
    v: &[f32],
    groups: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let v: &[f32; P] = v
        .try_into()
        .expect("vector length is the codebook's dimension");
    let vals = &scan.values[groups.start * P * 8..groups.end * P * 8];
    let hn = &scan.half_norms[groups.start * 8..groups.end * 8];
    for ((g, h), o) in vals
        .chunks_exact(P * 8)
        .zip(hn.chunks_exact(8))
        .zip(out.chunks_exact_mut(8))
    {
        let mut s = [0.0f32; 8];
        for d in 0..P {
            let vd = v[d];
            for l in 0..8 {
                s[l] += g[d * 8 + l] * vd;
            }
        }
        for l in 0..8 {
            o[l] = h[l] - s[l];
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) fn scores_avx2<const P: usize>(
    scan: &Scan,
    v: &[f32],
    groups: std::ops::Range<usize>,
    out: &mut [f32],
) {
    #[target_feature(enable = "avx2")]
    pub(super) fn inner<const P: usize>(
        scan: &Scan,
        v: &[f32],
        groups: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        scores_p::<P>(scan, v, groups, out)
    }
    // SAFETY: called only after AVX2 was detected.
    unsafe { inner::<P>(scan, v, groups, out) }
}

/// Scanning all codewords above this many is replaced by the cell search.
pub(super) const SCAN_ALL_UP_TO: usize = 1 << 11;

/// The search structure of one codebook.
#[derive(Debug)]
pub(super) struct Search {
    /// Every codeword in index order.
    pub(super) all: Scan,
    /// With more than [`SCAN_ALL_UP_TO`] codewords: the exact tree (up to
    /// [`TREE_MAX_DIM`] dimensions) or the cell structure.
    pub(super) index: Index,
}

#[derive(Debug)]
pub(super) enum Index {
    /// Every codeword is scanned.
    Scan,
    /// Exact: the k-d tree.
    Tree(Tree),
    /// Approximate: the nearest few cells.
    Cells(Cells),
}

/// Dimensions up to which a large book is searched through a k-d tree: in few
/// dimensions its bounding boxes prune all but a few dozen codewords.
pub(super) const TREE_MAX_DIM: usize = 4;

#[derive(Debug)]
pub(super) struct Cells {
    /// Cell centroids (ids are cell numbers).
    centroids: Scan,
    /// Codewords in cell order, each cell padded to whole groups.
    members: Scan,
    /// Group range of cell `c`: `start[c]..start[c + 1]`.
    start: Vec<usize>,
    /// Cells searched per vector.
    probes: usize,
}

impl Search {
    /// The search over the `n` codewords `values` (`[n, p]`, `n` a power of two):
    /// a scan of all up to [`SCAN_ALL_UP_TO`], above that the tree up to
    /// [`TREE_MAX_DIM`] dimensions and the cells beyond.
    pub(super) fn new(p: usize, n: usize, values: &[f32]) -> Search {
        Search::with_tree(p, n, values, p <= TREE_MAX_DIM)
    }

    /// The search that assigns training vectors to the `n` codewords of a book being
    /// built: [`new`](Self::new)'s, or the cells for a book that was trained through
    /// them before the tree existed and must rebuild to the shipped bytes.
    pub(super) fn for_training(p: usize, n: usize, values: &[f32], cells: bool) -> Search {
        Search::with_tree(p, n, values, p <= TREE_MAX_DIM && !cells)
    }

    pub(super) fn with_tree(p: usize, n: usize, values: &[f32], tree: bool) -> Search {
        debug_assert_eq!(values.len(), n * p);
        let ids: Vec<u32> = (0..n as u32).collect();
        let all = Scan::new(p, values, &ids);
        if n <= SCAN_ALL_UP_TO {
            return Search {
                all,
                index: Index::Scan,
            };
        }
        if tree {
            return Search {
                all,
                index: Index::Tree(Tree::new(p, values)),
            };
        }
        let n_cells = 1usize << (n.trailing_zeros() / 2);
        let probes = (n_cells / 16).max(8);
        // The cell centroids: k-means over the codewords, started from every
        // (n / n_cells)-th codeword.
        let mut cent: Vec<f32> = (0..n_cells)
            .flat_map(|c| values[c * (n / n_cells) * p..(c * (n / n_cells) + 1) * p].to_vec())
            .collect();
        let mut assign = vec![0u32; n];
        for it in 0..=8 {
            let cells: Vec<u32> = (0..n_cells as u32).collect();
            let scan = Scan::new(p, &cent, &cells);
            assign = values
                .par_chunks(p)
                .map(|v| scan.best(v, 0..scan.groups()).1)
                .collect();
            if it == 8 {
                break;
            }
            cent = centroids(values, p, &assign, &cent);
        }
        let mut by_cell: Vec<Vec<u32>> = vec![Vec::new(); n_cells];
        for (i, &c) in assign.iter().enumerate() {
            by_cell[c as usize].push(i as u32);
        }
        let cells: Vec<u32> = (0..n_cells as u32).collect();
        let mut members = Scan::new(p, &[], &[]);
        let mut start = vec![0];
        for m in &by_cell {
            members.push(values, m);
            start.push(members.groups());
        }
        Search {
            all,
            index: Index::Cells(Cells {
                centroids: Scan::new(p, &cent, &cells),
                members,
                start,
                probes,
            }),
        }
    }

    /// The nearest codeword to `v`: by a full scan when `exact`, else through the index.
    pub(super) fn nearest(&self, v: &[f32], exact: bool) -> u32 {
        let scan = || self.all.best(v, 0..self.all.groups()).1;
        let c = match &self.index {
            _ if exact => return scan(),
            Index::Scan => return scan(),
            Index::Tree(t) => return t.nearest(v).unwrap_or_else(scan),
            Index::Cells(c) => c,
        };
        let n_cells = c.start.len() - 1;
        let mut scores = [0.0f32; 256];
        c.centroids
            .scores(v, 0..c.centroids.groups(), &mut scores[..n_cells]);
        // The `probes` best cells, by partial selection.
        let mut order: Vec<u32> = (0..n_cells as u32).collect();
        order.select_nth_unstable_by(c.probes - 1, |&a, &b| {
            scores[a as usize]
                .total_cmp(&scores[b as usize])
                .then(a.cmp(&b))
        });
        let mut best = (f32::INFINITY, u32::MAX);
        for &cell in &order[..c.probes] {
            let (s, id) = c
                .members
                .best(v, c.start[cell as usize]..c.start[cell as usize + 1]);
            if s < best.0 || (s == best.0 && id < best.1) {
                best = (s, id);
            }
        }
        best.1
    }
}

/// An exact index of a low-dimensional book: a balanced k-d tree whose leaves are
/// groups of 8 codewords. A vector descends nearest box first and skips a subtree only
/// when no codeword inside its bounding box can score as well as the best found so far,
/// with a margin wider than the rounding of the scores, so it returns exactly what a scan
/// of every codeword returns (the same scores, ties to the lowest index).
#[derive(Debug)]
pub(super) struct Tree {
    pub(super) dim: usize,
    /// The codewords in leaf order: leaf `l` is group `l`.
    leaves: Scan,
    /// Per node, its box's lower corner then its upper corner (`2·dim` values). Nodes
    /// are in heap order (the children of `i` are `2i + 1` and `2i + 2`) and the last
    /// `leaves.groups()` are the leaves, left to right.
    boxes: Vec<f32>,
    /// The largest squared norm of a codeword.
    max_sq: f32,
}

impl Tree {
    /// The tree over `values` (`[n, dim]`, `n` a power of two, at least 8): each node is
    /// split at the median of its widest coordinate, ties ordered by index.
    pub(super) fn new(dim: usize, values: &[f32]) -> Tree {
        let n = values.len() / dim;
        assert!(n >= 8 && n.is_power_of_two(), "{n} codewords");
        let n_leaves = n / 8;
        // The search's stack holds at most one entry per level plus one.
        assert!(n_leaves.trailing_zeros() < 60, "{n} codewords");
        let mut order: Vec<u32> = (0..n as u32).collect();
        let mut boxes = vec![0.0f32; (2 * n_leaves - 1) * 2 * dim];
        // Iterative over (node, range of `order`), parents before children.
        let mut todo = vec![(0usize, 0usize, n)];
        while let Some((node, from, to)) = todo.pop() {
            let ids = &mut order[from..to];
            let bx = &mut boxes[node * 2 * dim..(node + 1) * 2 * dim];
            bx[..dim].fill(f32::INFINITY);
            bx[dim..].fill(f32::NEG_INFINITY);
            for &i in ids.iter() {
                let c = &values[i as usize * dim..(i as usize + 1) * dim];
                for d in 0..dim {
                    bx[d] = bx[d].min(c[d]);
                    bx[dim + d] = bx[dim + d].max(c[d]);
                }
            }
            if ids.len() == 8 {
                continue;
            }
            let mut split = 0;
            for d in 1..dim {
                if bx[dim + d] - bx[d] > bx[dim + split] - bx[split] {
                    split = d;
                }
            }
            ids.sort_unstable_by(|&a, &b| {
                let (x, y) = (
                    values[a as usize * dim + split],
                    values[b as usize * dim + split],
                );
                x.total_cmp(&y).then(a.cmp(&b))
            });
            let mid = from + (to - from) / 2;
            todo.push((2 * node + 2, mid, to));
            todo.push((2 * node + 1, from, mid));
        }
        let max_sq = values
            .chunks_exact(dim)
            .map(|c| c.iter().map(|v| v * v).sum::<f32>())
            .fold(0.0f32, f32::max);
        Tree {
            dim,
            leaves: Scan::new(dim, values, &order),
            boxes,
            max_sq,
        }
    }

    /// The nearest codeword to `v`, or `None` when `v` is so large that the pruning
    /// margin is not finite (then only a full scan is exact).
    pub(super) fn nearest(&self, v: &[f32]) -> Option<u32> {
        let dim = self.dim;
        let vv: f32 = v.iter().map(|x| x * x).sum();
        // A computed score `½‖c‖² − v·c`, and the bound below, is within about ten
        // units in the last place of `‖c‖² + ‖v‖²` of its exact value; the margin is
        // over a hundred.
        let margin = 1e-5 * (self.max_sq + vv) + f32::MIN_POSITIVE;
        if !margin.is_finite() {
            return None;
        }
        // The lowest score any codeword in node's box can reach, less the margin.
        let bound = |node: usize| {
            let bx = &self.boxes[node * 2 * dim..(node + 1) * 2 * dim];
            let mut d2 = 0.0f32;
            for d in 0..dim {
                let gap = (bx[d] - v[d]).max(v[d] - bx[dim + d]).max(0.0);
                d2 += gap * gap;
            }
            0.5 * (d2 - vv) - margin
        };
        let first_leaf = self.leaves.groups() - 1;
        let mut best = (f32::INFINITY, u32::MAX);
        let mut scores = [0.0f32; 8];
        let mut stack = [(0usize, f32::NEG_INFINITY); 64];
        let mut top = 1;
        while top > 0 {
            top -= 1;
            let (node, lower) = stack[top];
            if lower > best.0 {
                continue;
            }
            if node >= first_leaf {
                let g = node - first_leaf;
                self.leaves.scores(v, g..g + 1, &mut scores);
                for (l, &s) in scores.iter().enumerate() {
                    let id = self.leaves.ids[8 * g + l];
                    // As in `Scan::best`: a score of +inf (or NaN) never wins.
                    if s < best.0 || (s == best.0 && best.1 != u32::MAX && id < best.1) {
                        best = (s, id);
                    }
                }
                continue;
            }
            let (a, b) = (2 * node + 1, 2 * node + 2);
            let (la, lb) = (bound(a), bound(b));
            // The nearer child is pushed last, so searched first.
            let (near, far) = if la <= lb {
                ((a, la), (b, lb))
            } else {
                ((b, lb), (a, la))
            };
            stack[top] = far;
            stack[top + 1] = near;
            top += 2;
        }
        Some(best.1)
    }
}

/// Means of the points assigned to each of `old.len() / p` centroids, summed in f64 in
/// point order; a centroid with no points keeps its old value.
pub(super) fn centroids(points: &[f32], p: usize, assign: &[u32], old: &[f32]) -> Vec<f32> {
    let k = old.len() / p;
    let mut sum = vec![0.0f64; k * p];
    let mut count = vec![0u32; k];
    for (v, &a) in points.chunks_exact(p).zip(assign) {
        let a = a as usize;
        count[a] += 1;
        for (s, &x) in sum[a * p..(a + 1) * p].iter_mut().zip(v) {
            *s += x as f64;
        }
    }
    let mut out = old.to_vec();
    for c in 0..k {
        if count[c] > 0 {
            for d in 0..p {
                out[c * p + d] = (sum[c * p + d] / count[c] as f64) as f32;
            }
        }
    }
    out
}
