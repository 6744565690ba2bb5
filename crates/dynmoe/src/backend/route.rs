//! Routing a token on the host: the top-k experts of its router probabilities, and the
//! probabilities confined to a resident set. The CPU backends route with these, and they
//! are the reference every backend's on-device routing is checked against.

use std::borrow::Cow;

use crate::checkpoint::config::Router;

/// The experts chosen for one token and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Expert ids, best first.
    pub experts: Vec<u32>,
    /// Weight of each chosen expert's output.
    pub weights: Vec<f32>,
}

/// Picks the experts of one token from its router's `scores` (the softmax
/// probabilities, or a sigmoid router's scores, with `bias` its correction bias) as
/// `router` does: best first, ties to the lower id.
pub fn route(scores: &[f32], bias: Option<&[f32]>, top_k: usize, router: Router) -> Route {
    match router {
        Router::SoftmaxTopK { renormalize } => {
            let experts = best(scores, (0..scores.len() as u32).collect(), top_k);
            let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e as usize]).collect();
            if renormalize {
                let sum: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            Route { experts, weights }
        }
        Router::SigmoidGroups {
            groups,
            top_groups,
            renormalize,
            scale,
        } => {
            let choice: Vec<f32> = match bias {
                Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
                None => scores.to_vec(),
            };
            let experts = grouped(&choice, groups, top_groups, top_k);
            let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e as usize]).collect();
            // As the reference implementations divide: the sum plus 1e-20.
            let sum = if renormalize {
                weights.iter().sum::<f32>() + 1e-20
            } else {
                1.0
            };
            weights.iter_mut().for_each(|w| *w = *w / sum * scale);
            Route { experts, weights }
        }
    }
}

/// The `k` of `candidates` with the largest `key`, best first, ties to the lower id.
fn best(key: &[f32], mut candidates: Vec<u32>, k: usize) -> Vec<u32> {
    let better = |a: &u32, b: &u32| key[*b as usize].total_cmp(&key[*a as usize]).then(a.cmp(b));
    // Select, then sort only the chosen: a prompt routes every token of every layer here,
    // and a full sort of 128 or 256 experts a token cost milliseconds a layer.
    if k == 0 {
        candidates.clear();
    } else if k < candidates.len() {
        candidates.select_nth_unstable_by(k - 1, better);
        candidates.truncate(k);
    }
    candidates.sort_by(better);
    candidates
}

/// The grouped choice of a sigmoid router over its `choice` scores (bias added): each
/// group scored by the sum of its two best, the top-k taken within the `top_groups` best
/// groups. Experts confined away (−∞) never count: a group scores its finite best two,
/// and should the chosen groups hold fewer than `top_k` finite experts, every finite
/// expert is a candidate (confinement wins over the group limit).
fn grouped(choice: &[f32], groups: usize, top_groups: usize, top_k: usize) -> Vec<u32> {
    let per = choice.len() / groups;
    let group_score: Vec<f32> = choice
        .chunks(per)
        .map(|g| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in g.iter().filter(|v| v.is_finite()) {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            match (a.is_finite(), b.is_finite()) {
                (true, true) => a + b,
                (true, false) => a,
                _ => f32::NEG_INFINITY,
            }
        })
        .collect();
    let chosen = best(&group_score, (0..groups as u32).collect(), top_groups);
    let finite = |e: &u32| choice[*e as usize].is_finite();
    let mut candidates: Vec<u32> = chosen
        .iter()
        .flat_map(|&g| g * per as u32..(g + 1) * per as u32)
        .filter(finite)
        .collect();
    if candidates.len() < top_k {
        candidates = (0..choice.len() as u32).filter(finite).collect();
    }
    best(choice, candidates, top_k)
}

/// The scores of one token with routing confined to `resident`, the others set to −∞
/// (never picked). A softmax router's logits are masked before its softmax, so the
/// residents' probabilities are renormalised over the residents; a sigmoid router's
/// scores are each the expert's own and stay as they are.
pub fn confine(scores: &[f32], resident: &[bool], router: Router) -> Vec<f32> {
    let s: f32 = match router {
        Router::SoftmaxTopK { .. } => scores
            .iter()
            .zip(resident)
            .filter(|(_, &r)| r)
            .map(|(p, _)| p)
            .sum(),
        Router::SigmoidGroups { .. } => 1.0,
    };
    scores
        .iter()
        .zip(resident)
        .map(|(&p, &r)| if r { p / s } else { f32::NEG_INFINITY })
        .collect()
}

/// The router's scores of `rows` tokens (`[rows, E]`) as a distribution over the experts
/// per token, what hit rates and a resident set's evidence weigh: a softmax router's
/// probabilities as they are, a sigmoid router's scores divided by their sum (each is the
/// expert's own, so a token's scores do not sum to one).
pub fn as_distribution(scores: &[f32], experts: usize, router: Router) -> Cow<'_, [f32]> {
    match router {
        Router::SoftmaxTopK { .. } => Cow::Borrowed(scores),
        Router::SigmoidGroups { .. } => Cow::Owned(
            scores
                .chunks(experts)
                .flat_map(|t| {
                    let sum: f32 = t.iter().sum();
                    t.iter().map(move |s| s / sum)
                })
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_best_first_and_renormalises() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        let r = route(&probs, None, 2, Router::SoftmaxTopK { renormalize: true });
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 4.0 / 7.0).abs() < 1e-6 && (r.weights[1] - 3.0 / 7.0).abs() < 1e-6);
        let r = route(&probs, None, 2, Router::SoftmaxTopK { renormalize: false });
        assert_eq!(r.weights, vec![0.4, 0.3]);
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let r = route(
            &[0.25; 4],
            None,
            2,
            Router::SoftmaxTopK { renormalize: false },
        );
        assert_eq!(r.experts, vec![0, 1]);
    }

    #[test]
    fn selection_picks_what_a_full_sort_picks() {
        let mut rng = crate::testing::Rng::new(5);
        for experts in [1usize, 7, 128] {
            // Few distinct values, so ties are common.
            let probs: Vec<f32> = (0..experts)
                .map(|_| (rng.next_u64() % 5) as f32 / 5.0)
                .collect();
            let mut sorted: Vec<u32> = (0..experts as u32).collect();
            sorted.sort_by(|&a, &b| {
                probs[b as usize]
                    .total_cmp(&probs[a as usize])
                    .then(a.cmp(&b))
            });
            for top_k in 0..=experts {
                let r = route(
                    &probs,
                    None,
                    top_k,
                    Router::SoftmaxTopK { renormalize: false },
                );
                assert_eq!(r.experts, sorted[..top_k], "{experts} experts, top {top_k}");
            }
        }
    }
    const GROUPED: Router = Router::SigmoidGroups {
        groups: 4,
        top_groups: 2,
        renormalize: true,
        scale: 2.5,
    };

    #[test]
    fn sigmoid_router_chooses_within_the_best_groups_and_weighs_without_the_bias() {
        // Four groups of two. Group scores (best two summed): 0.9, 0.6+0.55, 0.7+0.3,
        // 0.5+0.35: groups 1 and 2 win although expert 0 scores best of all.
        let scores = [0.9, 0.0, 0.6, 0.55, 0.7, 0.3, 0.5, 0.35];
        let r = route(&scores, None, 2, GROUPED);
        assert_eq!(r.experts, vec![4, 2]);
        let sum = 0.7 + 0.6 + 1e-20;
        assert!((r.weights[0] - 0.7 / sum * 2.5).abs() < 1e-6);
        assert!((r.weights[1] - 0.6 / sum * 2.5).abs() < 1e-6);
        // The bias moves the choice (expert 3 past expert 2), not the weights.
        let bias = [0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0];
        let r = route(&scores, Some(&bias), 2, GROUPED);
        assert_eq!(r.experts, vec![4, 3]);
        let sum = 0.7 + 0.55 + 1e-20;
        assert!((r.weights[1] - 0.55 / sum * 2.5).abs() < 1e-6);
    }

    #[test]
    fn one_group_is_a_plain_top_k_of_the_biased_scores() {
        let mut rng = crate::testing::Rng::new(11);
        let router = Router::SigmoidGroups {
            groups: 1,
            top_groups: 1,
            renormalize: false,
            scale: 1.0,
        };
        for _ in 0..50 {
            let scores: Vec<f32> = (0..16).map(|_| rng.uniform()).collect();
            let bias: Vec<f32> = (0..16).map(|_| rng.uniform() * 0.2 - 0.1).collect();
            let biased: Vec<f32> = scores.iter().zip(&bias).map(|(s, b)| s + b).collect();
            let r = route(&scores, Some(&bias), 4, router);
            let want = route(&biased, None, 4, Router::SoftmaxTopK { renormalize: false });
            assert_eq!(r.experts, want.experts);
            let raw: Vec<f32> = r.experts.iter().map(|&e| scores[e as usize]).collect();
            assert_eq!(r.weights, raw);
        }
    }

    #[test]
    fn confined_sigmoid_routing_picks_only_residents() {
        let mut rng = crate::testing::Rng::new(12);
        for _ in 0..200 {
            let scores: Vec<f32> = (0..16).map(|_| rng.uniform()).collect();
            // From exactly three residents (one top-k) to all sixteen, scattered across
            // the groups, so some chosen groups hold none.
            let want = 3 + (rng.next_u64() % 14) as usize;
            let mut resident = vec![false; 16];
            while resident.iter().filter(|&&r| r).count() < want {
                resident[(rng.next_u64() % 16) as usize] = true;
            }
            let confined = confine(&scores, &resident, GROUPED);
            let kept: Vec<f32> = scores
                .iter()
                .zip(&resident)
                .filter(|(_, &r)| r)
                .map(|(s, _)| *s)
                .collect();
            assert_eq!(
                confined
                    .iter()
                    .copied()
                    .filter(|v| v.is_finite())
                    .collect::<Vec<_>>(),
                kept
            );
            let r = route(&confined, None, 3, GROUPED);
            assert_eq!(r.experts.len(), 3);
            assert!(
                r.experts.iter().all(|&e| resident[e as usize]),
                "{r:?} {resident:?}"
            );
            assert!(r.weights.iter().all(|w| w.is_finite()));
        }
    }
    #[test]
    fn a_sigmoid_routers_scores_become_a_distribution_per_token() {
        let scores = [0.9, 0.9, 0.1, 0.1, 0.01, 0.01, 0.19, 0.19];
        let d = as_distribution(&scores, 4, GROUPED);
        for t in d.chunks(4) {
            assert!((t.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        assert!((d[0] - 0.45).abs() < 1e-6 && (d[6] - 0.475).abs() < 1e-6);
        let soft = Router::SoftmaxTopK { renormalize: true };
        assert!(matches!(
            as_distribution(&scores, 4, soft),
            Cow::Borrowed(_)
        ));
    }
}
