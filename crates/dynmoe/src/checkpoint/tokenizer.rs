//! `tokenizer.json` through the `tokenizers` crate, plus what `tokenizer_config.json`
//! says about special tokens: whether a BOS token is prepended, which tokens end
//! generation, and the chat template.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;

use super::Error;

/// A model's tokenizer and its special-token conventions.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special tokens read as plain text, made on first use.
    plain: OnceLock<tokenizers::Tokenizer>,
    path: PathBuf,
    /// Prepended to every encoded text, when the tokenizer config asks for it.
    pub bos: Option<u32>,
    /// Tokens that end generation (the config's EOS token).
    pub eos: Vec<u32>,
    /// Jinja chat template, if the tokenizer config carries one.
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, Error> {
        let path = dir.join("tokenizer.json");
        let bytes = super::read_regular(&path)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let mut tok = Tokenizer {
            inner,
            plain: OnceLock::new(),
            path,
            bos: None,
            eos: Vec::new(),
            chat_template: None,
        };
        let config_path = dir.join("tokenizer_config.json");
        if config_path.exists() {
            tok.apply_config(&config_path)?;
        }
        Ok(tok)
    }

    fn apply_config(&mut self, path: &Path) -> Result<(), Error> {
        let text = super::read_regular(path)?;
        self.apply_config_json(&text, path)
    }

    /// Takes the special tokens and chat template of a `tokenizer_config.json` whose
    /// bytes are `text` (`path` names it in errors), replacing what an earlier one set.
    pub fn apply_config_json(&mut self, text: &[u8], path: &Path) -> Result<(), Error> {
        self.bos = None;
        self.eos.clear();
        self.chat_template = None;
        let bad = |reason: String| Error::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        let cfg: Value = serde_json::from_slice(text).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        // A special token is written either as a string or as {"content": ...}.
        let token_text = |key: &str| -> Option<String> {
            match cfg.get(key)? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let id_of = |key: &str| -> Result<Option<u32>, Error> {
            match token_text(key) {
                None => Ok(None),
                Some(t) => self
                    .inner
                    .token_to_id(&t)
                    .map(Some)
                    .ok_or_else(|| bad(format!("{key} {t:?} is not in the vocabulary"))),
            }
        };
        if cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            self.bos = Some(
                id_of("bos_token")?
                    .ok_or_else(|| bad("add_bos_token is set but bos_token is not".into()))?,
            );
        }
        if let Some(eos) = id_of("eos_token")? {
            self.eos.push(eos);
        }
        self.chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(())
    }

    /// Token ids of `text`, with the BOS token first if the tokenizer adds one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                reason: e.to_string(),
            })?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        ids.extend(self.bos);
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Token ids of `text` without the BOS token; special tokens written in it are
    /// those tokens (what a chat template's own markers are).
    pub fn encode_special(&self, text: &str) -> Result<Vec<u32>, Error> {
        self.ids(&self.inner, text)
    }

    /// Token ids of `text` without the BOS token, special tokens written in it read as
    /// plain text: what a user's message is, so that it cannot forge a control token.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, Error> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        self.ids(plain, text)
    }

    fn ids(&self, t: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, Error> {
        t.encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }

    /// The text of every special token of the vocabulary (`<|im_start|>`, ...).
    pub fn special_tokens(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        v.sort();
        v
    }

    /// The most bytes of text one token can stand for: the longest entry of the
    /// vocabulary, added tokens included. A byte-level vocabulary spells a byte of
    /// 0x80 or above as a two-byte character, so this is never less than the truth;
    /// `text.len() / longest_token_bytes()` is a floor on the tokens `text` encodes to.
    pub fn longest_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// The id of a token written exactly as `text` (special tokens included).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// The vocabulary entry of `id`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Text of `ids`, special tokens dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }
}
