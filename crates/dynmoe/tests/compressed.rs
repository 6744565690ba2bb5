//! A compressed model directory (`dynmoe compress -o OUT`): it loads without the
//! checkpoint and runs as the checkpoint does under the same plan; every way it can be
//! damaged is an error naming the file and field.

use std::path::Path;

use dynmoe::alloc::compress::{compress, BudgetScope, CompressOptions};
use dynmoe::alloc::probe::load_plan;
use dynmoe::backend::Cpu;
use dynmoe::codec::Codec;
use dynmoe::model;
use dynmoe::store::compressed;
use dynmoe::store::plan::Plan;
use dynmoe::testing::{fixture, logits_of, TempDir};

fn logits(m: &model::LoadedModel<Cpu>) -> Vec<f32> {
    logits_of(m, "def main():\n    print('the whale and the lighthouse')")
}

/// A plan for tiny-moe at 6 bits over its experts (its experts are so small that a VQ
/// record, one 16 KiB page, is 10.7 bits per weight; with the fewest resident and their
/// spare slots, half the experts are held) and the directory written from it.
fn compressed_tiny() -> (TempDir, Plan) {
    compressed_tiny_with(Codec::Bf16)
}

/// [`compressed_tiny`] with the dense layers at `dense_codec`.
fn compressed_tiny_with(dense_codec: Codec) -> (TempDir, Plan) {
    let out = TempDir::new("compressed");
    let src = fixture("tiny-moe");
    let calib = std::fs::read_to_string("../../data/corpus/code/calib.txt").unwrap();
    let opts = CompressOptions {
        bits: 6.0,
        scope: BudgetScope::Experts,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 512,
        dense_codec: Some(dense_codec),
        shadow: None,
    };
    let plan = compress(
        &src,
        &[("code".into(), calib)],
        out.dir(),
        &opts,
        &|_| {},
        &|_| {},
    )
    .unwrap();
    compressed::write(&src, out.dir(), &plan, &mut |_, _| {}).unwrap();
    (out, plan)
}

/// Bits accounting of a checkpoint under a plan's codecs and resident counts.
fn priced(
    plan: &Plan,
    config: &dynmoe::checkpoint::Config,
    ckpt: &dynmoe::checkpoint::Checkpoint,
) -> dynmoe::eval::bits::BitsReport {
    use dynmoe::eval::bits::{account, Assignment};
    let assignment = Assignment {
        tensors: plan.group_codecs(),
        layers: plan
            .layers
            .iter()
            .map(|l| (l.layer, (l.codec, l.resident)))
            .collect(),
        default_experts: Codec::Bf16,
    };
    account(config, ckpt, &assignment, None).unwrap()
}

fn err_of(dir: &Path) -> String {
    match model::load(dir, Cpu::fast()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(x) = src {
                s += &format!(": {x}");
                src = x.source();
            }
            s
        }
    }
}

#[test]
fn a_compressed_directory_runs_as_its_plan_and_refuses_damage() {
    let (out, plan) = compressed_tiny();
    let dir = out.dir();
    assert!(compressed::is_compressed(dir));
    // Every expert routable in both: the same weights, read from the directory's own
    // stores and dense tensors instead of the checkpoint.
    let (from_dir, loaded_plan) = model::load_compressed(dir, Cpu::fast()).unwrap();
    assert_eq!(loaded_plan.layers, plan.layers);
    let mut from_ckpt = load_plan(&fixture("tiny-moe"), &plan, &mut |_, _| {}).unwrap();
    for l in &plan.layers {
        from_ckpt.model.set_expert_mask(l.layer, None).unwrap();
    }
    assert_eq!(logits(&from_dir), logits(&from_ckpt));
    // `model::load` takes the same path, and refuses codecs the plan does not name.
    assert_eq!(
        logits(&model::load(dir, Cpu::fast()).unwrap()),
        logits(&from_dir)
    );
    let codecs = model::Codecs {
        default: Some("vq1.5".parse().unwrap()),
        ..model::Codecs::default()
    };
    assert!(model::load_with_codecs(dir, Cpu::fast(), &codecs).is_err());

    // Damage, one at a time, each restored afterwards.
    let manifest = dir.join(compressed::MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest).unwrap();
    let edits: [(&str, &str, &str); 4] = [
        ("\"version\": 2", "\"version\": 3", "version"),
        ("dynmoe-compressed-model", "something-else", "format"),
        (
            "\"dense_bytes\": ",
            "\"dense_bytes\": 1",
            "dense.safetensors",
        ),
        (
            "\"source_fingerprint\": \"fnv1a64:",
            "\"source_fingerprint\": \"fnv1a64:0",
            "source.fingerprint",
        ),
    ];
    for (from, to, named) in edits {
        std::fs::write(&manifest, text.replacen(from, to, 1)).unwrap();
        let e = err_of(dir);
        assert!(e.contains(named), "{from} -> {to}: {e}");
    }
    std::fs::write(
        &manifest,
        text.replacen("\"stores\"", "\"extra\": 1, \"stores\"", 1),
    )
    .unwrap();
    assert!(err_of(dir).contains("compressed.json"));
    std::fs::write(&manifest, &text).unwrap();
    assert!(model::load(dir, Cpu::fast()).is_ok());

    let dense = dir.join("dense.safetensors");
    let bytes = std::fs::read(&dense).unwrap();
    std::fs::write(&dense, &bytes[..bytes.len() - 8]).unwrap();
    assert!(err_of(dir).contains("dense.safetensors"));
    std::fs::write(&dense, &bytes).unwrap();

    let store = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with("experts-vq") && n.ends_with(".bin")
        })
        .expect("the plan puts some layer at a VQ rung");
    let bytes = std::fs::read(&store).unwrap();
    let mut flipped = bytes.clone();
    flipped[200] ^= 0x40;
    std::fs::write(&store, &flipped).unwrap();
    let e = err_of(dir);
    assert!(
        e.contains(&store.display().to_string()) && e.contains("checksum"),
        "{e}"
    );
    std::fs::write(&store, &bytes).unwrap();
    assert!(model::load(dir, Cpu::fast()).is_ok());

    // Rewriting removes the commit mark first: a crash mid-way leaves a directory no
    // later run takes for a compressed model.
    std::fs::remove_file(&manifest).unwrap();
    assert!(!compressed::is_compressed(dir));
    compressed::write(&fixture("tiny-moe"), dir, &plan, &mut |_, _| {}).unwrap();
    assert_eq!(std::fs::read_to_string(&manifest).unwrap(), text);
}

/// With the dense layers at a VQ rung, the directory holds them coded (and not in
/// `dense.safetensors`), runs exactly as the checkpoint under the same plan, and refuses
/// a manifest or a coded file that disagrees.
#[test]
fn a_compressed_directory_with_coded_dense_layers() {
    let (out, plan) = compressed_tiny_with("vq3".parse().unwrap());
    let dir = out.dir();
    assert_eq!(plan.dense_codec.to_string(), "vq3");
    let coded = dir.join("dense-vq3.safetensors");
    assert!(coded.exists());
    let dense = dynmoe::checkpoint::Checkpoint::open(dir).unwrap();
    assert!(dense
        .names()
        .iter()
        .all(|n| !n.contains("self_attn.q_proj.weight")));

    let (from_dir, _) = model::load_compressed(dir, Cpu::fast()).unwrap();
    let mut from_ckpt = load_plan(&fixture("tiny-moe"), &plan, &mut |_, _| {}).unwrap();
    for l in &plan.layers {
        from_ckpt.model.set_expert_mask(l.layer, None).unwrap();
    }
    assert_eq!(logits(&from_dir), logits(&from_ckpt));
    let bf16 = model::load(&fixture("tiny-moe"), Cpu::fast()).unwrap();
    assert_ne!(logits(&from_dir), logits(&bf16));

    let manifest = dir.join(compressed::MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["dense_vq"] = serde_json::json!(["vq2"]);
    std::fs::write(&manifest, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = err_of(dir);
    assert!(e.contains("dense_vq") && e.contains("vq2"), "{e}");
    std::fs::write(&manifest, &text).unwrap();

    let bytes = std::fs::read(&coded).unwrap();
    let mut flipped = bytes.clone();
    let at = flipped.len() - 5;
    flipped[at] ^= 0x10;
    std::fs::write(&coded, &flipped).unwrap();
    let e = err_of(dir);
    assert!(
        e.contains("dense-vq3.safetensors") && e.contains("checksum"),
        "{e}"
    );
    std::fs::write(&coded, &bytes).unwrap();
    assert!(model::load(dir, Cpu::fast()).is_ok());
}

/// With the dense layers at an affine width, the directory keeps them in
/// `dense.safetensors` and no coded file, quantizes them at load and runs exactly as the
/// checkpoint under the same plan; codecs asked beside a compressed directory are refused.
#[test]
fn a_compressed_directory_with_affine_dense_layers() {
    let q4 = Codec::Affine { bits: 4 };
    let (out, plan) = compressed_tiny_with(q4);
    let dir = out.dir();
    assert_eq!(plan.dense_codec, q4);
    let manifest = compressed::open(dir).unwrap().0;
    assert!(manifest.dense_vq.is_empty());
    assert!(std::fs::read_dir(dir).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with("dense-")));
    let dense = dynmoe::checkpoint::Checkpoint::open(dir).unwrap();
    assert!(dense
        .names()
        .iter()
        .any(|n| n.contains("self_attn.q_proj.weight")));

    let (from_dir, _) = model::load_compressed(dir, Cpu::fast()).unwrap();
    let mut from_ckpt = load_plan(&fixture("tiny-moe"), &plan, &mut |_, _| {}).unwrap();
    for l in &plan.layers {
        from_ckpt.model.set_expert_mask(l.layer, None).unwrap();
    }
    assert_eq!(logits(&from_dir), logits(&from_ckpt));
    let bf16_plan = Plan {
        dense_codec: Codec::Bf16,
        ..plan.clone()
    };
    let mut bf16_dense = load_plan(&fixture("tiny-moe"), &bf16_plan, &mut |_, _| {}).unwrap();
    for l in &plan.layers {
        bf16_dense.model.set_expert_mask(l.layer, None).unwrap();
    }
    assert_ne!(logits(&from_dir), logits(&bf16_dense));

    let codecs = model::Codecs {
        dense: Some(q4),
        ..model::Codecs::default()
    };
    let err = model::load_with_codecs(dir, Cpu::fast(), &codecs)
        .err()
        .expect("a compressed directory runs its plan's codecs")
        .to_string();
    assert!(err.contains("plan.json"), "{err}");
}

/// A budget over the whole model pays for the dense layers at their codec: the plan's
/// resident bytes are what bits accounting prices for its assignment (dense layers
/// included, the codebooks aside: the plan reports those the plan uses on their own), and
/// within the budget.
#[test]
fn a_model_scope_plan_prices_its_coded_dense_layers() {
    use dynmoe::eval::bits::{account, Assignment};
    let out = TempDir::new("compress-model-scope");
    let src = fixture("tiny-moe");
    let calib = std::fs::read_to_string("../../data/corpus/en/calib.txt").unwrap();
    let dense_codec: Codec = "vq3".parse().unwrap();
    let opts = CompressOptions {
        bits: 14.0,
        scope: BudgetScope::Model,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 512,
        dense_codec: Some(dense_codec),
        shadow: None,
    };
    let plan = compress(
        &src,
        &[("en".into(), calib)],
        out.dir(),
        &opts,
        &|_| {},
        &|_| {},
    )
    .unwrap();
    assert_eq!(plan.dense_codec, dense_codec);
    assert!(plan.resident_bytes <= plan.budget_bytes);
    let config = dynmoe::checkpoint::Config::from_file(&src.join("config.json")).unwrap();
    let ckpt = dynmoe::checkpoint::Checkpoint::open(&src).unwrap();
    let priced = priced(&plan, &config, &ckpt);
    assert_eq!(plan.resident_bytes, priced.resident_bytes);
    assert!(priced.codebook_bytes >= dense_codec.codebook_bytes().unwrap());
    assert_eq!(plan.rounds["codebook_bytes"], priced.codebook_bytes);
    assert_eq!(plan.params_total, priced.params_total);
    let bf16_dense = account(&config, &ckpt, &Assignment::uncompressed(), None).unwrap();
    assert!(
        priced.resident_by_kind[&dynmoe::checkpoint::arch::TensorKind::Attention]
            < bf16_dense.resident_by_kind[&dynmoe::checkpoint::arch::TensorKind::Attention] / 3
    );
}

/// A whole-model budget below what the allocation can reach is refused before any probe,
/// naming the smallest bits it could make, the share it does not allocate, and what to
/// change: with every group allocated, the experts-only scope; with the dense layers
/// fixed, leaving them to the allocator.
#[test]
fn a_budget_below_the_smallest_model_names_the_smallest_and_what_to_change() {
    let out = TempDir::new("compress-too-small");
    let calib = std::fs::read_to_string("../../data/corpus/en/calib.txt").unwrap();
    for (bits, dense_codec, hint) in [
        (0.5, None, "--scope experts"),
        (0.5, Some(Codec::Bf16), "leave out --dense-codec"),
    ] {
        let opts = CompressOptions {
            bits,
            scope: BudgetScope::Model,
            rounds: 1,
            anneal: Vec::new(),
            chunks: 1,
            ctx: 512,
            dense_codec,
            shadow: None,
        };
        let err = compress(
            &fixture("tiny-moe"),
            &[("en".into(), calib.clone())],
            out.dir(),
            &opts,
            &|_| {},
            &|_| {},
        )
        .unwrap_err();
        let dynmoe::alloc::compress::CompressError::BudgetTooSmall { minimum, fixed, .. } = &err
        else {
            panic!("{err}");
        };
        assert!(*minimum > bits && *fixed < *minimum, "{err}");
        let text = err.to_string();
        assert!(text.contains(hint), "{text}");
        // No probe ran: the journal was never written.
        assert!(!out.path("probes.jsonl").exists());
    }
}

/// Under a whole-model budget every tensor group is allocated: the embeddings, the
/// untied LM head and each layer's dense weights get a codec of their own, the plan's
/// bytes are what bits accounting prices for those codecs, the written directory runs
/// exactly as the checkpoint under the plan, and each group's reported bits are its
/// resident bytes × 8 / its parameters.
#[test]
fn a_whole_model_plan_allocates_every_tensor_group() {
    use dynmoe::checkpoint::arch::CodedGroup;
    use dynmoe::eval::compressed_bits::compressed_bits;
    let out = TempDir::new("compress-groups");
    let src = fixture("tiny-moe");
    let calib = std::fs::read_to_string("../../data/corpus/en/calib.txt").unwrap();
    let opts = CompressOptions {
        bits: 3.0,
        scope: BudgetScope::Model,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 512,
        dense_codec: None,
        shadow: None,
    };
    let plan = compress(
        &src,
        &[("en".into(), calib)],
        out.dir(),
        &opts,
        &|_| {},
        &|_| {},
    )
    .unwrap();
    let config = dynmoe::checkpoint::Config::from_file(&src.join("config.json")).unwrap();
    let mut want = vec![CodedGroup::Embedding, CodedGroup::Head];
    want.extend((0..config.layers.len()).map(CodedGroup::Dense));
    want.sort();
    assert_eq!(plan.groups.keys().copied().collect::<Vec<_>>(), want);
    assert!(plan.resident_bytes <= plan.budget_bytes);
    // At 3 bits of 16 nothing can stay bf16 everywhere.
    assert!(
        plan.groups.values().any(|&c| c != Codec::Bf16),
        "{:?}",
        plan.groups
    );

    let ckpt = dynmoe::checkpoint::Checkpoint::open(&src).unwrap();
    let priced = priced(&plan, &config, &ckpt);
    assert_eq!(plan.resident_bytes, priced.resident_bytes);
    assert_eq!(plan.rounds["codebook_bytes"], priced.codebook_bytes);

    compressed::write(&src, out.dir(), &plan, &mut |_, _| {}).unwrap();
    let (from_dir, _) = model::load_compressed(out.dir(), Cpu::fast()).unwrap();
    let mut from_ckpt = load_plan(&src, &plan, &mut |_, _| {}).unwrap();
    for l in &plan.layers {
        from_ckpt.model.set_expert_mask(l.layer, None).unwrap();
    }
    assert_eq!(logits(&from_dir), logits(&from_ckpt));

    let bits = compressed_bits(out.dir()).unwrap();
    let mut resident = 0;
    for (group, g) in &bits.groups {
        assert!(
            (g.resident_bits - g.resident_bytes as f64 * 8.0 / g.params as f64).abs() < 1e-9,
            "{group:?}: {g:?}"
        );
        resident += g.resident_bytes;
    }
    assert_eq!(resident, plan.resident_bytes);
}

/// What runs is what was priced: following a plan, the resident sets hold exactly the
/// bytes the plan gives the layers that keep only some experts (their residents and the
/// spare slots swaps land in), and a layer keeping every expert holds no set at all.
#[test]
fn resident_sets_hold_the_bytes_the_plan_priced() {
    use dynmoe::residency::ResidencyConfig;
    use dynmoe::runtime::residency::follow_plan;
    let (out, plan) = compressed_tiny();
    let partial: Vec<_> = plan
        .layers
        .iter()
        .filter(|l| l.resident < l.experts)
        .collect();
    assert!(!partial.is_empty(), "{:?}", plan.layers);
    let (mut m, _) = model::load_compressed(out.dir(), Cpu::fast()).unwrap();
    follow_plan(&mut m, &plan, ResidencyConfig::default()).unwrap();
    let report = m.model.residency().unwrap().report();
    assert_eq!(
        report.resident_by_layer.keys().copied().collect::<Vec<_>>(),
        partial.iter().map(|l| l.layer).collect::<Vec<_>>()
    );
    assert_eq!(
        report.slot_bytes as u64,
        partial.iter().map(|l| l.resident_bytes).sum::<u64>()
    );
    // Running does not grow them.
    let _ = logits(&m);
    let after = m.model.residency().unwrap().report();
    assert_eq!(after.slot_bytes, report.slot_bytes);
    assert_eq!(report.shadow_bytes, 0);

    // With shadows the plan prices every expert of a partial layer at the shadow rung
    // too, and the sets hold exactly that beside their slots.
    let out = TempDir::new("compressed-shadows");
    let src = fixture("tiny-moe");
    let opts = CompressOptions {
        bits: 8.0,
        scope: BudgetScope::Experts,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 512,
        dense_codec: None,
        shadow: Some("vq1".parse().unwrap()),
    };
    let calib = std::fs::read_to_string("../../data/corpus/code/calib.txt").unwrap();
    let plan = compress(
        &src,
        &[("code".into(), calib)],
        out.dir(),
        &opts,
        &|_| {},
        &|_| {},
    )
    .unwrap();
    compressed::write(&src, out.dir(), &plan, &mut |_, _| {}).unwrap();
    let partial: Vec<_> = plan
        .layers
        .iter()
        .filter(|l| l.resident < l.experts)
        .collect();
    assert!(!partial.is_empty() && partial.iter().all(|l| l.shadow_bytes > 0));
    let (mut m, _) = model::load_compressed(out.dir(), Cpu::fast()).unwrap();
    follow_plan(&mut m, &plan, ResidencyConfig::default()).unwrap();
    let report = m.model.residency().unwrap().report();
    assert_eq!(
        report.shadow_bytes as u64,
        partial.iter().map(|l| l.shadow_bytes).sum::<u64>()
    );
    assert_eq!(
        (report.slot_bytes + report.shadow_bytes) as u64,
        partial.iter().map(|l| l.resident_bytes).sum::<u64>()
    );
    // The directory runs as the checkpoint does under the plan (shadows from the
    // checkpoint's bf16 experts there, from the VQ records here: close, not equal).
    let from_ckpt = load_plan(&src, &plan, &mut |_, _| {}).unwrap();
    let e = dynmoe::testing::rel_err(&logits(&m), &logits(&from_ckpt));
    assert!(e < 0.2, "rel err {e}");
}
