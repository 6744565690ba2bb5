//! The two laws that turn a handful of probes into a sensitivity for every setting.
//!
//! **Distortion.** After the rotation every codec's relative mean squared error is a
//! constant of the codec, and across the VQ ladder those constants follow
//! φ(b) = 2^(a − c·b). A layer's loss increase grows with its weights' distortion, a
//! little faster than linearly at the low-bit end, so a few codec probes (coarse,
//! middle, fine) plus the current setting give a piecewise-linear curve `s(D)` from
//! which every other codec's cost is read.
//!
//! **Removal.** Masking the least salient fraction `f` of a layer's experts costs
//! about `a_i · f^p`: one exponent for the whole network, one amplitude per layer,
//! fitted by least squares on the removal probes.

/// `φ(b) = 2^(a − c·b)`: relative distortion of a codec at `b` bits per weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistortionLaw {
    /// Offset `a` (log2 units).
    pub a: f64,
    /// Slope `c` per bit.
    pub c: f64,
}

impl DistortionLaw {
    /// The constants the paper fits to its codecs.
    pub const PAPER: DistortionLaw = DistortionLaw { a: 1.710, c: 2.264 };

    /// φ at `bits`.
    pub fn at(&self, bits: f64) -> f64 {
        (self.a - self.c * bits).exp2()
    }

    /// Least-squares fit of `log2 D = a − c·b` to `(bits, distortion)` points. `None`
    /// with fewer than two distinct rates or a non-positive distortion.
    pub fn fit(points: &[(f64, f64)]) -> Option<DistortionLaw> {
        let distinct = points.iter().any(|p| p.0 != points[0].0);
        if !distinct || points.iter().any(|&(_, d)| d <= 0.0 || !d.is_finite()) {
            return None;
        }
        // One fit for the ladder's report and the allocator.
        let f = crate::codec::vq::report::fit(points);
        Some(DistortionLaw { a: f.a, c: f.c })
    }
}

/// Slope and intercept of the least-squares line through `points`; `None` when every
/// `x` is the same.
pub fn least_squares_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= f64::EPSILON * n * (1.0 + mx * mx) {
        return None;
    }
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// A layer's loss increase as a function of its codec's distortion: piecewise linear
/// through the probes and the current setting (zero change), extended past the ends
/// along the outermost segments. With two probes and the current setting this is close
/// to a line; a middle probe lets it bend, as the loss does (it grows faster than the
/// distortion at the low-bit end).
#[derive(Debug, Clone, PartialEq)]
pub struct CodecSensitivity {
    /// `(distortion, loss change)` by ascending distortion, one point per distortion.
    pub points: Vec<(f64, f64)>,
}

impl CodecSensitivity {
    /// Fits to probes `(distortion, loss change)` measured around a setting of
    /// distortion `current`; probes at the same distortion are averaged.
    pub fn fit(current: f64, probes: &[(f64, f64)]) -> CodecSensitivity {
        let mut all = vec![(current, 0.0)];
        all.extend(
            probes
                .iter()
                .copied()
                .filter(|p| p.0.is_finite() && p.1.is_finite()),
        );
        all.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut points: Vec<(f64, f64)> = Vec::new();
        let mut i = 0;
        while i < all.len() {
            let j = (i..all.len()).take_while(|&j| all[j].0 == all[i].0).count() + i;
            let mean = all[i..j].iter().map(|p| p.1).sum::<f64>() / (j - i) as f64;
            points.push((all[i].0, mean));
            i = j;
        }
        CodecSensitivity { points }
    }

    /// The modelled loss change at distortion `d`.
    pub fn at(&self, d: f64) -> f64 {
        let p = &self.points;
        if p.len() == 1 {
            return p[0].1;
        }
        // The segment holding d, or the outermost one on its side.
        let k = p
            .iter()
            .position(|q| q.0 >= d)
            .unwrap_or(p.len())
            .clamp(1, p.len() - 1);
        let ((x0, y0), (x1, y1)) = (p[k - 1], p[k]);
        y0 + (y1 - y0) * (d - x0) / (x1 - x0)
    }
}

/// `d_i(f) = a_i · f^p`, with `p` shared by all layers.
#[derive(Debug, Clone, PartialEq)]
pub struct RemovalLaw {
    /// The shared exponent.
    pub p: f64,
    /// Per layer amplitude.
    pub amplitudes: Vec<f64>,
}

impl RemovalLaw {
    /// Exponents searched: removal costs are convex in the removed fraction (the least
    /// salient experts go first), and beyond 8 the curve is a step at f = 1.
    const P_RANGE: (f64, f64) = (0.25, 8.0);

    /// The modelled cost of removing fraction `f` of layer `layer`'s experts, relative
    /// to removing `current`.
    pub fn at(&self, layer: usize, f: f64, current: f64) -> f64 {
        self.amplitudes[layer] * (f.powf(self.p) - current.powf(self.p))
    }

    /// Least-squares fit to per-layer probes `(fraction removed, loss change)` measured
    /// relative to each layer's current fraction `current[i]`.
    pub fn fit(current: &[f64], probes: &[Vec<(f64, f64)>]) -> RemovalLaw {
        let amplitudes_for = |p: f64| -> (Vec<f64>, f64) {
            let mut residual = 0.0;
            let amps = probes
                .iter()
                .zip(current)
                .map(|(layer, &c)| {
                    let basis = |f: f64| f.powf(p) - c.powf(p);
                    let num: f64 = layer.iter().map(|&(f, s)| basis(f) * s).sum();
                    let den: f64 = layer.iter().map(|&(f, _)| basis(f).powi(2)).sum();
                    let a = if den > 0.0 { num / den } else { 0.0 };
                    residual += layer
                        .iter()
                        .map(|&(f, s)| (a * basis(f) - s).powi(2))
                        .sum::<f64>();
                    a
                })
                .collect();
            (amps, residual)
        };
        // The residual is smooth in p but not always convex: scan, then refine by
        // golden-section search around the best grid point.
        let (lo, hi) = Self::P_RANGE;
        let grid: Vec<f64> = (0..=64)
            .map(|i| lo * (hi / lo).powf(i as f64 / 64.0))
            .collect();
        let best = grid
            .iter()
            .enumerate()
            .min_by(|a, b| amplitudes_for(*a.1).1.total_cmp(&amplitudes_for(*b.1).1))
            .map(|(i, _)| i)
            .unwrap_or(0);
        let (mut a, mut b) = (grid[best.saturating_sub(1)], grid[(best + 1).min(64)]);
        let g = (5f64.sqrt() - 1.0) / 2.0;
        for _ in 0..40 {
            let x1 = b - g * (b - a);
            let x2 = a + g * (b - a);
            if amplitudes_for(x1).1 <= amplitudes_for(x2).1 {
                b = x2;
            } else {
                a = x1;
            }
        }
        let p = (a + b) / 2.0;
        RemovalLaw {
            p,
            amplitudes: amplitudes_for(p).0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distortion_law_recovers_its_constants() {
        let law = DistortionLaw { a: 1.2, c: 2.1 };
        let points: Vec<(f64, f64)> = [0.7, 1.0, 1.5, 2.0, 3.0, 4.0]
            .iter()
            .map(|&b| (b, law.at(b)))
            .collect();
        let fit = DistortionLaw::fit(&points).unwrap();
        assert!(
            (fit.a - 1.2).abs() < 1e-9 && (fit.c - 2.1).abs() < 1e-9,
            "{fit:?}"
        );
        assert!(DistortionLaw::fit(&[(1.0, 0.3)]).is_none());
        assert!(DistortionLaw::fit(&[(1.0, 0.3), (2.0, 0.0)]).is_none());
    }

    #[test]
    fn codec_curve_passes_through_current_and_probes() {
        // An exact line s = 0.5 · (D − 0.01) is reproduced everywhere, ends included.
        let s = CodecSensitivity::fit(0.01, &[(0.4, 0.5 * 0.39), (0.007, 0.5 * -0.003)]);
        for d in [0.0, 0.007, 0.01, 0.2, 0.4, 0.6] {
            assert!((s.at(d) - 0.5 * (d - 0.01)).abs() < 1e-12, "{d}: {s:?}");
        }
        // A convex curve bends through a middle probe.
        let c = CodecSensitivity::fit(0.0, &[(0.1, 0.1), (0.4, 1.0)]);
        assert!((c.at(0.05) - 0.05).abs() < 1e-12 && (c.at(0.25) - 0.55).abs() < 1e-12);
        // Repeated distortions are averaged; a single point is flat.
        let r = CodecSensitivity::fit(0.0, &[(0.2, 1.0), (0.2, 3.0)]);
        assert!((r.at(0.2) - 2.0).abs() < 1e-12);
        assert_eq!(CodecSensitivity::fit(0.1, &[]).at(0.5), 0.0);
    }

    #[test]
    fn removal_law_recovers_shared_exponent_and_amplitudes() {
        let (p, amps) = (2.5, [0.1, 0.7, 0.02]);
        let current = [0.0, 0.25, 0.0];
        let probes: Vec<Vec<(f64, f64)>> = amps
            .iter()
            .zip(current)
            .map(|(a, c)| {
                [0.25, 0.5, 0.95]
                    .iter()
                    .map(|&f: &f64| (f, a * (f.powf(p) - f64::powf(c, p))))
                    .collect()
            })
            .collect();
        let law = RemovalLaw::fit(&current, &probes);
        assert!((law.p - p).abs() < 1e-3, "p = {}", law.p);
        for (fit, want) in law.amplitudes.iter().zip(amps) {
            assert!((fit - want).abs() < 1e-3 * want, "{fit} vs {want}");
        }
        assert!((law.at(1, 0.25, 0.25)).abs() < 1e-12);
    }
}
