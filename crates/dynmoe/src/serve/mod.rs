//! An OpenAI-compatible HTTP server: `POST /v1/completions`, `POST /v1/chat/completions`
//! (streamed as server-sent events or not), `GET /v1/models`, `GET /health` and
//! `GET /metrics` (Prometheus text).
//!
//! Handlers read the body, then parse, render and tokenize it on a prepare thread and
//! check it against the context; the [`engine`] generates, one scheduler thread over
//! one shared model for every request. Connections, their limits and timeouts, the API
//! key and CORS are `http`'s. A bad request is answered with an OpenAI error object and
//! a 4xx status; a full queue with 429 and `Retry-After`; a request whose KV cache alone
//! is larger than the engine's KV budget with 400 (`kv_budget_exceeded`).
//!
//! ```no_run
//! use std::sync::Arc;
//! use dynmoe::backend::Cpu;
//! use dynmoe::serve::{spawn, ServeOptions};
//! let m = dynmoe::model::load(std::path::Path::new("fixtures/models/tiny-moe"), Cpu::fast())?;
//! let opts = ServeOptions::for_model(&m, "tiny-moe");
//! let server = spawn(Arc::new(m), opts, "127.0.0.1:0")?;
//! println!("listening on http://{}", server.addr());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod api;
pub mod engine;
mod http;
pub mod metrics;

pub use http::{HttpOptions, OVERFLOW_CONNECTIONS};

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Semaphore;

use crate::backend::Backend;
use crate::model::LoadedModel;
use crate::runtime::chat::{self, ChatTemplate, TemplateError};
use api::{ApiError, Params};
use engine::{Engine, EngineOptions, Event, FinishReason, Refused, Request};

/// How the server is set up.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The id `/v1/models` lists and requests may name.
    pub model_name: String,
    /// Positions per sequence: prompt plus generated tokens.
    pub context: usize,
    /// `max_tokens` when a request gives none (less if the context has less room).
    pub default_max_tokens: usize,
    /// Larger request bodies are refused with 413.
    pub max_body_bytes: usize,
    /// Queue and concurrency.
    pub engine: EngineOptions,
    /// Connection limits, timeouts, the API key and CORS.
    pub http: HttpOptions,
    /// Requests rendered and tokenized at the same time, on threads of their own so
    /// that a slow one never holds up the threads answering `/health`; more wait.
    pub prepare_threads: usize,
    /// Instructions the chat template may run for one request.
    pub template_steps: u64,
}

impl ServeOptions {
    /// Defaults for `m`: its full trained context, 256 tokens a reply, 1 MiB bodies.
    pub fn for_model<B: Backend>(m: &LoadedModel<B>, name: &str) -> ServeOptions {
        ServeOptions {
            model_name: name.into(),
            context: m.model.config.max_position_embeddings,
            default_max_tokens: 256,
            max_body_bytes: 1 << 20,
            engine: EngineOptions::default(),
            http: HttpOptions::default(),
            prepare_threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(8)),
            template_steps: chat::STEP_BUDGET,
        }
    }
}

/// What every handler shares.
/// What a request asks to continue: a completion's text, or a chat's messages (rendered
/// by the template, their content never read as control tokens).
enum Prompt<'a> {
    Text(&'a str),
    Chat(&'a [crate::runtime::chat::Message]),
}

struct App<B: Backend> {
    model: Arc<LoadedModel<B>>,
    engine: Engine,
    template: ChatTemplate,
    /// Ends completions: the EOS tokens.
    stop: Vec<u32>,
    /// Ends chat replies: EOS and end-of-turn tokens.
    chat_stop: Vec<u32>,
    options: ServeOptions,
    created: u64,
    next_id: AtomicU64,
    /// Permits to render and tokenize, one per prepare thread.
    prepare: Arc<Semaphore>,
    /// The most bytes one token stands for: a prompt longer than the context times
    /// this is refused without tokenizing it.
    longest_token: usize,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl<B: Backend + 'static> App<B> {
    fn new(model: Arc<LoadedModel<B>>, options: ServeOptions) -> Result<App<B>, TemplateError> {
        let template =
            ChatTemplate::for_tokenizer(&model.tokenizer)?.with_step_budget(options.template_steps);
        let longest_token = model.tokenizer.longest_token_bytes();
        let prepare = Arc::new(Semaphore::new(options.prepare_threads.max(1)));
        let config_eos = &model.model.config.eos_token_ids;
        let mut stop: Vec<u32> = model
            .tokenizer
            .eos
            .iter()
            .chain(config_eos)
            .copied()
            .collect();
        stop.sort_unstable();
        stop.dedup();
        let chat_stop = chat::stop_tokens(&model.tokenizer, config_eos);
        let engine = Engine::start(model.clone(), options.engine);
        Ok(App {
            model,
            engine,
            template,
            stop,
            chat_stop,
            options,
            created: unix_now(),
            next_id: AtomicU64::new(1),
            prepare,
            longest_token,
        })
    }

    /// A seed for requests that give none: distinct per request, as OpenAI's
    /// unseeded sampling is.
    fn fresh_seed(&self) -> u64 {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos ^ self.next_id.load(Ordering::Relaxed).rotate_left(32)
    }

    /// Tokenizes `text` and checks it and `max_tokens` against the context.
    fn request(
        &self,
        prompt: Prompt<'_>,
        params: &Params,
        stop_tokens: &[u32],
        prompt_param: &str,
    ) -> Result<Request, ApiError> {
        let limit_param = params.max_tokens_field;
        if let Some(name) = &params.model {
            if *name != self.options.model_name {
                return Err(ApiError {
                    status: 404,
                    message: format!(
                        "the model {name:?} does not exist; this server serves {:?}",
                        self.options.model_name
                    ),
                    kind: "invalid_request_error",
                    param: Some("model".into()),
                    code: Some("model_not_found"),
                });
            }
        }
        let tok = &self.model.tokenizer;
        let ids = match prompt {
            Prompt::Text(text) => {
                self.fits(text.len(), prompt_param)?;
                tok.encode(text)
                    .map_err(|e| ApiError::invalid(prompt_param, e.to_string()))?
            }
            Prompt::Chat(messages) => {
                // The template may drop or repeat content, so the rendered text is
                // what is measured; rendering is cheap next to tokenizing.
                let text = self
                    .template
                    .render(messages)
                    .map_err(|e| template_error(e, prompt_param))?;
                self.fits(text.len(), prompt_param)?;
                // The template's control tokens as tokens, the messages' text as text.
                self.template
                    .encode(tok, messages)
                    .map_err(|e| template_error(e, prompt_param))?
            }
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(
                prompt_param,
                format!("{prompt_param} encodes to no tokens"),
            ));
        }
        let ctx = self.options.context;
        if ids.len() >= ctx {
            return Err(ApiError::invalid(
                prompt_param,
                format!(
                    "{prompt_param} is {} tokens; the context holds {ctx}, leaving no room to generate",
                    ids.len()
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let room = ctx - ids.len();
        let max_tokens = match params.max_tokens {
            Some(n) if n > room => {
                return Err(ApiError::invalid(
                    limit_param,
                    format!(
                        "{limit_param} {n} with a prompt of {} tokens exceeds the context of {ctx} (at most {room})",
                        ids.len()
                    ),
                )
                .with_code("context_length_exceeded"))
            }
            Some(n) => n,
            None => self.options.default_max_tokens.min(room),
        };
        Ok(Request {
            prompt: ids,
            max_tokens,
            sampling: params.sampling,
            stop_tokens: stop_tokens.to_vec(),
            stop_strings: params.stop.clone(),
        })
    }

    /// Refuses a prompt of `bytes` that must encode to more tokens than the context
    /// holds, before the tokenizer spends a second on it.
    fn fits(&self, bytes: usize, prompt_param: &str) -> Result<(), ApiError> {
        // Normalizers can shorten text (composing accents, for one); the factor of two
        // keeps the floor below any prompt that could fit.
        let floor = bytes / (2 * self.longest_token);
        let ctx = self.options.context;
        if floor >= ctx {
            return Err(ApiError::invalid(
                prompt_param,
                format!(
                    "{prompt_param} is {bytes} bytes, at least {floor} tokens; the context holds {ctx}"
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    /// Hands `request` to the engine; `limit_param` names the request's `max_tokens`
    /// field for an error that asks for fewer.
    fn submit(
        &self,
        request: Request,
        limit_param: &str,
    ) -> Result<UnboundedReceiver<Event>, ApiError> {
        self.engine.submit(request).map_err(|e| match e {
            Refused::QueueFull(e) => ApiError {
                status: 429,
                message: format!("{e}; retry shortly"),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            // Retrying would not help: the request as it is never fits.
            Refused::OverBudget(e) => ApiError::invalid(
                limit_param,
                format!("{e}; lower {limit_param} or the prompt"),
            )
            .with_code("kv_budget_exceeded"),
        })
    }
}

/// Which endpoint a reply belongs to: it decides the object names and the shape of
/// each choice.
#[derive(Clone)]
struct Reply {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl Reply {
    fn new<B: Backend>(app: &App<B>, chat: bool) -> Reply {
        let n = app.next_id.fetch_add(1, Ordering::Relaxed);
        Reply {
            id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
            created: unix_now(),
            model: app.options.model_name.clone(),
            chat,
        }
    }

    fn whole(&self, text: String, reason: FinishReason, prompt: usize, completion: usize) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": reason.as_str(), "logprobs": null})
        } else {
            json!({"index": 0, "text": text, "finish_reason": reason.as_str(), "logprobs": null})
        };
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        })
    }

    /// One streamed chunk: a piece of text (`delta`) or the end (`reason`).
    fn chunk(&self, delta: Option<Value>, reason: Option<FinishReason>) -> SseEvent {
        let reason = reason.map(FinishReason::as_str);
        let choice = if self.chat {
            json!({"index": 0, "delta": delta.unwrap_or_else(|| json!({})), "finish_reason": reason, "logprobs": null})
        } else {
            let text = delta.and_then(|d| d["content"].as_str().map(str::to_string));
            json!({"index": 0, "text": text.unwrap_or_default(), "finish_reason": reason, "logprobs": null})
        };
        let body = json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        SseEvent::default().data(body.to_string())
    }
}

fn template_error(e: TemplateError, prompt_param: &str) -> ApiError {
    let out_of_steps = e.out_of_steps;
    let err = ApiError::invalid(prompt_param, e.to_string());
    if out_of_steps {
        err.with_code("template_step_budget_exceeded")
    } else {
        err
    }
}

fn error_response(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut resp = (status, Json(e.body())).into_response();
    if e.status == 429 {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    resp
}

/// The body, or the extractor's refusal (too large, unreadable) as an error object.
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError {
        status: e.status().as_u16(),
        message: e.body_text(),
        kind: "invalid_request_error",
        param: None,
        code: (e.status() == StatusCode::PAYLOAD_TOO_LARGE).then_some("body_too_large"),
    })
}

/// Reads the body within the body timeout.
async fn read_body<B: Backend>(
    app: &App<B>,
    req: axum::extract::Request,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(app.options.http.body_timeout, Bytes::from_request(req, &())).await {
        Ok(body) => body_of(body),
        Err(_) => Err(ApiError {
            status: 408,
            message: format!(
                "the request body did not arrive within {} s",
                app.options.http.body_timeout.as_secs_f64()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("body_timeout"),
        }),
    }
}

type Started = (Reply, Params, UnboundedReceiver<Event>);

/// Runs `prepare` (parsing, the template, the tokenizer) on a prepare thread once a
/// permit is free: these take time in proportion to the prompt, or any time at all
/// for a bad template, and the server's own threads must stay free to answer.
async fn prepared<B: Backend + 'static>(
    app: &Arc<App<B>>,
    prepare: impl FnOnce(&App<B>) -> Result<Started, ApiError> + Send + 'static,
) -> Response {
    let Ok(permit) = app.prepare.clone().acquire_owned().await else {
        return error_response(server_error("the server is shutting down".into()));
    };
    let app = app.clone();
    let started = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        prepare(&app)
    })
    .await
    .unwrap_or_else(|_| Err(server_error("preparing the request failed".into())));
    match started {
        Ok((reply, params, rx)) => respond(reply, params.stream, rx).await,
        Err(e) => error_response(e),
    }
}

async fn completions<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    req: axum::extract::Request,
) -> Response {
    let body = match read_body(&app, req).await {
        Ok(b) => b,
        Err(e) => return error_response(e),
    };
    prepared(&app, move |app| {
        let (prompt, params) = api::parse_completion(&body, app.fresh_seed())?;
        let req = app.request(Prompt::Text(&prompt), &params, &app.stop, "prompt")?;
        let rx = app.submit(req, params.max_tokens_field)?;
        Ok((Reply::new(app, false), params, rx))
    })
    .await
}

async fn chat_completions<B: Backend + 'static>(
    State(app): State<Arc<App<B>>>,
    req: axum::extract::Request,
) -> Response {
    let body = match read_body(&app, req).await {
        Ok(b) => b,
        Err(e) => return error_response(e),
    };
    prepared(&app, move |app| {
        let (messages, params) = api::parse_chat(&body, app.fresh_seed())?;
        let req = app.request(Prompt::Chat(&messages), &params, &app.chat_stop, "messages")?;
        let rx = app.submit(req, params.max_tokens_field)?;
        Ok((Reply::new(app, true), params, rx))
    })
    .await
}

async fn respond(reply: Reply, stream: bool, mut rx: UnboundedReceiver<Event>) -> Response {
    if stream {
        return streamed(reply, rx).into_response();
    }
    // Dropping this future (the client went away) drops `rx`, which cancels the
    // sequence.
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                return Json(reply.whole(text, reason, prompt_tokens, completion_tokens))
                    .into_response()
            }
            Event::Failed(message) => return error_response(server_error(message)),
        }
    }
    error_response(server_error(
        "the engine stopped before the reply ended".into(),
    ))
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: 500,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

/// Server-sent events: chunks as text arrives, a final chunk with the finish reason,
/// then `[DONE]`. When the client disconnects the body is dropped, and `rx` with it.
fn streamed(
    reply: Reply,
    rx: UnboundedReceiver<Event>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        rx: UnboundedReceiver<Event>,
        ready: VecDeque<SseEvent>,
        ended: bool,
        reply: Reply,
    }
    let mut ready = VecDeque::new();
    if reply.chat {
        ready.push_back(reply.chunk(Some(json!({"role": "assistant", "content": ""})), None));
    }
    let st = St {
        rx,
        ready,
        ended: false,
        reply,
    };
    Sse::new(futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.ready.pop_front() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Text(t)) => {
                    let ev = st.reply.chunk(Some(json!({"content": t})), None);
                    st.ready.push_back(ev);
                }
                Some(Event::Done { reason, .. }) => {
                    let ev = st.reply.chunk(None, Some(reason));
                    st.ready.push_back(ev);
                    st.ready.push_back(SseEvent::default().data("[DONE]"));
                    st.ended = true;
                }
                Some(Event::Failed(message)) => {
                    let body = server_error(message).body().to_string();
                    st.ready.push_back(SseEvent::default().data(body));
                    st.ended = true;
                }
                None => st.ended = true,
            }
        }
    }))
}

async fn models<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": app.options.model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "dynmoe",
        "context_length": app.options.context,
    }]}))
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn prometheus<B: Backend + 'static>(State(app): State<Arc<App<B>>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics::render(
            &app.engine.counters(),
            app.model.model.residency().map(|r| r.report()).as_ref(),
        ),
    )
        .into_response()
}

async fn not_found() -> Response {
    error_response(ApiError {
        status: 404,
        message: "no such endpoint".into(),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })
}

fn router<B: Backend + 'static>(app: Arc<App<B>>) -> Router {
    let limit = app.options.max_body_bytes;
    let http = app.options.http.clone();
    let router = Router::new()
        .route("/v1/completions", post(completions::<B>))
        .route("/v1/chat/completions", post(chat_completions::<B>))
        .route("/v1/models", get(models::<B>))
        .route("/health", get(health))
        .route("/metrics", get(prometheus::<B>))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app);
    http::layers(router, &http)
}

/// What connections beyond the limit are served: `/health`, and 503 for the rest.
fn busy_router() -> Router {
    let busy = || async {
        let mut resp = error_response(http::busy_error());
        resp.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        resp
    };
    Router::new().route("/health", get(health)).fallback(busy)
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// What was asked.
        addr: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The model's chat template does not compile.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The runtime or the listener failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.into(),
            source,
        })
}

fn runtime(options: &ServeOptions) -> Result<tokio::runtime::Runtime, ServeError> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Prepare threads and a few for the runtime's own blocking work.
        .max_blocking_threads(options.prepare_threads.max(1) + 4)
        .enable_all()
        .build()?)
}

/// Serves `model` on `addr` until the future `shutdown` makes resolves, calling `ready`
/// with the bound address once it accepts connections. `shutdown` is called inside the
/// server's runtime before `ready`, so a signal handler it registers (see
/// [`interrupted`]) is in place before anyone learns the address. Blocks the calling
/// thread.
pub fn run<B: Backend + 'static, F>(
    model: Arc<LoadedModel<B>>,
    options: ServeOptions,
    addr: &str,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl FnOnce() -> F,
) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let rt = runtime(&options)?;
    let app = Arc::new(App::new(model, options)?);
    let http = app.options.http.clone();
    let served = rt.block_on(async move {
        let listener = bind(addr).await?;
        let shutdown = shutdown();
        ready(listener.local_addr()?);
        http::serve(listener, router(app), busy_router(), &http, shutdown).await;
        Ok(())
    });
    // Connections past the shutdown deadline are dropped here, cancelling their
    // sequences; a prepare thread still running is not waited for.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    served
}

/// A future that resolves on Ctrl-C or SIGTERM: the shutdown signal of a server run from
/// a terminal or a service manager. The handlers are registered when this is called, not
/// when the future is first polled, so a signal sent as soon as the server says where it
/// listens is not lost (the default action would kill the process). Call it inside a
/// Tokio runtime, as [`run`] does.
pub fn interrupted() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            match (term, int) {
                (Some(mut term), Some(mut int)) => {
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A server running on its own thread; dropping it shuts the server down.
pub struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServeError>>>,
}

impl Running {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts serving `model` on `addr` (port 0 picks a free one) on a new thread and
/// returns once it accepts connections.
pub fn spawn<B: Backend + 'static>(
    model: Arc<LoadedModel<B>>,
    options: ServeOptions,
    addr: &str,
) -> Result<Running, ServeError> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (bound, bound_rx) = std::sync::mpsc::channel();
    let addr_owned = addr.to_string();
    let thread = std::thread::Builder::new()
        .name("dynmoe-http".into())
        .spawn(move || {
            run(
                model,
                options,
                &addr_owned,
                |a| {
                    let _ = bound.send(a);
                },
                || async move {
                    let _ = stopped.await;
                },
            )
        })?;
    match bound_rx.recv() {
        Ok(addr) => Ok(Running {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }),
        // The thread ended before binding: its result says why.
        Err(_) => Err(thread
            .join()
            .map_err(|_| std::io::Error::other("the server thread panicked"))?
            .err()
            .unwrap_or_else(|| std::io::Error::other("the server stopped before binding").into())),
    }
}
