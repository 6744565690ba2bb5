//! One layer's resident set: which experts are in, the slot buffers the kernels read
//! them from, the spare buffers loads land in, and routing confined to the residents.

use super::policy::Evidence;
use super::reservoir::{words_as_bytes, Buffer, RecordFormat};
use crate::backend::{Backend, SwiGluGroup, Weight};
use crate::model::config::Router;
use crate::model::moe::{route, Route};
use crate::store::reader::record_view;
use crate::store::vq::record_views;

/// What a slot holds for the kernels: f32 tensors on the backend, or a store's record
/// (affine or VQ, as the layer's format says) in host memory, viewed in place.
enum Slot<B: Backend> {
    Dense([B::Matrix; 3]),
    Record(Vec<u32>),
}

/// The resident set of one MoE layer.
pub struct LayerSet<B: Backend> {
    pub(super) format: RecordFormat,
    pub(super) resident: Vec<bool>,
    /// Expert id to slot index (`usize::MAX` when not resident).
    slot_of: Vec<usize>,
    slots: Vec<Slot<B>>,
    /// Buffers free to receive a load; their number never changes while loads are out,
    /// it only moves between here and the loader.
    pub(super) spares: Vec<Buffer>,
    /// Loads issued and not yet committed, `(outgoing, incoming)`.
    pub(super) in_flight: Vec<(u32, u32)>,
    /// Experts swapped at the last checkpoint, who sit this one out.
    pub(super) frozen: Vec<bool>,
    pub(super) evidence: Evidence,
    /// Unmasked routing probability on residents, and in all.
    pub(super) hit: f64,
    pub(super) mass: f64,
    /// Probability on each token's own K most probable experts: what no set of K
    /// experts can beat.
    pub(super) oracle: f64,
}

/// The probabilities of one token with routing confined to `resident`: the router
/// logits of the others set to −∞ before the softmax, so the residents' probabilities
/// are renormalised over the residents and the others are −∞ (never picked).
pub fn confine(probs: &[f32], resident: &[bool]) -> Vec<f32> {
    let s: f32 = probs
        .iter()
        .zip(resident)
        .filter(|(_, &r)| r)
        .map(|(p, _)| p)
        .sum();
    probs
        .iter()
        .zip(resident)
        .map(|(&p, &r)| if r { p / s } else { f32::NEG_INFINITY })
        .collect()
}

impl<B: Backend> LayerSet<B> {
    /// A set holding `experts` (loaded into `buffers`, one each), with `spares` spare
    /// buffers, out of `num_experts`.
    pub(super) fn new(
        b: &B,
        format: RecordFormat,
        num_experts: usize,
        experts: &[u32],
        buffers: Vec<Buffer>,
        spares: Vec<Buffer>,
        evidence: Evidence,
    ) -> LayerSet<B> {
        let mut set = LayerSet {
            format,
            resident: vec![false; num_experts],
            slot_of: vec![usize::MAX; num_experts],
            slots: Vec::with_capacity(experts.len()),
            spares,
            in_flight: Vec::new(),
            frozen: vec![false; num_experts],
            evidence,
            hit: 0.0,
            mass: 0.0,
            oracle: 0.0,
        };
        for (&e, buf) in experts.iter().zip(buffers) {
            // A dense record's staging buffer is not kept: the slot is the upload.
            let (slot, _) = set.fill(b, buf, None);
            set.resident[e as usize] = true;
            set.slot_of[e as usize] = set.slots.len();
            set.slots.push(slot);
        }
        set
    }

    /// The slot a loaded buffer becomes, and the buffer freed by it: a dense record is
    /// uploaded (so its staging buffer is free again at once), a store record's buffer
    /// becomes the slot itself and frees the outgoing slot's buffer.
    fn fill(&self, b: &B, buf: Buffer, old: Option<Slot<B>>) -> (Slot<B>, Option<Buffer>) {
        match (self.format, buf) {
            (
                RecordFormat::Dense {
                    hidden,
                    intermediate,
                    ..
                },
                Buffer::F32(f),
            ) => {
                let n = hidden * intermediate;
                let (h, i) = (hidden, intermediate);
                let slot = Slot::Dense([
                    b.upload_matrix(&f[..n], i, h),
                    b.upload_matrix(&f[n..2 * n], i, h),
                    b.upload_matrix(&f[2 * n..3 * n], h, i),
                ]);
                (slot, Some(Buffer::F32(f)))
            }
            (RecordFormat::Affine(_) | RecordFormat::Vq(_), Buffer::Words(w)) => {
                let freed = match old {
                    Some(Slot::Record(o)) => Some(Buffer::Words(o)),
                    _ => None,
                };
                (Slot::Record(w), freed)
            }
            _ => panic!("a buffer of another format"),
        }
    }

    /// Makes `incoming` resident in `outgoing`'s slot from the loaded `buf`, returning
    /// the buffer that becomes spare.
    pub(super) fn commit(&mut self, b: &B, outgoing: u32, incoming: u32, buf: Buffer) -> Buffer {
        let s = self.slot_of[outgoing as usize];
        assert!(s != usize::MAX && self.slot_of[incoming as usize] == usize::MAX);
        // The outgoing slot is taken out first so a record slot's buffer can be reused.
        let old = std::mem::replace(&mut self.slots[s], Slot::Record(Vec::new()));
        let (slot, freed) = self.fill(b, buf, Some(old));
        self.slots[s] = slot;
        self.slot_of[outgoing as usize] = usize::MAX;
        self.slot_of[incoming as usize] = s;
        self.resident[outgoing as usize] = false;
        self.resident[incoming as usize] = true;
        freed.expect("a freed buffer")
    }

    /// The resident experts, ascending.
    pub fn residents(&self) -> Vec<u32> {
        (0..self.resident.len() as u32)
            .filter(|&e| self.resident[e as usize])
            .collect()
    }

    /// Routes `rows` tokens from their unmasked probabilities `[rows, E]`, confined to
    /// the residents; counts the hit rate and, when `track`, feeds the evidence.
    pub fn route(
        &mut self,
        probs: &[f32],
        rows: usize,
        top_k: usize,
        router: Router,
        track: bool,
    ) -> Vec<Route> {
        let e = self.resident.len();
        let k = self.slots.len();
        let mut sorted = vec![0.0f32; e];
        (0..rows)
            .map(|r| {
                let p = &probs[r * e..(r + 1) * e];
                sorted.copy_from_slice(p);
                sorted.sort_by(|a, b| b.total_cmp(a));
                self.oracle += sorted[..k].iter().map(|&v| v as f64).sum::<f64>();
                for (&pe, &res) in p.iter().zip(&self.resident) {
                    self.mass += pe as f64;
                    if res {
                        self.hit += pe as f64;
                    }
                }
                if track {
                    self.evidence.observe(p);
                }
                route(&confine(p, &self.resident), top_k, router)
            })
            .collect()
    }

    /// The kernels' view of resident expert `e`, from its slot.
    ///
    /// # Panics
    /// If `e` is not resident.
    pub fn group<'a>(
        &'a self,
        e: usize,
        rows: &'a [u32],
        scales: &'a [f32],
    ) -> SwiGluGroup<'a, B::Matrix> {
        let s = self.slot_of[e];
        assert!(s != usize::MAX, "expert {e} routed but not resident");
        match (&self.slots[s], self.format) {
            (Slot::Dense([g, u, d]), RecordFormat::Dense { intermediate, .. }) => SwiGluGroup {
                gate: Weight::Dense(g),
                up: Weight::Dense(u),
                down: Weight::Dense(d),
                intermediate,
                rows,
                scales,
            },
            (Slot::Record(w), RecordFormat::Affine(layout)) => crate::model::moe::record_group(
                record_view(&layout, words_as_bytes(w)),
                rows,
                scales,
            ),
            (Slot::Record(w), RecordFormat::Vq(layout)) => {
                crate::model::moe::vq_group(record_views(&layout, words_as_bytes(w)), rows, scales)
            }
            _ => unreachable!("slots match their layer's format"),
        }
    }

    /// Bytes of the slot buffers, resident and spare.
    pub fn slot_bytes(&self) -> usize {
        let one = match self.format {
            RecordFormat::Dense {
                hidden,
                intermediate,
                ..
            } => 3 * hidden * intermediate * 4,
            RecordFormat::Affine(_) | RecordFormat::Vq(_) => self.format.record_bytes(),
        };
        one * (self.slots.len() + self.spares.len() + self.in_flight.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    #[test]
    fn masked_routing_never_picks_a_non_resident() {
        let mut rng = Rng::new(11);
        let router = Router::SoftmaxTopK { renormalize: false };
        for _ in 0..200 {
            let mut p: Vec<f32> = (0..16).map(|_| rng.uniform()).collect();
            let s: f32 = p.iter().sum();
            p.iter_mut().for_each(|v| *v /= s);
            let resident: Vec<bool> = (0..16).map(|i| i % 3 != 0 || rng.uniform() < 0.3).collect();
            let r = route(&confine(&p, &resident), 4, router);
            assert!(r.experts.iter().all(|&e| resident[e as usize]), "{r:?}");
            // Renormalised over the residents, as a softmax over masked logits is.
            let sr: f32 = p
                .iter()
                .zip(&resident)
                .filter(|(_, &r)| r)
                .map(|(p, _)| p)
                .sum();
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                assert!((w - p[e as usize] / sr).abs() < 1e-6);
            }
            // The picks are the best residents.
            let mut best: Vec<u32> = (0..16u32).filter(|&e| resident[e as usize]).collect();
            best.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
            assert_eq!(r.experts, best[..4]);
        }
    }

    #[test]
    fn with_every_expert_resident_routing_is_unmasked() {
        let mut rng = Rng::new(12);
        for renormalize in [false, true] {
            let router = Router::SoftmaxTopK { renormalize };
            let mut p: Vec<f32> = (0..32).map(|_| rng.uniform()).collect();
            let s: f32 = p.iter().sum();
            p.iter_mut().for_each(|v| *v /= s);
            let a = route(&confine(&p, &[true; 32]), 4, router);
            let b = route(&p, 4, router);
            assert_eq!(a.experts, b.experts);
            for (x, y) in a.weights.iter().zip(&b.weights) {
                assert!((x - y).abs() <= 1e-6 * y.abs());
            }
        }
    }
}
