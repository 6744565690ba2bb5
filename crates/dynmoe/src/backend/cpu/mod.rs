//! The CPU backend: host memory, the f32 reference of every op, and fast kernels for
//! the ops that dominate time (matrix products, attention, normalisation).

pub mod fast;
pub mod reference;
pub mod timeline;

use std::sync::atomic::{AtomicBool, Ordering};

use super::{AttentionShape, Backend, SwiGluGroup, Weight};
use crate::codec::affine::kernels::{self, AffineView};
use crate::codec::vq::{self, VqView};

/// Runs `f` with the calling thread made one of the threads the CPU kernels run on, so
/// that a forward pass from it starts each parallel op itself instead of handing it to
/// the pool and sleeping until the pool is done: that hand-off is two thread switches an
/// op, which at batch 1 cost more than the ops (docs/notes/cpu-decode-2026-12-04.md).
/// For the thread that runs models (a command's main thread, a server's scheduler).
///
/// The thread joins the global pool where nothing has started it yet; otherwise it
/// starts a pool of its own of the same size, itself counted, which lasts until `f`
/// returns. A thread already in a pool just runs `f`, and so does one where no pool can
/// be built (the hand-off path, slower but the same results).
pub fn run_as_pool_thread<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let joined = rayon::ThreadPoolBuilder::new()
        .use_current_thread()
        .build_global()
        .is_ok();
    // Kept until `f` returns: dropping it ends its other threads.
    let _own = (!joined).then(|| {
        rayon::ThreadPoolBuilder::new()
            .use_current_thread()
            .build()
            .ok()
    });
    f()
}

/// Empty looks for work after which a waiting thread of [`with_warm_pool`] also offers
/// its core to the system between looks (a few microseconds of spinning).
const IDLE_SPINS: u32 = 1000;

thread_local! {
    /// Whether this thread is inside [`with_warm_pool`] already.
    static WARM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (a forward pass, a decode) with the pool's other threads looking for work
/// the whole time instead of going to sleep between ops. A pool thread with nothing to do
/// sleeps after a short wait, and waking it takes longer than a small op at batch 1, so a
/// pass of many short parallel ops would otherwise pay a wake-up for most of them (docs/
/// notes/cpu-decode-2026-12-04.md). The cost is the other cores kept busy while `f`
/// runs, which is when the work is there to take.
///
/// Only where the calling thread is in the pool ([`run_as_pool_thread`]); elsewhere, and
/// inside another call, `f` just runs.
pub fn with_warm_pool<R>(f: impl FnOnce() -> R) -> R {
    let me = rayon::current_thread_index();
    if me.is_none() || rayon::current_num_threads() < 2 || WARM.with(|w| w.get()) {
        return f();
    }
    /// Ends the waiting when `f` returns or unwinds: the scope waits for the waiters.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            WARM.with(|w| w.set(false));
        }
    }
    let done = AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| {
                // The caller may take a waiter back while it waits on its own work; and a
                // thread in a pass of its own never waits on another's, or two passes on
                // two threads could each hold the other's waiter.
                if rayon::current_thread_index() == me || WARM.with(|w| w.get()) {
                    return;
                }
                let mut idle = 0u32;
                while !done.load(Ordering::Acquire) {
                    if rayon::yield_now() == Some(rayon::Yield::Executed) {
                        idle = 0;
                    } else if idle < IDLE_SPINS {
                        idle += 1;
                        std::hint::spin_loop();
                    } else {
                        // Where there are more busy threads than cores, the others'.
                        std::thread::yield_now();
                    }
                }
            });
        }
        WARM.with(|w| w.set(true));
        let _done = Done(&done);
        f()
    })
}

/// The CPU backend. `Cpu::reference()` runs every op through the plain reference
/// loops; `Cpu::fast()` uses the threaded kernels where they exist.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    fast: bool,
}

impl Cpu {
    /// Threaded kernels (the default).
    pub fn fast() -> Cpu {
        Cpu { fast: true }
    }

    /// Plain single-threaded reference loops: the oracle.
    pub fn reference() -> Cpu {
        Cpu { fast: false }
    }
}

impl Backend for Cpu {
    type Tensor = Vec<f32>;
    type Matrix = Vec<f32>;
    type Slots = super::NoSlots;

    fn name(&self) -> &'static str {
        if self.fast {
            "cpu"
        } else {
            "cpu-reference"
        }
    }

    fn warm<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.fast {
            with_warm_pool(f)
        } else {
            f()
        }
    }

    fn upload(&self, data: &[f32]) -> Vec<f32> {
        timeline::timed("upload", || data.to_vec())
    }

    fn upload_matrix(&self, data: &[f32], out_dim: usize, in_dim: usize) -> Vec<f32> {
        timeline::timed("upload_matrix", || {
            debug_assert_eq!(data.len(), out_dim * in_dim);
            data.to_vec()
        })
    }

    fn alloc(&self, len: usize) -> Vec<f32> {
        timeline::timed("alloc", || {
            // NaN, not zero: a read of something no op wrote shows up in the output.
            vec![f32::NAN; len]
        })
    }

    fn zeros(&self, len: usize) -> Vec<f32> {
        timeline::timed("zeros", || vec![0.0; len])
    }

    fn download(&self, t: &Vec<f32>, out: &mut [f32]) {
        timeline::timed("download", || {
            out.copy_from_slice(&t[..out.len()]);
        })
    }

    fn embed(&self, table: Weight<'_, Vec<f32>>, dim: usize, ids: &[u32], out: &mut Vec<f32>) {
        timeline::timed("embed", || match table {
            Weight::Dense(t) => reference::embed(t, dim, ids, out),
            Weight::Affine(m) => {
                for (dst, &id) in out.chunks_exact_mut(dim).zip(ids) {
                    dst.copy_from_slice(&m.row(id as usize).dequantize());
                }
            }
            Weight::Vq(m) => {
                let book = vq::kernels::shipped(&m);
                for (dst, &id) in out.chunks_exact_mut(dim).zip(ids) {
                    dst.copy_from_slice(&m.row(id as usize).decode_with(book));
                }
            }
        })
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) {
        timeline::timed("rms_norm", || {
            if self.fast {
                fast::rms_norm(x, w, rows, dim, eps, out);
            } else {
                reference::rms_norm(x, w, rows, dim, eps, out);
            }
        })
    }

    fn rms_norm_inplace(&self, x: &mut Vec<f32>, w: &Vec<f32>, rows: usize, dim: usize, eps: f32) {
        timeline::timed("rms_norm_inplace", || {
            reference::rms_norm_inplace(x, w, rows, dim, eps);
        })
    }

    fn matmul(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut Vec<f32>,
    ) {
        timeline::timed_as(
            || format!("matmul {out_dim}x{in_dim} f32"),
            || {
                if self.fast {
                    crate::codec::dense::matmul(x, w, rows, in_dim, out_dim, out);
                } else {
                    reference::matmul(x, w, rows, in_dim, out_dim, out);
                }
            },
        )
    }

    fn matmul_heads(
        &self,
        x: &Vec<f32>,
        ws: &[Vec<f32>],
        rows: usize,
        k: usize,
        n: usize,
        out: &mut Vec<f32>,
    ) {
        let heads = ws.len();
        // Each head's rows gathered and multiplied on their own; the fast backend runs
        // the heads in parallel.
        let head = |(h, w): (usize, &Vec<f32>)| {
            let xh: Vec<f32> = (0..rows)
                .flat_map(|r| &x[(r * heads + h) * k..(r * heads + h + 1) * k])
                .copied()
                .collect();
            let mut y = vec![0.0f32; rows * n];
            self.matmul(&xh, w, rows, k, n, &mut y);
            y
        };
        timeline::timed_as(
            || format!("matmul_heads {heads}x{n}x{k} f32"),
            || {
                let per_head: Vec<Vec<f32>> = if self.fast {
                    use rayon::prelude::*;
                    ws.par_iter().enumerate().map(head).collect()
                } else {
                    ws.iter().enumerate().map(head).collect()
                };
                for (h, y) in per_head.iter().enumerate() {
                    for r in 0..rows {
                        out[(r * heads + h) * n..(r * heads + h + 1) * n]
                            .copy_from_slice(&y[r * n..(r + 1) * n]);
                    }
                }
            },
        )
    }

    fn matmul_affine(
        &self,
        x: &Vec<f32>,
        w: &AffineView<'_>,
        rows: usize,
        in_dim: usize,
        out: &mut Vec<f32>,
    ) {
        timeline::timed_as(
            || format!("matmul {}x{} q{}", w.rows, w.cols, w.bits),
            || {
                if self.fast {
                    fast::matmul_affine(x, rows, in_dim, w, out, true);
                } else {
                    with_padded_columns(x, rows, in_dim, w.cols, |x| {
                        kernels::matmul_reference(x, rows, w, &mut out[..rows * w.rows])
                    });
                }
            },
        )
    }

    fn matmul_vq(&self, x: &Vec<f32>, w: &VqView<'_>, rows: usize, out: &mut Vec<f32>) {
        timeline::timed_as(
            || format!("matmul {}x{} vq", w.rows, w.cols),
            || {
                let (x, out) = (&x[..rows * w.cols], &mut out[..rows * w.rows]);
                if self.fast {
                    vq::kernels::matmul(x, rows, w, out);
                } else {
                    vq::kernels::matmul_reference(x, rows, w, out);
                }
            },
        )
    }

    fn linear3(
        &self,
        x: &Vec<f32>,
        ws: [Weight<'_, Vec<f32>>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut Vec<f32>; 3],
    ) {
        let [wq, wk, wv] = ws;
        let [oq, ok, ov] = outs;
        let one = |w, d, out: &mut Vec<f32>| self.linear(x, w, rows, in_dim, d, out);
        if self.fast {
            // Three products too small to share one by one (q, k and v at batch 1) still
            // keep two threads busy side by side.
            timeline::timed("linear3", || {
                rayon::join(
                    || one(wq, out_dims[0], oq),
                    || rayon::join(|| one(wk, out_dims[1], ok), || one(wv, out_dims[2], ov)),
                );
            })
        } else {
            one(wq, out_dims[0], oq);
            one(wk, out_dims[1], ok);
            one(wv, out_dims[2], ov);
        }
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>, rows: usize) {
        timeline::timed("add_bias", || {
            reference::add_bias(x, bias, rows);
        })
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) {
        timeline::timed("add", || {
            reference::add(&mut x[..n], &y[..n]);
        })
    }

    fn silu_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize) {
        timeline::timed("silu_mul", || {
            reference::silu_mul(&mut gate[..n], &up[..n]);
        })
    }

    fn clamp(&self, x: &mut Vec<f32>, limit: f32, n: usize) {
        timeline::timed("clamp", || {
            reference::clamp(&mut x[..n], limit);
        })
    }

    fn softmax_rows(&self, x: &mut Vec<f32>, rows: usize, dim: usize) {
        timeline::timed("softmax_rows", || {
            reference::softmax_rows(x, rows, dim);
        })
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        positions: &[usize],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
    ) {
        timeline::timed("rope", || {
            if self.fast {
                fast::rope(x, positions, heads, head_dim, inv_freq);
            } else {
                reference::rope(x, positions, heads, head_dim, inv_freq);
            }
        })
    }

    fn write_rows(
        &self,
        src: &Vec<f32>,
        dst: &mut Vec<f32>,
        dst_row: usize,
        rows: usize,
        width: usize,
    ) {
        timeline::timed("write_rows", || {
            reference::write_rows(src, dst, dst_row, rows, width);
        })
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        shape: AttentionShape,
        out: &mut Vec<f32>,
    ) {
        timeline::timed("attention", || {
            if self.fast {
                fast::attention(q, k, v, &shape, out);
            } else {
                reference::attention(q, k, v, &shape, out);
            }
        })
    }

    fn gather_rows(&self, src: &Vec<f32>, rows: &[u32], width: usize, dst: &mut Vec<f32>) {
        timeline::timed("gather_rows", || {
            reference::gather_rows(src, rows, width, dst);
        })
    }

    fn scatter_add_rows(
        &self,
        src: &Vec<f32>,
        rows: &[u32],
        scales: &[f32],
        width: usize,
        dst: &mut Vec<f32>,
    ) {
        timeline::timed("scatter_add_rows", || {
            reference::scatter_add_rows(src, rows, scales, width, dst);
        })
    }

    fn swiglu_groups(
        &self,
        x: &Vec<f32>,
        hidden: usize,
        groups: &[SwiGluGroup<'_, Vec<f32>>],
        out: &mut Vec<f32>,
    ) {
        timeline::timed_as(
            || format!("experts x{}", groups.len()),
            || {
                if self.fast {
                    fast::swiglu_groups(x, hidden, groups, out);
                } else {
                    super::swiglu_groups_one_by_one(self, x, hidden, groups, out);
                }
            },
        )
    }
}

/// Runs `f` on the first `rows` rows of `x` widened from `in_dim` to `cols` columns with
/// zeros: stored matrices pad their input dimension to whole quantization groups, and a
/// zero column contributes nothing to a product, bias term included.
pub(crate) fn with_padded_columns<R>(
    x: &[f32],
    rows: usize,
    in_dim: usize,
    cols: usize,
    f: impl FnOnce(&[f32]) -> R,
) -> R {
    if in_dim == cols {
        return f(&x[..rows * cols]);
    }
    assert!(
        in_dim < cols,
        "input of {in_dim} columns for a matrix of {cols}"
    );
    let mut padded = vec![0.0f32; rows * cols];
    for (dst, src) in padded.chunks_exact_mut(cols).zip(x.chunks_exact(in_dim)) {
        dst[..in_dim].copy_from_slice(src);
    }
    f(&padded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn warm_passes_on_several_pool_threads_finish() {
        // Passes started on every thread of one pool at once, each with parallel work
        // inside: none may wait on another's waiter.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let sums: Vec<u64> = pool.install(|| {
            (0..12u64)
                .into_par_iter()
                .map(|i| with_warm_pool(|| (0..20_000u64).into_par_iter().map(|x| x * i).sum()))
                .collect()
        });
        let each: u64 = (0..20_000u64).sum();
        assert_eq!(sums, (0..12u64).map(|i| i * each).collect::<Vec<_>>());
    }
    #[test]
    fn matmul_heads_is_each_heads_product() {
        use crate::testing::{fresh, poisoned, rel_err};
        let (rows, heads, k, n) = (5, 3, 24, 40);
        let x = fresh(rows * heads * k, 1);
        let ws: Vec<Vec<f32>> = (0..heads as u64).map(|h| fresh(n * k, 10 + h)).collect();
        let mut want = vec![0.0f32; rows * heads * n];
        for r in 0..rows {
            for (h, w) in ws.iter().enumerate() {
                let xr = &x[(r * heads + h) * k..(r * heads + h + 1) * k];
                for o in 0..n {
                    let dot: f64 = (0..k).map(|i| xr[i] as f64 * w[o * k + i] as f64).sum();
                    want[(r * heads + h) * n + o] = dot as f32;
                }
            }
        }
        for b in [Cpu::reference(), Cpu::fast()] {
            let mut got = poisoned(rows * heads * n);
            b.matmul_heads(&x, &ws, rows, k, n, &mut got);
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "{}: rel err {e}", b.name());
            // The composed default other backends inherit.
            let mut got = poisoned(rows * heads * n);
            crate::backend::matmul_heads_one_by_one(&b, &x, &ws, rows, k, n, &mut got);
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "{} one by one: rel err {e}", b.name());
        }
    }
}
