//! Picking the next token from one row of logits: penalties, temperature, top-k, min-p and
//! top-p, then one draw. This host version is the reference a backend's sampler is checked
//! against; every step is defined so that a GPU can follow it exactly.
//!
//! 1. Penalties, on the tokens the sequence holds (`counts[t] > 0`): the repetition
//!    penalty divides a positive logit by `r` and multiplies a negative one by it; the
//!    presence penalty subtracts once, the frequency penalty once per occurrence.
//! 2. At temperature 0 the token is the largest logit (the lowest id on ties).
//! 3. Otherwise `s = logit / T` and `w = exp(s - max s)`. Tokens are ordered by `s`,
//!    larger first, the lower id first on ties.
//! 4. Kept: the first `top_k` tokens in that order, those with `w >= min_p`, and of those
//!    the shortest prefix of the order whose weight reaches `top_p` of theirs.
//! 5. One uniform draw `u` ([`crate::rng::uniform_at`] of the seed at the token's
//!    position) picks the kept token where the running sum of `w` over the kept tokens,
//!    in id order, first passes `u` times their total.

use crate::rng::uniform_at;

/// How the next token is picked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Divides the logits; 0 (or less) picks the most probable token.
    pub temperature: f32,
    /// Keep the k most probable tokens (0: all).
    pub top_k: usize,
    /// Keep the fewest most probable tokens whose probability reaches p (1: all).
    pub top_p: f32,
    /// Keep tokens at least this fraction as probable as the most probable one (0: all).
    pub min_p: f32,
    /// Above 1, makes tokens the sequence holds less probable (1: off).
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the sequence holds (0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the sequence holds it (0: off).
    pub frequency_penalty: f32,
    /// Seed of the draws: the same seed, prompt and settings give the same tokens.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::GREEDY
    }
}

impl Sampling {
    /// The most probable token, no penalties.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: 0,
    };

    /// Whether any penalty applies.
    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Whether the token is the largest (penalized) logit, with no draw.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Why these settings cannot be used, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let finite = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repetition_penalty", self.repetition_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ];
        if let Some((name, v)) = finite.iter().find(|(_, v)| !v.is_finite()) {
            return Err(format!("{name} must be a finite number, got {v}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(format!(
                "repetition_penalty must be positive, got {}",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// The logit after the penalties for a token the sequence holds `count` times.
pub fn penalized(logit: f32, count: u32, s: &Sampling) -> f32 {
    if count == 0 {
        return logit;
    }
    let r = s.repetition_penalty;
    let l = if logit > 0.0 { logit / r } else { logit * r };
    l - s.presence_penalty - s.frequency_penalty * count as f32
}

/// How many times each of `vocab` tokens occurs in `tokens`: the counts the penalties read.
pub fn counts(tokens: &[u32], vocab: usize) -> Vec<u32> {
    let mut c = vec![0u32; vocab];
    for &t in tokens {
        if let Some(n) = c.get_mut(t as usize) {
            *n += 1;
        }
    }
    c
}

/// The token picked from `logits` for the token at `position` of a sequence that holds
/// each token `counts[t]` times (`counts` may be empty when no penalty applies).
pub fn sample(logits: &[f32], counts: &[u32], s: &Sampling, position: u64) -> u32 {
    let count = |t: usize| counts.get(t).copied().unwrap_or(0);
    let logit = |t: usize| penalized(logits[t], count(t), s);
    if s.is_greedy() {
        let mut best = 0;
        for t in 1..logits.len() {
            if logit(t) > logit(best) {
                best = t;
            }
        }
        return best as u32;
    }
    let scaled: Vec<f32> = (0..logits.len())
        .map(|t| logit(t) / s.temperature)
        .collect();
    let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f32> = scaled.iter().map(|&v| (v - max).exp()).collect();
    let weight = |t: u32| w[t as usize];
    // Larger first, the lower id first on ties.
    let before = |a: &u32, b: &u32| {
        scaled[*b as usize]
            .total_cmp(&scaled[*a as usize])
            .then(a.cmp(b))
    };
    let mut kept: Vec<u32> = (0..logits.len() as u32)
        .filter(|&t| s.min_p <= 0.0 || weight(t) >= s.min_p)
        .collect();
    if s.top_k > 0 && s.top_k < kept.len() {
        kept.select_nth_unstable_by(s.top_k - 1, before);
        kept.truncate(s.top_k);
    }
    if s.top_p < 1.0 {
        kept = top_p_prefix(kept, &weight, &before, s.top_p);
    }
    kept.sort_unstable();
    let total: f64 = kept.iter().map(|&t| weight(t) as f64).sum();
    let target = uniform_at(s.seed, position) as f64 * total;
    let mut acc = 0.0f64;
    for &t in &kept {
        acc += weight(t) as f64;
        if acc > target {
            return t;
        }
    }
    *kept.last().expect("the most probable token is always kept")
}

/// The shortest prefix of `kept` in the order `before` whose weight reaches `p` of all
/// of theirs. The order is found a chunk at a time, each chunk selected from what is left
/// and sorted alone, so a peaked distribution costs a few linear passes, not a sort of
/// the vocabulary.
fn top_p_prefix(
    mut rest: Vec<u32>,
    weight: &dyn Fn(u32) -> f32,
    before: &dyn Fn(&u32, &u32) -> std::cmp::Ordering,
    p: f32,
) -> Vec<u32> {
    let total: f64 = rest.iter().map(|&t| weight(t) as f64).sum();
    let goal = p as f64 * total;
    let mut prefix = Vec::new();
    let mut acc = 0.0f64;
    let mut chunk = 64;
    while !rest.is_empty() {
        let take = chunk.min(rest.len());
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, before);
        }
        let mut head: Vec<u32> = rest.drain(..take).collect();
        head.sort_unstable_by(before);
        for t in head {
            // A token is kept while the weight before it falls short of the goal.
            if acc >= goal {
                return prefix;
            }
            acc += weight(t) as f64;
            prefix.push(t);
        }
        chunk *= 4;
    }
    prefix
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// The sampler by its definition: every token sorted, the prefix cut, the draw.
    fn by_definition(logits: &[f32], counts: &[u32], s: &Sampling, position: u64) -> u32 {
        let l: Vec<f32> = (0..logits.len())
            .map(|t| penalized(logits[t], counts.get(t).copied().unwrap_or(0), s))
            .collect();
        let scaled: Vec<f32> = l.iter().map(|v| v / s.temperature).collect();
        let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = scaled.iter().map(|v| (v - max).exp()).collect();
        let mut order: Vec<u32> = (0..l.len() as u32).collect();
        order.sort_by(|&a, &b| {
            scaled[b as usize]
                .total_cmp(&scaled[a as usize])
                .then(a.cmp(&b))
        });
        if s.top_k > 0 {
            order.truncate(s.top_k);
        }
        order.retain(|&t| s.min_p <= 0.0 || w[t as usize] >= s.min_p);
        let total: f64 = order.iter().map(|&t| w[t as usize] as f64).sum();
        let mut acc = 0.0f64;
        let cut = order
            .iter()
            .position(|&t| {
                let keep = acc < s.top_p as f64 * total;
                acc += w[t as usize] as f64;
                !keep
            })
            .unwrap_or(order.len());
        order.truncate(cut);
        order.sort_unstable();
        let kept: f64 = order.iter().map(|&t| w[t as usize] as f64).sum();
        let target = uniform_at(s.seed, position) as f64 * kept;
        let mut acc = 0.0f64;
        for &t in &order {
            acc += w[t as usize] as f64;
            if acc > target {
                return t;
            }
        }
        *order.last().unwrap()
    }

    #[test]
    fn the_sampler_follows_its_definition() {
        let mut rng = Rng::new(31);
        let settings = [
            Sampling {
                temperature: 0.8,
                top_p: 0.95,
                ..Sampling::GREEDY
            },
            Sampling {
                temperature: 1.3,
                top_k: 40,
                min_p: 0.05,
                ..Sampling::GREEDY
            },
            Sampling {
                temperature: 0.5,
                top_p: 0.5,
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.25,
                ..Sampling::GREEDY
            },
            Sampling {
                temperature: 1.0,
                ..Sampling::GREEDY
            },
        ];
        for (i, s) in settings.iter().enumerate() {
            for trial in 0..40 {
                let v = [5usize, 100, 3000][trial % 3];
                // Scaled so some rows are peaked and some flat; a few repeated values tie.
                let spread = [0.3f32, 3.0, 12.0][trial % 3];
                let logits: Vec<f32> = (0..v)
                    .map(|t| {
                        if t % 17 == 3 {
                            1.0
                        } else {
                            rng.normal() * spread
                        }
                    })
                    .collect();
                let counts: Vec<u32> = (0..v).map(|_| (rng.next_u64() % 4) as u32).collect();
                let s = Sampling {
                    seed: rng.next_u64(),
                    ..*s
                };
                let pos = rng.next_u64() % 4096;
                assert_eq!(
                    sample(&logits, &counts, &s, pos),
                    by_definition(&logits, &counts, &s, pos),
                    "setting {i}, trial {trial}"
                );
            }
        }
    }

    #[test]
    fn greedy_takes_the_largest_penalized_logit_and_the_lower_id_on_ties() {
        let logits = [1.0, 3.0, 3.0, 2.0];
        assert_eq!(sample(&logits, &[], &Sampling::GREEDY, 0), 1);
        let s = Sampling {
            presence_penalty: 1.5,
            ..Sampling::GREEDY
        };
        assert_eq!(sample(&logits, &[0, 1, 1, 0], &s, 0), 3);
    }

    #[test]
    fn draws_follow_the_kept_probabilities() {
        // Two tokens kept by top-k, in the ratio e^1 : 1 at temperature 1.
        let logits = [0.0f32, 1.0, -5.0, -6.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            seed: 99,
            ..Sampling::GREEDY
        };
        let n = 20_000;
        let ones = (0..n)
            .filter(|&pos| sample(&logits, &[], &s, pos) == 1)
            .count();
        let want = std::f64::consts::E / (1.0 + std::f64::consts::E);
        let got = ones as f64 / n as f64;
        assert!((got - want).abs() < 0.015, "{got} against {want}");
        assert!((0..n).all(|pos| sample(&logits, &[], &s, pos) < 2));
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let s = Sampling {
            temperature: 5.0,
            top_k: 1,
            seed: 9,
            ..Sampling::GREEDY
        };
        assert!((0..20).all(|pos| sample(&[0.1, 3.0, -1.0, 2.9], &[], &s, pos) == 1));
    }

    #[test]
    fn a_seed_gives_the_same_tokens_and_the_positions_vary_them() {
        let s = Sampling {
            temperature: 1.0,
            top_p: 0.9,
            seed: 42,
            ..Sampling::GREEDY
        };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let xs: Vec<u32> = (0..30).map(|pos| sample(&logits, &[], &s, pos)).collect();
        let ys: Vec<u32> = (0..30).map(|pos| sample(&logits, &[], &s, pos)).collect();
        assert_eq!(xs, ys);
        let distinct: std::collections::HashSet<_> = xs.iter().collect();
        assert!(distinct.len() > 1, "sampling never varied");
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let bad = Sampling {
            top_p: 0.0,
            ..Sampling::GREEDY
        };
        assert!(bad.check().unwrap_err().contains("top_p"));
        let bad = Sampling {
            temperature: f32::NAN,
            ..Sampling::GREEDY
        };
        assert!(bad.check().unwrap_err().contains("temperature"));
        assert!(Sampling::GREEDY.check().is_ok());
    }
}
