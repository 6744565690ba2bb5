//! One layer's resident set: which experts are in, the slot buffers the kernels read
//! them from, the spare buffers loads land in, and routing confined to the residents.

use super::policy::Evidence;
use crate::backend::route::{as_distribution, confine};
use crate::backend::{route::route, route::Route};
use crate::backend::{Backend, ExpertSlots, SwiGluGroup, Weight};
use crate::checkpoint::config::Router;
use crate::store::reader::record_view;
use crate::store::records::{words_as_bytes, Buffer, RecordFormat};
use crate::store::vq::record_views;
use crate::store::vq_encode::VqExperts;

/// What a slot holds for the kernels: f32 tensors on the backend, a store's record
/// (affine or VQ, as the layer's format says) in host memory, viewed in place, or the
/// index of a slot in the backend's own memory ([`Backend::new_slots`]).
enum Slot<B: Backend> {
    Dense([B::Matrix; 3]),
    Record(Vec<u32>),
    Device(usize),
}

/// A load whose record is on its way into a device slot: it commits at the first token
/// boundary after the copy has landed.
pub(super) struct Staged {
    outgoing: u32,
    incoming: u32,
    /// The device slot being filled.
    slot: usize,
    /// The host buffer the copy reads; spare again once the copy has landed.
    buffer: Buffer,
    /// Bytes read out of the reservoir, and the seconds that took.
    bytes: usize,
    seconds: f64,
}

/// The resident set of one MoE layer.
pub struct LayerSet<B: Backend> {
    /// Slots in the backend's memory, when the set lives there: then every `Slot` is a
    /// `Device` index, routing runs on the backend, and the host buffers are only the
    /// staging of loads. First, so that it drops (and unpins the staging) before them.
    device: Option<B::Slots>,
    /// Device slots holding no resident expert.
    free: Vec<usize>,
    /// Loads whose copy into a device slot is under way.
    pub(super) staged: Vec<Staged>,
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
    /// Every expert at a low rung, run for a token routed outside the residents: with
    /// shadows routing is never confined.
    pub(super) shadows: Option<VqExperts>,
}

/// The words of a store record's buffer.
fn words(buf: &Buffer) -> &[u32] {
    match buf {
        Buffer::Words(w) => w,
        Buffer::F32(_) => panic!("a dense buffer holds no record words"),
    }
}

impl<B: Backend> LayerSet<B> {
    /// A set holding `experts` (loaded into `buffers`, one each), with `spares` spare
    /// buffers, out of `num_experts`.
    ///
    /// With `on_device` (a block the backend can route, and its experts per token) and a
    /// backend that keeps slots in its own memory for this format, the set lives there:
    /// `experts` are copied into device slots (and `buffers` dropped), `spares` are
    /// page-locked as the staging of later loads, and one more device slot per spare
    /// receives loads in flight.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        b: &B,
        format: RecordFormat,
        num_experts: usize,
        experts: &[u32],
        buffers: Vec<Buffer>,
        mut spares: Vec<Buffer>,
        evidence: Evidence,
        on_device: Option<usize>,
    ) -> LayerSet<B> {
        let device = match (format, on_device) {
            (RecordFormat::Affine(_) | RecordFormat::Vq(_), Some(top_k)) => {
                b.new_slots(&format, num_experts, top_k, experts.len() + spares.len())
            }
            _ => None,
        };
        if let Some(mut slots) = device {
            for (i, (&e, buf)) in experts.iter().zip(&buffers).enumerate() {
                slots.load(i, words(buf));
                slots.assign(e as usize, Some(i));
            }
            for buf in &mut spares {
                if let Buffer::Words(w) = buf {
                    slots.pin(w);
                }
            }
            slots.wait();
            slots.flush();
            let mut set = LayerSet::empty(format, num_experts, spares, evidence);
            for (i, &e) in experts.iter().enumerate() {
                set.resident[e as usize] = true;
                set.slot_of[e as usize] = i;
                set.slots.push(Slot::Device(i));
            }
            set.free = (experts.len()..experts.len() + set.spares.len()).collect();
            set.device = Some(slots);
            return set;
        }
        let mut set = LayerSet::empty(format, num_experts, spares, evidence);
        for (&e, buf) in experts.iter().zip(buffers) {
            // A dense record's staging buffer is not kept: the slot is the upload.
            let (slot, _) = set.fill(b, buf, None);
            set.resident[e as usize] = true;
            set.slot_of[e as usize] = set.slots.len();
            set.slots.push(slot);
        }
        set
    }

    fn empty(
        format: RecordFormat,
        num_experts: usize,
        spares: Vec<Buffer>,
        evidence: Evidence,
    ) -> LayerSet<B> {
        LayerSet {
            device: None,
            free: Vec::new(),
            staged: Vec::new(),
            format,
            resident: vec![false; num_experts],
            slot_of: vec![usize::MAX; num_experts],
            slots: Vec::new(),
            spares,
            in_flight: Vec::new(),
            frozen: vec![false; num_experts],
            evidence,
            hit: 0.0,
            mass: 0.0,
            oracle: 0.0,
            shadows: None,
        }
    }

    /// The backend's slots, when the set lives in its memory.
    pub fn device_slots(&self) -> Option<&B::Slots> {
        self.device.as_ref()
    }

    /// Starts copying a loaded record into a free device slot; it commits once landed
    /// ([`commit_landed`](Self::commit_landed)).
    pub(super) fn stage(&mut self, incoming: u32, buffer: Buffer, bytes: usize, seconds: f64) {
        let &(outgoing, _) = self
            .in_flight
            .iter()
            .find(|&&(_, inc)| inc == incoming)
            .expect("a load that was issued");
        let slots = self.device.as_mut().expect("a set on the device");
        let slot = self
            .free
            .pop()
            .expect("a free device slot per load in flight");
        slots.load(slot, words(&buffer));
        self.staged.push(Staged {
            outgoing,
            incoming,
            slot,
            buffer,
            bytes,
            seconds,
        });
    }

    /// Commits every staged load whose copy has landed (its buffer spare again), then
    /// makes the set as it now is visible to the backend's next launches. Returns the
    /// bytes and read seconds of each committed load.
    pub(super) fn commit_landed(&mut self) -> Vec<(usize, f64)> {
        // Out of `self` while the set's bookkeeping changes beside it.
        let Some(mut slots) = self.device.take() else {
            return Vec::new();
        };
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.staged.len() {
            if !slots.loaded(self.staged[i].slot) {
                i += 1;
                continue;
            }
            let st = self.staged.swap_remove(i);
            let s = self.exchange(st.outgoing, st.incoming);
            slots.assign(st.outgoing as usize, None);
            slots.assign(st.incoming as usize, Some(st.slot));
            match std::mem::replace(&mut self.slots[s], Slot::Device(st.slot)) {
                Slot::Device(freed) => self.free.push(freed),
                _ => unreachable!("a set on the device has device slots only"),
            }
            self.in_flight
                .retain(|&pair| pair != (st.outgoing, st.incoming));
            self.spares.push(st.buffer);
            done.push((st.bytes, st.seconds));
        }
        slots.flush();
        self.device = Some(slots);
        done
    }

    /// Waits until every staged copy has landed (they still commit at the next boundary).
    pub(super) fn wait_staged(&self) {
        if let Some(slots) = &self.device {
            slots.wait();
        }
    }

    /// The slot a loaded buffer becomes, and the buffer freed by it: a dense record is
    /// uploaded (so its staging buffer is free again at once), a store record's buffer
    /// becomes the slot itself and frees the outgoing slot's buffer.
    fn fill(&self, b: &B, buf: Buffer, old: Option<Slot<B>>) -> (Slot<B>, Option<Buffer>) {
        match (self.format, buf) {
            (format @ RecordFormat::Dense { .. }, Buffer::F32(f)) => {
                let m = format.dense_matrices(&f).expect("a dense format");
                let slot = Slot::Dense(m.map(|(w, rows, cols)| b.upload_matrix(w, rows, cols)));
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
        let s = self.exchange(outgoing, incoming);
        // The outgoing slot is taken out first so a record slot's buffer can be reused.
        let old = std::mem::replace(&mut self.slots[s], Slot::Record(Vec::new()));
        let (slot, freed) = self.fill(b, buf, Some(old));
        self.slots[s] = slot;
        freed.expect("a freed buffer")
    }

    /// Hands `outgoing`'s slot index to `incoming` (ids and resident flags); returns it.
    /// The slot's contents are the caller's to replace.
    fn exchange(&mut self, outgoing: u32, incoming: u32) -> usize {
        let (out, inc) = (outgoing as usize, incoming as usize);
        let s = self.slot_of[out];
        assert!(s != usize::MAX && self.slot_of[inc] == usize::MAX);
        self.slot_of[out] = usize::MAX;
        self.slot_of[inc] = s;
        self.resident[out] = false;
        self.resident[inc] = true;
        s
    }

    /// The resident experts, ascending.
    pub fn residents(&self) -> Vec<u32> {
        (0..self.resident.len() as u32)
            .filter(|&e| self.resident[e as usize])
            .collect()
    }

    /// Routes `rows` tokens from their unmasked probabilities `[rows, E]` (`bias`: a
    /// sigmoid router's correction bias), confined to the residents; counts the hit rate
    /// and, when `track`, feeds the evidence, both over the scores as a distribution per
    /// token ([`as_distribution`]).
    pub fn route(
        &mut self,
        probs: &[f32],
        rows: usize,
        bias: Option<&[f32]>,
        top_k: usize,
        router: Router,
        track: bool,
    ) -> Vec<Route> {
        let e = self.resident.len();
        self.observe(&as_distribution(probs, e, router), rows, track);
        (0..rows)
            .map(|r| {
                let p = &probs[r * e..(r + 1) * e];
                match self.shadows {
                    Some(_) => route(p, bias, top_k, router),
                    None => route(&confine(p, &self.resident, router), bias, top_k, router),
                }
            })
            .collect()
    }

    /// Counts the hit rate of `rows` tokens' unmasked probabilities `[rows, E]` and, when
    /// `track`, feeds them to the evidence: what [`route`](Self::route) does besides
    /// routing, for blocks routed on the backend.
    pub fn observe(&mut self, probs: &[f32], rows: usize, track: bool) {
        let e = self.resident.len();
        let k = self.slots.len();
        let mut sorted = vec![0.0f32; e];
        for p in probs.chunks_exact(e).take(rows) {
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
        }
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
        if s == usize::MAX {
            let shadows = self
                .shadows
                .as_ref()
                .unwrap_or_else(|| panic!("expert {e} routed but not resident"));
            return SwiGluGroup::of_vq(shadows.expert(e), rows, scales);
        }
        match (&self.slots[s], self.format) {
            (Slot::Dense([g, u, d]), RecordFormat::Dense { intermediate, .. }) => SwiGluGroup {
                gate: Weight::Dense(g),
                up: Weight::Dense(u),
                down: Weight::Dense(d),
                intermediate,
                rows,
                scales,
            },
            (Slot::Record(w), RecordFormat::Affine(layout)) => {
                SwiGluGroup::of_record(record_view(&layout, words_as_bytes(w)), rows, scales)
            }
            (Slot::Record(w), RecordFormat::Vq(layout)) => {
                SwiGluGroup::of_vq(record_views(&layout, words_as_bytes(w)), rows, scales)
            }
            (Slot::Device(_), _) => {
                panic!("expert {e} lives in a device slot: the block is routed on the backend")
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
        let host = match self.device {
            Some(_) => self.spares.len() + self.in_flight.len(),
            None => self.slots.len() + self.spares.len() + self.in_flight.len(),
        };
        one * host
    }

    /// Bytes of the backend's memory the set takes (its device slots and tables).
    pub fn device_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |s| s.bytes())
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
            let r = route(&confine(&p, &resident, router), None, 4, router);
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
            let a = route(&confine(&p, &[true; 32], router), None, 4, router);
            let b = route(&p, None, 4, router);
            assert_eq!(a.experts, b.experts);
            for (x, y) in a.weights.iter().zip(&b.weights) {
                assert!((x - y).abs() <= 1e-6 * y.abs());
            }
        }
    }
}
