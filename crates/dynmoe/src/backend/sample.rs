//! Picking the next token from one row of logits: penalties, temperature, min-p, top-k and
//! top-p, then one draw. This host version is the reference a backend's sampler is checked
//! against; every step is defined so that a GPU can follow it with order-free integer sums
//! and max-reductions, and so give the same token for the same logits and seed.
//!
//! 1. Penalties, on the tokens the sequence holds (`counts[t] > 0`): the repetition
//!    penalty divides a positive logit by `r` and multiplies a negative one by it; the
//!    presence penalty subtracts once, the frequency penalty once per occurrence.
//! 2. At temperature 0 the token is the largest logit (the lowest id on ties).
//! 3. Otherwise `s = logit / T`, `w = exp(s - max s)` and the weight `W = ⌊w · 2^32⌋`.
//!    Candidates: every token, or with min-p those with `w >= min_p`. They are ordered by
//!    `s`, larger first, the lower id first on ties.
//! 4. Kept: the first `top_k` candidates, and of those the shortest prefix whose weight
//!    reaches `top_p` of theirs ([`kept`]). A GPU finds where the cut falls through a
//!    histogram of [`bin`]s and sorts only the candidates it must; should they be more
//!    than [`BIN_SORT_MAX`] (a near-flat distribution), whole bins are kept.
//! 5. The token is the kept one with the largest `s + g`, `g = -ln(-ln u)` Gumbel noise
//!    with `u` the Philox draw of (seed, the token's position, the token's id) (the lower
//!    id on ties): a sample of the kept tokens' softmax, whatever order they are visited in.

use crate::rng::philox4x32;

/// Bins of `(max s - s)` per unit of `s` in [`bin`].
pub const BINS_PER_UNIT: f32 = 128.0;

/// Bins of the histogram a sampler finds the top-k/top-p cut with: `s` within 32 units of
/// the maximum, finer than 1% of probability, and one bin for everything below.
pub const BINS: usize = 4096;

/// The most candidates of the bin where the cut falls that a sampler sorts to place it
/// exactly; above this the whole bin is kept.
pub const BIN_SORT_MAX: usize = 16384;

/// The histogram bin of a scaled logit `s` when the largest is `max`.
pub fn bin(s: f32, max: f32) -> usize {
    (((max - s) * BINS_PER_UNIT) as usize).min(BINS - 1)
}

/// A weight `w` in (0, 1] as the integer the cut is summed in: `w · 2^32`, rounded toward
/// zero.
pub fn fixed_weight(w: f32) -> u64 {
    (w as f64 * 4294967296.0) as u64
}

/// The Gumbel noise of token `id` at `position` under `seed`: `-ln(-ln u)` with `u` the
/// first Philox word's upper 24 bits, centred in its step so it is never 0 or 1.
pub fn gumbel(seed: u64, position: u64, id: u32) -> f32 {
    let w = philox4x32(
        [id, position as u32, (position >> 32) as u32, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    let u = ((w[0] >> 8) as f32 + 0.5) * (1.0 / (1u32 << 24) as f32);
    -(-u.ln()).ln()
}

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
/// each token `counts[t]` times (`counts` may be empty when no penalty applies);
/// [`NOT_A_TOKEN`](super::NOT_A_TOKEN) when a logit is not finite.
pub fn sample(logits: &[f32], counts: &[u32], s: &Sampling, position: u64) -> u32 {
    // A row that is not all finite has no token to give; the decode loop reports it.
    if !logits.iter().all(|l| l.is_finite()) {
        return super::NOT_A_TOKEN;
    }
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
    let mut kept: Vec<u32> = (0..logits.len() as u32)
        .filter(|&t| s.min_p <= 0.0 || w[t as usize] >= s.min_p)
        .collect();
    if s.top_k > 0 || s.top_p < 1.0 {
        kept = self::kept(kept, &scaled, &w, max, s);
    }
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for t in kept {
        let v = scaled[t as usize] + gumbel(s.seed, position, t);
        if v > best.0 || (v == best.0 && t < best.1) {
            best = (v, t);
        }
    }
    best.1
}

/// [`sample`] of each row of `logits` (`[rows, vocab]`): row `r` by `sampling[r]` for the
/// position after `positions[r]`, the penalties counting the tokens `held[r]`.
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    sampling: &[Sampling],
    positions: &[usize],
    held: &[&[u32]],
) -> Vec<u32> {
    let rows = logits.chunks(vocab).zip(sampling).zip(positions).zip(held);
    rows.map(|(((l, s), &pos), held)| {
        let counts = match s.penalizes() {
            true => counts(held, vocab),
            false => Vec::new(),
        };
        sample(l, &counts, s, pos as u64 + 1)
    })
    .collect()
}

/// The kept candidates of step 4 (`cands` are those min-p keeps): the first `top_k` in
/// the order (larger `s` first, the lower id on ties) and of those the shortest prefix
/// whose weight reaches `top_p` of theirs. The cut is placed as a GPU places it: a
/// histogram of [`bin`]s finds the bin it falls in, and only that bin's candidates (with
/// top-k, all those up to it) are sorted; when they are more than [`BIN_SORT_MAX`], whole
/// bins are kept instead.
pub fn kept(cands: Vec<u32>, scaled: &[f32], w: &[f32], max: f32, s: &Sampling) -> Vec<u32> {
    let bin_of = |t: u32| bin(scaled[t as usize], max);
    let weight = |t: u32| fixed_weight(w[t as usize]);
    let before = |a: &u32, b: &u32| {
        scaled[*b as usize]
            .total_cmp(&scaled[*a as usize])
            .then(a.cmp(b))
    };
    let goal = |total: u64| (s.top_p as f64 * total as f64).ceil() as u64;
    // The shortest prefix of `sorted` whose weight, after `ahead` of it, reaches `goal`:
    // a token is kept while the weight before it falls short.
    let prefix = |sorted: &[u32], ahead: u64, goal: u64| {
        let mut acc = ahead;
        let n = sorted
            .iter()
            .take_while(|&&t| {
                let keep = acc < goal;
                acc += weight(t);
                keep
            })
            .count();
        sorted[..n].to_vec()
    };
    // The first bin where a running sum over the bins in order reaches `goal`.
    let first_reaching = |per_bin: &[u64], goal: u64| {
        let mut acc = 0u64;
        per_bin
            .iter()
            .position(|&v| {
                acc += v;
                acc >= goal
            })
            .unwrap_or(BINS - 1)
    };
    if s.top_k > 0 && s.top_k < cands.len() {
        let mut counts = vec![0u64; BINS];
        cands.iter().for_each(|&t| counts[bin_of(t)] += 1);
        let cut = first_reaching(&counts, s.top_k as u64);
        let mut upto: Vec<u32> = cands.into_iter().filter(|&t| bin_of(t) <= cut).collect();
        if upto.len() <= BIN_SORT_MAX {
            upto.sort_unstable_by(before);
            upto.truncate(s.top_k);
            if s.top_p < 1.0 {
                let total = upto.iter().map(|&t| weight(t)).sum();
                upto = prefix(&upto, 0, goal(total));
            }
            return upto;
        }
        if s.top_p < 1.0 {
            let mut mass = vec![0u64; BINS];
            upto.iter().for_each(|&t| mass[bin_of(t)] += weight(t));
            let total = mass.iter().sum();
            let cut = first_reaching(&mass, goal(total));
            upto.retain(|&t| bin_of(t) <= cut);
        }
        return upto;
    }
    if s.top_p >= 1.0 {
        return cands;
    }
    let mut mass = vec![0u64; BINS];
    cands.iter().for_each(|&t| mass[bin_of(t)] += weight(t));
    let goal = goal(mass.iter().sum());
    let cut = first_reaching(&mass, goal);
    let (mut crowd, mut kept): (Vec<u32>, Vec<u32>) = cands
        .into_iter()
        .filter(|&t| bin_of(t) <= cut)
        .partition(|&t| bin_of(t) == cut);
    if crowd.len() > BIN_SORT_MAX {
        kept.extend(crowd);
        return kept;
    }
    crowd.sort_unstable_by(before);
    let ahead: u64 = mass[..cut].iter().sum();
    kept.extend(prefix(&crowd, ahead, goal));
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// The sampler by its definition: every candidate sorted, the exact cut, whole bins
    /// where the GPU would have too many to sort, the Gumbel argmax.
    fn by_definition(logits: &[f32], counts: &[u32], s: &Sampling, position: u64) -> u32 {
        let l: Vec<f32> = (0..logits.len())
            .map(|t| penalized(logits[t], counts.get(t).copied().unwrap_or(0), s))
            .collect();
        let scaled: Vec<f32> = l.iter().map(|v| v / s.temperature).collect();
        let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = scaled.iter().map(|v| (v - max).exp()).collect();
        let bin_of = |t: u32| bin(scaled[t as usize], max);
        let mut order: Vec<u32> = (0..l.len() as u32)
            .filter(|&t| s.min_p <= 0.0 || w[t as usize] >= s.min_p)
            .collect();
        order.sort_by(|&a, &b| {
            scaled[b as usize]
                .total_cmp(&scaled[a as usize])
                .then(a.cmp(&b))
        });
        let candidates = order.clone();
        let top_k = (s.top_k > 0 && s.top_k < order.len()).then_some(s.top_k);
        if let Some(k) = top_k {
            order.truncate(k);
        }
        let weight = |t: &u32| fixed_weight(w[*t as usize]);
        let total: u64 = order.iter().map(weight).sum();
        let goal = (s.top_p as f64 * total as f64).ceil() as u64;
        let mut acc = 0u64;
        order.retain(|t| {
            let keep = s.top_p >= 1.0 || acc < goal;
            acc += weight(t);
            keep
        });
        // Where the histogram's sort would overflow, whole bins.
        let crowd = |b: usize| candidates.iter().filter(|&&t| bin_of(t) == b).count();
        let upto = |b: usize| -> Vec<u32> {
            candidates
                .iter()
                .copied()
                .filter(|&t| bin_of(t) <= b)
                .collect()
        };
        if let Some(k) = top_k {
            let cut = bin_of(candidates[k - 1]);
            let g = upto(cut);
            if g.len() > BIN_SORT_MAX {
                order = g;
                if s.top_p < 1.0 {
                    let total: u64 = order.iter().map(weight).sum();
                    let goal = (s.top_p as f64 * total as f64).ceil() as u64;
                    let mut acc = 0u64;
                    let last = order.iter().find(|t| {
                        acc += weight(t);
                        acc >= goal
                    });
                    let cut = last.map_or(BINS - 1, |&t| bin_of(t));
                    order.retain(|&t| bin_of(t) <= cut);
                }
            }
        } else if s.top_p < 1.0 {
            let cut = bin_of(*order.last().unwrap());
            if crowd(cut) > BIN_SORT_MAX {
                order = upto(cut);
            }
        }
        order.sort_unstable();
        let mut best = (f32::NEG_INFINITY, 0);
        for &t in &order {
            let v = scaled[t as usize] + gumbel(s.seed, position, t);
            if v > best.0 {
                best = (v, t);
            }
        }
        best.1
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
            Sampling {
                temperature: 0.7,
                top_k: 3000,
                top_p: 0.8,
                ..Sampling::GREEDY
            },
        ];
        for (i, s) in settings.iter().enumerate() {
            for trial in 0..40 {
                let v = [5usize, 100, 3000, 20_000][trial % 4];
                // Scaled so some rows are peaked and some flat (the last so flat that the
                // cut falls in a bin too crowded to sort); a few repeated values tie.
                let spread = [0.3f32, 3.0, 12.0, 1e-4][trial % 4];
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

    /// SplitMix64's finalizer of `seed + t · φ`: the cases' inputs, made again bit for bit
    /// by the C++ program that reads them.
    fn case_bits(seed: u64, t: u64) -> u64 {
        let mut z = seed.wrapping_add(t.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A case's logits: uniform in ±spread/2 from [`case_bits`], every 17th token at 1 (ties).
    fn case_logits(seed: u64, vocab: usize, spread: f32) -> Vec<f32> {
        (0..vocab as u64)
            .map(|t| match t % 17 {
                3 => 1.0,
                _ => ((case_bits(seed, t) >> 40) as f32 / (1u32 << 24) as f32 - 0.5) * spread,
            })
            .collect()
    }

    /// A case's counts: 2 for one token in eight.
    fn case_counts(seed: u64, vocab: usize) -> Vec<u32> {
        (0..vocab as u64)
            .map(|t| u32::from(case_bits(seed ^ 0xC0FF_EE00, t).is_multiple_of(8)) * 2)
            .collect()
    }

    /// Cases of the sampler with the token it picks, one a line: tools/cuda-host-check
    /// makes the same inputs, runs the device sampler's kernels on them and must pick the
    /// same tokens. Seeded alone, so the file is fixed.
    fn cases() -> String {
        let mut out = String::from(
            "# backend::sample cases, one a line: vocab top_k top_p min_p repetition presence \
             frequency temperature (f32 bits) seed position logits-seed spread (bits) \
             penalized spoilt token; spoilt 1 puts a NaN at vocab/3, 2 +inf at vocab/2, 3 -inf \
             at 5\n",
        );
        let settings = [
            (0.0, 0, 1.0, 0.0, 1.3, 0.2, 0.1),
            (0.8, 0, 1.0, 0.0, 1.0, 0.0, 0.0),
            (0.8, 0, 1.0, 0.05, 1.0, 0.0, 0.0),
            (0.8, 0, 0.95, 0.0, 1.0, 0.0, 0.0),
            (1.2, 40, 1.0, 0.0, 1.0, 0.0, 0.0),
            (0.7, 40, 0.9, 0.02, 1.2, 0.3, 0.2),
            (1.0, 3000, 0.8, 0.0, 1.0, 0.0, 0.0),
            (0.6, 0, 0.5, 0.0, 1.0, 0.0, 0.0),
        ];
        // Peaked, middling and flat rows; the flat ones too crowded to sort. Then a few
        // rows holding a value that is not finite, which have no token.
        let rows = [(1000, 1.0f32), (8192, 8.0), (20_000, 30.0), (20_000, 1e-4)];
        let clean = settings.iter().flat_map(|s| rows.map(|r| (*s, r, 0)));
        let spoilt = [(0, 1), (1, 1), (3, 2), (5, 3), (6, 1)]
            .map(|(i, how)| (settings[i], (8192, 8.0), how));
        let mut k = 0u64;
        for ((temp, top_k, top_p, min_p, rep, pres, freq), (vocab, spread), spoil) in
            clean.chain(spoilt)
        {
            k += 1;
            let s = Sampling {
                temperature: temp,
                top_k,
                top_p,
                min_p,
                repetition_penalty: rep,
                presence_penalty: pres,
                frequency_penalty: freq,
                seed: case_bits(k, 1),
            };
            let position = case_bits(k, 2) % 100_000;
            let mut logits = case_logits(k, vocab, spread);
            match spoil {
                1 => logits[vocab / 3] = f32::NAN,
                2 => logits[vocab / 2] = f32::INFINITY,
                3 => logits[5] = f32::NEG_INFINITY,
                _ => {}
            }
            let penalized = s.penalizes();
            let counts = if penalized {
                case_counts(k, vocab)
            } else {
                Vec::new()
            };
            let token = sample(&logits, &counts, &s, position);
            let bits =
                [top_p, min_p, rep, pres, freq, temp].map(|x| format!("{:08x}", x.to_bits()));
            out += &format!(
                "{vocab} {top_k} {} {} {position} {k} {:08x} {} {spoil} {token}\n",
                bits.join(" "),
                s.seed,
                spread.to_bits(),
                u8::from(penalized)
            );
        }
        out
    }

    fn cases_file() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tools/cuda-host-check/sample_cases.txt")
    }

    /// The cases the device sampler is checked on are this sampler's: rewrite them with
    /// `cargo test -p dynmoe --lib -- --ignored write_sample_cases` after changing it.
    #[test]
    fn the_device_samplers_cases_are_this_samplers() {
        let file = std::fs::read_to_string(cases_file()).unwrap_or_default();
        assert!(
            file == cases(),
            "{} is not what backend::sample picks; rewrite it (see this test's doc)",
            cases_file().display()
        );
    }

    #[test]
    #[ignore = "writes tools/cuda-host-check/sample_cases.txt"]
    fn write_sample_cases() {
        std::fs::write(cases_file(), cases()).unwrap();
    }
}
