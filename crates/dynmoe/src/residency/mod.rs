//! Resident expert sets and dynamic REAP (docs/ARCHITECTURE.md, Residency).
//!
//! Per MoE layer a fixed number K of slots holds the resident experts at the layer's
//! codec, and routing is confined to them ([`set`]). Every token's unmasked routing
//! probabilities feed two exponential averages per expert ([`policy`]); every
//! `interval` routed tokens the policy picks up to `max_swaps` exchanges, the loader
//! threads read the incoming experts from the [`reservoir`] (RAM, or the files they
//! already live in) into spare slot buffers, and each exchange commits at the first
//! token boundary after its data has arrived. A token never waits for a load: until
//! the commit the outgoing expert keeps serving.
//!
//! On a backend that keeps slots in its own memory ([`Backend::new_slots`], the GPU), a
//! layer's slots live there and routing runs there: a load that has arrived is copied
//! into a free device slot beside the running tokens and commits at the first boundary
//! after the copy has landed.
//!
//! One [`Residency`] belongs to a model and is shared by every sequence running on it:
//! its state sits behind a mutex that a forward call holds from start to end, so
//! commits happen only between forward calls.

pub mod policy;
pub mod reservoir;
pub mod set;
mod shadow;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;

pub use policy::{plan_swaps, Evidence, PolicyParams};
pub use reservoir::{Loaded, Loader, Reservoir, ReservoirKind};
pub use set::LayerSet;

use crate::backend::Backend;

/// What can go wrong setting up residency.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option or a combination of them that cannot work.
    #[error("residency: {0}")]
    Config(String),
    /// A reservoir file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A record read from a store does not match the checksum its manifest gives it:
    /// the file was damaged or replaced in place while in use.
    #[error("{path}: the record of layer {layer} expert {expert} at byte {offset} is damaged or was replaced: checksum {found}, the manifest says {expected}")]
    Damaged {
        /// The data file.
        path: PathBuf,
        /// Decoder layer.
        layer: usize,
        /// Expert.
        expert: usize,
        /// Where the record starts in the file.
        offset: u64,
        /// The checksum of the bytes read.
        found: String,
        /// The manifest's.
        expected: String,
    },
}

/// Whether the resident set follows the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Dynamic REAP: swaps at checkpoints.
    Dynamic,
    /// A fixed set (static REAP when it comes from a calibration).
    Static,
}

/// How many experts per layer are resident.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResidentCount {
    /// A share of each layer's experts, rounded to the nearest count.
    Fraction(f32),
    /// A count per layer.
    Count(usize),
    /// As many as each layer's initial set names: a plan gives every layer its own
    /// count (`dynmoe compress`).
    Initial,
}

/// Everything a resident set is run with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResidencyConfig {
    /// Resident experts per layer.
    pub resident: ResidentCount,
    /// Dynamic or static.
    pub mode: Mode,
    /// Where non-resident experts live.
    pub reservoir: ReservoirKind,
    /// The swap policy.
    pub policy: PolicyParams,
    /// Loader threads.
    pub loader_threads: usize,
    /// A rung of the VQ ladder at which a layer that keeps only some experts also holds
    /// every expert, always: a token routed outside the set runs the expert's shadow
    /// instead of being confined to the residents. `None`: confined (the paper's
    /// policy).
    pub shadow: Option<crate::codec::vq::Rung>,
}

impl Default for ResidencyConfig {
    fn default() -> Self {
        ResidencyConfig {
            resident: ResidentCount::Fraction(1.0),
            mode: Mode::Dynamic,
            reservoir: ReservoirKind::Ram,
            policy: PolicyParams::default(),
            loader_threads: 2,
            shadow: None,
        }
    }
}

impl ResidencyConfig {
    /// Resident experts of a layer of `experts`, at least `top_k`; `initial` is the
    /// length of the layer's initial set, if it has one.
    pub fn count(
        &self,
        experts: usize,
        top_k: usize,
        initial: Option<usize>,
    ) -> Result<usize, Error> {
        let k = match self.resident {
            ResidentCount::Fraction(f) => {
                if f.is_nan() || f <= 0.0 || f > 1.0 {
                    return Err(Error::Config(format!(
                        "resident fraction {f} is not in (0, 1]"
                    )));
                }
                (f as f64 * experts as f64).round() as usize
            }
            ResidentCount::Count(k) => k,
            ResidentCount::Initial => initial.ok_or_else(|| {
                Error::Config("resident counts come from initial sets, and one is missing".into())
            })?,
        };
        if k < top_k || k > experts {
            return Err(Error::Config(format!(
                "{k} resident experts per layer: routing picks {top_k} of {experts}, so between {top_k} and {experts} must be resident"
            )));
        }
        if self.mode == Mode::Dynamic && self.policy.interval == 0 {
            return Err(Error::Config("swap interval 0".into()));
        }
        if self
            .policy
            .half_lives
            .iter()
            .any(|h| !h.is_finite() || *h <= 0.0)
        {
            return Err(Error::Config("half-lives must be positive".into()));
        }
        Ok(k)
    }

    /// Whether every expert would be resident (nothing to do).
    pub fn is_full(&self, experts: usize) -> bool {
        match self.resident {
            ResidentCount::Fraction(f) => f >= 1.0,
            ResidentCount::Count(k) => k >= experts,
            ResidentCount::Initial => false,
        }
    }
}

/// Counters of a residency run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    /// Tokens routed (per layer, so one per token).
    pub tokens: u64,
    /// Checkpoints reached.
    pub checkpoints: u64,
    /// Loads issued to the loader.
    pub loads_issued: u64,
    /// Exchanges committed.
    pub swaps: u64,
    /// Loads that failed (the outgoing expert stayed).
    pub loads_failed: u64,
    /// Bytes read out of the reservoir by committed loads.
    pub bytes_moved: u64,
    /// Seconds the loader threads spent reading them.
    pub read_seconds: f64,
    /// Bytes read to fill the slots at the start (not swaps).
    pub initial_fill_bytes: u64,
    /// Loads still in flight when the next checkpoint came: keeping the schedule would
    /// have made a token wait.
    pub stalls: u64,
    /// Token boundaries at which a load was still in flight, so the outgoing expert
    /// served one more token (no token waited).
    pub late_boundaries: u64,
}

impl Counters {
    /// Counts a committed exchange whose load read `bytes` in `seconds`.
    fn swapped(&mut self, bytes: usize, seconds: f64) {
        self.swaps += 1;
        self.bytes_moved += bytes as u64;
        self.read_seconds += seconds;
    }
}

/// What a residency run measured.
#[derive(Debug, Clone, Serialize)]
pub struct ResidencyReport {
    /// Dynamic or static.
    pub mode: Mode,
    /// Where non-resident experts live.
    pub reservoir: ReservoirKind,
    /// Experts per MoE layer.
    pub experts_per_layer: usize,
    /// Resident slots per MoE layer (the largest, when layers differ).
    pub resident_per_layer: usize,
    /// Resident slots of each MoE layer that holds a set (a layer keeping every expert
    /// holds none: it runs the model's own weights, and counts as all hits).
    pub resident_by_layer: BTreeMap<usize, usize>,
    /// Spare slots per MoE layer that holds a set, for loads in flight (at most; see
    /// [`spare_slots`]).
    pub spare_slots_per_layer: usize,
    /// Bytes of host memory in slot buffers over all layers: resident and spare, or only
    /// the spares (the staging of loads) where a set lives in the backend's memory.
    pub slot_bytes: usize,
    /// Bytes of the shadows held beside the sets (0 without shadows).
    pub shadow_bytes: usize,
    /// Bytes the reservoir holds in RAM (0 on disk).
    pub reservoir_ram_bytes: usize,
    /// Bytes of the backend's memory the sets live in (0 where they live on the host).
    pub device_bytes: usize,
    /// MoE layers whose set lives in the backend's memory, routed there.
    pub layers_on_device: usize,
    /// Unmasked routing probability on resident experts over all of it, in the layers
    /// that hold a set (1 when none does).
    pub hit_rate: f64,
    /// The same per MoE layer.
    pub hit_rate_per_layer: BTreeMap<usize, f64>,
    /// The ceiling of any set of K: probability on each token's own K most probable
    /// experts, over all of it.
    pub oracle_hit_rate: f64,
    /// Counters.
    #[serde(flatten)]
    pub counters: Counters,
    /// Bytes moved per 1000 routed tokens.
    pub bytes_moved_per_1000_tokens: f64,
    /// Bytes moved per second of reading, MB/s.
    pub read_bandwidth_mb_s: f64,
    /// The policy.
    pub policy: PolicyParams,
    /// The first failed load's error, if any.
    pub first_load_error: Option<String>,
}

struct Inner<B: Backend> {
    layers: BTreeMap<usize, LayerSet<B>>,
    loader: Option<Loader>,
    /// Loads that arrived while waiting for them outside a forward call.
    arrived: Vec<Loaded>,
    since_checkpoint: usize,
    counters: Counters,
    first_error: Option<String>,
}

/// Spare slots a layer of `experts` keeping `resident` holds for swaps in flight: one per
/// swap a checkpoint may start, but no more than there are residents to swap out or
/// experts outside to swap in (none when every expert is resident).
pub fn spare_slots(experts: usize, resident: usize, max_swaps: usize) -> usize {
    max_swaps
        .min(resident)
        .min(experts.saturating_sub(resident))
}

/// The resident sets of a model's MoE layers, and everything that changes them.
pub struct Residency<B: Backend> {
    config: ResidencyConfig,
    spare: usize,
    experts: usize,
    reservoir: Arc<Reservoir>,
    inner: Mutex<Inner<B>>,
}

/// A forward call's hold on the resident sets (see [`Residency::begin`]).
pub struct Step<'a, B: Backend> {
    residency: &'a Residency<B>,
    inner: MutexGuard<'a, Inner<B>>,
}

impl<B: Backend> Residency<B> {
    /// Resident sets over `reservoir` for MoE layers of `experts` experts routing
    /// `top_k`: the first K of `initial[layer]` (a ranking, best first; experts
    /// `0..K` where absent), read into the slots here. K is the config's count, or with
    /// [`ResidentCount::Initial`] the length of each layer's initial set. The sets of
    /// the layers in `on_device` (blocks the backend can route) live in the backend's
    /// own memory where it keeps slots for their format ([`Backend::new_slots`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: &B,
        reservoir: Arc<Reservoir>,
        layers: &[usize],
        experts: usize,
        top_k: usize,
        config: ResidencyConfig,
        initial: &BTreeMap<usize, Vec<u32>>,
        on_device: &BTreeSet<usize>,
    ) -> Result<Residency<B>, Error> {
        let spare = match config.mode {
            Mode::Dynamic => config.policy.max_swaps,
            Mode::Static => 0,
        };
        let mut counters = Counters::default();
        let mut sets = BTreeMap::new();
        let mut scratch = Vec::new();
        for &layer in layers {
            let k = config
                .count(experts, top_k, initial.get(&layer).map(Vec::len))
                .map_err(|e| match e {
                    Error::Config(m) => Error::Config(format!("layer {layer}: {m}")),
                    e => e,
                })?;
            if k >= experts {
                // Every expert resident: nothing to swap, and slots would copy the
                // model's own weights. The layer runs them as it does with no sets.
                continue;
            }
            let format = reservoir.format(layer);
            let mut chosen: Vec<u32> = Vec::with_capacity(k);
            for &e in initial.get(&layer).into_iter().flatten() {
                if (e as usize) >= experts {
                    return Err(Error::Config(format!(
                        "layer {layer}: initial expert {e} of {experts}"
                    )));
                }
                if chosen.len() < k && !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            for e in 0..experts as u32 {
                if chosen.len() < k && !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            let mut buffers = Vec::with_capacity(k);
            for &e in &chosen {
                let mut buf = format.buffer();
                counters.initial_fill_bytes +=
                    reservoir.read(layer, e as usize, &mut buf, &mut scratch)? as u64;
                buffers.push(buf);
            }
            let spares = (0..spare_slots(experts, k, spare))
                .map(|_| format.buffer())
                .collect();
            let evidence = Evidence::new(experts, config.policy.half_lives);
            let shadows = config
                .shadow
                .map(|rung| shadow::shadows(&reservoir, layer, experts, rung))
                .transpose()?;
            // The backend's routing confines to the residents: a layer with shadows
            // routes on the host.
            let on_device = (on_device.contains(&layer) && shadows.is_none()).then_some(top_k);
            let mut set = LayerSet::new(
                b, format, experts, &chosen, buffers, spares, evidence, on_device,
            );
            set.shadows = shadows;
            sets.insert(layer, set);
        }
        let loader = (config.mode == Mode::Dynamic)
            .then(|| Loader::new(reservoir.clone(), config.loader_threads));
        Ok(Residency {
            config,
            spare,
            experts,
            reservoir,
            inner: Mutex::new(Inner {
                layers: sets,
                loader,
                arrived: Vec::new(),
                since_checkpoint: 0,
                counters,
                first_error: None,
            }),
        })
    }

    /// Whether every layer's set lives in the backend's memory (so a decode step needs
    /// no host routing).
    pub fn all_on_device(&self) -> bool {
        self.lock()
            .layers
            .values()
            .all(|s| s.device_slots().is_some())
    }

    /// The configuration.
    pub fn config(&self) -> &ResidencyConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        // A panic mid-forward leaves consistent sets (commits are whole), so a
        // poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the sets for one forward call: a token boundary, so every load that has
    /// arrived is committed first.
    pub fn begin(&self, b: &B) -> Step<'_, B> {
        let mut inner = self.lock();
        let inner_ref = &mut *inner;
        let mut arrived = std::mem::take(&mut inner_ref.arrived);
        if let Some(loader) = &inner_ref.loader {
            arrived.extend(loader.ready());
        }
        for loaded in arrived {
            let Some(loaded) = stage_on_device(&mut inner_ref.layers, loaded) else {
                continue;
            };
            let set = inner_ref
                .layers
                .get_mut(&loaded.layer)
                .expect("a resident layer");
            let i = set
                .in_flight
                .iter()
                .position(|&(_, inc)| inc == loaded.expert)
                .expect("a load that was issued");
            let (out, inc) = set.in_flight.swap_remove(i);
            match loaded.result {
                Ok(bytes) => {
                    let freed = set.commit(b, out, inc, loaded.buffer);
                    set.spares.push(freed);
                    inner_ref.counters.swapped(bytes, loaded.seconds);
                }
                Err(e) => {
                    set.spares.push(loaded.buffer);
                    inner_ref.counters.loads_failed += 1;
                    inner_ref.first_error.get_or_insert(e);
                }
            }
        }
        for set in inner_ref.layers.values_mut() {
            for (bytes, seconds) in set.commit_landed() {
                inner_ref.counters.swapped(bytes, seconds);
            }
        }
        let waiting: usize = inner_ref.layers.values().map(|s| s.in_flight.len()).sum();
        if waiting > 0 {
            inner_ref.counters.late_boundaries += 1;
        }
        Step {
            residency: self,
            inner,
        }
    }

    /// Blocks until every load in flight has arrived. They still commit only at the
    /// next token boundary ([`begin`](Self::begin)).
    pub fn wait_loads(&self) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let waiting: usize = inner.layers.values().map(|s| s.in_flight.len()).sum();
        let Some(loader) = &inner.loader else { return };
        let staged: usize = inner.layers.values().map(|s| s.staged.len()).sum();
        let pending = waiting - inner.arrived.len() - staged;
        for _ in 0..pending {
            inner.arrived.push(loader.wait());
        }
        // Loads bound for the device start their copies now, and land before returning.
        let arrived = std::mem::take(&mut inner.arrived);
        for loaded in arrived {
            if let Some(loaded) = stage_on_device(&mut inner.layers, loaded) {
                inner.arrived.push(loaded);
            }
        }
        for set in inner.layers.values() {
            set.wait_staged();
        }
    }

    /// The resident experts of every MoE layer, ascending.
    pub fn resident_sets(&self) -> BTreeMap<usize, Vec<u32>> {
        self.lock()
            .layers
            .iter()
            .map(|(&l, s)| (l, s.residents()))
            .collect()
    }

    /// Loads issued and not committed, per layer, `(outgoing, incoming)`.
    pub fn in_flight(&self) -> BTreeMap<usize, Vec<(u32, u32)>> {
        self.lock()
            .layers
            .iter()
            .map(|(&l, s)| (l, s.in_flight.clone()))
            .collect()
    }

    /// Zeroes the counters and hit rates (the sets and the evidence stay).
    pub fn reset_counters(&self) {
        let mut inner = self.lock();
        inner.counters = Counters::default();
        for s in inner.layers.values_mut() {
            s.hit = 0.0;
            s.mass = 0.0;
            s.oracle = 0.0;
        }
    }

    /// What the run so far measured.
    pub fn report(&self) -> ResidencyReport {
        let inner = self.lock();
        let (hit, mass, oracle) = inner.layers.values().fold((0.0, 0.0, 0.0), |(h, m, o), s| {
            (h + s.hit, m + s.mass, o + s.oracle)
        });
        let c = inner.counters.clone();
        let resident_by_layer: BTreeMap<usize, usize> = inner
            .layers
            .iter()
            .map(|(&l, s)| (l, s.resident.iter().filter(|&&r| r).count()))
            .collect();
        ResidencyReport {
            mode: self.config.mode,
            reservoir: self.reservoir.kind(),
            experts_per_layer: self.experts,
            resident_per_layer: resident_by_layer.values().copied().max().unwrap_or(0),
            resident_by_layer,
            spare_slots_per_layer: self.spare,
            slot_bytes: inner.layers.values().map(|s| s.slot_bytes()).sum(),
            shadow_bytes: inner
                .layers
                .values()
                .filter_map(|s| s.shadows.as_ref())
                .map(shadow::shadow_bytes)
                .sum(),
            reservoir_ram_bytes: self.reservoir.ram_bytes(),
            device_bytes: inner.layers.values().map(|s| s.device_bytes()).sum(),
            layers_on_device: inner
                .layers
                .values()
                .filter(|s| s.device_slots().is_some())
                .count(),
            // Layers without a set miss nothing; with no set at all, nothing is missed.
            hit_rate: if mass > 0.0 { hit / mass } else { 1.0 },
            oracle_hit_rate: if mass > 0.0 { oracle / mass } else { 1.0 },
            hit_rate_per_layer: inner
                .layers
                .iter()
                .map(|(&l, s)| (l, s.hit / s.mass.max(f64::MIN_POSITIVE)))
                .collect(),
            bytes_moved_per_1000_tokens: c.bytes_moved as f64 * 1000.0 / (c.tokens.max(1)) as f64,
            read_bandwidth_mb_s: c.bytes_moved as f64 / 1e6 / c.read_seconds.max(1e-12),
            counters: c,
            policy: self.config.policy,
            first_load_error: inner.first_error.clone(),
        }
    }
}

/// Starts the device copy of a load bound for a set in the backend's memory (it commits
/// once landed); hands back any other load (a host set's, or a failed one) to commit.
fn stage_on_device<B: Backend>(
    layers: &mut BTreeMap<usize, LayerSet<B>>,
    loaded: Loaded,
) -> Option<Loaded> {
    let set = layers.get_mut(&loaded.layer).expect("a resident layer");
    match (&loaded.result, set.device_slots().is_some()) {
        (Ok(bytes), true) => {
            let bytes = *bytes;
            set.stage(loaded.expert, loaded.buffer, bytes, loaded.seconds);
            None
        }
        _ => Some(loaded),
    }
}

impl<B: Backend> Step<'_, B> {
    /// The set of decoder layer `layer`, if it is a MoE layer.
    pub fn layer(&mut self, layer: usize) -> Option<&mut LayerSet<B>> {
        self.inner.layers.get_mut(&layer)
    }

    /// Whether any layer's set lives in the backend's memory.
    pub fn any_on_device(&self) -> bool {
        self.inner
            .layers
            .values()
            .any(|s| s.device_slots().is_some())
    }

    /// Whether routing feeds the evidence.
    pub fn tracks(&self) -> bool {
        self.residency.config.mode == Mode::Dynamic
    }

    /// Ends the forward call after `tokens` routed tokens: at a checkpoint, plans the
    /// exchanges of every layer and hands their loads to the loader threads. The count
    /// runs across calls, and a call that passes several checkpoints (a long prompt)
    /// counts each and keeps the tokens past the last toward the next; it plans once, as
    /// the loads of one plan must land before the next can.
    pub fn finish(mut self, tokens: usize) {
        let inner = &mut *self.inner;
        inner.counters.tokens += tokens as u64;
        let Some(loader) = &inner.loader else { return };
        let p = self.residency.config.policy;
        inner.since_checkpoint += tokens;
        if inner.since_checkpoint < p.interval {
            return;
        }
        inner.counters.checkpoints += (inner.since_checkpoint / p.interval) as u64;
        inner.since_checkpoint %= p.interval;
        for (&layer, set) in inner.layers.iter_mut() {
            if !set.in_flight.is_empty() {
                // The last checkpoint's loads have not all arrived: this layer plans
                // nothing new, and the schedule has slipped.
                inner.counters.stalls += set.in_flight.len() as u64;
                continue;
            }
            let plan = plan_swaps(&set.evidence.ranks(), &set.resident, &set.frozen, &p);
            set.frozen.iter_mut().for_each(|f| *f = false);
            for (out, inc) in plan {
                let Some(buffer) = set.spares.pop() else {
                    break;
                };
                set.frozen[out as usize] = true;
                set.frozen[inc as usize] = true;
                set.in_flight.push((out, inc));
                inner.counters.loads_issued += 1;
                loader.submit(reservoir::Job {
                    layer,
                    expert: inc,
                    buffer,
                });
            }
        }
    }
}
