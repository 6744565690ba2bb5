//! The swap policy of dynamic REAP, as pure functions of the routing evidence: two
//! exponential averages per expert, and the checkpoint rule that pairs the best
//! non-residents with the worst residents.

use serde::Serialize;

/// The numbers of the policy (docs/ARCHITECTURE.md, Residency); every one is a command-line flag.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PolicyParams {
    /// Routed tokens between checkpoints.
    pub interval: usize,
    /// Pairs exchanged at a checkpoint; also the fewest qualifying pairs for any to move.
    pub max_swaps: usize,
    /// How far (relative) an incoming expert's rank must beat the outgoing one's.
    pub margin: f32,
    /// Half-lives of the two averages, in tokens.
    pub half_lives: [f32; 2],
}

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams {
            interval: 256,
            max_swaps: 4,
            margin: 0.05,
            half_lives: [100.0, 1000.0],
        }
    }
}

/// Per expert of one layer, two exponential averages of its unmasked routing
/// probability: `m ← β m + (1 − β) p` with `β = 2^(−1/h)`.
#[derive(Debug, Clone)]
pub struct Evidence {
    betas: [f32; 2],
    averages: [Vec<f32>; 2],
}

impl Evidence {
    /// Evidence for `experts` experts, every average at zero.
    pub fn new(experts: usize, half_lives: [f32; 2]) -> Evidence {
        Evidence {
            betas: half_lives.map(|h| 2f32.powf(-1.0 / h)),
            averages: [vec![0.0; experts], vec![0.0; experts]],
        }
    }

    /// Folds in one token's probability vector.
    pub fn observe(&mut self, probs: &[f32]) {
        for (beta, m) in self.betas.iter().zip(self.averages.iter_mut()) {
            for (m, &p) in m.iter_mut().zip(probs) {
                *m = beta * *m + (1.0 - beta) * p;
            }
        }
    }

    /// The rank of every expert: the mean of its two averages.
    pub fn ranks(&self) -> Vec<f32> {
        self.averages[0]
            .iter()
            .zip(&self.averages[1])
            .map(|(a, b)| 0.5 * (a + b))
            .collect()
    }
}

/// The exchanges of one checkpoint, `(outgoing, incoming)`: non-residents by descending
/// rank are paired with residents by ascending rank (ties to the lower id); experts
/// marked `frozen` (swapped at the last checkpoint, or still loading) take no part. If
/// at least `max_swaps` pairs have the incoming rank more than `margin` above the
/// outgoing one, the first `max_swaps` are returned; otherwise none, so that a set
/// which is nearly right does not thrash.
pub fn plan_swaps(
    ranks: &[f32],
    resident: &[bool],
    frozen: &[bool],
    p: &PolicyParams,
) -> Vec<(u32, u32)> {
    if p.max_swaps == 0 {
        return Vec::new();
    }
    let eligible = |want: bool| -> Vec<u32> {
        (0..ranks.len() as u32)
            .filter(|&e| resident[e as usize] == want && !frozen[e as usize])
            .collect()
    };
    let mut incoming = eligible(false);
    incoming.sort_by(|&a, &b| {
        ranks[b as usize]
            .total_cmp(&ranks[a as usize])
            .then(a.cmp(&b))
    });
    let mut outgoing = eligible(true);
    outgoing.sort_by(|&a, &b| {
        ranks[a as usize]
            .total_cmp(&ranks[b as usize])
            .then(a.cmp(&b))
    });
    let pairs: Vec<(u32, u32)> = outgoing
        .into_iter()
        .zip(incoming)
        .filter(|&(out, inc)| ranks[inc as usize] > ranks[out as usize] * (1.0 + p.margin))
        .collect();
    if pairs.len() < p.max_swaps {
        return Vec::new();
    }
    pairs.into_iter().take(p.max_swaps).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    const E: usize = 32;
    const K: usize = 16;

    /// A routing vector concentrated on `hot` (80% of the mass, spread with noise), the
    /// rest on every expert.
    fn token(rng: &mut Rng, hot: &[usize]) -> Vec<f32> {
        let mut p: Vec<f32> = (0..E).map(|_| 0.2 / E as f32 * rng.uniform()).collect();
        for &e in hot {
            p[e] += 0.8 / hot.len() as f32 * (0.5 + rng.uniform());
        }
        let s: f32 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= s);
        p
    }

    /// Runs the policy over `stream`, applying swaps at once (the loader is not part of
    /// the policy). Returns the swaps of each checkpoint and the final resident set.
    fn simulate(stream: &[Vec<f32>], start: &[usize], p: &PolicyParams) -> (Vec<usize>, Vec<bool>) {
        let mut ev = Evidence::new(E, p.half_lives);
        let mut resident = vec![false; E];
        start.iter().for_each(|&e| resident[e] = true);
        let mut frozen = vec![false; E];
        let mut swaps = Vec::new();
        for (t, probs) in stream.iter().enumerate() {
            ev.observe(probs);
            if (t + 1) % p.interval == 0 {
                let plan = plan_swaps(&ev.ranks(), &resident, &frozen, p);
                frozen = vec![false; E];
                for &(out, inc) in &plan {
                    resident[out as usize] = false;
                    resident[inc as usize] = true;
                    frozen[out as usize] = true;
                    frozen[inc as usize] = true;
                }
                swaps.push(plan.len());
            }
        }
        (swaps, resident)
    }

    fn stream(rng: &mut Rng, hot: &[usize], n: usize) -> Vec<Vec<f32>> {
        (0..n).map(|_| token(rng, hot)).collect()
    }

    #[test]
    fn betas_halve_at_the_half_life() {
        let mut ev = Evidence::new(1, [100.0, 1000.0]);
        ev.observe(&[1.0]);
        let after_one = ev.averages.clone();
        for _ in 0..100 {
            ev.observe(&[0.0]);
        }
        assert!((ev.averages[0][0] / after_one[0][0] - 0.5).abs() < 1e-4);
        assert!(ev.averages[1][0] < after_one[1][0] && ev.averages[1][0] > 0.9 * after_one[1][0]);
    }

    #[test]
    fn a_clear_drift_is_followed_within_a_few_checkpoints() {
        let p = PolicyParams::default();
        let mut rng = Rng::new(1);
        // The text moves from one half of the experts to the other.
        let a: Vec<usize> = (0..K).collect();
        let b: Vec<usize> = (K..E).collect();
        let mut s = stream(&mut rng, &a, 2048);
        s.extend(stream(&mut rng, &b, 256 * 8));
        let (swaps, resident) = simulate(&s, &a, &p);
        assert_eq!(
            swaps[..8].iter().sum::<usize>(),
            0,
            "moved before the drift: {swaps:?}"
        );
        assert!(
            b.iter().all(|&e| resident[e]),
            "B experts left out: {resident:?}"
        );
        // Four move per checkpoint (the pairs swapped last time sit out, but there are
        // others), so all sixteen are in by the fourth or fifth checkpoint after it.
        let checkpoints = swaps[8..]
            .iter()
            .scan(0, |acc, &n| {
                *acc += n;
                Some(*acc)
            })
            .take_while(|&n| n < K)
            .count()
            + 1;
        assert!(
            checkpoints <= 5,
            "took {checkpoints} checkpoints: {swaps:?}"
        );
    }

    #[test]
    fn fewer_than_four_qualifying_pairs_move_nothing() {
        let p = PolicyParams::default();
        let mut rng = Rng::new(2);
        // Residents 0..16 hold the mass; then three non-residents take over from three
        // residents: three pairs qualify, the fourth does not.
        let mut s = stream(&mut rng, &(0..16).collect::<Vec<_>>(), 1024);
        let mut hot: Vec<usize> = (0..13).collect();
        hot.extend([20, 21, 22]);
        s.extend(stream(&mut rng, &hot, 2048));
        let (swaps, resident) = simulate(&s, &(0..K).collect::<Vec<_>>(), &p);
        assert!(swaps.iter().all(|&n| n == 0), "swaps {swaps:?}");
        assert!((0..K).all(|e| resident[e]));
        // The same rule moves them once a fourth qualifies, proving the pairs were
        // there to be taken.
        let ranks: Vec<f32> = (0..E)
            .map(|e| if !(3..28).contains(&e) { 1.0 } else { 0.5 })
            .collect();
        let mut res = vec![false; E];
        (3..19).for_each(|e| res[e] = true);
        assert_eq!(plan_swaps(&ranks, &res, &[false; E], &p).len(), 4);
        let ranks: Vec<f32> = (0..E).map(|e| if e < 3 { 1.0 } else { 0.5 }).collect();
        assert!(plan_swaps(&ranks, &res, &[false; E], &p).is_empty());
    }

    #[test]
    fn a_stationary_stream_settles_and_stops_swapping() {
        let p = PolicyParams::default();
        let mut rng = Rng::new(3);
        let hot: Vec<usize> = (0..E).step_by(2).collect();
        let s = stream(&mut rng, &hot, 256 * 40);
        // Start from the wrong half: it converges, then nothing moves.
        let (swaps, resident) = simulate(&s, &(16..32).collect::<Vec<_>>(), &p);
        assert!(hot.iter().all(|&e| resident[e]), "{resident:?}");
        let late: usize = swaps[20..].iter().sum();
        assert_eq!(late, 0, "thrashing: {swaps:?}");
        // Started right, it never moves.
        let (swaps, _) = simulate(&s, &hot, &p);
        assert_eq!(swaps.iter().sum::<usize>(), 0, "{swaps:?}");
    }

    #[test]
    fn frozen_experts_sit_out() {
        let p = PolicyParams::default();
        let ranks: Vec<f32> = (0..8).map(|e| if e >= 4 { 1.0 } else { 0.1 }).collect();
        let resident = [true, true, true, true, false, false, false, false];
        assert_eq!(plan_swaps(&ranks, &resident, &[false; 8], &p).len(), 4);
        let mut frozen = [false; 8];
        frozen[5] = true;
        assert!(plan_swaps(&ranks, &resident, &frozen, &p).is_empty());
    }
}
