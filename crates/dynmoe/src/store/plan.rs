//! `plan.json`: what the allocator decided for each layer and why, the file a
//! compressed model directory is run by.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::arch::CodedGroup;
use crate::codec::vq::Rung;
use crate::codec::Codec;
use crate::store::dense_vq::GroupCodecs;

/// The plan file's name inside a compressed model directory.
pub const PLAN_FILE: &str = "plan.json";

/// Value of [`Plan::format`].
pub const FORMAT: &str = "dynmoe-plan";

/// Version this build writes. It reads version 1 too, whose plans code no tensor group
/// but the dense layers (no `groups`).
pub const VERSION: u32 = 2;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// One MoE layer's setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerPlan {
    /// Decoder layer index.
    pub layer: usize,
    /// Codec of its routed experts.
    pub codec: Codec,
    /// Routed experts in the layer.
    pub experts: usize,
    /// Experts resident at any time.
    pub resident: usize,
    /// Slots beside the resident ones for swaps in flight, held by a layer that keeps
    /// only some of its experts (0 when it keeps them all). Version 1 plans have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare_slots: Option<usize>,
    /// Bytes of the layer's shadows (every expert at the plan's shadow rung), held when
    /// it keeps only some experts; part of `resident_bytes`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shadow_bytes: u64,
    /// Bytes resident: the resident experts and the spare slots at the layer's codec,
    /// and its shadows.
    pub resident_bytes: u64,
    /// Bytes of its other experts, kept in the reservoir (RAM or disk).
    pub reservoir_bytes: u64,
    /// The resident experts (by REAP saliency when the plan removes some), `resident`
    /// of them.
    #[serde(default)]
    pub keep: Vec<u32>,
}

/// A whole model's plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// `model_type` of the source checkpoint.
    pub model_type: String,
    /// The checkpoint directory the plan applies to.
    pub source: String,
    /// Target resident bits per weight.
    pub budget_bits: f64,
    /// Target resident bytes.
    pub budget_bytes: u64,
    /// The denominator of bits per weight: every parameter of the model (or only the
    /// routed experts', for a budget scoped to the experts; see `rounds.scope`).
    pub params_total: u64,
    /// Codec of the dense linear layers (attention, shared experts, dense MLPs) that
    /// `groups` does not list.
    pub dense_codec: Codec,
    /// Tensor groups outside the routed experts at a codec of their own: the token
    /// embeddings, the LM head, a layer's dense linear weights. The embeddings and the
    /// head stay bf16 unless listed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub groups: BTreeMap<CodedGroup, Codec>,
    /// The VQ rung of the shadows every layer that keeps only some experts holds: a token
    /// routed outside its set runs the expert's shadow. `None`: routing is confined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<Codec>,
    /// Resident bytes outside the routed experts: embeddings, LM head, attention,
    /// norms, routers, shared experts.
    pub dense_bytes: u64,
    /// Σ resident bytes, dense included.
    pub resident_bytes: u64,
    /// Σ reservoir bytes.
    pub reservoir_bytes: u64,
    /// Budget minus resident bytes.
    pub unspent_bytes: u64,
    /// Per MoE layer, in layer order.
    pub layers: Vec<LayerPlan>,
    /// How the plan was reached: the allocator's rounds, sensitivities and probes.
    #[serde(default)]
    pub rounds: serde_json::Value,
}

/// A plan file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Reading or writing failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Not JSON of the plan's shape.
    #[error("{path}: not a plan: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde said (line, column, field).
        source: serde_json::Error,
    },
    /// A field holds a value no plan can hold.
    #[error("{path}: field `{field}`: {why}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field, e.g. `layers[3].resident`.
        field: String,
        /// What is wrong.
        why: String,
    },
    /// Writing the file failed.
    #[error(transparent)]
    Store(#[from] crate::store::Error),
}

impl Plan {
    /// The rung of each MoE layer the plan puts at a VQ rung (bf16 layers are left out),
    /// or why a layer's codec cannot be run from a plan (plans run bf16 and VQ rungs).
    pub fn vq_rungs(&self) -> Result<BTreeMap<usize, Rung>, String> {
        let mut rungs = BTreeMap::new();
        for l in &self.layers {
            match l.codec {
                Codec::Bf16 => {}
                c @ Codec::Vq { .. } => {
                    let rung = c
                        .rung()
                        .ok()
                        .flatten()
                        .ok_or_else(|| format!("layer {}: codec {c} has no rung", l.layer))?;
                    rungs.insert(l.layer, rung);
                }
                c => {
                    return Err(format!(
                        "layer {}: plans run bf16 and VQ rungs, not {c}",
                        l.layer
                    ))
                }
            }
        }
        Ok(rungs)
    }

    /// Each MoE layer's resident experts, best first: the experts a layer keeps, or all
    /// of them where it keeps every one. The starting sets of residency with
    /// [`ResidentCount::Initial`](crate::residency::ResidentCount::Initial).
    pub fn resident_sets(&self) -> BTreeMap<usize, Vec<u32>> {
        self.layers
            .iter()
            .map(|l| {
                let set = if l.resident < l.experts {
                    l.keep.clone()
                } else {
                    (0..l.experts as u32).collect()
                };
                (l.layer, set)
            })
            .collect()
    }

    /// The codec of every coded tensor group outside the routed experts.
    pub fn group_codecs(&self) -> GroupCodecs {
        GroupCodecs {
            groups: self.groups.clone(),
            ..GroupCodecs::uniform(self.dense_codec, Codec::Bf16, Codec::Bf16)
        }
    }

    /// The rung of the plan's shadows, if it has them (`validate` refuses anything but a
    /// rung).
    pub fn shadow_rung(&self) -> Option<Rung> {
        self.shadow.and_then(|c| c.rung().ok().flatten())
    }

    /// Bits per weight of what stays resident.
    pub fn resident_bits(&self) -> f64 {
        self.resident_bytes as f64 * 8.0 / self.params_total.max(1) as f64
    }

    /// Checks the plan's internal consistency; `path` only names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<(), PlanError> {
        let field = |field: String, why: String| PlanError::Field {
            path: path.to_path_buf(),
            field,
            why,
        };
        if self.format != FORMAT {
            return Err(field(
                "format".into(),
                format!("{:?} is not {FORMAT:?}", self.format),
            ));
        }
        if !(1..=VERSION).contains(&self.version) {
            return Err(field(
                "version".into(),
                format!(
                    "{} is not supported (this build reads 1 to {VERSION})",
                    self.version
                ),
            ));
        }
        let takes = crate::store::dense_vq::rung_of;
        if let Err(why) = takes(self.dense_codec) {
            return Err(field("dense_codec".into(), why));
        }
        if let Some(c) = self.shadow {
            if !matches!(c.rung(), Ok(Some(_))) {
                return Err(field(
                    "shadow".into(),
                    format!("{c} is not a rung of the VQ ladder"),
                ));
            }
        }
        for (group, &codec) in &self.groups {
            if let Err(why) = takes(codec) {
                return Err(field(format!("groups.{group}"), why));
            }
        }
        let mut previous = None;
        let (mut resident, mut reservoir) = (self.dense_bytes, 0u64);
        for (i, l) in self.layers.iter().enumerate() {
            if previous.is_some_and(|p| l.layer <= p) {
                return Err(field(
                    format!("layers[{i}].layer"),
                    "layers out of order".into(),
                ));
            }
            previous = Some(l.layer);
            if l.resident == 0 || l.resident > l.experts {
                return Err(field(
                    format!("layers[{i}].resident"),
                    format!("{} resident of {} experts", l.resident, l.experts),
                ));
            }
            if l.resident < l.experts
                && (l.keep.len() != l.resident || l.keep.iter().any(|&x| x as usize >= l.experts))
            {
                return Err(field(
                    format!("layers[{i}].keep"),
                    format!(
                        "{:?} is not {} experts below {}",
                        l.keep, l.resident, l.experts
                    ),
                ));
            }
            resident += l.resident_bytes;
            reservoir += l.reservoir_bytes;
        }
        if resident != self.resident_bytes {
            return Err(field(
                "resident_bytes".into(),
                format!(
                    "{} but the layers and dense tensors add up to {resident}",
                    self.resident_bytes
                ),
            ));
        }
        if reservoir != self.reservoir_bytes {
            return Err(field(
                "reservoir_bytes".into(),
                format!(
                    "{} but the layers add up to {reservoir}",
                    self.reservoir_bytes
                ),
            ));
        }
        if self.resident_bytes + self.unspent_bytes != self.budget_bytes
            && self.resident_bytes <= self.budget_bytes
        {
            return Err(field(
                "unspent_bytes".into(),
                format!(
                    "{} but the budget {} minus resident {} is {}",
                    self.unspent_bytes,
                    self.budget_bytes,
                    self.resident_bytes,
                    self.budget_bytes - self.resident_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Writes the plan atomically.
    pub fn save(&self, path: &Path) -> Result<(), PlanError> {
        let json = serde_json::to_vec_pretty(self).expect("a plan serialises");
        crate::store::atomic::write_file(path, &json)?;
        Ok(())
    }

    /// Reads and validates a plan.
    pub fn load(path: &Path) -> Result<Plan, PlanError> {
        let bytes = std::fs::read(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let plan: Plan = serde_json::from_slice(&bytes).map_err(|source| PlanError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        plan.validate(path)?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TempDir;

    fn sample() -> Plan {
        let layers: Vec<LayerPlan> = (0..3)
            .map(|i| LayerPlan {
                layer: i,
                codec: ["vq1.5", "q2", "vq2.25"][i].parse().unwrap(),
                experts: 32,
                resident: 16 + i,
                spare_slots: Some(4),
                shadow_bytes: 0,
                resident_bytes: 1000 + i as u64,
                reservoir_bytes: 900,
                keep: (0..16 + i as u32).collect(),
            })
            .collect();
        let resident = 500 + layers.iter().map(|l| l.resident_bytes).sum::<u64>();
        Plan {
            format: FORMAT.into(),
            version: VERSION,
            model_type: "qwen3_moe".into(),
            source: "fixtures/models/small-moe".into(),
            budget_bits: 2.0,
            budget_bytes: resident + 7,
            params_total: 20_000,
            dense_codec: Codec::Bf16,
            groups: [
                (CodedGroup::Embedding, "q3".parse().unwrap()),
                (CodedGroup::Dense(1), "vq2".parse().unwrap()),
            ]
            .into(),
            shadow: None,
            dense_bytes: 500,
            resident_bytes: resident,
            reservoir_bytes: 2700,
            unspent_bytes: 7,
            layers,
            rounds: serde_json::json!([{"budget": 1}]),
        }
    }

    #[test]
    fn round_trips_through_its_file() {
        let dir = TempDir::new("plan");
        let p = sample();
        p.save(&dir.path(PLAN_FILE)).unwrap();
        assert_eq!(Plan::load(&dir.path(PLAN_FILE)).unwrap(), p);
        assert!((p.resident_bits() - p.resident_bytes as f64 * 8.0 / 20_000.0).abs() < 1e-12);
    }

    #[test]
    fn corrupt_plans_name_the_field() {
        let dir = TempDir::new("plan-bad");
        let path = dir.path(PLAN_FILE);
        type Corrupt = Box<dyn Fn(&mut serde_json::Value)>;
        let cases: Vec<(&str, Corrupt)> = vec![
            ("format", Box::new(|v| v["format"] = "other".into())),
            ("version", Box::new(|v| v["version"] = 9.into())),
            (
                "layers[1].resident",
                Box::new(|v| v["layers"][1]["resident"] = 0.into()),
            ),
            (
                "layers[2].resident",
                Box::new(|v| v["layers"][2]["resident"] = 33.into()),
            ),
            (
                "layers[1].layer",
                Box::new(|v| v["layers"][1]["layer"] = 0.into()),
            ),
            (
                "resident_bytes",
                Box::new(|v| v["resident_bytes"] = 1.into()),
            ),
            (
                "reservoir_bytes",
                Box::new(|v| v["reservoir_bytes"] = 1.into()),
            ),
            ("unspent_bytes", Box::new(|v| v["unspent_bytes"] = 8.into())),
            ("codec", Box::new(|v| v["layers"][0]["codec"] = "q9".into())),
            (
                "groups.embedding",
                Box::new(|v| v["groups"]["embedding"] = "vq0.1".into()),
            ),
            ("shadow", Box::new(|v| v["shadow"] = "q4".into())),
            (
                "tensor group",
                Box::new(|v| v["groups"]["layers.x.dense"] = "q4".into()),
            ),
            (
                "missing field",
                Box::new(|v| {
                    v.as_object_mut().unwrap().remove("layers");
                }),
            ),
        ];
        for (want, corrupt) in cases {
            let mut v = serde_json::to_value(sample()).unwrap();
            corrupt(&mut v);
            std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
            let e = Plan::load(&path).expect_err(want).to_string();
            assert!(e.contains(want) && e.contains(PLAN_FILE), "{want}: {e}");
        }
        std::fs::write(&path, b"{\"format\": \"dynmoe-plan\", ").unwrap();
        assert!(matches!(Plan::load(&path), Err(PlanError::Parse { .. })));
        assert!(matches!(
            Plan::load(&dir.path("absent.json")),
            Err(PlanError::Io { .. })
        ));
    }
}
