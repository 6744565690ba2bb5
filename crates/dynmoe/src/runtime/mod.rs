//! Running a loaded model: sampling and the generation loop shared by `run`, `chat`
//! and `serve`, and the resident sets they run with.

pub mod chat;
pub mod generate;
pub mod residency;
