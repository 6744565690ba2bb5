//! The engine's KV budget: requests join only while the KV caches of the active sequences
//! and theirs fit in it, in the order they came, and one whose cache alone is larger than
//! the budget is refused when submitted (400 over HTTP).
//!
//! Which request ran when is read off the events' channels without clocks: the channels
//! are drained newest request first, so a request seen to have started must find every
//! request before it finished by the time those are drained (were it not so, the later
//! request's first event was sent before an earlier one's end).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::UnboundedReceiver;

use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Cpu;
use dynmoe::model::{self, LoadedModel};
use dynmoe::serve::engine::{mib, Engine, EngineOptions, Event, FinishReason, Refused, Request};
use dynmoe::serve::{metrics, spawn, Running, ServeOptions};
use dynmoe::testing::fixture;

fn model() -> Arc<LoadedModel<Cpu>> {
    static M: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    M.get_or_init(|| {
        Arc::new(model::load(&fixture("tiny-moe"), Cpu::fast()).expect("tiny-moe loads"))
    })
    .clone()
}

const PROMPT: [u32; 4] = [5, 17, 300, 42];

/// A greedy request of `positions` positions (the prompt and `max_tokens`) that runs to
/// `max_tokens`.
fn request(positions: usize) -> Request {
    Request {
        prompt: PROMPT.to_vec(),
        max_tokens: positions - PROMPT.len(),
        sampling: Sampling::GREEDY,
        stop_tokens: Vec::new(),
        stop_strings: Vec::new(),
    }
}

fn engine(kv_budget: Option<usize>) -> Engine {
    Engine::start(
        model(),
        EngineOptions {
            max_sequences: 4,
            queue_capacity: 8,
            kv_budget,
        },
    )
}

/// Every event in `rx` now, after `seen`; the channel closes after the end.
fn drain(rx: &mut UnboundedReceiver<Event>, seen: &mut Vec<Event>) {
    loop {
        match rx.try_recv() {
            Ok(e) => seen.push(e),
            Err(TryRecvError::Empty) => return,
            Err(TryRecvError::Disconnected) => {
                let ended = matches!(seen.last(), Some(Event::Done { .. }));
                assert!(ended, "the engine dropped a request: {seen:?}");
                return;
            }
        }
    }
}

/// Runs the requests behind `rxs` (submitted in this order, each fitting the budget only
/// alone) to their ends, checking as they go that each began only after every one before
/// it had finished, that one sequence at most was active, and that the KV gauge only ever
/// read nothing or `need[i]` of the one running. Returns each request's events.
fn run_one_at_a_time(
    engine: &Engine,
    mut rxs: Vec<UnboundedReceiver<Event>>,
    need: &[usize],
) -> Vec<Vec<Event>> {
    let n = rxs.len();
    let mut events = vec![Vec::new(); n];
    let mut gauge_seen = vec![false; n];
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let c = engine.counters();
        assert!(c.active_sequences <= 1, "{c:?}");
        assert!(
            c.kv_bytes == 0 || need.contains(&(c.kv_bytes as usize)),
            "the KV gauge read {} with the caches {need:?} one at a time",
            c.kv_bytes
        );
        for (seen, &b) in gauge_seen.iter_mut().zip(need) {
            *seen |= b as u64 == c.kv_bytes;
        }
        for (i, rx) in rxs.iter_mut().enumerate().rev() {
            drain(rx, &mut events[i]);
        }
        let done: Vec<bool> = events
            .iter()
            .map(|e| matches!(e.last(), Some(Event::Done { .. })))
            .collect();
        for i in (0..n).filter(|&i| !events[i].is_empty()) {
            let unfinished: Vec<usize> = (0..i).filter(|&j| !done[j]).collect();
            assert!(
                unfinished.is_empty(),
                "request {i} produced {:?} while requests {unfinished:?} before it were still running",
                events[i][0]
            );
        }
        if done.iter().all(|&d| d) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the requests did not end: {events:?}"
        );
        std::thread::yield_now();
    }
    let c = engine.counters();
    assert_eq!(
        (c.active_sequences, c.kv_bytes, c.queue_depth),
        (0, 0, 0),
        "{c:?}"
    );
    assert_eq!(c.completed, n as u64, "{c:?}");
    // Requests as long as these are seen running many times over; a gauge never seen at
    // a request's cache was not kept.
    assert!(
        gauge_seen.iter().all(|&s| s),
        "the KV gauge never read some of {need:?}: {gauge_seen:?}"
    );
    events
}

fn assert_ran_to_length(events: &[Event], positions: usize) {
    match events.last() {
        Some(&Event::Done {
            reason,
            prompt_tokens,
            completion_tokens,
        }) => {
            assert_eq!(reason, FinishReason::Length);
            assert_eq!(prompt_tokens, PROMPT.len());
            assert_eq!(completion_tokens, positions - PROMPT.len());
        }
        other => panic!("the request ended with {other:?}"),
    }
}

#[test]
fn two_requests_that_fit_the_budget_only_one_at_a_time_run_one_after_the_other() {
    let positions = 400;
    let need = model().model.state_bytes(positions);
    // Room for one and a half caches: the second waits for the first.
    let budget = need + need / 2;
    let e = engine(Some(budget));
    let rxs = vec![
        e.submit(request(positions)).unwrap(),
        e.submit(request(positions)).unwrap(),
    ];
    let events = run_one_at_a_time(&e, rxs, &[need, need]);
    for ev in &events {
        assert_ran_to_length(ev, positions);
    }
    // Greedy from the same prompt, alone in the model: the same text.
    assert_eq!(events[0], events[1]);
    let c = e.counters();
    assert_eq!(c.kv_budget, Some(budget as u64));
    assert_eq!(c.requests, 2);
}

#[test]
fn a_smaller_request_does_not_overtake_the_one_waiting_at_the_head() {
    // The first takes 60% of the budget and the second all of it, so the second waits
    // for the first; the third would fit beside the first but comes after the second.
    let (a, b, c) = (600, 1000, 300);
    let m = model();
    let need = [a, b, c].map(|p| m.model.state_bytes(p));
    let e = engine(Some(need[1]));
    let rxs = vec![
        e.submit(request(a)).unwrap(),
        e.submit(request(b)).unwrap(),
        e.submit(request(c)).unwrap(),
    ];
    let events = run_one_at_a_time(&e, rxs, &need);
    for (ev, p) in events.iter().zip([a, b, c]) {
        assert_ran_to_length(ev, p);
    }
}

#[test]
fn a_request_larger_than_the_whole_budget_is_refused_when_submitted() {
    let m = model();
    let budget = m.model.state_bytes(64);
    let e = engine(Some(budget));
    match e.submit(request(65)) {
        Err(Refused::OverBudget(over)) => {
            assert_eq!(over.positions, 65);
            assert_eq!(over.need, m.model.state_bytes(65));
            assert_eq!(over.budget, budget);
            let message = over.to_string();
            for part in [
                format!("needs {} MiB", mib(over.need)),
                format!("budget of {} MiB", mib(budget)),
            ] {
                assert!(message.contains(&part), "{message:?} lacks {part:?}");
            }
        }
        Err(other) => panic!("refused as {other:?}"),
        Ok(_) => panic!("a request larger than the budget was taken"),
    }
    // It was never queued; one that fits exactly is taken and runs.
    assert_eq!(e.counters().requests, 0);
    let mut rx = e.submit(request(64)).unwrap();
    let mut last = None;
    while let Some(ev) = rx.blocking_recv() {
        last = Some(ev);
    }
    assert!(matches!(last, Some(Event::Done { .. })), "{last:?}");
    // Without a budget the same request is taken.
    assert!(engine(None).submit(request(65)).is_ok());
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

fn post(s: &Running, path: &str, body: &Value) -> (u16, Option<String>, Value) {
    let mut resp = agent()
        .post(format!("http://{}{path}", s.addr()))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .expect("the server answers");
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    let text = resp.body_mut().read_to_string().unwrap();
    (
        status,
        retry,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn metric(s: &Running, name: &str) -> Option<f64> {
    let text = agent()
        .get(format!("http://{}/metrics", s.addr()))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    metrics::value_of(&text, name)
}

#[test]
fn over_http_a_request_larger_than_the_budget_gets_400_naming_the_need_and_the_budget() {
    let m = model();
    let budget = m.model.state_bytes(64);
    let mut opts = ServeOptions::for_model(&m, "tiny-moe");
    opts.engine.kv_budget = Some(budget);
    let s = spawn(m.clone(), opts, "127.0.0.1:0").expect("the server starts");

    let prompt = "Call me Ishmael.";
    let positions = m.tokenizer.encode(prompt).unwrap().len() + 100;
    let need = m.model.state_bytes(positions);
    let (status, retry, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 100}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(retry, None, "retrying would not help");
    let err = &v["error"];
    assert_eq!(err["type"], "invalid_request_error", "{v}");
    assert_eq!(err["code"], "kv_budget_exceeded", "{v}");
    assert_eq!(err["param"], "max_tokens", "{v}");
    let message = err["message"].as_str().unwrap();
    for part in [
        format!("{positions} positions) needs {} MiB", mib(need)),
        format!("KV budget of {} MiB", mib(budget)),
        "lower max_tokens or the prompt".to_string(),
    ] {
        assert!(message.contains(&part), "{message:?} lacks {part:?}");
    }

    // A chat asking with max_completion_tokens is told to lower that.
    let chat =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100});
    let (status, _, v) = post(&s, "/v1/chat/completions", &chat);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "max_completion_tokens", "{v}");

    // One that fits is served, and the gauges say what the budget is and that, the reply
    // given, no cache is held.
    let (status, _, v) = post(
        &s,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        metric(&s, "dynmoe_kv_cache_budget_bytes"),
        Some(budget as f64)
    );
    assert_eq!(metric(&s, "dynmoe_kv_cache_bytes"), Some(0.0));
    assert_eq!(metric(&s, "dynmoe_requests_total"), Some(1.0));
    assert_eq!(metric(&s, "dynmoe_requests_rejected_total"), Some(0.0));
}
