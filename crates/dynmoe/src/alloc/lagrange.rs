//! One budget, many layers: the Lagrangian relaxation of the allocation problem.
//!
//! Each layer offers a few settings, each with a modelled loss increase and a byte
//! price. For a multiplier λ ≥ 0 every layer picks, on its own, the setting minimising
//! `cost + λ·bytes`; a larger λ buys fewer bytes. Bisection finds the smallest λ whose
//! total fits the budget. Settings are discrete, so that solution can leave bytes
//! unspent and miss better combinations that sit between two multipliers; a local
//! search then takes the best improving move that fits — one layer changing setting, or
//! two layers trading bytes — until none is left.

/// One setting a layer may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// Modelled loss increase.
    pub cost: f64,
    /// Resident bytes the setting costs.
    pub bytes: u64,
}

/// The chosen setting per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    /// Index into each layer's choices.
    pub picks: Vec<usize>,
    /// Σ bytes of the picks.
    pub bytes: u64,
    /// Σ modelled cost of the picks.
    pub cost: f64,
    /// The multiplier the bisection ended on.
    pub lambda: f64,
    /// Budget minus bytes.
    pub unspent: u64,
}

/// Why no allocation fits.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AllocError {
    /// A layer was offered nothing.
    #[error("layer {layer} has no settings to choose from")]
    NoChoices {
        /// The layer.
        layer: usize,
    },
    /// Even the cheapest setting of every layer exceeds the budget.
    #[error("the budget of {budget} bytes is below the smallest possible model ({minimum} bytes)")]
    Infeasible {
        /// The budget.
        budget: u64,
        /// Σ of every layer's cheapest setting.
        minimum: u64,
    },
}

fn pick(choices: &[Choice], lambda: f64) -> usize {
    // Ties go to fewer bytes, so λ → ∞ ends on the cheapest setting.
    let score = |c: &Choice| c.cost + lambda * c.bytes as f64;
    (0..choices.len())
        .min_by(|&a, &b| {
            score(&choices[a])
                .total_cmp(&score(&choices[b]))
                .then(choices[a].bytes.cmp(&choices[b].bytes))
        })
        .unwrap_or(0)
}

fn totals(layers: &[Vec<Choice>], picks: &[usize]) -> (u64, f64) {
    layers
        .iter()
        .zip(picks)
        .fold((0, 0.0), |(b, c), (l, &i)| (b + l[i].bytes, c + l[i].cost))
}

/// Chooses one setting per layer minimising Σ cost subject to Σ bytes ≤ `budget`.
/// `fixed_bytes` (tensors outside the allocation, priced once) count against the budget.
pub fn allocate(
    layers: &[Vec<Choice>],
    fixed_bytes: u64,
    budget: u64,
) -> Result<Allocation, AllocError> {
    if let Some(layer) = layers.iter().position(|l| l.is_empty()) {
        return Err(AllocError::NoChoices { layer });
    }
    let minimum = fixed_bytes
        + layers
            .iter()
            .map(|l| l.iter().map(|c| c.bytes).min().unwrap_or(0))
            .sum::<u64>();
    if minimum > budget {
        return Err(AllocError::Infeasible { budget, minimum });
    }
    let at = |lambda: f64| -> Vec<usize> { layers.iter().map(|l| pick(l, lambda)).collect() };
    let fits = |picks: &[usize]| fixed_bytes + totals(layers, picks).0 <= budget;

    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    let mut picks = at(lo);
    if !fits(&picks) {
        // Grow the bracket until it fits; λ past every cost/byte ratio picks the cheapest.
        let mut guard = 0;
        while !fits(&at(hi)) && guard < 2000 {
            lo = hi;
            hi *= 2.0;
            guard += 1;
        }
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if mid <= lo || mid >= hi {
                break;
            }
            if fits(&at(mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        lo = hi;
        picks = at(hi);
        if !fits(&picks) {
            // Only reachable when ties defeat the bisection: fall back to the cheapest.
            picks = layers
                .iter()
                .map(|l| (0..l.len()).min_by_key(|&i| l[i].bytes).unwrap_or(0))
                .collect();
        }
    }
    improve(layers, fixed_bytes, budget, &mut picks);
    let (bytes, cost) = totals(layers, &picks);
    Ok(Allocation {
        picks,
        bytes: bytes + fixed_bytes,
        cost,
        lambda: lo,
        unspent: budget - bytes - fixed_bytes,
    })
}

/// Local search from the Lagrangian solution: repeatedly applies the move that lowers
/// the total cost most while fitting the budget — one layer to another setting, or a
/// pair of layers, one giving up bytes the other spends — until no move helps.
fn improve(layers: &[Vec<Choice>], fixed: u64, budget: u64, picks: &mut [usize]) {
    // Gains below this are float noise, not improvements; ignoring them ends the loop.
    const EPS: f64 = 1e-12;
    loop {
        let spent = fixed + totals(layers, picks).0;
        let left = (budget - spent) as i64;
        let delta = |layer: usize, i: usize| {
            let (now, c) = (layers[layer][picks[layer]], layers[layer][i]);
            (c.cost - now.cost, c.bytes as i64 - now.bytes as i64)
        };
        let mut best: Option<(f64, Vec<(usize, usize)>)> = None;
        let mut consider = |gain: f64, moves: Vec<(usize, usize)>| {
            if gain > EPS && best.as_ref().is_none_or(|(g, _)| gain > *g) {
                best = Some((gain, moves));
            }
        };
        for a in 0..layers.len() {
            for i in 0..layers[a].len() {
                let (dc, db) = delta(a, i);
                if db <= left {
                    consider(-dc, vec![(a, i)]);
                }
                // Pair moves: only worth pairing a move that frees bytes with one that
                // spends them.
                if db >= 0 {
                    continue;
                }
                for (b, choices) in layers.iter().enumerate() {
                    if b == a {
                        continue;
                    }
                    for j in 0..choices.len() {
                        let (dc2, db2) = delta(b, j);
                        if db + db2 <= left {
                            consider(-(dc + dc2), vec![(a, i), (b, j)]);
                        }
                    }
                }
            }
        }
        match best {
            Some((_, moves)) => moves.into_iter().for_each(|(l, i)| picks[l] = i),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn brute_force(layers: &[Vec<Choice>], budget: u64) -> f64 {
        let mut best = f64::INFINITY;
        let mut idx = vec![0usize; layers.len()];
        loop {
            let (b, c) = totals(layers, &idx);
            if b <= budget {
                best = best.min(c);
            }
            let mut l = 0;
            loop {
                if l == layers.len() {
                    return best;
                }
                idx[l] += 1;
                if idx[l] < layers[l].len() {
                    break;
                }
                idx[l] = 0;
                l += 1;
            }
        }
    }

    fn random_layers(rng: &mut Rng, n: usize) -> Vec<Vec<Choice>> {
        (0..n)
            .map(|_| {
                // Convex-ish trade-offs: more bytes, less cost.
                let scale = 0.1 + rng.uniform() as f64;
                (0..4)
                    .map(|k| Choice {
                        bytes: 100 * (k as u64 + 1) + (rng.uniform() * 30.0) as u64,
                        cost: scale * 2f64.powi(-2 * k) + rng.uniform() as f64 * 0.01,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn never_exceeds_the_budget_and_is_near_optimal() {
        let mut rng = Rng::new(7);
        for trial in 0..40 {
            let layers = random_layers(&mut rng, 5);
            let min: u64 = layers
                .iter()
                .map(|l| l.iter().map(|c| c.bytes).min().unwrap())
                .sum();
            let budget = min + (rng.uniform() * 1200.0) as u64;
            let a = allocate(&layers, 0, budget).unwrap();
            assert!(a.bytes <= budget, "trial {trial}: {} > {budget}", a.bytes);
            assert_eq!(a.unspent, budget - a.bytes);
            let best = brute_force(&layers, budget);
            // Lagrangian + local search is not exact on discrete sets; it must stay close.
            assert!(
                a.cost <= best * 1.5 + 1e-3,
                "trial {trial}: {} vs {best}",
                a.cost
            );
        }
    }

    #[test]
    fn fixed_bytes_count_and_infeasible_budgets_are_refused() {
        let layers = vec![vec![
            Choice {
                cost: 1.0,
                bytes: 10,
            },
            Choice {
                cost: 0.0,
                bytes: 50,
            },
        ]];
        assert_eq!(allocate(&layers, 0, 60).unwrap().picks, vec![1]);
        assert_eq!(allocate(&layers, 20, 60).unwrap().picks, vec![0]);
        assert_eq!(
            allocate(&layers, 60, 60),
            Err(AllocError::Infeasible {
                budget: 60,
                minimum: 70
            })
        );
        assert_eq!(
            allocate(&[vec![]], 0, 60),
            Err(AllocError::NoChoices { layer: 0 })
        );
    }
}
