//! The forward pass, written once for every architecture against [`Backend`].
//!
//! One call processes a chunk of tokens at consecutive positions (a whole prompt in
//! prefill, one token in decode), appending their keys and values to the state's
//! cache. Shapes in comments: `n` tokens in the chunk, `h` hidden size, `q`/`kv` the
//! query and key/value widths, `E` experts, `V` vocabulary.

use crate::checkpoint::config::{Config, QkNorm};
use crate::checkpoint::Checkpoint;
use std::collections::BTreeMap;
use std::sync::Arc;

use super::moe::{self, MoeObserver, Routing};
use super::weights::{Attention, Experts, Ffn, Layer, LayerStores, Linear, Loader};
use super::Error;
use crate::backend::{AddNorm, AttentionShape, Backend, HeadNorm, MoeInput, PendingRead, Weight};
use crate::residency::{self, Reservoir, ReservoirKind, Residency, ResidencyConfig, Step};
use crate::store::dense_vq::CodedLayers;
use crate::store::records::LayerSource;
use crate::store::vq_encode::VqExperts;

/// A model's weights on a backend, ready to run.
pub struct Model<B: Backend> {
    /// Resolved configuration.
    pub config: Config,
    backend: B,
    /// `[V, h]`.
    embed_tokens: B::Matrix,
    layers: Vec<Layer<B>>,
    /// `[h]`.
    norm: B::Tensor,
    /// `[V, h]`; `None` when tied to the embedding.
    lm_head: Option<Linear<B>>,
    /// `[head_dim / 2]` rotary inverse frequencies.
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
    /// Buffers of [`Model::decode_greedy`], made on its first call.
    step: Option<StepBuffers<B>>,
}

/// The buffers of a one-token decode step, at fixed addresses so a backend can record
/// the step once and replay it.
struct StepBuffers<B: Backend> {
    /// `[token, position]` as `u32` bits: every per-step value the step reads.
    step: B::Tensor,
    /// The residual, and the buffer its next sum goes to (the ops that add to it read
    /// the old one while they write the new one; the two swap after each add).
    x: B::Tensor,
    x_next: B::Tensor,
    xn: B::Tensor,
    qs: B::Tensor,
    ks: B::Tensor,
    vs: B::Tensor,
    attn: B::Tensor,
    /// The attention's output projection, added to the residual by the MoE block.
    attn_out: B::Tensor,
    /// The feed-forward block's output, added to the residual by the next layer.
    delta: B::Tensor,
    /// Router probabilities, `E` per layer at `layer · E`, then the chosen token's bits.
    probs: B::Tensor,
    logits: B::Tensor,
    /// MoE layers the last run of the step routed on the backend.
    routed: Vec<usize>,
    /// Whether the last run queued nothing but device work (every MoE layer routed on
    /// the backend, no dense feed-forward layer): then it may be recorded.
    fit: bool,
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

/// Inverse frequencies as transformers computes them in float32:
/// `1 / theta^(2i / d)`, divided by the linear scaling factor.
pub fn rope_inv_freq(theta: f32, head_dim: usize, linear_factor: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32) / linear_factor)
        .collect()
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
        let embed_tokens = ld.matrix("model.embed_tokens.weight", v, h)?;
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
        let inv_freq = rope_inv_freq(
            config.rope.theta,
            config.head_dim,
            config.rope.linear_factor,
        );
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
            None => Weight::Dense(&self.embed_tokens),
        }
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
        }
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
        mut observer: Option<&mut dyn MoeObserver<B>>,
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
        let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());

        let positions: Vec<usize> = (state.pos..state.pos + n).collect();
        let mut x = b.alloc(n * h); // [n, h] residual stream
        let mut xn = b.alloc(n * h); // [n, h] normalised
        let mut qs = b.alloc(n * q); // [n, q]
        let mut ks = b.alloc(n * kv); // [n, kv]
        let mut vs = b.alloc(n * kv); // [n, kv]
        let mut attn = b.alloc(n * q); // [n, q]
        let mut delta = b.alloc(n * h); // [n, h] block output

        // A token boundary: loads that have arrived commit now, and the sets stay as
        // they are until this call ends.
        let mut step = self.residency.as_ref().map(|r| r.begin(b));
        let track = step.as_ref().is_some_and(|s| s.tracks());
        let routing = Routing {
            top_k: c.moe.top_k,
            router: c.moe.router,
        };
        // MoE layers routed on the backend leave their probabilities here, one slice a
        // layer, read back once at the end of the call instead of once a layer. Not with
        // resident sets or an observer: both need each layer's probabilities at once.
        let e = c.moe.num_experts;
        let on_device_ok = self.residency.is_none() && observer.is_none();
        let sets_on_device = step.as_ref().is_some_and(|s| s.any_on_device());
        let mut probs_dev = ((on_device_ok || sets_on_device) && c.moe_layers().next().is_some())
            .then(|| b.alloc(self.layers.len() * n * e));
        let mut on_device: Vec<usize> = Vec::new();
        // Rows whose logits are wanted.
        let m = n - logits_from;
        b.embed(&self.embed_tokens, h, tokens, &mut x);
        // Each residual add is fused with the norm that reads its result (the next
        // block's input norm, or the final one), so `xn` holds a block's input on entry.
        // The final norm runs on every row (a row's norm reads only that row), and only
        // when some logits are wanted.
        let norm_wanted = |i: usize| i < self.layers.len() || m > 0;
        if norm_wanted(0) {
            b.rms_norm(&x, self.norm_before(0), n, h, c.rms_norm_eps, &mut xn);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            // Attention block.
            let a = &layer.self_attn;
            qkv(b, &xn, a, n, [&mut qs, &mut ks, &mut vs]);
            self.qk_norm_and_clip(layer, &mut qs, &mut ks, &mut vs, n);
            b.rope(&mut qs, &positions, c.num_heads, c.head_dim, &self.inv_freq);
            b.rope(
                &mut ks,
                &positions,
                c.num_kv_heads,
                c.head_dim,
                &self.inv_freq,
            );
            b.write_rows(&ks, &mut state.k_cache[i], state.pos, n, kv);
            b.write_rows(&vs, &mut state.v_cache[i], state.pos, n, kv);
            let shape = AttentionShape {
                rows: n,
                pos0: state.pos,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                window: c.layers[i].sliding_window,
            };
            b.attention(&qs, &state.k_cache[i], &state.v_cache[i], shape, &mut attn);
            linear(b, &attn, &a.o_proj, n, &mut delta);

            // Feed-forward block.
            let post = &layer.post_attention_layernorm;
            b.add_rms_norm(&mut x, &delta, post, n, h, c.rms_norm_eps, &mut xn);
            match &layer.mlp {
                Ffn::Dense(mlp) => {
                    moe::dense(b, mlp, &xn, n, &mut delta);
                    state.router_probs[i].clear();
                }
                Ffn::Moe(block) => {
                    let set = step.as_mut().and_then(|s| s.layer(i));
                    // On the backend: a layer with no set when nothing watches each layer,
                    // and a layer whose set lives in the backend's memory.
                    let slots = set.as_deref().and_then(|s| s.device_slots());
                    let try_device = set.is_none() && on_device_ok || slots.is_some();
                    let routed = try_device
                        && probs_dev.as_mut().is_some_and(|p| {
                            moe::forward_on_device(
                                b,
                                block,
                                routing,
                                MoeInput::Rows(&xn),
                                n,
                                &mut delta,
                                p,
                                i * n * e,
                                slots,
                            )
                        });
                    if routed {
                        // A set's evidence is fed once the probabilities are read back
                        // (`finish_sets`); an observer needs them now.
                        on_device.push(i);
                        if let (Some(o), Some(p)) = (observer.as_deref_mut(), &probs_dev) {
                            let mut host = vec![0.0f32; (i + 1) * n * e];
                            b.download(p, &mut host);
                            state.router_probs[i] = host.split_off(i * n * e);
                            o.observe(b, i, block, &xn, n, &state.router_probs[i]);
                        }
                    } else {
                        assert!(
                            slots.is_none(),
                            "layer {i}: a set on the device the backend cannot route"
                        );
                        state.router_probs[i] =
                            moe::forward(b, block, routing, &xn, n, &mut delta, set, track);
                        if let Some(o) = observer.as_deref_mut() {
                            o.observe(b, i, block, &xn, n, &state.router_probs[i]);
                        }
                    }
                }
            }
            if norm_wanted(i + 1) {
                let w = self.norm_before(i + 1);
                b.add_rms_norm(&mut x, &delta, w, n, h, c.rms_norm_eps, &mut xn);
            } else {
                b.add(&mut x, &delta, n * h);
            }
        }
        state.pos += n;

        // LM head, only on the rows whose logits are wanted.
        if m == 0 {
            self.read_router_probs(state, probs_dev.as_ref(), &on_device, n);
            finish_sets(step, &state.router_probs, &on_device, n, track);
            return Ok(Vec::new());
        }
        let head_in = if logits_from == 0 {
            &xn
        } else {
            let rows: Vec<u32> = (logits_from as u32..n as u32).collect();
            b.gather_rows(&xn, &rows, h, &mut delta);
            &delta
        };
        let mut logits = b.alloc(m * c.vocab_size);
        b.linear(head_in, self.head(), m, h, c.vocab_size, &mut logits);
        let mut out = vec![0.0f32; m * c.vocab_size];
        b.download(&logits, &mut out);
        // After the logits, which waited for the device: a copy, not a wait.
        self.read_router_probs(state, probs_dev.as_ref(), &on_device, n);
        finish_sets(step, &state.router_probs, &on_device, n, track);
        Ok(out)
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

    /// Runs one token at position `state.pos`, appends it to the cache and returns the
    /// most probable next token: [`forward`](Self::forward) of one token followed by an
    /// argmax, with the argmax on the backend and every per-step value (token, position)
    /// read from device memory, so that no host round trip happens before the chosen
    /// token and a backend may replay the step from a record (a CUDA graph). Router
    /// probabilities land in `state.router_probs` as with `forward`. With resident sets
    /// the step runs as `forward` does.
    pub fn decode_greedy(&self, state: &mut State<B>, token: u32) -> Result<u32, Error> {
        let c = &self.config;
        let b = &self.backend;
        if token as usize >= c.vocab_size {
            return Err(Error::TokenOutOfRange {
                id: token,
                vocab: c.vocab_size,
            });
        }
        if state.pos + 1 > state.capacity {
            return Err(Error::ContextOverflow {
                needed: state.pos + 1,
                capacity: state.capacity,
            });
        }
        if self.residency.as_ref().is_some_and(|r| !r.all_on_device()) {
            let logits = self.forward(state, &[token], 0)?;
            return Ok(crate::model::argmax(&logits));
        }
        let (e, l) = (c.moe.num_experts, self.layers.len());
        let bufs = state.step.get_or_insert_with(|| self.step_buffers());
        let at = [f32::from_bits(token), f32::from_bits(state.pos as u32)];
        b.upload_into(&at, &mut bufs.step);
        // A token boundary: landed loads commit before the step is issued.
        let mut step = self.residency.as_ref().map(|r| r.begin(b));
        let track = step.as_ref().is_some_and(|s| s.tracks());
        let key = (state.id, self.epoch);
        let (kc, vc) = (&mut state.k_cache, &mut state.v_cache);
        let (_, host_probs) = self.run_step(bufs, kc, vc, key, step.as_mut());
        state.pos += 1;

        // One read of the step's results: the router probabilities and the token.
        let mut host = vec![0.0f32; l * e + 1];
        b.download(&bufs.probs, &mut host);
        let token = self.step_results(&host, &bufs.routed, host_probs, &mut state.router_probs);
        finish_sets(step, &state.router_probs, &bufs.routed, 1, track);
        Ok(token)
    }

    /// Runs one decode step from the values the step tensor holds, replayed from a record
    /// where it fits (recording it the first time), else op by op; returns whether it
    /// ran from a record, and the probabilities of the layers it routed on the host.
    fn run_step(
        &self,
        bufs: &mut StepBuffers<B>,
        k_cache: &mut [B::Tensor],
        v_cache: &mut [B::Tensor],
        key: (usize, u64),
        mut sets: Option<&mut Step<'_, B>>,
    ) -> (bool, Vec<(usize, Vec<f32>)>) {
        let mut host_probs = Vec::new();
        let recorded = if bufs.fit {
            self.backend.replay_step(key, &mut || {
                self.step_body(bufs, k_cache, v_cache, &mut host_probs, sets.as_deref_mut())
            })
        } else {
            bufs.fit = self.step_body(bufs, k_cache, v_cache, &mut host_probs, sets);
            false
        };
        (recorded, host_probs)
    }

    /// A step's results as the host read them (`host`: the router probabilities of the
    /// layers routed on the backend, `E` a layer, then the chosen token's bits) into
    /// `router_probs`, with those of the layers routed on the host; returns the token.
    fn step_results(
        &self,
        host: &[f32],
        routed: &[usize],
        host_probs: Vec<(usize, Vec<f32>)>,
        router_probs: &mut [Vec<f32>],
    ) -> u32 {
        let e = self.config.moe.num_experts;
        for p in router_probs.iter_mut() {
            p.clear();
        }
        for &i in routed {
            router_probs[i] = host[i * e..(i + 1) * e].to_vec();
        }
        for (i, p) in host_probs {
            router_probs[i] = p;
        }
        host[self.layers.len() * e].to_bits()
    }

    /// The buffers of a decode step, made on a state's first.
    fn step_buffers(&self) -> StepBuffers<B> {
        let (c, b) = (&self.config, &self.backend);
        let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
        StepBuffers {
            step: b.alloc(2),
            x: b.alloc(h),
            x_next: b.alloc(h),
            xn: b.alloc(h),
            qs: b.alloc(q),
            ks: b.alloc(kv),
            vs: b.alloc(kv),
            attn: b.alloc(q),
            attn_out: b.alloc(h),
            delta: b.alloc(h),
            probs: b.alloc(self.layers.len() * c.moe.num_experts + 1),
            logits: b.alloc(c.vocab_size),
            routed: Vec::new(),
            fit: false,
        }
    }

    /// Greedy decode of up to `n` tokens after `first` (the token at position
    /// `state.pos`), each handed to `on_token` as it is chosen; `on_token` returning
    /// `false` stops there. Returns how many tokens were handed over. Those tokens, and
    /// `state.pos` and `state.router_probs` after each, are what as many
    /// [`decode_greedy`](Self::decode_greedy) calls give, each fed the token before.
    ///
    /// Where the backend replays the step from a record, the steps are queued back to
    /// back: the step tensor is uploaded once, each step leaves its token and the next
    /// position there for the next one, and step `t + 1` is queued before step `t`'s
    /// results are read, so the device does not wait for the host between tokens. Steps
    /// run one call at a time, as `decode_greedy` runs them, on a state's first step
    /// (which tells whether the step can be recorded), where it cannot be (dense or
    /// host-routed feed-forward layers, graphs off), and with resident sets, whose swaps
    /// land at token boundaries the host picks. Stopped early, the step after the last
    /// token handed over may have run too: it wrote the cache row at `state.pos`, which
    /// the next call writes again.
    ///
    /// Errors as `decode_greedy`: `first` out of the vocabulary, or the cache full, in
    /// which case the tokens that fit were handed over first.
    pub fn decode_greedy_many(
        &self,
        state: &mut State<B>,
        first: u32,
        n: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize, Error> {
        let mut done = 0;
        let mut token = first;
        let mut queue = self.residency.is_none();
        while done < n {
            let fit = state.step.as_ref().is_some_and(|s| s.fit);
            let room = state.capacity.saturating_sub(state.pos).min(n - done);
            // One step left gains nothing from queueing; one past the cache is left to
            // `decode_greedy`'s error.
            if queue && fit && room > 1 && (token as usize) < self.config.vocab_size {
                let q = self.decode_queued(state, token, room, on_token, false);
                done += q.delivered;
                token = q.last;
                if q.stopped {
                    break;
                }
                queue = q.recorded;
                continue;
            }
            token = self.decode_greedy(state, token)?;
            done += 1;
            if !on_token(token) {
                break;
            }
        }
        Ok(done)
    }

    /// The queued steps of [`decode_greedy_many`](Self::decode_greedy_many): up to `n`
    /// tokens after `first`, `n` within the cache. When the first step did not run from a
    /// record it delivers that one token alone, unless `force`d to queue steps that run
    /// their body each time (which gives the same tokens, to test the loop on a backend
    /// that records nothing).
    fn decode_queued(
        &self,
        state: &mut State<B>,
        first: u32,
        n: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
        force: bool,
    ) -> Queued {
        let b = &self.backend;
        let State {
            pos,
            k_cache,
            v_cache,
            router_probs,
            id,
            step,
            ..
        } = state;
        let bufs = step.get_or_insert_with(|| self.step_buffers());
        let key = (*id, self.epoch);
        let start = [f32::from_bits(first), f32::from_bits(*pos as u32)];
        b.upload_into(&start, &mut bufs.step);
        let (recorded, read) = self.queue_step(bufs, k_cache, v_cache, key);
        let mut out = Queued {
            delivered: 0,
            last: first,
            stopped: false,
            recorded,
        };
        let limit = if recorded || force { n } else { 1 };
        let mut queued = 1;
        let mut ahead = Some(read);
        while let Some((read, host_probs)) = ahead.take() {
            if queued < limit {
                ahead = Some(self.queue_step(bufs, k_cache, v_cache, key).1);
                queued += 1;
            }
            let host = b.finish_read(read);
            *pos += 1;
            out.delivered += 1;
            out.last = self.step_results(&host, &bufs.routed, host_probs, router_probs);
            if !on_token(out.last) {
                out.stopped = true;
                break;
            }
        }
        // The step queued past a stop: its read is finished so that the backend gets its
        // buffer back.
        if let Some((read, _)) = ahead {
            let _ = b.finish_read(read);
        }
        out
    }

    /// Queues one decode step ([`run_step`](Self::run_step), no resident sets) and the
    /// read of its results; returns whether it ran from a record, the read, and the
    /// probabilities of layers routed on the host.
    fn queue_step(
        &self,
        bufs: &mut StepBuffers<B>,
        k_cache: &mut [B::Tensor],
        v_cache: &mut [B::Tensor],
        key: (usize, u64),
    ) -> (bool, QueuedRead) {
        let (recorded, host_probs) = self.run_step(bufs, k_cache, v_cache, key, None);
        let len = self.layers.len() * self.config.moe.num_experts + 1;
        let read = self.backend.read_async(&bufs.probs, len);
        (recorded, (read, host_probs))
    }

    /// The ops of [`decode_greedy`](Self::decode_greedy); returns whether it queued
    /// nothing but device work. MoE layers the backend cannot route run on the host
    /// path, their probabilities pushed to `host_probs`.
    fn step_body(
        &self,
        bufs: &mut StepBuffers<B>,
        k_cache: &mut [B::Tensor],
        v_cache: &mut [B::Tensor],
        host_probs: &mut Vec<(usize, Vec<f32>)>,
        mut sets: Option<&mut Step<'_, B>>,
    ) -> bool {
        let (c, b) = (&self.config, &self.backend);
        let (h, e) = (c.hidden_size, c.moe.num_experts);
        let routing = Routing {
            top_k: c.moe.top_k,
            router: c.moe.router,
        };
        let mut fit = true;
        bufs.routed.clear();
        let eps = c.rms_norm_eps;
        b.embed_at(&self.embed_tokens, h, &bufs.step, &mut bufs.x);
        // Each residual add is made by the op that reads the norm after it (the q/k/v
        // projections, the router, the LM head), into `x_next`; then the two swap. The
        // first layer's norm reads the embedding as it is; each later one adds the layer
        // before's feed-forward output.
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let n = AddNorm {
                x: &bufs.x,
                delta: (i > 0).then_some(&bufs.delta),
                w: self.norm_before(i),
                eps,
            };
            let ls = [&a.q_proj, &a.k_proj, &a.v_proj];
            b.add_rms_norm_linear3(
                n,
                &mut bufs.x_next,
                &mut bufs.xn,
                ls.map(|l| l.weight()),
                1,
                h,
                ls.map(|l| l.out_dim),
                [&mut bufs.qs, &mut bufs.ks, &mut bufs.vs],
            );
            qkv_biases(b, a, 1, [&mut bufs.qs, &mut bufs.ks, &mut bufs.vs]);
            if i > 0 {
                std::mem::swap(&mut bufs.x, &mut bufs.x_next);
            }
            let shape = AttentionShape {
                rows: 1,
                pos0: 0,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                window: c.layers[i].sliding_window,
            };
            // Per-head q/k norms without clipping go into the preamble's one launch;
            // any other normalisation or clipping runs first, on its own.
            let norm = match (&a.qk_norm, c.qk_norm, c.clip_qkv) {
                (Some((qn, kn)), QkNorm::PerHead, None) => Some(HeadNorm { q: qn, k: kn, eps }),
                _ => {
                    self.qk_norm_and_clip(layer, &mut bufs.qs, &mut bufs.ks, &mut bufs.vs, 1);
                    None
                }
            };
            b.attention_step_at(
                &mut bufs.qs,
                &mut bufs.ks,
                &bufs.vs,
                norm,
                shape,
                &self.inv_freq,
                &bufs.step,
                &mut k_cache[i],
                &mut v_cache[i],
                &mut bufs.attn,
            );
            linear(b, &bufs.attn, &a.o_proj, 1, &mut bufs.attn_out);
            let post = AddNorm {
                x: &bufs.x,
                delta: Some(&bufs.attn_out),
                w: &layer.post_attention_layernorm,
                eps,
            };
            let routed = match &layer.mlp {
                Ffn::Moe(block) => moe::forward_on_device(
                    b,
                    block,
                    routing,
                    MoeInput::AddNorm {
                        n: post,
                        sum: &mut bufs.x_next,
                        xn: &mut bufs.xn,
                    },
                    1,
                    &mut bufs.delta,
                    &mut bufs.probs,
                    i * e,
                    sets.as_mut()
                        .and_then(|s| s.layer(i))
                        .and_then(|s| s.device_slots()),
                ),
                Ffn::Dense(_) => false,
            };
            if !routed {
                b.add_rms_norm_to(post, 1, h, &mut bufs.x_next, &mut bufs.xn);
            }
            std::mem::swap(&mut bufs.x, &mut bufs.x_next);
            match &layer.mlp {
                Ffn::Moe(_) if routed => bufs.routed.push(i),
                Ffn::Dense(mlp) => {
                    fit = false;
                    moe::dense(b, mlp, &bufs.xn, 1, &mut bufs.delta);
                }
                Ffn::Moe(block) => {
                    fit = false;
                    let p =
                        moe::forward(b, block, routing, &bufs.xn, 1, &mut bufs.delta, None, false);
                    host_probs.push((i, p));
                }
            }
        }
        let n = AddNorm {
            x: &bufs.x,
            delta: (!self.layers.is_empty()).then_some(&bufs.delta),
            w: self.norm_before(self.layers.len()),
            eps,
        };
        b.add_rms_norm_linear(
            n,
            &mut bufs.x_next,
            &mut bufs.xn,
            self.head(),
            1,
            h,
            c.vocab_size,
            &mut bufs.logits,
        );
        b.argmax_rows(
            &bufs.logits,
            1,
            c.vocab_size,
            &mut bufs.probs,
            self.layers.len() * e,
        );
        // So that the record replays again with no upload between (`decode_queued`);
        // `decode_greedy` uploads each step's values over it.
        b.advance_step(&mut bufs.step, &bufs.probs, self.layers.len() * e);
        fit
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
        let (Some(probs), Some(&last)) = (probs, layers.last()) else {
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

/// A queued step's read of its results, and the probabilities of the layers it routed on
/// the host.
type QueuedRead = (PendingRead, Vec<(usize, Vec<f32>)>);

/// What [`Model::decode_queued`] did.
struct Queued {
    /// Tokens handed to the callback.
    delivered: usize,
    /// The last of them (`first` when none).
    last: u32,
    /// Whether the callback asked to stop.
    stopped: bool,
    /// Whether the first step ran from a record.
    recorded: bool,
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

/// A layer's q, k and v projections of `x` on `rows` rows (one launch where the backend
/// can), then their biases.
fn qkv<B: Backend>(b: &B, x: &B::Tensor, a: &Attention<B>, rows: usize, outs: [&mut B::Tensor; 3]) {
    let ls = [&a.q_proj, &a.k_proj, &a.v_proj];
    let [q, k, v] = outs;
    b.linear3(
        x,
        ls.map(|l| l.weight()),
        rows,
        a.q_proj.in_dim,
        ls.map(|l| l.out_dim),
        [&mut *q, &mut *k, &mut *v],
    );
    qkv_biases(b, a, rows, [q, k, v]);
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
    use crate::model::argmax;
    use crate::testing::{fixture_dirs, greedy_reference, GreedyReference};

    /// The queued loop of `decode_greedy_many` forced on the CPU, which records no step
    /// and so never queues one otherwise: from a fresh state's first step and from a
    /// state that has run some, it gives the tokens, position and router probabilities of
    /// `decode_greedy` called token by token; stopped early (one step past the stop
    /// already run), the state goes on from the last token handed over as if that step
    /// had never run.
    #[test]
    fn queued_steps_decode_as_steps_one_call_at_a_time() {
        let prompt = [5u32, 17, 300, 42, 7, 99];
        let (p, n, stop) = (prompt.len(), 9, 4);
        for dir in fixture_dirs() {
            let m = model::load(&dir, Cpu::fast()).unwrap();
            let model = &m.model;
            let label = dir.display();
            let GreedyReference {
                state: mut a,
                first,
                tokens: want,
                probs,
            } = greedy_reference(model, &prompt, n);

            let mut fresh = model.new_state(p + n);
            model.forward(&mut fresh, &prompt, p - 1).unwrap();
            a.pos = p;
            for (which, s) in [("fresh state", &mut fresh), ("used state", &mut a)] {
                let mut got = Vec::new();
                let q = model.decode_queued(
                    s,
                    first,
                    n,
                    &mut |t| {
                        got.push(t);
                        true
                    },
                    true,
                );
                assert_eq!(got, want, "{label} {which}");
                assert_eq!((q.delivered, q.last, q.stopped), (n, want[n - 1], false));
                assert_eq!(s.pos, p + n, "{label} {which}");
                assert_eq!(s.router_probs, probs[n - 1], "{label} {which}");
            }

            a.pos = p;
            let mut got = Vec::new();
            let q = model.decode_queued(
                &mut a,
                first,
                n,
                &mut |t| {
                    got.push(t);
                    got.len() < stop
                },
                true,
            );
            assert_eq!(got, want[..stop], "{label} stopped");
            assert_eq!((q.delivered, q.stopped), (stop, true), "{label}");
            assert_eq!(
                a.pos,
                p + stop,
                "{label}: the step past the stop is not counted"
            );
            assert_eq!(a.router_probs, probs[stop - 1], "{label} stopped");
            let next = model.decode_greedy(&mut a, want[stop - 1]).unwrap();
            assert_eq!(next, want[stop], "{label}: decode_greedy after the stop");
            let logits = model.forward(&mut a, &[next], 0).unwrap();
            assert_eq!(argmax(&logits), want[stop + 1], "{label}: forward after it");
        }
    }
}
