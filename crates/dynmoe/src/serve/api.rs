//! The OpenAI request bodies, read field by field so that every refusal names the
//! field (`param`) and says what was expected, and the error object it is sent as.

use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use crate::backend::sample::Sampling;
use crate::runtime::chat::Message;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What is wrong, for a person.
    pub message: String,
    /// `invalid_request_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable reason (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: &str, message: String) -> ApiError {
        ApiError {
            status: 400,
            message,
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// The same error with a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Sampling and stopping settings common to both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `model`, if the client named one.
    pub model: Option<String>,
    /// `max_tokens` (or `max_completion_tokens`), checked against the context later.
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came from, for errors about it.
    pub max_tokens_field: &'static str,
    /// temperature, top_p, top_k, seed.
    pub sampling: Sampling,
    /// `stop`, as a list.
    pub stop: Vec<String>,
    /// `stream`.
    pub stream: bool,
}

/// Temperatures above this are refused, as OpenAI does.
const MAX_TEMPERATURE: f64 = 2.0;
/// OpenAI accepts at most this many stop sequences.
const MAX_STOPS: usize = 4;

/// Fields accepted by both endpoints. `user` and `stream_options` are accepted and
/// ignored; `n` is accepted only as 1.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stream",
    "n",
    "user",
    "stream_options",
];

/// A `/v1/completions` body: the prompt and the settings.
pub fn parse_completion(body: &[u8], default_seed: u64) -> Result<(String, Params), ApiError> {
    let f = Fields::parse(body, &[COMMON, &["prompt"]])?;
    let prompt = match f.raw("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => s.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "prompt must be a string or a list of one string (batched and token-id prompts are not served)".into(),
                ))
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("prompt must be a string, got {}", kind_of(other)),
            ))
        }
        None => return Err(ApiError::invalid("prompt", "prompt is required".into())),
    };
    Ok((prompt, f.params("max_tokens", default_seed)?))
}

/// A `/v1/chat/completions` body: the messages and the settings.
pub fn parse_chat(body: &[u8], default_seed: u64) -> Result<(Vec<Message>, Params), ApiError> {
    let f = Fields::parse(body, &[COMMON, &["messages", "max_completion_tokens"]])?;
    let Some(raw) = f.raw("messages") else {
        return Err(ApiError::invalid("messages", "messages is required".into()));
    };
    let Value::Array(items) = raw else {
        return Err(ApiError::invalid(
            "messages",
            format!("messages must be a list, got {}", kind_of(raw)),
        ));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty".into()));
    }
    let messages = items
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let limit = if f.raw("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    Ok((messages, f.params(limit, default_seed)?))
}

fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let param = format!("messages[{i}]");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            &param,
            format!("{param} must be an object, got {}", kind_of(m)),
        ));
    };
    let role = match o.get("role") {
        Some(Value::String(r))
            if ["system", "developer", "user", "assistant"].contains(&r.as_str()) =>
        {
            r.clone()
        }
        Some(Value::String(r)) => {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!("{param}.role {r:?} is not system, developer, user or assistant"),
            ))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!("{param}.role must be a string, got {}", kind_of(other)),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!("{param}.role is required"),
            ))
        }
    };
    // Content is a string or a list of parts, of which only text parts are served.
    let bad_content = |what: String| ApiError::invalid(&format!("{param}.content"), what);
    let content = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None if role == "assistant" => String::new(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type"), part.get("text")) {
                    (Some(Value::String(t)), Some(Value::String(s))) if t == "text" => {
                        text.push_str(s)
                    }
                    _ => {
                        return Err(bad_content(format!(
                            "{param}.content: only parts of type \"text\" with a string \"text\" are served"
                        )))
                    }
                }
            }
            text
        }
        Some(other) => {
            return Err(bad_content(format!(
                "{param}.content must be a string or a list of text parts, got {}",
                kind_of(other)
            )))
        }
        None => return Err(bad_content(format!("{param}.content is required"))),
    };
    Ok(Message { role, content })
}

/// A request body's top-level fields.
struct Fields(Map<String, Value>);

impl Fields {
    fn parse(body: &[u8], known: &[&[&str]]) -> Result<Fields, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|e| ApiError {
            status: 400,
            message: format!("the body is not valid JSON: {e}"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        })?;
        let Value::Object(map) = value else {
            return Err(ApiError {
                status: 400,
                message: format!("the body must be a JSON object, got {}", kind_of(&value)),
                kind: "invalid_request_error",
                param: None,
                code: None,
            });
        };
        if let Some(k) = map
            .keys()
            .find(|k| !known.iter().any(|set| set.contains(&k.as_str())))
        {
            return Err(ApiError::invalid(
                k,
                format!("unrecognized request field {k:?}"),
            ));
        }
        Ok(Fields(map))
    }

    /// The field's value; `null` counts as absent.
    fn raw(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// The field as a `T`, refusing a value of another type by name.
    fn get<T: DeserializeOwned>(&self, name: &str, expected: &str) -> Result<Option<T>, ApiError> {
        self.raw(name)
            .map(|v| {
                T::deserialize(v).map_err(|_| {
                    ApiError::invalid(name, format!("{name} must be {expected}, got {}", show(v)))
                })
            })
            .transpose()
    }

    fn params(
        &self,
        max_tokens_field: &'static str,
        default_seed: u64,
    ) -> Result<Params, ApiError> {
        let model = self.get::<String>("model", "a string")?;
        let max_tokens = match self.get::<i64>(max_tokens_field, "an integer")? {
            Some(n) if n < 1 => {
                return Err(ApiError::invalid(
                    max_tokens_field,
                    format!("{max_tokens_field} must be at least 1, got {n}"),
                ))
            }
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let temperature = self.get::<f64>("temperature", "a number")?.unwrap_or(1.0);
        if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}"),
            ));
        }
        let top_p = self.get::<f64>("top_p", "a number")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.get::<i64>("top_k", "an integer")? {
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be 0 (all tokens) or more, got {k}"),
                ))
            }
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
            None => 0,
        };
        let seed = self
            .get::<u64>("seed", "a non-negative integer")?
            .unwrap_or(default_seed);
        // OpenAI's penalties (in [-2, 2]) and the min-p and repetition penalty that vLLM
        // and llama-server take beside them.
        let number = |field: &'static str, default: f64, range: std::ops::RangeInclusive<f64>| {
            let v = self.get::<f64>(field, "a number")?.unwrap_or(default);
            if !range.contains(&v) {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "{field} must be in [{}, {}], got {v}",
                        range.start(),
                        range.end()
                    ),
                ));
            }
            Ok(v as f32)
        };
        let presence_penalty = number("presence_penalty", 0.0, -2.0..=2.0)?;
        let frequency_penalty = number("frequency_penalty", 0.0, -2.0..=2.0)?;
        let min_p = number("min_p", 0.0, 0.0..=1.0)?;
        let repetition_penalty = number("repetition_penalty", 1.0, 0.01..=10.0)?;
        let stop = match self.raw("stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(v) => self
                .get::<Vec<String>>("stop", "a string or a list of strings")?
                .unwrap_or_else(|| unreachable!("stop is present: {v}")),
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOPS} stop sequences, got {}", stop.len()),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "a stop sequence is empty".into()));
        }
        let stream = self.get::<bool>("stream", "a boolean")?.unwrap_or(false);
        if let Some(n) = self.get::<i64>("n", "an integer")? {
            if n != 1 {
                return Err(ApiError::invalid(
                    "n",
                    format!("only n = 1 is served, got {n}"),
                ));
            }
        }
        self.get::<String>("user", "a string")?;
        Ok(Params {
            model,
            max_tokens,
            max_tokens_field,
            sampling: Sampling {
                temperature: temperature as f32,
                top_k,
                top_p: top_p as f32,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
            },
            stop,
            stream,
        })
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A short description of a refused value: its kind and, when short, itself.
fn show(v: &Value) -> String {
    let text = v.to_string();
    if text.len() <= 40 {
        format!("{} {text}", kind_of(v))
    } else {
        kind_of(v).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: &str) -> Result<(String, Params), ApiError> {
        parse_completion(body.as_bytes(), 5)
    }

    #[test]
    fn a_plain_completion_gets_openai_defaults() {
        let (prompt, p) = completion(r#"{"model": "m", "prompt": "Hi"}"#).unwrap();
        assert_eq!(prompt, "Hi");
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(p.max_tokens, None);
        assert_eq!(p.sampling.temperature, 1.0);
        assert_eq!(p.sampling.top_p, 1.0);
        assert_eq!(p.sampling.seed, 5);
        assert!(!p.stream);
    }

    #[test]
    fn the_penalties_and_min_p_reach_the_sampler() {
        let body = r#"{"prompt": "a", "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.25}"#;
        let (_, p) = completion(body).unwrap();
        assert_eq!(p.sampling.min_p, 0.05);
        assert_eq!(p.sampling.repetition_penalty, 1.1);
        assert_eq!(p.sampling.presence_penalty, 0.5);
        assert_eq!(p.sampling.frequency_penalty, -0.25);
        let chat = br#"{"messages": [{"role": "user", "content": "a"}], "presence_penalty": 1}"#;
        assert_eq!(
            parse_chat(chat, 5).unwrap().1.sampling.presence_penalty,
            1.0
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        for (body, param) in [
            (r#"{"prompt": "a", "temperature": "hot"}"#, "temperature"),
            (r#"{"prompt": "a", "temperature": 2.5}"#, "temperature"),
            (r#"{"prompt": "a", "top_p": 0}"#, "top_p"),
            (r#"{"prompt": "a", "top_k": -1}"#, "top_k"),
            (r#"{"prompt": "a", "min_p": 1.5}"#, "min_p"),
            (
                r#"{"prompt": "a", "presence_penalty": 3}"#,
                "presence_penalty",
            ),
            (
                r#"{"prompt": "a", "repetition_penalty": 0}"#,
                "repetition_penalty",
            ),
            (r#"{"prompt": "a", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "a", "max_tokens": 1.5}"#, "max_tokens"),
            (r#"{"prompt": "a", "seed": -3}"#, "seed"),
            (r#"{"prompt": "a", "stop": [1]}"#, "stop"),
            (r#"{"prompt": "a", "stop": ["a","b","c","d","e"]}"#, "stop"),
            (r#"{"prompt": "a", "stream": "yes"}"#, "stream"),
            (r#"{"prompt": "a", "n": 2}"#, "n"),
            (r#"{"prompt": "a", "colour": 1}"#, "colour"),
            (r#"{"prompt": ["a", "b"]}"#, "prompt"),
            (r#"{"prompt": 7}"#, "prompt"),
            (r#"{}"#, "prompt"),
        ] {
            let e = completion(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn malformed_json_is_a_400_without_a_param() {
        for body in ["{\"prompt\": ", "[1, 2]", ""] {
            let e = completion(body).unwrap_err();
            assert_eq!((e.status, e.param.clone()), (400, None), "{body}");
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn chat_messages_accept_text_parts_and_refuse_other_roles() {
        let (m, p) = parse_chat(
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3, "stop": "x"}"#,
            0,
        )
        .unwrap();
        assert_eq!(m, vec![Message::new("user", "ab")]);
        assert_eq!((p.max_tokens, p.stop), (Some(3), vec!["x".to_string()]));
        let e =
            parse_chat(br#"{"messages": [{"role": "wizard", "content": "a"}]}"#, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_chat(br#"{"messages": [{"role": "user", "content": 3}]}"#, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = parse_chat(br#"{"messages": []}"#, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
}
