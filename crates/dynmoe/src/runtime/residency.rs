//! Resident sets as a user asks for them: a share or count of each layer's experts,
//! static or following the text, seeded by a calibration text, or a compressed model's
//! plan. `run`, `chat`, `serve` and `eval` set residency up through this one place.

use std::collections::BTreeMap;

use crate::backend::Backend;
use crate::calib::reap_saliency;
use crate::model::LoadedModel;
use crate::residency::{self, Mode, ResidencyConfig, ResidentCount};
use crate::store::compressed;
use crate::store::plan::Plan;

/// Why resident sets could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A static set asked for with no calibration text to choose its experts.
    #[error("a static resident set needs a calibration text to choose its experts")]
    StaticWithoutCalibration,
    /// A resident share, count or calibration text asked of a plan, which sets each
    /// layer's resident experts itself.
    #[error("a plan sets each layer's resident experts; drop the resident share or count and the calibration text")]
    PlanSetsResidency,
    /// A swap margin that is negative or not a number.
    #[error("the swap margin must be >= 0, got {0}")]
    SwapMargin(f32),
    /// The sets or their reservoir could not be made.
    #[error(transparent)]
    Residency(#[from] residency::Error),
    /// The model could not be read or run (calibration, the plan of a compressed
    /// directory).
    #[error(transparent)]
    Model(#[from] crate::model::Error),
    /// A compressed directory's plan could not be read.
    #[error(transparent)]
    Store(#[from] crate::store::Error),
}

/// What a user asks of resident sets.
#[derive(Debug, Clone)]
pub struct ResidencyRequest {
    /// Resident experts per layer; `None` when not asked: every expert, or a compressed
    /// model's plan.
    pub resident: Option<ResidentCount>,
    /// Everything else about the sets (`resident` is taken from the field above).
    pub config: ResidencyConfig,
    /// Calibration text for REAP saliency, and the 512-token chunks of it to read: the
    /// static set, and where a dynamic set starts (without it, from the lowest ids).
    pub calib: Option<(String, usize)>,
}

impl ResidencyRequest {
    /// The configuration, or `None` when every expert stays resident.
    pub fn config(&self) -> Result<Option<ResidencyConfig>, SetupError> {
        let resident = match self.resident {
            None => return Ok(None),
            Some(ResidentCount::Fraction(f)) if f >= 1.0 => return Ok(None),
            Some(r) => r,
        };
        self.config_with(resident).map(Some)
    }

    fn config_with(&self, resident: ResidentCount) -> Result<ResidencyConfig, SetupError> {
        let margin = self.config.policy.margin;
        if margin.is_nan() || margin < 0.0 {
            return Err(SetupError::SwapMargin(margin));
        }
        Ok(ResidencyConfig {
            resident,
            ..self.config
        })
    }

    /// Installs the resident sets of `plan` on `m` (loaded from the plan's checkpoint):
    /// each layer starts from the experts the plan keeps, with as many slots, and follows
    /// the text unless the mode is static. Returns the configuration.
    pub fn install_plan<B: Backend>(
        &self,
        m: &mut LoadedModel<B>,
        plan: &Plan,
    ) -> Result<ResidencyConfig, SetupError> {
        if self.resident.is_some() || self.calib.is_some() {
            return Err(SetupError::PlanSetsResidency);
        }
        let config = self.config_with(ResidentCount::Initial)?;
        follow_plan(m, plan, config)?;
        Ok(config)
    }

    /// Installs the resident sets asked for on `m`; returns their configuration, `None`
    /// when every expert stays resident. A compressed model runs its plan's sets unless a
    /// share or count says otherwise (1.0: every expert). `progress(done, total)` follows
    /// the calibration.
    pub fn install<B: Backend>(
        &self,
        m: &mut LoadedModel<B>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Option<ResidencyConfig>, SetupError> {
        if self.resident.is_none() && compressed::is_compressed(&m.dir) {
            let (_, plan) = compressed::open(&m.dir)?;
            if plan.layers.iter().all(|l| l.resident >= l.experts) {
                return Ok(None);
            }
            return self.install_plan(m, &plan).map(Some);
        }
        let Some(config) = self.config()? else {
            return Ok(None);
        };
        if config.is_full(m.model.config.moe.num_experts) {
            return Ok(None);
        }
        let initial = match &self.calib {
            Some((text, chunks)) => reap_saliency(m, text, 512, Some(*chunks), progress)?.ranking(),
            None if config.mode == Mode::Static => {
                return Err(SetupError::StaticWithoutCalibration)
            }
            None => BTreeMap::new(),
        };
        let reservoir = m.model.reservoir(config.reservoir)?;
        let sets = m.model.new_residency(reservoir, config, &initial)?;
        m.model.set_residency(Some(sets));
        Ok(Some(config))
    }
}

/// Turns the static masks a plan's model starts with (`alloc::probe::load_plan`) into
/// resident sets holding the same experts, each layer with as many slots as the plan
/// keeps resident: under [`Mode::Dynamic`] they then follow the text, the rest streamed
/// from `config.reservoir`. `config.resident` is replaced by the plan's counts.
pub fn follow_plan<B: Backend>(
    m: &mut LoadedModel<B>,
    plan: &Plan,
    config: ResidencyConfig,
) -> Result<(), SetupError> {
    // No more swaps in flight than the plan priced slots for: each layer holds
    // `spare_slots(experts, resident, max_swaps)`, which the plan's own count bounds once
    // max_swaps does not exceed the largest of them.
    let priced = plan
        .layers
        .iter()
        .filter(|l| l.resident < l.experts)
        .filter_map(|l| l.spare_slots)
        .max();
    let mut config = ResidencyConfig {
        resident: ResidentCount::Initial,
        ..config
    };
    if let Some(spare) = priced {
        config.policy.max_swaps = config.policy.max_swaps.min(spare);
    }
    // The plan's shadows, which it priced.
    if plan.shadow.is_some() {
        config.shadow = plan.shadow_rung();
    }
    for l in &plan.layers {
        m.model.set_expert_mask(l.layer, None)?;
    }
    let reservoir = m.model.reservoir(config.reservoir)?;
    let sets = m
        .model
        .new_residency(reservoir, config, &plan.resident_sets())?;
    m.model.set_residency(Some(sets));
    Ok(())
}
