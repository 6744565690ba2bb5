//! How the CUDA backend runs: a [`Tuning`] chosen when the backend is made. The defaults
//! are what measured fastest (the GPU rounds in docs/notes/); the fields are what a user may want
//! otherwise, to debug or to measure one way against another. The one environment
//! variable the backend reads, `DYNMOE_CUDA`, overrides them:
//!
//! ```text
//! DYNMOE_CUDA=graphs=0,pdl=0
//! DYNMOE_CUDA=tensor_cores=0
//! DYNMOE_CUDA=define=TIMELINE=65536,define=PHASES=512
//! ```

use super::CudaError;

/// The backend's run-time choices ([`Cuda::with_tuning`](super::Cuda::with_tuning)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuning {
    /// Record each decode step as a CUDA graph the first time it runs, then replay it
    /// (`graphs=1`, the default). Off, every step launches its kernels one by one: to
    /// debug a kernel, or to time what recording buys.
    pub graphs: bool,
    /// Launch kernels with programmatic dependent launch on sm_90 and later (`pdl=1`, the
    /// default), so that each is scheduled while the one before it finishes and the
    /// kernels that may load before their wait do. Off, every kernel starts once the one
    /// before has ended, as on older devices.
    pub pdl: bool,
    /// Run products on tensor cores on sm_80 and later (`tensor_cores=1`, the default):
    /// prompts' dense products through cuBLAS' bf16 GEMM and their experts through the
    /// grouped GEMMs, a decode step's affine and VQ products through the `mma.sync`
    /// kernels. Off, the portable kernels older devices run: f32 GEMMs for prompts (their
    /// affine experts then take the host path), matrix-vector kernels for decode.
    pub tensor_cores: bool,
    /// Kernel constants passed to NVRTC as `-DNAME=VALUE` (`define=NAME=VALUE`, any number
    /// of them; none by default): the tunable constants the kernel sources mark with
    /// `#ifndef`, and the `TIMELINE` and `PHASES` instruments (`#ifdef`). For measuring
    /// other values on one binary; the host reads `DMMA_BLOCKS` too.
    pub defines: Vec<(String, String)>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            graphs: true,
            pdl: true,
            tensor_cores: true,
            defines: Vec::new(),
        }
    }
}

impl Tuning {
    /// The environment variable [`from_env`](Self::from_env) reads.
    pub const VARIABLE: &'static str = "DYNMOE_CUDA";

    /// The defaults, with what `DYNMOE_CUDA` sets (the defaults alone when it is unset).
    pub fn from_env() -> Result<Tuning, CudaError> {
        match std::env::var(Self::VARIABLE) {
            Ok(value) => Self::parse(&value),
            Err(std::env::VarError::NotPresent) => Ok(Tuning::default()),
            Err(std::env::VarError::NotUnicode(v)) => Err(CudaError::Tuning {
                item: v.to_string_lossy().into_owned(),
                expected: "UTF-8 text".into(),
            }),
        }
    }

    /// The defaults, with what `value` sets: comma-separated `key=value` items, `graphs`,
    /// `pdl` and `tensor_cores` taking 0 or 1 (a later item wins), `define` taking
    /// `NAME=VALUE` for a constant the kernel sources let be set. Spaces around an item
    /// and empty items are ignored.
    pub fn parse(value: &str) -> Result<Tuning, CudaError> {
        let mut t = Tuning::default();
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let bad = |expected: String| CudaError::Tuning {
                item: item.to_string(),
                expected,
            };
            let Some((key, v)) = item.split_once('=') else {
                return Err(bad("a key=value item".into()));
            };
            let flag = || match v {
                "0" => Ok(false),
                "1" => Ok(true),
                _ => Err(bad(format!("{key} takes 0 or 1"))),
            };
            match key {
                "graphs" => t.graphs = flag()?,
                "pdl" => t.pdl = flag()?,
                "tensor_cores" => t.tensor_cores = flag()?,
                "define" => {
                    let (name, v) = v
                        .split_once('=')
                        .filter(|(n, v)| !n.is_empty() && !v.is_empty())
                        .ok_or_else(|| bad("define takes NAME=VALUE".into()))?;
                    let tunables = super::program::tunables();
                    if !tunables.contains(&name) {
                        return Err(bad(format!(
                            "{name} is not a constant the kernels let be set ({})",
                            tunables.join(", ")
                        )));
                    }
                    if !v
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.+-".contains(c))
                    {
                        return Err(bad(format!("{name}'s value is not a plain token")));
                    }
                    t.defines.push((name.to_string(), v.to_string()));
                }
                _ => {
                    return Err(bad(format!(
                        "unknown key {key} (graphs, pdl, tensor_cores, define)"
                    )))
                }
            }
        }
        Ok(t)
    }

    /// The value `define` sets for the kernel constant `name` (the last one given).
    pub fn define(&self, name: &str) -> Option<&str> {
        self.defines
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Tuning;

    #[test]
    fn unset_or_empty_is_the_defaults() {
        assert_eq!(Tuning::parse("").unwrap(), Tuning::default());
        assert_eq!(Tuning::parse(" , ,").unwrap(), Tuning::default());
        let d = Tuning::default();
        assert!(d.graphs && d.pdl && d.tensor_cores && d.defines.is_empty());
    }

    #[test]
    fn each_key_sets_its_field_and_a_later_item_wins() {
        let t = Tuning::parse("graphs=0, pdl=0,tensor_cores=0").unwrap();
        assert!(!t.graphs && !t.pdl && !t.tensor_cores);
        let t = Tuning::parse("pdl=0,pdl=1,graphs=1").unwrap();
        assert!(t.graphs && t.pdl && t.tensor_cores);
    }

    #[test]
    fn the_kernels_let_their_tunable_constants_and_instruments_be_set() {
        assert_eq!(
            super::super::program::tunables(),
            [
                "DMMA_BLOCKS",
                "DMMA_UNITS",
                "MV_ONE_BLOCKS",
                "PHASES",
                "RMMA_DOWN_UNITS",
                "RMMA_GATE_UP_BLOCKS",
                "RMMA_GATE_UP_UNITS",
                "TIMELINE",
                "VQM_BLOCKS",
            ]
        );
    }

    #[test]
    fn defines_name_tunable_constants_and_the_instruments() {
        let t =
            Tuning::parse("define=TIMELINE=65536,define=PHASES=512,define=DMMA_UNITS=8").unwrap();
        assert_eq!(
            t.defines,
            [
                ("TIMELINE", "65536"),
                ("PHASES", "512"),
                ("DMMA_UNITS", "8")
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        let t = Tuning::parse("define=DMMA_BLOCKS=3,define=DMMA_BLOCKS=2").unwrap();
        assert_eq!(t.define("DMMA_BLOCKS"), Some("2"));
        assert_eq!(t.define("DMMA_UNITS"), None);
    }

    #[test]
    fn each_error_names_the_variable_the_item_and_what_it_takes() {
        for (value, item, says) in [
            ("graphs=2", "graphs=2", "graphs takes 0 or 1"),
            ("pdl=off", "pdl=off", "pdl takes 0 or 1"),
            ("pdl", "pdl", "a key=value item"),
            ("graphs=1,graph=0", "graph=0", "unknown key graph"),
            (
                "define=DMMA_UNITS",
                "define=DMMA_UNITS",
                "define takes NAME=VALUE",
            ),
            ("define==4", "define==4", "define takes NAME=VALUE"),
            (
                "define=DMMA_UNIT=4",
                "define=DMMA_UNIT=4",
                "DMMA_UNIT is not a constant",
            ),
            (
                "define=RMMA_ROWS=8",
                "define=RMMA_ROWS=8",
                "RMMA_ROWS is not a constant",
            ),
            (
                "define=DMMA_UNITS=4;x",
                "define=DMMA_UNITS=4;x",
                "not a plain token",
            ),
        ] {
            let err = Tuning::parse(value).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("DYNMOE_CUDA: `{item}`:")) && err.contains(says),
                "{value}: {err}"
            );
        }
    }
}
