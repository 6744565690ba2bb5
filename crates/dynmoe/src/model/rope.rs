//! Rotary inverse frequencies as transformers computes them: the default, linear
//! scaling and YaRN (DeepSeek-V3), laid out over `head_dim / 2` pairs with zeros for the
//! pairs that do not rotate (partial rotary, latent attention: see
//! `checkpoint::arch::partial_rotary` and `model::mla`).

use crate::checkpoint::config::{Config, Yarn};

/// Inverse frequencies as transformers computes them in float32:
/// `1 / theta^(2i / d)`, divided by the linear scaling factor.
pub fn rope_inv_freq(theta: f32, head_dim: usize, linear_factor: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32) / linear_factor)
        .collect()
}

/// A model's inverse frequencies, one per pair of a head (`head_dim / 2`): those of its
/// `rotary_dim` rotating values first, then zeros, a rotation by nothing.
pub fn model_inv_freq(config: &Config) -> Vec<f32> {
    let r = &config.rope;
    let mut freqs = match &r.yarn {
        Some(y) => yarn_inv_freq(r.theta, r.rotary_dim, y),
        None => rope_inv_freq(r.theta, r.rotary_dim, r.linear_factor),
    };
    freqs.resize(config.head_dim / 2, 0.0);
    freqs
}

/// YaRN's `mscale`: `0.1 · m · ln(scale) + 1`, or 1 for no extension.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Yarn {
    /// What transformers multiplies the rotary cosines and sines by, so the rotating
    /// values of queries and keys alike.
    pub fn attention_factor(&self) -> f64 {
        match (self.attention_factor, self.mscale, self.mscale_all_dim) {
            (Some(f), ..) => f,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(self.factor, m) / yarn_mscale(self.factor, all)
            }
            _ => yarn_mscale(self.factor, 1.0),
        }
    }

    /// What latent attention multiplies its softmax scale by: `mscale(factor,
    /// mscale_all_dim)²`, or 1 without `mscale_all_dim`.
    pub fn softmax_mscale(&self) -> f64 {
        match self.mscale_all_dim {
            Some(all) if all != 0.0 => yarn_mscale(self.factor, all).powi(2),
            _ => 1.0,
        }
    }
}

/// YaRN's inverse frequencies over `dim` rotating values: high frequencies kept, low
/// ones divided by the factor, a linear ramp between the correction range's ends;
/// in float32 where transformers computes in float32.
pub fn yarn_inv_freq(theta: f32, dim: usize, y: &Yarn) -> Vec<f32> {
    let base = theta as f64;
    let correction = |rotations: f64| {
        dim as f64
            * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction(y.beta_fast), correction(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    let (low, high) = (low as f32, high as f32);
    (0..dim / 2)
        .map(|i| {
            let pos = theta.powf((2 * i) as f32 / dim as f32);
            let (extrapolated, interpolated) = (1.0 / pos, 1.0 / (y.factor as f32 * pos));
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interpolated * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            attention_factor: None,
            truncate: true,
        }
    }

    #[test]
    fn yarn_keeps_the_fastest_and_divides_the_slowest_frequencies() {
        let y = yarn(40.0);
        let plain = rope_inv_freq(10000.0, 64, 1.0);
        let scaled = yarn_inv_freq(10000.0, 64, &y);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[31] * 40.0 / plain[31] - 1.0).abs() < 1e-6);
        // In between, never faster than the original nor slower than the divided one.
        for (s, p) in scaled.iter().zip(&plain) {
            assert!(*s <= *p && *s >= p / 40.0 * (1.0 - 1e-6));
        }
    }

    #[test]
    fn deepseek_v3_scales_as_published() {
        // DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1: no rotary scaling, and the
        // softmax scale times (0.1 ln 40 + 1)².
        let y = yarn(40.0);
        assert_eq!(y.attention_factor(), 1.0);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((y.softmax_mscale() - m * m).abs() < 1e-12);
        assert_eq!(yarn(1.0).softmax_mscale(), 1.0);
    }
}
