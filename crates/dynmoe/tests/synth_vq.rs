//! Synthetic compressed directories (`model::synth::synth_compressed`, `dynmoe synth
//! --vq`): random VQ records written straight to disk load through `store::compressed`
//! and run at two rungs of different `p`; the bytes follow the seed; decoded weights have
//! the intended spread; the manifests say the records are random; and damage to a
//! record or an edit of a manifest is refused with the file named, as for a compressed
//! checkpoint.

use std::path::Path;

use dynmoe::backend::Cpu;
use dynmoe::codec::vq::Rung;
use dynmoe::codec::Codec;
use dynmoe::model::{self, Codecs};
use dynmoe::store::compressed::{self, MANIFEST_FILE};
use dynmoe::store::synth::{SOURCE_KIND, STD};
use dynmoe::store::vq::{VqManifest, VqStore};
use dynmoe::store::{is_converted, synth_vq};
use dynmoe::store::{plan::Plan, plan::PLAN_FILE};
use dynmoe::synth::{synth_compressed, synth_converted, CompressedReport};
use dynmoe::testing::{fixture, TempDir, TINY_SHAPE};

const LAYERS: usize = 2;

fn rung(name: &str) -> Rung {
    Rung::parse(name).unwrap()
}

fn write(dir: &Path, rung_name: &str, seed: u64) -> CompressedReport {
    synth_compressed(
        &TINY_SHAPE,
        Some(LAYERS),
        rung(rung_name),
        &fixture("small-moe"),
        dir,
        seed,
        &mut |_, _| {},
    )
    .unwrap()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

/// Logits of a short prompt through the CPU backend, the directory loaded with the
/// default codecs (its plan's).
fn logits(dir: &Path) -> Result<Vec<f32>, model::Error> {
    let m = model::load_with_codecs(dir, Cpu::fast(), &Codecs::default())?;
    let mut state = m.model.new_state(8);
    m.model.forward(&mut state, &[1, 2, 3, 4], 3)
}

fn load_error(dir: &Path) -> String {
    match logits(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites the JSON file at `path` through `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_slice(&read(path)).unwrap();
    edit(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn a_directory_at_each_of_two_rungs_loads_runs_and_says_what_it_is() {
    let mut all = Vec::new();
    for name in ["vq1.5", "vq0.7"] {
        let out = TempDir::new("synth-vq");
        let r = write(out.dir(), name, 3);
        let store_file = format!("experts-{name}.bin");
        for f in [
            "config.json",
            "tokenizer.json",
            "dense.safetensors",
            &store_file,
            &format!("experts-{name}.json"),
            PLAN_FILE,
            MANIFEST_FILE,
        ] {
            assert!(out.path(f).exists(), "{name}: {f}");
        }
        assert!(compressed::is_compressed(out.dir()) && !is_converted(out.dir()));
        assert_eq!((r.layers, r.store.rung.as_str()), (LAYERS, name));
        let layout = dynmoe::store::vq::VqLayout::new(
            rung(name),
            TINY_SHAPE.hidden,
            TINY_SHAPE.moe_intermediate,
        )
        .unwrap();
        assert_eq!(r.store.expert_bytes, synth_vq::expert_bytes(&layout));
        assert_eq!(
            r.store.bytes,
            read(&out.path(&store_file)).len() as u64,
            "{name}"
        );
        assert_eq!(
            r.bytes(),
            TINY_SHAPE.compressed_bytes(LAYERS, rung(name)).unwrap()
        );

        // The plan puts every MoE layer at the rung with every expert resident.
        let plan = Plan::load(&out.path(PLAN_FILE)).unwrap();
        assert_eq!(plan.layers.len(), LAYERS);
        let codec: Codec = name.parse().unwrap();
        for l in &plan.layers {
            assert_eq!((l.codec, l.resident, l.experts), (codec, 8, 8));
        }
        assert!((plan.resident_bits() - r.resident_bits).abs() < 1e-12);

        // The manifests say the records are random, made by the VQ generator from seed 3.
        let m = VqManifest::read(&out.path(&format!("experts-{name}.json"))).unwrap();
        assert_eq!(m.source.kind, SOURCE_KIND);
        assert!(m.source.files.is_empty());
        let g = m.source.generator.clone().unwrap();
        assert_eq!((g.name.as_str(), g.seed), (synth_vq::GENERATOR, 3));
        assert!(m.created.note.contains("synthetic"), "{}", m.created.note);
        let (manifest, _) = compressed::open(out.dir()).unwrap();
        assert_eq!(manifest.generator.as_ref(), Some(&g));
        assert_eq!(manifest.source_fingerprint, m.source.fingerprint);
        assert_eq!(manifest.stores[name], vec![0, 1]);

        // The stored records decode to weights of mean 0 and standard deviation STD.
        let store = VqStore::open_encoded_from(out.dir(), rung(name), &manifest.source_fingerprint)
            .unwrap();
        let mut w = Vec::new();
        for e in [0, 5] {
            for v in store.record(1, e) {
                w.extend(v.decode().unwrap());
            }
        }
        let n = w.len() as f64;
        let mean = w.iter().map(|&x| x as f64).sum::<f64>() / n;
        let std = (w.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(mean.abs() < 0.05 * STD as f64, "{name}: mean {mean}");
        assert!((std / STD as f64 - 1.0).abs() < 0.2, "{name}: std {std}");

        let l = logits(out.dir()).unwrap();
        assert!(
            l.len() == TINY_SHAPE.vocab && l.iter().all(|x| x.is_finite()),
            "{name}"
        );
        all.push(l);
    }
    assert_ne!(all[0], all[1], "the experts change the logits");
}

#[test]
fn one_seed_writes_the_same_bytes_and_another_seed_other_ones() {
    let (a, b, c) = (
        TempDir::new("synth-vq-a"),
        TempDir::new("synth-vq-b"),
        TempDir::new("synth-vq-c"),
    );
    write(a.dir(), "vq1.5", 7);
    write(b.dir(), "vq1.5", 7);
    write(c.dir(), "vq1.5", 8);
    for f in [
        "experts-vq1.5.bin",
        "dense.safetensors",
        "config.json",
        PLAN_FILE,
        MANIFEST_FILE,
    ] {
        assert_eq!(read(&a.path(f)), read(&b.path(f)), "{f}");
    }
    for f in ["experts-vq1.5.bin", "dense.safetensors", MANIFEST_FILE] {
        assert_ne!(read(&a.path(f)), read(&c.path(f)), "{f}");
    }
    let manifest = |d: &TempDir| {
        let mut m = VqManifest::read(&d.path("experts-vq1.5.json")).unwrap();
        m.created.unix_time = 0;
        m
    };
    assert_eq!(manifest(&a), manifest(&b), "the same checksums and source");
    assert_ne!(
        manifest(&a).source.fingerprint,
        manifest(&c).source.fingerprint
    );
    assert_ne!(manifest(&a).layers, manifest(&c).layers);
}

#[test]
fn damage_and_edits_are_refused_with_the_file_named() {
    let out = TempDir::new("synth-vq-damage");
    write(out.dir(), "vq1.5", 1);
    let (store, manifest) = (
        out.path("experts-vq1.5.bin"),
        out.path("experts-vq1.5.json"),
    );
    let (store_bytes, manifest_bytes) = (read(&store), read(&manifest));
    let restore = || {
        std::fs::write(&store, &store_bytes).unwrap();
        std::fs::write(&manifest, &manifest_bytes).unwrap();
    };

    // A flipped byte in a record's codes, in the middle of the file.
    let record_size = VqManifest::read(&manifest).unwrap().record_size as usize;
    let mut flipped = store_bytes.clone();
    flipped[5 * record_size + 300] ^= 0x40;
    std::fs::write(&store, &flipped).unwrap();
    let e = load_error(out.dir());
    assert!(
        e.contains("experts-vq1.5.bin") && e.contains("checksum"),
        "{e}"
    );
    restore();
    assert!(logits(out.dir()).is_ok());

    // Edited fields of the store's manifest.
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let edits: Vec<(&str, &str, Edit)> = vec![
        (
            "experts-vq1.5.json",
            "hidden",
            Box::new(|v| v["hidden"] = 64.into()),
        ),
        (
            "experts-vq1.5.json",
            "source.fingerprint",
            Box::new(|v| v["source"]["fingerprint"] = "fnv1a64:0000000000000000".into()),
        ),
        (
            "experts-vq1.5.json",
            "checksums",
            Box::new(|v| v["layers"][1]["checksums"][2] = "fnv1a64:0000000000000000".into()),
        ),
        // The checksums still hold, but the records are not what the claimed seed makes.
        (
            "experts-vq1.5.bin",
            "generator",
            Box::new(|v| v["source"]["generator"]["seed"] = 2.into()),
        ),
        (
            "experts-vq1.5.bin",
            "generator",
            Box::new(|v| v["source"]["generator"]["name"] = "dynmoe-vq-uniform-0".into()),
        ),
    ];
    for (file, field, edit) in &edits {
        edit_json(&manifest, edit);
        let e = load_error(out.dir());
        assert!(e.contains(file) && e.contains(field), "{field}: {e}");
        restore();
    }

    // Edits of the directory's own manifest and of its plan.
    let top = out.path(MANIFEST_FILE);
    let top_bytes = read(&top);
    edit_json(&top, |v| v["generator"]["name"] = "other-generator".into());
    let e = load_error(out.dir());
    assert!(e.contains(MANIFEST_FILE) && e.contains("generator"), "{e}");
    edit_json(&top, |v| {
        v["generator"]["name"] = synth_vq::GENERATOR.into();
        v["source_fingerprint"] = "fnv1a64:0000000000000000".into();
    });
    let e = load_error(out.dir());
    assert!(
        e.contains("experts-vq1.5.json") && e.contains("source.fingerprint"),
        "{e}"
    );
    std::fs::write(&top, &top_bytes).unwrap();
    edit_json(&out.path(PLAN_FILE), |v| {
        v["layers"][0]["resident"] = 4.into()
    });
    let e = load_error(out.dir());
    assert!(
        e.contains(MANIFEST_FILE) && e.contains("plan_checksum"),
        "{e}"
    );
}

#[test]
fn a_rewrite_at_another_rung_replaces_the_store_and_other_models_are_refused() {
    let out = TempDir::new("synth-vq-rewrite");
    write(out.dir(), "vq1.5", 1);
    write(out.dir(), "vq3", 1);
    assert!(!out.path("experts-vq1.5.bin").exists() && !out.path("experts-vq1.5.json").exists());
    assert!(logits(out.dir()).is_ok_and(|l| l.iter().all(|x| x.is_finite())));

    // A converted directory (affine stores) is not overwritten.
    let converted = TempDir::new("synth-vq-converted");
    synth_converted(
        &TINY_SHAPE,
        Some(LAYERS),
        &[2],
        &fixture("small-moe"),
        converted.dir(),
        1,
        &mut |_, _| {},
    )
    .unwrap();
    let e = synth_compressed(
        &TINY_SHAPE,
        Some(LAYERS),
        rung("vq1.5"),
        &fixture("small-moe"),
        converted.dir(),
        1,
        &mut |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("another directory") && e.contains("converted"),
        "{e}"
    );
    assert!(!converted.path("experts-vq1.5.bin").exists());
}
