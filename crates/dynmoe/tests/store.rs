//! Expert stores on the committed fixtures: conversion round trip, low-bit builds,
//! detection and rebuilding of stale, damaged and half-written stores, concurrent
//! builders in separate processes, and the reader.
//!
//! Records are decoded here from `docs/FORMAT.md`'s description alone (not through the
//! codec), so these tests also hold the document to the bytes.

use std::path::Path;
use std::process::{Command, Stdio};

use dynmoe::checkpoint::{Checkpoint, Config};
use dynmoe::store::lowbit::{self, spot_check_records};
use dynmoe::store::{base, Error, ExpertStore, Layout, Proj};
use dynmoe::testing::{fixture, TempDir as Scratch};

/// A fixture converted into a fresh directory.
fn converted(name: &str) -> Scratch {
    let out = Scratch::new(name);
    base::convert(&fixture(name), out.dir(), &mut |_, _| {}).unwrap();
    out
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

fn mtime(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = read(path);
    bytes[at as usize] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

fn no_temp_files(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp."))
}

// ---- Decoding from docs/FORMAT.md ----

fn u32_at(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
}

fn bf16_at(bytes: &[u8], i: usize) -> f32 {
    half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// Position of column `j` of a 32-column chunk in the 2-bit layout: word k, group p,
/// byte b with j = 2(8k + 4p + b) for p < 2 and 2(8k + 4(p - 2) + b) + 1 for p >= 2.
fn kpb(j: usize) -> (usize, usize, usize) {
    let (e, odd) = (j / 2, j % 2);
    (e / 8, (e % 8) / 4 + 2 * odd, e % 4)
}

/// The code of row `r`, column `c` of a matrix stored at `bits` with `cols` stored
/// columns, read from its code bytes.
fn code(codes: &[u8], bits: u32, cols: usize, r: usize, c: usize) -> u32 {
    match bits {
        4 => {
            let w = u32_at(codes, r * cols / 8 + c / 8);
            (w >> (4 * (c % 8))) & 0xF
        }
        2 => {
            let (k, p, b) = kpb(c % 32);
            let w = u32_at(codes, r * cols / 16 + 2 * (c / 32) + k);
            (w >> (8 * b + 2 * p)) & 3
        }
        3 => {
            let (k, p, b) = kpb(c % 32);
            let chunk = r * cols * 3 / 32 + 3 * (c / 32);
            let upper = (u32_at(codes, chunk + k) >> (8 * b + 2 * p)) & 3;
            let lowest = (u32_at(codes, chunk + 2) >> (8 * b + 4 * k + p)) & 1;
            2 * upper + lowest
        }
        _ => unreachable!(),
    }
}

/// Weight `(r, c)` of one projection of a record, reconstructed as FORMAT.md says.
fn weight(record: &[u8], layout: &Layout, proj: Proj, r: usize, c: usize) -> f32 {
    let m = layout.matrix(proj);
    let q = code(&record[m.codes.range()], layout.bits, m.cols, r, c) as f32;
    let g = r * m.cols / 64 + c / 64;
    let s = bf16_at(&record[m.scales.range()], g);
    let b = bf16_at(&record[m.biases.range()], g);
    match layout.bits {
        4 => q * s + b,
        3 => (2.0 * q + 0.5) * s + b,
        2 => (4.0 * q + 1.5) * s + b,
        _ => unreachable!(),
    }
}

/// Checkpoint tensor names of the projections of an expert.
fn expert_names(dir: &Path, layer: usize, expert: usize) -> [String; 3] {
    let ckpt = Checkpoint::open(dir).unwrap();
    let qwen = format!("model.layers.{layer}.mlp.experts.{expert}");
    if ckpt.contains(&format!("{qwen}.gate_proj.weight")) {
        ["gate_proj", "up_proj", "down_proj"].map(|p| format!("{qwen}.{p}.weight"))
    } else {
        let p = format!("model.layers.{layer}.block_sparse_moe.experts.{expert}");
        ["w1", "w3", "w2"].map(|w| format!("{p}.{w}.weight"))
    }
}

/// Decodes every projection of the records `picks` of a converted fixture and checks
/// each weight against the checkpoint to within the 4-bit error. MLX moves the step so
/// that the larger-magnitude extreme and zero fall on the grid, which can shrink it by up
/// to 1/16 and clamp the far extreme by up to one step; hence one step (not half), plus
/// the rounding of the stored bf16 scale and bias.
fn check_round_trip(name: &str, out: &Path, picks: &[usize]) {
    let src = fixture(name);
    let config = Config::from_file(&src.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&src).unwrap();
    let store = ExpertStore::open(out, 4).unwrap();
    let layout = *store.layout();
    let layers: Vec<usize> = config.moe_layers().collect();
    assert_eq!(store.layers(), &layers[..]);
    assert_eq!(store.num_records(), layers.len() * config.moe.num_experts);
    for &i in picks {
        let (layer, expert) = (
            layers[i / config.moe.num_experts],
            i % config.moe.num_experts,
        );
        let record = store.record_bytes(i);
        let names = expert_names(&src, layer, expert);
        let (mut err2, mut ref2) = (0.0f64, 0.0f64);
        for proj in Proj::ALL {
            let m = layout.matrix(proj);
            let w = ckpt
                .f32(&names[proj.index()], &[m.rows, m.true_cols])
                .unwrap();
            for r in 0..m.rows {
                for c in 0..m.true_cols {
                    let g = r * m.cols / 64 + c / 64;
                    let s = bf16_at(&record[m.scales.range()], g).abs();
                    let b = bf16_at(&record[m.biases.range()], g).abs();
                    let bound = s + 15.0 * s / 256.0 + b / 256.0 + 1e-6;
                    let want = w[r * m.true_cols + c];
                    let got = weight(record, &layout, proj, r, c);
                    assert!(
                        (got - want).abs() <= bound,
                        "{name} record {i} {proj:?} ({r}, {c}): {got} vs {want}, bound {bound}"
                    );
                    err2 += ((got - want) as f64).powi(2);
                    ref2 += (want as f64).powi(2);
                }
            }
        }
        let rel = (err2 / ref2).sqrt();
        assert!(rel < 0.15, "{name} record {i}: relative error {rel}");
    }
}

// ---- Conversion ----

#[test]
fn convert_round_trip_small_moe() {
    let out = converted("small-moe");
    let store = ExpertStore::open(out.dir(), 4).unwrap();
    let n = store.num_records();
    // The small fixture's experts are 80 wide: down_proj's columns are padded to 128.
    assert_eq!(store.layout().matrix(Proj::Down).cols, 128);
    check_round_trip(
        "small-moe",
        out.dir(),
        &spot_check_records(n, 1, 1)
            .into_iter()
            .chain([n / 2 + 1])
            .collect::<Vec<_>>(),
    );
}

#[test]
fn convert_round_trip_tiny_moe_every_record() {
    let out = converted("tiny-moe");
    let n = ExpertStore::open(out.dir(), 4).unwrap().num_records();
    check_round_trip("tiny-moe", out.dir(), &(0..n).collect::<Vec<_>>());
}

#[test]
fn convert_reads_mixtral_naming_across_shards() {
    let out = converted("tiny-mixtral");
    let n = ExpertStore::open(out.dir(), 4).unwrap().num_records();
    assert_eq!(n, 16);
    check_round_trip("tiny-mixtral", out.dir(), &[0, 7, 15]);
}

#[test]
fn converted_directory_is_self_contained() {
    let out = converted("tiny-qwen2-moe");
    let src = fixture("tiny-qwen2-moe");
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(read(&out.path(f)), read(&src.join(f)), "{f}");
    }
    // Every tensor but the routed experts, bytes and dtype unchanged.
    let dense_bytes = read(&out.path("dense.safetensors"));
    let dense = safetensors::SafeTensors::deserialize(&dense_bytes).unwrap();
    let src_bytes = read(&src.join("model.safetensors"));
    let original = safetensors::SafeTensors::deserialize(&src_bytes).unwrap();
    let mut kept = 0;
    for (name, view) in original.tensors() {
        let routed = name.contains(".mlp.experts.");
        match dense.tensor(&name) {
            Ok(d) => {
                assert!(!routed, "{name} is an expert but is in dense.safetensors");
                assert_eq!(
                    (d.dtype(), d.shape(), d.data()),
                    (view.dtype(), view.shape(), view.data()),
                    "{name}"
                );
                kept += 1;
            }
            Err(_) => assert!(routed, "{name} is missing from dense.safetensors"),
        }
    }
    assert_eq!(kept, dense.len());
    assert!(dense
        .tensor("model.layers.0.mlp.shared_expert.gate_proj.weight")
        .is_ok());
    assert!(no_temp_files(out.dir()));

    let manifest: serde_json::Value =
        serde_json::from_slice(&read(&out.path("experts.json"))).unwrap();
    assert_eq!(manifest["format"], "dynmoe-expert-store");
    assert_eq!(manifest["version"], 3);
    assert_eq!(manifest["bits"], 4);
    assert_eq!(manifest["source"]["kind"], "checkpoint");
    assert_eq!(manifest["model"]["model_type"], "qwen2_moe");
    assert_eq!(
        manifest["file_size"].as_u64().unwrap(),
        std::fs::metadata(out.path("experts.bin")).unwrap().len()
    );
}

#[test]
fn convert_refuses_its_own_directory() {
    let dir = Scratch::new("same");
    for e in std::fs::read_dir(fixture("tiny-moe")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path(&p.file_name().unwrap().to_string_lossy())).unwrap();
    }
    let err = base::convert(dir.dir(), dir.dir(), &mut |_, _| {}).unwrap_err();
    assert!(matches!(err, Error::SameDirectory { .. }), "{err}");
}

// ---- Low-bit stores ----

/// Checks a low-bit store against its base record by record, decoding both from
/// FORMAT.md: codes are the 4-bit codes shifted right, scale/bias blocks identical.
fn check_derived(dir: &Path, bits: u32) {
    let q4 = ExpertStore::open(dir, 4).unwrap();
    let q = ExpertStore::open(dir, bits).unwrap();
    let (l4, l) = (*q4.layout(), *q.layout());
    for i in 0..q.num_records() {
        let (src, dst) = (q4.record_bytes(i), q.record_bytes(i));
        for (a, b) in l4.scale_blocks().iter().zip(l.scale_blocks()) {
            assert_eq!(src[a.range()], dst[b.range()], "record {i}: scale block");
        }
        for proj in Proj::ALL {
            let (m4, m) = (l4.matrix(proj), l.matrix(proj));
            for r in 0..m.rows {
                for c in 0..m.cols {
                    let want = code(&src[m4.codes.range()], 4, m4.cols, r, c) >> (4 - bits);
                    let got = code(&dst[m.codes.range()], bits, m.cols, r, c);
                    assert_eq!(got, want, "record {i} {proj:?} ({r}, {c}) at {bits} bits");
                }
            }
        }
        assert!(
            dst[l.data_end..].iter().all(|&b| b == 0),
            "record {i}: padding"
        );
    }
}

#[test]
fn ensure_builds_2_and_3_bit_stores() {
    let out = converted("tiny-moe");
    assert!(!lowbit::usable(out.dir(), 2) && !lowbit::usable(out.dir(), 3));
    let done = lowbit::ensure_many(out.dir(), &[2, 3]).unwrap();
    assert_eq!(
        done.iter().map(|e| (e.bits, e.built)).collect::<Vec<_>>(),
        [(2, true), (3, true)]
    );
    assert!(lowbit::usable(out.dir(), 2) && lowbit::usable(out.dir(), 3));
    check_derived(out.dir(), 2);
    check_derived(out.dir(), 3);
    let layout = lowbit::ensure(out.dir(), 3).unwrap();
    assert_eq!(layout, Layout::new(3, 64, 64).unwrap());
    let again = lowbit::ensure_many(out.dir(), &[3, 2]).unwrap();
    assert!(again.iter().all(|e| !e.built));
    assert!(no_temp_files(out.dir()));
}

#[test]
fn small_moe_low_bit_stores_match_the_format() {
    let out = converted("small-moe");
    lowbit::ensure_many(out.dir(), &[3, 2]).unwrap();
    check_derived(out.dir(), 2);
    check_derived(out.dir(), 3);
}

#[test]
fn building_3_leaves_2_byte_identical_and_unwritten() {
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let (data, manifest) = (out.path("experts2.bin"), out.path("experts2.json"));
    let before = (read(&data), read(&manifest), mtime(&data), mtime(&manifest));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let done = lowbit::ensure_many(out.dir(), &[3, 2]).unwrap();
    assert_eq!(
        done.iter().map(|e| (e.bits, e.built)).collect::<Vec<_>>(),
        [(3, true), (2, false)]
    );
    let after = (read(&data), read(&manifest), mtime(&data), mtime(&manifest));
    assert_eq!(before, after);
    // And rebuilding 3 by force leaves 2 alone too.
    let mut policy = lowbit::Policy {
        force: true,
        progress: &mut |_, _| {},
        notice: &mut |_| {},
    };
    let forced = lowbit::ensure_with_policy(out.dir(), &[3], &mut policy).unwrap();
    assert!(forced[0].built);
    assert_eq!((read(&data), mtime(&data)), (before.0, before.2));
}

#[test]
fn ensure_many_ignores_duplicates() {
    let out = converted("tiny-moe");
    let mut notices = Vec::new();
    let mut progress = Vec::new();
    let mut policy = lowbit::Policy {
        force: false,
        progress: &mut |done, total| progress.push((done, total)),
        notice: &mut |line| notices.push(line.to_string()),
    };
    let done = lowbit::ensure_with_policy(out.dir(), &[3, 2, 3, 2, 4], &mut policy).unwrap();
    assert_eq!(
        done.iter().map(|e| (e.bits, e.built)).collect::<Vec<_>>(),
        [(3, true), (2, true), (4, false)]
    );
    assert_eq!(notices.len(), 2, "{notices:?}");
    // One pass over the source records builds both targets.
    assert_eq!(progress.first(), Some(&(0, 16)));
    assert_eq!(progress.last(), Some(&(16, 16)));
    assert!(progress.windows(2).all(|w| w[0].0 < w[1].0));
    assert!(matches!(
        lowbit::ensure(out.dir(), 5),
        Err(Error::UnsupportedBits { bits: 5 })
    ));
}

#[test]
fn older_layout_store_is_detected_and_rebuilt() {
    let out = converted("tiny-moe");
    lowbit::write_older_layout_q2(out.dir()).unwrap();
    let old = read(&out.path("experts2.bin"));
    let err = lowbit::check(out.dir(), 2).unwrap_err().to_string();
    assert!(
        err.contains("experts2.json") && err.contains("version"),
        "{err}"
    );

    // A manifest that claims the current version does not make the bytes current: the
    // spot check re-packs records and finds the older layout.
    let manifest = read(&out.path("experts2.json"));
    let claim = String::from_utf8(manifest)
        .unwrap()
        .replace("\"version\": 1", "\"version\": 3");
    std::fs::write(out.path("experts2.json"), claim).unwrap();
    let err = lowbit::check(out.dir(), 2).unwrap_err().to_string();
    assert!(
        err.contains("experts2.bin") && err.contains("differs"),
        "{err}"
    );
    assert!(ExpertStore::open(out.dir(), 2).is_err());

    let done = lowbit::ensure_many(out.dir(), &[2]).unwrap();
    assert!(done[0].built, "the older layout was kept");
    assert!(done[0].reason.as_deref().unwrap().contains("differs"));
    assert_ne!(read(&out.path("experts2.bin")), old);
    check_derived(out.dir(), 2);
}

#[test]
fn truncated_store_is_detected_and_rebuilt() {
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 3).unwrap();
    let good = read(&out.path("experts3.bin"));
    std::fs::write(out.path("experts3.bin"), &good[..good.len() - 4096]).unwrap();
    let err = lowbit::check(out.dir(), 3).unwrap_err();
    assert!(matches!(err, Error::Size { .. }), "{err}");
    assert!(err.to_string().contains("experts3.bin"), "{err}");
    assert!(lowbit::ensure_many(out.dir(), &[3]).unwrap()[0].built);
    assert_eq!(read(&out.path("experts3.bin")), good);
}

#[test]
fn flipped_byte_in_a_sampled_record_is_detected_and_rebuilt() {
    let out = converted("small-moe");
    lowbit::ensure_many(out.dir(), &[2, 3]).unwrap();
    let good = read(&out.path("experts2.bin"));
    let layout = lowbit::check(out.dir(), 2).unwrap();
    let q4 = Layout::new(4, layout.hidden, layout.intermediate).unwrap();
    let n = good.len() / layout.record_size;
    let picks = spot_check_records(n, q4.record_size, layout.record_size);
    assert!(
        picks.contains(&0) && picks.contains(&(n - 1)) && picks.len() >= 3,
        "{picks:?}"
    );
    // A code byte of the first record, a scale of a middle one, a padding byte of the last.
    let middle = picks[picks.len() / 2];
    let places = [
        layout.record_offset(0) + 5,
        layout.record_offset(middle) + layout.matrix(Proj::Up).scales.offset as u64 + 3,
        layout.record_offset(n - 1) + layout.record_size as u64 - 1,
    ];
    for at in places {
        flip_byte(&out.path("experts2.bin"), at);
        assert!(!lowbit::usable(out.dir(), 2), "flip at {at} undetected");
        assert!(
            lowbit::usable(out.dir(), 3),
            "the 3-bit store is not affected"
        );
        assert!(lowbit::ensure_many(out.dir(), &[2]).unwrap()[0].built);
        assert_eq!(read(&out.path("experts2.bin")), good);
    }
}

#[test]
fn corrupt_manifests_are_detected_and_rebuilt() {
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let path = out.path("experts2.json");
    let good = String::from_utf8(read(&path)).unwrap();
    let record_size = Layout::new(2, 64, 64).unwrap().record_size;
    let damaged = [
        (good[..good.len() / 2].to_string(), "malformed"),
        (good.replace("\"version\": 3", "\"version\": 4"), "version"),
        (
            good.replace("\"version\": 3", "\"version\": 1"),
            "older layout",
        ),
        (
            good.replace("\"version\": 3", "\"version\": 2"),
            "record checksums",
        ),
        (good.replacen("\"fnv1a64:", "\"fnv1a64:0", 1), "damaged"),
        (
            good.replace(
                &format!("\"record_size\": {record_size}"),
                "\"record_size\": 16384000",
            ),
            "record_size",
        ),
        (good.replace("\"bits\": 2", "\"bits\": 3"), "bits"),
        (
            good.replace(
                "\"format\": \"dynmoe-expert-store\"",
                "\"format\": \"other\"",
            ),
            "format",
        ),
        (
            good.replace("\"kind\": \"store\"", "\"kind\": \"checkpoint\""),
            "source",
        ),
    ];
    for (text, what) in damaged {
        assert_ne!(text, good, "{what}: the damage did not apply");
        std::fs::write(&path, &text).unwrap();
        let err = lowbit::check(out.dir(), 2).unwrap_err().to_string();
        assert!(
            err.contains(what) && err.contains("experts2"),
            "{what}: {err}"
        );
        let err = ExpertStore::open(out.dir(), 2).err().unwrap().to_string();
        assert!(err.contains("experts2"), "{err}");
        assert!(
            lowbit::ensure_many(out.dir(), &[2]).unwrap()[0].built,
            "{what}"
        );
        assert_eq!(String::from_utf8(read(&path)).unwrap().len(), good.len());
    }
    // A base manifest that changes identity (a new conversion) invalidates derived stores.
    let base_path = out.path("experts.json");
    let base_json = String::from_utf8(read(&base_path)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&base_json).unwrap();
    let fp = v["fingerprint"].as_str().unwrap();
    std::fs::write(
        &base_path,
        base_json.replace(fp, "fnv1a64:0000000000000000"),
    )
    .unwrap();
    let err = lowbit::check(out.dir(), 2).unwrap_err().to_string();
    assert!(err.contains("another experts.bin"), "{err}");
}

#[test]
fn reader_refuses_unusable_stores_and_views_usable_ones() {
    let out = converted("small-moe");
    let err = ExpertStore::open(out.dir(), 2).err().unwrap().to_string();
    assert!(
        err.contains("experts2.json") && err.contains("missing"),
        "{err}"
    );
    lowbit::ensure(out.dir(), 2).unwrap();
    flip_byte(&out.path("experts2.bin"), 100);
    let err = ExpertStore::open(out.dir(), 2).err().unwrap().to_string();
    assert!(
        err.contains("experts2.bin") && err.contains("damaged"),
        "{err}"
    );
    lowbit::ensure(out.dir(), 2).unwrap();

    let store = ExpertStore::open(out.dir(), 2).unwrap();
    assert_eq!(store.bits(), 2);
    let (layer, expert) = (store.layers()[2], 17);
    let index = store.record_index(layer, expert).unwrap();
    assert_eq!(index, 2 * 32 + 17);
    let rec = store.record(layer, expert);
    let bytes = store.record_bytes(index);
    let l = store.layout();
    for (view, proj) in [
        (rec.gate, Proj::Gate),
        (rec.up, Proj::Up),
        (rec.down, Proj::Down),
    ] {
        let m = l.matrix(proj);
        assert_eq!((view.bits, view.rows, view.cols), (2, m.rows, m.cols));
        assert_eq!(view.words.len() * 4, m.codes.len);
        assert_eq!(view.scales.len(), m.rows * m.cols / 64);
        assert_eq!(
            view.words.as_ptr() as usize,
            bytes[m.codes.range()].as_ptr() as usize,
            "a copy"
        );
        assert_eq!(view.words[3], u32_at(&bytes[m.codes.range()], 3));
        assert_eq!(
            view.biases[1].to_f32(),
            bf16_at(&bytes[m.biases.range()], 1)
        );
    }
    assert_eq!(store.record_index(1, 32), None);
    assert_eq!(store.record_index(99, 0), None);
}

#[test]
fn crash_mid_build_is_never_trusted() {
    let out = converted("tiny-moe");
    lowbit::ensure(out.dir(), 2).unwrap();
    let good = read(&out.path("experts2.bin"));
    // What a build killed after removing the manifest and while writing leaves behind:
    // a stray temporary file, and (had the rename happened) a data file with no manifest.
    std::fs::write(
        out.path(".experts2.bin.tmp.99999.0"),
        &good[..good.len() / 3],
    )
    .unwrap();
    std::fs::remove_file(out.path("experts2.json")).unwrap();
    std::fs::write(out.path("experts2.bin"), &good[..good.len() / 2]).unwrap();
    assert!(!lowbit::usable(out.dir(), 2));
    assert!(ExpertStore::open(out.dir(), 2).is_err());
    assert!(lowbit::ensure_many(out.dir(), &[2]).unwrap()[0].built);
    assert_eq!(read(&out.path("experts2.bin")), good);
    assert!(
        no_temp_files(out.dir()),
        "the stray temporary file was left"
    );

    // A complete data file without its manifest is not trusted either.
    std::fs::remove_file(out.path("experts2.json")).unwrap();
    assert!(!lowbit::usable(out.dir(), 2));

    // A conversion killed before its manifest: no base store, so nothing builds on it.
    std::fs::remove_file(out.path("experts.json")).unwrap();
    let err = lowbit::ensure(out.dir(), 2).unwrap_err();
    assert!(matches!(err, Error::MissingBase { .. }), "{err}");
    assert!(err.to_string().contains("experts.json"), "{err}");
    assert!(ExpertStore::open(out.dir(), 4).is_err());
}

// ---- Two processes ----

const CHILD_DIR: &str = "DYNMOE_STORE_TEST_CHILD_DIR";

/// Runs only as a child of `two_processes_ensure_at_once` (which sets the variable):
/// ensures both low-bit stores and reports whether it built anything.
#[test]
fn child_process_ensure() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let done = lowbit::ensure_many(Path::new(&dir), &[2, 3]).unwrap();
    let built = done.iter().filter(|e| e.built).count();
    println!("child-result built={built}");
}

#[test]
fn two_processes_ensure_at_once() {
    let out = converted("small-moe");
    let exe = std::env::current_exe().unwrap();
    let spawn = || {
        Command::new(&exe)
            .args([
                "child_process_ensure",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, out.dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children = [spawn(), spawn()];
    let mut built = Vec::new();
    for child in children {
        let output = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("child-result built=").map(|(_, n)| n))
            .unwrap_or_else(|| panic!("no result line: {stdout}"));
        built.push(line.trim().parse::<usize>().unwrap());
    }
    built.sort();
    // One process built both stores; the other waited for the lock and kept them.
    assert_eq!(built, [0, 2]);
    assert!(lowbit::usable(out.dir(), 2) && lowbit::usable(out.dir(), 3));
    assert!(no_temp_files(out.dir()));
    check_derived(out.dir(), 3);
}

// ---- The views feed the kernels ----

#[test]
fn kernels_on_store_views_agree_with_the_documented_decoding() {
    use dynmoe::codec::affine::kernels::matmul;
    let out = converted("small-moe");
    lowbit::ensure_many(out.dir(), &[2, 3]).unwrap();
    for bits in [4, 3, 2] {
        let store = ExpertStore::open(out.dir(), bits).unwrap();
        let layout = *store.layout();
        let index = store.num_records() - 3;
        let rec = store.record_at(index);
        let bytes = store.record_bytes(index);
        for (view, proj) in [
            (rec.gate, Proj::Gate),
            (rec.up, Proj::Up),
            (rec.down, Proj::Down),
        ] {
            let m = layout.matrix(proj);
            // Real inputs, then zeros over the padding columns.
            let x: Vec<f32> =
                dynmoe::testing::fresh(m.true_cols, index as u64 * 3 + proj.index() as u64)
                    .into_iter()
                    .chain(std::iter::repeat_n(0.0, m.cols - m.true_cols))
                    .collect();
            let mut got = vec![f32::NAN; m.rows];
            matmul(&x, 1, &view, &mut got);
            let want: Vec<f32> = (0..m.rows)
                .map(|r| {
                    (0..m.true_cols)
                        .map(|c| weight(bytes, &layout, proj, r, c) as f64 * x[c] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            let err = dynmoe::testing::rel_err(&got, &want);
            assert!(err < 1e-5, "{bits}-bit {proj:?}: relative error {err}");
        }
    }
}

// ---- docs/FORMAT.md's numbers ----

/// §4.5's worked example, packed by the codec and read back by this file's decoder.
#[test]
fn format_doc_worked_example() {
    use dynmoe::codec::affine::lowbit::pack_matrix;
    let chunk = [0x7654_3210u32, 0xfedc_ba98, 0x89ab_cdef, 0x0123_4567];
    let q4: Vec<u32> = chunk.iter().chain(&chunk).copied().collect();
    let codes: Vec<u32> = (0..32).map(|j| if j < 16 { j } else { 31 - j }).collect();
    let q4_bytes: Vec<u8> = q4.iter().flat_map(|w| w.to_le_bytes()).collect();
    for (c, &q) in codes.iter().enumerate() {
        assert_eq!(code(&q4_bytes, 4, 64, 0, c), q);
    }
    for (bits, want) in [
        (2, vec![0xdddd_8888u32, 0x2222_7777]),
        (3, vec![0xdddd_8888, 0x2222_7777, 0x0ff0_0ff0]),
    ] {
        let mut dst = vec![0u32; 2 * want.len()];
        pack_matrix(&q4, 1, 64, bits, &mut dst);
        assert_eq!(dst[..want.len()], want[..], "{bits}-bit words");
        let bytes: Vec<u8> = dst.iter().flat_map(|w| w.to_le_bytes()).collect();
        for c in 0..64 {
            assert_eq!(
                code(&bytes, bits, 64, 0, c),
                codes[c % 32] >> (4 - bits),
                "{bits}-bit column {c}"
            );
        }
    }
    assert_eq!((0xdddd_8888u32 >> 2) & 0x0303_0303, 0x0303_0202);
}

/// §3's offset tables.
#[test]
fn format_doc_offset_tables() {
    let offsets = |l: &Layout| -> Vec<usize> {
        l.matrices
            .iter()
            .map(|m| m.codes.offset)
            .chain(l.scale_blocks().iter().map(|p| p.offset))
            .chain([l.data_end, l.record_size])
            .collect()
    };
    assert_eq!(
        offsets(&Layout::new(4, 2048, 768).unwrap()),
        [
            0, 786_432, 1_572_864, 2_359_296, 2_408_448, 2_457_600, 2_506_752, 2_555_904,
            2_605_056, 2_654_208, 2_654_208
        ]
    );
    assert_eq!(
        offsets(&Layout::new(3, 2048, 768).unwrap()),
        [
            0, 589_824, 1_179_648, 1_769_472, 1_818_624, 1_867_776, 1_916_928, 1_966_080,
            2_015_232, 2_064_384, 2_064_384
        ]
    );
    assert_eq!(
        offsets(&Layout::new(2, 2048, 768).unwrap()),
        [
            0, 393_216, 786_432, 1_179_648, 1_228_800, 1_277_952, 1_327_104, 1_376_256, 1_425_408,
            1_474_560, 1_474_560
        ]
    );
    assert_eq!(
        offsets(&Layout::new(4, 256, 80).unwrap()),
        [0, 10_240, 20_480, 36_864, 37_504, 38_144, 38_784, 39_424, 40_448, 41_472, 49_152]
    );
}
