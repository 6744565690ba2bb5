//! Whole models on the device against the CPU: perplexity and greedy decodes of the
//! fixtures, plan masks, resident sets, and decode steps advanced on the device.

use super::*;

fn test_text(domain: &str) -> String {
    std::fs::read_to_string(root().join("data/corpus").join(domain).join("test.txt")).unwrap()
}

/// Perplexity over 4 chunks of 512 on the CPU and the device, and the greedy decode of
/// 24 tokens after a 16-token prompt on both. The caller has checked for a device.
/// CPU and GPU perplexity, greedy decodes and one decode step's router probabilities and
/// logits of the model in `dir` loaded with `codecs`. With `routed`, every MoE layer's
/// experts are quantized, so each routes on the device and decode steps are recorded.
fn compare_end_to_end(label: &str, dir: &std::path::Path, codecs: &Codecs, routed: bool) {
    let cpu = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    // The device backend is borrowed by every model; `Cuda` is not `Clone`, so each
    // model gets its own backend on the same device.
    let dev = model::load_with_codecs(dir, Cuda::new(0).unwrap(), codecs).unwrap();
    let opts = PplOptions {
        ctx: 512,
        max_chunks: Some(4),
        ..PplOptions::default()
    };
    for domain in ["en", "code"] {
        let text = test_text(domain);
        let a = perplexity(&cpu, &text, opts, &mut |_, _| {}).unwrap();
        let b = perplexity(&dev, &text, opts, &mut |_, _| {}).unwrap();
        let rel = (a.ppl - b.ppl).abs() / a.ppl;
        println!(
            "ppl {label:<22} {domain:<5} cpu {:.6} cuda {:.6} rel {rel:.2e}",
            a.ppl, b.ppl
        );
        assert!(rel < 1e-3, "{label} {domain}: cpu {} cuda {}", a.ppl, b.ppl);
        let prompt = &cpu.tokenizer.encode(&text).unwrap()[..16];
        let s = Sampling::default();
        let x = generate_ids(&cpu, prompt, 24, s, &[], &mut |_| {}).unwrap();
        let y = generate_ids(&dev, prompt, 24, s, &[], &mut |_| {}).unwrap();
        println!(
            "greedy {label:<19} {domain:<5} equal {} (decode {:.0} tok/s cpu, {:.0} cuda)",
            x.tokens == y.tokens,
            x.decode_tokens_per_second,
            y.decode_tokens_per_second
        );
        assert_eq!(
            x.tokens, y.tokens,
            "{label} {domain}: greedy decodes differ"
        );
    }
    // With quantized experts every MoE layer routes on the device, so the decode steps
    // after the first were replayed from a recorded graph.
    let recorded = dev.model.backend().recorded_steps();
    println!("graphs {label:<19} recorded decode steps {recorded}");
    if routed {
        assert!(recorded > 0, "{label}: no decode step was recorded");
    }
    // A decode step's router probabilities (read back once, at the end of the step, when
    // the device routes) against the CPU's, layer by layer.
    let text = test_text("en");
    let ids = &cpu.tokenizer.encode(&text).unwrap()[..9];
    let (mut sc, mut sd) = (cpu.model.new_state(16), dev.model.new_state(16));
    cpu.model.forward(&mut sc, &ids[..8], 8).unwrap();
    dev.model.forward(&mut sd, &ids[..8], 8).unwrap();
    let lc = cpu.model.forward(&mut sc, &ids[8..], 0).unwrap();
    let ld = dev.model.forward(&mut sd, &ids[8..], 0).unwrap();
    let worst = sc
        .router_probs
        .iter()
        .zip(&sd.router_probs)
        .map(|(a, b)| {
            assert_eq!(a.len(), b.len(), "{label}: router probabilities of a layer");
            if a.is_empty() {
                0.0
            } else {
                rel_err(b, a)
            }
        })
        .fold(0.0f64, f64::max);
    let e_logits = rel_err(&ld, &lc);
    println!("decode step {label:<19} router probs {worst:.2e} logits {e_logits:.2e}");
    assert!(
        worst < 1e-4 && e_logits < 1e-4,
        "{label}: decode step differs"
    );
}

#[test]
fn a_plan_mask_routes_alike_on_the_device() {
    let Some(_) = gpu() else { return };
    let converted = TempDir::new("cuda-mask");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let mut cpu = model::load_with(converted.dir(), Cpu::fast(), &eb).unwrap();
    let mut dev = model::load_with(converted.dir(), Cuda::new(0).unwrap(), &eb).unwrap();
    let e = cpu.model.config.moe.num_experts;
    let layers: Vec<usize> = cpu.model.config.moe_layers().collect();
    for (j, &l) in layers.iter().enumerate() {
        let keep: Vec<bool> = (0..e).map(|x| (x + j) % 4 != 0).collect();
        cpu.model.set_expert_mask(l, Some(keep.clone())).unwrap();
        dev.model.set_expert_mask(l, Some(keep)).unwrap();
    }
    let prompt = &cpu.tokenizer.encode(&test_text("en")).unwrap()[..16];
    let s = Sampling::default();
    let x = generate_ids(&cpu, prompt, 24, s, &[], &mut |_| {}).unwrap();
    let y = generate_ids(&dev, prompt, 24, s, &[], &mut |_| {}).unwrap();
    println!("greedy small-moe q4 masked equal {}", x.tokens == y.tokens);
    assert_eq!(x.tokens, y.tokens, "masked greedy decodes differ");
}

#[test]
fn fixtures_agree_with_the_cpu_end_to_end() {
    let Some(_) = gpu() else { return };
    for name in [
        "tiny-moe",
        "small-moe",
        "tiny-qwen2-moe",
        "tiny-olmoe",
        "tiny-mixtral",
        "tiny-glm4-moe",
        "tiny-deepseek-v3",
    ] {
        compare_end_to_end(name, &fixture(name), &Codecs::default(), false);
    }
    let converted = TempDir::new("cuda-stores");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 3, 2] {
        let eb = ExpertBits {
            default: Some(bits),
            ..ExpertBits::default()
        };
        let label = format!("small-moe q{bits}");
        compare_end_to_end(&label, converted.dir(), &(&eb).into(), true);
    }
    // Every expert at a VQ rung (encoded beside a copy of the checkpoint on first load),
    // routed on the device by the VQ kernels: gate and up rotated in one block of 256,
    // down in one padded block of 128.
    let copy = dynmoe::testing::fixture_copy("small-moe");
    for rung in ["vq1.5", "vq3"] {
        let codecs = Codecs {
            default: Some(rung.parse().unwrap()),
            ..Codecs::default()
        };
        compare_end_to_end(&format!("small-moe {rung}"), copy.dir(), &codecs, true);
    }
}

/// Resident sets in device memory (the small fixture's 4-bit store, and its experts at
/// vq1.5, 12 of 32 experts per layer, dynamic swaps every 4 tokens from a RAM and a disk
/// reservoir): each greedy step, replayed from a recorded graph or run through
/// `forward`, picks the token the CPU picks with routing masked to the sets that step
/// used; swaps happen and commit only once their copies have landed; and a whole
/// sequence through the device slots (the prompt path) equals the CPU model masked to
/// the final sets. The 4- and 2-bit stores' slots in unit tiles (on tensor cores) and in
/// rows (without).
#[test]
fn resident_sets_in_device_memory_route_as_masks() {
    let Some(_) = gpu() else { return };
    let converted = TempDir::new("cuda-residency");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    for bits in [4, 2] {
        let codecs = (&ExpertBits {
            default: Some(bits),
            ..ExpertBits::default()
        })
            .into();
        let tiles = check_resident_sets(&format!("q{bits}"), converted.dir(), &codecs, true);
        // Tiled slots are sized by their tiles, not by the record's whole pages: the
        // device bytes say which the sets held.
        let rows = check_resident_sets(
            &format!("q{bits} without tensor cores"),
            converted.dir(),
            &codecs,
            false,
        );
        assert_ne!(
            rows, tiles,
            "q{bits}: slots in tiles took the records' size"
        );
    }
    // VQ slots hold each expert's rotation signs beside its record.
    let copy = dynmoe::testing::fixture_copy("small-moe");
    let codecs = Codecs {
        default: Some("vq1.5".parse().unwrap()),
        ..Codecs::default()
    };
    check_resident_sets("vq1.5", copy.dir(), &codecs, false);
}

/// Checks resident sets of the model at `dir` (`tensor_cores`: 4- and 2-bit affine slots
/// in unit tiles); returns the device bytes the sets took.
fn check_resident_sets(
    label: &str,
    dir: &std::path::Path,
    codecs: &Codecs,
    tensor_cores: bool,
) -> usize {
    use dynmoe::residency::{Mode, PolicyParams, ReservoirKind, ResidencyConfig, ResidentCount};
    let mut cpu = model::load_with_codecs(dir, Cpu::fast(), codecs).unwrap();
    let backend = if tensor_cores {
        Cuda::new(0).unwrap()
    } else {
        let tuning = Tuning {
            tensor_cores: false,
            ..Tuning::from_env().unwrap()
        };
        Cuda::with_tuning(0, tuning).unwrap()
    };
    let mut dev = model::load_with_codecs(dir, backend, codecs).unwrap();
    let mut device_bytes = 0;
    let e = cpu.model.config.moe.num_experts;
    let layers: Vec<usize> = cpu.model.config.moe_layers().collect();
    for kind in [ReservoirKind::Ram, ReservoirKind::Disk] {
        let cfg = ResidencyConfig {
            resident: ResidentCount::Count(12),
            mode: Mode::Dynamic,
            reservoir: kind,
            policy: PolicyParams {
                interval: 4,
                max_swaps: 2,
                margin: 0.0,
                half_lives: [4.0, 16.0],
            },
            loader_threads: 2,
            shadow: None,
        };
        let reservoir = dev.model.reservoir(kind).unwrap();
        let res = dev
            .model
            .new_residency(reservoir, cfg, &std::collections::BTreeMap::new())
            .unwrap();
        dev.model.set_residency(Some(res));
        let rep = dev.model.residency().unwrap().report();
        assert_eq!(
            rep.layers_on_device,
            layers.len(),
            "{label} {kind:?}: sets on the host"
        );

        let ids = cpu.tokenizer.encode(&test_text("en")).unwrap();
        let prompt = &ids[..16];
        let (mut sc, mut sd) = (cpu.model.new_state(64), dev.model.new_state(64));
        let masks = |m: &mut model::LoadedModel<Cpu>,
                     sets: &std::collections::BTreeMap<usize, Vec<u32>>| {
            for (&l, set) in sets {
                let mut keep = vec![false; e];
                set.iter().for_each(|&x| keep[x as usize] = true);
                m.model.set_expert_mask(l, Some(keep)).unwrap();
            }
        };
        let r = dev.model.residency().unwrap();
        masks(&mut cpu, &r.resident_sets());
        let lc = cpu.model.forward(&mut sc, prompt, 15).unwrap();
        let ld = dev.model.forward(&mut sd, prompt, 15).unwrap();
        let err = rel_err(&ld, &lc);
        println!("residency {label} {kind:?} prompt through device slots: logits {err:.2e}");
        assert!(
            err < 1e-4,
            "{label} {kind:?}: prompt logits differ ({err:.2e})"
        );
        dev.model.residency().unwrap().wait_loads();

        let mut next = dynmoe::model::argmax(&lc);
        let mut changed = 0;
        let mut before = dev.model.residency().unwrap().resident_sets();
        for step in 0..40 {
            // Every other step through `forward` (one row, the logits read back) rather
            // than the recorded step: both must route over the sets alone.
            let t = if step % 2 == 0 {
                dynmoe::testing::decode_one(&dev.model, &mut sd, next).unwrap()
            } else {
                dynmoe::model::argmax(&dev.model.forward(&mut sd, &[next], 0).unwrap())
            };
            let r = dev.model.residency().unwrap();
            let used = r.resident_sets();
            changed += (used != before) as usize;
            before = used.clone();
            masks(&mut cpu, &used);
            let want = dynmoe::model::argmax(&cpu.model.forward(&mut sc, &[next], 0).unwrap());
            assert_eq!(
                t, want,
                "{label} {kind:?} step {step}: device slots and CPU mask disagree"
            );
            // Both reservoirs commit at the same boundaries: every load lands before
            // the next step (a real run never waits).
            r.wait_loads();
            next = t;
        }
        let rep = dev.model.residency().unwrap().report();
        println!(
            "residency {label} {kind:?}: {} swaps, {} bytes moved, {} stalls, {} late boundaries, sets changed at {changed} steps, {} graphs recorded, {:.1} MB on the device",
            rep.counters.swaps,
            rep.counters.bytes_moved,
            rep.counters.stalls,
            rep.counters.late_boundaries,
            dev.model.backend().recorded_steps(),
            rep.device_bytes as f64 / 1e6
        );
        assert!(
            rep.counters.swaps > 0 && changed > 0,
            "{label} {kind:?}: no swap committed"
        );
        assert_eq!(rep.counters.loads_failed, 0);
        assert!(
            dev.model.backend().recorded_steps() > 0,
            "no decode step recorded"
        );

        // The whole sequence again in one call, through the slots as they are once the
        // loads waited for above commit at its start (read after it: no commit happens
        // inside a call).
        let seq = &ids[..24];
        let (mut sc, mut sd) = (cpu.model.new_state(24), dev.model.new_state(24));
        let ld = dev.model.forward(&mut sd, seq, 0).unwrap();
        let sets = dev.model.residency().unwrap().resident_sets();
        masks(&mut cpu, &sets);
        let lc = cpu.model.forward(&mut sc, seq, 0).unwrap();
        let err = rel_err(&ld, &lc);
        println!("residency {label} {kind:?} sequence after swaps: logits {err:.2e}");
        assert!(
            err < 1e-4,
            "{label} {kind:?}: sequence logits differ ({err:.2e})"
        );
        device_bytes = rep.device_bytes;
        dev.model.set_residency(None);
        for &l in &layers {
            cpu.model.set_expert_mask(l, None).unwrap();
        }
    }
    device_bytes
}

/// `advance_step` against the CPU's (the token's bits copied, the position one on), and
/// `read_async`: more reads under way than the backend keeps buffers for, each holding
/// the values its tensor had when it was queued though the tensor is overwritten right
/// after, finished out of order, one dropped unfinished.
#[test]
fn step_advance_and_queued_reads_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let at = 5;
    let mut chosen = fresh(at + 3, 901);
    chosen[at] = f32::from_bits(4321);
    let step = [f32::from_bits(17), f32::from_bits(99)];
    let cpu = Cpu::reference();
    let mut want = cpu.upload(&step);
    cpu.advance_step(&mut want, &cpu.upload(&chosen), at);
    let (mut st, ct) = (g.upload(&step), g.upload(&chosen));
    g.advance_step(&mut st, &ct, at);
    g.advance_step(&mut st, &ct, at);
    let mut got = [0.0f32; 2];
    g.download(&st, &mut got);
    println!(
        "check advance_step {} {}",
        got[0].to_bits(),
        got[1].to_bits()
    );
    assert_eq!(want[0].to_bits(), 4321);
    assert_eq!(want[1].to_bits(), 100);
    assert_eq!((got[0].to_bits(), got[1].to_bits()), (4321, 101));

    let len = 3000;
    let mut t = g.upload(&fresh(len, 910));
    let mut reads = Vec::new();
    for r in 0..6u64 {
        reads.push((r, g.read_async(&t, len - r as usize)));
        g.upload_into(&fresh(len, 911 + r), &mut t);
    }
    let dropped = reads.remove(2);
    drop(dropped);
    for (r, read) in reads.into_iter().rev() {
        let values = g.finish_read(read);
        let want = fresh(len, 910 + r);
        assert_eq!(values.len(), len - r as usize, "read {r}");
        assert!(
            values
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "read {r}: not the values queued before it"
        );
    }
    assert!(g.finish_read(g.read_async(&t, 0)).is_empty());
}

/// `decode` of many tokens on the device (every MoE layer routed there, so the step is
/// recorded and the steps queued back to back, each replay reading the token and
/// position the one before left) against `decode` of one token a call: the same tokens
/// and router probabilities; stopped early, decoding goes on from the last token handed
/// over; with graphs off it takes the steps one call at a time.
#[test]
fn queued_decode_is_decode_token_by_token_on_the_device() {
    let Some(g) = gpu() else { return };
    let converted = TempDir::new("cuda-queued");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let mut tokens = Vec::new();
    for graphs in [true, false] {
        // A backend of its own: a recording takes in what other tests queue on a shared
        // one.
        let tuning = Tuning {
            graphs,
            ..g.tuning().clone()
        };
        let dev =
            model::load_with(converted.dir(), Cuda::with_tuning(0, tuning).unwrap(), &eb).unwrap();
        let m = &dev.model;
        let prompt = &dev.tokenizer.encode(&test_text("en")).unwrap()[..16];
        let (p, n, stop) = (prompt.len(), 32, 7);
        let GreedyReference {
            state: mut s,
            first,
            tokens: want,
            probs,
        } = greedy_reference(m, prompt, n);
        assert_eq!(
            m.backend().recorded_steps() > 0,
            graphs,
            "graphs {graphs}: steps recorded"
        );
        s.pos = p;
        let mut got = Vec::new();
        let k = m
            .decode(
                &mut [Decoding::new(&mut s, first, DecodeOptions::greedy(n))],
                &mut |_, t| {
                    got.push(t);
                    true
                },
            )
            .unwrap();
        println!("queued greedy (graphs {graphs}): equal {}", got == want);
        assert_eq!((k, &got), (vec![n], &want), "graphs {graphs}");
        assert_eq!(s.pos, p + n);
        let worst = s
            .router_probs
            .iter()
            .zip(&probs[n - 1])
            .filter(|(a, _)| !a.is_empty())
            .map(|(a, b)| rel_err(a, b))
            .fold(0.0f64, f64::max);
        assert!(
            worst < 1e-6,
            "graphs {graphs}: router probabilities {worst:.2e}"
        );

        s.pos = p;
        got.clear();
        let k = m
            .decode(
                &mut [Decoding::new(&mut s, first, DecodeOptions::greedy(n))],
                &mut |_, t| {
                    got.push(t);
                    got.len() < stop
                },
            )
            .unwrap();
        assert_eq!(
            (k, &got[..]),
            (vec![stop], &want[..stop]),
            "graphs {graphs} stopped"
        );
        assert_eq!(s.pos, p + stop);
        let next = dynmoe::testing::decode_one(m, &mut s, want[stop - 1]).unwrap();
        assert_eq!(next, want[stop], "graphs {graphs}: a step after the stop");
        tokens.push(want);
    }
    assert_eq!(
        tokens[0], tokens[1],
        "the same tokens with graphs and without"
    );
}

/// Sampled decode with the token picked on the device (recorded and queued where graphs
/// are on) against the CPU's host sampler on the same model: the same tokens, at settings
/// of every kind the device chain takes (a draw alone, min-p, top-k, top-p, penalties,
/// greedy with penalties). The device is a backend of its own, so its steps record.
#[test]
fn sampled_decode_on_the_device_picks_the_cpus_tokens() {
    let Some(g) = gpu() else { return };
    if !g.samples_on_device() {
        println!("skipped: the sampler's kernels were not granted their shared memory");
        return;
    }
    let converted = TempDir::new("cuda-sampled");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let dev = model::load_with(
        converted.dir(),
        Cuda::with_tuning(0, g.tuning().clone()).unwrap(),
        &eb,
    )
    .unwrap();
    let cpu = model::load_with(converted.dir(), Cpu::fast(), &eb).unwrap();
    let prompt = &dev.tokenizer.encode(&test_text("en")).unwrap()[..16];
    let n = 24;
    let base = Sampling {
        temperature: 0.8,
        seed: 11,
        ..Sampling::GREEDY
    };
    let settings = [
        base,
        Sampling { min_p: 0.1, ..base },
        Sampling { top_k: 20, ..base },
        Sampling { top_p: 0.9, ..base },
        Sampling {
            top_k: 40,
            top_p: 0.8,
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            ..base
        },
        Sampling {
            temperature: 0.0,
            repetition_penalty: 1.5,
            ..Sampling::GREEDY
        },
    ];
    fn run<B: dynmoe::backend::Backend>(
        m: &model::Model<B>,
        prompt: &[u32],
        n: usize,
        s: Sampling,
    ) -> Vec<u32> {
        let mut st = m.new_state(prompt.len() + n + 1);
        let l = m.forward(&mut st, prompt, prompt.len() - 1).unwrap();
        let counts = dynmoe::backend::sample::counts(prompt, m.config.vocab_size);
        let first = dynmoe::backend::sample::sample(&l, &counts, &s, st.pos as u64);
        let mut got = vec![first];
        let opts = DecodeOptions {
            max_tokens: n,
            sampling: s,
        };
        m.decode(&mut [Decoding::new(&mut st, first, opts)], &mut |_, t| {
            got.push(t);
            true
        })
        .unwrap();
        got
    }
    for s in settings {
        let want = run(&cpu.model, prompt, n, s);
        let got = run(&dev.model, prompt, n, s);
        println!("sampled {s:?}: equal {}", got == want);
        assert_eq!(got, want, "{s:?}");
    }
    assert!(
        dev.model.backend().recorded_steps() > 0,
        "no sampled step was recorded"
    );
}

/// Several sequences decoded together on the device against each decoded alone there.
#[test]
fn sequences_decoded_together_on_the_device_are_each_decoded_alone() {
    let Some(g) = gpu() else { return };
    let converted = TempDir::new("cuda-rows");
    dynmoe::store::base::convert(&fixture("small-moe"), converted.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let dev = model::load_with(
        converted.dir(),
        Cuda::with_tuning(0, g.tuning().clone()).unwrap(),
        &eb,
    )
    .unwrap();
    let m = &dev.model;
    let ids = dev.tokenizer.encode(&test_text("en")).unwrap();
    let prompts: Vec<&[u32]> = vec![&ids[..16], &ids[20..29], &ids[40..72]];
    let n = 16;
    let prefill = |p: &[u32]| {
        let mut s = m.new_state(p.len() + n);
        m.forward(&mut s, &p[..p.len() - 1], 0).unwrap();
        s
    };
    let drawn = |seed: u64, top_k: usize, top_p: f32| Sampling {
        temperature: 0.8,
        top_k,
        top_p,
        seed,
        ..Sampling::GREEDY
    };
    // Greedy; then each sequence drawn by settings of its own (picked on the device when
    // decoded together, as alone); then one with penalties among them (picked on the host).
    let penalized = Sampling {
        repetition_penalty: 1.3,
        ..drawn(9, 0, 1.0)
    };
    let rounds = [
        ("greedy", [Sampling::GREEDY; 3]),
        (
            "sampled",
            [drawn(1, 0, 1.0), drawn(2, 40, 1.0), drawn(3, 0, 0.9)],
        ),
        (
            "penalized",
            [drawn(4, 0, 0.95), penalized, Sampling::GREEDY],
        ),
    ];
    for (label, settings) in rounds {
        let options = |i: usize| DecodeOptions {
            max_tokens: n,
            sampling: settings[i],
        };
        let mut want = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let mut s = prefill(p);
            let mut got = Vec::new();
            let first = p[p.len() - 1];
            m.decode(
                &mut [Decoding::new(&mut s, first, options(i))],
                &mut |_, t| {
                    got.push(t);
                    true
                },
            )
            .unwrap();
            want.push(got);
        }
        let mut states: Vec<_> = prompts.iter().map(|p| prefill(p)).collect();
        let mut got = vec![Vec::new(); prompts.len()];
        let mut seqs: Vec<Decoding<'_, _>> = states
            .iter_mut()
            .zip(&prompts)
            .enumerate()
            .map(|(i, (s, p))| Decoding::new(s, p[p.len() - 1], options(i)))
            .collect();
        m.decode(&mut seqs, &mut |i, t| {
            got[i].push(t);
            true
        })
        .unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            println!("rows {label}: sequence {i} equal {}", g == w);
            assert_eq!(g, w, "{label}: sequence {i}");
        }
    }
}
