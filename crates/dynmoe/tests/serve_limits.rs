//! The server's limits against real connections: timeouts, the connection limit,
//! shutdown, the prepare threads, the API key and CORS. Each test sets its own short
//! limits so that it runs in a second or two.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

use dynmoe::backend::Cpu;
use dynmoe::model::{self, LoadedModel};
use dynmoe::serve::{spawn, Running, ServeOptions, OVERFLOW_CONNECTIONS};
use dynmoe::testing::fixture;

fn load() -> LoadedModel<Cpu> {
    model::load(&fixture("tiny-moe"), Cpu::fast()).expect("tiny-moe loads")
}

fn shared() -> Arc<LoadedModel<Cpu>> {
    static M: OnceLock<Arc<LoadedModel<Cpu>>> = OnceLock::new();
    M.get_or_init(|| Arc::new(load())).clone()
}

fn server_with(f: impl FnOnce(&mut ServeOptions)) -> Running {
    let m = shared();
    let mut opts = ServeOptions::for_model(&m, "tiny-moe");
    f(&mut opts);
    spawn(m, opts, "127.0.0.1:0").expect("the server starts")
}

fn connect(s: &Running) -> TcpStream {
    let c = TcpStream::connect(s.addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c
}

/// One response off `c`: status, head (lower-cased) and body.
fn read_response(c: &mut TcpStream) -> (u16, String, String) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match c.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            other => panic!("the connection ended inside a response head: {other:?}"),
        }
    }
    let head = String::from_utf8_lossy(&buf).to_lowercase();
    let status = head[9..12].parse().unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map_or(0, |n| n.trim().parse().unwrap());
    let mut body = vec![0u8; len];
    c.read_exact(&mut body).unwrap();
    (status, head, String::from_utf8(body).unwrap())
}

fn request(c: &mut TcpStream, method: &str, path: &str, headers: &str, body: &str) {
    let text = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n{body}",
        body.len()
    );
    c.write_all(text.as_bytes()).unwrap();
}

fn call(s: &Running, method: &str, path: &str, headers: &str, body: &str) -> (u16, String, Value) {
    let mut c = connect(s);
    request(&mut c, method, path, headers, body);
    let (status, head, body) = read_response(&mut c);
    (
        status,
        head,
        serde_json::from_str(&body).unwrap_or(Value::Null),
    )
}

/// True once the peer has closed `c`: a read returns end of file or a reset.
fn closed(c: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match c.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn an_idle_connection_is_closed_after_the_header_timeout() {
    let s = server_with(|o| o.http.header_timeout = Duration::from_millis(300));
    let mut idle = connect(&s);
    let started = Instant::now();
    assert!(closed(&mut idle), "the idle connection stayed open");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    // A kept-alive connection is closed the same way once it has been answered.
    let mut kept = connect(&s);
    request(&mut kept, "GET", "/health", "", "");
    assert_eq!(read_response(&mut kept).0, 200);
    assert!(closed(&mut kept));
}

#[test]
fn connections_beyond_the_limit_get_503_while_health_still_answers() {
    let s = server_with(|o| {
        o.http.max_connections = 3;
        o.http.header_timeout = Duration::from_secs(30);
    });
    let mut first = connect(&s);
    request(&mut first, "GET", "/health", "", "");
    assert_eq!(read_response(&mut first).0, 200);
    let idle: Vec<TcpStream> = (0..2).map(|_| connect(&s)).collect();
    // Past the limit a connection gets one request: /health is answered, the API is
    // not, and the connection is closed after it.
    let (status, head, _) = call(&s, "GET", "/health", "", "");
    assert_eq!(status, 200, "{head}");
    let completion = r#"{"prompt": "hi", "max_tokens": 1}"#;
    let (status, head, v) = call(&s, "POST", "/v1/completions", "", completion);
    assert_eq!(status, 503, "{head}");
    assert_eq!(v["error"]["code"], "busy", "{v}");
    assert!(head.contains("retry-after: 1"), "{head}");
    // Past those few more, connections are told so without being read.
    let held: Vec<TcpStream> = (0..OVERFLOW_CONNECTIONS).map(|_| connect(&s)).collect();
    std::thread::sleep(Duration::from_millis(100));
    let mut over = connect(&s);
    let (status, head, body) = read_response(&mut over);
    assert_eq!(status, 503, "{head}{body}");
    assert!(body.contains("\"busy\""), "{body}");
    assert!(closed(&mut over));
    // The connection held before the limit was reached keeps being served.
    let started = Instant::now();
    request(&mut first, "GET", "/health", "", "");
    assert_eq!(read_response(&mut first).0, 200);
    assert!(started.elapsed() < Duration::from_millis(500));
    // Closing connections gives their places back.
    drop(idle);
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(3);
    while call(&s, "POST", "/v1/completions", "", completion).0 != 200 {
        assert!(Instant::now() < deadline, "the places were not given back");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn shutdown_ends_within_its_deadline_with_a_half_sent_header_open() {
    let s = server_with(|o| {
        o.http.header_timeout = Duration::from_secs(60);
        o.http.shutdown_deadline = Duration::from_millis(300);
    });
    let mut half = connect(&s);
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .unwrap();
    // Wait until the server is reading the head.
    std::thread::sleep(Duration::from_millis(100));
    let (done, stopped) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        drop(s);
        let _ = done.send(());
    });
    stopped
        .recv_timeout(Duration::from_secs(5))
        .expect("the server shut down");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(closed(&mut half));
}

#[test]
fn a_body_that_stalls_gets_408() {
    let s = server_with(|o| o.http.body_timeout = Duration::from_millis(300));
    let mut c = connect(&s);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\":")
        .unwrap();
    let started = Instant::now();
    let (status, _, body) = read_response(&mut c);
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("body_timeout"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_looping_template_gets_an_error_naming_the_step_budget_and_health_answers() {
    let mut m = load();
    m.tokenizer.chat_template = Some(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"
            .into(),
    );
    let mut opts = ServeOptions::for_model(&m, "tiny-moe");
    // Large enough that each render runs for a good part of a second.
    opts.template_steps = 20_000_000;
    opts.prepare_threads = 2;
    let s = Arc::new(spawn(Arc::new(m), opts, "127.0.0.1:0").unwrap());
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}"#;
    let chats: Vec<_> = (0..3)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || call(&s, "POST", "/v1/chat/completions", "", body))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(call(&s, "GET", "/health", "", "").0, 200);
        let took = started.elapsed();
        assert!(took < Duration::from_millis(100), "/health took {took:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    for chat in chats {
        let (status, _, v) = chat.join().unwrap();
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "template_step_budget_exceeded", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("step budget of 20000000 steps"),
            "{message}"
        );
    }
}

#[test]
fn an_oversized_prompt_is_refused_before_it_is_tokenized() {
    let s = server_with(|o| o.max_body_bytes = 8 << 20);
    let prompt = "lorem ipsum dolor sit amet ".repeat(4 << 20 >> 5);
    for (path, body) in [
        ("/v1/completions", serde_json::json!({ "prompt": prompt })),
        (
            "/v1/chat/completions",
            serde_json::json!({ "messages": [{"role": "user", "content": prompt}] }),
        ),
    ] {
        let started = Instant::now();
        let (status, _, v) = call(&s, "POST", path, "", &body.to_string());
        let took = started.elapsed();
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("bytes"),
            "{v}"
        );
        // Tokenizing this many bytes takes seconds.
        assert!(took < Duration::from_millis(500), "{path} took {took:?}");
    }
}

#[test]
fn an_api_key_is_asked_for_everywhere_but_health() {
    let s = server_with(|o| o.http.api_key = Some("s3cret".into()));
    let (status, head, v) = call(&s, "GET", "/v1/models", "", "");
    assert_eq!(status, 401, "{v}");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    let wrong = "authorization: Bearer s3creT\r\n";
    assert_eq!(call(&s, "GET", "/v1/models", wrong, "").0, 401);
    let body = r#"{"prompt": "hi", "max_tokens": 1}"#;
    assert_eq!(call(&s, "POST", "/v1/completions", wrong, body).0, 401);
    assert_eq!(call(&s, "GET", "/metrics", "", "").0, 401);
    let right = "authorization: Bearer s3cret\r\n";
    assert_eq!(call(&s, "GET", "/v1/models", right, "").0, 200);
    assert_eq!(call(&s, "POST", "/v1/completions", right, body).0, 200);
    assert_eq!(call(&s, "GET", "/health", "", "").0, 200);
}

#[test]
fn cors_headers_are_sent_only_when_configured() {
    let origin = "origin: https://app.example\r\n";
    let plain = server_with(|_| {});
    let (_, head, _) = call(&plain, "GET", "/v1/models", origin, "");
    assert!(!head.contains("access-control-allow-origin"), "{head}");

    let s = server_with(|o| {
        o.http.cors_origins = vec!["https://app.example".into()];
        o.http.api_key = Some("k".into());
    });
    let (status, head, _) = call(
        &s,
        "GET",
        "/v1/models",
        &format!("{origin}authorization: Bearer k\r\n"),
        "",
    );
    assert_eq!(status, 200);
    assert!(
        head.contains("access-control-allow-origin: https://app.example"),
        "{head}"
    );
    // A preflight carries no key and is answered all the same.
    let preflight = format!(
        "{origin}access-control-request-method: POST\r\naccess-control-request-headers: authorization, content-type\r\n"
    );
    let (status, head, _) = call(&s, "OPTIONS", "/v1/chat/completions", &preflight, "");
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("access-control-allow-methods"), "{head}");
    assert!(head.contains("authorization"), "{head}");
    // Another origin is not allowed.
    let (_, head, _) = call(
        &s,
        "GET",
        "/health",
        "origin: https://elsewhere.example\r\n",
        "",
    );
    assert!(!head.contains("access-control-allow-origin"), "{head}");
}
