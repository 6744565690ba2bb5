//! Bits accounting: the bytes of every tensor at the codec it is given, split into what
//! stays resident and what waits in the reservoir, and bits per weight = resident
//! bytes × 8 / all parameters (docs/ARCHITECTURE.md, Allocation). Attention, routers, norms, embeddings
//! and the LM head are priced too, not only the experts.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::checkpoint::arch::{classify, layer_of, TensorKind};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::{Codec, CodecError};
use crate::model::Error;
use crate::store::dense_vq::GroupCodecs;

/// What each part of the model is stored as.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// Codecs of the tensor groups outside the routed experts: embeddings, LM head, each
    /// layer's dense linear weights. Norms and routers stay bf16.
    pub tensors: GroupCodecs,
    /// Per MoE layer: the routed experts' codec and how many of them are resident.
    /// Layers not listed keep every expert resident at `default_experts`.
    pub layers: BTreeMap<usize, (Codec, usize)>,
    /// Codec of MoE layers the map does not list.
    pub default_experts: Codec,
}

impl Assignment {
    /// Everything at the checkpoint's precision, every expert resident.
    pub fn uncompressed() -> Assignment {
        Assignment {
            tensors: GroupCodecs::default(),
            layers: BTreeMap::new(),
            default_experts: Codec::Bf16,
        }
    }
}

/// One MoE layer's bytes.
#[derive(Debug, Clone, Serialize)]
pub struct LayerBits {
    /// Decoder layer.
    pub layer: usize,
    /// Codec of its routed experts.
    pub codec: Codec,
    /// Routed experts.
    pub experts: usize,
    /// Of which resident.
    pub resident: usize,
    /// Slots for swaps in flight beside them, held when some experts are not resident
    /// (the default policy's swaps at a checkpoint).
    pub spare_slots: usize,
    /// Bytes of one expert at the codec.
    pub expert_bytes: u64,
    /// Resident expert bytes: the resident experts and the spare slots.
    pub resident_bytes: u64,
    /// Reservoir expert bytes.
    pub reservoir_bytes: u64,
    /// Everything else of the layer (attention, norms, router, shared expert).
    pub dense_bytes: u64,
}

/// A model's bytes under an assignment.
#[derive(Debug, Clone, Serialize)]
pub struct BitsReport {
    /// Every parameter, routed experts included.
    pub params_total: u64,
    /// Resident bytes by kind of tensor (routed experts: resident ones only).
    pub resident_by_kind: BTreeMap<TensorKind, u64>,
    /// Codebooks of the VQ rungs in use: constants of the program (compiled in, as
    /// llama.cpp's IQ grids are), resident once each, reported on their own and counted
    /// in no model's bytes or bits.
    pub codebook_bytes: u64,
    /// Σ resident bytes of the model's tensors (codebooks aside).
    pub resident_bytes: u64,
    /// Σ reservoir bytes.
    pub reservoir_bytes: u64,
    /// Resident bytes × 8 / parameters.
    pub resident_bits_per_weight: f64,
    /// (Resident + reservoir) × 8 / parameters.
    pub stored_bits_per_weight: f64,
    /// Per MoE layer.
    pub layers: Vec<LayerBits>,
    /// Bytes of the KV cache at the context asked for (f32, as the CPU backend keeps it).
    pub kv_cache_bytes: Option<u64>,
}

/// Bytes one routed expert of `hidden × intermediate` takes at `codec`, resident or in
/// the reservoir: at a VQ rung its record in the VQ store, whole pages
/// ([`crate::store::vq::VqLayout`]), which is what a resident slot or a mapped store
/// holds; otherwise its three matrices at the codec.
pub fn expert_bytes(codec: Codec, hidden: usize, intermediate: usize) -> Result<u64, CodecError> {
    match codec.rung()? {
        // The layout refuses only a zero dimension.
        Some(rung) => crate::store::vq::VqLayout::new(rung, hidden, intermediate)
            .map(|l| l.record_size as u64)
            .map_err(|_| CodecError::NoColumns { rows: intermediate }),
        None => Ok(2 * codec.matrix_bytes(intermediate, hidden)?
            + codec.matrix_bytes(hidden, intermediate)?),
    }
}

/// Prices a model under `assignment`. `kv_context`, if given, adds the KV cache of one
/// sequence of that many tokens.
pub fn account(
    config: &Config,
    ckpt: &Checkpoint,
    assignment: &Assignment,
    kv_context: Option<usize>,
) -> Result<BitsReport, Error> {
    let codec_err = |name: &str, source: CodecError| Error::Encode {
        tensor: name.to_string(),
        source,
    };
    let mut resident_by_kind: BTreeMap<TensorKind, u64> = BTreeMap::new();
    let mut params_total = 0u64;
    let mut layer_dense: BTreeMap<usize, u64> = BTreeMap::new();
    let mut rungs = BTreeSet::new();
    for name in ckpt.names() {
        let kind = classify(name);
        if kind == TensorKind::RoutedExperts {
            continue; // priced from the config below, converted or not
        }
        let shape = ckpt.info(name)?.shape.clone();
        let params: u64 = shape.iter().map(|&d| d as u64).product();
        params_total += params;
        let coded = assignment.tensors.of_tensor(name, &shape, config);
        if let Some(c @ Codec::Vq { .. }) = coded {
            rungs.insert(c);
        }
        let bytes = if let Some(codec) = coded {
            codec
                .matrix_bytes(shape[0], shape[1])
                .map_err(|e| codec_err(name, e))?
        } else {
            2 * params
        };
        *resident_by_kind.entry(kind).or_default() += bytes;
        if let Some(l) = layer_of(name) {
            *layer_dense.entry(l).or_default() += bytes;
        }
    }
    let (h, i, e) = (
        config.hidden_size,
        config.moe.expert_intermediate,
        config.moe.num_experts,
    );
    let mut layers = Vec::new();
    let spare = crate::residency::policy::PolicyParams::default().max_swaps;
    for l in config.moe_layers() {
        let (codec, resident) = assignment
            .layers
            .get(&l)
            .copied()
            .unwrap_or((assignment.default_experts, e));
        let name = format!("model.layers.{l}.experts");
        let expert_bytes = expert_bytes(codec, h, i).map_err(|x| codec_err(&name, x))?;
        if let Codec::Vq { .. } = codec {
            rungs.insert(codec);
        }
        params_total += (e * 3 * h * i) as u64;
        let resident = resident.min(e);
        // A layer keeping only some experts holds slots for swaps in flight beside them.
        let spare_slots = crate::residency::spare_slots(e, resident, spare);
        let row = LayerBits {
            layer: l,
            codec,
            experts: e,
            resident,
            spare_slots,
            expert_bytes,
            resident_bytes: (resident + spare_slots) as u64 * expert_bytes,
            reservoir_bytes: (e - resident) as u64 * expert_bytes,
            dense_bytes: layer_dense.get(&l).copied().unwrap_or(0),
        };
        *resident_by_kind
            .entry(TensorKind::RoutedExperts)
            .or_default() += row.resident_bytes;
        layers.push(row);
    }
    let codebook_bytes = rungs
        .iter()
        .map(|c| c.codebook_bytes().map_err(|x| codec_err("codebook", x)))
        .sum::<Result<u64, _>>()?;
    let resident_bytes = resident_by_kind.values().sum::<u64>();
    let reservoir_bytes = layers.iter().map(|l| l.reservoir_bytes).sum();
    let kv_cache_bytes = kv_context.map(|ctx| {
        (config.layers.len() * 2 * config.num_kv_heads * config.head_dim * ctx * 4) as u64
    });
    Ok(BitsReport {
        params_total,
        resident_by_kind,
        codebook_bytes,
        resident_bytes,
        reservoir_bytes,
        resident_bits_per_weight: resident_bytes as f64 * 8.0 / params_total as f64,
        stored_bits_per_weight: (resident_bytes + reservoir_bytes) as f64 * 8.0
            / params_total as f64,
        layers,
        kv_cache_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fixture;

    #[test]
    fn bits_add_up_and_fall_with_codec_and_residency() {
        let dir = fixture("small-moe");
        let config = Config::from_file(&dir.join("config.json")).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let full = account(&config, &ckpt, &Assignment::uncompressed(), Some(512)).unwrap();
        let inv = crate::eval::inspect::inventory(&config, &ckpt).unwrap();
        assert_eq!(full.params_total, inv.params_total);
        // bf16 everywhere, every expert resident: 16 bits per weight exactly.
        assert_eq!(full.resident_bytes, 2 * full.params_total);
        assert_eq!(full.reservoir_bytes, 0);
        assert!((full.resident_bits_per_weight - 16.0).abs() < 1e-12);
        assert!(full.kv_cache_bytes.unwrap() > 0);

        let e = config.moe.num_experts;
        let at = |codec: &str, resident: usize| {
            let codec: Codec = codec.parse().unwrap();
            let a = Assignment {
                tensors: GroupCodecs::default(),
                layers: config
                    .moe_layers()
                    .map(|l| (l, (codec, resident)))
                    .collect(),
                default_experts: Codec::Bf16,
            };
            account(&config, &ckpt, &a, None).unwrap()
        };
        let (q4, q2, vq2, half) = (at("q4", e), at("q2", e), at("vq2", e), at("vq2", e / 2));

        // The untied LM head at vq3 is priced at its codes and norms, with vq3's codebook
        // counted once; nothing else moves.
        let vq3: Codec = "vq3".parse().unwrap();
        let coded_head = Assignment {
            tensors: GroupCodecs::uniform(Codec::Bf16, vq3, Codec::Bf16),
            ..Assignment::uncompressed()
        };
        let head = account(&config, &ckpt, &coded_head, None).unwrap();
        let (v, h) = (config.vocab_size, config.hidden_size);
        assert_eq!(
            head.resident_by_kind[&TensorKind::LmHead],
            vq3.matrix_bytes(v, h).unwrap()
        );
        assert_eq!(head.codebook_bytes, vq3.codebook_bytes().unwrap());
        assert_eq!(
            head.resident_bytes + 2 * (v * h) as u64,
            full.resident_bytes + vq3.matrix_bytes(v, h).unwrap()
        );
        assert!(q2.resident_bytes < q4.resident_bytes);
        assert_eq!(vq2.codebook_bytes, 65536 * 8 * 2);
        // Half the experts in the reservoir; resident, the other half and the spare slots
        // a partial set holds for swaps in flight.
        let one = half.layers[0].expert_bytes;
        let spare = half.layers[0].spare_slots as u64;
        assert!(spare > 0 && vq2.layers[0].spare_slots == 0);
        assert_eq!(
            half.reservoir_bytes,
            vq2.resident_bytes - half.resident_bytes + spare * one * half.layers.len() as u64
        );
        for r in [&q4, &q2, &vq2, &half] {
            let layers: u64 = r.layers.iter().map(|l| l.resident_bytes).sum();
            assert_eq!(r.resident_by_kind[&TensorKind::RoutedExperts], layers);
            assert_eq!(r.resident_bytes, r.resident_by_kind.values().sum::<u64>());
        }
    }
}
