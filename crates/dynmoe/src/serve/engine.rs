//! The scheduler: one thread owns the model's compute and serves every sequence.
//!
//! Requests wait in a bounded queue; up to `max_sequences` of them are active at once,
//! each with its own KV cache, and with a KV budget only as many as their caches fit in
//! it: the request at the head of the queue joins once the caches of the active
//! sequences and its own fit (first in, first out: a smaller one behind it waits too), and
//! a request whose cache alone is larger than the budget is refused when submitted.
//! Sequences join and leave between scheduler rounds, and a round runs one chunk of at
//! most [`PREFILL_CHUNK`] prompt tokens of one new sequence (so a long prompt never
//! stalls the others for long), then one decode step of every
//! sequence past its prompt together: one pass over the layers with a row a sequence
//! (`Model::decode`). All sequences share the one model object, and through it whatever
//! resident state the model keeps, which every sequence's routing feeds.
//!
//! A sequence whose receiver is gone (the client disconnected) is dropped at the start
//! of the next step, freeing its cache.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::backend::sample;
use crate::backend::sample::Sampling;
use crate::backend::Backend;
use crate::model::{DecodeOptions, Decoding, Error, LoadedModel, State};
use crate::runtime::generate::TextStream;

/// How much the engine takes on.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Sequences generated at the same time.
    pub max_sequences: usize,
    /// Requests that may wait for a free sequence; one more is refused.
    pub queue_capacity: usize,
    /// Bytes the KV caches of the active sequences may take together
    /// ([`Model::state_bytes`](crate::model::Model::state_bytes) of each one's prompt plus
    /// `max_tokens`); `None` bounds them only by `max_sequences`.
    pub kv_budget: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_sequences: 4,
            queue_capacity: 64,
            kv_budget: None,
        }
    }
}

/// One generation to run.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    /// Sampler settings.
    pub sampling: Sampling,
    /// Tokens that end generation (not part of the output).
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation; the output stops before the first one.
    pub stop_strings: Vec<String>,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What the engine sends back about one request, in order: pieces of text, then one
/// `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// More output text.
    Text(String),
    /// Generation ended normally.
    Done {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens (stop tokens excluded).
        completion_tokens: usize,
    },
    /// The forward pass failed.
    Failed(String),
}

/// The queue is full; the request was not taken.
#[derive(Debug, thiserror::Error)]
#[error("the request queue is full ({capacity} waiting)")]
pub struct QueueFull {
    /// The queue's capacity.
    pub capacity: usize,
}

/// The request's KV cache alone is larger than the whole KV budget: it could never run,
/// so it was not taken.
#[derive(Debug, thiserror::Error)]
#[error(
    "this request's KV cache (its prompt and max_tokens, {positions} positions) needs {} MiB, more than the server's whole KV budget of {} MiB",
    mib(*.need),
    mib(*.budget)
)]
pub struct OverBudget {
    /// Positions the request's cache holds: its prompt plus `max_tokens`.
    pub positions: usize,
    /// Bytes its cache takes.
    pub need: usize,
    /// The budget, bytes.
    pub budget: usize,
}

/// Why [`Engine::submit`] did not take a request.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The queue is full: later, it may be taken.
    #[error(transparent)]
    QueueFull(#[from] QueueFull),
    /// The request needs more KV cache than the budget: as it is, it never will be.
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
}

/// `bytes` in MiB as a person reads them: whole MiB from 100 up, fewer digits the larger.
pub fn mib(bytes: usize) -> String {
    let m = bytes as f64 / (1u64 << 20) as f64;
    if m >= 100.0 {
        format!("{m:.0}")
    } else if m >= 1.0 {
        format!("{m:.1}")
    } else {
        format!("{m:.3}")
    }
}

/// Counters since the engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Requests accepted into the queue.
    pub requests: u64,
    /// Requests refused because the queue was full.
    pub rejected: u64,
    /// Requests whose client went away before the end.
    pub cancelled: u64,
    /// Requests that ended with a forward-pass error.
    pub failed: u64,
    /// Requests generated to the end.
    pub completed: u64,
    /// Prompt tokens run through the model.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Seconds the scheduler spent running forwards.
    pub busy_seconds: f64,
    /// Requests waiting now.
    pub queue_depth: u64,
    /// Sequences being generated now.
    pub active_sequences: u64,
    /// Bytes of KV cache the active sequences hold now.
    pub kv_bytes: u64,
    /// The KV budget, bytes; `None` when unbounded.
    pub kv_budget: Option<u64>,
}

#[derive(Default)]
struct Metrics {
    requests: AtomicU64,
    rejected: AtomicU64,
    cancelled: AtomicU64,
    failed: AtomicU64,
    completed: AtomicU64,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    busy_nanos: AtomicU64,
    queue_depth: AtomicU64,
    active_sequences: AtomicU64,
    kv_bytes: AtomicU64,
}

struct Pending {
    request: Request,
    events: UnboundedSender<Event>,
    /// Bytes of its KV cache.
    kv: usize,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    metrics: Metrics,
    options: EngineOptions,
    /// [`Model::state_bytes`](crate::model::Model::state_bytes) of the model served.
    state_bytes: Box<dyn Fn(usize) -> usize + Send + Sync>,
}

/// The scheduler thread and its queue. Dropping it stops the thread once the current
/// step ends; requests still queued get no answer (their receivers close).
pub struct Engine {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the scheduler thread serving `model`.
    pub fn start<B: Backend + 'static>(
        model: Arc<LoadedModel<B>>,
        options: EngineOptions,
    ) -> Engine {
        let options = EngineOptions {
            max_sequences: options.max_sequences.max(1),
            ..options
        };
        let sizer = model.clone();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            metrics: Metrics::default(),
            options,
            state_bytes: Box::new(move |capacity| sizer.model.state_bytes(capacity)),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("dynmoe-scheduler".into())
            .spawn(move || crate::backend::cpu::run_as_pool_thread(|| schedule(&model, &s)))
            .expect("spawning the scheduler thread");
        Engine {
            shared,
            thread: Some(thread),
        }
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request. A request whose KV cache alone exceeds the budget is
    /// refused ([`Refused::OverBudget`]), as is one that finds the queue full.
    pub fn submit(&self, request: Request) -> Result<UnboundedReceiver<Event>, Refused> {
        assert!(!request.prompt.is_empty(), "a request needs a prompt");
        assert!(
            request.max_tokens > 0,
            "a request generates at least one token"
        );
        let positions = request.prompt.len().saturating_add(request.max_tokens);
        let kv = (self.shared.state_bytes)(positions);
        if let Some(budget) = self.shared.options.kv_budget.filter(|&b| kv > b) {
            return Err(OverBudget {
                positions,
                need: kv,
                budget,
            }
            .into());
        }
        let m = &self.shared.metrics;
        let mut q = self.shared.queue.lock().expect("queue lock");
        if q.waiting.len() >= self.shared.options.queue_capacity {
            m.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(QueueFull {
                capacity: self.shared.options.queue_capacity,
            }
            .into());
        }
        let (events, rx) = unbounded_channel();
        q.waiting.push_back(Pending {
            request,
            events,
            kv,
        });
        m.requests.fetch_add(1, Ordering::Relaxed);
        m.queue_depth
            .store(q.waiting.len() as u64, Ordering::Relaxed);
        self.shared.wake.notify_one();
        Ok(rx)
    }

    /// The options in force.
    pub fn options(&self) -> EngineOptions {
        self.shared.options
    }

    /// Counters and gauges now.
    pub fn counters(&self) -> Counters {
        let m = &self.shared.metrics;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            requests: get(&m.requests),
            rejected: get(&m.rejected),
            cancelled: get(&m.cancelled),
            failed: get(&m.failed),
            completed: get(&m.completed),
            prompt_tokens: get(&m.prompt_tokens),
            generated_tokens: get(&m.generated_tokens),
            busy_seconds: get(&m.busy_nanos) as f64 * 1e-9,
            queue_depth: get(&m.queue_depth),
            active_sequences: get(&m.active_sequences),
            kv_bytes: get(&m.kv_bytes),
            kv_budget: self.shared.options.kv_budget.map(|b| b as u64),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.queue.lock().expect("queue lock").shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Prompt tokens a scheduler round runs of a new sequence.
pub const PREFILL_CHUNK: usize = 256;

/// One active sequence.
struct Sequence<B: Backend> {
    request: Request,
    events: UnboundedSender<Event>,
    state: State<B>,
    /// Bytes of `state`'s KV cache, as the budget counts them.
    kv: usize,
    /// The last token, which the next decode step feeds; `None` while the prompt runs.
    fed: Option<u32>,
    out: TextStream,
}

/// What a step left of a sequence.
enum Step {
    Continue,
    Finished,
    Cancelled,
    Failed,
}

fn schedule<B: Backend>(model: &LoadedModel<B>, shared: &Shared) {
    let m = &shared.metrics;
    let mut active: Vec<Sequence<B>> = Vec::new();
    loop {
        {
            let mut q = shared.queue.lock().expect("queue lock");
            loop {
                if q.shutdown {
                    return;
                }
                let mut kv: usize = active.iter().map(|s| s.kv).sum();
                while active.len() < shared.options.max_sequences {
                    let Some(p) = q.waiting.front() else {
                        break;
                    };
                    if p.events.is_closed() {
                        q.waiting.pop_front();
                        m.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    // The head waits until its cache fits beside the active ones', and
                    // everything behind it with it. It always fits once none is active:
                    // `submit` refuses what could not.
                    if let Some(budget) = shared.options.kv_budget {
                        if kv + p.kv > budget {
                            break;
                        }
                    }
                    let p = q.waiting.pop_front().expect("the head of the queue");
                    let capacity = p.request.prompt.len() + p.request.max_tokens;
                    kv += p.kv;
                    active.push(Sequence {
                        state: model.model.new_state(capacity),
                        kv: p.kv,
                        fed: None,
                        out: TextStream::default(),
                        request: p.request,
                        events: p.events,
                    });
                }
                m.queue_depth
                    .store(q.waiting.len() as u64, Ordering::Relaxed);
                m.active_sequences
                    .store(active.len() as u64, Ordering::Relaxed);
                m.kv_bytes.store(kv as u64, Ordering::Relaxed);
                if !active.is_empty() {
                    break;
                }
                q = shared.wake.wait(q).expect("queue lock");
            }
        }
        let t = Instant::now();
        let outcomes = round(model, &mut active, m);
        let mut outcomes = outcomes.into_iter();
        active.retain(|_| {
            let counter = match outcomes.next().expect("an outcome a sequence") {
                Step::Continue => return true,
                // Counted by `finish`, before the client could see the end.
                Step::Finished => return false,
                Step::Cancelled => &m.cancelled,
                Step::Failed => &m.failed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            false
        });
        m.busy_nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        m.active_sequences
            .store(active.len() as u64, Ordering::Relaxed);
        let kv: usize = active.iter().map(|s| s.kv).sum();
        m.kv_bytes.store(kv as u64, Ordering::Relaxed);
    }
}

/// One scheduler round over the active sequences: a chunk of one prompt, then one
/// decode step of every sequence past its prompt, together. Returns each sequence's
/// outcome, in order.
fn round<B: Backend>(model: &LoadedModel<B>, active: &mut [Sequence<B>], m: &Metrics) -> Vec<Step> {
    let mut outcomes: Vec<Option<Step>> = active
        .iter()
        .map(|s| s.events.is_closed().then_some(Step::Cancelled))
        .collect();
    if let Some(i) = (0..active.len()).find(|&i| outcomes[i].is_none() && active[i].fed.is_none()) {
        outcomes[i] = prefill_chunk(model, &mut active[i], m);
    }
    let decoding: Vec<usize> = (0..active.len())
        .filter(|&i| outcomes[i].is_none() && active[i].fed.is_some())
        .collect();
    if !decoding.is_empty() {
        let mut next = vec![0u32; decoding.len()];
        let mut seqs: Vec<Decoding<'_, B>> = active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| decoding.contains(i))
            .map(|(_, s)| {
                let opts = DecodeOptions {
                    max_tokens: 1,
                    sampling: s.request.sampling,
                };
                Decoding::new(&mut s.state, s.fed.expect("past its prompt"), opts)
            })
            .collect();
        let result = model.model.decode(&mut seqs, &mut |r, t| {
            next[r] = t;
            true
        });
        drop(seqs);
        for (r, &i) in decoding.iter().enumerate() {
            outcomes[i] = Some(match &result {
                Ok(_) => after_token(model, &mut active[i], next[r], m),
                Err(e) => fail(&active[i], e),
            });
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Step::Continue))
        .collect()
}

/// Runs the next chunk of a sequence's prompt; after the last, picks its first token from
/// the prompt's last logits. `None` while the prompt is not done.
fn prefill_chunk<B: Backend>(
    model: &LoadedModel<B>,
    s: &mut Sequence<B>,
    m: &Metrics,
) -> Option<Step> {
    let prompt = &s.request.prompt;
    let from = s.state.pos;
    let to = (from + PREFILL_CHUNK).min(prompt.len());
    let last = to == prompt.len();
    let chunk = &prompt[from..to];
    let logits_from = if last { chunk.len() - 1 } else { chunk.len() };
    let logits = match model.model.forward(&mut s.state, chunk, logits_from) {
        Ok(l) => l,
        Err(e) => return Some(fail(s, &e)),
    };
    m.prompt_tokens
        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
    if !last {
        return None;
    }
    let sampling = s.request.sampling;
    let vocab = model.model.config.vocab_size;
    let counts = match sampling.penalizes() {
        true => sample::counts(prompt, vocab),
        false => Vec::new(),
    };
    let first = sample::sample(&logits[..vocab], &counts, &sampling, s.state.pos as u64);
    Some(after_token(model, s, first, m))
}

/// The generation failed: the client is told.
fn fail<B: Backend>(s: &Sequence<B>, e: &Error) -> Step {
    let _ = s.events.send(Event::Failed(e.to_string()));
    Step::Failed
}

/// A token the sequence produced: its end, or its text handed out (all but a possible
/// start of a stop string) and the token kept for the next step.
fn after_token<B: Backend>(
    model: &LoadedModel<B>,
    s: &mut Sequence<B>,
    next: u32,
    m: &Metrics,
) -> Step {
    let r = &s.request;
    let done = |s: &Sequence<B>, reason: FinishReason| Event::Done {
        reason,
        prompt_tokens: s.request.prompt.len(),
        completion_tokens: s.out.tokens().len(),
    };
    if r.stop_tokens.contains(&next) {
        let rest = s.out.take_rest().to_string();
        return finish(s, rest, done(s, FinishReason::Stop), m);
    }
    if let Err(e) = s.out.push(&model.tokenizer, next) {
        let _ = s.events.send(Event::Failed(e.to_string()));
        return Step::Failed;
    }
    m.generated_tokens.fetch_add(1, Ordering::Relaxed);
    s.fed = Some(next);
    let r = &s.request;
    if let Some(at) = first_stop(s.out.text(), s.out.shown(), &r.stop_strings) {
        let piece = s.out.take_until(at).to_string();
        return finish(s, piece, done(s, FinishReason::Stop), m);
    }
    if s.out.tokens().len() >= r.max_tokens {
        let rest = s.out.take_rest().to_string();
        return finish(s, rest, done(s, FinishReason::Length), m);
    }
    let hold = stop_prefix_len(s.out.text(), &r.stop_strings);
    let piece = s.out.take(hold);
    if !piece.is_empty() && s.events.send(Event::Text(piece.to_string())).is_err() {
        return Step::Cancelled;
    }
    Step::Continue
}

/// Sends the last text and the end. The request is counted complete and its sequence
/// inactive (its KV cache no longer in use) before the end goes out, so a client that
/// reads `/metrics` right after its reply sees them; a client already gone is moved to
/// the cancelled count instead.
fn finish<B: Backend>(s: &Sequence<B>, piece: String, done: Event, m: &Metrics) -> Step {
    if !piece.is_empty() && s.events.send(Event::Text(piece)).is_err() {
        return Step::Cancelled;
    }
    m.completed.fetch_add(1, Ordering::Relaxed);
    let release = |gauge: &AtomicU64, by: u64| {
        let _ = gauge.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(by))
        });
    };
    release(&m.active_sequences, 1);
    release(&m.kv_bytes, s.kv as u64);
    match s.events.send(done) {
        Ok(()) => Step::Finished,
        Err(_) => {
            m.completed.fetch_sub(1, Ordering::Relaxed);
            m.cancelled.fetch_add(1, Ordering::Relaxed);
            Step::Finished
        }
    }
}

/// Byte offset of the earliest stop string in `text` that does not start inside
/// text already handed out (text handed out never holds the start of a stop string).
fn first_stop(text: &str, shown: usize, stops: &[String]) -> Option<usize> {
    let from = stops
        .iter()
        .map(|s| s.len())
        .max()
        .map_or(shown, |longest| shown.saturating_sub(longest));
    let from = (0..=from)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
        .filter(|&at| at >= shown)
        .min()
}

/// Length of the longest end of `text` that begins some stop string: text that may yet
/// turn into a stop and so is not handed out.
fn stop_prefix_len(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|s| (1..s.len()).rev().map(move |n| &s.as_bytes()[..n]))
        .filter(|p| text.as_bytes().ends_with(p))
        .map(<[u8]>::len)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn a_stop_string_is_found_where_it_starts() {
        let st = stops(&["\n\n", "END"]);
        assert_eq!(first_stop("abc END x\n\n", 0, &st), Some(4));
        assert_eq!(first_stop("abc EN", 0, &st), None);
        // Text already shown cannot hold a stop's start.
        assert_eq!(first_stop("END then END", 4, &st), Some(9));
    }

    #[test]
    fn the_possible_start_of_a_stop_is_held_back() {
        let st = stops(&["END", "\n\n"]);
        assert_eq!(stop_prefix_len("abc EN", &st), 2);
        assert_eq!(stop_prefix_len("abc E", &st), 1);
        assert_eq!(stop_prefix_len("abc\n", &st), 1);
        assert_eq!(stop_prefix_len("abc", &st), 0);
        assert_eq!(stop_prefix_len("abc", &[]), 0);
    }
}
