//! Resident expert sets on real fixtures: confined routing against a model that only
//! has the resident experts, the reservoir's records against the checkpoint and the
//! stores, swaps committing only at token boundaries, and a decode run from disk.

use std::collections::BTreeMap;
use std::path::Path;

use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Cpu;
use dynmoe::checkpoint::Checkpoint;
use dynmoe::checkpoint::{experts::ExpertShape, experts::ExpertTensors};
use dynmoe::model::{self, ExpertBits};
use dynmoe::residency::{Mode, PolicyParams, ReservoirKind, ResidencyConfig, ResidentCount};
use dynmoe::runtime::generate::generate_ids;
use dynmoe::store::records::Buffer;
use dynmoe::testing::{fixture, rel_err, TempDir};
use safetensors::tensor::TensorView;

/// Resident experts of tiny-moe (8 experts, top-2, 2 layers) used below: a different
/// half in each layer.
fn residents() -> BTreeMap<usize, Vec<u32>> {
    BTreeMap::from([(0, vec![1, 2, 5, 7]), (1, vec![0, 3, 4, 6])])
}

fn config(mode: Mode, k: usize, reservoir: ReservoirKind) -> ResidencyConfig {
    ResidencyConfig {
        resident: ResidentCount::Count(k),
        mode,
        reservoir,
        policy: PolicyParams::default(),
        loader_threads: 2,
        shadow: None,
    }
}

/// A copy of the tiny-moe checkpoint that has only `keep[layer]` as its experts
/// (renumbered in ascending order) and the matching router rows: routing over it is
/// a softmax over exactly those experts' logits.
fn subset_model(keep: &BTreeMap<usize, Vec<u32>>) -> TempDir {
    let src = fixture("tiny-moe");
    let dir = TempDir::new("residency-subset");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let k = keep[&0].len();
    cfg["num_local_experts"] = k.into();
    std::fs::write(dir.path("config.json"), cfg.to_string()).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let parts: Vec<&str> = name.split('.').collect();
        if name.contains(".mlp.experts.") {
            let layer: usize = parts[2].parse().unwrap();
            let e: u32 = parts[5].parse().unwrap();
            if let Some(i) = keep[&layer].iter().position(|&x| x == e) {
                let renamed = format!("model.layers.{layer}.mlp.experts.{i}.{}.weight", parts[6]);
                out.push((renamed, t.dtype(), t.shape().to_vec(), t.data().to_vec()));
            }
        } else if name.ends_with(".mlp.gate.weight") {
            let layer: usize = parts[2].parse().unwrap();
            let row = t.shape()[1] * 2;
            let data: Vec<u8> = keep[&layer]
                .iter()
                .flat_map(|&e| t.data()[e as usize * row..(e as usize + 1) * row].to_vec())
                .collect();
            out.push((name, t.dtype(), vec![k, t.shape()[1]], data));
        } else {
            out.push((name, t.dtype(), t.shape().to_vec(), t.data().to_vec()));
        }
    }
    let views: Vec<(String, TensorView)> = out
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path("model.safetensors")).unwrap();
    dir
}

fn tokens(m: &model::LoadedModel<Cpu>) -> Vec<u32> {
    m.tokenizer
        .encode("The whale swam past the lighthouse while gulls argued over the harbour. 1 + 2 = 3; print(x)")
        .unwrap()
}

fn logits(m: &model::LoadedModel<Cpu>, ids: &[u32]) -> Vec<f32> {
    let mut state = m.model.new_state(ids.len());
    m.model.forward(&mut state, ids, 0).unwrap()
}

/// With a static set, the forward pass equals that of a model whose non-resident
/// experts do not exist, for the bf16 checkpoint and for its 4- and 2-bit stores,
/// from a RAM and a disk reservoir.
#[test]
fn static_set_equals_a_model_of_only_the_residents() {
    let keep = residents();
    let sub = subset_model(&keep);
    let full_conv = TempDir::new("residency-full-conv");
    let sub_conv = TempDir::new("residency-sub-conv");
    dynmoe::store::base::convert(&fixture("tiny-moe"), full_conv.dir(), &mut |_, _| {}).unwrap();
    dynmoe::store::base::convert(sub.dir(), sub_conv.dir(), &mut |_, _| {}).unwrap();
    let tiny = fixture("tiny-moe");
    let cases: Vec<(&str, &Path, &Path, ExpertBits)> = vec![
        ("bf16", &tiny, sub.dir(), ExpertBits::default()),
        (
            "4-bit",
            full_conv.dir(),
            sub_conv.dir(),
            ExpertBits::default(),
        ),
        (
            "2-bit",
            full_conv.dir(),
            sub_conv.dir(),
            ExpertBits {
                default: Some(2),
                ..ExpertBits::default()
            },
        ),
    ];
    for (label, full, subset, bits) in cases {
        let want_m = model::load_with(subset, Cpu::fast(), &bits).unwrap();
        let ids = tokens(&want_m);
        let want = logits(&want_m, &ids);
        for kind in [ReservoirKind::Ram, ReservoirKind::Disk] {
            let mut m = model::load_with(full, Cpu::fast(), &bits).unwrap();
            let unconfined = logits(&m, &ids);
            let reservoir = m.model.reservoir(kind).unwrap();
            let res = m
                .model
                .new_residency(reservoir, config(Mode::Static, 4, kind), &keep)
                .unwrap();
            m.model.set_residency(Some(res));
            let got = logits(&m, &ids);
            let err = rel_err(&got, &want);
            assert!(err < 1e-5, "{label} {kind:?}: rel err {err}");
            // And confinement is not a no-op.
            assert!(
                rel_err(&unconfined, &want) > 1e-3,
                "{label}: the residents changed nothing"
            );
            let r = m.model.residency().unwrap().report();
            assert!(
                r.hit_rate > 0.0 && r.hit_rate < 1.0,
                "{label}: hit rate {}",
                r.hit_rate
            );
            assert_eq!(r.counters.swaps, 0);
            assert_eq!(m.model.residency().unwrap().resident_sets(), keep);
        }
    }
}

/// A plan's expert mask (no slots) routes exactly as a model of only the kept experts,
/// and at VQ rungs too.
#[test]
fn expert_masks_equal_a_model_of_only_the_kept_experts() {
    use dynmoe::codec::Codec;
    use dynmoe::model::Codecs;
    let keep = residents();
    let sub = subset_model(&keep);
    let mask = |m: &mut model::LoadedModel<Cpu>| {
        for (&layer, kept) in &keep {
            let mut mask = vec![false; m.model.config.moe.num_experts];
            kept.iter().for_each(|&e| mask[e as usize] = true);
            m.model.set_expert_mask(layer, Some(mask)).unwrap();
        }
    };
    let want_m = model::load(sub.dir(), Cpu::fast()).unwrap();
    let ids = tokens(&want_m);
    let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    mask(&mut m);
    let err = rel_err(&logits(&m, &ids), &logits(&want_m, &ids));
    assert!(err < 1e-5, "bf16: rel err {err}");

    // At a VQ rung the kept experts' encodings are the same in both models (the seed of
    // an expert's rotation follows its index, which the subset renumbers, so compare the
    // masked model with itself unmasked instead: masking must change it, and a mask
    // keeping every expert must not).
    let codecs = Codecs {
        default: Some("vq2.25".parse::<Codec>().unwrap()),
        ..Codecs::default()
    };
    // The VQ experts are stored beside the checkpoint: a copy keeps the fixture clean.
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    let mut vq = model::load_with_codecs(copy.dir(), Cpu::fast(), &codecs).unwrap();
    let open = logits(&vq, &ids);
    let layer = *keep.keys().next().unwrap();
    vq.model
        .set_expert_mask(layer, Some(vec![true; vq.model.config.moe.num_experts]))
        .unwrap();
    // Confining renormalises by a sum that is 1 up to rounding.
    let same = rel_err(&logits(&vq, &ids), &open);
    assert!(
        same < 1e-6,
        "a mask keeping every expert changed the logits by {same}"
    );
    mask(&mut vq);
    assert!(
        rel_err(&logits(&vq, &ids), &open) > 1e-3,
        "the mask changed nothing"
    );
    // Too few experts kept for top-k, and a dense layer, are refused.
    let k = vq.model.config.moe.top_k;
    let e = vq.model.config.moe.num_experts;
    let mut few = vec![false; e];
    few[..k - 1].iter_mut().for_each(|b| *b = true);
    assert!(vq.model.set_expert_mask(layer, Some(few)).is_err());
    assert!(vq
        .model
        .set_expert_mask(layer, Some(vec![true; e + 1]))
        .is_err());
}

/// Every expert resident gives the unconfined forward pass.
#[test]
fn all_resident_equals_unconfined() {
    let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    let ids = tokens(&m);
    let want = logits(&m, &ids);
    let reservoir = m.model.reservoir(ReservoirKind::Ram).unwrap();
    let res = m
        .model
        .new_residency(
            reservoir,
            config(Mode::Static, 8, ReservoirKind::Ram),
            &BTreeMap::new(),
        )
        .unwrap();
    m.model.set_residency(Some(res));
    let got = logits(&m, &ids);
    assert!(rel_err(&got, &want) < 1e-6);
    let r = m.model.residency().unwrap().report();
    assert!((r.hit_rate - 1.0).abs() < 1e-9);
}

/// RAM and disk reservoirs deliver the same records: for a checkpoint, the
/// checkpoint's own weights widened to f32; for a store, the store's record bytes.
#[test]
fn ram_and_disk_reservoirs_deliver_identical_records() {
    let conv = TempDir::new("residency-records");
    dynmoe::store::base::convert(&fixture("tiny-moe"), conv.dir(), &mut |_, _| {}).unwrap();
    let ckpt = Checkpoint::open(&fixture("tiny-moe")).unwrap();
    let shape = ExpertShape {
        experts: 8,
        hidden: 64,
        intermediate: 64,
    };
    for (label, dir, bits) in [
        ("bf16", fixture("tiny-moe"), None),
        ("4-bit", conv.dir().to_path_buf(), None),
        ("3-bit", conv.dir().to_path_buf(), Some(3)),
    ] {
        let m = model::load_with(
            &dir,
            Cpu::fast(),
            &ExpertBits {
                default: bits,
                ..ExpertBits::default()
            },
        )
        .unwrap();
        let ram = m.model.reservoir(ReservoirKind::Ram).unwrap();
        let disk = m.model.reservoir(ReservoirKind::Disk).unwrap();
        assert!(ram.ram_bytes() > 0 && disk.ram_bytes() == 0);
        let store = (label != "bf16")
            .then(|| dynmoe::store::ExpertStore::open(&dir, bits.unwrap_or(4)).unwrap());
        let mut scratch = Vec::new();
        for layer in [0, 1] {
            for e in 0..8 {
                let mut a = ram.format(layer).buffer();
                let mut b = disk.format(layer).buffer();
                let na = ram.read(layer, e, &mut a, &mut scratch).unwrap();
                let nb = disk.read(layer, e, &mut b, &mut scratch).unwrap();
                assert_eq!(na, nb);
                assert_eq!(a, b, "{label} layer {layer} expert {e}");
                match (&a, &store) {
                    (Buffer::F32(f), None) => {
                        let t = ExpertTensors::find(
                            &ckpt,
                            &format!("model.layers.{layer}.mlp"),
                            ["gate_proj", "up_proj", "down_proj"],
                        )
                        .unwrap();
                        let want: Vec<f32> = (0..3)
                            .flat_map(|p| t.matrix(&ckpt, &shape, e, p).unwrap().0)
                            .collect();
                        assert_eq!(f, &want, "{label} layer {layer} expert {e}");
                        assert_eq!(na, want.len() * 2, "bf16 bytes moved");
                    }
                    (Buffer::Words(_), Some(s)) => {
                        let idx = s.record_index(layer, e).unwrap();
                        assert_eq!(&a.bytes()[..na], s.record_bytes(idx), "{label} {layer} {e}");
                    }
                    _ => panic!("{label}: unexpected buffer kind"),
                }
            }
        }
    }
}

/// A swap's data arrives on a loader thread, but the set changes only at the next
/// token boundary (the start of a forward call), and then the new expert serves.
#[test]
fn swaps_commit_only_at_a_token_boundary() {
    for kind in [ReservoirKind::Ram, ReservoirKind::Disk] {
        let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
        let reservoir = m.model.reservoir(kind).unwrap();
        let mut cfg = config(Mode::Dynamic, 4, kind);
        // Any better-ranked non-resident qualifies, one pair at a time, every 8 tokens.
        cfg.policy = PolicyParams {
            interval: 8,
            max_swaps: 1,
            margin: 0.0,
            half_lives: [4.0, 16.0],
        };
        let res = m
            .model
            .new_residency(reservoir, cfg, &BTreeMap::new())
            .unwrap();
        m.model.set_residency(Some(res));
        let ids = tokens(&m);
        let mut state = m.model.new_state(ids.len() + 1);
        m.model.forward(&mut state, &ids[..8], 8).unwrap();
        let r = m.model.residency().unwrap();
        let flying = r.in_flight();
        let issued: usize = flying.values().map(Vec::len).sum();
        assert!(
            issued > 0,
            "{kind:?}: no swap planned; ranks never beat a resident?"
        );
        let before = r.resident_sets();
        r.wait_loads();
        // Loaded, not committed.
        assert_eq!(r.resident_sets(), before);
        assert_eq!(r.report().counters.swaps, 0);
        // The next forward call is the boundary.
        m.model.forward(&mut state, &ids[8..9], 1).unwrap();
        let r = m.model.residency().unwrap();
        let after = r.resident_sets();
        for (layer, pairs) in &flying {
            for &(out, inc) in pairs {
                assert!(!after[layer].contains(&out) && after[layer].contains(&inc));
            }
            assert_eq!(after[layer].len(), 4, "the budget never grows");
        }
        let rep = r.report();
        assert_eq!(rep.counters.swaps as usize, issued);
        assert_eq!(rep.counters.bytes_moved as usize, issued * 3 * 64 * 64 * 2);
    }
}

/// Decoding with the reservoir on disk: swaps happen, no load is still in flight at
/// the checkpoint after it was issued (no stall), and the budget holds.
#[test]
fn decode_from_a_disk_reservoir_does_not_stall() {
    let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    let reservoir = m.model.reservoir(ReservoirKind::Disk).unwrap();
    let mut cfg = config(Mode::Dynamic, 4, ReservoirKind::Disk);
    cfg.policy.interval = 16;
    cfg.policy.max_swaps = 1;
    let res = m
        .model
        .new_residency(reservoir, cfg, &BTreeMap::new())
        .unwrap();
    m.model.set_residency(Some(res));
    let ids = tokens(&m);
    let sampling = Sampling {
        temperature: 1.0,
        seed: 7,
        ..Sampling::GREEDY
    };
    let g = generate_ids(&m, &ids, 300, sampling, &[], &mut |_| {}).unwrap();
    assert_eq!(g.tokens.len(), 300);
    let r = m.model.residency().unwrap().report();
    assert_eq!(r.counters.stalls, 0, "{r:?}");
    assert!(r.counters.checkpoints >= 18);
    assert_eq!(r.counters.loads_failed, 0);
    assert!(r.counters.swaps > 0, "{r:?}");
    assert_eq!(r.resident_per_layer, 4);
    for set in m.model.residency().unwrap().resident_sets().values() {
        assert_eq!(set.len(), 4);
    }
}

#[test]
fn per_layer_counts_from_initial_sets_equal_masks_of_those_sets() {
    // A plan gives each layer its own count: 3 resident experts in layer 0, 5 in layer 1.
    let sets = BTreeMap::from([(0, vec![6, 1, 3]), (1, vec![0, 2, 4, 5, 7])]);
    let tiny = fixture("tiny-moe");
    let mut masked = model::load(&tiny, Cpu::fast()).unwrap();
    for (&layer, set) in &sets {
        let mut keep = vec![false; masked.model.config.moe.num_experts];
        set.iter().for_each(|&e| keep[e as usize] = true);
        masked.model.set_expert_mask(layer, Some(keep)).unwrap();
    }
    let ids = tokens(&masked);
    let want = logits(&masked, &ids);

    let mut m = model::load(&tiny, Cpu::fast()).unwrap();
    let mut cfg = config(Mode::Static, 0, ReservoirKind::Ram);
    cfg.resident = ResidentCount::Initial;
    let reservoir = m.model.reservoir(cfg.reservoir).unwrap();
    let res = m
        .model
        .new_residency(reservoir.clone(), cfg, &sets)
        .unwrap();
    m.model.set_residency(Some(res));
    let err = rel_err(&logits(&m, &ids), &want);
    assert!(err < 1e-5, "rel err {err}");
    let report = m.model.residency().unwrap().report();
    assert_eq!(report.resident_by_layer, BTreeMap::from([(0, 3), (1, 5)]));
    assert_eq!(report.resident_per_layer, 5);

    // Without a set for layer 1 there is no count for it.
    let partial = BTreeMap::from([(0, vec![6, 1, 3])]);
    let err = match m.model.new_residency(reservoir, cfg, &partial) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a layer without an initial set was accepted"),
    };
    assert!(err.contains("layer 1"), "{err}");
}

// ---- Resident sets over VQ layers ----

/// tiny-moe (in a copy, where its VQ stores are written) with layer 0 at `l0` and
/// layer 1 at `l1` (`None`: bf16).
fn vq_model(dir: &Path, l0: Option<&str>, l1: Option<&str>) -> model::LoadedModel<Cpu> {
    use dynmoe::codec::Codec;
    let codecs = model::Codecs {
        default: None,
        per_layer: [(0, l0), (1, l1)]
            .into_iter()
            .filter_map(|(l, c)| c.map(|c| (l, c.parse::<Codec>().unwrap())))
            .collect(),
        dense: None,
        head: None,
        embedding: None,
    };
    model::load_with_codecs(dir, Cpu::fast(), &codecs).unwrap()
}

/// Every expert of a VQ layer resident gives the model without resident sets, from
/// either reservoir: such a layer holds no set (nothing is copied into slots, which
/// would duplicate the store's records) and misses nothing.
#[test]
fn vq_layers_with_every_expert_resident_equal_no_residency() {
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    for (l0, l1) in [(Some("vq2"), Some("vq1.5")), (Some("vq2.25"), None)] {
        for kind in [ReservoirKind::Ram, ReservoirKind::Disk] {
            let mut m = vq_model(copy.dir(), l0, l1);
            let ids = tokens(&m);
            let want = logits(&m, &ids);
            let reservoir = m.model.reservoir(kind).unwrap();
            let res = m
                .model
                .new_residency(reservoir, config(Mode::Static, 8, kind), &BTreeMap::new())
                .unwrap();
            m.model.set_residency(Some(res));
            // Confining renormalises by a sum that is 1 up to rounding.
            let err = rel_err(&logits(&m, &ids), &want);
            assert!(err < 1e-6, "{l0:?}/{l1:?} {kind:?}: rel err {err}");
            let r = m.model.residency().unwrap().report();
            assert!((r.hit_rate - 1.0).abs() < 1e-9);
            assert_eq!(r.counters.initial_fill_bytes, 0, "no slot filled");
            assert_eq!(r.slot_bytes, 0);
            assert!(r.resident_by_layer.is_empty());
        }
    }
}

/// The reservoir of a VQ layer holds the store's records: RAM and disk deliver the same
/// bytes, which are the store's.
#[test]
fn vq_reservoirs_deliver_the_store_records() {
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    let m = vq_model(copy.dir(), Some("vq2"), Some("vq1.5"));
    let ram = m.model.reservoir(ReservoirKind::Ram).unwrap();
    let disk = m.model.reservoir(ReservoirKind::Disk).unwrap();
    let mut scratch = Vec::new();
    for (layer, rung) in [(0, "vq2"), (1, "vq1.5")] {
        let store = dynmoe::store::vq::VqStore::open(
            copy.dir(),
            dynmoe::codec::vq::Rung::parse(rung).unwrap(),
        )
        .unwrap();
        for e in 0..8 {
            let mut a = ram.format(layer).buffer();
            let mut b = disk.format(layer).buffer();
            let na = ram.read(layer, e, &mut a, &mut scratch).unwrap();
            assert_eq!(disk.read(layer, e, &mut b, &mut scratch).unwrap(), na);
            assert_eq!(a, b);
            let index = store.record_index(layer, e).unwrap();
            assert_eq!(&a.bytes()[..na], store.record_bytes(index), "{rung} {e}");
        }
    }
    // VQ experts encoded in memory (the allocator's probes) have no reservoir.
    let (config, ckpt) = (
        dynmoe::checkpoint::Config::from_file(&copy.path("config.json")).unwrap(),
        Checkpoint::open(copy.dir()).unwrap(),
    );
    let rung = dynmoe::codec::vq::Rung::parse("vq2").unwrap();
    let vq = BTreeMap::from([(
        0,
        dynmoe::store::vq_encode::encode_experts(&config, &ckpt, 0, rung).unwrap(),
    )]);
    let probe = dynmoe::alloc::probe::assemble(
        copy.dir(),
        config,
        &ckpt,
        &vq,
        &Default::default(),
        &BTreeMap::new(),
    )
    .unwrap();
    let err = probe.model.reservoir(ReservoirKind::Ram).err().unwrap();
    assert!(err.to_string().contains("layer 0"), "{err}");
}

/// At 50% residency on VQ layers, dynamic swaps happen, and after them a forward pass
/// equals the model without resident sets whose routing is masked to the same experts;
/// the disk and RAM reservoirs give identical outputs and sets all along.
#[test]
fn vq_dynamic_swaps_equal_the_model_with_the_same_mask() {
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    let run = |kind: ReservoirKind| {
        let mut m = vq_model(copy.dir(), Some("vq2"), Some("vq1.5"));
        let reservoir = m.model.reservoir(kind).unwrap();
        let mut cfg = config(Mode::Dynamic, 4, kind);
        cfg.policy = PolicyParams {
            interval: 8,
            max_swaps: 1,
            margin: 0.0,
            half_lives: [4.0, 16.0],
        };
        let res = m.model.new_residency(reservoir, cfg, &residents()).unwrap();
        m.model.set_residency(Some(res));
        let ids = tokens(&m);
        let mut state = m.model.new_state(ids.len() + 8);
        let mut outputs = Vec::new();
        let mut sets = Vec::new();
        // Token by token; each load is waited for so both reservoirs commit at the same
        // boundaries (a real run never waits).
        for (i, &t) in ids.iter().enumerate() {
            outputs.push(m.model.forward(&mut state, &[t], 1).unwrap());
            sets.push(m.model.residency().unwrap().resident_sets());
            m.model.residency().unwrap().wait_loads();
            assert_eq!(state.pos, i + 1);
        }
        (m, ids, outputs, sets)
    };
    let (mut m, ids, ram_out, ram_sets) = run(ReservoirKind::Ram);
    let (_, _, disk_out, disk_sets) = run(ReservoirKind::Disk);
    assert!(ram_out == disk_out, "disk and RAM reservoirs differ");
    assert_eq!(ram_sets, disk_sets);
    let r = m.model.residency().unwrap().report();
    assert!(r.counters.swaps > 0, "{r:?}");
    assert_eq!(r.counters.loads_failed, 0);
    assert!(
        ram_sets.first() != ram_sets.last(),
        "the sets never changed"
    );
    let vq2 =
        dynmoe::store::vq::VqLayout::new(dynmoe::codec::vq::Rung::parse("vq2").unwrap(), 64, 64)
            .unwrap()
            .record_size as u64;
    assert_eq!(
        r.counters.bytes_moved,
        r.counters.swaps * vq2,
        "whole records moved"
    );

    // A whole sequence in one call uses one set: the one committed at its start.
    let mut state = m.model.new_state(ids.len());
    let got = m.model.forward(&mut state, &ids, 0).unwrap();
    let sets = m.model.residency().unwrap().resident_sets();
    m.model.set_residency(None);
    for (&layer, set) in &sets {
        assert_eq!(set.len(), 4, "the budget never grows");
        let mut mask = vec![false; 8];
        set.iter().for_each(|&e| mask[e as usize] = true);
        m.model.set_expert_mask(layer, Some(mask)).unwrap();
    }
    assert_eq!(
        got,
        logits(&m, &ids),
        "resident slots differ from the masked model"
    );
}

/// Decoding with a VQ layer (and a bf16 one) from a disk reservoir: swaps happen, no
/// load is still in flight at the checkpoint after it was issued (no stall).
#[test]
fn vq_decode_from_a_disk_reservoir_does_not_stall() {
    let copy = dynmoe::testing::fixture_copy("tiny-moe");
    let mut m = vq_model(copy.dir(), Some("vq2"), None);
    let reservoir = m.model.reservoir(ReservoirKind::Disk).unwrap();
    let mut cfg = config(Mode::Dynamic, 4, ReservoirKind::Disk);
    cfg.policy.interval = 16;
    cfg.policy.max_swaps = 1;
    let res = m
        .model
        .new_residency(reservoir, cfg, &BTreeMap::new())
        .unwrap();
    m.model.set_residency(Some(res));
    let ids = tokens(&m);
    let sampling = Sampling {
        temperature: 1.0,
        seed: 7,
        ..Sampling::GREEDY
    };
    let g = generate_ids(&m, &ids, 300, sampling, &[], &mut |_| {}).unwrap();
    assert_eq!(g.tokens.len(), 300);
    let r = m.model.residency().unwrap().report();
    assert_eq!(r.counters.stalls, 0, "{r:?}");
    assert!(
        r.counters.swaps > 0 && r.counters.loads_failed == 0,
        "{r:?}"
    );
}

/// The checkpoint count runs across forward calls: a call past several checkpoints counts
/// each and carries the tokens past the last one into the next call.
#[test]
fn checkpoints_count_routed_tokens_across_calls() {
    let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    let reservoir = m.model.reservoir(ReservoirKind::Ram).unwrap();
    let mut cfg = config(Mode::Dynamic, 4, ReservoirKind::Ram);
    cfg.policy.interval = 16;
    let res = m
        .model
        .new_residency(reservoir, cfg, &BTreeMap::new())
        .unwrap();
    m.model.set_residency(Some(res));
    let ids: Vec<u32> = tokens(&m).into_iter().cycle().take(64).collect();
    let mut state = m.model.new_state(128);
    let checkpoints =
        |m: &model::LoadedModel<Cpu>| m.model.residency().unwrap().report().counters.checkpoints;
    // 53 tokens: three checkpoints, 5 tokens toward the fourth.
    m.model.forward(&mut state, &ids[..53], 52).unwrap();
    assert_eq!(checkpoints(&m), 3);
    // 10 more: 15 toward the fourth, none reached.
    m.model.forward(&mut state, &ids[53..63], 9).unwrap();
    assert_eq!(checkpoints(&m), 3);
    // One more reaches it.
    m.model.forward(&mut state, &ids[63..64], 0).unwrap();
    assert_eq!(checkpoints(&m), 4);
}

/// With shadows a token routed outside the resident set runs the expert's shadow instead
/// of being confined: with 2 of 8 experts resident and shadows at vq5 the model stays
/// close to every expert resident, where confinement alone is far off; the hit rate counts
/// the residents only, and the shadows' bytes are reported (codes and norms of
/// every expert's three matrices, no page padding).
#[test]
fn shadows_run_the_experts_outside_the_set() {
    use dynmoe::codec::vq::{row_bytes, Rung};
    let mut m = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    let ids = tokens(&m);
    let want = logits(&m, &ids);
    let run = |m: &mut model::LoadedModel<Cpu>, shadow: Option<Rung>| {
        let reservoir = m.model.reservoir(ReservoirKind::Ram).unwrap();
        let config = ResidencyConfig {
            shadow,
            ..config(Mode::Static, 2, ReservoirKind::Ram)
        };
        let res = m
            .model
            .new_residency(reservoir, config, &residents())
            .unwrap();
        m.model.set_residency(Some(res));
        let err = rel_err(&logits(m, &ids), &want);
        let report = m.model.set_residency(None).unwrap().report();
        (err, report)
    };
    let (confined, plain) = run(&mut m, None);
    let vq5 = Rung::parse("vq5").unwrap();
    let (shadowed, report) = run(&mut m, Some(vq5));
    println!("rel err to every expert resident: confined {confined:.3}, shadows {shadowed:.4}");
    assert!(
        shadowed < 0.05 && shadowed * 10.0 < confined,
        "{shadowed} vs {confined}"
    );
    assert_eq!(plain.shadow_bytes, 0);
    // Tokens did route outside the set: the shadows ran.
    assert!(report.hit_rate < 0.99, "{}", report.hit_rate);
    let c = &m.model.config;
    let (h, i, e) = (c.hidden_size, c.moe.expert_intermediate, c.moe.num_experts);
    let matrix = |rows: usize, cols: usize| {
        let block = dynmoe::codec::vq::rotation::block_size(cols);
        rows * row_bytes(vq5, cols) + 2 * rows * cols.div_ceil(block)
    };
    let layers = c.moe_layers().count();
    assert_eq!(
        report.shadow_bytes,
        layers * e * (2 * matrix(i, h) + matrix(h, i))
    );
}
