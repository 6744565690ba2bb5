//! `bench decode --timeline` on the CPU: where a decode token's time goes, op by op.

use std::time::Instant;

use anyhow::Result;
use dynmoe::backend::cpu::timeline;
use dynmoe::backend::Cpu;
use dynmoe::model::{argmax, DecodeOptions, Decoding, LoadedModel};
use serde::Serialize;

use crate::bench::random_prompt;

/// One op's share of a decode token.
#[derive(Debug, Serialize)]
pub(crate) struct OpRow {
    /// The op, and for a product its shape (`out x in`) and codec.
    pub op: String,
    /// Calls a token.
    pub calls_per_token: f64,
    /// Microseconds a call (mean).
    pub us_each: f64,
    /// Microseconds a token.
    pub us_per_token: f64,
}

/// A decode token taken apart.
#[derive(Debug, Serialize)]
pub(crate) struct Timeline {
    /// Wall time of a token, microseconds.
    pub us_per_token: f64,
    /// The ops, costliest first, then `between ops` (routing, sampling, allocation:
    /// the token's time less the ops').
    pub ops: Vec<OpRow>,
}

/// Decodes `generate` tokens after a `prompt`-token prefill with the timeline on and
/// sums each op's time over them: a warm-up decode first, so that the figures are the
/// steady state's.
pub(crate) fn cpu_timeline(
    m: &LoadedModel<Cpu>,
    prompt: usize,
    generate: usize,
) -> Result<Timeline> {
    let ids = random_prompt(m, prompt);
    let mut state = m.model.new_state(prompt + generate);
    let first = argmax(&m.model.forward(&mut state, &ids, prompt - 1)?);
    let decode = |state: &mut _| {
        let mut seqs = [Decoding::new(state, first, DecodeOptions::greedy(generate))];
        m.model.decode(&mut seqs, &mut |_, _| true)
    };
    decode(&mut state)?;
    state.pos = prompt;
    timeline::start();
    let t = Instant::now();
    let done = decode(&mut state);
    let wall = t.elapsed().as_secs_f64() * 1e6;
    let marks = timeline::take();
    let tokens = done?[0].max(1) as f64;
    let mut ops: Vec<OpRow> = Vec::new();
    for (op, us) in marks {
        match ops.iter_mut().find(|r| r.op == op) {
            Some(r) => {
                r.calls_per_token += 1.0;
                r.us_per_token += us;
            }
            None => ops.push(OpRow {
                op,
                calls_per_token: 1.0,
                us_each: 0.0,
                us_per_token: us,
            }),
        }
    }
    for r in &mut ops {
        r.us_each = r.us_per_token / r.calls_per_token;
        r.calls_per_token /= tokens;
        r.us_per_token /= tokens;
    }
    ops.sort_by(|a, b| b.us_per_token.total_cmp(&a.us_per_token));
    let in_ops: f64 = ops.iter().map(|r| r.us_per_token).sum();
    let us_per_token = wall / tokens;
    ops.push(OpRow {
        op: "between ops".into(),
        calls_per_token: 1.0,
        us_each: us_per_token - in_ops,
        us_per_token: us_per_token - in_ops,
    });
    Ok(Timeline { us_per_token, ops })
}

/// Prints `t` as a table.
pub(crate) fn print(label: &str, t: &Timeline) {
    println!(
        "timeline of a decode token at {label}: {:.1} us ({:.0} tok/s)",
        t.us_per_token,
        1e6 / t.us_per_token
    );
    println!(
        "  {:<34} {:>8} {:>9} {:>10} {:>7}",
        "op", "a token", "us each", "us a token", "share"
    );
    for r in &t.ops {
        println!(
            "  {:<34} {:>8.1} {:>9.2} {:>10.1} {:>6.1}%",
            r.op,
            r.calls_per_token,
            r.us_each,
            r.us_per_token,
            100.0 * r.us_per_token / t.us_per_token
        );
    }
}
