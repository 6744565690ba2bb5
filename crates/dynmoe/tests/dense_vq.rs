//! Dense linear layers and the LM head at VQ rungs: the coded file beside a checkpoint
//! round-trips and is reused, every kind of damage is refused with the file and field
//! named, and a model run with coded layers equals the same model whose checkpoint holds
//! the decoded weights.

use std::collections::HashMap;
use std::path::Path;

use dynmoe::backend::Cpu;
use dynmoe::checkpoint::Checkpoint;
use dynmoe::codec::vq::Rung;
use dynmoe::codec::Codec;
use dynmoe::model::{self, Codecs};
use dynmoe::store::dense_vq::{self, dense_linear_weights, lm_head_weight};
use dynmoe::store::Error;
use dynmoe::testing::{fixture_copy, logits_of, rel_err, write_checkpoint_replacing, TempDir};
use safetensors::tensor::TensorView;

fn rung(s: &str) -> Rung {
    Rung::parse(s).unwrap()
}

fn fingerprint_of(dir: &Path) -> String {
    // The fingerprint ensure() records: read back from the file it wrote.
    let bytes = std::fs::read(dir.join(dense_vq::file_name(rung("vq2")))).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().as_ref().unwrap()["source_fingerprint"].clone()
}

fn logits(m: &model::LoadedModel<Cpu>) -> Vec<f32> {
    logits_of(
        m,
        "The keeper of the lighthouse wrote: def main(): return 42",
    )
}

/// The model with its dense layers and its LM head at `codec`.
fn with_dense(dir: &Path, codec: &str) -> model::LoadedModel<Cpu> {
    let codecs = Codecs {
        dense: Some(codec.parse::<Codec>().unwrap()),
        head: Some(codec.parse::<Codec>().unwrap()),
        ..Codecs::default()
    };
    model::load_with_codecs(dir, Cpu::fast(), &codecs).unwrap()
}

/// Every attention projection is coded (tiny-moe has no shared experts or dense MLPs),
/// a second ensure reads the file instead of encoding again, and what it reads equals
/// the encoder's output.
#[test]
fn coded_layers_round_trip_and_are_reused() {
    let dir = fixture_copy("tiny-moe");
    let ckpt = Checkpoint::open(dir.dir()).unwrap();
    let names: Vec<String> = dense_linear_weights(&ckpt)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let layers = 2;
    assert_eq!(names.len(), 4 * layers, "{names:?}");
    assert!(names.iter().all(|n| n.contains("self_attn")));

    let weights = dense_linear_weights(&ckpt).unwrap();
    let first = dense_vq::ensure(dir.dir(), &ckpt, rung("vq2"), &weights, &mut |_, _| {}).unwrap();
    let path = dir.path(&dense_vq::file_name(rung("vq2")));
    let written = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut encoded = 0;
    let second = dense_vq::ensure(dir.dir(), &ckpt, rung("vq2"), &weights, &mut |_, _| {
        encoded += 1
    })
    .unwrap();
    assert_eq!(encoded, 0, "the second ensure encoded again");
    assert_eq!(
        std::fs::metadata(&path).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(first, second);
    let fresh = dense_vq::encode(&ckpt, rung("vq2"), &weights, &mut |_, _| {}).unwrap();
    assert_eq!(first, fresh);
    for (name, m) in &first {
        assert_eq!(m.seed, dense_vq::seed(name));
    }

    // The LM head at the same rung joins the same file; the dense layers stay in it and
    // are read, not encoded, again.
    let config = dynmoe::checkpoint::Config::from_file(&dir.path("config.json")).unwrap();
    let head = lm_head_weight(&ckpt, &config)
        .unwrap()
        .expect("tiny-moe's head is untied");
    let with_head = dense_vq::ensure(
        dir.dir(),
        &ckpt,
        rung("vq2"),
        std::slice::from_ref(&head),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(with_head.keys().collect::<Vec<_>>(), vec![&head.0]);
    let mut encoded = 0;
    let again = dense_vq::ensure(dir.dir(), &ckpt, rung("vq2"), &weights, &mut |_, _| {
        encoded += 1
    })
    .unwrap();
    assert_eq!((encoded, &again), (0, &first));
}

/// A model whose dense layers and LM head run coded equals the model whose checkpoint
/// holds the decoded weights (in f32): the products straight from the codes are the
/// products with the weights the codes stand for.
#[test]
fn coded_dense_layers_equal_their_decoded_weights() {
    let coded_dir = fixture_copy("tiny-moe");
    let decoded_dir = fixture_copy("tiny-moe");
    let ckpt = Checkpoint::open(coded_dir.dir()).unwrap();
    let config = dynmoe::checkpoint::Config::from_file(&coded_dir.path("config.json")).unwrap();
    let mut weights = dense_linear_weights(&ckpt).unwrap();
    weights.extend(lm_head_weight(&ckpt, &config).unwrap());
    assert_eq!(
        weights.len(),
        9,
        "attention projections and the head: {weights:?}"
    );
    let coded = dense_vq::encode(&ckpt, rung("vq2"), &weights, &mut |_, _| {}).unwrap();
    let decoded = coded
        .iter()
        .map(|(name, m)| (name.clone(), m.decode().unwrap()))
        .collect();
    write_checkpoint_replacing(&ckpt, &decoded, &decoded_dir.path("model.safetensors"));
    drop(ckpt);

    let a = logits(&with_dense(coded_dir.dir(), "vq2"));
    let b = logits(&model::load(decoded_dir.dir(), Cpu::fast()).unwrap());
    let plain = logits(&model::load(coded_dir.dir(), Cpu::fast()).unwrap());
    let err = rel_err(&a, &b);
    assert!(err < 1e-5, "coded vs decoded logits: {err:e}");
    // And the coding is not a no-op.
    assert!(rel_err(&a, &plain) > 1e-3);
}

fn expect_manifest_field(err: Error, path: &Path, field: &str) {
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains(field),
        "{msg} (wanted file {} and field {field})",
        path.display()
    );
}

/// A flipped code byte, a truncated file, a file of another rung, of another checkpoint,
/// and a file with a metadata field missing are each refused, naming the file and field;
/// ensure() then encodes again instead of trusting it.
#[test]
fn damaged_files_are_refused_naming_file_and_field() {
    let dir = fixture_copy("tiny-moe");
    let ckpt = Checkpoint::open(dir.dir()).unwrap();
    let r = rung("vq2");
    let weights = dense_linear_weights(&ckpt).unwrap();
    let good = dense_vq::ensure(dir.dir(), &ckpt, r, &weights, &mut |_, _| {}).unwrap();
    let path = dir.path(&dense_vq::file_name(r));
    let fp = fingerprint_of(dir.dir());
    let pristine = std::fs::read(&path).unwrap();

    // A flipped byte in the last tensor's data: its checksum no longer matches.
    let mut bytes = pristine.clone();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    expect_manifest_field(
        dense_vq::read(&path, r, &fp).unwrap_err(),
        &path,
        "checksum",
    );

    // Truncated.
    std::fs::write(&path, &pristine[..pristine.len() - 100]).unwrap();
    let msg = dense_vq::read(&path, r, &fp).unwrap_err().to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");

    // Read as another rung, or against another checkpoint.
    std::fs::write(&path, &pristine).unwrap();
    expect_manifest_field(
        dense_vq::read(&path, rung("vq3"), &fp).unwrap_err(),
        &path,
        "rung",
    );
    expect_manifest_field(
        dense_vq::read(&path, r, "fnv1a64:0000000000000000").unwrap_err(),
        &path,
        "source_fingerprint",
    );

    // Missing file.
    let gone = dir.path("dense-vq1.safetensors");
    assert!(matches!(
        dense_vq::read(&gone, rung("vq1"), &fp),
        Err(Error::Missing { .. })
    ));

    // Metadata fields dropped one at a time.
    for field in [
        "format",
        "version",
        "rung",
        "codebook",
        "source_fingerprint",
        "tensors",
    ] {
        let out = TempDir::new("dense-vq-field");
        let p = out.path("dense.safetensors");
        rewrite_metadata(&pristine, &p, |m| {
            m.remove(field);
        });
        expect_manifest_field(dense_vq::read(&p, r, &fp).unwrap_err(), &p, field);
    }

    // After damage, ensure() encodes again and rewrites a good file.
    let mut bytes = pristine.clone();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let again = dense_vq::ensure(dir.dir(), &ckpt, r, &weights, &mut |_, _| {}).unwrap();
    assert_eq!(again, good);
    assert_eq!(dense_vq::read(&path, r, &fp).unwrap(), good);
}

/// The same file with its metadata edited.
fn rewrite_metadata(src: &[u8], dst: &Path, edit: impl FnOnce(&mut HashMap<String, String>)) {
    let st = safetensors::SafeTensors::deserialize(src).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(src).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    edit(&mut meta);
    let views: Vec<(String, TensorView<'_>)> = st.tensors();
    safetensors::serialize_to_file(views, Some(meta), dst).unwrap();
}

/// Loading a checkpoint with dense layers at a VQ rung through the command-line path,
/// and the codecs a dense layer cannot take.
#[test]
fn dense_codec_choices_are_checked() {
    let dir = fixture_copy("tiny-moe");
    let m = with_dense(dir.dir(), "vq3");
    assert!(dir.path("dense-vq3.safetensors").exists());
    assert!(logits(&m).iter().all(|v| v.is_finite()));
    for codec in [Codec::Affine { bits: 8 }, Codec::Vq { millibits: 1300 }] {
        let codecs = Codecs {
            dense: Some(codec),
            ..Codecs::default()
        };
        let err = model::load_with_codecs(dir.dir(), Cpu::fast(), &codecs)
            .err()
            .unwrap_or_else(|| panic!("dense layers at {codec} loaded"))
            .to_string();
        assert!(err.contains(&codec.to_string()), "{err}");
    }
}
