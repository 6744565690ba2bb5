//! The operations the forward pass is written against.
//!
//! The model code calls only these; a backend owns where tensors live (host memory,
//! device memory) and how each op runs. Tensors are flat f32 buffers in row-major
//! order; every op takes the sizes it needs explicitly, so a backend never has to
//! guess a shape. The CPU backend's reference functions are the oracle every fast
//! kernel, CPU or GPU, is compared with.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

pub mod route;
pub mod sample;

pub use cpu::Cpu;
#[cfg(feature = "cuda")]
pub use cuda::Cuda;

use crate::codec::affine::kernels::AffineView;
use crate::codec::vq::VqView;
use sample::Sampling;

/// What [`Backend::argmax_rows`] writes for a row of logits that is not all finite: no
/// token (above every vocabulary), which the decode loop reports as an error.
pub const NOT_A_TOKEN: u32 = u32::MAX;

/// A compute backend.
pub trait Backend: Send + Sync {
    /// A buffer of f32 values owned by the backend.
    type Tensor: Send + Sync;
    /// A dense weight matrix `[out_dim, in_dim]` (or an embedding table) as the backend
    /// keeps it: it may hold the values in a narrower type than f32 where that loses
    /// nothing (checkpoint weights are bf16), since decode reads every weight per token.
    type Matrix: Send + Sync;
    /// A resident set's expert slots in the backend's own memory
    /// ([`new_slots`](Self::new_slots)); [`NoSlots`] where records stay in host memory.
    type Slots: ExpertSlots;

    /// Short name for reports (`cpu`, `cpu-reference`, ...).
    fn name(&self) -> &'static str;

    /// Bytes of the backend's memory free now, where it has memory of its own to run out
    /// of (a device's); `None` (the default) where it allocates from the host.
    fn memory_free(&self) -> Option<usize> {
        None
    }

    /// Runs `f`, a forward pass or a decode on this backend, with whatever the backend
    /// keeps ready for the length of one (the CPU: its threads awake). The default just
    /// runs it.
    fn warm<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// Copies host data into a new tensor.
    fn upload(&self, data: &[f32]) -> Self::Tensor;
    /// A weight matrix of `out_dim` rows and `in_dim` columns from its row-major values.
    fn upload_matrix(&self, data: &[f32], out_dim: usize, in_dim: usize) -> Self::Matrix;
    /// A new tensor of `len` elements whose contents are unspecified until written.
    fn alloc(&self, len: usize) -> Self::Tensor;
    /// A new tensor of `len` zeros.
    fn zeros(&self, len: usize) -> Self::Tensor;
    /// Copies a tensor's first `out.len()` elements to the host.
    fn download(&self, t: &Self::Tensor, out: &mut [f32]);

    /// `out[r] = table[ids[r]]`, rows of width `dim`; a coded table decodes only the rows
    /// looked up.
    fn embed(
        &self,
        table: Weight<'_, Self::Matrix>,
        dim: usize,
        ids: &[u32],
        out: &mut Self::Tensor,
    );

    /// RMSNorm of each row of width `dim`: `x * rsqrt(mean(x²) + eps) * w`, for the first
    /// `rows` rows.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Tensor,
    );
    /// RMSNorm in place (q/k normalisation).
    fn rms_norm_inplace(
        &self,
        x: &mut Self::Tensor,
        w: &Self::Tensor,
        rows: usize,
        dim: usize,
        eps: f32,
    );

    /// `out[r, o] = Σ_i x[r, i] · w[o, i]` for `rows` rows: `x` is `[rows, in_dim]`,
    /// `w` is `[out_dim, in_dim]` as checkpoints store linear layers.
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Matrix,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut Self::Tensor,
    );
    /// The same product with `w` an affine-quantized matrix (4, 3 or 2 bits) read in
    /// place from an expert store. `x` has `in_dim` columns; when the stored matrix is
    /// wider (its columns padded to whole quantization groups), `x` is read as if padded
    /// with zeros.
    fn matmul_affine(
        &self,
        x: &Self::Tensor,
        w: &AffineView<'_>,
        rows: usize,
        in_dim: usize,
        out: &mut Self::Tensor,
    );

    /// The same product with `w` a matrix of the VQ ladder: `x` is `[rows, w.cols]`,
    /// `out` `[rows, w.rows]`.
    fn matmul_vq(&self, x: &Self::Tensor, w: &VqView<'_>, rows: usize, out: &mut Self::Tensor);

    /// `out = x Wᵀ` for a weight in any form.
    fn linear(
        &self,
        x: &Self::Tensor,
        w: Weight<'_, Self::Matrix>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut Self::Tensor,
    ) {
        match w {
            Weight::Dense(t) => self.matmul(x, t, rows, in_dim, out_dim, out),
            Weight::Affine(v) => self.matmul_affine(x, &v, rows, in_dim, out),
            Weight::Vq(v) => {
                debug_assert_eq!(v.cols, in_dim);
                self.matmul_vq(x, &v, rows, out)
            }
        }
    }

    /// A product per head: `out[r, h·n + o] = Σ_i x[r, h·k + i] · ws[h][o, i]` for `rows`
    /// rows of `ws.len()` heads, each weight `[n, k]` (latent attention's absorbed
    /// up-projections). The default gathers each head's rows (a row of `x` read as
    /// `heads` rows of `k`) and runs one [`matmul`](Self::matmul) per head.
    fn matmul_heads(
        &self,
        x: &Self::Tensor,
        ws: &[Self::Matrix],
        rows: usize,
        k: usize,
        n: usize,
        out: &mut Self::Tensor,
    ) {
        matmul_heads_one_by_one(self, x, ws, rows, k, n, out);
    }

    /// Three products of the same `x` (a layer's q, k and v projections):
    /// `outs[j] = x ws[j]ᵀ`, `out_dims[j]` wide. The default is three
    /// [`linear`](Self::linear) calls; a backend may run them as one launch.
    #[allow(clippy::too_many_arguments)]
    fn linear3(
        &self,
        x: &Self::Tensor,
        ws: [Weight<'_, Self::Matrix>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut Self::Tensor; 3],
    ) {
        for ((w, d), out) in ws.into_iter().zip(out_dims).zip(outs) {
            self.linear(x, w, rows, in_dim, d, out);
        }
    }

    /// `x[r, :] += bias` for the first `rows` rows of width `bias.len()`.
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor, rows: usize);
    /// `x[..n] += y[..n]`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor, n: usize);
    /// A residual add and the norm that reads its result: `x += delta` on the first
    /// `rows` rows of width `dim`, then [`rms_norm`](Self::rms_norm) of `x` into `out`.
    /// The default is those two ops; a backend may do both in one pass.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        delta: &Self::Tensor,
        w: &Self::Tensor,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Tensor,
    ) {
        self.add(x, delta, rows * dim);
        self.rms_norm(x, w, rows, dim, eps, out);
    }
    /// The residual add and norm of [`AddNorm`] out of place: `sum = x + delta` and
    /// `out = rms_norm(sum)` on `rows` rows of `dim`, `x` left as it is; without a delta,
    /// `out = rms_norm(x)` and `sum` is not written. The default is a copy and
    /// [`add_rms_norm`](Self::add_rms_norm).
    fn add_rms_norm_to(
        &self,
        n: AddNorm<'_, Self::Tensor>,
        rows: usize,
        dim: usize,
        sum: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        match n.delta {
            Some(delta) => {
                self.write_rows(n.x, sum, 0, rows, dim);
                self.add_rms_norm(sum, delta, n.w, rows, dim, n.eps, out);
            }
            None => self.rms_norm(n.x, n.w, rows, dim, n.eps, out),
        }
    }

    /// [`linear3`](Self::linear3) of the norm [`add_rms_norm_to`](Self::add_rms_norm_to)
    /// makes (into `sum` and `xn`, `in_dim` wide). The default is those two ops; a
    /// backend may fold the add and the norm into the products' reading of their input,
    /// and then `xn` holds nothing.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_linear3(
        &self,
        n: AddNorm<'_, Self::Tensor>,
        sum: &mut Self::Tensor,
        xn: &mut Self::Tensor,
        ws: [Weight<'_, Self::Matrix>; 3],
        rows: usize,
        in_dim: usize,
        out_dims: [usize; 3],
        outs: [&mut Self::Tensor; 3],
    ) {
        self.add_rms_norm_to(n, rows, in_dim, sum, xn);
        self.linear3(xn, ws, rows, in_dim, out_dims, outs);
    }

    /// [`linear`](Self::linear) of the norm [`add_rms_norm_to`](Self::add_rms_norm_to)
    /// makes, as [`add_rms_norm_linear3`](Self::add_rms_norm_linear3) (a model's last
    /// norm and its LM head).
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_linear(
        &self,
        n: AddNorm<'_, Self::Tensor>,
        sum: &mut Self::Tensor,
        xn: &mut Self::Tensor,
        w: Weight<'_, Self::Matrix>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        out: &mut Self::Tensor,
    ) {
        self.add_rms_norm_to(n, rows, in_dim, sum, xn);
        self.linear(xn, w, rows, in_dim, out_dim, out);
    }

    /// `gate[..n] = silu(gate[..n]) * up[..n]`.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor, n: usize);
    /// Clamp `x[..n]` to `[-limit, limit]`.
    fn clamp(&self, x: &mut Self::Tensor, limit: f32, n: usize);
    /// Softmax of each of the first `rows` rows of width `dim`.
    fn softmax_rows(&self, x: &mut Self::Tensor, rows: usize, dim: usize);

    /// Rotary embedding in place ("rotate half" convention): row `r` of `x` holds
    /// `heads` heads of `head_dim` values at position `positions[r]`; `inv_freq` has
    /// `head_dim / 2` entries.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &[usize],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
    );

    /// Copies `rows` rows of width `width` from `src` into `dst` starting at row `dst_row`.
    fn write_rows(
        &self,
        src: &Self::Tensor,
        dst: &mut Self::Tensor,
        dst_row: usize,
        rows: usize,
        width: usize,
    );

    /// Causal grouped-query attention over a KV cache.
    ///
    /// `q` is `[rows, heads * head_dim]` for positions `pos0 .. pos0 + rows`; the caches
    /// are `[ctx, kv_heads * head_dim]` and already hold positions `0 .. pos0 + rows`.
    /// Query head `h` reads kv head `h / (heads / kv_heads)`. With a window `w`, position
    /// `p` sees keys `p - w + 1 ..= p`. Scores are scaled by `1 / sqrt(head_dim)`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Tensor,
        v_cache: &Self::Tensor,
        shape: AttentionShape,
        out: &mut Self::Tensor,
    );

    /// Attention of `shape.rows` query rows that each belong to a different sequence:
    /// row `r`'s key and value (rows of `k`, `v`) go to position `positions[r]` of its own
    /// caches `k_caches[r]`, `v_caches[r]`, and its query attends to their first
    /// `positions[r] + 1` positions, as [`attention`](Self::attention) of one row does.
    /// The default is one `attention` a row, through row copies.
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        positions: &[usize],
        k_caches: &mut [&mut Self::Tensor],
        v_caches: &mut [&mut Self::Tensor],
        shape: AttentionShape,
        out: &mut Self::Tensor,
    ) {
        let (qd, kvd) = (
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        let (mut qr, mut kr, mut vr) = (self.alloc(qd), self.alloc(kvd), self.alloc(kvd));
        let mut or = self.alloc(qd);
        for (r, &pos) in positions.iter().enumerate().take(shape.rows) {
            let row = [r as u32];
            self.gather_rows(q, &row, qd, &mut qr);
            self.gather_rows(k, &row, kvd, &mut kr);
            self.gather_rows(v, &row, kvd, &mut vr);
            self.write_rows(&kr, k_caches[r], pos, 1, kvd);
            self.write_rows(&vr, v_caches[r], pos, 1, kvd);
            let one = AttentionShape {
                rows: 1,
                pos0: pos,
                ..shape
            };
            self.attention(&qr, k_caches[r], v_caches[r], one, &mut or);
            self.write_rows(&or, out, r, 1, qd);
        }
    }

    /// `dst[r] = src[rows[r]]` for rows of width `width`.
    fn gather_rows(&self, src: &Self::Tensor, rows: &[u32], width: usize, dst: &mut Self::Tensor);
    /// `dst[rows[r]] += scales[r] · src[r]` for rows of width `width`.
    fn scatter_add_rows(
        &self,
        src: &Self::Tensor,
        rows: &[u32],
        scales: &[f32],
        width: usize,
        dst: &mut Self::Tensor,
    );

    /// SwiGLU experts, each on its own rows of `x` (`[*, hidden]`): for every group,
    /// `out[rows[r]] += weights[r] · down(silu(gate(x[rows[r]])) ⊙ up(x[rows[r]]))`.
    ///
    /// This is the whole MoE dispatch in one call, so a backend can run the groups
    /// concurrently or as one grouped kernel. The default runs them one after another
    /// through the single ops above.
    fn swiglu_groups(
        &self,
        x: &Self::Tensor,
        hidden: usize,
        groups: &[SwiGluGroup<'_, Self::Matrix>],
        out: &mut Self::Tensor,
    ) {
        swiglu_groups_one_by_one(self, x, hidden, groups, out);
    }

    /// Copies host data into an existing tensor, in place where the backend can (so a
    /// recorded step that reads the tensor sees the new values).
    fn upload_into(&self, data: &[f32], t: &mut Self::Tensor) {
        *t = self.upload(data);
    }

    /// [`embed`](Self::embed) of one token whose id is stored, as `u32` bits, in `step[0]`.
    fn embed_at(
        &self,
        table: Weight<'_, Self::Matrix>,
        dim: usize,
        step: &Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        let [id, _] = self.step_values(step);
        self.embed(table, dim, &[id], out);
    }

    /// [`rope`](Self::rope) of one row at the position stored, as `u32` bits, in `step[1]`.
    fn rope_at(
        &self,
        x: &mut Self::Tensor,
        step: &Self::Tensor,
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
    ) {
        let [_, pos] = self.step_values(step);
        self.rope(x, &[pos as usize], heads, head_dim, inv_freq);
    }

    /// Row 0 of `src` copied to row `step[1]` of `dst`.
    fn write_row_at(
        &self,
        src: &Self::Tensor,
        dst: &mut Self::Tensor,
        step: &Self::Tensor,
        width: usize,
    ) {
        let [_, pos] = self.step_values(step);
        self.write_rows(src, dst, pos as usize, 1, width);
    }

    /// What a one-row decode step does between the q/k/v products and attention, at the
    /// position `step[1]`: with `norm`, per-head RMSNorm of `q` (`shape.heads` heads) and
    /// `k` (`shape.kv_heads`) in place; RoPE of both; then `k` and `v` copied to that row
    /// of `k_cache` and `v_cache`. `shape` gives the head counts and width (its rows,
    /// position and window are not read). The default is those ops one after another
    /// ([`attention_preamble_one_by_one`]); a backend may do them in one launch.
    #[allow(clippy::too_many_arguments)]
    fn attention_preamble_at(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        norm: Option<HeadNorm<'_, Self::Tensor>>,
        shape: AttentionShape,
        inv_freq: &[f32],
        step: &Self::Tensor,
        k_cache: &mut Self::Tensor,
        v_cache: &mut Self::Tensor,
    ) {
        attention_preamble_one_by_one(self, q, k, v, norm, shape, inv_freq, step, k_cache, v_cache);
    }

    /// A one-row decode step's attention with its preamble: what
    /// [`attention_preamble_at`](Self::attention_preamble_at) does to the caches, then
    /// [`attention_at`](Self::attention_at) of the normed and rotated `q` into `out`.
    /// `q` and `k` are scratch afterwards: a backend may leave them as they were. The
    /// default is the two ops; a backend may do them in one launch.
    #[allow(clippy::too_many_arguments)]
    fn attention_step_at(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        norm: Option<HeadNorm<'_, Self::Tensor>>,
        shape: AttentionShape,
        inv_freq: &[f32],
        step: &Self::Tensor,
        k_cache: &mut Self::Tensor,
        v_cache: &mut Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        self.attention_preamble_at(q, k, v, norm, shape, inv_freq, step, k_cache, v_cache);
        self.attention_at(q, k_cache, v_cache, shape, step, out);
    }

    /// [`attention`](Self::attention) of one query row at the position `step[1]`
    /// (`shape.pos0` is ignored).
    fn attention_at(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Tensor,
        v_cache: &Self::Tensor,
        shape: AttentionShape,
        step: &Self::Tensor,
        out: &mut Self::Tensor,
    ) {
        let [_, pos] = self.step_values(step);
        let shape = AttentionShape {
            rows: 1,
            pos0: pos as usize,
            ..shape
        };
        self.attention(q, k_cache, v_cache, shape, out);
    }

    /// The index of each of the first `rows` rows' largest value (the lowest on ties),
    /// stored as `u32` bits in `out[at + r]`; the other values of `out` are kept. A row
    /// holding a NaN or an infinity has no largest value: its index is [`NOT_A_TOKEN`].
    fn argmax_rows(
        &self,
        x: &Self::Tensor,
        rows: usize,
        dim: usize,
        out: &mut Self::Tensor,
        at: usize,
    ) {
        let mut host = vec![0.0f32; rows * dim];
        self.download(x, &mut host);
        let mut o = vec![0.0f32; at + rows];
        self.download(out, &mut o);
        for r in 0..rows {
            let row = &host[r * dim..(r + 1) * dim];
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = i;
                }
            }
            let best = if row.iter().all(|v| v.is_finite()) {
                best as u32
            } else {
                NOT_A_TOKEN
            };
            o[at + r] = f32::from_bits(best);
        }
        self.upload_into(&o, out);
    }

    /// The next token of a decode step picked from `logits` (`[V]`) by `s`, its id's bits
    /// written to `out[at]` (the other values of `out` are kept): the draw is the one for
    /// the position after `step[1]`, the penalties read `counts` (`[V]`, each token's
    /// occurrences in the sequence) as [`sample::sample`] defines. The default reads them
    /// back and picks on the host; a backend whose [`samples_on_device`] is true does it
    /// without the host, so that a step that samples can be recorded.
    ///
    /// [`samples_on_device`]: Self::samples_on_device
    #[allow(clippy::too_many_arguments)]
    fn sample_at(
        &self,
        logits: &Self::Tensor,
        vocab: usize,
        s: &Sampling,
        counts: Option<&Self::Tensor>,
        step: &Self::Tensor,
        out: &mut Self::Tensor,
        at: usize,
    ) {
        let mut l = vec![0.0f32; vocab];
        self.download(logits, &mut l);
        let counts: Vec<u32> = counts.map_or_else(Vec::new, |c| {
            let mut v = vec![0.0f32; vocab];
            self.download(c, &mut v);
            v.iter().map(|&n| n as u32).collect()
        });
        let [_, pos] = self.step_values(step);
        let token = sample::sample(&l, &counts, s, pos as u64 + 1);
        let mut o = vec![0.0f32; at + 1];
        self.download(out, &mut o);
        o[at] = f32::from_bits(token);
        self.upload_into(&o, out);
    }

    /// The next token of each of several sequences decoded together: row `r` of `logits`
    /// (`[rows, V]`) picked by `sampling[r]` for the position after `positions[r]`, the
    /// penalties counting `held[r]` (the tokens the sequence holds), as
    /// [`sample::sample`] defines. The default reads the logits back and picks on the
    /// host; a backend that samples on the device reads back only the tokens.
    fn sample_rows(
        &self,
        logits: &Self::Tensor,
        vocab: usize,
        sampling: &[Sampling],
        positions: &[usize],
        held: &[&[u32]],
    ) -> Vec<u32> {
        let mut l = vec![0.0f32; sampling.len() * vocab];
        self.download(logits, &mut l);
        sample::sample_rows(&l, vocab, sampling, positions, held)
    }

    /// Whether [`sample_at`](Self::sample_at) and [`count_token`](Self::count_token) run
    /// without the host.
    fn samples_on_device(&self) -> bool {
        false
    }

    /// `counts[t] += 1` for the token `t` whose bits are at `chosen[at]` (where
    /// [`sample_at`](Self::sample_at) left it). The default goes through the host.
    fn count_token(
        &self,
        counts: &mut Self::Tensor,
        vocab: usize,
        chosen: &Self::Tensor,
        at: usize,
    ) {
        let mut c = vec![0.0f32; at + 1];
        self.download(chosen, &mut c);
        let mut n = vec![0.0f32; vocab];
        self.download(counts, &mut n);
        n[c[at].to_bits() as usize] += 1.0;
        self.upload_into(&n, counts);
    }

    /// Readies a decode step tensor for the next step without the host: `step[0]` takes
    /// the token whose bits are at `chosen[at]` (where [`argmax_rows`](Self::argmax_rows)
    /// left it) and `step[1]` the position after its own. As the last op of a recorded
    /// step it lets the record be replayed again at once, each replay reading what the
    /// one before left. The default goes through the host, so a backend that records
    /// steps ([`replay_step`](Self::replay_step)) has its own.
    fn advance_step(&self, step: &mut Self::Tensor, chosen: &Self::Tensor, at: usize) {
        let [_, pos] = self.step_values(step);
        let mut c = vec![0.0f32; at + 1];
        self.download(chosen, &mut c);
        self.upload_into(&[c[at], f32::from_bits(pos.wrapping_add(1))], step);
    }

    /// Starts copying `t`'s first `len` values to the host, behind every op queued so
    /// far, and returns without waiting for them; [`finish_read`](Self::finish_read)
    /// hands them over. Later ops may overwrite `t` at once: the read has its own copy.
    /// The default is a plain [`download`](Self::download), done before it returns.
    fn read_async(&self, t: &Self::Tensor, len: usize) -> PendingRead {
        let mut values = vec![0.0f32; len];
        self.download(t, &mut values);
        PendingRead::ready(values)
    }

    /// The values of a read this backend started with [`read_async`](Self::read_async),
    /// waiting for that copy alone (not for ops queued after it).
    fn finish_read(&self, read: PendingRead) -> Vec<f32> {
        match read.into_values() {
            Ok(values) => values,
            Err(_) => panic!(
                "{}: a read that was not started by this backend",
                self.name()
            ),
        }
    }

    /// The two `u32` values of a decode step tensor (token, position).
    fn step_values(&self, step: &Self::Tensor) -> [u32; 2] {
        let mut v = [0.0f32; 2];
        self.download(step, &mut v);
        [v[0].to_bits(), v[1].to_bits()]
    }

    /// Runs `body`, a decode step whose per-call values all live in device memory, so that
    /// the backend may record it once under `key` and replay the record on later calls
    /// with the same key instead of calling `body`. `body` returns whether it kept to
    /// that (queued no host copies, allocated nothing); a backend records only then and
    /// otherwise runs it as it is. Returns whether the step ran from a record. The default
    /// calls `body`.
    fn replay_step(&self, key: (usize, u64), body: &mut dyn FnMut() -> bool) -> bool {
        let _ = key;
        body();
        false
    }

    /// A whole routed MoE block without a host round trip, of the rows `x` reads
    /// (with [`MoeInput::AddNorm`], after writing them): router logits `x · gateᵀ`,
    /// their softmax written to `probs[probs_at .. probs_at + rows · E]` (unmasked), the
    /// top-k experts of each row among those `route.keep` marks, and
    /// `out[r] = Σ_k w_k · expert_k(x[r])` (overwritten, not added to).
    ///
    /// Returns `false`, having done nothing, when the backend has no such path for these
    /// experts or this many rows; the caller then routes on the host. The default has none.
    #[allow(clippy::too_many_arguments)]
    fn routed_moe(
        &self,
        x: MoeInput<'_, Self::Tensor>,
        rows: usize,
        hidden: usize,
        gate: &Self::Matrix,
        experts: &RoutedExperts<'_, Self::Matrix>,
        route: DeviceRoute<'_>,
        probs: &mut Self::Tensor,
        probs_at: usize,
        out: &mut Self::Tensor,
    ) -> bool {
        let _ = (x, rows, hidden, gate, experts, route, probs, probs_at, out);
        false
    }

    /// `count` slots for records of `format` (an affine or VQ store's) in the backend's
    /// memory, routing `top_k` of `experts` experts a token, none of them resident yet;
    /// `None` when the backend keeps a resident set's records in host memory (the
    /// default) or cannot route these on the device.
    fn new_slots(
        &self,
        format: &crate::store::records::RecordFormat,
        experts: usize,
        top_k: usize,
        count: usize,
    ) -> Option<Self::Slots> {
        let _ = (format, experts, top_k, count);
        None
    }

    /// [`routed_moe`](Self::routed_moe) over the experts resident in `slots`: routing is
    /// confined to them (`route.keep` is ignored), their weights read from the slots as
    /// last [`flush`](ExpertSlots::flush)ed. Any number of rows. Returns `false`, having
    /// done nothing, where the backend has no such path (the default).
    #[allow(clippy::too_many_arguments)]
    fn routed_moe_slots(
        &self,
        x: MoeInput<'_, Self::Tensor>,
        rows: usize,
        hidden: usize,
        gate: &Self::Matrix,
        slots: &Self::Slots,
        route: DeviceRoute<'_>,
        probs: &mut Self::Tensor,
        probs_at: usize,
        out: &mut Self::Tensor,
    ) -> bool {
        let _ = (x, rows, hidden, gate, slots, route, probs, probs_at, out);
        false
    }
}

/// A read of a tensor on its way to the host, from [`Backend::read_async`]: the values
/// themselves, or whatever the backend that started the copy needs to find them once it
/// lands. Dropping it unfinished is allowed (the backend's handle waits for its copy
/// before its buffer goes).
#[must_use = "a read's values come from Backend::finish_read"]
pub struct PendingRead(Pending);

enum Pending {
    Ready(Vec<f32>),
    Queued(Box<dyn std::any::Any + Send>),
}

impl PendingRead {
    /// A read whose values are already on the host.
    pub fn ready(values: Vec<f32>) -> PendingRead {
        PendingRead(Pending::Ready(values))
    }

    /// A read still under way, known to the backend that started it by `handle`.
    pub fn queued(handle: Box<dyn std::any::Any + Send>) -> PendingRead {
        PendingRead(Pending::Queued(handle))
    }

    /// The values of a [`ready`](Self::ready) read, or the handle of a
    /// [`queued`](Self::queued) one.
    pub fn into_values(self) -> Result<Vec<f32>, Box<dyn std::any::Any + Send>> {
        match self.0 {
            Pending::Ready(v) => Ok(v),
            Pending::Queued(h) => Err(h),
        }
    }
}

/// A resident set's expert records in a backend's own memory (device memory on a GPU).
///
/// Records are copied in on a stream of their own while tokens run; an expert is routed
/// to a slot only once [`assign`](Self::assign)ed and [`flush`](Self::flush)ed, which the
/// resident set does at a token boundary after [`loaded`](Self::loaded) says the copy has
/// landed. So no token waits for a copy, and none reads a half-written slot.
pub trait ExpertSlots: Send {
    /// Page-locks `buf` for as long as these slots live, so that loads from it are
    /// asynchronous copies; `buf` must outlive the slots and never move.
    fn pin(&mut self, buf: &mut [u32]);
    /// Starts copying `record` into `slot`, behind all work issued so far (so a slot whose
    /// expert was unassigned at this boundary is no longer being read). `record` must
    /// stay unchanged until [`loaded`](Self::loaded) says so.
    fn load(&mut self, slot: usize, record: &[u32]);
    /// Whether the last load into `slot` has landed (never waits).
    fn loaded(&self, slot: usize) -> bool;
    /// Blocks until every load has landed.
    fn wait(&self);
    /// Routes expert `expert` to `slot` (`None`: not resident, never chosen), from the
    /// next [`flush`](Self::flush) on.
    fn assign(&mut self, expert: usize, slot: Option<usize>);
    /// Makes the assignments visible to the work issued after this call. Not to be
    /// called while a step is being recorded.
    fn flush(&mut self);
    /// Bytes of device memory the slots and their tables take.
    fn bytes(&self) -> usize;
}

/// The slots of a backend that keeps resident records in host memory: there are none.
pub enum NoSlots {}

impl ExpertSlots for NoSlots {
    fn pin(&mut self, _: &mut [u32]) {
        match *self {}
    }
    fn load(&mut self, _: usize, _: &[u32]) {
        match *self {}
    }
    fn loaded(&self, _: usize) -> bool {
        match *self {}
    }
    fn wait(&self) {
        match *self {}
    }
    fn assign(&mut self, _: usize, _: Option<usize>) {
        match *self {}
    }
    fn flush(&mut self) {
        match *self {}
    }
    fn bytes(&self) -> usize {
        match *self {}
    }
}

/// The routed experts of one MoE block, for [`Backend::routed_moe`].
pub struct RoutedExperts<'a, T> {
    /// Identity of the block, stable for as long as its weights are (its address): what
    /// a backend keys per-block device state by. A backend confirms it against the
    /// weights' own addresses before trusting it.
    pub id: usize,
    /// Number of experts.
    pub count: usize,
    /// Gate, up and down projections of expert `e`.
    pub weights: &'a (dyn Fn(usize) -> [Weight<'a, T>; 3] + Sync),
}

/// How [`Backend::routed_moe`] picks experts: the softmax router of
/// [`crate::backend::route::route`], confined to `keep` as [`crate::backend::route::confine`] does.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRoute<'a> {
    /// Experts per row.
    pub top_k: usize,
    /// Divide the chosen probabilities by their sum.
    pub renormalize: bool,
    /// Experts routing may choose (`None`: all); at least `top_k` are marked.
    pub keep: Option<&'a [bool]>,
}

/// A residual add and the RMSNorm after it, for the op that reads the norm
/// ([`Backend::add_rms_norm_to`] and the ops built on it): `rms_norm(x + delta) · w`.
pub struct AddNorm<'a, T> {
    /// The residual before the add.
    pub x: &'a T,
    /// What the last block added to it (`None`: `x` is the residual).
    pub delta: Option<&'a T>,
    /// The norm's weights.
    pub w: &'a T,
    /// The norm's epsilon.
    pub eps: f32,
}

// Written out because a derive would require `T: Copy`; only references are copied.
impl<T> Clone for AddNorm<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for AddNorm<'_, T> {}

/// What [`Backend::routed_moe`] reads: its input rows, or one row it makes itself from
/// the residual (the post-attention norm of a decode step).
pub enum MoeInput<'a, T> {
    /// The block's input rows.
    Rows(&'a T),
    /// [`Backend::add_rms_norm_to`] of `n` into `sum` and `xn`, one row; the experts read
    /// `xn`, or, where a backend folds the norm into its router and experts, the
    /// residual through the norm, and `xn` may then hold nothing.
    AddNorm {
        /// The add and the norm.
        n: AddNorm<'a, T>,
        /// Gets `x + delta`.
        sum: &'a mut T,
        /// Gets the normed row (see above).
        xn: &'a mut T,
    },
}

/// [`Backend::matmul_heads`] from single ops: each head's rows gathered, multiplied
/// and scattered back.
pub fn matmul_heads_one_by_one<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    ws: &[B::Matrix],
    rows: usize,
    k: usize,
    n: usize,
    out: &mut B::Tensor,
) {
    let heads = ws.len();
    let (mut xh, mut yh) = (b.alloc(rows * k), b.alloc(rows * n));
    b.write_rows(&b.zeros(rows * heads * n), out, 0, rows * heads, n);
    let ones = vec![1.0f32; rows];
    for (h, w) in ws.iter().enumerate() {
        let at: Vec<u32> = (0..rows).map(|r| (r * heads + h) as u32).collect();
        b.gather_rows(x, &at, k, &mut xh);
        b.matmul(&xh, w, rows, k, n, &mut yh);
        b.scatter_add_rows(&yh, &at, &ones, n, out);
    }
}

/// The weights of a per-head q/k RMSNorm, for [`Backend::attention_preamble_at`] and
/// [`Backend::attention_step_at`].
pub struct HeadNorm<'a, T> {
    /// `[head_dim]`, applied to every query head.
    pub q: &'a T,
    /// `[head_dim]`, applied to every key head.
    pub k: &'a T,
    /// The norm's epsilon.
    pub eps: f32,
}

// Written out because a derive would require `T: Copy`; only references are copied.
impl<T> Clone for HeadNorm<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for HeadNorm<'_, T> {}

/// [`Backend::attention_preamble_at`] through the single ops.
#[allow(clippy::too_many_arguments)]
pub fn attention_preamble_one_by_one<B: Backend + ?Sized>(
    b: &B,
    q: &mut B::Tensor,
    k: &mut B::Tensor,
    v: &B::Tensor,
    norm: Option<HeadNorm<'_, B::Tensor>>,
    shape: AttentionShape,
    inv_freq: &[f32],
    step: &B::Tensor,
    k_cache: &mut B::Tensor,
    v_cache: &mut B::Tensor,
) {
    let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    if let Some(n) = norm {
        b.rms_norm_inplace(q, n.q, heads, d, n.eps);
        b.rms_norm_inplace(k, n.k, kv_heads, d, n.eps);
    }
    b.rope_at(q, step, heads, d, inv_freq);
    b.rope_at(k, step, kv_heads, d, inv_freq);
    b.write_row_at(k, k_cache, step, kv_heads * d);
    b.write_row_at(v, v_cache, step, kv_heads * d);
}

/// [`Backend::swiglu_groups`] through the single ops, one group after another.
pub fn swiglu_groups_one_by_one<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    hidden: usize,
    groups: &[SwiGluGroup<'_, B::Matrix>],
    out: &mut B::Tensor,
) {
    let rows = groups.iter().map(|g| g.rows.len()).max().unwrap_or(0);
    let width = groups.iter().map(|g| g.intermediate).max().unwrap_or(0);
    let mut xs = b.alloc(rows * hidden);
    let mut gate = b.alloc(rows * width);
    let mut up = b.alloc(rows * width);
    let mut ys = b.alloc(rows * hidden);
    for g in groups.iter().filter(|g| !g.rows.is_empty()) {
        let (n, i) = (g.rows.len(), g.intermediate);
        b.gather_rows(x, g.rows, hidden, &mut xs);
        b.linear(&xs, g.gate, n, hidden, i, &mut gate);
        b.linear(&xs, g.up, n, hidden, i, &mut up);
        b.silu_mul(&mut gate, &up, n * i);
        b.linear(&gate, g.down, n, i, hidden, &mut ys);
        b.scatter_add_rows(&ys, g.rows, g.scales, hidden, out);
    }
}

/// A weight matrix `[out_dim, in_dim]`: a dense backend matrix, or a quantized matrix read
/// in place from host memory (an expert store's mapping, or a model's own encoding).
pub enum Weight<'a, T> {
    /// A [`Backend::Matrix`].
    Dense(&'a T),
    /// Affine codes, scales and biases in host memory.
    Affine(AffineView<'a>),
    /// VQ codes and block norms in host memory.
    Vq(VqView<'a>),
}

// Written out because a derive would require `T: Copy`; only references are copied.
impl<T> Clone for Weight<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Weight<'_, T> {}

/// One expert (or dense MLP) and the rows it runs on, for [`Backend::swiglu_groups`].
pub struct SwiGluGroup<'a, T> {
    /// `[intermediate, hidden]`.
    pub gate: Weight<'a, T>,
    /// `[intermediate, hidden]`.
    pub up: Weight<'a, T>,
    /// `[hidden, intermediate]`.
    pub down: Weight<'a, T>,
    /// Width of the hidden layer.
    pub intermediate: usize,
    /// Rows of `x` routed to this expert.
    pub rows: &'a [u32],
    /// Weight of each row's output (the router's gate value).
    pub scales: &'a [f32],
}

impl<'a, T> SwiGluGroup<'a, T> {
    /// The group that runs a VQ-coded expert (gate, up, down) on `rows`.
    pub fn of_vq(
        [gate, up, down]: [crate::codec::vq::VqView<'a>; 3],
        rows: &'a [u32],
        scales: &'a [f32],
    ) -> SwiGluGroup<'a, T> {
        SwiGluGroup {
            gate: Weight::Vq(gate),
            up: Weight::Vq(up),
            down: Weight::Vq(down),
            intermediate: gate.rows,
            rows,
            scales,
        }
    }

    /// The group that runs an affine expert record (a store's, or a resident slot's) on
    /// `rows`.
    pub fn of_record(
        r: crate::store::ExpertRecord<'a>,
        rows: &'a [u32],
        scales: &'a [f32],
    ) -> SwiGluGroup<'a, T> {
        SwiGluGroup {
            gate: Weight::Affine(r.gate),
            up: Weight::Affine(r.up),
            down: Weight::Affine(r.down),
            intermediate: r.gate.rows,
            rows,
            scales,
        }
    }
}

/// The sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query rows (tokens) in this call.
    pub rows: usize,
    /// Position of the first query row; the cache holds `pos0 + rows` positions.
    pub pos0: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Sliding window, if any.
    pub window: Option<usize>,
}

impl AttentionShape {
    /// The first key position query position `p` may see.
    pub fn first_visible(&self, p: usize) -> usize {
        match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        }
    }
}
