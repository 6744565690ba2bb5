//! Picking a decode step's token on the device (kernels/sample.cu), as `backend::sample`
//! defines it, so that a step that samples is recorded and replayed like a greedy one.
//! The chain follows the settings: penalties and temperature (`sample_scale`), then, with
//! top-k or top-p, the histogram, the cut and the sort of the candidates it falls among
//! (`sample_hist`, `sample_cut`, `sample_gather`, `sample_settle`), then the Gumbel draw
//! (`sample_draw`); greedy with penalties ends in `argmax_rows` instead.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::launch::{kernel_args, Ptr};
use super::{ok, Cuda};
use crate::backend::sample::{Sampling, BINS, BIN_SORT_MAX};

/// Threads of the sampler's grid kernels (the kernels' `SAMPLE_THREADS`).
pub(super) const SAMPLE_THREADS: usize = 256;
/// Threads of the one-block kernels.
const SETTLE_THREADS: usize = 1024;
/// Bytes of the kernels' `SampleCut`.
const CUT_BYTES: usize = 40;

pub(super) const SAMPLE_SCALE: &str = "sample_scale";
kernel_args! {
    /// `s` = the penalized logits over the temperature (`counts` null: no penalty), and
    /// each block's maximum into `bmax`.
    SampleScale for &[SAMPLE_SCALE] => {
        logits: Ptr, counts: Ptr, s: Ptr, bmax: Ptr, vocab: i32, chunk: i32,
        temperature: f32, rep: f32, pres: f32, freq: f32,
    }
}

pub(super) const SAMPLE_HIST: &str = "sample_hist";
kernel_args! {
    /// The candidates' count and integer weight by bin, added to the row's histogram.
    SampleHist for &[SAMPLE_HIST] => {
        s: Ptr, bmax: Ptr, hist_count: Ptr, hist_mass: Ptr, vocab: i32, chunk: i32,
        min_p: f32,
    }
}

pub(super) const SAMPLE_CUT: &str = "sample_cut";
kernel_args! {
    /// The bin the top-k (else top-p) cut falls in, from the histogram.
    SampleCut for &[SAMPLE_CUT] => {
        hist_count: Ptr, hist_mass: Ptr, cut: Ptr, top_k: i32, top_p: f32,
    }
}

pub(super) const SAMPLE_GATHER: &str = "sample_gather";
kernel_args! {
    /// The candidates the cut must sort.
    SampleGather for &[SAMPLE_GATHER] => {
        s: Ptr, bmax: Ptr, cut: Ptr, list_s: Ptr, list_id: Ptr, vocab: i32, chunk: i32,
        min_p: f32,
    }
}

pub(super) const SAMPLE_SETTLE: &str = "sample_settle";
kernel_args! {
    /// The exact cut among the gathered candidates, or whole bins.
    SampleSettle for &[SAMPLE_SETTLE] => {
        bmax: Ptr, blocks: i32, hist_mass: Ptr, cut: Ptr, list_s: Ptr, list_id: Ptr,
        top_k: i32, top_p: f32,
    }
}

pub(super) const SAMPLE_DRAW: &str = "sample_draw";
kernel_args! {
    /// The kept token with the largest scaled logit plus Gumbel noise, into
    /// `out[r · out_stride + at]`; the histogram readied for the next step.
    SampleDraw for &[SAMPLE_DRAW] => {
        s: Ptr, bmax: Ptr, cut: Ptr, step: Ptr, out: Ptr, out_stride: i32, at: i32,
        vocab: i32, chunk: i32, min_p: f32, seed_lo: u32, seed_hi: u32, count: Ptr,
        part: Ptr, part_i: Ptr, hist_count: Ptr, hist_mass: Ptr,
    }
}

pub(super) const COUNT_TOKEN: &str = "count_token";
kernel_args! {
    /// `counts[token] += 1` for the token at `out[r · out_stride + at]`.
    CountToken for &[COUNT_TOKEN] => {
        counts: Ptr, out: Ptr, out_stride: i32, at: i32, vocab: i32,
    }
}

/// Where the sampler's scratch buffer keeps each of its parts, in floats from its start.
struct Layout {
    blocks: usize,
    chunk: usize,
    s: usize,
    bmax: usize,
    /// Eight-byte aligned, as its `unsigned long long` sums need.
    hist_mass: usize,
    hist_count: usize,
    cut: usize,
    list_s: usize,
    list_id: usize,
    count: usize,
    part: usize,
    part_i: usize,
    floats: usize,
}

impl Layout {
    /// The parts for a row of `vocab` logits over a grid of about two blocks an SM.
    fn new(vocab: usize, sms: usize) -> Layout {
        let blocks = vocab.div_ceil(4 * SAMPLE_THREADS).clamp(1, 2 * sms.max(1));
        let chunk = vocab.div_ceil(blocks);
        let mut at = 0usize;
        let mut take = |n: usize, align: usize| {
            at = at.div_ceil(align) * align;
            let here = at;
            at += n;
            here
        };
        let s = take(vocab, 1);
        let bmax = take(blocks, 1);
        let hist_mass = take(2 * BINS, 2);
        let hist_count = take(BINS, 1);
        let cut = take(CUT_BYTES / 4, 2);
        let list_s = take(BIN_SORT_MAX, 1);
        let list_id = take(BIN_SORT_MAX, 1);
        let count = take(1, 1);
        let part = take(blocks, 1);
        let part_i = take(blocks, 1);
        Layout {
            blocks,
            chunk,
            s,
            bmax,
            hist_mass,
            hist_count,
            cut,
            list_s,
            list_id,
            count,
            part,
            part_i,
            floats: at,
        }
    }
}

/// Shared memory `sample_settle` sorts in: a key a candidate, up to [`BIN_SORT_MAX`]; more
/// than `sample_hist`'s histogram, which the same grant covers.
pub(super) const SETTLE_SHARED: usize = 8 * BIN_SORT_MAX;

/// Shared memory of `sample_hist`'s block histogram (the kernels' `SAMPLE_HIST_SHARED`):
/// a bin's integer weight (8 bytes) and count (4).
pub(super) const HIST_SHARED: usize = 12 * BINS;

impl Cuda {
    /// The token `s` picks from `logits` (`[vocab]`) into `out` (as bits), the draw's
    /// position after the one in `step` (`[token, position]`), the penalties from
    /// `counts` (null: none).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_sample(
        &self,
        logits: Ptr,
        vocab: usize,
        s: &Sampling,
        counts: Ptr,
        step: Ptr,
        out: Ptr,
    ) {
        let l = Layout::new(vocab, self.sms);
        // Zeroed once: the kernels leave the histogram and the count at zero.
        let mut scratch = self.grown_with(&self.sample_scratch, l.floats, true);
        let base = self.ptr(scratch.as_mut().expect("grown"));
        let at = |n: usize| base.floats(n);
        let grid = |blocks: usize, threads: usize, shared: usize| LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (v, chunk, blocks) = (vocab as i32, l.chunk as i32, l.blocks);
        let penalized = if s.penalizes() { counts } else { Ptr::NULL };
        self.launch(
            SAMPLE_SCALE,
            grid(blocks, SAMPLE_THREADS, 0),
            SampleScale {
                logits,
                counts: penalized,
                s: at(l.s),
                bmax: at(l.bmax),
                vocab: v,
                chunk,
                temperature: s.temperature.max(0.0),
                rep: s.repetition_penalty,
                pres: s.presence_penalty,
                freq: s.frequency_penalty,
            },
        );
        if s.is_greedy() {
            return self.launch_argmax_rows(at(l.s), 1, vocab, out);
        }
        let cuts = s.top_k > 0 || s.top_p < 1.0;
        if cuts {
            self.launch(
                SAMPLE_HIST,
                grid(blocks, SAMPLE_THREADS, HIST_SHARED),
                SampleHist {
                    s: at(l.s),
                    bmax: at(l.bmax),
                    hist_count: at(l.hist_count),
                    hist_mass: at(l.hist_mass),
                    vocab: v,
                    chunk,
                    min_p: s.min_p,
                },
            );
            let top_k = s.top_k.min(i32::MAX as usize) as i32;
            self.launch(
                SAMPLE_CUT,
                grid(1, SETTLE_THREADS, 0),
                SampleCut {
                    hist_count: at(l.hist_count),
                    hist_mass: at(l.hist_mass),
                    cut: at(l.cut),
                    top_k,
                    top_p: s.top_p,
                },
            );
            self.launch(
                SAMPLE_GATHER,
                grid(blocks, SAMPLE_THREADS, 0),
                SampleGather {
                    s: at(l.s),
                    bmax: at(l.bmax),
                    cut: at(l.cut),
                    list_s: at(l.list_s),
                    list_id: at(l.list_id),
                    vocab: v,
                    chunk,
                    min_p: s.min_p,
                },
            );
            self.launch(
                SAMPLE_SETTLE,
                grid(1, SETTLE_THREADS, SETTLE_SHARED),
                SampleSettle {
                    bmax: at(l.bmax),
                    blocks: blocks as i32,
                    hist_mass: at(l.hist_mass),
                    cut: at(l.cut),
                    list_s: at(l.list_s),
                    list_id: at(l.list_id),
                    top_k,
                    top_p: s.top_p,
                },
            );
        }
        self.launch(
            SAMPLE_DRAW,
            grid(blocks, SAMPLE_THREADS, 0),
            SampleDraw {
                s: at(l.s),
                bmax: at(l.bmax),
                cut: if cuts { at(l.cut) } else { Ptr::NULL },
                step,
                out,
                out_stride: 0,
                at: 0,
                vocab: v,
                chunk,
                min_p: s.min_p,
                seed_lo: s.seed as u32,
                seed_hi: (s.seed >> 32) as u32,
                count: at(l.count),
                part: at(l.part),
                part_i: at(l.part_i),
                hist_count: if cuts { at(l.hist_count) } else { Ptr::NULL },
                hist_mass: if cuts { at(l.hist_mass) } else { Ptr::NULL },
            },
        );
    }

    /// Each row of `logits` (`[rows, vocab]`) picked by its `sampling` for the position
    /// after its `positions`, one chain of launches a row (each row's settings are its
    /// own), the tokens read back together.
    pub(super) fn sample_rows_on_device(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        sampling: &[Sampling],
        positions: &[usize],
    ) -> Vec<u32> {
        let rows = sampling.len();
        if rows == 0 {
            return Vec::new();
        }
        // Each row's step values as `launch_sample` reads them: `[token, position]`.
        let steps: Vec<u32> = positions.iter().flat_map(|&p| [0, p as u32]).collect();
        let steps = self.upload_u32(&steps);
        let mut out = ok(self.stream.alloc_zeros::<u32>(rows), "alloc");
        let (logits, steps_at, out_at) =
            (self.ptr(logits), self.ptr(&steps), self.ptr_mut(&mut out));
        for (r, s) in sampling.iter().enumerate() {
            let (row, step, token) = (
                logits.floats(r * vocab),
                steps_at.floats(2 * r),
                out_at.floats(r),
            );
            self.launch_sample(row, vocab, s, Ptr::NULL, step, token);
        }
        ok(self.stream.clone_dtoh(&out), "download")
    }

    /// `counts[t] += 1` for the token `t` whose bits are at `out`.
    pub(super) fn launch_count_token(&self, counts: Ptr, vocab: usize, out: Ptr) {
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = CountToken {
            counts,
            out,
            out_stride: 0,
            at: 0,
            vocab: vocab as i32,
        };
        self.launch(COUNT_TOKEN, one, args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_parts_do_not_overlap_and_the_sums_are_aligned() {
        for (vocab, sms) in [(1, 132), (8192, 132), (151_936, 132), (5, 1)] {
            let l = Layout::new(vocab, sms);
            assert!(l.blocks * l.chunk >= vocab && l.blocks <= 2 * sms);
            let parts = [
                (l.s, vocab),
                (l.bmax, l.blocks),
                (l.hist_mass, 2 * BINS),
                (l.hist_count, BINS),
                (l.cut, CUT_BYTES / 4),
                (l.list_s, BIN_SORT_MAX),
                (l.list_id, BIN_SORT_MAX),
                (l.count, 1),
                (l.part, l.blocks),
                (l.part_i, l.blocks),
            ];
            for (i, a) in parts.iter().enumerate() {
                assert!(a.0 + a.1 <= l.floats);
                for b in &parts[i + 1..] {
                    assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{a:?} {b:?}");
                }
            }
            assert_eq!(l.hist_mass % 2, 0);
            assert_eq!(l.cut % 2, 0);
        }
    }
}
