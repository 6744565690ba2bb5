//! Iterative Sensitivity Probing: probe, allocate, re-probe under the new allocation,
//! re-allocate, until the plan stops changing (docs/ARCHITECTURE.md, Allocation).
//!
//! The allocator gives each *unit* a setting: a MoE layer's routed experts a codec and a
//! resident fraction, a tensor group (embeddings, LM head, a layer's attention) a codec.
//! A probe is the calibration loss of the whole model with one unit's setting changed
//! and every other unit left where the current plan put it. Per unit and round: each of
//! its probe codecs (at its current resident fraction) and each of its probe removal
//! levels (at its current codec), plus one baseline. The laws of [`super::law`] fill in
//! every other setting; [`super::lagrange`] spends the budget. Sensitivities measured on
//! the uncompressed model add up only under mild compression, which is why the loop
//! re-probes around the plan it just made.

use rayon::prelude::*;
use serde::Serialize;

use super::lagrange::{allocate, AllocError, Allocation, Choice};
use super::law::{CodecSensitivity, RemovalLaw};

/// One layer's setting: a codec (index into [`Problem::codecs`]) and the fraction of
/// its experts that is not resident.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Setting {
    /// Index of the codec.
    pub codec: usize,
    /// Fraction of the layer's experts removed from the resident set.
    pub removed: f64,
}

/// A codec the allocator may choose.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CodecOption {
    /// Name as plans spell it (`q4`, `vq1.5`, `bf16`).
    pub name: String,
    /// Relative mean squared error of the codec on unit Gaussian data (0 for bf16).
    pub distortion: f64,
}

/// What one unit may be set to and how it is probed.
#[derive(Debug, Clone, PartialEq)]
pub struct Unit {
    /// The settings it may take: for a tensor group, codecs with nothing removed.
    pub settings: Vec<Setting>,
    /// Its probe codecs, coarse to fine (indices into [`Problem::codecs`]).
    pub probe_codecs: Vec<usize>,
    /// Its probe removal fractions (none for a tensor group).
    pub probe_removals: Vec<f64>,
    /// The setting it starts from (the uncompressed model).
    pub start: Setting,
}

/// The allocation problem: what may be chosen and what it costs in bytes.
pub struct Problem<'a> {
    /// The units allocated, in the order settings list them.
    pub units: Vec<Unit>,
    /// Codecs to choose from.
    pub codecs: Vec<CodecOption>,
    /// Resident bytes of a unit at a setting.
    pub bytes: &'a (dyn Fn(usize, Setting) -> u64 + Sync),
    /// Resident bytes outside the allocated units.
    pub fixed_bytes: u64,
}

/// Evaluates the calibration loss of a whole configuration.
pub trait Prober: Sync {
    /// The error a probe may fail with.
    type Error: Send;
    /// Mean negative log-likelihood per token of the model configured by `settings`
    /// (one per unit).
    fn loss(&self, settings: &[Setting]) -> Result<f64, Self::Error>;
}

/// One probe and what it measured.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeResult {
    /// The unit changed.
    pub layer: usize,
    /// Its setting during the probe.
    pub setting: Setting,
    /// Loss minus the round's baseline.
    pub delta: f64,
}

/// What one round saw and decided.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// Budget in bytes this round allocated.
    pub budget: u64,
    /// Loss of the configuration the round started from.
    pub baseline: f64,
    /// Every probe of the round.
    pub probes: Vec<ProbeResult>,
    /// Per unit, the codec curve's points `(distortion, loss change)`.
    pub codec_sensitivity: Vec<Vec<(f64, f64)>>,
    /// The removal law's shared exponent.
    pub removal_exponent: f64,
    /// Its per-layer amplitudes.
    pub removal_amplitudes: Vec<f64>,
    /// The plan the round chose.
    pub plan: Vec<Setting>,
    /// Modelled loss increase of that plan over the baseline.
    pub modelled_cost: f64,
    /// Bytes the plan spends, fixed bytes included.
    pub bytes: u64,
    /// Budget minus bytes.
    pub unspent: u64,
}

/// Why ISP stopped early.
#[derive(Debug, thiserror::Error)]
pub enum IspError<E> {
    /// A probe failed.
    #[error("{0}")]
    Probe(E),
    /// No plan fits.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

/// Runs ISP: one round per budget of `anneal` (each a stepping stone on the way down),
/// then rounds at `budget` until the plan stops changing or `rounds` of them ran.
/// `progress(round, done, total)` is called after every probe.
pub fn isp<P: Prober>(
    problem: &Problem<'_>,
    prober: &P,
    budget: u64,
    anneal: &[u64],
    rounds: usize,
    progress: &(dyn Fn(usize, usize, usize) + Sync),
) -> Result<Vec<Round>, IspError<P::Error>> {
    let mut current: Vec<Setting> = problem.units.iter().map(|u| u.start).collect();
    let mut log: Vec<Round> = Vec::new();
    let schedule: Vec<u64> = anneal
        .iter()
        .copied()
        .chain(std::iter::repeat_n(budget, rounds.max(1)))
        .collect();
    for (r, &b) in schedule.iter().enumerate() {
        let round = one_round(problem, prober, &current, b, &|done, total| {
            progress(r, done, total)
        })?;
        let unchanged = round.plan == current;
        current = round.plan.clone();
        log.push(round);
        if r >= anneal.len() && unchanged {
            break;
        }
    }
    Ok(log)
}

/// The probes of one round around `current`.
fn probe_settings(problem: &Problem<'_>, current: &[Setting]) -> Vec<(usize, Setting)> {
    let mut out = Vec::new();
    for (layer, (&now, unit)) in current.iter().zip(&problem.units).enumerate() {
        for &codec in &unit.probe_codecs {
            if codec != now.codec {
                out.push((layer, Setting { codec, ..now }));
            }
        }
        for &removed in &unit.probe_removals {
            if removed != now.removed {
                out.push((layer, Setting { removed, ..now }));
            }
        }
    }
    out
}

fn one_round<P: Prober>(
    problem: &Problem<'_>,
    prober: &P,
    current: &[Setting],
    budget: u64,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Round, IspError<P::Error>> {
    let baseline = prober.loss(current).map_err(IspError::Probe)?;
    let wanted = probe_settings(problem, current);
    let done = std::sync::atomic::AtomicUsize::new(0);
    let probes: Vec<ProbeResult> = wanted
        .par_iter()
        .map(|&(layer, setting)| {
            let mut config = current.to_vec();
            config[layer] = setting;
            let loss = prober.loss(&config).map_err(IspError::Probe)?;
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(n, wanted.len());
            Ok(ProbeResult {
                layer,
                setting,
                delta: loss - baseline,
            })
        })
        .collect::<Result<_, IspError<P::Error>>>()?;

    let d = |codec: usize| problem.codecs[codec].distortion;
    let units = problem.units.len();
    let codec_lines: Vec<CodecSensitivity> = (0..units)
        .map(|layer| {
            let points: Vec<(f64, f64)> = probes
                .iter()
                .filter(|p| p.layer == layer && p.setting.removed == current[layer].removed)
                .map(|p| (d(p.setting.codec), p.delta))
                .collect();
            CodecSensitivity::fit(d(current[layer].codec), &points)
        })
        .collect();
    let removal_points: Vec<Vec<(f64, f64)>> = (0..units)
        .map(|layer| {
            probes
                .iter()
                .filter(|p| p.layer == layer && p.setting.codec == current[layer].codec)
                .map(|p| (p.setting.removed, p.delta))
                .collect()
        })
        .collect();
    let current_removed: Vec<f64> = current.iter().map(|s| s.removed).collect();
    let removal = RemovalLaw::fit(&current_removed, &removal_points);

    let settings: Vec<&Vec<Setting>> = problem.units.iter().map(|u| &u.settings).collect();
    let choices: Vec<Vec<Choice>> = settings
        .iter()
        .enumerate()
        .map(|(unit, options)| {
            options
                .iter()
                .map(|&s| Choice {
                    cost: codec_lines[unit].at(d(s.codec))
                        + removal.at(unit, s.removed, current[unit].removed),
                    bytes: (problem.bytes)(unit, s),
                })
                .collect()
        })
        .collect();
    let Allocation {
        picks,
        bytes,
        cost,
        unspent,
        ..
    } = allocate(&choices, problem.fixed_bytes, budget)?;
    Ok(Round {
        budget,
        baseline,
        probes,
        codec_sensitivity: codec_lines.iter().map(|c| c.points.clone()).collect(),
        removal_exponent: removal.p,
        removal_amplitudes: removal.amplitudes,
        plan: picks
            .iter()
            .zip(&settings)
            .map(|(&i, options)| options[i])
            .collect(),
        modelled_cost: cost,
        bytes,
        unspent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic model: per-layer loss κ_i·D + a_i·f^2, plus an interaction that
    /// makes neighbouring coarse layers cost more together than apart.
    struct Synthetic {
        codecs: Vec<CodecOption>,
        kappa: Vec<f64>,
        amp: Vec<f64>,
        interaction: f64,
    }

    impl Prober for Synthetic {
        type Error = ();
        fn loss(&self, s: &[Setting]) -> Result<f64, ()> {
            let d: Vec<f64> = s.iter().map(|x| self.codecs[x.codec].distortion).collect();
            let mut l: f64 = (0..s.len())
                .map(|i| self.kappa[i] * d[i] + self.amp[i] * s[i].removed.powi(2))
                .sum();
            l += self.interaction * d.windows(2).map(|w| w[0] * w[1]).sum::<f64>();
            Ok(l)
        }
    }

    fn codecs() -> Vec<CodecOption> {
        [("c1", 0.33), ("c2", 0.09), ("c3", 0.025), ("c4", 0.007)]
            .iter()
            .map(|&(n, d)| CodecOption {
                name: n.into(),
                distortion: d,
            })
            .collect()
    }

    fn bits(codec: usize) -> u64 {
        codec as u64 + 1
    }

    /// Every codec at each of `removals`.
    fn grid(codecs: &[usize], removals: &[f64]) -> Vec<Setting> {
        codecs
            .iter()
            .flat_map(|&codec| {
                removals
                    .iter()
                    .map(move |&removed| Setting { codec, removed })
            })
            .collect()
    }

    /// `n` units of the same choices, starting at `start`.
    fn units(n: usize, removals: &[f64], probe_removals: &[f64], start: Setting) -> Vec<Unit> {
        let all: Vec<usize> = (0..codecs().len()).collect();
        vec![
            Unit {
                settings: grid(&all, removals),
                probe_codecs: vec![0, 3],
                probe_removals: probe_removals.to_vec(),
                start,
            };
            n
        ]
    }

    #[test]
    fn plans_fit_the_budget_and_stop_when_unchanged() {
        let layers = 6;
        let prober = Synthetic {
            codecs: codecs(),
            kappa: vec![1.0, 5.0, 0.5, 2.0, 8.0, 0.2],
            amp: vec![0.1, 2.0, 0.05, 0.3, 4.0, 0.02],
            interaction: 0.0,
        };
        // Irregular prices, so no two settings tie.
        let price = |l: usize, s: Setting| {
            (1000 + 37 * l as u64 + 13 * s.codec as u64)
                * bits(s.codec)
                * ((1.0 - s.removed) * 8.0) as u64
        };
        let start = Setting {
            codec: 3,
            removed: 0.0,
        };
        let problem = Problem {
            units: units(layers, &[0.0, 0.25, 0.5, 0.75], &[0.25, 0.95], start),
            codecs: codecs(),
            bytes: &price,
            fixed_bytes: 500,
        };
        let budget = 500 + 6 * 8 * 2000;
        let log = isp(&problem, &prober, budget, &[], 4, &|_, _, _| {}).unwrap();
        for r in &log {
            assert!(r.bytes <= budget && r.budget == budget);
        }
        // The loss is additive in layers, so the second round finds nothing to change.
        assert_eq!(
            log.len(),
            2,
            "{:?}",
            log.iter().map(|r| &r.plan).collect::<Vec<_>>()
        );
        let plan = &log[1].plan;
        // Sensitive layers keep more bits than insensitive ones.
        assert!(
            plan[4].codec >= plan[5].codec && plan[1].codec >= plan[2].codec,
            "{plan:?}"
        );
        // The fitted removal law recovers the exponent 2 from two probes per layer.
        assert!(
            (log[0].removal_exponent - 2.0).abs() < 1e-2,
            "{}",
            log[0].removal_exponent
        );
        // Modelled and probed costs agree for an additive loss.
        let real = prober.loss(plan).unwrap() - log[0].baseline;
        assert!(
            (real - log[0].modelled_cost).abs() < 1e-6 + 1e-6 * real.abs(),
            "{real}"
        );
    }

    #[test]
    fn tensor_groups_take_codecs_only() {
        // Two expert layers and one group that may take only codecs 1 to 3 and never
        // loses experts; the group is the most sensitive, so it keeps its best codec.
        let prober = Synthetic {
            codecs: codecs(),
            kappa: vec![1.0, 1.0, 20.0],
            amp: vec![0.2, 0.2, 50.0],
            interaction: 0.0,
        };
        let price = |_l: usize, s: Setting| 100 * bits(s.codec) * ((1.0 - s.removed) * 4.0) as u64;
        let start = Setting {
            codec: 3,
            removed: 0.0,
        };
        let mut units = units(2, &[0.0, 0.5], &[0.5], start);
        units.push(Unit {
            settings: grid(&[1, 2, 3], &[0.0]),
            probe_codecs: vec![1, 3],
            probe_removals: Vec::new(),
            start,
        });
        let problem = Problem {
            units,
            codecs: codecs(),
            bytes: &price,
            fixed_bytes: 0,
        };
        let log = isp(&problem, &prober, 2800, &[], 2, &|_, _, _| {}).unwrap();
        let plan = &log.last().unwrap().plan;
        assert_eq!(plan[2], start, "{plan:?}");
        assert!(
            plan[..2].iter().any(|s| s.codec < 3 || s.removed > 0.0),
            "{plan:?}"
        );
        // The group was never probed at a removal.
        assert!(log
            .iter()
            .flat_map(|r| &r.probes)
            .all(|p| p.layer != 2 || p.setting.removed == 0.0));
    }

    #[test]
    fn annealing_runs_one_round_per_stepping_stone() {
        let prober = Synthetic {
            codecs: codecs(),
            kappa: vec![1.0, 3.0, 0.5],
            amp: vec![0.5, 0.5, 0.5],
            interaction: 4.0,
        };
        let price = |_l: usize, s: Setting| 100 * bits(s.codec) * ((1.0 - s.removed) * 4.0) as u64;
        let start = Setting {
            codec: 3,
            removed: 0.0,
        };
        let problem = Problem {
            units: units(3, &[0.0, 0.5], &[0.5], start),
            codecs: codecs(),
            bytes: &price,
            fixed_bytes: 0,
        };
        let log = isp(&problem, &prober, 2400, &[3600, 3000], 1, &|_, _, _| {}).unwrap();
        let budgets: Vec<u64> = log.iter().map(|r| r.budget).collect();
        assert_eq!(budgets, vec![3600, 3000, 2400]);
        assert!(log.iter().all(|r| r.bytes <= r.budget));
    }
}
