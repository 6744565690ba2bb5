//! The forward pass, written once for every architecture against [`Backend`].
//!
//! One pass over the decoder layers ([`Model::run_layers`]) serves every use: a chunk of
//! tokens at consecutive positions (a prompt, a scored chunk, a probe, a residency run:
//! [`Model::forward`]) and a decode step of one token ([`Model::decode`], in [`decode`]).
//! They differ only in where the tokens' positions come from and in the fused ops a step
//! asks the backend for ([`Pass`]). Shapes in comments: `n` tokens, `h` hidden size,
//! `q`/`kv` the query and key/value widths, `E` experts, `V` vocabulary.

mod decode;

pub use super::rope::rope_inv_freq;
pub use decode::{DecodeOptions, Decoding};

use crate::checkpoint::config::{Config, QkNorm};
use crate::checkpoint::{first_non_finite, Checkpoint};
use std::collections::BTreeMap;
use std::sync::Arc;

use super::moe::{self, MoeObserver, Routing};
use super::weights::{Attention, Experts, Ffn, Layer, LayerStores, Linear, Loader};
use super::Error;
use crate::backend::{AddNorm, AttentionShape, Backend, HeadNorm, MoeInput, Weight};
use crate::residency::{self, Reservoir, ReservoirKind, Residency, ResidencyConfig, Step};
use crate::store::dense_vq::CodedLayers;
use crate::store::records::LayerSource;
use crate::store::vq_encode::VqExperts;

/// A model's weights on a backend, ready to run.
pub struct Model<B: Backend> {
    /// Resolved configuration.
    pub config: Config,
    backend: B,
    /// `[V, h]`, possibly coded (rows decoded as they are looked up).
    embed_tokens: Linear<B>,
    layers: Vec<Layer<B>>,
    /// `[h]`.
    norm: B::Tensor,
    /// `[V, h]`; `None` when tied to the embedding.
    lm_head: Option<Linear<B>>,
    /// `[head_dim / 2]` rotary inverse frequencies (zeros after `rotary_dim / 2`).
    inv_freq: Vec<f32>,
    /// The resident expert sets, shared by every sequence; `None` runs every expert.
    residency: Option<Residency<B>>,
    /// Bumped whenever routing changes (masks, resident sets), so that a decode step
    /// recorded before is never replayed after.
    epoch: u64,
}

/// Per-sequence run state: the KV cache and what the last call routed.
pub struct State<B: Backend> {
    /// Positions already in the cache.
    pub pos: usize,
    capacity: usize,
    /// Per layer `[capacity, kv]`.
    k_cache: Vec<B::Tensor>,
    v_cache: Vec<B::Tensor>,
    /// Per layer, the last call's full router probabilities `[n, E]` (empty for dense
    /// layers): the evidence calibration and the resident-set runtime work from.
    pub router_probs: Vec<Vec<f32>>,
    /// Distinguishes this state's recorded decode steps from another's.
    id: usize,
    /// Buffers of [`Model::decode`]'s steps, made on the first.
    step: Option<decode::StepBuffers<B>>,
    /// The tokens at positions `0 .. pos` (and beyond, left by a call that was rewound):
    /// what sampling penalties count.
    tokens: Vec<u32>,
    /// `[V]` how many times each token occurs in the sequence, as the backend's sampler
    /// reads them; made by the first decode that penalizes.
    counts: Option<B::Tensor>,
}

impl<B: Backend> State<B> {
    /// Forgets every cached position (a new sequence).
    pub fn clear(&mut self) {
        self.pos = 0;
    }

    /// Positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl<B: Backend> Model<B> {
    /// Builds the model from a checkpoint (and, for a converted directory, the expert
    /// store of each MoE layer), checking every tensor's shape. The MoE layers in `vq`
    /// run those VQ-encoded experts; the dense linear layers (and LM head) in `coded` run
    /// coded.
    pub fn load(
        config: Config,
        ckpt: &Checkpoint,
        stores: Option<LayerStores>,
        vq: &BTreeMap<usize, VqExperts>,
        coded: &CodedLayers,
        backend: B,
    ) -> Result<Model<B>, Error> {
        let (v, h) = (config.vocab_size, config.hidden_size);
        let ld = Loader {
            ckpt,
            stores: stores.as_ref(),
            vq,
            coded,
            backend: &backend,
            config: &config,
        };
        let embed_tokens = ld.linear("model.embed_tokens", v, h, false)?;
        let layers = (0..config.layers.len())
            .map(|i| super::weights::load_layer(&ld, i))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = ld.tensor("model.norm.weight", &[h])?;
        // Some tied checkpoints still carry lm_head.weight; the tie decides.
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(ld.linear("lm_head", v, h, false)?)
        };
        let inv_freq = super::rope::model_inv_freq(&config);
        Ok(Model {
            config,
            backend,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            residency: None,
            epoch: 0,
        })
    }

    /// Where each MoE layer's routed experts live on disk, by decoder layer.
    pub fn expert_sources(&self) -> BTreeMap<usize, LayerSource> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.mlp {
                Ffn::Moe(m) => Some((i, (*m.source).clone())),
                Ffn::Dense(_) => None,
            })
            .collect()
    }

    /// A reservoir of every routed expert of this model, in RAM or on disk.
    pub fn reservoir(&self, kind: ReservoirKind) -> Result<Arc<Reservoir>, residency::Error> {
        let encoded = self.layers.iter().position(|l| {
            matches!(&l.mlp, Ffn::Moe(m) if matches!(m.experts, Experts::Vq(VqExperts::Encoded(_))))
        });
        if let Some(layer) = encoded {
            return Err(residency::Error::Config(format!(
                "layer {layer} runs VQ experts encoded in memory, which no reservoir can \
                 read; load them from a VQ expert store (store::vq)"
            )));
        }
        Ok(Arc::new(Reservoir::open(kind, &self.expert_sources())?))
    }

    /// Resident sets for this model over `reservoir` (see [`Residency::new`]); install
    /// them with [`set_residency`](Self::set_residency).
    pub fn new_residency(
        &self,
        reservoir: Arc<Reservoir>,
        config: ResidencyConfig,
        initial: &BTreeMap<usize, Vec<u32>>,
    ) -> Result<Residency<B>, residency::Error> {
        let layers: Vec<usize> = self.config.moe_layers().collect();
        let on_device = self
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(&l.mlp, Ffn::Moe(m) if moe::routable_on_device(m)))
            .map(|(i, _)| i)
            .collect();
        Residency::new(
            &self.backend,
            reservoir,
            &layers,
            self.config.moe.num_experts,
            self.config.moe.top_k,
            config,
            initial,
            &on_device,
        )
    }

    /// Confines routing to `residency`'s sets from the next forward call on (`None`:
    /// every expert, the model's own weights). Returns the previous sets.
    pub fn set_residency(&mut self, residency: Option<Residency<B>>) -> Option<Residency<B>> {
        self.epoch += 1;
        std::mem::replace(&mut self.residency, residency)
    }

    /// Confines MoE layer `layer`'s routing to the experts marked in `keep` (a plan's
    /// static removal, no slots involved); `None` restores every expert.
    pub fn set_expert_mask(&mut self, layer: usize, keep: Option<Vec<bool>>) -> Result<(), Error> {
        let e = self.config.moe.num_experts;
        match self.layers.get_mut(layer).map(|l| &mut l.mlp) {
            Some(Ffn::Moe(m)) => {
                if let Some(k) = &keep {
                    let kept = k.iter().filter(|&&b| b).count();
                    if k.len() != e || kept < self.config.moe.top_k {
                        return Err(Error::Config(format!(
                            "layer {layer}: a mask of {} entries keeping {kept} experts; \
                             {e} entries keeping at least top-k {} are needed",
                            k.len(),
                            self.config.moe.top_k
                        )));
                    }
                }
                m.keep = keep;
                self.epoch += 1;
                Ok(())
            }
            _ => Err(Error::Config(format!("layer {layer} is not a MoE layer"))),
        }
    }

    /// Gives MoE layer `layer`'s experts shadows (every expert at a low rung): with a
    /// static mask ([`set_expert_mask`](Self::set_expert_mask)) routing is then not
    /// confined, and an expert outside the mask runs its shadow. `None` removes them.
    pub fn set_expert_shadows(
        &mut self,
        layer: usize,
        shadows: Option<VqExperts>,
    ) -> Result<(), Error> {
        match self.layers.get_mut(layer).map(|l| &mut l.mlp) {
            Some(Ffn::Moe(m)) => {
                m.shadows = shadows;
                self.epoch += 1;
                Ok(())
            }
            _ => Err(Error::Config(format!("layer {layer} is not a MoE layer"))),
        }
    }

    /// The resident sets in use.
    pub fn residency(&self) -> Option<&Residency<B>> {
        self.residency.as_ref()
    }

    /// The backend the weights live on.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The norm that reads the residual stream before decoder layer `i`: that layer's
    /// input norm, or past the last layer the final norm.
    fn norm_before(&self, i: usize) -> &B::Tensor {
        self.layers
            .get(i)
            .map_or(&self.norm, |l| &l.input_layernorm)
    }

    /// The LM head's weight: its own (possibly coded), or the embedding table it is tied to.
    fn head(&self) -> Weight<'_, B::Matrix> {
        match &self.lm_head {
            Some(l) => l.weight(),
            None => self.embed_tokens.weight(),
        }
    }

    /// Bytes of KV cache a state of `capacity` positions holds: what
    /// [`new_state`](Self::new_state) allocates for keys and values, f32, every layer.
    /// Saturates rather than overflowing.
    pub fn state_bytes(&self, capacity: usize) -> usize {
        capacity.saturating_mul(self.config.kv_cache_bytes_per_position())
    }

    /// A fresh state whose KV cache holds `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> State<B> {
        let kv = self.config.kv_dim();
        let n = self.layers.len();
        State {
            pos: 0,
            capacity,
            k_cache: (0..n).map(|_| self.backend.alloc(capacity * kv)).collect(),
            v_cache: (0..n).map(|_| self.backend.alloc(capacity * kv)).collect(),
            router_probs: vec![Vec::new(); n],
            id: {
                static NEXT: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            step: None,
            tokens: Vec::new(),
            counts: None,
        }
    }

    /// Before a call runs from mapped expert stores: each store's file unchanged since it
    /// was mapped (a file truncated or copied over in place is an error, not SIGBUS or
    /// garbage), and each layer run from an expert store checked against its records'
    /// checksums, once, the first time (docs/FORMAT.md, §7 and §13.3).
    pub fn check_stores(&self) -> Result<(), Error> {
        let mut seen: Vec<usize> = Vec::new();
        let mut first = |ptr: usize| {
            let new = !seen.contains(&ptr);
            if new {
                seen.push(ptr);
            }
            new
        };
        for layer in &self.layers {
            let Ffn::Moe(moe) = &layer.mlp else {
                continue;
            };
            match &moe.experts {
                Experts::Stored { store, layer } => {
                    if first(Arc::as_ptr(store) as usize) {
                        store.check_unchanged()?;
                    }
                    store.verify_layer(*layer)?;
                }
                Experts::Vq(VqExperts::Stored { store, layer }) => {
                    if first(Arc::as_ptr(store) as usize) {
                        store.check_unchanged()?;
                    }
                    store.verify_layer(*layer)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs `tokens` at positions `state.pos ..`, appends them to the cache, and returns
    /// the logits of tokens `logits_from ..` as `[(n - logits_from), V]`.
    pub fn forward(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        logits_from: usize,
    ) -> Result<Vec<f32>, Error> {
        self.forward_observed(state, tokens, logits_from, None)
    }

    /// [`forward`](Self::forward), showing every MoE block to `observer`.
    pub fn forward_observed(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        logits_from: usize,
        observer: Option<&mut dyn MoeObserver<B>>,
    ) -> Result<Vec<f32>, Error> {
        let b = &self.backend;
        b.warm(|| self.forward_pass(state, tokens, logits_from, observer))
    }

    fn forward_pass(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        logits_from: usize,
        observer: Option<&mut dyn MoeObserver<B>>,
    ) -> Result<Vec<f32>, Error> {
        let c = &self.config;
        let b = &self.backend;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        assert!(
            logits_from <= n,
            "logits_from {logits_from} beyond {n} tokens"
        );
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        if state.pos + n > state.capacity {
            return Err(Error::ContextOverflow {
                needed: state.pos + n,
                capacity: state.capacity,
            });
        }
        self.check_stores()?;
        let h = c.hidden_size;
        let positions: Vec<usize> = (state.pos..state.pos + n).collect();
        let mut acts = Activations::new(b, c, n, false);

        // A token boundary: loads that have arrived commit now, and the sets stay as
        // they are until this call ends.
        let mut sets = self.residency.as_ref().map(|r| r.begin(b));
        let track = sets.as_ref().is_some_and(|s| s.tracks());
        // MoE layers routed on the backend leave their probabilities here, one slice a
        // layer, read back once at the end of the call instead of once a layer. Not with
        // resident sets or an observer where the sets are not on the backend: both need
        // each layer's probabilities at once.
        let device_ok = self.residency.is_none() && observer.is_none();
        let sets_on_device = sets.as_ref().is_some_and(|s| s.any_on_device());
        let mut probs = ((device_ok || sets_on_device) && c.moe_layers().next().is_some())
            .then(|| b.alloc(self.layers.len() * n * c.moe.num_experts));
        let mut moe = MoeRun {
            sets: sets.as_mut(),
            track,
            device_ok,
            probs: probs.as_mut(),
            // A shorter borrow of the observer, as long as the others'.
            observer: match observer {
                Some(o) => Some(o),
                None => None,
            },
            routed: Vec::new(),
            host: Vec::new(),
            device_only: true,
        };
        b.embed(self.embed_tokens.weight(), h, tokens, &mut acts.x);
        let pass = Pass::Chunk {
            pos0: state.pos,
            positions: &positions,
        };
        let mut caches = Caches::One {
            k: &mut state.k_cache,
            v: &mut state.v_cache,
        };
        self.run_layers(pass, n, &mut acts, &mut caches, &mut moe);
        let MoeRun { routed, host, .. } = moe;
        state.tokens.truncate(state.pos);
        state.tokens.extend_from_slice(tokens);
        state.pos += n;
        // Rows whose logits are wanted.
        let m = n - logits_from;
        let mut out = vec![0.0f32; m * c.vocab_size];
        if m > 0 {
            // The final norm runs on every row (a row's norm reads only that row), the LM
            // head only on the rows wanted.
            let (x, xn, eps) = (&mut acts.x, &mut acts.xn, c.rms_norm_eps);
            if self.layers.is_empty() {
                b.rms_norm(x, &self.norm, n, h, eps, xn);
            } else {
                b.add_rms_norm(x, &acts.delta, &self.norm, n, h, eps, xn);
            }
            let head_in = if logits_from == 0 {
                &acts.xn
            } else {
                let rows: Vec<u32> = (logits_from as u32..n as u32).collect();
                b.gather_rows(&acts.xn, &rows, h, &mut acts.delta);
                &acts.delta
            };
            let mut logits = b.alloc(m * c.vocab_size);
            b.linear(head_in, self.head(), m, h, c.vocab_size, &mut logits);
            b.download(&logits, &mut out);
            if let Some(i) = first_non_finite(&out) {
                return Err(Error::NonFiniteLogits {
                    position: state.pos - n + logits_from + i / c.vocab_size,
                });
            }
        }
        // After the logits, which waited for the device: a copy, not a wait.
        self.read_router_probs(state, probs.as_ref(), &routed, n);
        for (i, p) in host {
            state.router_probs[i] = p;
        }
        finish_sets(sets, &state.router_probs, &routed, n, track);
        Ok(out)
    }

    /// The one pass over the decoder layers, for every use of the model: `acts.x` holds
    /// the embedded tokens on entry, and on return the residual stream before the last
    /// layer's feed-forward output, which is in `acts.delta` (the final norm adds it).
    /// MoE layers leave their router probabilities as `moe` says.
    pub(super) fn run_layers(
        &self,
        pass: Pass<'_, B::Tensor>,
        rows: usize,
        acts: &mut Activations<B::Tensor>,
        caches: &mut Caches<'_, B::Tensor>,
        moe: &mut MoeRun<'_, '_, B>,
    ) {
        for (i, layer) in self.layers.iter().enumerate() {
            self.attention_block(pass, i, layer, rows, acts, caches);
            self.feed_forward(pass, i, layer, rows, acts, moe);
        }
    }

    /// Decoder layer `i`'s attention block: the residual add of the layer before and
    /// this layer's input norm, q, k and v, their norms and clipping, RoPE, the cache,
    /// attention, and the output projection into `acts.attn_out`.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        pass: Pass<'_, B::Tensor>,
        i: usize,
        layer: &Layer<B>,
        rows: usize,
        acts: &mut Activations<B::Tensor>,
        caches: &mut Caches<'_, B::Tensor>,
    ) {
        let (c, b) = (&self.config, &self.backend);
        let (h, kv, eps) = (c.hidden_size, c.kv_dim(), c.rms_norm_eps);
        let a = &layer.self_attn;
        let ls = [&a.q_proj, &a.k_proj, &a.v_proj];
        let shape = AttentionShape {
            rows,
            pos0: 0,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.layers[i].sliding_window,
        };
        let Activations {
            x,
            x_next,
            xn,
            qs,
            ks,
            vs,
            attn,
            attn_out,
            delta,
        } = acts;
        match pass {
            Pass::Chunk { positions, .. } | Pass::Rows { positions } => {
                match i {
                    0 => b.rms_norm(x, self.norm_before(0), rows, h, eps, xn),
                    _ => b.add_rms_norm(x, delta, self.norm_before(i), rows, h, eps, xn),
                }
                let outs = [&mut *qs, &mut *ks, &mut *vs];
                match &a.mla {
                    Some(mla) => super::mla::project(b, a, mla, eps, xn, rows, outs),
                    None => {
                        let ws = ls.map(|l| l.weight());
                        let dims = ls.map(|l| l.out_dim);
                        b.linear3(xn, ws, rows, h, dims, outs);
                        qkv_biases(b, a, rows, [&mut *qs, &mut *ks, &mut *vs]);
                    }
                }
                self.qk_norm_and_clip(layer, qs, ks, vs, rows);
                b.rope(qs, positions, c.num_heads, c.head_dim, &self.inv_freq);
                b.rope(ks, positions, c.num_kv_heads, c.head_dim, &self.inv_freq);
                match (pass, caches) {
                    (Pass::Chunk { pos0, .. }, Caches::One { k, v }) => {
                        let (k_cache, v_cache) = (&mut k[i], &mut v[i]);
                        b.write_rows(ks, k_cache, pos0, rows, kv);
                        b.write_rows(vs, v_cache, pos0, rows, kv);
                        let shape = AttentionShape { pos0, ..shape };
                        b.attention(qs, k_cache, v_cache, shape, attn);
                    }
                    (_, Caches::Rows(per_row)) => {
                        let (mut kc, mut vc): (Vec<_>, Vec<_>) = per_row
                            .iter_mut()
                            .map(|(k, v)| (&mut k[i], &mut v[i]))
                            .unzip();
                        b.attention_rows(qs, ks, vs, positions, &mut kc, &mut vc, shape, attn);
                    }
                    _ => unreachable!("a chunk attends one sequence's caches, rows each their own"),
                }
            }
            Pass::Step { step } => {
                let Caches::One { k, v } = caches else {
                    unreachable!("a step runs one sequence")
                };
                let (k_cache, v_cache) = (&mut k[i], &mut v[i]);
                // The residual add is made by the products that read the norm, into
                // `x_next`; then the two swap. The first layer's norm reads the
                // embedding as it is.
                let x_next = x_next
                    .as_mut()
                    .expect("a step has a second residual buffer");
                let n = AddNorm {
                    x: &*x,
                    delta: (i > 0).then_some(&*delta),
                    w: self.norm_before(i),
                    eps,
                };
                let outs = [&mut *qs, &mut *ks, &mut *vs];
                match &a.mla {
                    Some(mla) => {
                        b.add_rms_norm_to(n, rows, h, x_next, xn);
                        super::mla::project(b, a, mla, eps, xn, rows, outs);
                    }
                    None => {
                        let ws = ls.map(|l| l.weight());
                        let dims = ls.map(|l| l.out_dim);
                        b.add_rms_norm_linear3(n, x_next, xn, ws, rows, h, dims, outs);
                        qkv_biases(b, a, rows, [&mut *qs, &mut *ks, &mut *vs]);
                    }
                }
                if i > 0 {
                    std::mem::swap(x, x_next);
                }
                // Per-head q/k norms without clipping go into the attention's own
                // preamble; any other normalisation or clipping runs first, on its own.
                let norm = match (&a.qk_norm, c.qk_norm, c.clip_qkv) {
                    (Some((qn, kn)), QkNorm::PerHead, None) => Some(HeadNorm { q: qn, k: kn, eps }),
                    _ => {
                        self.qk_norm_and_clip(layer, qs, ks, vs, rows);
                        None
                    }
                };
                let freqs = &self.inv_freq;
                b.attention_step_at(qs, ks, vs, norm, shape, freqs, step, k_cache, v_cache, attn);
            }
        }
        match &a.mla {
            Some(mla) => super::mla::output(b, a, mla, attn, rows, attn_out),
            None => linear(b, attn, &a.o_proj, rows, attn_out),
        }
    }

    /// Decoder layer `i`'s feed-forward block: the residual add of the attention output
    /// and the norm after it, then the dense MLP or the MoE block, on the backend where it
    /// routes there, into `acts.delta`.
    fn feed_forward(
        &self,
        pass: Pass<'_, B::Tensor>,
        i: usize,
        layer: &Layer<B>,
        rows: usize,
        acts: &mut Activations<B::Tensor>,
        moe: &mut MoeRun<'_, '_, B>,
    ) {
        let (c, b) = (&self.config, &self.backend);
        let e = c.moe.num_experts;
        let routing = Routing {
            top_k: c.moe.top_k,
            router: c.moe.router,
        };
        let Ffn::Moe(block) = &layer.mlp else {
            self.post_attention_norm(pass, layer, rows, acts);
            if let Ffn::Dense(mlp) = &layer.mlp {
                moe::dense(b, mlp, &acts.xn, rows, &mut acts.delta);
            }
            moe.device_only = false;
            return;
        };
        let at = i * rows * e;
        let routed = match pass {
            Pass::Chunk { .. } | Pass::Rows { .. } => {
                self.post_attention_norm(pass, layer, rows, acts);
                let set = moe.sets.as_mut().and_then(|s| s.layer(i));
                // On the backend: a layer with no set when nothing watches each layer,
                // and a layer whose set lives in the backend's memory.
                let slots = set.as_deref().and_then(|s| s.device_slots());
                let try_device = set.is_none() && moe.device_ok || slots.is_some();
                let routed = try_device
                    && moe.probs.as_mut().is_some_and(|p| {
                        let x = MoeInput::Rows(&acts.xn);
                        moe::forward_on_device(
                            b,
                            block,
                            routing,
                            x,
                            rows,
                            &mut acts.delta,
                            p,
                            at,
                            slots,
                        )
                    });
                if !routed {
                    assert!(
                        slots.is_none(),
                        "layer {i}: a set on the device the backend cannot route"
                    );
                    let (x, out) = (&acts.xn, &mut acts.delta);
                    let p = moe::forward(b, block, routing, x, rows, out, set, moe.track);
                    if let Some(o) = moe.observer.as_deref_mut() {
                        o.observe(b, i, block, &acts.xn, rows, &p);
                    }
                    moe.host.push((i, p));
                }
                routed
            }
            Pass::Step { .. } => {
                // The residual add and the norm folded into the router's reading of its
                // input where the block routes on the backend.
                let x_next = acts
                    .x_next
                    .as_mut()
                    .expect("a step has a second residual buffer");
                let n = AddNorm {
                    x: &acts.x,
                    delta: Some(&acts.attn_out),
                    w: &layer.post_attention_layernorm,
                    eps: c.rms_norm_eps,
                };
                let slots = moe
                    .sets
                    .as_mut()
                    .and_then(|s| s.layer(i))
                    .and_then(|s| s.device_slots());
                let probs = moe.probs.as_mut().expect("a step's probabilities");
                let x = MoeInput::AddNorm {
                    n,
                    sum: &mut *x_next,
                    xn: &mut acts.xn,
                };
                let routed = moe::forward_on_device(
                    b,
                    block,
                    routing,
                    x,
                    rows,
                    &mut acts.delta,
                    probs,
                    at,
                    slots,
                );
                if routed {
                    std::mem::swap(&mut acts.x, x_next);
                } else {
                    self.post_attention_norm(pass, layer, rows, acts);
                    let (x, out) = (&acts.xn, &mut acts.delta);
                    let p = moe::forward(b, block, routing, x, rows, out, None, false);
                    moe.host.push((i, p));
                    moe.device_only = false;
                }
                routed
            }
        };
        if routed {
            moe.routed.push(i);
            // A set's evidence is fed once the probabilities are read back
            // (`finish_sets`); an observer needs them now.
            if let (Some(o), Some(p)) = (moe.observer.as_deref_mut(), moe.probs.as_deref()) {
                let mut host = vec![0.0f32; at + rows * e];
                b.download(p, &mut host);
                o.observe(b, i, block, &acts.xn, rows, &host[at..]);
            }
        }
    }

    /// The residual add of the attention output and the norm after it, into `acts.xn`:
    /// in place in a chunk, into the second residual buffer (then swapped) in a step.
    fn post_attention_norm(
        &self,
        pass: Pass<'_, B::Tensor>,
        layer: &Layer<B>,
        rows: usize,
        acts: &mut Activations<B::Tensor>,
    ) {
        let (c, b) = (&self.config, &self.backend);
        let (h, eps, w) = (
            c.hidden_size,
            c.rms_norm_eps,
            &layer.post_attention_layernorm,
        );
        match pass {
            Pass::Chunk { .. } | Pass::Rows { .. } => {
                b.add_rms_norm(&mut acts.x, &acts.attn_out, w, rows, h, eps, &mut acts.xn);
            }
            Pass::Step { .. } => {
                let x_next = acts
                    .x_next
                    .as_mut()
                    .expect("a step has a second residual buffer");
                let n = AddNorm {
                    x: &acts.x,
                    delta: Some(&acts.attn_out),
                    w,
                    eps,
                };
                b.add_rms_norm_to(n, rows, h, x_next, &mut acts.xn);
                std::mem::swap(&mut acts.x, x_next);
            }
        }
    }

    /// The q/k normalisation and the QKV clipping of the architecture, on `n` rows.
    fn qk_norm_and_clip(
        &self,
        layer: &Layer<B>,
        qs: &mut B::Tensor,
        ks: &mut B::Tensor,
        vs: &mut B::Tensor,
        n: usize,
    ) {
        let (c, b) = (&self.config, &self.backend);
        let (q, kv) = (c.q_dim(), c.kv_dim());
        if let Some((qn, kn)) = &layer.self_attn.qk_norm {
            match c.qk_norm {
                QkNorm::PerHead => {
                    b.rms_norm_inplace(qs, qn, n * c.num_heads, c.head_dim, c.rms_norm_eps);
                    b.rms_norm_inplace(ks, kn, n * c.num_kv_heads, c.head_dim, c.rms_norm_eps);
                }
                QkNorm::Whole => {
                    b.rms_norm_inplace(qs, qn, n, q, c.rms_norm_eps);
                    b.rms_norm_inplace(ks, kn, n, kv, c.rms_norm_eps);
                }
                QkNorm::None => {}
            }
        }
        if let Some(limit) = c.clip_qkv {
            b.clamp(qs, limit, n * q);
            b.clamp(ks, limit, n * kv);
            b.clamp(vs, limit, n * kv);
        }
    }

    /// Copies the probabilities of the MoE layers routed on the backend (`layers`, each
    /// `[n, E]` at `layer · n · E` in `probs`) into `state.router_probs`.
    fn read_router_probs(
        &self,
        state: &mut State<B>,
        probs: Option<&B::Tensor>,
        layers: &[usize],
        n: usize,
    ) {
        for p in state.router_probs.iter_mut() {
            p.clear();
        }
        let (Some(probs), Some(&last)) = (probs, layers.iter().max()) else {
            return;
        };
        let e = self.config.moe.num_experts;
        let mut host = vec![0.0f32; (last + 1) * n * e];
        self.backend.download(probs, &mut host);
        for &i in layers {
            state.router_probs[i] = host[i * n * e..(i + 1) * n * e].to_vec();
        }
    }
}

/// Where a pass over the layers takes its tokens' positions from, which also decides
/// which fused ops it asks the backend for.
pub(super) enum Pass<'p, T> {
    /// Tokens at positions `pos0 ..` that the host knows (`positions`): prompts, scored
    /// chunks, probes, residency runs.
    Chunk {
        /// Position of the first token.
        pos0: usize,
        /// Every token's position.
        positions: &'p [usize],
    },
    /// Tokens of different sequences, one a row, at positions the host knows, each
    /// attending to its own sequence's caches ([`Caches::Rows`]): a decode step of a batch.
    Rows {
        /// Every row's position in its sequence.
        positions: &'p [usize],
    },
    /// One decode step: its token and position are `[token, position]` bits in `step`,
    /// read by the backend, so that the step can be recorded once and replayed. Each
    /// residual add is folded into the op that reads the norm after it.
    Step {
        /// The step's values.
        step: &'p T,
    },
}

impl<T> Clone for Pass<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Pass<'_, T> {}

/// The KV caches a pass writes and attends to.
pub(super) enum Caches<'c, T> {
    /// One sequence's, per layer.
    One {
        /// `[capacity, kv]` per layer.
        k: &'c mut [T],
        /// `[capacity, kv]` per layer.
        v: &'c mut [T],
    },
    /// Each row's own sequence's: per row, its keys' and values' caches per layer.
    Rows(Vec<(&'c mut [T], &'c mut [T])>),
}

/// The activations of a pass, each `rows` rows of the width in its comment.
pub(super) struct Activations<T> {
    /// `[h]` the residual stream.
    pub x: T,
    /// `[h]` where a step's next residual sum goes: the ops that add to the residual read
    /// the old sum while they write the new one, and the two swap after each add. A
    /// chunk adds in place and has none.
    pub x_next: Option<T>,
    /// `[h]` the normalised residual a block reads.
    pub xn: T,
    /// `[q]`, `[kv]`, `[kv]`.
    pub qs: T,
    pub ks: T,
    pub vs: T,
    /// `[q]` attention output.
    pub attn: T,
    /// `[h]` the attention block's output projection.
    pub attn_out: T,
    /// `[h]` the feed-forward block's output, added to the residual by the next layer.
    pub delta: T,
}

impl<T> Activations<T> {
    /// Buffers for `rows` rows; `step` adds the second residual buffer a step needs.
    pub fn new<B: Backend<Tensor = T>>(b: &B, c: &Config, rows: usize, step: bool) -> Self {
        let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
        Activations {
            x: b.alloc(rows * h),
            x_next: step.then(|| b.alloc(rows * h)),
            xn: b.alloc(rows * h),
            qs: b.alloc(rows * q),
            ks: b.alloc(rows * kv),
            vs: b.alloc(rows * kv),
            attn: b.alloc(rows * q),
            attn_out: b.alloc(rows * h),
            delta: b.alloc(rows * h),
        }
    }
}

/// What a pass's MoE layers route with and leave behind.
pub(super) struct MoeRun<'m, 's, B: Backend> {
    /// The resident sets of this call.
    pub sets: Option<&'m mut Step<'s, B>>,
    /// Whether the sets take this call's evidence.
    pub track: bool,
    /// Whether a layer without a set may route on the backend (nothing needs each
    /// layer's probabilities at once).
    pub device_ok: bool,
    /// `[layers, rows, E]` the probabilities of the layers routed on the backend; `None`
    /// where none may be.
    pub probs: Option<&'m mut B::Tensor>,
    /// Sees every MoE block (calibration).
    pub observer: Option<&'m mut dyn MoeObserver<B>>,
    /// The MoE layers routed on the backend.
    pub routed: Vec<usize>,
    /// The probabilities of the layers routed on the host, by layer.
    pub host: Vec<(usize, Vec<f32>)>,
    /// Whether the pass queued nothing but backend work (every MoE layer routed on the
    /// backend, no dense feed-forward layer): then a step may be recorded.
    pub device_only: bool,
}

/// Ends a forward call's hold on the resident sets: the layers in `routed` were routed on
/// the backend, so their sets see the call's probabilities only now (hit rate and
/// evidence), before the checkpoint plans the next swaps.
fn finish_sets<B: Backend>(
    step: Option<Step<'_, B>>,
    router_probs: &[Vec<f32>],
    routed: &[usize],
    n: usize,
    track: bool,
) {
    let Some(mut step) = step else { return };
    for &i in routed {
        if let Some(set) = step.layer(i) {
            if set.device_slots().is_some() {
                set.observe(&router_probs[i], n, track);
            }
        }
    }
    step.finish(n);
}

/// The q, k and v projections' biases, where they have them, added to their outputs.
fn qkv_biases<B: Backend>(b: &B, a: &Attention<B>, rows: usize, outs: [&mut B::Tensor; 3]) {
    for (l, out) in [&a.q_proj, &a.k_proj, &a.v_proj].into_iter().zip(outs) {
        if let Some(bias) = &l.bias {
            b.add_bias(out, bias, rows);
        }
    }
}

/// `out = x Wᵀ (+ b)` on `rows` rows.
fn linear<B: Backend>(b: &B, x: &B::Tensor, l: &Linear<B>, rows: usize, out: &mut B::Tensor) {
    b.linear(x, l.weight(), rows, l.in_dim, l.out_dim, out);
    if let Some(bias) = &l.bias {
        b.add_bias(out, bias, rows);
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::Cpu;
    use crate::model;
    use crate::testing::fixture_dirs;

    /// `state_bytes` is what `new_state` allocates: the keys' and values' buffers of every
    /// layer, on the CPU (where a tensor is a `Vec<f32>`), for every fixture.
    #[test]
    fn state_bytes_is_what_a_new_state_allocates() {
        for dir in fixture_dirs() {
            let m = model::load(&dir, Cpu::fast()).unwrap();
            for capacity in [0, 1, 37, 300] {
                let s = m.model.new_state(capacity);
                let allocated: usize = s
                    .k_cache
                    .iter()
                    .chain(&s.v_cache)
                    .map(|t| size_of_val(t.as_slice()))
                    .sum();
                assert_eq!(
                    m.model.state_bytes(capacity),
                    allocated,
                    "{} at {capacity} positions",
                    dir.display()
                );
            }
        }
    }
}
