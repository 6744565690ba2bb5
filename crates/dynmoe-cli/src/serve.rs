//! `dynmoe serve` (the OpenAI-compatible HTTP server) and `dynmoe chat` (a terminal
//! conversation); both share the runtime's chat template and generation loop.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use dynmoe::runtime::chat::{self, ChatTemplate, Message};
use dynmoe::runtime::generate::generate_ids;
use dynmoe::serve::engine::{mib, EngineOptions};
use dynmoe::serve::{self, HttpOptions, ServeOptions};

use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Backend;
use dynmoe::model::LoadedModel;

use crate::residency::ResidencyArgs;
use crate::{cuda_backend, load, BackendKind, ModelArgs, SamplingArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Model id served in /v1/models and expected in requests (default: the
    /// directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Sequences generated at the same time.
    #[arg(long, default_value_t = 4)]
    max_seqs: usize,
    /// Requests that may wait for a free sequence; more are answered 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// MiB the KV caches of the sequences generated at the same time may take together
    /// (each needs its prompt plus max_tokens positions); a request waits until its cache
    /// fits, and one needing more than the whole budget is answered 400. Default: on a
    /// GPU, 90% of the device memory free once the model has loaded; on the CPU,
    /// unbounded.
    #[arg(long, value_name = "MIB")]
    kv_budget: Option<f64>,
    /// Positions per sequence (prompt and reply); default: the model's
    /// max_position_embeddings.
    #[arg(long)]
    ctx: Option<usize>,
    /// max_tokens of a request that gives none.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Request bodies larger than this are refused with 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds a connection may take to send a request's headers, counted from
    /// when it opens or from its last reply; idle connections are closed after it.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request's body may take to arrive; slower ones get 408.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Open connections at most; more get 503 and are closed.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds replies in progress get to finish after Ctrl-C or SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    shutdown_timeout: f64,
    /// Require `Authorization: Bearer <KEY>` on every endpoint but /health.
    /// Also read from DYNMOE_API_KEY, which keeps the key out of the process list.
    #[arg(long, env = "DYNMOE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// An origin a browser page may call the API from (repeat for more; `*` for
    /// any). Without one, no CORS headers are sent.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// One resident set, shared by every request served.
    #[command(flatten)]
    residency: ResidencyArgs,
}

fn seconds(flag: &str, s: f64) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("--{flag} must be a positive number of seconds, not {s}"))
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.max_seqs == 0 {
        anyhow::bail!("--max-seqs must be at least 1");
    }
    if let Some(mib) = a.kv_budget.filter(|&m| !(m.is_finite() && m > 0.0)) {
        anyhow::bail!("--kv-budget must be a positive number of MiB, not {mib}");
    }
    let http = http_options(&a)?;
    with_model!(a.model, |m| serve_on(m, &a, http))
}

fn http_options(a: &ServeArgs) -> Result<HttpOptions> {
    if a.max_connections == 0 {
        anyhow::bail!("--max-connections must be at least 1");
    }
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key must not be empty");
    }
    Ok(HttpOptions {
        header_timeout: seconds("header-timeout", a.header_timeout)?,
        body_timeout: seconds("body-timeout", a.body_timeout)?,
        max_connections: a.max_connections,
        shutdown_deadline: seconds("shutdown-timeout", a.shutdown_timeout)?,
        api_key: a.api_key.clone(),
        cors_origins: a.cors_origins.clone(),
    })
}

fn serve_on<B: Backend + 'static>(
    mut m: LoadedModel<B>,
    a: &ServeArgs,
    http: HttpOptions,
) -> Result<()> {
    a.residency.install(&mut m)?;
    let name = match a.name.clone() {
        Some(n) => n,
        None => dir_name(&a.model.model),
    };
    let mut opts = ServeOptions::for_model(&m, &name);
    let max = m.model.config.max_position_embeddings;
    if let Some(ctx) = a.ctx.filter(|&c| c > max) {
        anyhow::bail!(
            "--ctx {ctx} is longer than the model's context (max_position_embeddings {max} in config.json)"
        );
    }
    opts.context = a.ctx.unwrap_or(opts.context);
    opts.default_max_tokens = a.default_max_tokens;
    opts.max_body_bytes = a.max_body_bytes;
    // After the model and its resident sets have taken their memory.
    let kv_budget = match a.kv_budget {
        Some(mib) => Some((mib * (1u64 << 20) as f64) as usize),
        None => m.model.backend().memory_free().map(|free| free / 10 * 9),
    };
    opts.engine = EngineOptions {
        max_sequences: a.max_seqs,
        queue_capacity: a.queue,
        kv_budget,
    };
    opts.http = http;
    opts.http.max_connections = fit_connections(opts.http.max_connections);
    eprintln!("dynmoe: {}", kv_budget_line(&m, a, opts.context, kv_budget));
    let addr = format!("{}:{}", a.host, a.port);
    serve::run(
        Arc::new(m),
        opts,
        &addr,
        |bound| eprintln!("dynmoe serving {name} on http://{bound}"),
        serve::interrupted,
    )?;
    Ok(())
}

/// What the KV budget is and where it came from, printed as the server starts (on a line
/// of its own: scripts read the address off the end of the line after it).
fn kv_budget_line<B: Backend>(
    m: &LoadedModel<B>,
    a: &ServeArgs,
    context: usize,
    budget: Option<usize>,
) -> String {
    let Some(budget) = budget else {
        return "KV budget: unbounded (--max-seqs bounds the sequences; --kv-budget MIB bounds their caches)".into();
    };
    let origin = match a.kv_budget {
        Some(_) => "--kv-budget",
        None => "90% of the device memory free after loading",
    };
    let full = m.model.state_bytes(context);
    format!(
        "KV budget {} MiB ({origin}), room for {} sequences of the whole {context}-position context ({} MiB each)",
        mib(budget),
        budget / full.max(1),
        mib(full)
    )
}

/// Raises the open-file limit toward what `wanted` connections need, and lowers the
/// connection limit to what the file limit allows: beyond it `accept` fails, and a new
/// connection (a health check's among them) would wait instead of being told to retry.
#[cfg(unix)]
fn fit_connections(wanted: usize) -> usize {
    // The listener, stdio, model files, the connections served past the limit (which
    // answer /health) and a margin.
    const SPARE: u64 = 32 + serve::OVERFLOW_CONNECTIONS as u64;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return wanted;
    }
    let need = wanted as u64 + SPARE;
    if lim.rlim_cur < need {
        let raised = libc::rlimit {
            rlim_cur: need.min(lim.rlim_max),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    let fits = lim.rlim_cur.saturating_sub(SPARE).max(1);
    if fits < wanted as u64 {
        eprintln!(
            "dynmoe: the open-file limit is {}; serving at most {fits} connections instead of {wanted} (raise it with ulimit -n)",
            lim.rlim_cur
        );
        return fits as usize;
    }
    wanted
}

#[cfg(not(unix))]
fn fit_connections(wanted: usize) -> usize {
    wanted
}

fn dir_name(dir: &std::path::Path) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A system message opening the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    residency: ResidencyArgs,
}

/// Reads one user message per line from stdin, prints each reply as it is generated
/// and a status line on stderr. `/reset` forgets the conversation.
pub fn chat(a: ChatArgs) -> Result<()> {
    let sampling = a.sampling.checked()?;
    with_model!(a.model, |m| chat_on(m, &a, sampling))
}

fn chat_on<B: Backend>(mut m: LoadedModel<B>, a: &ChatArgs, sampling: Sampling) -> Result<()> {
    a.residency.install(&mut m)?;
    let template = ChatTemplate::for_tokenizer(&m.tokenizer)?;
    let stop = chat::stop_tokens(&m.tokenizer, &m.model.config.eos_token_ids);
    let ctx = m.model.config.max_position_embeddings;
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "chatting with {} ({} template); /reset forgets, Ctrl-D ends",
            m.dir.display(),
            template.origin()
        );
    }
    let opening: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let mut history = opening.clone();
    let mut out = std::io::stdout();
    let mut turn = 0u64;
    let prompt_mark = || {
        if interactive {
            eprint!("> ");
        }
    };
    prompt_mark();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        let line = line.trim();
        if line.is_empty() {
            prompt_mark();
            continue;
        }
        if line == "/reset" {
            history = opening.clone();
            eprintln!("[conversation reset]");
            prompt_mark();
            continue;
        }
        history.push(Message::new("user", line));
        // Forget the oldest exchanges until the prompt and a full reply fit.
        let ids = loop {
            let ids = template.encode(&m.tokenizer, &history)?;
            if ids.len() + a.max_tokens <= ctx {
                break Some(ids);
            }
            let first = opening.len();
            if history.len() - first <= 1 {
                break None;
            }
            history.drain(first..(first + 2).min(history.len() - 1));
        };
        let Some(ids) = ids else {
            eprintln!(
                "[that message does not fit in the context of {ctx} tokens with a {}-token reply]",
                a.max_tokens
            );
            history.pop();
            prompt_mark();
            continue;
        };
        let mut s = sampling;
        s.seed = sampling.seed.wrapping_add(turn);
        turn += 1;
        let g = generate_ids(&m, &ids, a.max_tokens, s, &stop, &mut |piece| {
            print!("{piece}");
            let _ = out.flush();
        })?;
        println!();
        let hit_rate = m
            .model
            .residency()
            .map(|r| format!("; hit rate {:.1}%", 100.0 * r.report().hit_rate))
            .unwrap_or_default();
        eprintln!(
            "[{} tokens at {:.1} tok/s; prompt {} tokens at {:.1} tok/s{hit_rate}]",
            g.tokens.len(),
            g.decode_tokens_per_second,
            g.prompt_tokens,
            g.prefill_tokens_per_second
        );
        history.push(Message::new("assistant", &g.text));
        prompt_mark();
    }
    Ok(())
}
