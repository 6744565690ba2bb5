//! Decoding: [`Model::decode`] produces the tokens after a prompt, each one step of the
//! pass over the layers ([`Pass::Step`]). A step's token and position live in backend
//! memory and its argmax runs on the backend, so no host round trip happens before the
//! next token is known, and a backend that records a step (a CUDA graph) replays it.

use super::{finish_sets, Activations, Caches, Model, MoeRun, Pass, State};
use crate::backend::sample::{self, Sampling};
use crate::backend::{AddNorm, Backend, PendingRead, NOT_A_TOKEN};
use crate::model::{argmax, Error};
use crate::residency::Step;

/// How [`Model::decode`] produces tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeOptions {
    /// Tokens to produce at most.
    pub max_tokens: usize,
    /// How each token is picked from the logits ([`Sampling::GREEDY`]: the most probable).
    pub sampling: Sampling,
}

impl DecodeOptions {
    /// Up to `max_tokens` tokens, each the most probable.
    pub fn greedy(max_tokens: usize) -> DecodeOptions {
        DecodeOptions {
            max_tokens,
            sampling: Sampling::GREEDY,
        }
    }
}

/// What a step picks its token with: the settings, and the sequence's token counts when
/// a penalty reads them (the step adds its token to them).
struct Pick<'a, T> {
    sampling: &'a Sampling,
    counts: Option<&'a mut T>,
}

/// The buffers of a decode step, at fixed addresses so a backend can record the step once
/// and replay it.
pub(super) struct StepBuffers<B: Backend> {
    /// `[token, position]` as `u32` bits: every per-step value the step reads.
    step: B::Tensor,
    acts: Activations<B::Tensor>,
    /// Router probabilities, `E` per layer at `layer · E`, then the chosen token's bits.
    probs: B::Tensor,
    logits: B::Tensor,
    /// MoE layers the last run of the step routed on the backend.
    routed: Vec<usize>,
    /// The record key of the last run that ran op by op and queued nothing but backend
    /// work (every MoE layer routed on the backend, no dense feed-forward layer): a step
    /// under that key may be recorded. A key is recorded only after a run op by op under
    /// it, as that run is what sizes the backend's scratch buffers, which cannot grow
    /// while a record is being taken.
    fit: Option<u64>,
}

/// A sequence [`Model::decode`] advances: its state, the token at `state.pos` it feeds
/// first, and how its tokens are picked.
pub struct Decoding<'s, B: Backend> {
    /// The sequence's cache and position.
    pub state: &'s mut State<B>,
    /// The token at `state.pos`.
    pub first: u32,
    /// How many tokens, picked how.
    pub opts: DecodeOptions,
}

impl<'s, B: Backend> Decoding<'s, B> {
    /// `state` fed `first`, then its own tokens, as `opts` says.
    pub fn new(state: &'s mut State<B>, first: u32, opts: DecodeOptions) -> Self {
        Decoding { state, first, opts }
    }
}

impl<B: Backend> Model<B> {
    /// Decodes the sequences of `seqs` together: each is fed its `first` token, then the
    /// tokens it produces, up to its `opts.max_tokens`, each handed to `on_token` with the
    /// sequence's index as it is chosen; `on_token` returning `false` stops that
    /// sequence. Returns how many tokens each was handed; each `state.pos` and
    /// `state.router_probs` are those of its last token's step. Several sequences advance
    /// in one pass over the layers a step, each row attending to its own cache; one
    /// sequence runs the decode step below.
    ///
    /// Errors: a token outside the vocabulary, bad sampling settings, or a cache full, in
    /// which case the tokens that fit were handed over first.
    pub fn decode(
        &self,
        seqs: &mut [Decoding<'_, B>],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<usize>, Error> {
        self.backend.warm(|| self.decode_seqs(seqs, on_token))
    }

    fn decode_seqs(
        &self,
        seqs: &mut [Decoding<'_, B>],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<usize>, Error> {
        for s in seqs.iter() {
            if let Err(why) = s.opts.sampling.check() {
                return Err(Error::Config(format!("sampling: {why}")));
            }
        }
        match seqs {
            [one] => {
                let (state, first, opts) = (&mut *one.state, one.first, one.opts);
                Ok(vec![
                    self.decode_one(state, first, opts, &mut |t| on_token(0, t))?
                ])
            }
            _ => self.decode_rows(seqs, on_token),
        }
    }

    /// Decodes up to `opts.max_tokens` tokens after `first` (the token at position
    /// `state.pos`), each handed to `on_token` as it is chosen; `on_token` returning
    /// `false` stops there. Returns how many tokens were handed over.
    ///
    /// Where the backend replays the step from a record, the steps are queued back to
    /// back: the step tensor is uploaded once, each step leaves its token and the next
    /// position there for the next one, and step `t + 1` is queued before step `t`'s
    /// results are read, so the device does not wait for the host between tokens. Steps
    /// run one at a time on a state's first step (which tells whether the step can be
    /// recorded), where it cannot be (dense or host-routed feed-forward layers, graphs
    /// off), and with resident sets, whose swaps land at token boundaries the host picks.
    /// Stopped early, the step after the last token handed over may have run too: it
    /// wrote the cache row at `state.pos`, which the next call writes again.
    ///
    /// Errors: `first` outside the vocabulary, or the cache full, in which case the
    /// tokens that fit were handed over first.
    fn decode_one(
        &self,
        state: &mut State<B>,
        first: u32,
        opts: DecodeOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize, Error> {
        self.check_stores()?;
        self.ready_counts(state, first, &opts.sampling);
        let n = opts.max_tokens;
        let mut done = 0;
        let mut token = first;
        let mut queue = self.residency.is_none();
        while done < n {
            let key = self.epoch ^ step_key(&opts.sampling, state.counts.is_some());
            let fit = state.step.as_ref().is_some_and(|s| s.fit == Some(key));
            let room = state.capacity.saturating_sub(state.pos).min(n - done);
            // One step left gains nothing from queueing; one past the cache is left to
            // `step`'s error.
            if queue && fit && room > 1 && (token as usize) < self.config.vocab_size {
                let q = self.decode_queued(state, token, room, &opts.sampling, on_token, false);
                done += q.delivered;
                token = q.last;
                if token == NOT_A_TOKEN {
                    return Err(Error::NonFiniteLogits {
                        position: state.pos - 1,
                    });
                }
                if q.stopped {
                    break;
                }
                queue = q.recorded;
                continue;
            }
            token = self.step(state, token, &opts.sampling)?;
            if token == NOT_A_TOKEN {
                return Err(Error::NonFiniteLogits {
                    position: state.pos - 1,
                });
            }
            done += 1;
            if !on_token(token) {
                break;
            }
        }
        Ok(done)
    }

    /// [`decode`](Self::decode) of several sequences: one pass over the layers a step for
    /// every sequence still going, until each has its tokens or was stopped.
    fn decode_rows(
        &self,
        seqs: &mut [Decoding<'_, B>],
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<usize>, Error> {
        let v = self.config.vocab_size;
        let mut done = vec![0usize; seqs.len()];
        let mut fed: Vec<u32> = seqs.iter().map(|s| s.first).collect();
        let mut going: Vec<bool> = seqs.iter().map(|s| s.opts.max_tokens > 0).collect();
        loop {
            let rows: Vec<usize> = (0..seqs.len()).filter(|&i| going[i]).collect();
            if rows.is_empty() {
                return Ok(done);
            }
            for &i in &rows {
                let s = &seqs[i].state;
                if fed[i] as usize >= v {
                    return Err(Error::TokenOutOfRange {
                        id: fed[i],
                        vocab: v,
                    });
                }
                if s.pos + 1 > s.capacity {
                    return Err(Error::ContextOverflow {
                        needed: s.pos + 1,
                        capacity: s.capacity,
                    });
                }
            }
            let tokens: Vec<u32> = rows.iter().map(|&i| fed[i]).collect();
            let sampling: Vec<Sampling> = rows.iter().map(|&i| seqs[i].opts.sampling).collect();
            let mut states: Vec<&mut State<B>> = seqs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| going[*i])
                .map(|(_, s)| &mut *s.state)
                .collect();
            let picked = self.rows_step(&mut states, &tokens, &sampling)?;
            if let Some(j) = picked.iter().position(|&t| t == NOT_A_TOKEN) {
                let position = seqs[rows[j]].state.pos - 1;
                return Err(Error::NonFiniteLogits { position });
            }
            for (&i, &t) in rows.iter().zip(&picked) {
                done[i] += 1;
                fed[i] = t;
                going[i] = on_token(i, t) && done[i] < seqs[i].opts.max_tokens;
            }
        }
    }

    /// One decode step of several sequences at once: `tokens[r]` fed to `states[r]` at
    /// its position, one pass over the layers with a row a sequence; returns each row's
    /// next token, picked by `sampling[r]`.
    fn rows_step(
        &self,
        states: &mut [&mut State<B>],
        tokens: &[u32],
        sampling: &[Sampling],
    ) -> Result<Vec<u32>, Error> {
        let (c, b) = (&self.config, &self.backend);
        let (h, v, e, n) = (c.hidden_size, c.vocab_size, c.moe.num_experts, tokens.len());
        let positions: Vec<usize> = states.iter().map(|s| s.pos).collect();
        let mut acts = Activations::new(b, c, n, false);
        // A token boundary for the resident sets, as a chunk is.
        let mut sets = self.residency.as_ref().map(|r| r.begin(b));
        let track = sets.as_ref().is_some_and(|s| s.tracks());
        let device_ok = self.residency.is_none();
        let sets_on_device = sets.as_ref().is_some_and(|s| s.any_on_device());
        let mut probs = ((device_ok || sets_on_device) && c.moe_layers().next().is_some())
            .then(|| b.alloc(self.layers.len() * n * e));
        let mut moe = MoeRun {
            sets: sets.as_mut(),
            track,
            device_ok,
            probs: probs.as_mut(),
            observer: None,
            routed: Vec::new(),
            host: Vec::new(),
            device_only: true,
        };
        b.embed(self.embed_tokens.weight(), h, tokens, &mut acts.x);
        let mut caches = Caches::Rows(
            states
                .iter_mut()
                .map(|s| (&mut s.k_cache[..], &mut s.v_cache[..]))
                .collect(),
        );
        let pass = Pass::Rows {
            positions: &positions,
        };
        self.run_layers(pass, n, &mut acts, &mut caches, &mut moe);
        let MoeRun { routed, host, .. } = moe;
        let (x, xn, eps) = (&mut acts.x, &mut acts.xn, c.rms_norm_eps);
        if self.layers.is_empty() {
            b.rms_norm(x, &self.norm, n, h, eps, xn);
        } else {
            b.add_rms_norm(x, &acts.delta, &self.norm, n, h, eps, xn);
        }
        let mut logits = b.alloc(n * v);
        b.linear(&acts.xn, self.head(), n, h, v, &mut logits);
        let picked = if sampling.iter().all(|s| s.is_greedy() && !s.penalizes()) {
            let mut out = b.alloc(n);
            b.argmax_rows(&logits, n, v, &mut out, 0);
            let mut bits = vec![0.0f32; n];
            b.download(&out, &mut bits);
            bits.iter().map(|x| x.to_bits()).collect()
        } else {
            // The tokens each sequence holds once this step's is in, for the penalties.
            let held: Vec<Vec<u32>> = states
                .iter()
                .zip(tokens)
                .zip(sampling)
                .map(|((s, &fed), sm)| {
                    if !sm.penalizes() {
                        return Vec::new();
                    }
                    let mut held = s.tokens[..s.pos].to_vec();
                    held.push(fed);
                    held
                })
                .collect();
            let held: Vec<&[u32]> = held.iter().map(Vec::as_slice).collect();
            b.sample_rows(&logits, v, sampling, &positions, &held)
        };
        // Each layer's probabilities, `[n, E]`, then each row's share to its sequence.
        let mut layer_probs = vec![Vec::new(); self.layers.len()];
        if let (Some(p), Some(&last)) = (&probs, routed.iter().max()) {
            let mut all = vec![0.0f32; (last + 1) * n * e];
            b.download(p, &mut all);
            for &i in &routed {
                layer_probs[i] = all[i * n * e..(i + 1) * n * e].to_vec();
            }
        }
        for (i, p) in host {
            layer_probs[i] = p;
        }
        for (r, s) in states.iter_mut().enumerate() {
            for (i, p) in layer_probs.iter().enumerate() {
                s.router_probs[i] = match p.is_empty() {
                    true => Vec::new(),
                    false => p[r * e..(r + 1) * e].to_vec(),
                };
            }
            s.tokens.truncate(s.pos);
            s.tokens.push(tokens[r]);
            s.pos += 1;
        }
        finish_sets(sets, &layer_probs, &routed, n, track);
        Ok(picked)
    }

    /// Runs one token at position `state.pos`, appends it to the cache and returns the
    /// most probable next token. With resident sets that do not all live in the
    /// backend's memory the step runs as [`forward`](Self::forward) does.
    fn step(&self, state: &mut State<B>, token: u32, s: &Sampling) -> Result<u32, Error> {
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
            // `forward` refuses logits that are not finite.
            let position = state.pos as u64 + 1;
            let logits = self.forward(state, &[token], 0)?;
            let next = match s.is_greedy() && !s.penalizes() {
                true => argmax(&logits),
                false => {
                    let counts = sample::counts(&state.tokens[..state.pos], c.vocab_size);
                    sample::sample(&logits, &counts, s, position)
                }
            };
            return Ok(next);
        }
        let (e, l) = (c.moe.num_experts, self.layers.len());
        let bufs = state.step.get_or_insert_with(|| self.step_buffers());
        let at = [f32::from_bits(token), f32::from_bits(state.pos as u32)];
        b.upload_into(&at, &mut bufs.step);
        // A token boundary: landed loads commit before the step is issued.
        let mut sets = self.residency.as_ref().map(|r| r.begin(b));
        let track = sets.as_ref().is_some_and(|s| s.tracks());
        let key = (state.id, self.epoch ^ step_key(s, state.counts.is_some()));
        let (kc, vc) = (&mut state.k_cache, &mut state.v_cache);
        let pick = Pick {
            sampling: s,
            counts: state.counts.as_mut(),
        };
        let (_, host_probs) = self.run_step(bufs, kc, vc, key, pick, sets.as_mut());
        state.tokens.truncate(state.pos);
        state.tokens.push(token);
        state.pos += 1;

        // One read of the step's results: the router probabilities and the token.
        let mut host = vec![0.0f32; l * e + 1];
        b.download(&bufs.probs, &mut host);
        let token = self.step_results(&host, &bufs.routed, host_probs, &mut state.router_probs);
        finish_sets(sets, &state.router_probs, &bufs.routed, 1, track);
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
        mut pick: Pick<'_, B::Tensor>,
        mut sets: Option<&mut Step<'_, B>>,
    ) -> (bool, Vec<(usize, Vec<f32>)>) {
        let mut host_probs = Vec::new();
        // A step that picks its token on the host holds a copy back, which no record may.
        let s = pick.sampling;
        let device_pick = (s.is_greedy() && !s.penalizes()) || self.backend.samples_on_device();
        let recorded = if bufs.fit == Some(key.1) && device_pick {
            self.backend.replay_step(key, &mut || {
                let pick = Pick {
                    sampling: pick.sampling,
                    counts: pick.counts.as_deref_mut(),
                };
                let sets = sets.as_deref_mut();
                self.step_body(bufs, k_cache, v_cache, pick, &mut host_probs, sets)
            })
        } else {
            let fit = self.step_body(bufs, k_cache, v_cache, pick, &mut host_probs, sets);
            bufs.fit = fit.then_some(key.1);
            false
        };
        (recorded, host_probs)
    }

    /// The ops of one step: the pass over the layers, the final norm and the LM head, the
    /// token picked, and the step values moved on for the next step. Returns whether its
    /// layers queued nothing but backend work; MoE layers the backend cannot route run on
    /// the host, their probabilities pushed to `host_probs`.
    fn step_body(
        &self,
        bufs: &mut StepBuffers<B>,
        k_cache: &mut [B::Tensor],
        v_cache: &mut [B::Tensor],
        pick: Pick<'_, B::Tensor>,
        host_probs: &mut Vec<(usize, Vec<f32>)>,
        sets: Option<&mut Step<'_, B>>,
    ) -> bool {
        let (c, b) = (&self.config, &self.backend);
        let (h, e, l) = (c.hidden_size, c.moe.num_experts, self.layers.len());
        b.embed_at(self.embed_tokens.weight(), h, &bufs.step, &mut bufs.acts.x);
        let mut moe = MoeRun {
            sets,
            track: false,
            device_ok: true,
            probs: Some(&mut bufs.probs),
            observer: None,
            routed: Vec::new(),
            host: Vec::new(),
            device_only: true,
        };
        let pass = Pass::Step { step: &bufs.step };
        let mut caches = Caches::One {
            k: k_cache,
            v: v_cache,
        };
        self.run_layers(pass, 1, &mut bufs.acts, &mut caches, &mut moe);
        let fit = moe.device_only;
        bufs.routed = moe.routed;
        host_probs.extend(moe.host);
        let acts = &mut bufs.acts;
        let n = AddNorm {
            x: &acts.x,
            delta: (l > 0).then_some(&acts.delta),
            w: &self.norm,
            eps: c.rms_norm_eps,
        };
        let x_next = acts
            .x_next
            .as_mut()
            .expect("a step has a second residual buffer");
        let (head, v) = (self.head(), c.vocab_size);
        b.add_rms_norm_linear(n, x_next, &mut acts.xn, head, 1, h, v, &mut bufs.logits);
        let s = pick.sampling;
        let plain = s.is_greedy() && !s.penalizes();
        if plain {
            b.argmax_rows(&bufs.logits, 1, v, &mut bufs.probs, l * e);
        } else {
            let (step, out, counts) = (&bufs.step, &mut bufs.probs, pick.counts.as_deref());
            b.sample_at(&bufs.logits, v, s, counts, step, out, l * e);
        }
        if let Some(counts) = pick.counts {
            // The sequence holds the picked token from now on.
            b.count_token(counts, v, &bufs.probs, l * e);
        }
        // So that the record replays again with no upload between (`decode_queued`);
        // `step` uploads each step's values over it.
        b.advance_step(&mut bufs.step, &bufs.probs, l * e);
        fit
    }

    /// The queued steps of [`decode`](Self::decode): up to `n` tokens after `first`, `n`
    /// within the cache. When the first step did not run from a record it delivers that
    /// one token alone, unless `force`d to queue steps that run their body each time
    /// (which gives the same tokens, to test the loop on a backend that records nothing).
    fn decode_queued(
        &self,
        state: &mut State<B>,
        first: u32,
        n: usize,
        s: &Sampling,
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
            tokens,
            counts,
            ..
        } = state;
        let bufs = step.get_or_insert_with(|| self.step_buffers());
        let key = (*id, self.epoch ^ step_key(s, counts.is_some()));
        let start = [f32::from_bits(first), f32::from_bits(*pos as u32)];
        b.upload_into(&start, &mut bufs.step);
        let pick = Pick {
            sampling: s,
            counts: counts.as_mut(),
        };
        let (recorded, read) = self.queue_step(bufs, k_cache, v_cache, key, pick);
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
                let pick = Pick {
                    sampling: s,
                    counts: counts.as_mut(),
                };
                ahead = Some(self.queue_step(bufs, k_cache, v_cache, key, pick).1);
                queued += 1;
            }
            let host = b.finish_read(read);
            tokens.truncate(*pos);
            tokens.push(out.last);
            *pos += 1;
            out.delivered += 1;
            out.last = self.step_results(&host, &bufs.routed, host_probs, router_probs);
            // No token: the caller reports it; nothing more is handed over.
            if out.last == NOT_A_TOKEN || !on_token(out.last) {
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
        pick: Pick<'_, B::Tensor>,
    ) -> (bool, QueuedRead) {
        let (recorded, host_probs) = self.run_step(bufs, k_cache, v_cache, key, pick, None);
        let len = self.layers.len() * self.config.moe.num_experts + 1;
        let read = self.backend.read_async(&bufs.probs, len);
        (recorded, (read, host_probs))
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

    /// Readies `state`'s token counts for a decode that starts from `first` with `s`: the
    /// tokens up to `state.pos` and `first` counted, on the backend, when a penalty reads
    /// them. Made once a state, then written in place, so recorded steps keep reading
    /// them.
    fn ready_counts(&self, state: &mut State<B>, first: u32, s: &Sampling) {
        if !s.penalizes() {
            return;
        }
        let v = self.config.vocab_size;
        state.tokens.truncate(state.pos);
        let mut counts = sample::counts(&state.tokens, v);
        if let Some(c) = counts.get_mut(first as usize) {
            *c += 1;
        }
        let values: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let b = &self.backend;
        let t = state.counts.get_or_insert_with(|| b.alloc(v));
        b.upload_into(&values, t);
    }

    /// The buffers of a decode step, made on a state's first.
    fn step_buffers(&self) -> StepBuffers<B> {
        let (c, b) = (&self.config, &self.backend);
        StepBuffers {
            step: b.alloc(2),
            acts: Activations::new(b, c, 1, true),
            probs: b.alloc(self.layers.len() * c.moe.num_experts + 1),
            logits: b.alloc(c.vocab_size),
            routed: Vec::new(),
            fit: None,
        }
    }
}

/// What a recorded step is kept under besides its state and the model's routing: the
/// sampling settings it was recorded with (its launches hold them) and whether it counts
/// tokens.
fn step_key(s: &Sampling, counts: bool) -> u64 {
    if s.is_greedy() && !s.penalizes() && !counts {
        return 0;
    }
    let words = [
        s.temperature.to_bits() as u64,
        s.top_k as u64,
        s.top_p.to_bits() as u64,
        s.min_p.to_bits() as u64,
        s.repetition_penalty.to_bits() as u64,
        s.presence_penalty.to_bits() as u64,
        s.frequency_penalty.to_bits() as u64,
        s.seed,
        counts as u64,
    ];
    // FNV-1a over the words, then moved to the high bits, where epochs never reach.
    let h = words.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        (h ^ w).wrapping_mul(0x0000_0100_0000_01b3)
    });
    h | (1 << 63)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::model;
    use crate::model::argmax;
    use crate::testing::{fixture_dirs, greedy_reference, GreedyReference};

    /// The queued loop of `decode` forced on the CPU, which records no step
    /// and so never queues one otherwise: from a fresh state's first step and from a
    /// state that has run some, it gives the tokens, position and router probabilities of
    /// `step` called token by token; stopped early (one step past the stop
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
                    &Sampling::GREEDY,
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
                &Sampling::GREEDY,
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
            let next = model
                .step(&mut a, want[stop - 1], &Sampling::GREEDY)
                .unwrap();
            assert_eq!(next, want[stop], "{label}: a step after the stop");
            let logits = model.forward(&mut a, &[next], 0).unwrap();
            assert_eq!(argmax(&logits), want[stop + 1], "{label}: forward after it");
        }
    }

    /// Sampled decode with penalties, the steps one call at a time and queued (forced on
    /// the CPU, which records no step), against its definition: `forward` of each token
    /// and the host sampler on its logits, counting the prompt and every token fed.
    #[test]
    fn sampled_decode_is_the_host_sampler_on_forward_logits() {
        let prompt = [5u32, 17, 300, 42, 7, 99, 5, 17];
        let n = 12;
        let s = Sampling {
            temperature: 0.9,
            top_k: 50,
            top_p: 0.9,
            min_p: 0.01,
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            frequency_penalty: 0.2,
            seed: 1234,
        };
        for dir in fixture_dirs() {
            let m = model::load(&dir, Cpu::fast()).unwrap();
            let model = &m.model;
            let v = model.config.vocab_size;
            let label = dir.display();
            // The definition.
            let mut r = model.new_state(prompt.len() + n + 1);
            let mut fed = prompt.to_vec();
            let mut logits = model.forward(&mut r, &prompt, prompt.len() - 1).unwrap();
            let mut want = Vec::new();
            for _ in 0..=n {
                let counts = sample::counts(&fed, v);
                let t = sample::sample(&logits, &counts, &s, r.pos as u64);
                want.push(t);
                fed.push(t);
                logits = model.forward(&mut r, &[t], 0).unwrap();
            }
            let (first, want) = (want[0], &want[1..]);
            // One call at a time, and queued.
            for queued in [false, true] {
                let mut a = model.new_state(prompt.len() + n + 1);
                model.forward(&mut a, &prompt, prompt.len() - 1).unwrap();
                let mut got = Vec::new();
                if queued {
                    model.ready_counts(&mut a, first, &s);
                    let q = model.decode_queued(
                        &mut a,
                        first,
                        n,
                        &s,
                        &mut |t| {
                            got.push(t);
                            true
                        },
                        true,
                    );
                    assert_eq!(q.delivered, n, "{label}");
                } else {
                    let opts = DecodeOptions {
                        max_tokens: n,
                        sampling: s,
                    };
                    model
                        .decode(&mut [Decoding::new(&mut a, first, opts)], &mut |_, t| {
                            got.push(t);
                            true
                        })
                        .unwrap();
                }
                assert_eq!(&got, want, "{label}, queued {queued}");
                assert_eq!(a.pos, prompt.len() + n, "{label}");
            }
        }
    }
}
