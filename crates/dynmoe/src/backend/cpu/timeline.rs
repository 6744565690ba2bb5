//! The CPU backend's per-op timeline: while it is on, every op the forward pass calls
//! records its name and wall time. CPU ops run synchronously on the calling thread, so
//! an op's wall time is its whole cost, thread hand-offs included; what the host does
//! between ops (routing, sampling, allocation) is the step's time less their sum.
//!
//! `dynmoe bench decode --timeline` reads it; off, an op pays one relaxed atomic load.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
/// The thread that started the timeline: ops other threads run inside one of its ops
/// (products run side by side) are that op's time, not more.
static OWNER: Mutex<Option<std::thread::ThreadId>> = Mutex::new(None);
static MARKS: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());

thread_local! {
    /// Ops entered and not yet left on this thread: an op made of other ops (the
    /// reference backend's expert groups) is recorded once, as itself.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`, recording its wall time under `op` while the timeline is on.
#[inline]
pub(super) fn timed<R>(op: &'static str, f: impl FnOnce() -> R) -> R {
    timed_as(|| op.to_string(), f)
}

/// [`timed`] under a label made only while the timeline is on (a product's shape and
/// codec, which tell the LM head from an expert).
#[inline]
pub(super) fn timed_as<R>(label: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
    if !ON.load(Ordering::Relaxed) || !owner() {
        return f();
    }
    let depth = DEPTH.with(|d| d.replace(d.get() + 1));
    let t = Instant::now();
    let r = f();
    let us = t.elapsed().as_secs_f64() * 1e6;
    DEPTH.with(|d| d.set(depth));
    if depth == 0 {
        MARKS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((label(), us));
    }
    r
}

fn owner() -> bool {
    *OWNER.lock().unwrap_or_else(|e| e.into_inner()) == Some(std::thread::current().id())
}

/// Starts recording the ops the calling thread runs, dropping whatever was recorded
/// before.
pub fn start() {
    MARKS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    *OWNER.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current().id());
    ON.store(true, Ordering::Relaxed);
}

/// Stops recording and returns each op called since [`start`], in order, with its
/// wall time in microseconds.
pub fn take() -> Vec<(String, f64)> {
    ON.store(false, Ordering::Relaxed);
    std::mem::take(&mut *MARKS.lock().unwrap_or_else(|e| e.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_outermost_ops_only_while_on() {
        timed("before", || ());
        start();
        timed("outer", || timed("inner", || std::hint::black_box(1 + 1)));
        timed("second", || ());
        let marks = take();
        timed("after", || ());
        let names: Vec<&str> = marks.iter().map(|m| m.0.as_str()).collect();
        assert_eq!(names, ["outer", "second"]);
        assert!(marks.iter().all(|m| m.1 >= 0.0));
        assert!(take().is_empty());
    }
}
