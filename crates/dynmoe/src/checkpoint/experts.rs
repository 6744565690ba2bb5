//! Where a MoE layer's routed experts sit in a checkpoint. Published checkpoints keep
//! one tensor per expert and projection; transformers 5 keeps them fused in memory and
//! may save them so. Loading the model and converting it to expert stores both read
//! experts through this one resolver.

use std::path::PathBuf;

use safetensors::tensor::Dtype;

use super::config::Config;
use super::{arch, Checkpoint, Error};

/// A run of bytes in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// The file.
    pub file: PathBuf,
    /// Where the run starts.
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
}

/// Gate, up and down: the order of projections everywhere in dynmoe.
pub const PROJECTIONS: usize = 3;

/// The tensors holding one MoE layer's routed experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertTensors {
    /// `{prefix}.{e}.{names[p]}.weight`, one per expert and projection.
    PerExpert {
        /// `model.layers.{L}.{block}.experts`.
        prefix: String,
        /// Gate, up and down projection names.
        names: [&'static str; PROJECTIONS],
    },
    /// `gate_up_proj` `[E, 2I, H]` (gate rows first) and `down_proj` `[E, H, I]`.
    Fused {
        /// Name of the fused gate/up tensor.
        gate_up: String,
        /// Name of the fused down tensor.
        down: String,
    },
}

/// The shapes of one layer's experts.
#[derive(Debug, Clone, Copy)]
pub struct ExpertShape {
    /// Experts in the layer.
    pub experts: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
}

impl ExpertShape {
    /// The routed experts' shape a configuration gives every MoE layer.
    pub fn of(config: &super::config::Config) -> ExpertShape {
        ExpertShape {
            experts: config.moe.num_experts,
            hidden: config.hidden_size,
            intermediate: config.moe.expert_intermediate,
        }
    }

    /// `[rows, cols]` of projection `p` (0 gate, 1 up, 2 down) as checkpoints store it.
    pub fn matrix(&self, p: usize) -> [usize; 2] {
        match p {
            0 | 1 => [self.intermediate, self.hidden],
            _ => [self.hidden, self.intermediate],
        }
    }
}

impl ExpertTensors {
    /// The experts under `{block}.experts` (e.g. `model.layers.3.mlp`) with projection
    /// names `names`, in the per-expert layout or, failing that, the fused one.
    pub fn find(
        ckpt: &Checkpoint,
        block: &str,
        names: [&'static str; PROJECTIONS],
    ) -> Result<ExpertTensors, Error> {
        let prefix = format!("{block}.experts");
        let first = format!("{prefix}.0.{}.weight", names[0]);
        let gate_up = format!("{prefix}.gate_up_proj");
        if ckpt.contains(&first) || !ckpt.contains(&gate_up) {
            // A missing per-expert tensor is reported by name when it is read.
            return Ok(ExpertTensors::PerExpert { prefix, names });
        }
        Ok(ExpertTensors::Fused {
            gate_up,
            down: format!("{prefix}.down_proj"),
        })
    }

    /// Projection `p` of expert `e` as f32 `[rows, cols]`, and the tensor it was read from.
    pub fn matrix(
        &self,
        ckpt: &Checkpoint,
        shape: &ExpertShape,
        e: usize,
        p: usize,
    ) -> Result<(Vec<f32>, String), Error> {
        let [rows, cols] = shape.matrix(p);
        let n = rows * cols;
        match self {
            ExpertTensors::PerExpert { prefix, names } => {
                let name = format!("{prefix}.{e}.{}.weight", names[p]);
                Ok((ckpt.f32(&name, &[rows, cols])?, name))
            }
            ExpertTensors::Fused { gate_up, down } => {
                let (x, i, h) = (shape.experts, shape.intermediate, shape.hidden);
                let (name, full, start) = match p {
                    0 => (gate_up, [x, 2 * i, h], e * 2 * n),
                    1 => (gate_up, [x, 2 * i, h], e * 2 * n + n),
                    _ => (down, [x, h, i], e * n),
                };
                let t = ckpt.raw_checked(name, &full)?;
                Ok((t.f32_range(name, start, n)?, name.clone()))
            }
        }
    }

    /// Where projection `p` of expert `e` sits in its shard: the bytes [`matrix`]
    /// widens, for reading them again later without the checkpoint.
    ///
    /// [`matrix`]: ExpertTensors::matrix
    pub fn extent(
        &self,
        ckpt: &Checkpoint,
        shape: &ExpertShape,
        e: usize,
        p: usize,
    ) -> Result<(Extent, Dtype), Error> {
        let [rows, cols] = shape.matrix(p);
        let n = rows * cols;
        let (name, full, start) = match self {
            ExpertTensors::PerExpert { prefix, names } => (
                format!("{prefix}.{e}.{}.weight", names[p]),
                [1, rows, cols],
                0,
            ),
            ExpertTensors::Fused { gate_up, down } => {
                let (x, i, h) = (shape.experts, shape.intermediate, shape.hidden);
                match p {
                    0 => (gate_up.clone(), [x, 2 * i, h], e * 2 * n),
                    1 => (gate_up.clone(), [x, 2 * i, h], e * 2 * n + n),
                    _ => (down.clone(), [x, h, i], e * n),
                }
            }
        };
        let t = match self {
            ExpertTensors::PerExpert { .. } => ckpt.raw_checked(&name, &full[1..])?,
            ExpertTensors::Fused { .. } => ckpt.raw_checked(&name, &full)?,
        };
        let size = t.float_size(&name)?;
        Ok((
            Extent {
                file: t.path.to_path_buf(),
                offset: t.offset + (start * size) as u64,
                len: n * size,
            },
            t.dtype,
        ))
    }

    /// Every tensor these experts occupy.
    pub fn tensor_names(&self, experts: usize) -> Vec<String> {
        match self {
            ExpertTensors::PerExpert { prefix, names } => (0..experts)
                .flat_map(|e| {
                    names
                        .iter()
                        .map(move |p| format!("{prefix}.{e}.{p}.weight"))
                })
                .collect(),
            ExpertTensors::Fused { gate_up, down } => vec![gate_up.clone(), down.clone()],
        }
    }
}

/// Where MoE layer `layer`'s routed experts sit in the checkpoint, and the prefix their
/// tensor names share (for errors).
pub fn expert_tensors(
    config: &Config,
    ckpt: &Checkpoint,
    layer: usize,
) -> Result<(ExpertTensors, String, [&'static str; 3]), Error> {
    let names = arch::ffn_names(config.arch, ckpt, layer);
    let prefix = format!("model.layers.{layer}.{}", names.block);
    let tensors = ExpertTensors::find(ckpt, &prefix, names.projections)?;
    Ok((tensors, prefix, names.projections))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh, TempDir};
    use safetensors::tensor::{Dtype, TensorView};

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The same experts written per expert and fused read back identically.
    #[test]
    fn fused_and_per_expert_layouts_agree() {
        let shape = ExpertShape {
            experts: 3,
            hidden: 8,
            intermediate: 6,
        };
        let (x, h, i) = (shape.experts, shape.hidden, shape.intermediate);
        let mats: Vec<[Vec<f32>; 3]> = (0..x as u64)
            .map(|e| {
                [
                    fresh(i * h, 10 + e),
                    fresh(i * h, 20 + e),
                    fresh(h * i, 30 + e),
                ]
            })
            .collect();
        let names = ["gate_proj", "up_proj", "down_proj"];

        let mut per_expert = Vec::new();
        for (e, m) in mats.iter().enumerate() {
            for p in 0..3 {
                per_expert.push((
                    format!("b.experts.{e}.{}.weight", names[p]),
                    shape.matrix(p).to_vec(),
                    f32_bytes(&m[p]),
                ));
            }
        }
        let gate_up: Vec<f32> = mats
            .iter()
            .flat_map(|m| m[0].iter().chain(&m[1]).copied())
            .collect();
        let down: Vec<f32> = mats.iter().flat_map(|m| m[2].iter().copied()).collect();
        let fused = vec![
            (
                "b.experts.gate_up_proj".to_string(),
                vec![x, 2 * i, h],
                f32_bytes(&gate_up),
            ),
            (
                "b.experts.down_proj".to_string(),
                vec![x, h, i],
                f32_bytes(&down),
            ),
        ];

        for (label, tensors) in [("per-expert", per_expert), ("fused", fused)] {
            let dir = TempDir::new("expert-tensors");
            let views: Vec<(String, TensorView)> = tensors
                .iter()
                .map(|(n, s, b)| {
                    (
                        n.clone(),
                        TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
                    )
                })
                .collect();
            safetensors::serialize_to_file(views, None, &dir.path("model.safetensors")).unwrap();
            let ckpt = Checkpoint::open(dir.dir()).unwrap();
            let t = ExpertTensors::find(&ckpt, "b", names).unwrap();
            assert_eq!(matches!(t, ExpertTensors::Fused { .. }), label == "fused");
            for (e, m) in mats.iter().enumerate() {
                for (p, want) in m.iter().enumerate() {
                    assert_eq!(
                        &t.matrix(&ckpt, &shape, e, p).unwrap().0,
                        want,
                        "{label} e{e} p{p}"
                    );
                    let (ext, dtype) = t.extent(&ckpt, &shape, e, p).unwrap();
                    let file = std::fs::read(&ext.file).unwrap();
                    let at = ext.offset as usize;
                    let mut got = vec![0.0f32; want.len()];
                    crate::checkpoint::widen(dtype, &file[at..at + ext.len], &mut got);
                    assert_eq!(&got, want, "extent {label} e{e} p{p}");
                }
            }
            let mut listed = t.tensor_names(x);
            listed.sort();
            let mut stored: Vec<String> = tensors.iter().map(|(n, ..)| n.clone()).collect();
            stored.sort();
            assert_eq!(listed, stored, "{label}");
        }
    }
}
