//! Dense linear layers and the LM head at MLX affine widths (`--dense-codec q4`,
//! `--head-codec q4`, q3, q2), quantized at load: the loader's matrices are MLX's
//! quantization and the expert stores' 3- and 2-bit repacking bit for bit, their products
//! are the products with the weights they stand for, the codec moves perplexity a little
//! from a Hugging Face checkpoint and from a converted directory alike, bits accounting
//! prices the bytes they take, and a width that is not whole groups is refused by name.

use std::collections::BTreeMap;
use std::path::Path;

use dynmoe::backend::{Backend, Cpu, Weight};
use dynmoe::checkpoint::arch::TensorKind;
use dynmoe::checkpoint::{Checkpoint, Config};
use dynmoe::codec::affine::{self, lowbit};
use dynmoe::codec::Codec;
use dynmoe::eval::bits::{account, Assignment};
use dynmoe::eval::ppl::{perplexity, PplOptions};
use dynmoe::model::weights::Loader;
use dynmoe::model::{self, Codecs};
use dynmoe::store::dense_vq::GroupCodecs;
use dynmoe::store::{dense_vq::CodedLayers, dense_vq::CodedWeight};
use dynmoe::testing::{
    fixture, fixture_copy, fresh, logits_of, rel_err, write_checkpoint_replacing, TempDir,
};
use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

const Q4: Codec = Codec::Affine { bits: 4 };

/// A checkpoint of `tensors` (name, rows, cols) holding random bf16 values, and those
/// values as the checkpoint reads them.
fn random_checkpoint(tensors: &[(&str, usize, usize)]) -> (TempDir, Vec<Vec<f32>>) {
    let dir = TempDir::new("dense-affine");
    let values: Vec<Vec<f32>> = tensors
        .iter()
        .enumerate()
        .map(|(i, &(_, rows, cols))| {
            fresh(rows * cols, 40 + i as u64)
                .into_iter()
                .map(|v| bf16::from_f32(v).to_f32())
                .collect()
        })
        .collect();
    let bytes: Vec<Vec<u8>> = values
        .iter()
        .map(|v| {
            v.iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(&(name, rows, cols), b)| {
            (
                name,
                TensorView::new(Dtype::BF16, vec![rows, cols], b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path("model.safetensors")).unwrap();
    (dir, values)
}

/// The dense layers (`dense`) and LM head (`head`) of the checkpoint in `dir` coded as
/// a load codes them.
fn coded(dir: &Path, dense: Option<Codec>, head: Option<Codec>) -> CodedLayers {
    let ckpt = Checkpoint::open(dir).unwrap();
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let converted = dynmoe::store::is_converted(dir);
    model::coded_layers(
        dir,
        &ckpt,
        &config,
        &GroupCodecs::uniform(
            dense.unwrap_or(Codec::Bf16),
            head.unwrap_or(Codec::Bf16),
            Codec::Bf16,
        ),
        converted,
        &mut |_, _| {},
    )
    .unwrap()
}

/// A 48×192 matrix (three groups a row, one and a half 128-column chunks of the 3- and
/// 2-bit layouts) through the loader at each width: MLX's codes at 4 bits, the expert
/// stores' repacking of them at 3 and 2, the same scales and biases; and `Backend::linear`
/// on both CPU backends gives the product with the matrix those codes stand for.
#[test]
fn loaded_weights_are_mlx_codes_and_multiply_as_their_values() {
    let (rows, cols, batch) = (48, 192, 3);
    let name = "model.layers.0.self_attn.q_proj";
    let (dir, values) = random_checkpoint(&[(&format!("{name}.weight"), rows, cols)]);
    let ckpt = Checkpoint::open(dir.dir()).unwrap();
    let config = Config::from_file(&fixture("tiny-moe").join("config.json")).unwrap();
    let q4 = affine::quantize(&values[0], rows, cols, 4).unwrap();
    let x = fresh(batch * cols, 7);
    for bits in [4, 3, 2] {
        let (words, dequantized) = if bits == 4 {
            (q4.words.clone(), affine::dequantize(&q4))
        } else {
            let mut words = vec![0; rows * lowbit::words_per_row(cols, bits)];
            lowbit::pack_matrix(&q4.words, rows, cols, bits, &mut words);
            let d = lowbit::dequantize(&words, &q4.scales, &q4.biases, rows, cols, bits);
            (words, d)
        };
        let want: Vec<f32> = x
            .chunks(cols)
            .flat_map(|xr| {
                dequantized.chunks(cols).map(|wr| {
                    xr.iter()
                        .zip(wr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>() as f32
                })
            })
            .collect();
        let codec = Codec::Affine { bits };
        let coded = model::coded_layers(
            dir.dir(),
            &ckpt,
            &config,
            &GroupCodecs::uniform(codec, Codec::Bf16, Codec::Bf16),
            false,
            &mut |_, _| {},
        )
        .unwrap();
        assert_eq!(coded.len(), 1, "{codec}: {:?}", coded.keys());
        for backend in [Cpu::fast(), Cpu::reference()] {
            let loader = Loader {
                ckpt: &ckpt,
                stores: None,
                vq: &BTreeMap::new(),
                coded: &coded,
                backend: &backend,
                config: &config,
            };
            let linear = loader.linear(name, rows, cols, false).unwrap();
            let Weight::Affine(v) = linear.weight() else {
                panic!("{codec}: the loaded weight is not affine");
            };
            assert_eq!((v.bits, v.rows, v.cols), (bits, rows, cols));
            assert!(v.words == words.as_slice(), "{codec}: codes differ");
            assert!(v.scales == q4.scales.as_slice() && v.biases == q4.biases.as_slice());
            let mut out = backend.zeros(batch * rows);
            backend.linear(
                &backend.upload(&x),
                linear.weight(),
                batch,
                cols,
                rows,
                &mut out,
            );
            let mut got = vec![0.0; batch * rows];
            backend.download(&out, &mut got);
            let err = rel_err(&got, &want);
            assert!(err < 1e-5, "{codec} on {}: {err:e}", backend.name());
        }
    }
}

/// A weight whose width is not a whole number of 64-column groups is an error naming the
/// tensor and its file, at any width.
#[test]
fn a_width_that_is_not_whole_groups_is_refused_by_name() {
    let name = "model.layers.0.self_attn.o_proj.weight";
    let (dir, _) = random_checkpoint(&[(name, 16, 100)]);
    let ckpt = Checkpoint::open(dir.dir()).unwrap();
    let config = Config::from_file(&fixture("tiny-moe").join("config.json")).unwrap();
    for bits in [4, 3, 2] {
        let err = model::coded_layers(
            dir.dir(),
            &ckpt,
            &config,
            &GroupCodecs::uniform(Codec::Affine { bits }, Codec::Bf16, Codec::Bf16),
            false,
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(name)
                && err.contains(&dir.path("model.safetensors").display().to_string())
                && err.contains("100 columns"),
            "q{bits}: {err}"
        );
    }
}

/// The dense layers and the head of a checkpoint at each width, their matrices
/// dequantized into a copy of the checkpoint (f32), as `dir`'s model: the one whose bf16
/// forward pass the coded model must reproduce.
fn dequantized_copy(dir: &Path, layers: &CodedLayers) -> TempDir {
    let copy = fixture_copy(dir.file_name().unwrap().to_str().unwrap());
    let weights = layers
        .iter()
        .map(|(name, m)| match m {
            CodedWeight::Affine(a) => (name.clone(), a.dequantize()),
            CodedWeight::Vq(_) => panic!("{name} is VQ-coded"),
        })
        .collect();
    let ckpt = Checkpoint::open(dir).unwrap();
    write_checkpoint_replacing(&ckpt, &weights, &copy.path("model.safetensors"));
    copy
}

fn logits(dir: &Path, codecs: &Codecs) -> Vec<f32> {
    let m = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    logits_of(
        &m,
        "The keeper of the lighthouse wrote: def main(): return 42",
    )
}

/// A model whose dense layers and head run coded equals the same model whose checkpoint
/// holds the dequantized weights: the products straight from the codes are the products
/// with the weights the codes stand for, in every layer.
#[test]
fn coded_models_equal_their_dequantized_weights() {
    let dir = fixture("tiny-moe");
    let plain = logits(&dir, &Codecs::default());
    for bits in [4, 3, 2] {
        let c = Some(Codec::Affine { bits });
        let codecs = Codecs {
            dense: c,
            head: c,
            ..Codecs::default()
        };
        let coded_logits = logits(&dir, &codecs);
        let decoded = dequantized_copy(&dir, &coded(&dir, c, c));
        let err = rel_err(&coded_logits, &logits(decoded.dir(), &Codecs::default()));
        assert!(
            err < 1e-5,
            "q{bits}: coded against dequantized logits {err:e}"
        );
        assert!(
            rel_err(&coded_logits, &plain) > 1e-3,
            "q{bits} coded nothing"
        );
    }
}

/// The largest relative change of perplexity [`q4_costs_little`] accepts: three times the
/// largest measured (from the checkpoint 3.5845, with q4 dense layers +2.7%, a q4 head
/// +0.8%, both +3.6%; from a converted directory 3.6025, +3.1%, +0.7%, +4.0%).
const Q4_BOUND: f64 = 0.12;

fn perplexity_of(dir: &Path, codecs: &Codecs) -> f64 {
    let text = std::fs::read_to_string("../../data/corpus/code/test.txt").unwrap();
    let m = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    let opts = PplOptions {
        ctx: 512,
        max_chunks: Some(4),
        micro_batch: None,
    };
    perplexity(&m, &text, opts, &mut |_, _| {}).unwrap().ppl
}

/// Each of q4 dense layers, a q4 head and both moves small-moe's perplexity on 4 chunks
/// of the code test split, by less than [`Q4_BOUND`].
fn q4_costs_little(dir: &Path) {
    let bf16 = perplexity_of(dir, &Codecs::default());
    for (what, dense, head) in [
        ("dense", Some(Q4), None),
        ("head", None, Some(Q4)),
        ("both", Some(Q4), Some(Q4)),
    ] {
        let codecs = Codecs {
            dense,
            head,
            ..Codecs::default()
        };
        let ppl = perplexity_of(dir, &codecs);
        let change = ppl / bf16 - 1.0;
        eprintln!(
            "{}: q4 {what}: {ppl:.4} against {bf16:.4} ({:+.3}%)",
            dir.display(),
            100.0 * change
        );
        assert!(change.abs() > 1e-5, "q4 {what} changed nothing: {ppl}");
        assert!(change.abs() < Q4_BOUND, "q4 {what}: {ppl} against {bf16}");
    }
}

/// From the Hugging Face checkpoint, which is left as it was: affine dense layers need no
/// file.
#[test]
fn q4_dense_layers_and_head_cost_little_perplexity() {
    let dir = fixture_copy("small-moe");
    let listing = || {
        let mut v: Vec<_> = std::fs::read_dir(dir.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };
    let before = listing();
    q4_costs_little(dir.dir());
    assert_eq!(listing(), before, "quantizing at load wrote a file");
}

/// From a converted directory (experts from its 4-bit store): its dense tensors are the
/// checkpoint's, so they code to the same matrices, and cost as little.
#[test]
fn a_converted_directory_codes_its_dense_layers_the_same() {
    let src = fixture("small-moe");
    let converted = TempDir::new("dense-affine-converted");
    dynmoe::store::base::convert(&src, converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 3, 2] {
        let c = Some(Codec::Affine { bits });
        let from_converted = coded(converted.dir(), c, c);
        assert_eq!(from_converted, coded(&src, c, c), "q{bits}");
        assert!(from_converted.contains_key("lm_head.weight"));
        assert!(from_converted
            .values()
            .all(|m| matches!(m, CodedWeight::Affine(a) if a.bits == bits)));
    }
    q4_costs_little(converted.dir());
}

/// Affine dense layers beside a VQ head, and the other way round, from a checkpoint (the
/// VQ file holds only what is VQ-coded); a converted directory takes the affine choice
/// and refuses the VQ one, naming the directory.
#[test]
fn affine_and_vq_choices_mix() {
    let dir = fixture_copy("tiny-moe");
    let vq4: Codec = "vq4".parse().unwrap();
    for (dense, head) in [(Q4, vq4), (vq4, Q4)] {
        let layers = coded(dir.dir(), Some(dense), Some(head));
        for (name, m) in &layers {
            let want = if name == "lm_head.weight" {
                head
            } else {
                dense
            };
            let affine = matches!(m, CodedWeight::Affine(_));
            assert_eq!(affine, want == Q4, "{name} at {dense}/{head}");
        }
        let file = std::fs::read(dir.path("dense-vq4.safetensors")).unwrap();
        let held = safetensors::SafeTensors::deserialize(&file)
            .unwrap()
            .names()
            .len();
        let vq = layers
            .values()
            .filter(|m| matches!(m, CodedWeight::Vq(_)))
            .count();
        assert_eq!(held, 2 * vq, "codes and norms of the VQ-coded weights only");
        let codecs = Codecs {
            dense: Some(dense),
            head: Some(head),
            ..Codecs::default()
        };
        let m = model::load_with_codecs(dir.dir(), Cpu::fast(), &codecs).unwrap();
        let mut state = m.model.new_state(8);
        let logits = m.model.forward(&mut state, &[1, 2, 3, 4], 0).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()));
        std::fs::remove_file(dir.path("dense-vq4.safetensors")).unwrap();
    }

    let converted = TempDir::new("dense-affine-mix");
    dynmoe::store::base::convert(&fixture("tiny-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    assert!(coded(converted.dir(), Some(Q4), None).len() > 1);
    let codecs = Codecs {
        dense: Some(Q4),
        head: Some(vq4),
        ..Codecs::default()
    };
    let err = model::load_with_codecs(converted.dir(), Cpu::fast(), &codecs)
        .err()
        .expect("a converted directory has no VQ-coded layers")
        .to_string();
    assert!(
        err.contains(&converted.dir().display().to_string()) && err.contains("vq4"),
        "{err}"
    );
}

/// `dynmoe inspect --dense-codec qN --head-codec qN` prices the attention projections and
/// the LM head at exactly the bytes their coded matrices take: codes plus a bf16 scale and
/// bias per 64 weights; nothing else moves and no codebook is counted.
#[test]
fn bits_accounting_prices_the_coded_bytes() {
    let dir = fixture("tiny-moe");
    let config = Config::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let full = account(&config, &ckpt, &Assignment::uncompressed(), None).unwrap();
    for bits in [4, 3, 2] {
        let codec = Codec::Affine { bits };
        let priced = account(
            &config,
            &ckpt,
            &Assignment {
                tensors: GroupCodecs::uniform(codec, codec, Codec::Bf16),
                ..Assignment::uncompressed()
            },
            None,
        )
        .unwrap();
        let layers = coded(&dir, Some(codec), Some(codec));
        let held = |head: bool| -> u64 {
            layers
                .iter()
                .filter(|(n, _)| (n.as_str() == "lm_head.weight") == head)
                .map(|(_, m)| match m {
                    CodedWeight::Affine(a) => {
                        (4 * a.words.len() + 2 * a.scales.len() + 2 * a.biases.len()) as u64
                    }
                    CodedWeight::Vq(_) => panic!("{codec}: a VQ matrix"),
                })
                .sum()
        };
        assert_eq!(priced.resident_by_kind[&TensorKind::Attention], held(false));
        assert_eq!(priced.resident_by_kind[&TensorKind::LmHead], held(true));
        assert_eq!(priced.codebook_bytes, 0);
        let params: u64 = layers
            .values()
            .map(|m| {
                let (r, c) = m.shape();
                (r * c) as u64
            })
            .sum();
        assert_eq!(
            full.resident_bytes - priced.resident_bytes,
            2 * params - held(false) - held(true)
        );
        // Codes plus 32 bits of scale and bias per 64 weights.
        assert_eq!(
            (held(false) + held(true)) * 16,
            params * (2 * bits as u64 + 1)
        );
    }
}

/// A coded embedding table looked up on the CPU gives exactly the rows of the whole
/// table decoded, at every affine width and every rung of the ladder (ids repeated,
/// first and last; the output poisoned first).
#[test]
fn coded_embedding_lookups_are_the_decoded_tables_rows() {
    use dynmoe::backend::{Backend, Weight};
    use dynmoe::codec::vq::{VqMatrix, LADDER};
    let (vocab, dim) = (300, 256);
    let ids = [0u32, 299, 17, 17, 150];
    let table = dynmoe::testing::fresh(vocab * dim, 31);
    let check = |name: &str, w: Weight<'_, Vec<f32>>, decoded: Vec<f32>| {
        let b = Cpu::fast();
        let mut out = b.alloc(ids.len() * dim);
        out.fill(f32::NAN);
        b.embed(w, dim, &ids, &mut out);
        for (r, &id) in ids.iter().enumerate() {
            let want = &decoded[id as usize * dim..(id as usize + 1) * dim];
            assert_eq!(&out[r * dim..(r + 1) * dim], want, "{name}: id {id}");
        }
    };
    for bits in [4, 3, 2] {
        let m = dynmoe::codec::affine::AffineMatrix::quantize(&table, vocab, dim, bits).unwrap();
        check(
            &format!("q{bits}"),
            Weight::Affine(m.view()),
            m.dequantize(),
        );
    }
    for rung in LADDER {
        let m = VqMatrix::encode(&table, vocab, dim, rung, 9).unwrap();
        check(
            rung.name().as_str(),
            Weight::Vq(m.view()),
            m.decode().unwrap(),
        );
    }
}
