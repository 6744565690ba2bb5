//! Attention (kernels/attention.cu): a decode step's one row split over the keys and
//! merged, grouped by KV head where the head width allows; a prompt's rows tiled, or a
//! block per (row, head) where the tiled kernel does not take the width; and a decode
//! step's preamble (head norms, RoPE and the cache write) in one kernel.

use std::sync::MutexGuard;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::launch::{kernel_args, kernel_params, Ptr};
use super::program::{builds, Builds};
use super::{cfg, ok, Cuda};
use crate::backend::{attention_preamble_one_by_one, AttentionShape, HeadNorm};

/// Pairs of a head one thread of `attn_preamble_at` rotates (its `PRE_PAIRS`).
pub(super) const PRE_PAIRS: usize = 4;
/// Query heads one block of `attention_group_*` takes (its `ATT_GROUP`).
pub(super) const ATT_GROUP: usize = 8;
/// Threads of an `attention_group_*` block (its `ATT_THREADS`).
pub(super) const ATT_THREADS: u32 = 128;
/// Keys one step of `attention_group_*`'s score pass takes per load (a block's 16 lane
/// groups): chunks are whole multiples of it.
pub(super) const ATT_STEP: usize = 16;
/// Most keys an `attention_group_*` block takes (its `ATT_CHUNK_MAX`).
pub(super) const ATT_CHUNK_MAX: usize = 256;
/// Threads of an `attention_combine` block (its `COMBINE_THREADS`).
pub(super) const COMBINE_THREADS: u32 = 512;
/// Query slots (a row and a head of a GQA group each) of an `attention_tiled_*` block
/// (its `PA_BM`).
pub(super) const PA_BM: usize = 64;
/// Keys of one tile an `attention_tiled_*` block stages (its `PA_BN`).
pub(super) const PA_BN: usize = 32;
/// Threads of an `attention_tiled_*` block (its `PA_THREADS`).
pub(super) const PA_THREADS: u32 = 256;

/// The builds of kernel `$name` for heads up to 64, 128 and 256 values wide.
macro_rules! widths {
    ($name:literal) => {
        builds!($name: 64 => "_64", 128 => "_128", 256 => "_256")
    };
}

/// The build of `kernel` (one of [`widths!`]) that takes heads of `head_dim`, if one
/// does: float4 rows up to 256.
pub(super) fn for_heads(kernel: &Builds<3>, head_dim: usize) -> Option<&'static str> {
    if head_dim == 0 || !head_dim.is_multiple_of(4) {
        return None;
    }
    let widest = match head_dim {
        1..=64 => 64,
        65..=128 => 128,
        129..=256 => 256,
        _ => return None,
    };
    kernel.get(widest)
}

pub(super) const ATTENTION_GROUP: Builds<3> = widths!("attention_group");
pub(super) const ATTENTION_TILED: Builds<3> = widths!("attention_tiled");
pub(super) const ATTENTION_GROUP_ROWS: Builds<3> = widths!("attention_group_rows");

kernel_params! {
    /// Queries and the caches of keys and values they attend to.
    Qkv => { q: Ptr, k: Ptr, v: Ptr }
}

kernel_params! {
    /// The heads of rows at `pos0 + r` (a decode step's: at `*pos_at` where non-null), over
    /// a `window` of keys (0: all).
    Heads => { pos0: i32, heads: i32, kv_heads: i32, head_dim: i32, window: i32 }
}

pub(super) const ATTENTION: &str = "attention";
kernel_args! {
    /// Causal attention, a block per (row, head).
    Attention for &[ATTENTION] => { qkv: Qkv, out: Ptr, heads: Heads }
}

pub(super) const ATTN_PREAMBLE_AT: &str = "attn_preamble_at";
kernel_args! {
    /// A decode step's head norms (`qn`, `kn`, where non-null), RoPE at `*pos` and the
    /// write of k and v into the caches at that row; with `late`, the next kernel starts
    /// only after this one's wait.
    AttnPreambleAt for &[ATTN_PREAMBLE_AT] => {
        q: Ptr, k: Ptr, v: Ptr, qn: Ptr, kn: Ptr, eps: f32, pos: Ptr, inv_freq: Ptr,
        k_cache: Ptr, v_cache: Ptr, heads: i32, kv_heads: i32, head_dim: i32, late: i32,
    }
}

pub(super) const ATTENTION_SPLIT: &str = "attention_split";
kernel_args! {
    /// One row's attention over `chunk` keys a block, a block per (head, chunk): the
    /// partial outputs `acc` and their (max, sum) `ml`.
    AttentionSplit for &[ATTENTION_SPLIT] => {
        qkv: Qkv, acc: Ptr, ml: Ptr, heads: Heads, pos_at: Ptr, chunk: i32,
    }
}

kernel_args! {
    /// [`AttentionSplit`] a block per (KV head and tile of its query heads, chunk); with
    /// `early`, loading its keys before its launch wait.
    AttentionGroup for &ATTENTION_GROUP.names => { split: AttentionSplit, early: i32 }
}

kernel_args! {
    /// [`AttentionGroup`] for several sequences, a row each (blockIdx.z): `rows` holds
    /// each row's key cache, value cache and position.
    AttentionGroupRows for &ATTENTION_GROUP_ROWS.names => {
        q: Ptr, rows: Ptr, acc: Ptr, ml: Ptr, heads: i32, kv_heads: i32, head_dim: i32,
        window: i32, chunk: i32,
    }
}

pub(super) const CACHE_WRITE_ROWS: &str = "cache_write_rows";
kernel_args! {
    /// Row r of `k` and `v` into the caches of row r of the table `rows`, at its position.
    CacheWriteRows for &[CACHE_WRITE_ROWS] => { k: Ptr, v: Ptr, rows: Ptr, kvw: i32 }
}

pub(super) const ATTENTION_COMBINE: &str = "attention_combine";
kernel_args! {
    /// Each head's `splits` partial outputs merged into `out`.
    AttentionCombine for &[ATTENTION_COMBINE] => {
        acc: Ptr, ml: Ptr, out: Ptr, splits: i32, head_dim: i32,
    }
}

kernel_args! {
    /// A prompt's attention, a block per KV head and pair of tiles of query slots.
    AttentionTiled for &ATTENTION_TILED.names => {
        qkv: Qkv, out: Ptr, rows: i32, heads: Heads,
    }
}

impl Heads {
    fn of(shape: &AttentionShape) -> Heads {
        Heads {
            pos0: shape.pos0 as i32,
            heads: shape.heads as i32,
            kv_heads: shape.kv_heads as i32,
            head_dim: shape.head_dim as i32,
            window: shape.window.map_or(0, |w| w as i32),
        }
    }
}

impl Cuda {
    /// The queries and the key and value caches, as the kernels take them.
    fn qkv(&self, [q, k, v]: [&CudaSlice<f32>; 3]) -> Qkv {
        Qkv {
            q: self.ptr(q),
            k: self.ptr(k),
            v: self.ptr(v),
        }
    }
}

/// Positions a cache of `shape`'s KV heads holds (at least 1).
fn cache_rows(cache: &CudaSlice<f32>, shape: &AttentionShape) -> usize {
    (cache.len() / (shape.kv_heads * shape.head_dim)).max(1)
}

/// Keys per block of the grouped decode attention over a cache of `capacity` positions
/// with `units` blocks per chunk (KV heads times head tiles) on `sms` multiprocessors:
/// about two blocks per multiprocessor, so a short context still fills the device and a
/// long one is not cut finer than that, in whole score steps, at most `ATT_CHUNK_MAX`.
/// It follows the capacity, not the position, so a recorded step stays valid.
fn group_chunk(capacity: usize, units: usize, sms: usize) -> usize {
    let even = (capacity * units) as f64 / (2 * sms.max(1)) as f64;
    let steps = (even / ATT_STEP as f64).round() as usize;
    (steps * ATT_STEP).clamp(ATT_STEP, ATT_CHUNK_MAX)
}

/// Dynamic shared memory of an `attention_tiled_*` block for heads of `head_dim`: the Q
/// tile and two K tiles with rows padded by a float4, two V tiles, P
/// (`[PA_BN][PA_BM + 4]`) and two floats per slot.
pub(super) fn tiled_shared(head_dim: usize) -> usize {
    let f4 = head_dim / 4;
    ((PA_BM + 2 * PA_BN) * (f4 + 1) + 2 * PA_BN * f4) * 16 + (PA_BN * (PA_BM + 4) + 2 * PA_BM) * 4
}

impl Cuda {
    /// The preamble of a one-row decode step; with `late`, the kernel lets the next one
    /// start only after its own wait (see `attn_preamble_at`). False when it went through
    /// the single ops instead (no kernel of its own, so nothing for `late` to promise).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn preamble_at(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        norm: Option<HeadNorm<'_, CudaSlice<f32>>>,
        shape: AttentionShape,
        inv_freq: &[f32],
        step: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<f32>,
        v_cache: &mut CudaSlice<f32>,
        late: bool,
    ) -> bool {
        let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let half = d / 2;
        let threads = half.next_multiple_of(32).clamp(32, 256);
        // A head the kernel's registers cannot hold (or an odd width, whose last value
        // RoPE leaves alone) goes through the single ops.
        if d % 2 != 0 || half > PRE_PAIRS * threads || heads == 0 || kv_heads == 0 {
            attention_preamble_one_by_one(
                self, q, k, v, norm, shape, inv_freq, step, k_cache, v_cache,
            );
            return false;
        }
        let freq = self.constant(inv_freq);
        let args = AttnPreambleAt {
            q: self.ptr_mut(q),
            k: self.ptr_mut(k),
            v: self.ptr(v),
            qn: norm.as_ref().map_or(Ptr::NULL, |n| self.ptr(n.q)),
            kn: norm.as_ref().map_or(Ptr::NULL, |n| self.ptr(n.k)),
            eps: norm.map_or(0.0, |n| n.eps),
            pos: self.ptr(&step.slice(1..2)),
            inv_freq: self.ptr(&*freq),
            k_cache: self.ptr_mut(k_cache),
            v_cache: self.ptr_mut(v_cache),
            heads: heads as i32,
            kv_heads: kv_heads as i32,
            head_dim: d as i32,
            late: late as i32,
        };
        let launch = cfg(heads + 2 * kv_heads, threads as u32, 0);
        self.launch(ATTN_PREAMBLE_AT, launch, args);
        true
    }

    /// Attention of a decode step's one row at the position in `step`; `early`: the
    /// kernel before is the preamble with `late` (see `attention_group`).
    pub(super) fn attention_row_at(
        &self,
        qkv: [&CudaSlice<f32>; 3],
        shape: AttentionShape,
        step: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        early: bool,
    ) {
        assert!(
            shape.head_dim <= 256,
            "head_dim {} over the attention kernel's 256",
            shape.head_dim
        );
        let at = self.ptr(&step.slice(1..2));
        let capacity = cache_rows(qkv[1], &shape);
        self.attention_one_row(self.qkv(qkv), capacity, shape, at, self.ptr_mut(out), early);
    }

    /// [`Backend::attention_rows`](crate::backend::Backend::attention_rows): row `r` of
    /// `q`, `k` and `v` (one row a sequence) at `positions[r]` against its own caches.
    /// Where the grouped kernel takes the head width, three launches for every row: a
    /// table of each row's caches and position goes up, one kernel writes each row's k
    /// and v into its caches, one attends every row over its own keys, and the combine
    /// merges all rows' heads. Otherwise a row at a time, from its place in `q` into its
    /// place in `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_of_rows(
        &self,
        [q, k, v]: [&CudaSlice<f32>; 3],
        positions: &[usize],
        k_caches: &mut [&mut CudaSlice<f32>],
        v_caches: &mut [&mut CudaSlice<f32>],
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        let (qd, kvd) = (
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        let rows = positions.len().min(shape.rows);
        if rows == 0 {
            return;
        }
        if let Some(name) = for_heads(&ATTENTION_GROUP_ROWS, shape.head_dim) {
            let mut table = Vec::with_capacity(3 * rows);
            let mut capacity = 1;
            for r in 0..rows {
                table.push(self.ptr_mut(&mut *k_caches[r]).0);
                table.push(self.ptr_mut(&mut *v_caches[r]).0);
                table.push(positions[r] as u64);
                capacity = capacity.max(cache_rows(k_caches[r], &shape));
            }
            let table = ok(self.stream.clone_htod(&table), "upload");
            let at = self.ptr(&table);
            let write = CacheWriteRows {
                k: self.ptr(k),
                v: self.ptr(v),
                rows: at,
                kvw: kvd as i32,
            };
            self.launch(CACHE_WRITE_ROWS, cfg(rows, 256, 0), write);
            let tiles = (shape.heads / shape.kv_heads).div_ceil(ATT_GROUP);
            let units = shape.kv_heads * tiles;
            let chunk = group_chunk(capacity, units * rows, self.sms);
            let splits = capacity.div_ceil(chunk);
            let heads = rows * shape.heads;
            let (_scratch, acc, ml) = self.split_parts(heads, splits, shape.head_dim);
            let grid = LaunchConfig {
                grid_dim: (units as u32, splits as u32, rows as u32),
                block_dim: (ATT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = AttentionGroupRows {
                q: self.ptr(q),
                rows: at,
                acc,
                ml,
                heads: shape.heads as i32,
                kv_heads: shape.kv_heads as i32,
                head_dim: shape.head_dim as i32,
                window: shape.window.map_or(0, |w| w as i32),
                chunk: chunk as i32,
            };
            self.launch(name, grid, args);
            let out = self.ptr_mut(out);
            self.launch_combine([acc, ml, out], heads, splits, shape.head_dim);
            // The table is freed in stream order, after the kernels that read it.
            drop(table);
            return;
        }
        let out = self.ptr_mut(out);
        for (r, &pos) in positions.iter().enumerate().take(rows) {
            let row = r * kvd..(r + 1) * kvd;
            let at = pos * kvd..(pos + 1) * kvd;
            for (src, cache) in [(k, &mut *k_caches[r]), (v, &mut *v_caches[r])] {
                let mut dst = cache.slice_mut(at.clone());
                ok(
                    self.stream.memcpy_dtod(&src.slice(row.clone()), &mut dst),
                    "copy",
                );
            }
            let one = AttentionShape {
                rows: 1,
                pos0: pos,
                ..shape
            };
            let qkv = Qkv {
                q: self.ptr(q).floats(r * qd),
                k: self.ptr(&*k_caches[r]),
                v: self.ptr(&*v_caches[r]),
            };
            let capacity = cache_rows(k_caches[r], &shape);
            self.attention_one_row(qkv, capacity, one, Ptr::NULL, out.floats(r * qd), false);
        }
    }

    /// Attention of one query row (position `pos0`, or the `u32` at `pos_at` where
    /// non-null) with the keys cut into chunks, then merged: one block per head would walk
    /// the whole context alone. A block per (KV head, chunk) where the head width allows
    /// (it reads each K and V row once for the heads that share it: 14% faster decode than
    /// a block per query head, docs/notes/gpu-02-2026-11-30-attention-and-tensor-cores.md), else a block per (head, chunk). The
    /// chunks follow the cache's capacity, not the position, so a recorded step stays
    /// valid.
    fn attention_one_row(
        &self,
        qkv: Qkv,
        capacity: usize,
        shape: AttentionShape,
        pos_at: Ptr,
        out: Ptr,
        early: bool,
    ) {
        let group = shape.heads / shape.kv_heads;
        let tiles = group.div_ceil(ATT_GROUP);
        // The grouped kernel's float4 rows need 16-byte addresses: q and the caches are
        // whole allocations (256-byte aligned), so a head width of 4s gives them.
        let grouped = for_heads(&ATTENTION_GROUP, shape.head_dim);
        let (chunk, blocks_x, threads) = match grouped {
            Some(_) => (
                group_chunk(capacity, shape.kv_heads * tiles, self.sms),
                shape.kv_heads * tiles,
                ATT_THREADS,
            ),
            None => (capacity.div_ceil(128).clamp(64, 1024), shape.heads, 128),
        };
        let splits = capacity.div_ceil(chunk);
        let (_scratch, acc, ml) = self.split_parts(shape.heads, splits, shape.head_dim);
        let grid = LaunchConfig {
            grid_dim: (blocks_x as u32, splits as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let split = AttentionSplit {
            qkv,
            acc,
            ml,
            heads: Heads::of(&shape),
            pos_at,
            chunk: chunk as i32,
        };
        match grouped {
            Some(name) => {
                let early = early as i32;
                self.launch(name, grid, AttentionGroup { split, early });
            }
            None => self.launch(ATTENTION_SPLIT, grid, split),
        }
        self.launch_combine([acc, ml, out], shape.heads, splits, shape.head_dim);
    }

    /// Where the split kernels of `heads` heads (every row's, one after another) put their
    /// `splits` partial outputs: the outputs (`[heads, splits, head_dim]`), then their
    /// (max, sum) (`[heads, splits, 2]`), in one buffer, as `attention_combine` reads them.
    /// The guard holds the buffer for the launches that use it.
    fn split_parts(
        &self,
        heads: usize,
        splits: usize,
        head_dim: usize,
    ) -> (MutexGuard<'_, Option<CudaSlice<f32>>>, Ptr, Ptr) {
        let outputs = heads * splits * head_dim;
        let mut scratch = self.grown(&self.attn_scratch, outputs + heads * splits * 2);
        let acc = self.ptr_mut(scratch.as_mut().expect("grown"));
        (scratch, acc, acc.floats(outputs))
    }

    /// Each of `heads` heads' `splits` partial outputs (`split_parts`) merged into its
    /// row of `out`.
    fn launch_combine(
        &self,
        [acc, ml, out]: [Ptr; 3],
        heads: usize,
        splits: usize,
        head_dim: usize,
    ) {
        let args = AttentionCombine {
            acc,
            ml,
            out,
            splits: splits as i32,
            head_dim: head_dim as i32,
        };
        self.launch(ATTENTION_COMBINE, cfg(heads, COMBINE_THREADS, 0), args);
    }

    /// [`Backend::attention`](crate::backend::Backend::attention): one row split over the
    /// keys; several by the tiled kernel where the head width and the shared memory the
    /// device granted allow, else a block per (row, head).
    pub(super) fn launch_attention(
        &self,
        qkv: [&CudaSlice<f32>; 3],
        shape: AttentionShape,
        out: &mut CudaSlice<f32>,
    ) {
        assert!(
            shape.head_dim <= 256,
            "head_dim {} over the attention kernel's 256",
            shape.head_dim
        );
        if shape.rows == 0 {
            return;
        }
        if shape.rows == 1 {
            let capacity = cache_rows(qkv[1], &shape);
            let (qkv, out) = (self.qkv(qkv), self.ptr_mut(out));
            self.attention_one_row(qkv, capacity, shape, Ptr::NULL, out, false);
            return;
        }
        if let Some(name) = for_heads(&ATTENTION_TILED, shape.head_dim)
            .filter(|_| shape.head_dim <= self.tiled_head_dim)
        {
            self.attention_tiled(name, self.qkv(qkv), shape, self.ptr_mut(out));
            return;
        }
        let args = Attention {
            qkv: self.qkv(qkv),
            out: self.ptr_mut(out),
            heads: Heads::of(&shape),
        };
        self.launch(ATTENTION, cfg(shape.rows * shape.heads, 128, 0), args);
    }

    /// Attention of several rows by `attention_tiled_*` (`name`): a block per KV head and
    /// pair of tiles of 64 query slots, one from each end (see the kernel). q, the caches
    /// and out are whole allocations (256-byte aligned) and the head width a multiple of 4,
    /// so their rows are float4s.
    fn attention_tiled(&self, name: &'static str, qkv: Qkv, shape: AttentionShape, out: Ptr) {
        let slots = shape.rows * (shape.heads / shape.kv_heads);
        let grid = slots.div_ceil(PA_BM).div_ceil(2) * shape.kv_heads;
        let args = AttentionTiled {
            qkv,
            out,
            rows: shape.rows as i32,
            heads: Heads::of(&shape),
        };
        let launch = cfg(grid, PA_THREADS, tiled_shared(shape.head_dim));
        self.launch(name, launch, args);
    }
}

#[cfg(test)]
mod tests {
    use super::{
        for_heads, group_chunk, tiled_shared, ATTENTION_GROUP, ATTENTION_TILED, ATT_CHUNK_MAX,
        ATT_STEP,
    };
    use crate::backend::cuda::SHARED_LIMIT;

    #[test]
    fn grouped_attention_chunks_fill_the_device_in_whole_steps() {
        // Qwen3-30B-A3B on an H200: 4 KV heads of 8 query heads, 132 multiprocessors.
        assert_eq!(group_chunk(640, 4, 132), 16);
        assert_eq!(group_chunk(4096, 4, 132), 64);
        assert_eq!(group_chunk(16, 4, 132), 16);
        assert_eq!(group_chunk(1 << 20, 4, 132), ATT_CHUNK_MAX);
        for sms in [1, 78, 132] {
            for units in [1, 2, 4, 8, 16, 64] {
                for capacity in (1..5000).step_by(7).chain([1 << 16, 1 << 20]) {
                    let chunk = group_chunk(capacity, units, sms);
                    assert!(chunk.is_multiple_of(ATT_STEP) && chunk <= ATT_CHUNK_MAX);
                    // Fewer blocks than multiprocessors only when no chunk could be smaller.
                    let blocks = units * capacity.div_ceil(chunk);
                    assert!(
                        blocks >= sms || chunk == ATT_STEP,
                        "{capacity} keys, {units} units, {sms} SMs: {blocks} blocks of {chunk}"
                    );
                }
            }
        }
    }

    #[test]
    fn grouped_attention_takes_head_widths_of_whole_float4s_up_to_256() {
        let g = |d| for_heads(&ATTENTION_GROUP, d);
        assert_eq!(g(64), Some("attention_group_64"));
        assert_eq!(g(4), Some("attention_group_64"));
        assert_eq!(g(96), Some("attention_group_128"));
        assert_eq!(g(128), Some("attention_group_128"));
        assert_eq!(g(132), Some("attention_group_256"));
        assert_eq!(g(256), Some("attention_group_256"));
        for d in [0, 2, 66, 130, 260] {
            assert_eq!(g(d), None, "{d}");
        }
    }

    #[test]
    fn tiled_attention_takes_the_grouped_widths_within_the_shared_memory_of_an_h200() {
        for d in [4, 36, 64, 96, 128, 200, 256] {
            let grouped = for_heads(&ATTENTION_GROUP, d).unwrap();
            assert_eq!(
                for_heads(&ATTENTION_TILED, d).unwrap(),
                grouped.replace("group", "tiled"),
                "{d}"
            );
        }
        for d in [0, 2, 66, 130, 260] {
            assert_eq!(for_heads(&ATTENTION_TILED, d), None, "{d}");
        }
        // 128 wide: two blocks an SM (228 KB, 1 KB reserved a block); 256: one, within
        // the 227 KB a block may opt in to.
        assert_eq!(tiled_shared(128), 109_568);
        assert!(2 * (tiled_shared(128) + 1024) <= 228 << 10);
        assert_eq!(tiled_shared(256), 207_872);
        assert!(tiled_shared(256) <= 227 << 10);
        assert!(
            tiled_shared(64) > SHARED_LIMIT,
            "every width asks for its shared memory"
        );
    }
}
