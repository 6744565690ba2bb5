//! Running a loaded model: sampling and the generation loop shared by `run`, `chat`
//! and `serve`.

pub mod chat;
pub mod generate;
