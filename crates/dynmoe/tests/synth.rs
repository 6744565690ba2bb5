//! Synthetic converted directories (`model::synth::synth_converted`): random expert
//! stores written straight to disk load and run like converted models, with or without
//! the 4-bit store; the bytes follow the seed; the decoded weights have the intended
//! spread; an interrupted write and a damaged record are not trusted.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use dynmoe::backend::Cpu;
use dynmoe::codec::affine::lowbit::dequantize;
use dynmoe::model::{self, ExpertBits};
use dynmoe::store::{lowbit, manifest::Manifest, synth, ExpertStore};
use dynmoe::synth::{synth_converted, ConvertedReport, Shape};
use dynmoe::testing::{fixture, TempDir};

/// A small Qwen3-MoE shape: intermediate 96 is not a multiple of 64, so the stored
/// columns are padded as in the fixtures.
const SHAPE: Shape = dynmoe::testing::TINY_SHAPE;

fn write(dir: &Path, bits: &[u32], seed: u64) -> ConvertedReport {
    synth_converted(
        &SHAPE,
        Some(2),
        bits,
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

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = read(path);
    bytes[at as usize] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

/// Logits of a short prompt through the CPU backend at `bits` (`None`: the directory's
/// default precision).
fn logits(dir: &Path, bits: Option<u32>) -> Result<Vec<f32>, model::Error> {
    let eb = ExpertBits {
        default: bits,
        ..ExpertBits::default()
    };
    let m = model::load_with(dir, Cpu::fast(), &eb)?;
    let mut state = m.model.new_state(8);
    m.model.forward(&mut state, &[1, 2, 3, 4], 3)
}

fn all_finite(v: &[f32]) -> bool {
    v.len() == SHAPE.vocab && v.iter().all(|x| x.is_finite())
}

#[test]
fn a_directory_with_a_4_bit_store_loads_and_runs_at_each_precision() {
    let out = TempDir::new("synth-42");
    let r = write(out.dir(), &[4, 2], 1);
    assert_eq!(r.layers, 2);
    assert!(!out.path("experts3.bin").exists());
    assert_eq!(
        r.stores.iter().map(|s| s.bits).collect::<Vec<_>>(),
        [4, 2],
        "the base first"
    );
    let at4 = logits(out.dir(), None).unwrap();
    let at2 = logits(out.dir(), Some(2)).unwrap();
    assert!(all_finite(&at4) && all_finite(&at2));
    assert_ne!(at4, at2, "the experts change the logits");
    // The 2-bit store was derived from experts.bin as `store ensure` derives it; the
    // 3-bit one is built from it on demand.
    let m2 = Manifest::read(&out.path("experts2.json")).unwrap();
    assert_eq!(m2.source.kind, "store");
    assert!(logits(out.dir(), Some(3)).is_ok_and(|l| all_finite(&l)));
    let m4 = Manifest::read(&out.path("experts.json")).unwrap();
    assert_eq!(m4.source.kind, synth::SOURCE_KIND);
    let generator = m4.source.generator.unwrap();
    assert_eq!(
        (generator.name.as_str(), generator.seed),
        (synth::GENERATOR, 1)
    );
    assert!(m4.source.files.is_empty());
}

#[test]
fn one_seed_writes_the_same_bytes_and_another_seed_other_ones() {
    let (a, b, c) = (
        TempDir::new("synth-a"),
        TempDir::new("synth-b"),
        TempDir::new("synth-c"),
    );
    write(a.dir(), &[4, 2], 7);
    write(b.dir(), &[4, 2], 7);
    write(c.dir(), &[4, 2], 8);
    for f in [
        "experts.bin",
        "experts2.bin",
        "dense.safetensors",
        "config.json",
    ] {
        assert_eq!(read(&a.path(f)), read(&b.path(f)), "{f}");
    }
    for f in ["experts.bin", "experts2.bin", "dense.safetensors"] {
        assert_ne!(read(&a.path(f)), read(&c.path(f)), "{f}");
    }
    let fp = |d: &TempDir| Manifest::read(&d.path("experts.json")).unwrap().fingerprint;
    assert_eq!(fp(&a), fp(&b));
    assert_ne!(fp(&a), fp(&c));
}

#[test]
fn a_2_bit_only_directory_loads_at_2_bits() {
    let (q2, both) = (TempDir::new("synth-q2"), TempDir::new("synth-q2-42"));
    write(q2.dir(), &[2], 5);
    write(both.dir(), &[4, 2], 5);
    assert!(!q2.path("experts.bin").exists() && !q2.path("experts.json").exists());
    // The same records as the 2-bit store derived from a 4-bit one of the same seed.
    assert_eq!(
        read(&q2.path("experts2.bin")),
        read(&both.path("experts2.bin"))
    );
    let m = Manifest::read(&q2.path("experts2.json")).unwrap();
    assert_eq!(m.source.kind, synth::SOURCE_KIND);
    assert_eq!(m.source.generator.unwrap().seed, 5);

    assert_eq!(ExpertStore::open(q2.dir(), 2).unwrap().bits(), 2);
    assert!(lowbit::usable(q2.dir(), 2));
    let kept = lowbit::ensure_many(q2.dir(), &[2]).unwrap();
    assert!(!kept[0].built, "a usable store is kept");
    // Unasked, the directory runs at the precision it has, and the same as asked.
    let default = logits(q2.dir(), None).unwrap();
    assert!(all_finite(&default));
    assert_eq!(default, logits(q2.dir(), Some(2)).unwrap());
    assert_eq!(default, logits(both.dir(), Some(2)).unwrap());
    let err = logits(q2.dir(), Some(4)).err().unwrap().to_string();
    assert!(err.contains("experts.json"), "{err}");
    let err = lowbit::ensure(q2.dir(), 3).unwrap_err().to_string();
    assert!(err.contains("experts.json"), "{err}");
}

#[test]
fn decoded_expert_weights_have_the_intended_spread() {
    let out = TempDir::new("synth-std");
    write(out.dir(), &[4, 2], 3);
    // 2 bits reconstruct at the midpoints of four 4-bit codes: variance 20 s² against
    // 21.25 s² for the sixteen 4-bit levels.
    for (bits, want) in [(4, synth::STD), (2, synth::STD * (20.0f32 / 21.25).sqrt())] {
        let store = ExpertStore::open(out.dir(), bits).unwrap();
        let (mut sum, mut sq, mut n) = (0f64, 0f64, 0usize);
        for i in 0..store.num_records() {
            let r = store.record_at(i);
            for (v, true_cols) in [(r.gate, SHAPE.hidden), (r.up, SHAPE.hidden), (r.down, 96)] {
                let w = dequantize(v.words, v.scales, v.biases, v.rows, v.cols, bits);
                for row in w.chunks_exact(v.cols) {
                    for &x in &row[..true_cols] {
                        sum += x as f64;
                        sq += (x as f64).powi(2);
                        n += 1;
                    }
                }
            }
        }
        let mean = sum / n as f64;
        let std = (sq / n as f64 - mean * mean).sqrt();
        assert!(mean.abs() < 2e-4, "{bits} bits: mean {mean}");
        assert!(
            (std / want as f64 - 1.0).abs() < 0.03,
            "{bits} bits: std {std}, want {want}"
        );
    }
}

#[test]
fn an_interrupted_write_is_not_trusted() {
    let out = TempDir::new("synth-cut");
    let good = TempDir::new("synth-cut-good");
    write(good.dir(), &[4, 2], 2);
    let dense = SHAPE.converted_bytes(2, &[]).unwrap() as usize;
    // Stopped after the first batch of records, dense.safetensors in place.
    let cut = catch_unwind(AssertUnwindSafe(|| {
        synth_converted(
            &SHAPE,
            Some(2),
            &[4, 2],
            &fixture("small-moe"),
            out.dir(),
            2,
            &mut |done, _| assert!(done <= dense, "interrupted"),
        )
    }));
    assert!(cut.is_err());
    assert!(out.path("dense.safetensors").exists());
    for f in ["experts.json", "experts2.json"] {
        assert!(!out.path(f).exists(), "{f}");
    }
    // What a killed writer leaves beside that: a temporary file, and a data file
    // renamed into place whose manifest was never written.
    std::fs::write(out.path(".experts2.bin.tmp.999999.0"), b"half").unwrap();
    std::fs::copy(good.path("experts2.bin"), out.path("experts2.bin")).unwrap();
    assert!(!lowbit::usable(out.dir(), 4) && !lowbit::usable(out.dir(), 2));
    assert!(ExpertStore::open(out.dir(), 2).is_err());
    assert!(logits(out.dir(), None).is_err());
    assert!(logits(out.dir(), Some(2)).is_err());

    // A later run cleans up and writes the same bytes as an uninterrupted one.
    write(out.dir(), &[4, 2], 2);
    assert!(!out.path(".experts2.bin.tmp.999999.0").exists());
    for f in ["experts.bin", "experts2.bin", "dense.safetensors"] {
        assert_eq!(read(&out.path(f)), read(&good.path(f)), "{f}");
    }
    assert!(lowbit::usable(out.dir(), 2));
}

/// The spot check of `lowbit` (the first, the last and evenly spread records between,
/// checked against their checksums and compared byte for byte with a re-pack of
/// `experts.bin` or with records made again from the generator) catches a flipped byte in
/// those records. Records between the picks are caught by their checksums when they are
/// used (tests/integrity.rs).
#[test]
fn a_flipped_byte_in_a_checked_record_is_caught() {
    let out = TempDir::new("synth-flip");
    write(out.dir(), &[4, 2], 4);
    let original = read(&out.path("experts2.bin"));
    let size = original.len() as u64;
    let record = ExpertStore::open(out.dir(), 2)
        .unwrap()
        .layout()
        .record_size as u64;

    // The last 2-bit record: fails its checksum, and is rebuilt from experts.bin to the
    // bytes synth wrote.
    flip_byte(&out.path("experts2.bin"), size - record + 100);
    let err = lowbit::check(out.dir(), 2).unwrap_err().to_string();
    assert!(
        err.contains("record 15") && err.contains("damaged"),
        "{err}"
    );
    assert!(lowbit::ensure_many(out.dir(), &[2]).unwrap()[0].built);
    assert_eq!(read(&out.path("experts2.bin")), original);

    // The first 4-bit record: fails its regeneration from the seed.
    flip_byte(&out.path("experts.bin"), 10);
    let err = ExpertStore::open(out.dir(), 4).err().unwrap().to_string();
    assert!(
        err.contains("experts.bin") && err.contains("seed 4"),
        "{err}"
    );

    // A 2-bit store standing alone: the same check, and nothing to rebuild it from.
    let q2 = TempDir::new("synth-flip-q2");
    write(q2.dir(), &[2], 4);
    flip_byte(&q2.path("experts2.bin"), 3);
    let err = ExpertStore::open(q2.dir(), 2).err().unwrap().to_string();
    assert!(
        err.contains("experts2.bin") && err.contains("record 0"),
        "{err}"
    );
    let err = lowbit::ensure(q2.dir(), 2).unwrap_err().to_string();
    assert!(err.contains("experts2.bin"), "{err}");
    assert!(logits(q2.dir(), None).is_err());
}

#[test]
fn bad_requests_are_refused_with_the_field_named() {
    let out = TempDir::new("synth-bad");
    let tok = fixture("small-moe");
    let e = synth_converted(&SHAPE, Some(2), &[5], &tok, out.dir(), 0, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("5-bit"), "{e}");
    let e = synth_converted(&SHAPE, Some(4), &[2], &tok, out.dir(), 0, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 layers"), "{e}");
    std::fs::write(out.path("model.safetensors"), b"").unwrap();
    let e = synth_converted(&SHAPE, Some(2), &[2], &tok, out.dir(), 0, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn layer_counts_follow_the_byte_budget() {
    let per = |n| SHAPE.converted_bytes(n, &[2]).unwrap();
    assert!(per(1) < per(2) && per(2) < per(3));
    assert_eq!(SHAPE.layers_fitting(3, &[2], per(3)).unwrap(), 3);
    assert_eq!(SHAPE.layers_fitting(3, &[2], per(3) - 1).unwrap(), 2);
    assert_eq!(SHAPE.layers_fitting(3, &[2], per(1) - 1).unwrap(), 0);
    let out = TempDir::new("synth-size");
    let r = write(out.dir(), &[4, 2], 0);
    assert_eq!(r.bytes(), SHAPE.converted_bytes(2, &[4, 2]).unwrap());
}

// ---- Records made from docs/FORMAT.md §16 alone ----

fn fnv_field(h: &mut u64, bytes: &[u8]) {
    fnv_bytes(h, &(bytes.len() as u64).to_le_bytes());
    fnv_bytes(h, bytes);
}

fn fnv_bytes(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h = (*h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
}

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The 4-bit record of expert `e` of layer `l` of SHAPE by §16: parts at the offsets of
/// §3 for hidden 128, intermediate 96 (stored 128).
fn record_by_the_document(seed: u64, l: u64, e: u64, record_size: usize) -> Vec<u8> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv_field(&mut h, b"dynmoe-affine-uniform-1");
    for v in [seed, l, e] {
        fnv_bytes(&mut h, &v.to_le_bytes());
    }
    let mut rng = SplitMix(h);
    let mut rec = vec![0u8; record_size];
    // Codes: gate and up 96 rows × 128 / 8 words, down 128 × 128 / 8; 64-aligned parts.
    let code_lens = [96 * 16 * 4, 96 * 16 * 4, 128 * 16 * 4];
    let mut at = 0;
    for len in code_lens {
        for k in 0..len / 8 {
            rec[at + 8 * k..at + 8 * k + 8].copy_from_slice(&rng.next().to_le_bytes());
        }
        at += len;
    }
    let m0 = 0.02f32 / (255.0f32 / 12.0 * (1.0 + 0.25f32 * 0.25 / 3.0)).sqrt();
    for groups in [96 * 2, 96 * 2, 128 * 2] {
        let (scales, biases) = (at, at + 2 * groups);
        for g in 0..groups {
            let r = rng.next();
            let unit = (r >> 40) as f32 / (1u64 << 24) as f32;
            let magnitude = m0 * (0.75 + 0.5 * unit);
            let scale = half::bf16::from_f32(if r.is_multiple_of(2) {
                magnitude
            } else {
                -magnitude
            });
            let bias = half::bf16::from_f32(-7.5 * scale.to_f32());
            rec[scales + 2 * g..scales + 2 * g + 2].copy_from_slice(&scale.to_le_bytes());
            rec[biases + 2 * g..biases + 2 * g + 2].copy_from_slice(&bias.to_le_bytes());
        }
        at += 4 * groups;
    }
    rec
}

#[test]
fn records_and_dense_weights_are_what_format_md_says() {
    let out = TempDir::new("synth-doc");
    write(out.dir(), &[4], 11);
    let store = ExpertStore::open(out.dir(), 4).unwrap();
    let size = store.layout().record_size;
    let bytes = read(&out.path("experts.bin"));
    for (i, (l, e)) in [(0, (0, 0)), (5, (0, 5)), (15, (1, 7))] {
        assert_eq!(
            bytes[i * size..(i + 1) * size],
            record_by_the_document(11, l, e, size),
            "record {i}"
        );
    }

    // dense.safetensors: a norm is ones; the first values of a matrix are chunk 0's.
    let dense = read(&out.path("dense.safetensors"));
    let n = u64::from_le_bytes(dense[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&dense[8..8 + n]).unwrap();
    let tensor = |name: &str| {
        let off = &header[name]["data_offsets"];
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        &dense[8 + n + a..8 + n + b]
    };
    assert!(tensor("model.norm.weight")
        .chunks_exact(2)
        .all(|v| v == half::bf16::ONE.to_le_bytes()));
    let name = "model.layers.1.self_attn.q_proj.weight";
    let mut salt = 11u64 ^ 0xcbf2_9ce4_8422_2325;
    fnv_bytes(&mut salt, name.as_bytes());
    let mut rng = SplitMix(salt);
    let r = rng.next();
    for (k, v) in tensor(name)[..8].chunks_exact(2).enumerate() {
        let u = (((r >> (16 * k)) & 0xffff) as f32 + 0.5) / 65536.0;
        let want = half::bf16::from_f32((2.0 * u - 1.0) * 0.02 * 3f32.sqrt());
        assert_eq!(v, want.to_le_bytes(), "value {k}");
    }
}
