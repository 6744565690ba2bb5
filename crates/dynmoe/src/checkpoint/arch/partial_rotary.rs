//! Partial rotary embedding (GLM-4.5: the leading half of each head rotates, the rest
//! passes through) as a full rotary embedding over a reordered head.
//!
//! transformers rotates the leading `r` of a head's `d` values in the pairs
//! `(i, i + r/2)`; every backend's rotary op rotates pairs `(i, i + d/2)`. Reordering
//! each head's values so that value `i` stays at `i` and value `r/2 + i` moves to
//! `d/2 + i` (`i < r/2`), the pass-through values filling the positions left, and
//! giving the pass-through pairs a frequency of zero (a rotation by nothing), turns one
//! into the other. A query and a key reordered alike have the same dot product, so the
//! checkpoint's readers see q and k projections (their weights, biases and per-head
//! norms) in the reordered layout, and the rest of the model never knows.

use std::path::Path;

use crate::checkpoint::Config;

/// The head layout of a model with partial rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialRotary {
    /// Values per attention head.
    pub head_dim: usize,
    /// Leading values of each head that rotate.
    pub rotary_dim: usize,
}

impl PartialRotary {
    /// The layout `config` implies, if its rotary embedding is partial. Latent attention
    /// lays out its heads itself (`model::mla`).
    pub fn of(config: &Config) -> Option<PartialRotary> {
        let partial = config.mla.is_none() && config.rope.rotary_dim < config.head_dim;
        partial.then_some(PartialRotary {
            head_dim: config.head_dim,
            rotary_dim: config.rope.rotary_dim,
        })
    }

    /// The layout of the model in `dir`, from its `config.json`. A directory without a
    /// readable configuration has none here; loading it reports why.
    pub fn of_dir(dir: &Path) -> Option<PartialRotary> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return None;
        }
        Config::from_file(&path)
            .ok()
            .as_ref()
            .and_then(PartialRotary::of)
    }

    /// For each position of a reordered head, the position of the stored head it reads.
    pub fn order(&self) -> Vec<usize> {
        let (d, r) = (self.head_dim, self.rotary_dim);
        let (half, rot_half, pass_half) = (d / 2, r / 2, (d - r) / 2);
        (0..d)
            .map(|p| match (p < half, p % half) {
                (true, i) if i < rot_half => i,
                (false, i) if i < rot_half => rot_half + i,
                (true, i) => r + (i - rot_half),
                (false, i) => r + pass_half + (i - rot_half),
            })
            .collect()
    }

    /// Whether tensor `name` holds one row per value of the query or key heads.
    pub fn applies_to(name: &str) -> bool {
        [
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ]
        .iter()
        .any(|suffix| name.ends_with(suffix))
    }

    /// Reorders the rows of `values` (`rows` rows, a whole number of heads) head by head.
    pub fn reorder(&self, values: &mut [f32], rows: usize) {
        let d = self.head_dim;
        if rows == 0 || !rows.is_multiple_of(d) {
            return;
        }
        let width = values.len() / rows;
        let order = self.order();
        let mut head = vec![0.0f32; d * width];
        for chunk in values.chunks_exact_mut(d * width) {
            head.copy_from_slice(chunk);
            for (to, &from) in order.iter().enumerate() {
                chunk[to * width..(to + 1) * width]
                    .copy_from_slice(&head[from * width..(from + 1) * width]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_pairs_land_half_a_head_apart() {
        let l = PartialRotary {
            head_dim: 16,
            rotary_dim: 8,
        };
        let order = l.order();
        // A permutation.
        let mut seen = order.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..16).collect::<Vec<_>>());
        // transformers' pair (i, i + 4) sits at (i, i + 8).
        for i in 0..4 {
            assert_eq!((order[i], order[8 + i]), (i, 4 + i));
        }
        // The pass-through values keep their order.
        assert_eq!(&order[4..8], &[8, 9, 10, 11]);
        assert_eq!(&order[12..16], &[12, 13, 14, 15]);
    }

    #[test]
    fn reorders_whole_rows_head_by_head() {
        let l = PartialRotary {
            head_dim: 4,
            rotary_dim: 2,
        };
        // Two heads of four rows, rows of two values: row r holds (r, -r).
        let mut v: Vec<f32> = (0..8).flat_map(|r| [r as f32, -(r as f32)]).collect();
        l.reorder(&mut v, 8);
        // order = [0, 2, 1, 3] within each head.
        let rows: Vec<f32> = v.chunks(2).map(|r| r[0]).collect();
        assert_eq!(rows, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert!(v.chunks(2).all(|r| r[1] == -r[0]));
    }
}
