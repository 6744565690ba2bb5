//! The connection side of the server: accepting, limits and timeouts, shutdown with a
//! deadline, the API key and CORS. `axum::serve` offers none of the limits, so
//! connections are accepted here and each is handed to hyper with a header timeout.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tower_http::cors::{AllowOrigin, CorsLayer};

use super::api::ApiError;

/// Limits on connections, and who may call the API.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// A connection that has not sent a whole request head this long after it opened,
    /// or after its last response, is closed: this bounds idle keep-alive connections
    /// as well as slow senders.
    pub header_timeout: Duration,
    /// A request body not read in full within this is answered 408.
    pub body_timeout: Duration,
    /// Open connections at most; more are answered 503 and closed at once.
    pub max_connections: usize,
    /// After a shutdown signal, requests in flight get this long to finish before
    /// their connections are dropped.
    pub shutdown_deadline: Duration,
    /// When set, every endpoint but `/health` wants `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Origins browsers may call the API from (`*` for any); none sends no CORS
    /// headers.
    pub cors_origins: Vec<String>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
            shutdown_deadline: Duration::from_secs(10),
            api_key: None,
            cors_origins: Vec::new(),
        }
    }
}

/// What a connection over the limit is told.
pub(super) fn busy_error() -> ApiError {
    ApiError {
        status: 503,
        message: "too many open connections; retry shortly".into(),
        kind: "server_error",
        param: None,
        code: Some("busy"),
    }
}

/// [`busy_error`] as a whole HTTP response, for connections that are not read.
fn busy() -> String {
    let body = busy_error().body().to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Connections served beyond the limit, one request each, by `busy`: enough that a
/// health check or a supervisor still gets through while clients hold every place.
pub const OVERFLOW_CONNECTIONS: usize = 32;

/// Serves `router` on `listener` until `shutdown` resolves, then lets requests in
/// flight finish for at most the shutdown deadline. Past the connection limit, a few
/// more connections get one request each from `busy`, which answers `/health` and
/// refuses the rest; past those, connections are refused without being read.
pub(super) async fn serve(
    listener: TcpListener,
    router: Router,
    busy: Router,
    opts: &HttpOptions,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(opts.max_connections.max(1)));
    let overflow = Arc::new(Semaphore::new(OVERFLOW_CONNECTIONS));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        .keep_alive(true);
    let mut brief = hyper::server::conn::http1::Builder::new();
    brief
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout.min(Duration::from_secs(2)))
        .keep_alive(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, or a connection reset before it was
                // taken: wait a little rather than spin, and keep serving.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let (permit, builder, service) = match permits.clone().try_acquire_owned() {
            Ok(p) => (p, &http, router.clone()),
            Err(_) => match overflow.clone().try_acquire_owned() {
                Ok(p) => (p, &brief, busy.clone()),
                Err(_) => {
                    tokio::spawn(refuse(stream));
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let conn =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    // Connections still reading a request head or streaming a reply past the deadline
    // are dropped with the runtime.
    let _ = tokio::time::timeout(opts.shutdown_deadline, graceful.shutdown()).await;
}

/// Tells a connection over the limit why, without waiting on it for long.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        let _ = stream.write_all(busy().as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// Adds the API key check and CORS to `router`, as `opts` asks.
pub(super) fn layers(router: Router, opts: &HttpOptions) -> Router {
    let mut router = match &opts.api_key {
        Some(key) => router.layer(axum::middleware::from_fn_with_state(
            Arc::<str>::from(key.as_str()),
            require_key,
        )),
        None => router,
    };
    if !opts.cors_origins.is_empty() {
        let origins = if opts.cors_origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                opts.cors_origins
                    .iter()
                    .filter_map(|o| HeaderValue::from_str(o).ok()),
            )
        };
        // Outermost, so that a preflight is answered before the key is asked for:
        // browsers send no credentials with one.
        router = router.layer(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
        );
    }
    router
}

async fn require_key(State(key): State<Arc<str>>, req: Request, next: Next) -> Response {
    // Health checks come from load balancers and supervisors that hold no key.
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if same(g.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        _ => {
            let e = ApiError {
                status: 401,
                message: "a valid API key is needed: send `Authorization: Bearer <key>`".into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("invalid_api_key"),
            };
            let mut resp = (StatusCode::UNAUTHORIZED, axum::Json(e.body())).into_response();
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            resp
        }
    }
}

/// Compares in time that depends on the lengths only, so that response times do not
/// tell how much of a guessed key was right.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}
