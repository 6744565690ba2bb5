//! A MoE block's experts routed on the device (kernels/routed.cu): every expert's device
//! copy in one pointer table indexed by expert id, the route read from the router's
//! output on the device, and the chosen experts' products — a decode step's on tensor
//! cores (`routed_mma_*`, which route their rows themselves), else on the row-major
//! CUDA-core kernels (affine.rs), a prompt's through the grouped GEMMs (expert_gemm.rs);
//! VQ experts through vq.rs and vq_mma.rs.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, LaunchConfig};

use super::affine::{affine_key, fingerprint, routed_shared, AffineKey, MatShape, ROUTED_ENTRY};
use super::affine_mma::{routed_mma_shared, InputNorm, RMMA_DOWN_WARPS, RMMA_ROWS, RMMA_WARPS};
use super::expert_gemm::gemm_grid_fits;
use super::launch::{kernel_args, Ptr};
use super::program::{tiled, Builds};
use super::route::ROUTE_SHARED_MAX;
use super::vq::{vq_fingerprint, vq_key, VqFingerprint, VqKey, VqRoutedShape};
use super::{driver, ok, Cuda, CudaError, CudaSlots, DeviceMatrix, SHARED_LIMIT};
use crate::backend::{DeviceRoute, MoeInput, RoutedExperts, Weight};
use crate::codec::affine::kernels::AffineView;
use crate::codec::vq::VqView;
use crate::store::records::RecordFormat;

/// The gate and up pointers of an entry a routed gate/up block copies with `early` (the
/// kernel's `GATE_UP_POINTERS`).
pub(super) const GATE_UP_POINTERS: usize = 6;
/// Most rows the routed matrix-vector kernels take: beyond, each expert's weights would
/// be read once per row, so more rows take the grouped GEMMs on tensor cores (without
/// tensor cores, the host path).
pub const ROUTED_MAX_ROWS: usize = super::affine::AFFINE_GEMM_ROWS;
/// Most rows whose affine experts take the routed kernels on tensor cores: from five rows
/// (40 pairs of Qwen3-30B-A3B's top-8), the grouped GEMMs, which read each expert once for
/// all its pairs, were faster on an H200 (8 sequences a step: 3,283 to 3,403 tok/s against
/// 2,950 to 3,092; 2 and 4 sequences slower there: docs/notes/batched-decode-2026-12-04.md).
const ROUTED_MMA_MAX_ROWS: usize = 4;
/// Most (row, expert) pairs one routed launch takes (a grid dimension holds 65 535).
const ROUTED_CHUNK_PAIRS: usize = 4096;

pub(super) const ROUTED_MMA_GATE_UP_Q3: &str = "routed_mma_gate_up_q3";
pub(super) const ROUTED_MMA_GATE_UP_TILED: Builds<2> = tiled!("routed_mma_gate_up");
pub(super) const ROUTED_MMA_DOWN_Q3: &str = "routed_mma_down_q3";
pub(super) const ROUTED_MMA_DOWN_TILED: Builds<2> = tiled!("routed_mma_down");
pub(super) const AFFINE_TILES_FROM_ROWS: &str = "affine_tiles_from_rows";

/// Each routed down kernel on tensor cores and the gate/up kernel of the same experts:
/// [`down_alone`] sets their split of L1 and shared memory together.
const ROUTED_MMA_PAIRS: [(&str, &str); 3] = [
    (ROUTED_MMA_DOWN_Q3, ROUTED_MMA_GATE_UP_Q3),
    (
        ROUTED_MMA_DOWN_TILED.names[0],
        ROUTED_MMA_GATE_UP_TILED.names[0],
    ),
    (
        ROUTED_MMA_DOWN_TILED.names[1],
        ROUTED_MMA_GATE_UP_TILED.names[1],
    ),
];

kernel_args! {
    /// A decode step's gate and up of each (row, expert) pair on tensor cores into
    /// `h = silu(gate·x) ⊙ (up·x)`. With `logits` (up to ROUTE_SHARED_MAX experts),
    /// each block routes its row itself (writing `ids` and `weights` where `ready` is
    /// non-null); with `early`, it stages x and the experts' pointers before its launch
    /// wait; with `delta`/`norm_w`, it reads x through that residual add and norm.
    RoutedMmaGateUp for &[
        ROUTED_MMA_GATE_UP_Q3, ROUTED_MMA_GATE_UP_TILED.names[0], ROUTED_MMA_GATE_UP_TILED.names[1],
    ] => {
        table: Ptr, logits: Ptr, keep: Ptr, experts: i32, renormalize: i32, ids: Ptr,
        weights: Ptr, top_k: i32, x: Ptr, h: Ptr, shape: MatShape, early: i32, delta: Ptr,
        norm_w: Ptr, eps: f32, ready: Ptr,
    }
}

kernel_args! {
    /// Down of each row's pairs, weighted and added in order into `out`; with `logits`,
    /// also the probabilities in their place (`ready`: gate/up's flag that the route is
    /// written).
    RoutedMmaDown for &[
        ROUTED_MMA_DOWN_Q3, ROUTED_MMA_DOWN_TILED.names[0], ROUTED_MMA_DOWN_TILED.names[1],
    ] => {
        table: Ptr, ids: Ptr, weights: Ptr, top_k: i32, h: Ptr, out: Ptr, shape: MatShape,
        logits: Ptr, experts: i32, ready: Ptr,
    }
}

kernel_args! {
    /// An affine matrix as stored (`words`, `scales`, `biases`) into unit tiles.
    AffineTilesFromRows for &[AFFINE_TILES_FROM_ROWS] => {
        words: Ptr, scales: Ptr, biases: Ptr, rows: i32, cols: i32, bits: i32,
        tile_words: Ptr, sb: Ptr,
    }
}

/// A routed down kernel whose blocks ask for shared memory they do not use
/// ([`down_alone`]), with the gate/up kernel of the same experts.
pub(super) struct PaddedDown {
    down: &'static str,
    gate_up: &'static str,
    bytes: usize,
}

/// The `routed_mma_down_*` kernels that ask for shared memory they do not use, so that a
/// second down block cannot land on an SM: those whose registers let two blocks share
/// an SM.
///
/// At 2 bits a 16-warp down block takes 64 registers a thread, so two fit an SM's
/// registers where at 4 bits (76) only one does; two on one SM take twice as long over
/// the products after their wait, and the layer waits for the last (docs/notes/gpu-04-2026-12-02-rounds-7-11.md).
/// A padded block asks for half of what an SM holds (each block also takes a reserve of
/// about 1 KB). Returns each padded kernel (none where the device grants less). The
/// padded kernels and the gate/up kernels of the same experts prefer all of the unified
/// L1 and shared memory as shared memory: an SM changes its split only while idle, so a
/// padded block must find the split it needs already there, beside gate/up's blocks.
/// Measured on the H200 (12-layer Qwen3-30B-A3B shape, q4 dense layers, median of
/// three): 2 bits 1 671.9 tok/s padded against 1 637.8, 4 bits (nothing padded)
/// unchanged; padding every down kernel cost 4 bits 3%, the carveout on every kernel
/// 1.3–1.6% (sixteenth round). With bf16 dense layers the blocks go unpadded at launch
/// ([`Cuda::down_padding`]).
pub(super) fn down_alone(
    ctx: &CudaContext,
    f: &HashMap<&'static str, CudaFunction>,
    optin: usize,
) -> Result<Vec<PaddedDown>, CudaError> {
    use cudarc::driver::sys::CUdevice_attribute;
    let per_sm = driver(
        ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
    )? as usize;
    let bytes = per_sm / 2;
    let mut padded = Vec::new();
    for (down, gate_up) in ROUTED_MMA_PAIRS {
        let blocks = driver(f[down].occupancy_max_active_blocks_per_multiprocessor(
            (RMMA_DOWN_WARPS * 32) as u32,
            0,
            None,
        ))?;
        if blocks < 2 || !grant_shared(f, &[down], bytes, optin) {
            continue;
        }
        for n in [down, gate_up] {
            prefer_shared(&f[n], 100)?;
        }
        padded.push(PaddedDown {
            down,
            gate_up,
            bytes,
        });
    }
    Ok(padded)
}

/// Asks for `bytes` of dynamic shared memory a block for each kernel of `names`: whether
/// every one was granted it (never more than the device's opt-in, `optin`).
pub(super) fn grant_shared(
    f: &HashMap<&'static str, CudaFunction>,
    names: &[&str],
    bytes: usize,
    optin: usize,
) -> bool {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    bytes <= optin
        && names
            .iter()
            .all(|n| f[n].set_attribute(attr, bytes as i32).is_ok())
}

/// Has `func` prefer `percent`% of the unified L1 and shared memory as shared memory.
fn prefer_shared(func: &CudaFunction, percent: usize) -> Result<(), CudaError> {
    set_carveout(func, percent as i32)
}

/// Takes back a preference of [`prefer_shared`]: the driver picks `func`'s split again.
fn leave_split_to_driver(func: &CudaFunction) -> Result<(), CudaError> {
    set_carveout(
        func,
        cudarc::driver::sys::CUshared_carveout::CU_SHAREDMEM_CARVEOUT_DEFAULT as i32,
    )
}

fn set_carveout(func: &CudaFunction, value: i32) -> Result<(), CudaError> {
    let attr =
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
    driver(func.set_attribute(attr, value))
}

/// Dynamic shared memory of a `routed_mma_gate_up_*` block with `early`: the staged units
/// and partial sums, then, 8-byte aligned, six pointers for each of `experts`, then with
/// the norm folded in (`normed` the row's width, else 0) the row through it from the next
/// 16-byte boundary.
pub(super) fn routed_mma_gate_up_shared(units: usize, experts: usize, normed: usize) -> usize {
    routed_mma_shared(units).next_multiple_of(8)
        + experts * GATE_UP_POINTERS * 8
        + if normed > 0 { normed * 4 + 16 } else { 0 }
}

/// A MoE block's experts on the device, for routing there: every expert's gate, up and
/// down pointers in one table indexed by expert id.
pub(super) struct RoutedBlock {
    table: CudaSlice<u64>,
    /// The copies the table points into, kept alive with it.
    _weights: Vec<Arc<dyn Send + Sync>>,
    /// What confirms the block's id: it is trusted only while this still matches.
    check: RoutedCheck,
    kind: RoutedKind,
    /// The expert mask last used with the block, and its device copy.
    keep: Option<(Vec<bool>, CudaSlice<u8>)>,
}

/// The shapes every expert of a block routed on the device shares.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoutedShape {
    pub bits: u32,
    /// Whether the experts' only device copy is in unit tiles
    /// ([`unit_tiles`](super::affine::unit_tiles), [`Cuda::experts_tiled`]), which the
    /// kernels named `*_tiled_q*` read; otherwise rows, as a record stores them.
    pub tiled: bool,
    /// Expert width (rows of gate and up).
    pub inter: usize,
    /// Stored columns of gate and up, and of down.
    pub up_cols: usize,
    pub down_cols: usize,
}

impl RoutedShape {
    /// The shape of `layout`'s records, if the routed kernels take it for a residual
    /// stream of `hidden`.
    pub fn of(
        bits: u32,
        inter: usize,
        up_cols: usize,
        down_cols: usize,
        hidden: usize,
    ) -> Option<Self> {
        let fits = |cols: usize| routed_shared(cols) <= SHARED_LIMIT;
        (matches!(bits, 2..=4)
            && up_cols >= hidden
            && down_cols >= inter
            && fits(up_cols)
            && fits(down_cols))
        .then_some(RoutedShape {
            bits,
            tiled: false,
            inter,
            up_cols,
            down_cols,
        })
    }

    /// The tensor-core routed kernels that read these experts: gate/up and down, 3 bits
    /// as stored, 4 and 2 bits in tiles.
    fn mma_kernels(&self) -> (&'static str, &'static str) {
        match (self.bits, self.tiled) {
            (3, false) => (ROUTED_MMA_GATE_UP_Q3, ROUTED_MMA_DOWN_Q3),
            (b, true) => (ROUTED_MMA_GATE_UP_TILED.of(b), ROUTED_MMA_DOWN_TILED.of(b)),
            (b, false) => panic!("no tensor-core routed kernel reads {b}-bit experts as stored"),
        }
    }
}

/// The codes of a block routed on the device.
#[derive(Debug, Clone, Copy)]
pub(super) enum RoutedKind {
    Affine(RoutedShape),
    Vq(VqRoutedShape),
}

/// What confirms that a block's id still names the same weights: cache key and sampled
/// words of the first and last experts' gate projections.
#[derive(Debug, Clone, PartialEq)]
enum RoutedCheck {
    Affine([(AffineKey, [u32; 3]); 2]),
    Vq([(VqKey, VqFingerprint); 2]),
}

/// One routed launch sequence: where the expert table and the mask are, and how to route.
pub(super) struct Routed<'a> {
    pub kind: RoutedKind,
    /// The `[E, ROUTED_ENTRY]` pointer table.
    pub table: Ptr,
    /// The `[E]` byte mask (null: every expert may be chosen).
    pub keep: Ptr,
    pub experts: usize,
    pub route: DeviceRoute<'a>,
    /// Whether the router was `matvec_bf16_one_late`, so the routed gate/up kernel right
    /// after it may stage x and read the table before its launch wait.
    pub router_late: bool,
    /// The residual and the norm the router folded in (`matvec_bf16_norm_one_late`,
    /// which is late too): the routed gate/up kernel reads its row through them, and
    /// nothing writes the normed row.
    pub norm: Option<(Ptr, InputNorm)>,
}

/// The rows of one routed launch sequence: `rows` input rows of `hidden` at `x`, the
/// router's logits at `probs` (`experts` a row, turned into probabilities there) and the
/// rows the experts' weighted outputs go to, `out`.
#[derive(Debug, Clone, Copy)]
pub(super) struct RoutedRows {
    pub x: Ptr,
    pub rows: usize,
    pub hidden: usize,
    pub probs: Ptr,
    pub out: Ptr,
}

/// What confirms that a block's id still names the same weights.
fn routed_check(experts: &RoutedExperts<'_, DeviceMatrix>) -> Option<RoutedCheck> {
    let gate = |e: usize| (experts.weights)(e)[0];
    match (gate(0), gate(experts.count - 1)) {
        (Weight::Affine(a), Weight::Affine(b)) => Some(RoutedCheck::Affine([
            (affine_key(&a), fingerprint(&a)),
            (affine_key(&b), fingerprint(&b)),
        ])),
        (Weight::Vq(a), Weight::Vq(b)) => Some(RoutedCheck::Vq([
            (vq_key(&a), vq_fingerprint(&a)),
            (vq_key(&b), vq_fingerprint(&b)),
        ])),
        _ => None,
    }
}

impl Cuda {
    /// Whether a decode step's affine experts of `shape`, `top_k` a row, run on tensor
    /// cores (`routed_mma_*`): tensor cores on, and their staged units within the shared
    /// memory a block takes without opting in.
    pub(super) fn routed_mma_takes(&self, shape: RoutedShape, top_k: usize) -> bool {
        let units = (shape.up_cols / 64).max(top_k * (shape.down_cols / 64));
        self.tensor_cores() && routed_mma_shared(units) <= SHARED_LIMIT
    }

    /// The device table of a block's experts, built (every expert copied to the device)
    /// the first time the block is routed here, with `top_k` experts a row, and again
    /// when its experts' layout does not suit the kernels that read a route of another
    /// `top_k` ([`experts_tiled`](Self::experts_tiled)); `None` when its experts are not
    /// affine or VQ matrices of one shape the routed kernels take.
    fn routed_block<'m>(
        &self,
        map: &'m mut HashMap<usize, RoutedBlock>,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        hidden: usize,
        top_k: usize,
    ) -> Option<&'m mut RoutedBlock> {
        let check = routed_check(experts)?;
        let stale = |b: &RoutedBlock| {
            b.check != check
                || matches!(b.kind, RoutedKind::Affine(s) if s.tiled != self.experts_tiled(s, top_k))
        };
        if map.get(&experts.id).is_some_and(stale) {
            self.drop_graphs();
            map.remove(&experts.id);
        }
        match map.entry(experts.id) {
            std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                Some(v.insert(self.build_routed(experts, hidden, top_k, check)?))
            }
        }
    }

    /// Whether a block of experts of `shape`, `top_k` a row, is held in unit tiles, its
    /// only device copy: at 4 or 2 bits where the tensor-core routed kernels take them
    /// (one to [`ROUTED_MAX_ROWS`] rows; more rows take the grouped GEMMs, which read
    /// tiles too). Measured +2.5% decode at 4 bits and, at two units a round, +4.4% at 2
    /// (docs/notes/gpu-05-2026-12-02-rounds-12-15.md, fourteenth round).
    fn experts_tiled(&self, shape: RoutedShape, top_k: usize) -> bool {
        matches!(shape.bits, 4 | 2) && self.routed_mma_takes(shape, top_k)
    }

    /// Copies every expert of a block to the device and tables their pointers: gate, up
    /// and down in turn, each as its codes, then its scales and biases (affine: in tiles,
    /// the tiles' scales and biases twice) or its norms and rotation sign bits (VQ).
    fn build_routed(
        &self,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        hidden: usize,
        top_k: usize,
        check: RoutedCheck,
    ) -> Option<RoutedBlock> {
        let mut table = Vec::with_capacity(experts.count * ROUTED_ENTRY);
        let mut weights: Vec<Arc<dyn Send + Sync>> = Vec::with_capacity(experts.count * 3);
        let kind = match (experts.weights)(0) {
            [Weight::Affine(g), Weight::Affine(_), Weight::Affine(d)] => {
                let (bits, inter, up_cols, down_cols) = (g.bits, g.rows, g.cols, d.cols);
                let mut shape = RoutedShape::of(bits, inter, up_cols, down_cols, hidden)?;
                shape.tiled = self.experts_tiled(shape, top_k);
                for e in 0..experts.count {
                    let [Weight::Affine(g), Weight::Affine(u), Weight::Affine(d)] =
                        (experts.weights)(e)
                    else {
                        return None;
                    };
                    let same = |m: &AffineView<'_>, rows: usize, cols: usize| {
                        m.bits == bits && m.rows == rows && m.cols == cols
                    };
                    if !(same(&g, inter, up_cols)
                        && same(&u, inter, up_cols)
                        && same(&d, hidden, down_cols))
                    {
                        return None;
                    }
                    for m in [g, u, d] {
                        if shape.tiled {
                            let t = self.upload_tiles(&m);
                            let sb = self.ptr(&t.sb).0;
                            table.extend([self.ptr(&t.words).0, sb, sb]);
                            weights.push(Arc::new(t));
                        } else {
                            let dev = self.device_affine(&m, false);
                            table.extend(dev.rows.addresses(&self.stream));
                            weights.push(dev);
                        }
                    }
                }
                RoutedKind::Affine(shape)
            }
            [Weight::Vq(g), Weight::Vq(_), Weight::Vq(d)] => {
                let shape = VqRoutedShape::of(&g, &d, hidden, self.vq_routed_shared)?;
                let like = |m: &VqView<'_>, n: &VqView<'_>| {
                    (m.rung, m.rows, m.cols, m.block) == (n.rung, n.rows, n.cols, n.block)
                };
                for e in 0..experts.count {
                    let [Weight::Vq(eg), Weight::Vq(eu), Weight::Vq(ed)] = (experts.weights)(e)
                    else {
                        return None;
                    };
                    if !(like(&eg, &g) && like(&eu, &g) && like(&ed, &d)) {
                        return None;
                    }
                    for m in [eg, eu, ed] {
                        let dev = self.device_vq(&m);
                        table.push(self.ptr(&dev.codes).0);
                        table.push(self.ptr(&dev.norms).0);
                        table.push(self.ptr(&dev.signs).0);
                        weights.push(dev);
                    }
                }
                RoutedKind::Vq(shape)
            }
            _ => return None,
        };
        Some(RoutedBlock {
            table: ok(self.stream.clone_htod(&table), "upload"),
            _weights: weights,
            check,
            kind,
            keep: None,
        })
    }

    /// Routes `io`'s rows and runs their experts: the route, the gate/up and down
    /// launches reading the chosen experts through `r.table`, and the weighted combine
    /// into `io.out`.
    pub(super) fn launch_routed(&self, r: &Routed<'_>, io: RoutedRows) {
        let (x, rows, hidden, probs, out) = (io.x, io.rows, io.hidden, io.probs, io.out);
        let shape = match r.kind {
            RoutedKind::Affine(shape) => shape,
            RoutedKind::Vq(shape) => {
                return self.launch_routed_vq(r, shape, io);
            }
        };
        if rows > ROUTED_MMA_MAX_ROWS
            && self.tensor_cores()
            && gemm_grid_fits(rows * r.route.top_k, r.experts)
        {
            self.launch_routed_gemm(r, shape, io);
            return;
        }
        let k = r.route.top_k;
        let (inter, pairs) = (shape.inter, rows * k);
        let scratch = self.routed_scratch_at(pairs, k, inter, hidden);
        if !self.routed_mma_takes(shape, k) {
            // Experts in tiles are held so only where routed_mma_takes them (experts_tiled).
            assert!(
                !shape.tiled,
                "experts in tiles reached the row-major routed kernels"
            );
            self.launch_routed_rows(r, shape, scratch, io);
            return;
        }
        let [ids, weights, g, ..] = scratch;
        // Up to ROUTE_SHARED_MAX experts each gate/up block routes its row itself, and
        // the down kernel writes the probabilities; beyond, the route kernel runs first
        // and `logits` is null.
        let logits = if r.experts <= ROUTE_SHARED_MAX {
            probs
        } else {
            self.launch_route(r, rows, probs, ids, weights);
            Ptr::NULL
        };
        // Only right after the late router (no route kernel in between).
        let early = r.router_late && !logits.is_null();
        // With the router's fold, gate/up reads the residual through the same norm.
        let (x, delta, norm_w, eps) = match r.norm {
            Some((residual, n)) => (residual, n.delta, n.w, n.eps),
            None => (x, Ptr::NULL, Ptr::NULL, 0.0f32),
        };
        debug_assert!(r.norm.is_none() || (early && rows == 1));
        // The flag only where a gate/up block writes the one row's route.
        let ready = if !logits.is_null() && rows == 1 {
            self.ptr(&self.down_ready)
        } else {
            Ptr::NULL
        };
        let (gate_up_name, down_name) = shape.mma_kernels();
        // Gate and up write silu(gate) ⊙ up per pair into `g`; down adds each row's
        // pairs, weighted, straight into `out`.
        let args = RoutedMmaGateUp {
            table: r.table,
            logits,
            keep: r.keep,
            experts: r.experts as i32,
            renormalize: r.route.renormalize as i32,
            ids,
            weights,
            top_k: k as i32,
            x,
            h: g,
            shape: MatShape::new(inter, shape.up_cols, hidden),
            early: early as i32,
            delta,
            norm_w,
            eps,
            ready,
        };
        let up_units = shape.up_cols / 64;
        // With the norm, the row through it after the experts' pointers.
        let shared = if early {
            routed_mma_gate_up_shared(up_units, r.experts, r.norm.map_or(0, |_| hidden))
        } else {
            routed_mma_shared(up_units)
        };
        let gate_up = LaunchConfig {
            grid_dim: (inter.div_ceil(RMMA_ROWS) as u32, pairs as u32, 1),
            block_dim: ((RMMA_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        self.launch(gate_up_name, gate_up, args);

        let args = RoutedMmaDown {
            table: r.table,
            ids,
            weights,
            top_k: k as i32,
            h: g,
            out,
            shape: MatShape::new(hidden, shape.down_cols, inter),
            logits,
            experts: r.experts as i32,
            ready,
        };
        let down_units = k * (shape.down_cols / 64);
        let padding = self.down_padding(down_name);
        let down = LaunchConfig {
            grid_dim: (hidden.div_ceil(RMMA_ROWS) as u32, rows as u32, 1),
            block_dim: ((RMMA_DOWN_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: routed_mma_shared(down_units).max(padding) as u32,
        };
        self.launch(down_name, down, args);
    }

    /// The intermediates of routing `pairs` pairs (`top_k` a row): expert ids, weights,
    /// then gate, up and down outputs, carved from one scratch buffer, each on 16 bytes
    /// for the kernels' float4 loads. The buffer is sized for at least the most rows a
    /// decode step routes, so that it is not replaced (under a recorded step) when a call
    /// with more rows follows; a larger call replaces it, which the single stream orders
    /// after every launch that read the old one.
    pub(super) fn routed_scratch_at(
        &self,
        pairs: usize,
        top_k: usize,
        inter: usize,
        hidden: usize,
    ) -> [Ptr; 5] {
        let pad = |n: usize| n.next_multiple_of(4);
        let size = |pairs: usize| 2 * pad(pairs) + 2 * pad(pairs * inter) + pairs * hidden;
        let mut scratch = self.routed_scratch.lock().expect("scratch lock");
        if scratch.as_ref().is_none_or(|s| s.len() < size(pairs)) {
            self.drop_graphs();
            let n = size(pairs.max(ROUTED_MAX_ROWS * top_k));
            *scratch = Some(ok(unsafe { self.stream.alloc::<f32>(n) }, "alloc"));
        }
        let base = self.ptr(scratch.as_ref().expect("set above"));
        let h = 2 * pad(pairs);
        [
            base,
            base.floats(pad(pairs)),
            base.floats(h),
            base.floats(h + pad(pairs * inter)),
            base.floats(h + 2 * pad(pairs * inter)),
        ]
    }

    /// [`launch_routed`](Self::launch_routed) over `rows` rows in chunks that keep the
    /// grid (a block row per pair) within bounds; `probs` holds `experts` values a row.
    fn launch_routed_chunks(&self, r: &Routed<'_>, io: RoutedRows) {
        let chunk = (ROUTED_CHUNK_PAIRS / r.route.top_k).max(1);
        for r0 in (0..io.rows).step_by(chunk) {
            let part = RoutedRows {
                x: io.x.floats(r0 * io.hidden),
                rows: chunk.min(io.rows - r0),
                hidden: io.hidden,
                probs: io.probs.floats(r0 * r.experts),
                out: io.out.floats(r0 * io.hidden),
            };
            self.launch_routed(r, part);
        }
    }

    /// Once a one-row bf16 dense product has run ([`Cuda::down_padding`]): the routed
    /// kernels that [`down_alone`] had prefer all shared memory leave the split to the
    /// driver again, as they would had they never been padded. Set on the functions, so
    /// every later launch and recorded graph takes it.
    pub(super) fn unpad_down_blocks(&self) {
        for p in &self.down_alone {
            for n in [p.down, p.gate_up] {
                ok(leave_split_to_driver(&self.k.f[n]), "a kernel's carveout");
            }
        }
    }

    /// The shared memory a routed down block of kernel `name` asks for beyond its own
    /// ([`down_alone`]). None once a dense product has run on a one-row bf16 kernel:
    /// those prefer L1 to shared memory, an SM changes its split only while idle, and a
    /// padded block then waits for its SM to empty. Measured on the H200 (12-layer
    /// Qwen3-30B-A3B shape, bf16 dense layers, 2 bits): 1 205.6 tok/s padded against
    /// 1 240.1 unpadded; padded with every kernel preferring all shared memory, 1 180.8.
    /// Dense layers in tiles run on kernels that leave the split alone, and the padding
    /// pays there. A decode step runs its attention products before its first MoE block,
    /// so the graph it records has the choice made. The preference for shared memory that
    /// the padded kernels were given at load goes at the same time
    /// ([`Cuda::unpad_down_blocks`]): kept, it left 2 bits 1.8% below no padding at all
    /// there, in one run; given up, level (1 331.4 against 1 330.8 tok/s). A bf16 LM head
    /// counts as a dense product too, so q4 dense layers under a bf16 head run unpadded
    /// once it has run.
    fn down_padding(&self, name: &str) -> usize {
        if self.bf16_one_row_dense.load(Ordering::Relaxed) {
            return 0;
        }
        self.down_alone
            .iter()
            .find(|p| p.down == name)
            .map_or(0, |p| p.bytes)
    }

    /// [`Backend::routed_moe`](crate::backend::Backend::routed_moe).
    pub(super) fn launch_routed_moe(
        &self,
        x: MoeInput<'_, CudaSlice<f32>>,
        [rows, hidden]: [usize; 2],
        gate: &DeviceMatrix,
        experts: &RoutedExperts<'_, DeviceMatrix>,
        route: DeviceRoute<'_>,
        [probs, out]: [&mut CudaSlice<f32>; 2],
        probs_at: usize,
    ) -> bool {
        let (e, k) = (experts.count, route.top_k);
        if rows == 0 || e == 0 || k == 0 || k > e || e > 4096 {
            return false;
        }
        if route.keep.is_some_and(|m| m.len() != e) {
            return false;
        }
        let mut map = self.routed.lock().expect("routed blocks lock");
        let Some(block) = self.routed_block(&mut map, experts, hidden, k) else {
            return false;
        };
        match block.kind {
            // Affine prompts take the grouped GEMMs, on tensor cores; without them each
            // expert would be read once per row, and the host path's grouped products win.
            RoutedKind::Affine(_)
                if rows > ROUTED_MAX_ROWS
                    && !(self.tensor_cores() && gemm_grid_fits(rows * k, e)) =>
            {
                return false
            }
            // VQ experts of any number of rows take the routed kernels, each pair reading
            // its expert: the host path would decode every expert to f32 for a GEMM. The
            // CUDA-core down kernel, which every shape may fall back to, holds a token's
            // top_k rows: on an H200 that is 8 rows up to 7 264 wide, not 1 536 as
            // without the opt-in (Qwen3-Coder-480B's 2 560 needs it).
            RoutedKind::Vq(shape) if shape.down_shared(k) > self.vq_routed_shared => return false,
            _ => {}
        }
        let keep = match route.keep {
            None => Ptr::NULL,
            Some(mask) => {
                if block
                    .keep
                    .as_ref()
                    .is_none_or(|(m, _)| m.as_slice() != mask)
                {
                    self.drop_graphs();
                    let bytes: Vec<u8> = mask.iter().map(|&b| b as u8).collect();
                    block.keep =
                        Some((mask.to_vec(), ok(self.stream.clone_htod(&bytes), "upload")));
                }
                let (_, dev) = block.keep.as_ref().expect("set above");
                self.ptr(dev)
            }
        };
        let routed = Routed {
            kind: block.kind,
            table: self.ptr(&block.table),
            keep,
            experts: e,
            route,
            router_late: false,
            norm: None,
        };
        // Affine prompts take the grouped GEMMs whole; VQ ones go in chunks.
        let chunked = matches!(block.kind, RoutedKind::Vq(_));
        let io = [probs, out];
        self.route_and_run(x, routed, [rows, hidden], gate, io, probs_at, chunked);
        true
    }

    /// The router's product of `x` (`rows` rows of `hidden`) into `probs` from
    /// `probs_at`, then the experts of `routed` for those rows into `out`, in grid-sized
    /// chunks where `chunked`.
    #[allow(clippy::too_many_arguments)]
    fn route_and_run(
        &self,
        x: MoeInput<'_, CudaSlice<f32>>,
        routed: Routed<'_>,
        [rows, hidden]: [usize; 2],
        gate: &DeviceMatrix,
        [probs, out]: [&mut CudaSlice<f32>; 2],
        probs_at: usize,
        chunked: bool,
    ) {
        let e = routed.experts;
        let (x, routed) = self.moe_input(x, routed, rows, hidden, gate);
        let mut logits = probs.slice_mut(probs_at..probs_at + rows * e);
        let io = RoutedRows {
            x: self.ptr(x),
            rows,
            hidden,
            probs: self.ptr_mut(&mut logits),
            out: self.ptr_mut(out),
        };
        let routed = self.launch_router(routed, gate, x, rows, hidden, &mut logits);
        if chunked {
            self.launch_routed_chunks(&routed, io);
        } else {
            self.launch_routed(&routed, io);
        }
    }

    /// [`Backend::new_slots`](crate::backend::Backend::new_slots).
    pub(super) fn make_slots(
        &self,
        format: &RecordFormat,
        [experts, top_k, count]: [usize; 3],
    ) -> Option<CudaSlots> {
        if experts == 0 || experts > 4096 || top_k == 0 || top_k > experts {
            return None;
        }
        let kind = match format {
            RecordFormat::Affine(layout) => {
                let [gate, _, down] = layout.matrices;
                let mut shape =
                    RoutedShape::of(layout.bits, gate.rows, gate.cols, down.cols, layout.hidden)?;
                shape.tiled = self.experts_tiled(shape, top_k);
                RoutedKind::Affine(shape)
            }
            // As in `routed_moe`: the CUDA-core down kernel, which every shape may fall
            // back to, holds a token's top_k rows.
            RecordFormat::Vq(layout) => {
                let shape = VqRoutedShape::of_layout(layout, self.vq_routed_shared)?;
                if shape.down_shared(top_k) > self.vq_routed_shared {
                    return None;
                }
                RoutedKind::Vq(shape)
            }
            _ => return None,
        };
        let from_rows = matches!(kind, RoutedKind::Affine(s) if s.tiled)
            .then(|| self.k.f[AFFINE_TILES_FROM_ROWS].clone());
        Some(CudaSlots::new(
            &self.stream,
            &self.copies,
            kind,
            format,
            experts,
            count,
            from_rows,
        ))
    }

    /// [`Backend::routed_moe_slots`](crate::backend::Backend::routed_moe_slots).
    pub(super) fn launch_routed_moe_slots(
        &self,
        x: MoeInput<'_, CudaSlice<f32>>,
        [rows, hidden]: [usize; 2],
        gate: &DeviceMatrix,
        slots: &CudaSlots,
        route: DeviceRoute<'_>,
        [probs, out]: [&mut CudaSlice<f32>; 2],
        probs_at: usize,
    ) -> bool {
        let (e, k) = (slots.experts(), route.top_k);
        if rows == 0 || k == 0 || k > e || e > 4096 {
            return false;
        }
        // Slots made for a route of another top_k, in tiles where the tiled kernels do not
        // take this one or in rows where they would: the routed kernels on tensor cores
        // read 4- and 2-bit experts only in tiles.
        if matches!(slots.kind, RoutedKind::Affine(s) if s.tiled != self.experts_tiled(s, k)) {
            return false;
        }
        let routed = Routed {
            kind: slots.kind,
            table: slots.table_at(),
            keep: slots.keep_at(),
            experts: e,
            route,
            router_late: false,
            norm: None,
        };
        // The routed kernels read each chosen expert once per row: fine for a decode step,
        // and for a prompt the only path that reads device slots.
        let io = [probs, out];
        self.route_and_run(x, routed, [rows, hidden], gate, io, probs_at, true);
        true
    }
}
