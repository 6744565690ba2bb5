//! Chat prompts: a conversation rendered through the model's Jinja chat template
//! (`tokenizer_config.json`), shared by `dynmoe chat` and the HTTP server.
//!
//! Templates are Hugging Face's: Jinja run by minijinja with Python string methods
//! (`.strip()`, `.startswith()`, ...) and `raise_exception`, as transformers provides them.
//! A model whose tokenizer config has no template gets [`CHATML`], the format the
//! project's fixtures and the Qwen family use.

use serde::{Deserialize, Serialize};

use crate::checkpoint::Tokenizer;

/// The template used when a model has none: ChatML, each turn between `<|im_start|>`
/// and `<|im_end|>`.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Tokens that end an assistant turn in the common chat formats (ChatML, Llama 3,
/// Phi); those the vocabulary has stop generation alongside the EOS tokens.
const END_OF_TURN: &[&str] = &["<|im_end|>", "<|eot_id|>", "<|end|>"];

/// Marks where a special token stood inside a message's content while the template
/// renders (see [`ChatTemplate::encode`]): the last private-use character of Unicode,
/// which no tokenizer gives a meaning and which is replaced in content by U+FFFD.
const MARK: char = '\u{10FFFD}';

/// Template instructions one render may run before it is stopped. A template comes
/// with the model, not from a trusted author, and a nested loop over `range` can run
/// for hours; ChatML takes about twenty steps a message, so this leaves room for tens
/// of thousands of messages while a runaway template stops within a second or so.
pub const STEP_BUDGET: u64 = 5_000_000;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// What was said.
    pub content: String,
}

impl Message {
    /// A message with this role and content.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Why a template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
#[error("chat template ({origin}): {reason}")]
pub struct TemplateError {
    /// `tokenizer_config.json` or `default ChatML`.
    pub origin: &'static str,
    /// What minijinja or the template said.
    pub reason: String,
    /// The render ran past its step budget (see [`ChatTemplate::with_step_budget`]).
    pub out_of_steps: bool,
}

/// A compiled chat template with the special tokens templates refer to.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    origin: &'static str,
    bos_token: String,
    eos_token: String,
    steps: u64,
}

impl ChatTemplate {
    /// The tokenizer's template, or [`CHATML`] when it has none.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<ChatTemplate, TemplateError> {
        let (source, origin) = match &tok.chat_template {
            Some(t) => (t.clone(), "tokenizer_config.json"),
            None => (CHATML.to_string(), "default ChatML"),
        };
        let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
        ChatTemplate::new(
            source,
            origin,
            text_of(tok.bos),
            text_of(tok.eos.first().copied()),
        )
    }

    /// Compiles `source`; `origin` names where it came from in errors.
    pub fn new(
        source: String,
        origin: &'static str,
        bos_token: String,
        eos_token: String,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<(), minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError {
                origin,
                reason: e.to_string(),
                out_of_steps: false,
            })?;
        env.set_fuel(Some(STEP_BUDGET));
        Ok(ChatTemplate {
            env,
            origin,
            bos_token,
            eos_token,
            steps: STEP_BUDGET,
        })
    }

    /// The same template stopped after `steps` instructions a render instead of
    /// [`STEP_BUDGET`].
    pub fn with_step_budget(mut self, steps: u64) -> ChatTemplate {
        self.env.set_fuel(Some(steps));
        self.steps = steps;
        self
    }

    /// Instructions one render may run.
    pub fn step_budget(&self) -> u64 {
        self.steps
    }

    /// Where the template came from: `tokenizer_config.json` or `default ChatML`.
    pub fn origin(&self) -> &'static str {
        self.origin
    }

    /// The prompt text for `messages`, ending with the opening of the assistant's turn.
    pub fn render(&self, messages: &[Message]) -> Result<String, TemplateError> {
        let tmpl = self.env.get_template("chat").map_err(|e| self.error(e))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| self.error(e))
    }

    /// The prompt for `messages` as token ids: the template's own text with its
    /// special tokens (`<|im_start|>`, ...) as those tokens, and every special token
    /// written inside a message's content as plain text, so that a user cannot forge a
    /// role or end a turn. Content without special tokens encodes exactly as the
    /// rendered prompt does through [`Tokenizer::encode`].
    pub fn encode(&self, tok: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>, TemplateError> {
        let specials = tok.special_tokens();
        // Each special token inside content becomes a marker no text holds: a
        // private-use character, the token's index as private-use characters, and the
        // first again. Templates that strip or case-map content leave them as they are.
        let marker = |i: usize| {
            format!(
                "{MARK}{}{MARK}",
                char::from_u32(0x10_0000 + i as u32).unwrap_or(MARK)
            )
        };
        let masked: Vec<Message> = messages
            .iter()
            .map(|m| {
                let mut content = m.content.replace(MARK, "\u{FFFD}");
                for (i, s) in specials.iter().enumerate() {
                    if content.contains(s.as_str()) {
                        content = content.replace(s.as_str(), &marker(i));
                    }
                }
                Message {
                    role: m.role.clone(),
                    content,
                }
            })
            .collect();
        let text = self.render(&masked)?;
        let encoding = |e: crate::checkpoint::Error| TemplateError {
            origin: self.origin,
            reason: format!("encoding the prompt: {e}"),
            out_of_steps: false,
        };
        let mut ids: Vec<u32> = tok.bos.into_iter().collect();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(MARK) {
            ids.extend(tok.encode_special(&rest[..at]).map_err(encoding)?);
            let after = &rest[at + MARK.len_utf8()..];
            let mut chars = after.chars();
            let (index, close) = (chars.next(), chars.next());
            match (index, close) {
                (Some(c), Some(MARK)) if (c as usize) >= 0x10_0000 => {
                    let s = &specials[c as usize - 0x10_0000];
                    ids.extend(tok.encode_plain(s).map_err(encoding)?);
                    rest = chars.as_str();
                }
                // A template that split a marker: what is left is plain text.
                _ => {
                    ids.extend(
                        tok.encode_plain(&rest[at..at + MARK.len_utf8()])
                            .map_err(encoding)?,
                    );
                    rest = after;
                }
            }
        }
        ids.extend(tok.encode_special(rest).map_err(encoding)?);
        Ok(ids)
    }

    fn error(&self, e: minijinja::Error) -> TemplateError {
        if e.kind() == minijinja::ErrorKind::OutOfFuel {
            return TemplateError {
                origin: self.origin,
                reason: format!(
                    "rendering ran past the template's step budget of {} steps (does it loop?)",
                    self.steps
                ),
                out_of_steps: true,
            };
        }
        let mut reason = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            reason.push_str(&format!(": {s}"));
            source = s.source();
        }
        TemplateError {
            origin: self.origin,
            reason,
            out_of_steps: false,
        }
    }
}

/// Tokens that end generation in a chat: the tokenizer's and the config's EOS tokens,
/// and the end-of-turn markers the vocabulary has.
pub fn stop_tokens(tok: &Tokenizer, config_eos: &[u32]) -> Vec<u32> {
    let mut ids: Vec<u32> = tok.eos.iter().chain(config_eos).copied().collect();
    ids.extend(END_OF_TURN.iter().filter_map(|t| tok.token_id(t)));
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::new(source.into(), "test", "<s>".into(), "</s>".into()).unwrap()
    }

    #[test]
    fn chatml_wraps_each_turn_and_opens_the_reply() {
        let t = template(CHATML);
        let text = t
            .render(&[
                Message::new("system", "Be brief."),
                Message::new("user", "Hi"),
            ])
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_special_tokens_work() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}{% if m.content.startswith('x') %}[{{ m.content.strip() | upper }}]{% endif %}{% endfor %}{{ eos_token }}",
        );
        let text = t
            .render(&[Message::new("user", "x y  "), Message::new("user", "no")])
            .unwrap();
        assert_eq!(text, "<s>[X Y]</s>");
    }

    #[test]
    fn raise_exception_becomes_an_error_naming_the_template() {
        let t = template("{{ raise_exception('roles must alternate') }}");
        let e = t.render(&[Message::new("user", "a")]).unwrap_err();
        assert_eq!(e.origin, "test");
        assert!(e.to_string().contains("roles must alternate"), "{e}");
    }

    #[test]
    fn a_looping_template_stops_at_its_step_budget() {
        let t = template(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        )
        .with_step_budget(100_000);
        let started = std::time::Instant::now();
        let e = t.render(&[Message::new("user", "a")]).unwrap_err();
        assert!(e.out_of_steps, "{e}");
        assert!(e.to_string().contains("step budget of 100000 steps"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
        // ChatML over many messages stays well inside the default budget.
        let many = vec![Message::new("user", "hello"); 20_000];
        template(CHATML).render(&many).unwrap();
    }

    #[test]
    fn a_malformed_template_is_refused_when_compiled() {
        let e = ChatTemplate::new("{% for %}".into(), "test", String::new(), String::new())
            .err()
            .expect("refused");
        assert!(e.to_string().starts_with("chat template (test)"), "{e}");
    }
}
