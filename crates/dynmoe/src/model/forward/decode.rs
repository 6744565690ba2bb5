//! Decoding: [`Model::decode`] produces the tokens after a prompt, each one step of the
//! pass over the layers ([`Pass::Step`]). A step's token and position live in backend
//! memory and its argmax runs on the backend, so no host round trip happens before the
//! next token is known, and a backend that records a step (a CUDA graph) replays it.

use super::{finish_sets, Activations, Model, MoeRun, Pass, State};
use crate::backend::{AddNorm, Backend, PendingRead, NOT_A_TOKEN};
use crate::model::{argmax, Error};
use crate::residency::Step;

/// How [`Model::decode`] produces tokens: greedily, for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Tokens to produce at most.
    pub max_tokens: usize,
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
    /// Whether the last run queued nothing but backend work (every MoE layer routed on
    /// the backend, no dense feed-forward layer): then it may be recorded.
    fit: bool,
}

impl<B: Backend> Model<B> {
    /// Decodes up to `opts.max_tokens` tokens after `first` (the token at position
    /// `state.pos`), each handed to `on_token` as it is chosen; `on_token` returning
    /// `false` stops there. Returns how many tokens were handed over; `state.pos` and
    /// `state.router_probs` are those of the last one's step.
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
    pub fn decode(
        &self,
        state: &mut State<B>,
        first: u32,
        opts: DecodeOptions,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize, Error> {
        self.check_stores()?;
        let n = opts.max_tokens;
        let mut done = 0;
        let mut token = first;
        let mut queue = self.residency.is_none();
        while done < n {
            let fit = state.step.as_ref().is_some_and(|s| s.fit);
            let room = state.capacity.saturating_sub(state.pos).min(n - done);
            // One step left gains nothing from queueing; one past the cache is left to
            // `step`'s error.
            if queue && fit && room > 1 && (token as usize) < self.config.vocab_size {
                let q = self.decode_queued(state, token, room, on_token, false);
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
            token = self.step(state, token)?;
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

    /// Runs one token at position `state.pos`, appends it to the cache and returns the
    /// most probable next token. With resident sets that do not all live in the
    /// backend's memory the step runs as [`forward`](Self::forward) does.
    fn step(&self, state: &mut State<B>, token: u32) -> Result<u32, Error> {
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
            let logits = self.forward(state, &[token], 0)?;
            return Ok(argmax(&logits));
        }
        let (e, l) = (c.moe.num_experts, self.layers.len());
        let bufs = state.step.get_or_insert_with(|| self.step_buffers());
        let at = [f32::from_bits(token), f32::from_bits(state.pos as u32)];
        b.upload_into(&at, &mut bufs.step);
        // A token boundary: landed loads commit before the step is issued.
        let mut sets = self.residency.as_ref().map(|r| r.begin(b));
        let track = sets.as_ref().is_some_and(|s| s.tracks());
        let key = (state.id, self.epoch);
        let (kc, vc) = (&mut state.k_cache, &mut state.v_cache);
        let (_, host_probs) = self.run_step(bufs, kc, vc, key, sets.as_mut());
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

    /// The ops of one step: the pass over the layers, the final norm and the LM head, the
    /// argmax, and the step values moved on for the next step. Returns whether it queued
    /// nothing but backend work; MoE layers the backend cannot route run on the host,
    /// their probabilities pushed to `host_probs`.
    fn step_body(
        &self,
        bufs: &mut StepBuffers<B>,
        k_cache: &mut [B::Tensor],
        v_cache: &mut [B::Tensor],
        host_probs: &mut Vec<(usize, Vec<f32>)>,
        sets: Option<&mut Step<'_, B>>,
    ) -> bool {
        let (c, b) = (&self.config, &self.backend);
        let (h, e, l) = (c.hidden_size, c.moe.num_experts, self.layers.len());
        b.embed_at(&self.embed_tokens, h, &bufs.step, &mut bufs.acts.x);
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
        self.run_layers(pass, 1, &mut bufs.acts, k_cache, v_cache, &mut moe);
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
        b.argmax_rows(&bufs.logits, 1, v, &mut bufs.probs, l * e);
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
    ) -> (bool, QueuedRead) {
        let (recorded, host_probs) = self.run_step(bufs, k_cache, v_cache, key, None);
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

    /// The buffers of a decode step, made on a state's first.
    fn step_buffers(&self) -> StepBuffers<B> {
        let (c, b) = (&self.config, &self.backend);
        StepBuffers {
            step: b.alloc(2),
            acts: Activations::new(b, c, 1, true),
            probs: b.alloc(self.layers.len() * c.moe.num_experts + 1),
            logits: b.alloc(c.vocab_size),
            routed: Vec::new(),
            fit: false,
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

#[cfg(test)]
mod tests {
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
            let next = model.step(&mut a, want[stop - 1]).unwrap();
            assert_eq!(next, want[stop], "{label}: a step after the stop");
            let logits = model.forward(&mut a, &[next], 0).unwrap();
            assert_eq!(argmax(&logits), want[stop + 1], "{label}: forward after it");
        }
    }
}
