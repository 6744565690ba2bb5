//! VQ expert stores beside a checkpoint: records against the encoder, reuse on a second
//! load, extension by a layer, every kind of damage caught with the file and field
//! named, a crash between data and manifest, and perplexity through a store against
//! the same rung encoded in memory.
//!
//! Records are read here by the byte offsets of `docs/FORMAT.md` §13 as well as through
//! the library's views, so the document is held to the bytes.

use std::collections::BTreeMap;
use std::path::Path;

use dynmoe::backend::Cpu;
use dynmoe::checkpoint::{experts::ExpertShape, experts::ExpertTensors};
use dynmoe::checkpoint::{Checkpoint, Config};
use dynmoe::codec::vq::{Rung, VqMatrix};
use dynmoe::codec::Codec;
use dynmoe::eval::ppl::{perplexity_tokens, PplOptions};
use dynmoe::model::{self, Codecs};
use dynmoe::store::vq::{self, VqLayout, VqManifest, VqStore, HEADER};
use dynmoe::store::{vq_encode::encode_experts, vq_encode::vq_seed};
use dynmoe::store::{Error, PAGE};
use dynmoe::testing::{fixture_copy, TempDir};

fn rung(s: &str) -> Rung {
    Rung::parse(s).unwrap()
}

fn open_ckpt(dir: &Path) -> (Config, Checkpoint) {
    (
        Config::from_file(&dir.join("config.json")).unwrap(),
        Checkpoint::open(dir).unwrap(),
    )
}

fn ensure(dir: &Path, rungs: &[(usize, &str)]) -> vq::Ensured {
    let (config, ckpt) = open_ckpt(dir);
    let rungs: BTreeMap<usize, Rung> = rungs.iter().map(|&(l, r)| (l, rung(r))).collect();
    vq::ensure(dir, &config, &ckpt, &rungs, &mut |_, _| {}).unwrap()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn mtime(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

fn no_temp_files(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp."))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Every record of every layer equals, byte for byte, what `VqMatrix::encode` gives
/// for the checkpoint's weights with the seed the format states; the views are over
/// the mapped file, not copies; each layer at its own rung.
#[test]
fn records_are_the_encoder_output_at_each_layers_rung() {
    let dir = fixture_copy("tiny-moe");
    let done = ensure(dir.dir(), &[(0, "vq2"), (1, "vq1.5")]);
    assert_eq!(done.built.len(), 2, "one store per rung");
    let (config, ckpt) = open_ckpt(dir.dir());
    let shape = ExpertShape::of(&config);
    for (layer, name) in [(0, "vq2"), (1, "vq1.5")] {
        let store = &done.stores[&layer];
        assert_eq!(store.rung(), rung(name));
        assert_eq!(store.layers(), vec![layer]);
        assert_eq!(
            store.path().file_name().unwrap().to_string_lossy(),
            format!("experts-{name}.bin")
        );
        let t = ExpertTensors::find(
            &ckpt,
            &format!("model.layers.{layer}.mlp"),
            ["gate_proj", "up_proj", "down_proj"],
        )
        .unwrap();
        let layout = *store.layout();
        assert_eq!(layout.record_size % PAGE, 0);
        let file = read(store.path());
        for e in 0..shape.experts {
            let views = store.record(layer, e);
            let at = store.manifest().layers[0].offset as usize + e * layout.record_size;
            let record = &file[at..at + layout.record_size];
            // The header, at the offsets of the format document.
            assert_eq!(&record[..8], b"DMVQREC1");
            assert_eq!(
                u32::from_le_bytes(record[8..12].try_into().unwrap()),
                layer as u32
            );
            assert_eq!(
                u32::from_le_bytes(record[12..16].try_into().unwrap()),
                e as u32
            );
            for (p, v) in views.iter().enumerate() {
                let [rows, cols] = shape.matrix(p);
                let w = t.matrix(&ckpt, &shape, e, p).unwrap().0;
                let seed = vq_seed(layer, shape.experts, e, p);
                assert_eq!(seed, ((layer * shape.experts + e) * 3 + p) as u64);
                assert_eq!(u64_at(record, 16 + 8 * p), seed);
                let want = VqMatrix::encode(&w, rows, cols, rung(name), seed).unwrap();
                assert_eq!(
                    (v.rows, v.cols, v.seed, v.rung),
                    (rows, cols, seed, rung(name))
                );
                assert_eq!(
                    v.codes,
                    &want.codes[..],
                    "layer {layer} expert {e} proj {p}"
                );
                assert_eq!(
                    v.norms,
                    &want.norms[..],
                    "layer {layer} expert {e} proj {p}"
                );
                let m = &layout.matrices[p];
                assert_eq!(&record[m.codes.range()], &want.codes[..]);
                let norms: Vec<u8> = want.norms.iter().flat_map(|n| n.to_le_bytes()).collect();
                assert_eq!(&record[m.norms.range()], &norms[..]);
                assert_eq!(v.decode().unwrap(), want.decode().unwrap());
            }
            assert!(record[layout.data_end..].iter().all(|&b| b == 0), "padding");
            let mapped = store.record_bytes(store.record_index(layer, e).unwrap());
            assert_eq!(
                views[0].codes.as_ptr() as usize,
                mapped[layout.matrices[0].codes.range()].as_ptr() as usize,
                "a copy"
            );
        }
    }
    // The header is the first part; codes follow it.
    let l = VqLayout::new(rung("vq2"), 64, 64).unwrap();
    assert_eq!(l.matrices[0].codes.offset, HEADER);
}

/// A second load reads the store the first one wrote: nothing is encoded or written.
#[test]
fn second_load_reuses_the_store() {
    let dir = fixture_copy("tiny-moe");
    let codecs = Codecs {
        default: Some("vq2".parse::<Codec>().unwrap()),
        ..Codecs::default()
    };
    let first = model::load_with_codecs(dir.dir(), Cpu::fast(), &codecs).unwrap();
    let manifest = dir.path("experts-vq2.json");
    let data = dir.path("experts-vq2.bin");
    let (bytes, stamp, data_stamp) = (read(&manifest), mtime(&manifest), mtime(&data));
    let ids = first
        .tokenizer
        .encode("The whale swam past the lighthouse.")
        .unwrap();
    let mut s1 = first.model.new_state(ids.len());
    let want = first.model.forward(&mut s1, &ids, 0).unwrap();
    drop(first);

    let second = model::load_with_codecs(dir.dir(), Cpu::fast(), &codecs).unwrap();
    assert_eq!(read(&manifest), bytes);
    assert_eq!(mtime(&manifest), stamp, "the manifest was rewritten");
    assert_eq!(mtime(&data), data_stamp, "the data file was rewritten");
    let mut s2 = second.model.new_state(ids.len());
    assert_eq!(second.model.forward(&mut s2, &ids, 0).unwrap(), want);
    assert!(ensure(dir.dir(), &[(0, "vq2"), (1, "vq2")])
        .built
        .is_empty());
}

/// Asking for a layer the rung's store lacks rewrites it with both: the held layer's
/// records copied unchanged, the new one encoded.
#[test]
fn a_missing_layer_extends_the_store() {
    let dir = fixture_copy("tiny-moe");
    let first = ensure(dir.dir(), &[(1, "vq2")]);
    let held = first.stores[&1].record_bytes(0).to_vec();
    drop(first);
    let both = ensure(dir.dir(), &[(0, "vq2")]);
    let b = &both.built[0];
    assert_eq!((b.encoded.clone(), b.copied.clone()), (vec![0], vec![1]));
    assert!(b.reason.contains("holds layers [1]"), "{}", b.reason);
    let store = &both.stores[&0];
    assert_eq!(store.layers(), vec![0, 1]);
    assert_eq!(
        store.record_bytes(store.record_index(1, 0).unwrap()),
        &held[..]
    );
    let again = fixture_copy("tiny-moe");
    let direct = ensure(again.dir(), &[(0, "vq2"), (1, "vq2")]);
    assert_eq!(
        read(direct.stores[&0].path()),
        read(store.path()),
        "extending gives the bytes of building both at once"
    );
}

/// Builds `vq2` for both layers of a tiny-moe copy; returns the directory and the
/// data file's bytes.
fn built() -> (TempDir, Vec<u8>) {
    let dir = fixture_copy("tiny-moe");
    ensure(dir.dir(), &[(0, "vq2"), (1, "vq2")]);
    let good = read(&dir.path("experts-vq2.bin"));
    (dir, good)
}

/// The error opening the damaged store, which must name `file` and contain `what`;
/// then `ensure` rebuilds it to the original bytes.
fn refused_then_rebuilt(dir: &Path, good: &[u8], file: &str, what: &str) {
    let err = VqStore::open(dir, rung("vq2"))
        .err()
        .expect("a damaged store opened");
    let msg = err.to_string();
    assert!(msg.contains(file), "{msg}");
    assert!(msg.contains(what), "{msg}");
    let again = ensure(dir, &[(0, "vq2"), (1, "vq2")]);
    assert_eq!(again.built.len(), 1, "not rebuilt after: {msg}");
    assert_eq!(read(&dir.join("experts-vq2.bin")), good);
    assert!(VqStore::open(dir, rung("vq2")).is_ok());
    assert!(no_temp_files(dir));
}

#[test]
fn truncated_data_file_is_refused_and_rebuilt() {
    let (dir, good) = built();
    std::fs::write(dir.path("experts-vq2.bin"), &good[..good.len() - PAGE]).unwrap();
    let err = VqStore::open(dir.dir(), rung("vq2")).err().unwrap();
    assert!(matches!(err, Error::Size { .. }), "{err}");
    refused_then_rebuilt(dir.dir(), &good, "experts-vq2.bin", "truncated");
}

#[test]
fn flipped_byte_is_caught_by_its_record_checksum() {
    let (dir, good) = built();
    let mut bad = good.clone();
    // In the gate codes of the last record (layer 1, expert 7).
    let m: VqManifest = serde_json::from_slice(&read(&dir.path("experts-vq2.json"))).unwrap();
    let at = good.len() - m.record_size as usize + HEADER + 100;
    bad[at] ^= 0x10;
    std::fs::write(dir.path("experts-vq2.bin"), &bad).unwrap();
    refused_then_rebuilt(
        dir.dir(),
        &good,
        "experts-vq2.bin",
        "layers[1].checksums[7]",
    );
}

/// Each manifest field changed or removed is refused, naming the manifest and field.
#[test]
fn bad_manifest_fields_are_refused_and_rebuilt() {
    let (dir, good) = built();
    let path = dir.path("experts-vq2.json");
    let original: serde_json::Value = serde_json::from_slice(&read(&path)).unwrap();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        ("record_size", Box::new(|m| m["record_size"] = 4096.into())),
        ("file_size", Box::new(|m| m["file_size"] = 1.into())),
        ("hidden", Box::new(|m| m["hidden"] = 65.into())),
        (
            "codebook",
            Box::new(|m| m["codebook"] = "fnv1a64:0000000000000000".into()),
        ),
        (
            "layers[0].offset",
            Box::new(|m| m["layers"][0]["offset"] = 16384.into()),
        ),
        (
            "layers[1].layer",
            Box::new(|m| m["layers"][1]["layer"] = 7.into()),
        ),
        (
            "layers[1].checksums",
            Box::new(|m| {
                m["layers"][1]["checksums"].as_array_mut().unwrap().pop();
            }),
        ),
        ("version", Box::new(|m| m["version"] = 2.into())),
        (
            "format",
            Box::new(|m| m["format"] = "dynmoe-expert-store".into()),
        ),
        ("seed", Box::new(|m| m["seed"] = "expert".into())),
        (
            "`codebook`",
            Box::new(|m| {
                m.as_object_mut().unwrap().remove("codebook");
            }),
        ),
        (
            "`layers`",
            Box::new(|m| {
                m.as_object_mut().unwrap().remove("layers");
            }),
        ),
    ];
    for (field, change) in cases {
        let mut m = original.clone();
        change(&mut m);
        std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
        refused_then_rebuilt(dir.dir(), &good, "experts-vq2.json", field);
    }
    std::fs::write(&path, b"{ not json").unwrap();
    refused_then_rebuilt(dir.dir(), &good, "experts-vq2.json", "malformed");
}

/// A store of one rung under another rung's names is refused: by its `file` field, and
/// when that is patched too, by its `rung` field.
#[test]
fn a_store_of_another_rung_is_refused() {
    let (dir, _) = built();
    let other = rung("vq1.5");
    std::fs::copy(dir.path("experts-vq2.bin"), dir.path("experts-vq1.5.bin")).unwrap();
    std::fs::copy(dir.path("experts-vq2.json"), dir.path("experts-vq1.5.json")).unwrap();
    let err = VqStore::open(dir.dir(), other).err().unwrap().to_string();
    assert!(
        err.contains("experts-vq1.5.json") && err.contains("\"file\""),
        "{err}"
    );
    let mut m: VqManifest = serde_json::from_slice(&read(&dir.path("experts-vq1.5.json"))).unwrap();
    m.file = "experts-vq1.5.bin".into();
    std::fs::write(dir.path("experts-vq1.5.json"), m.to_bytes()).unwrap();
    let err = VqStore::open(dir.dir(), other).err().unwrap().to_string();
    assert!(err.contains("\"rung\"") && err.contains("vq2"), "{err}");
    // Asked for, it is rebuilt at its own rung.
    let done = ensure(dir.dir(), &[(0, "vq1.5")]);
    assert_eq!(done.built.len(), 1);
    assert_eq!(done.stores[&0].rung(), other);
}

/// A store encoded from another checkpoint (here: the configuration changed since) is
/// refused by its source fingerprint.
#[test]
fn a_store_of_another_checkpoint_is_refused() {
    let (dir, _) = built();
    let config = dir.path("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&read(&config)).unwrap();
    c["rms_norm_eps"] = 1e-5.into();
    std::fs::write(&config, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    let err = VqStore::open(dir.dir(), rung("vq2"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("experts-vq2.json") && err.contains("source.fingerprint"),
        "{err}"
    );
    assert_eq!(ensure(dir.dir(), &[(0, "vq2")]).built.len(), 1);
}

/// What a build killed after removing the manifest leaves (a stray temporary file, a
/// data file without a manifest, or a partial one) is never used, and is rebuilt.
#[test]
fn crash_between_data_and_manifest_is_never_trusted() {
    let (dir, good) = built();
    std::fs::write(
        dir.path(".experts-vq2.bin.tmp.99999.0"),
        &good[..good.len() / 3],
    )
    .unwrap();
    std::fs::remove_file(dir.path("experts-vq2.json")).unwrap();
    let err = VqStore::open(dir.dir(), rung("vq2")).err().unwrap();
    assert!(matches!(err, Error::Missing { .. }), "{err}");
    assert!(err.to_string().contains("experts-vq2.json"), "{err}");
    std::fs::write(dir.path("experts-vq2.bin"), &good[..good.len() / 2]).unwrap();
    assert!(VqStore::open(dir.dir(), rung("vq2")).is_err());
    let done = ensure(dir.dir(), &[(0, "vq2"), (1, "vq2")]);
    let reason = &done.built[0].reason;
    assert!(reason.contains("experts-vq2.json: missing"), "{reason}");
    assert_eq!(read(&dir.path("experts-vq2.bin")), good);
    assert!(
        no_temp_files(dir.dir()),
        "the stray temporary file was left"
    );
}

/// small-moe at vq1.5 through the store scores exactly what the same rung encoded in
/// memory scores.
#[test]
fn small_moe_perplexity_through_the_store_equals_the_in_memory_encoding() {
    let dir = fixture_copy("small-moe");
    let codecs = Codecs {
        default: Some("vq1.5".parse::<Codec>().unwrap()),
        ..Codecs::default()
    };
    let stored = model::load_with_codecs(dir.dir(), Cpu::fast(), &codecs).unwrap();
    let (config, ckpt) = open_ckpt(dir.dir());
    let vq: BTreeMap<usize, _> = config
        .moe_layers()
        .map(|l| (l, encode_experts(&config, &ckpt, l, rung("vq1.5")).unwrap()))
        .collect();
    let memory = dynmoe::alloc::probe::assemble(
        dir.dir(),
        config,
        &ckpt,
        &vq,
        &Default::default(),
        &BTreeMap::new(),
    )
    .unwrap();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus/en/test.txt"),
    )
    .unwrap();
    let tokens = stored.tokenizer.encode(&text).unwrap();
    let opts = PplOptions {
        max_chunks: Some(2),
        ..PplOptions::default()
    };
    let a = perplexity_tokens(&stored, &tokens, opts, &mut |_, _| {}).unwrap();
    let b = perplexity_tokens(&memory, &tokens, opts, &mut |_, _| {}).unwrap();
    assert_eq!(a.ppl, b.ppl);
    assert!(a.ppl.is_finite() && a.ppl > 1.0);
    eprintln!(
        "small-moe vq1.5, 2 chunks of en/test: ppl {} both ways",
        a.ppl
    );
}
