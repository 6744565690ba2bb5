//! Routing a token on the host: the top-k experts of its router probabilities, and the
//! probabilities confined to a resident set. The CPU backends route with these, and they
//! are the reference every backend's on-device routing is checked against.

use crate::checkpoint::config::Router;

/// The experts chosen for one token and their weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Expert ids, best first.
    pub experts: Vec<u32>,
    /// Weight of each chosen expert's output.
    pub weights: Vec<f32>,
}

/// Picks the `top_k` most probable experts of one token. Ties go to the lower id.
pub fn route(probs: &[f32], top_k: usize, router: Router) -> Route {
    let better = |a: &u32, b: &u32| {
        probs[*b as usize]
            .total_cmp(&probs[*a as usize])
            .then(a.cmp(b))
    };
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    // Select, then sort only the chosen: a prompt routes every token of every layer here,
    // and a full sort of 128 or 256 experts a token cost milliseconds a layer.
    if top_k == 0 {
        order.clear();
    } else if top_k < order.len() {
        order.select_nth_unstable_by(top_k - 1, better);
        order.truncate(top_k);
    }
    order.sort_by(better);
    let mut weights: Vec<f32> = order.iter().map(|&e| probs[e as usize]).collect();
    match router {
        Router::SoftmaxTopK { renormalize: true } => {
            let sum: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        Router::SoftmaxTopK { renormalize: false } => {}
    }
    Route {
        experts: order,
        weights,
    }
}

/// The probabilities of one token with routing confined to `resident`: the router
/// logits of the others set to −∞ before the softmax, so the residents' probabilities
/// are renormalised over the residents and the others are −∞ (never picked).
pub fn confine(probs: &[f32], resident: &[bool]) -> Vec<f32> {
    let s: f32 = probs
        .iter()
        .zip(resident)
        .filter(|(_, &r)| r)
        .map(|(p, _)| p)
        .sum();
    probs
        .iter()
        .zip(resident)
        .map(|(&p, &r)| if r { p / s } else { f32::NEG_INFINITY })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_best_first_and_renormalises() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        let r = route(&probs, 2, Router::SoftmaxTopK { renormalize: true });
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 4.0 / 7.0).abs() < 1e-6 && (r.weights[1] - 3.0 / 7.0).abs() < 1e-6);
        let r = route(&probs, 2, Router::SoftmaxTopK { renormalize: false });
        assert_eq!(r.weights, vec![0.4, 0.3]);
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let r = route(&[0.25; 4], 2, Router::SoftmaxTopK { renormalize: false });
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
                let r = route(&probs, top_k, Router::SoftmaxTopK { renormalize: false });
                assert_eq!(r.experts, sorted[..top_k], "{experts} experts, top {top_k}");
            }
        }
    }
}
