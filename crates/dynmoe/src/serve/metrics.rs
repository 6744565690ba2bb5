//! `GET /metrics` in the Prometheus text exposition format.

use std::fmt::Write;

use super::engine::Counters;
use crate::residency::ResidencyReport;

/// The exposition text for `c`. Tokens per second is generated tokens over the
/// scheduler's busy time, so idle time between requests does not dilute it.
pub fn render(c: &Counters, residency: Option<&ResidencyReport>) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {value}");
    };
    metric(
        "dynmoe_requests_total",
        "counter",
        "Requests accepted into the queue.",
        c.requests as f64,
    );
    metric(
        "dynmoe_requests_rejected_total",
        "counter",
        "Requests refused with 429 because the queue was full.",
        c.rejected as f64,
    );
    metric(
        "dynmoe_requests_cancelled_total",
        "counter",
        "Requests whose client disconnected before the end.",
        c.cancelled as f64,
    );
    metric(
        "dynmoe_requests_failed_total",
        "counter",
        "Requests ended by a forward-pass error.",
        c.failed as f64,
    );
    metric(
        "dynmoe_requests_completed_total",
        "counter",
        "Requests generated to the end.",
        c.completed as f64,
    );
    metric(
        "dynmoe_prompt_tokens_total",
        "counter",
        "Prompt tokens run through the model.",
        c.prompt_tokens as f64,
    );
    metric(
        "dynmoe_generated_tokens_total",
        "counter",
        "Tokens generated.",
        c.generated_tokens as f64,
    );
    metric(
        "dynmoe_busy_seconds_total",
        "counter",
        "Seconds the scheduler spent running the model.",
        c.busy_seconds,
    );
    let tps = if c.busy_seconds > 0.0 {
        c.generated_tokens as f64 / c.busy_seconds
    } else {
        0.0
    };
    metric(
        "dynmoe_tokens_per_second",
        "gauge",
        "Generated tokens per busy second since start.",
        tps,
    );
    metric(
        "dynmoe_queue_depth",
        "gauge",
        "Requests waiting for a free sequence.",
        c.queue_depth as f64,
    );
    metric(
        "dynmoe_active_sequences",
        "gauge",
        "Sequences being generated.",
        c.active_sequences as f64,
    );
    metric(
        "dynmoe_kv_cache_bytes",
        "gauge",
        "Bytes of KV cache the active sequences hold.",
        c.kv_bytes as f64,
    );
    // Only with a budget: without one the caches are bounded by the sequences alone.
    if let Some(budget) = c.kv_budget {
        metric(
            "dynmoe_kv_cache_budget_bytes",
            "gauge",
            "Bytes of KV cache the active sequences may hold together.",
            budget as f64,
        );
    }
    // Only with resident sets installed: a model running every expert has no hit rate.
    if let Some(r) = residency {
        for (name, kind, help, value) in [
            (
                "dynmoe_hit_rate",
                "gauge",
                "Share of unmasked routing probability on resident experts.",
                r.hit_rate,
            ),
            (
                "dynmoe_swaps_total",
                "counter",
                "Experts swapped into resident sets.",
                r.counters.swaps as f64,
            ),
            (
                "dynmoe_bytes_moved_total",
                "counter",
                "Bytes read from the reservoir into resident slots.",
                r.counters.bytes_moved as f64,
            ),
            (
                "dynmoe_stalls_total",
                "counter",
                "Loads still in flight when their swap was due.",
                r.counters.stalls as f64,
            ),
            (
                "dynmoe_routed_tokens_total",
                "counter",
                "Tokens routed through the resident sets.",
                r.counters.tokens as f64,
            ),
        ] {
            metric(name, kind, help, value);
        }
    }
    out
}

/// The value of an unlabelled metric in exposition text.
pub fn value_of(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_is_exposed_with_help_and_type() {
        let c = Counters {
            requests: 7,
            generated_tokens: 30,
            busy_seconds: 1.5,
            active_sequences: 2,
            kv_bytes: 3 << 20,
            kv_budget: Some(8 << 20),
            ..Counters::default()
        };
        let text = render(&c, None);
        assert_eq!(value_of(&text, "dynmoe_hit_rate"), None);
        assert_eq!(value_of(&text, "dynmoe_kv_cache_bytes"), Some(3145728.0));
        assert_eq!(
            value_of(&text, "dynmoe_kv_cache_budget_bytes"),
            Some(8388608.0)
        );
        let unbounded = render(&Counters::default(), None);
        assert_eq!(value_of(&unbounded, "dynmoe_kv_cache_budget_bytes"), None);
        assert_eq!(value_of(&unbounded, "dynmoe_kv_cache_bytes"), Some(0.0));
        assert_eq!(value_of(&text, "dynmoe_requests_total"), Some(7.0));
        assert_eq!(value_of(&text, "dynmoe_tokens_per_second"), Some(20.0));
        assert_eq!(value_of(&text, "dynmoe_active_sequences"), Some(2.0));
        assert_eq!(value_of(&text, "dynmoe_requests"), None);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(' ').next().unwrap();
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} untyped");
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} undocumented"
            );
        }
    }
}
