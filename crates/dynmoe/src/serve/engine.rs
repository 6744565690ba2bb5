//! The scheduler: one thread owns the model's compute and serves every sequence.
//!
//! Requests wait in a bounded queue; up to `max_sequences` of them are active at once,
//! each with its own KV cache, and each scheduler step runs one forward per active
//! sequence (its prompt on the first step, one token after that) before admitting
//! more. The forward takes one sequence's state, so sequences are interleaved token by
//! token rather than batched into one matrix product; because every sequence sees
//! exactly the calls it would see alone, greedy outputs do not depend on what else is
//! being served. All sequences share the one model object, and through it whatever
//! resident state the model keeps.
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
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_sequences: 4,
            queue_capacity: 64,
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
}

struct Pending {
    request: Request,
    events: UnboundedSender<Event>,
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
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            metrics: Metrics::default(),
            options,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("dynmoe-scheduler".into())
            .spawn(move || schedule(&model, &s))
            .expect("spawning the scheduler thread");
        Engine {
            shared,
            thread: Some(thread),
        }
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(&self, request: Request) -> Result<UnboundedReceiver<Event>, QueueFull> {
        assert!(!request.prompt.is_empty(), "a request needs a prompt");
        assert!(
            request.max_tokens > 0,
            "a request generates at least one token"
        );
        let m = &self.shared.metrics;
        let mut q = self.shared.queue.lock().expect("queue lock");
        if q.waiting.len() >= self.shared.options.queue_capacity {
            m.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(QueueFull {
                capacity: self.shared.options.queue_capacity,
            });
        }
        let (events, rx) = unbounded_channel();
        q.waiting.push_back(Pending { request, events });
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

/// One active sequence.
struct Sequence<B: Backend> {
    request: Request,
    events: UnboundedSender<Event>,
    state: State<B>,
    /// The prompt, until its prefill; then the last token, which the next decode step
    /// feeds.
    feed: Vec<u32>,
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
                while active.len() < shared.options.max_sequences {
                    let Some(p) = q.waiting.pop_front() else {
                        break;
                    };
                    if p.events.is_closed() {
                        m.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let capacity = p.request.prompt.len() + p.request.max_tokens;
                    active.push(Sequence {
                        state: model.model.new_state(capacity),
                        feed: p.request.prompt.clone(),
                        out: TextStream::default(),
                        request: p.request,
                        events: p.events,
                    });
                }
                m.queue_depth
                    .store(q.waiting.len() as u64, Ordering::Relaxed);
                m.active_sequences
                    .store(active.len() as u64, Ordering::Relaxed);
                if !active.is_empty() {
                    break;
                }
                q = shared.wake.wait(q).expect("queue lock");
            }
        }
        let t = Instant::now();
        active.retain_mut(|s| {
            let counter = match step(model, s, m) {
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
    }
}

/// One forward of one sequence and the token it yields.
fn step<B: Backend>(model: &LoadedModel<B>, s: &mut Sequence<B>, m: &Metrics) -> Step {
    if s.events.is_closed() {
        return Step::Cancelled;
    }
    let next = match next_token(model, s) {
        Ok(t) => t,
        Err(e) => {
            let _ = s.events.send(Event::Failed(e.to_string()));
            return Step::Failed;
        }
    };
    if s.out.tokens().is_empty() {
        m.prompt_tokens
            .fetch_add(s.feed.len() as u64, Ordering::Relaxed);
    }
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
    s.feed.clear();
    s.feed.push(next);

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

/// The sequence's next token: the prompt's prefill and the host sampler on its last
/// logits, then one decode step a call (recorded and replayed where the backend can).
fn next_token<B: Backend>(model: &LoadedModel<B>, s: &mut Sequence<B>) -> Result<u32, Error> {
    let sampling = s.request.sampling;
    if s.out.tokens().is_empty() {
        let logits = model
            .model
            .forward(&mut s.state, &s.feed, s.feed.len() - 1)?;
        let vocab = model.model.config.vocab_size;
        let counts = match sampling.penalizes() {
            true => sample::counts(&s.feed, vocab),
            false => Vec::new(),
        };
        return Ok(sample::sample(
            &logits[..vocab],
            &counts,
            &sampling,
            s.state.pos as u64,
        ));
    }
    let mut next = None;
    let opts = DecodeOptions {
        max_tokens: 1,
        sampling,
    };
    model.model.decode(
        &mut [Decoding::new(&mut s.state, s.feed[0], opts)],
        &mut |_, t| {
            next = Some(t);
            true
        },
    )?;
    Ok(next.expect("one token decoded"))
}

/// Sends the last text and the end. The request is counted complete and its sequence
/// inactive before the end goes out, so a client that reads `/metrics` right after its
/// reply sees them; a client already gone is moved to the cancelled count instead.
fn finish<B: Backend>(s: &Sequence<B>, piece: String, done: Event, m: &Metrics) -> Step {
    if !piece.is_empty() && s.events.send(Event::Text(piece)).is_err() {
        return Step::Cancelled;
    }
    m.completed.fetch_add(1, Ordering::Relaxed);
    let _ = m
        .active_sequences
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(1))
        });
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
