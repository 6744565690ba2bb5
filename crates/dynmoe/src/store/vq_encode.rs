//! Encoding a checkpoint's routed experts at VQ rungs: the one encoder that VQ expert
//! stores ([`super::vq`]) and in-memory encodings (the allocator's probes) share, and the
//! rotation seed each matrix gets.

use std::sync::Arc;

use super::vq::VqStore;
use super::Error;
use crate::checkpoint::experts::{expert_tensors, ExpertShape, ExpertTensors};
use crate::checkpoint::{Checkpoint, Config};
use crate::codec::vq::{Rung, VqMatrix, VqView};

/// One layer's routed experts at a VQ rung.
#[derive(Clone)]
pub enum VqExperts {
    /// Encoded in memory: per expert its gate, up and down projections (shared, so
    /// several models can hold one encoding).
    Encoded(Arc<Vec<[VqMatrix; 3]>>),
    /// The records of decoder layer `layer` in a VQ expert store.
    Stored {
        /// The store of the layer's rung.
        store: Arc<VqStore>,
        /// Decoder layer whose records these are.
        layer: usize,
    },
}

impl VqExperts {
    /// Gate, up and down of expert `e`.
    pub fn expert(&self, e: usize) -> [VqView<'_>; 3] {
        match self {
            VqExperts::Encoded(m) => [m[e][0].view(), m[e][1].view(), m[e][2].view()],
            VqExperts::Stored { store, layer } => store.record(*layer, e),
        }
    }
}

/// The seed of the rotation of projection `p` (0 gate, 1 up, 2 down) of expert `e` of
/// decoder layer `layer`, in a model of `experts` experts per MoE layer: every matrix of
/// the model gets its own, so no two share a rotation.
pub fn vq_seed(layer: usize, experts: usize, e: usize, p: usize) -> u64 {
    ((layer * experts + e) * 3 + p) as u64
}

/// Gate, up and down of expert `e` of MoE layer `layer` encoded at `rungs` (one per
/// projection), from the checkpoint's weights, with the seeds of [`vq_seed`]. The one
/// encoder of expert weights: in-memory encodings and VQ expert stores are both made by
/// it.
pub fn encode_expert(
    config: &Config,
    ckpt: &Checkpoint,
    tensors: &ExpertTensors,
    layer: usize,
    e: usize,
    rungs: [Rung; 3],
) -> Result<[VqMatrix; 3], Error> {
    let shape = ExpertShape::of(config);
    let encode = |p: usize| -> Result<VqMatrix, Error> {
        let [rows, cols] = shape.matrix(p);
        let (w, name) = tensors.matrix(ckpt, &shape, e, p)?;
        let seed = vq_seed(layer, shape.experts, e, p);
        VqMatrix::encode(&w, rows, cols, rungs[p], seed).map_err(|source| Error::Encode {
            tensor: name,
            source,
        })
    };
    Ok([encode(0)?, encode(1)?, encode(2)?])
}

/// Every routed expert of MoE layer `layer` encoded at `rung` in memory, from the
/// checkpoint's weights (what the allocator's probes try; running models read VQ
/// experts from a store, see `store::vq`).
pub fn encode_experts(
    config: &Config,
    ckpt: &Checkpoint,
    layer: usize,
    rung: Rung,
) -> Result<VqExperts, Error> {
    encode_experts_by_projection(config, ckpt, layer, [rung; 3])
}

/// [`encode_experts`] with a rung per projection (gate, up, down): mixes that give the
/// down projection more bits, as hand-made dynamic quants do.
pub fn encode_experts_by_projection(
    config: &Config,
    ckpt: &Checkpoint,
    layer: usize,
    rungs: [Rung; 3],
) -> Result<VqExperts, Error> {
    let (tensors, ..) = expert_tensors(config, ckpt, layer)?;
    let experts = (0..config.moe.num_experts)
        .map(|e| encode_expert(config, ckpt, &tensors, layer, e, rungs))
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(VqExperts::Encoded(Arc::new(experts)))
}
