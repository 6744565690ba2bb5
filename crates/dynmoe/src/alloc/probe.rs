//! The allocator's probes on a real model: the calibration loss of a checkpoint with
//! each MoE layer's routed experts at a chosen codec and a chosen share of them removed,
//! and each tensor group (embeddings, LM head, a layer's dense linear weights) at a
//! chosen codec (docs/ARCHITECTURE.md, Allocation).
//!
//! Removal follows REAP: a layer keeps its most salient experts (saliency measured once,
//! on the uncompressed model and the calibration text) and its routing is confined to
//! them. VQ encodings are made once per layer and rung and shared by every probe that
//! uses them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::alloc::isp::{Prober, Setting};
use crate::backend::Cpu;
use crate::calib::reap::{reap_saliency, Saliency};
use crate::checkpoint::arch::CodedGroup;
use crate::checkpoint::{Checkpoint, Config, Tokenizer};
use crate::codec::Codec;
use crate::eval::ppl::{perplexity_tokens, PplError, PplOptions};
use crate::model::{Error, LoadedModel, Model};
use crate::store::dense_vq::{self, CodedLayers, GroupCodecs, WeightShapes};
use crate::store::{vq_encode::encode_experts, vq_encode::VqExperts};

/// What one entry of a settings vector sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeUnit {
    /// The routed experts of a MoE layer: codec and removal.
    Experts(usize),
    /// A tensor group: codec only.
    Group(CodedGroup),
}

impl std::fmt::Display for ProbeUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeUnit::Experts(l) => write!(f, "layers.{l}.experts"),
            ProbeUnit::Group(g) => write!(f, "{g}"),
        }
    }
}

/// Probes one Hugging Face checkpoint.
pub struct ModelProber {
    dir: PathBuf,
    config: Config,
    ckpt: Checkpoint,
    /// The codecs a [`Setting`] indexes.
    codecs: Vec<Codec>,
    /// What a settings vector lists, in order: every MoE layer, then the tensor groups
    /// allocated (if any).
    units: Vec<ProbeUnit>,
    /// The weights of each allocated tensor group, with their shapes.
    group_weights: BTreeMap<CodedGroup, WeightShapes>,
    /// Tensor groups coded at a codec, made once and shared by every probe.
    coded_groups: Mutex<HashMap<(CodedGroup, Codec), CodedLayers>>,
    /// Per MoE layer, experts by descending REAP saliency.
    ranking: BTreeMap<usize, Vec<u32>>,
    /// Calibration texts, tokenised.
    calib: Vec<Vec<u32>>,
    opts: PplOptions,
    encoded: Mutex<HashMap<(usize, Codec), VqExperts>>,
    /// The dense linear layers every probed model runs coded (none: bf16).
    dense: CodedLayers,
    /// The rung of the shadows a layer with experts removed holds, if any.
    shadow: Option<crate::codec::vq::Rung>,
    /// Each MoE layer's shadows, encoded once.
    shadows: Mutex<HashMap<usize, VqExperts>>,
}

/// Saliency over several texts: per expert, the token-weighted mean of each text's.
pub fn merge_saliency(parts: &[Saliency]) -> Saliency {
    let mut out = Saliency::default();
    for p in parts {
        out.tokens += p.tokens;
        for (&l, s) in &p.layers {
            let n = &p.routed[&l];
            let sums = out.layers.entry(l).or_insert_with(|| vec![0.0; s.len()]);
            let counts = out.routed.entry(l).or_insert_with(|| vec![0; s.len()]);
            for e in 0..s.len() {
                sums[e] += s[e] * n[e] as f64;
                counts[e] += n[e];
            }
        }
    }
    for (l, sums) in out.layers.iter_mut() {
        for (v, &n) in sums.iter_mut().zip(&out.routed[l]) {
            *v = if n > 0 { *v / n as f64 } else { 0.0 };
        }
    }
    out
}

impl ModelProber {
    /// Opens the checkpoint at `dir`, tokenises the calibration texts and measures REAP
    /// saliency on them. Each probe scores `opts.max_chunks` chunks of every text.
    pub fn new(
        dir: &Path,
        codecs: Vec<Codec>,
        calib: &[String],
        opts: PplOptions,
    ) -> Result<ModelProber, Error> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let full = crate::model::load(dir, Cpu::fast())?;
        let parts = calib
            .iter()
            .map(|t| reap_saliency(&full, t, opts.ctx, opts.max_chunks, &mut |_, _| {}))
            .collect::<Result<Vec<_>, _>>()?;
        let ranking = merge_saliency(&parts).ranking();
        let calib = calib
            .iter()
            .map(|t| full.tokenizer.encode(t))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ModelProber {
            dir: dir.to_path_buf(),
            units: config.moe_layers().map(ProbeUnit::Experts).collect(),
            group_weights: BTreeMap::new(),
            coded_groups: Mutex::new(HashMap::new()),
            config,
            ckpt,
            codecs,
            ranking,
            calib,
            opts,
            encoded: Mutex::new(HashMap::new()),
            dense: CodedLayers::new(),
            shadow: None,
            shadows: Mutex::new(HashMap::new()),
        })
    }

    /// Probes with the dense linear layers at `codec` (coded once: a VQ rung beside the
    /// checkpoint, an affine width in memory), as the compressed model will run them.
    pub fn with_dense_codec(
        mut self,
        codec: Codec,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<ModelProber, Error> {
        self.dense = crate::model::coded_layers(
            &self.dir,
            &self.ckpt,
            &self.config,
            &GroupCodecs::uniform(codec, Codec::Bf16, Codec::Bf16),
            false,
            progress,
        )?;
        Ok(self)
    }

    /// Allocates `groups` too: each becomes a unit of the settings vector, after the MoE
    /// layers, in the order given. A group the checkpoint has no tensor of is refused.
    pub fn with_groups(mut self, groups: &[CodedGroup]) -> Result<ModelProber, Error> {
        let mut all = dense_vq::group_weights(&self.ckpt, &self.config)?;
        for &group in groups {
            let weights = all.remove(&group).ok_or_else(|| {
                Error::Config(format!(
                    "{}: no tensor of group {group}",
                    self.dir.display()
                ))
            })?;
            self.group_weights.insert(group, weights);
            self.units.push(ProbeUnit::Group(group));
        }
        Ok(self)
    }

    /// Probes a layer with experts removed as it runs with shadows: every expert also held
    /// at `rung`, and a token routed outside the kept experts running its shadow.
    pub fn with_shadow(mut self, rung: crate::codec::vq::Rung) -> ModelProber {
        self.shadow = Some(rung);
        self
    }

    /// The shadows of `layer` at the prober's shadow rung (encoded once).
    fn shadows_of(&self, layer: usize, rung: crate::codec::vq::Rung) -> Result<VqExperts, Error> {
        let cache = || self.shadows.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = cache().get(&layer) {
            return Ok(s.clone());
        }
        let s = encode_experts(&self.config, &self.ckpt, layer, rung)?;
        cache().insert(layer, s.clone());
        Ok(s)
    }

    /// What each entry of a settings vector sets.
    pub fn units(&self) -> &[ProbeUnit] {
        &self.units
    }

    /// The weights of an allocated tensor group with their shapes (empty for others).
    pub fn group_weights(&self, group: CodedGroup) -> &[(String, [usize; 2])] {
        self.group_weights.get(&group).map_or(&[], |w| w)
    }

    /// The codecs settings index.
    pub fn codecs(&self) -> &[Codec] {
        &self.codecs
    }

    /// The experts a layer keeps when `removed` of them go: its most salient, at least
    /// top-k.
    pub fn kept(&self, layer: usize, removed: f64) -> Vec<u32> {
        let e = self.config.moe.num_experts;
        let k = resident_count(e, self.config.moe.top_k, removed);
        self.ranking[&layer][..k].to_vec()
    }

    fn experts_at(&self, layer: usize, codec: Codec) -> Result<Option<VqExperts>, Error> {
        let Some(rung) = codec.rung().map_err(|source| Error::Encode {
            tensor: format!("layer {layer}"),
            source,
        })?
        else {
            return Ok(None);
        };
        if let Some(e) = self
            .encoded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(layer, codec))
        {
            return Ok(Some(e.clone()));
        }
        // Encoding outside the lock lets other probes proceed; a race encodes twice.
        let e = encode_experts(&self.config, &self.ckpt, layer, rung)?;
        self.encoded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((layer, codec), e.clone());
        Ok(Some(e))
    }

    /// Tensor group `group` coded at `codec`, in memory (made once).
    fn group_at(&self, group: CodedGroup, codec: Codec) -> Result<CodedLayers, Error> {
        let cache = || self.coded_groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache().get(&(group, codec)) {
            return Ok(c.clone());
        }
        let weights = self.group_weights(group);
        let quiet = &mut |_, _| {};
        // Coding outside the lock lets other probes proceed; a race codes twice.
        let coded = match (codec, dense_vq::rung_of(codec).map_err(Error::Config)?) {
            (Codec::Affine { bits }, _) => {
                dense_vq::quantize_affine(&self.ckpt, bits, weights, quiet)?
            }
            (_, Some(rung)) => {
                dense_vq::vq_layers(dense_vq::encode(&self.ckpt, rung, weights, quiet)?)
            }
            (_, None) => CodedLayers::new(),
        };
        cache().insert((group, codec), coded.clone());
        Ok(coded)
    }

    /// The model configured by `settings` (one per unit, in [`units`] order).
    ///
    /// [`units`]: Self::units
    pub fn model(&self, settings: &[Setting]) -> Result<LoadedModel<Cpu>, Error> {
        if settings.len() != self.units.len() {
            return Err(Error::Config(format!(
                "{} settings for {} units",
                settings.len(),
                self.units.len()
            )));
        }
        let mut vq = BTreeMap::new();
        let mut dense = self.dense.clone();
        let mut keep: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for (&unit, s) in self.units.iter().zip(settings) {
            let layer = match unit {
                ProbeUnit::Experts(layer) => layer,
                ProbeUnit::Group(group) => {
                    let codec = self.codecs.get(s.codec).copied().ok_or_else(|| {
                        Error::Config(format!(
                            "{group}: codec {} of {}",
                            s.codec,
                            self.codecs.len()
                        ))
                    })?;
                    for (name, _) in self.group_weights(group) {
                        dense.remove(name);
                    }
                    dense.extend(self.group_at(group, codec)?);
                    continue;
                }
            };
            if s.removed > 0.0 {
                keep.insert(layer, self.kept(layer, s.removed));
            }
            match self.codecs.get(s.codec) {
                Some(Codec::Bf16) => {}
                Some(&c @ Codec::Vq { .. }) => {
                    vq.insert(layer, self.experts_at(layer, c)?.expect("a VQ codec"));
                }
                other => {
                    return Err(Error::Config(format!(
                        "layer {layer}: probes run bf16 and VQ rungs, not {other:?}"
                    )))
                }
            }
        }
        let mut m = assemble(
            &self.dir,
            self.config.clone(),
            &self.ckpt,
            &vq,
            &dense,
            &keep,
        )?;
        if let Some(rung) = self.shadow {
            for &layer in keep.keys() {
                let s = self.shadows_of(layer, rung)?;
                m.model.set_expert_shadows(layer, Some(s))?;
            }
        }
        Ok(m)
    }
}

/// A model of `ckpt` whose MoE layers in `vq` run those encodings, whose dense layers in
/// `dense` run coded, and whose layers in `keep` route only to those experts.
pub fn assemble(
    dir: &Path,
    config: Config,
    ckpt: &Checkpoint,
    vq: &BTreeMap<usize, VqExperts>,
    dense: &CodedLayers,
    keep: &BTreeMap<usize, Vec<u32>>,
) -> Result<LoadedModel<Cpu>, Error> {
    let e = config.moe.num_experts;
    let mut model = Model::load(config, ckpt, None, vq, dense, Cpu::fast())?;
    for (&layer, experts) in keep {
        let mut mask = vec![false; e];
        for &x in experts {
            let slot = mask
                .get_mut(x as usize)
                .ok_or_else(|| Error::Config(format!("layer {layer}: expert {x} of {e} kept")))?;
            *slot = true;
        }
        model.set_expert_mask(layer, Some(mask))?;
    }
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        model,
        tokenizer: Tokenizer::from_dir(dir)?,
    })
}

/// Loads the model a plan describes from its checkpoint at `dir` (normally
/// `plan.source`): each MoE layer's experts at the plan's codec (VQ rungs from the VQ
/// expert stores beside the checkpoint, encoded on first use), routing confined to the
/// experts it keeps. `progress(done, total)` counts the records written while a VQ
/// store is built.
pub fn load_plan(
    dir: &Path,
    plan: &crate::store::plan::Plan,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedModel<Cpu>, Error> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let ckpt = Checkpoint::open(dir)?;
    let rungs = plan.vq_rungs().map_err(Error::Config)?;
    let keep: BTreeMap<usize, Vec<u32>> = plan
        .layers
        .iter()
        .filter(|l| l.resident < l.experts)
        .map(|l| (l.layer, l.keep.clone()))
        .collect();
    let vq = crate::model::stored_vq_experts(dir, &config, &ckpt, &rungs, progress)?;
    let dense =
        crate::model::coded_layers(dir, &ckpt, &config, &plan.group_codecs(), false, progress)?;
    let mut m = assemble(dir, config, &ckpt, &vq, &dense, &keep)?;
    if let Some(rung) = plan.shadow_rung() {
        for &layer in keep.keys() {
            let s = encode_experts(&m.model.config, &ckpt, layer, rung)?;
            m.model.set_expert_shadows(layer, Some(s))?;
        }
    }
    Ok(m)
}

/// Resident experts of a layer of `experts` when a share `removed` goes: rounded to the
/// nearest count, never fewer than `top_k`.
pub fn resident_count(experts: usize, top_k: usize, removed: f64) -> usize {
    let k = ((1.0 - removed) * experts as f64).round() as usize;
    k.clamp(top_k.min(experts), experts)
}

impl Prober for ModelProber {
    type Error = PplError;

    fn loss(&self, settings: &[Setting]) -> Result<f64, PplError> {
        let m = self.model(settings)?;
        let mut sum = 0.0;
        for tokens in &self.calib {
            sum += perplexity_tokens(&m, tokens, self.opts, &mut |_, _| {})?.nll_mean;
        }
        Ok(sum / self.calib.len() as f64)
    }
}
