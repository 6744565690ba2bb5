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
    // Dense layers coded at load (kept bf16 in the directory), and coded in their own file.
    // tiny-moe's experts are so small that a VQ record (a 16 KiB page) is 10.7 bits per
    // weight: the fewest resident with their spare slots are 5.3 bits of its experts.
    check("q4", 6.0);
    check("vq1.5", 8.0);
}

fn check(dense_codec: &str, bits: f64) {
    let out = TempDir::new("compressed-bits");
    let src = fixture("tiny-moe");
    let calib = std::fs::read_to_string("../../data/corpus/code/calib.txt").unwrap();
    let opts = CompressOptions {
        bits,
        scope: BudgetScope::Experts,
        rounds: 1,
        anneal: Vec::new(),
        chunks: 1,
        ctx: 128,
        dense_codec: Some(dense_codec.parse::<Codec>().unwrap()),
        shadow: None,
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
        // A layer left bf16 keeps its experts here; the resident ones are its share.
        let plan_layer = |name: &str| {
            let l: u64 = name.split('.').nth(2).unwrap().parse().unwrap();
            plan.layers.iter().find(|p| p.layer as u64 == l).unwrap()
        };
        // q4: a 4-bit code per weight and a bf16 scale and bias per 64, 4.5 bits.
        let matrix = t["shape"].as_array().unwrap().len() == 2;
        let resident = match group(name) {
            Group::Attention if matrix && dense_codec == "q4" => params * 9 / 16,
            Group::Attention if matrix => panic!("{name}: a coded weight left in bf16"),
            Group::RoutedExperts => {
                let l = plan_layer(name);
                disk * l.resident as u64 / l.experts as u64
            }
            _ => disk,
        };
        add(group(name), params, resident, disk);
    }
    let source = header(&src.join("model.safetensors"));
    let params_of = |t: &Value| -> u64 {
        t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .product()
    };
    let mut codebooks = 0;
    let codebook = |rung: &str| {
        let r = dynmoe::codec::vq::Rung::parse(rung).unwrap();
        (1u64 << r.index_bits) * r.dim as u64 * 2
    };
    if dense_codec.starts_with("vq") {
        codebooks += codebook(dense_codec);
        let coded = header(&out.path(&format!("dense-{dense_codec}.safetensors")));
        let mut weights = 0;
        for (name, t) in coded.as_object().unwrap() {
            let o = &t["data_offsets"];
            let Some(weight) = name
                .strip_suffix(".vq_codes")
                .or(name.strip_suffix(".vq_norms"))
            else {
                continue;
            };
            let bytes = o[1].as_u64().unwrap() - o[0].as_u64().unwrap();
            let params = if name.ends_with(".vq_codes") {
                weights += 1;
                params_of(&source[weight])
            } else {
                0
            };
            add(group(weight), params, bytes, bytes);
        }
        assert!(weights > 0);
    }
    let config = json(&src.join("config.json"));
    let (h, inter) = (
        config["hidden_size"].as_u64().unwrap(),
        config["moe_intermediate_size"].as_u64().unwrap(),
    );
    let plan_json = json(&out.path("plan.json"));
    let manifest = json(&out.path("compressed.json"));
    for rung in manifest["stores"].as_object().unwrap().keys() {
        let m = json(&out.path(&format!("experts-{rung}.json")));
        let record = m["record_size"].as_u64().unwrap();
        if rung != dense_codec {
            codebooks +=
                (1u64 << m["index_bits"].as_u64().unwrap()) * m["dim"].as_u64().unwrap() * 2;
        }
        let file = std::fs::metadata(out.path(&format!("experts-{rung}.bin")))
            .unwrap()
            .len();
        let mut disk = 0;
        for l in plan_json["layers"].as_array().unwrap() {
            if l["codec"] == *rung {
                let experts = l["experts"].as_u64().unwrap();
                disk += experts * record;
                // The resident experts and the spare slots their swaps land in.
                let held = l["resident"].as_u64().unwrap() + l["spare_slots"].as_u64().unwrap();
                add(
                    Group::RoutedExperts,
                    experts * 3 * h * inter,
                    held * record,
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
    let source_params: u64 = source
        .as_object()
        .unwrap()
        .iter()
        .filter(|(n, _)| *n != "__metadata__")
        .map(|(_, t)| params_of(t))
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
