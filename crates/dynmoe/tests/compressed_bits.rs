//! Bits per weight of a compressed directory, checked against what its files hold: the
//! expected bytes and parameters of each group are read here from the safetensors
//! header, the store manifest, `config.json` and `plan.json` directly.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use dynmoe::alloc::compress::{compress, BudgetScope, CompressOptions};
use dynmoe::codec::Codec;
use dynmoe::eval::compressed_bits::{compressed_bits, Group};
use dynmoe::store::compressed;
use dynmoe::testing::{fixture, TempDir};
use serde_json::Value;

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn header(path: &Path) -> Value {
    let mut f = std::fs::File::open(path).unwrap();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).unwrap();
    let mut h = vec![0u8; u64::from_le_bytes(n) as usize];
    f.read_exact(&mut h).unwrap();
    serde_json::from_slice(&h).unwrap()
}

/// The group of a qwen3_moe tensor name, spelled out here rather than asked of the
/// library.
fn group(name: &str) -> Group {
    if name.contains("embed_tokens") {
        Group::Embedding
    } else if name.starts_with("lm_head") {
        Group::LmHead
    } else if name.contains("norm") || name.ends_with("mlp.gate.weight") {
        Group::RoutersAndNorms
    } else if name.contains(".experts.") {
        Group::RoutedExperts
    } else if name.contains("self_attn.") {
        Group::Attention
    } else {
        panic!("{name}: no group")
    }
}

#[test]
fn each_group_reports_its_bytes_times_8_over_its_parameters() {
    let out = TempDir::new("compressed-bits");
    let src = fixture("tiny-moe");
    let calib = std::fs::read_to_string("../../data/corpus/code/calib.txt").unwrap();
    let opts = CompressOptions {
        bits: 2.0,
        scope: BudgetScope::Experts,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 128,
        dense_codec: "q4".parse::<Codec>().unwrap(),
    };
    let calib = [("code".to_string(), calib)];
    let plan = compress(&src, &calib, out.dir(), &opts, &|_| {}, &|_| {}).unwrap();
    compressed::write(&src, out.dir(), &plan, &mut |_, _| {}).unwrap();
    let got = compressed_bits(out.dir()).unwrap();

    // (params, resident bytes, disk bytes) per group.
    let mut want: BTreeMap<Group, (u64, u64, u64)> = BTreeMap::new();
    let mut add = |g: Group, p: u64, r: u64, d: u64| {
        let e = want.entry(g).or_default();
        (e.0, e.1, e.2) = (e.0 + p, e.1 + r, e.2 + d);
    };
    let dense = header(&out.path("dense.safetensors"));
    for (name, t) in dense.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let params: u64 = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product();
        let o = &t["data_offsets"];
        let disk = o[1].as_u64().unwrap() - o[0].as_u64().unwrap();
        assert!(!name.contains(".experts."), "every layer is coded: {name}");
        // q4: a 4-bit code per weight and a bf16 scale and bias per 64, 4.5 bits.
        let resident = match group(name) {
            Group::Attention if t["shape"].as_array().unwrap().len() == 2 => params * 9 / 16,
            _ => disk,
        };
        add(group(name), params, resident, disk);
    }
    let config = json(&src.join("config.json"));
    let (h, inter) = (
        config["hidden_size"].as_u64().unwrap(),
        config["moe_intermediate_size"].as_u64().unwrap(),
    );
    let plan_json = json(&out.path("plan.json"));
    let manifest = json(&out.path("compressed.json"));
    let mut codebooks = 0;
    for rung in manifest["stores"].as_object().unwrap().keys() {
        let m = json(&out.path(&format!("experts-{rung}.json")));
        let record = m["record_size"].as_u64().unwrap();
        codebooks += (1u64 << m["index_bits"].as_u64().unwrap()) * m["dim"].as_u64().unwrap() * 2;
        let file = std::fs::metadata(out.path(&format!("experts-{rung}.bin")))
            .unwrap()
            .len();
        let mut disk = 0;
        for l in plan_json["layers"].as_array().unwrap() {
            if l["codec"] == *rung {
                let experts = l["experts"].as_u64().unwrap();
                disk += experts * record;
                add(
                    Group::RoutedExperts,
                    experts * 3 * h * inter,
                    l["resident"].as_u64().unwrap() * record,
                    experts * record,
                );
            }
        }
        assert_eq!(disk, file, "{rung}: the store is its layers' records");
    }

    let groups: Vec<Group> = got.groups.keys().copied().collect();
    assert_eq!(groups, want.keys().copied().collect::<Vec<_>>());
    assert!(groups.contains(&Group::RoutedExperts) && groups.contains(&Group::Attention));
    let (mut params, mut resident, mut disk) = (0, 0, 0);
    for (g, &(p, r, d)) in &want {
        let b = &got.groups[g];
        assert_eq!(
            (b.params, b.resident_bytes, b.disk_bytes),
            (p, r, d),
            "{g:?}"
        );
        assert_eq!(b.resident_bits, r as f64 * 8.0 / p as f64, "{g:?}");
        assert_eq!(b.disk_bits, d as f64 * 8.0 / p as f64, "{g:?}");
        (params, resident, disk) = (params + p, resident + r, disk + d);
    }
    // Every parameter of the checkpoint is counted once.
    let source = header(&src.join("model.safetensors"));
    let source_params: u64 = source
        .as_object()
        .unwrap()
        .iter()
        .filter(|(n, _)| *n != "__metadata__")
        .map(|(_, t)| {
            t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .product::<u64>()
        })
        .sum();
    assert_eq!(params, source_params);
    assert_eq!(got.total.params, params);
    assert_eq!(
        got.total.resident_bits,
        resident as f64 * 8.0 / params as f64
    );
    assert_eq!(got.total.disk_bits, disk as f64 * 8.0 / params as f64);
    // Codebooks are apart from the model's bits: f16 codewords, 2^index_bits of `dim`.
    assert_eq!(got.codebook_bytes, codebooks);
    assert!(
        got.total.resident_bits < 15.0,
        "{}",
        got.total.resident_bits
    );
}
