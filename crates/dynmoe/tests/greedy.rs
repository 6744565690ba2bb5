//! Golden greedy decode: from the first 16 oracle tokens of each domain, dynmoe's
//! generation loop (one prefill, then one decode step per token) must produce exactly
//! the 24 tokens transformers' `generate(do_sample=False)` produced for the same
//! checkpoint (`greedy.json`, written by `tools/fixtures/train.py greedy`).

use dynmoe::backend::sample::Sampling;
use dynmoe::backend::Cpu;
use dynmoe::model;
use dynmoe::runtime::generate::generate_ids;
use dynmoe::testing::{fixture_dirs, greedy_reference, GreedyReference};

#[derive(serde::Deserialize)]
struct Golden {
    new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    domain: String,
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

#[test]
fn greedy_decode_matches_transformers_on_every_fixture() {
    let dirs = fixture_dirs();
    assert!(dirs.len() >= 5, "expected the five bundled fixtures");
    for dir in dirs {
        let path = dir.join("greedy.json");
        let golden: Golden = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap();
        let m = model::load(&dir, Cpu::fast()).unwrap();
        for case in &golden.cases {
            let g = generate_ids(
                &m,
                &case.prompt,
                golden.new_tokens,
                Sampling::default(),
                &[],
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(
                g.tokens,
                case.generated,
                "{} [{}]",
                dir.display(),
                case.domain
            );
        }
    }
}

/// `decode` of one token a call (the argmax and every per-step value on the backend) against
/// `forward` of one token and a host argmax: the same token and router probabilities,
/// step after step, on an MoE fixture with its experts in a 4-bit store.
#[test]
fn decode_is_forward_and_argmax() {
    use dynmoe::model::argmax;
    use dynmoe::model::ExpertBits;
    use dynmoe::testing::{decode_one, fixture, TempDir};
    let dir = TempDir::new("greedy-step");
    dynmoe::store::base::convert(&fixture("small-moe"), dir.dir(), &mut |_, _| {}).unwrap();
    let eb = ExpertBits {
        default: Some(4),
        ..ExpertBits::default()
    };
    let m = model::load_with(dir.dir(), Cpu::fast(), &eb).unwrap();
    let prompt = [5u32, 17, 300, 42, 7, 99, 1000, 3];
    let (mut a, mut b) = (m.model.new_state(40), m.model.new_state(40));
    let logits = m.model.forward(&mut a, &prompt, prompt.len() - 1).unwrap();
    m.model.forward(&mut b, &prompt, prompt.len()).unwrap();
    let (mut x, mut y) = (argmax(&logits), argmax(&logits));
    for step in 0..12 {
        x = decode_one(&m.model, &mut a, x).unwrap();
        y = argmax(&m.model.forward(&mut b, &[y], 0).unwrap());
        assert_eq!(x, y, "step {step}");
        assert_eq!(a.pos, b.pos);
        for (l, (p, q)) in a.router_probs.iter().zip(&b.router_probs).enumerate() {
            assert_eq!(p.len(), q.len(), "layer {l}");
            let worst = p
                .iter()
                .zip(q)
                .map(|(u, v)| (u - v).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-6,
                "step {step} layer {l}: router probabilities differ by {worst}"
            );
        }
    }
    // The step checks its input like forward does.
    let vocab = m.model.config.vocab_size as u32;
    assert!(decode_one(&m.model, &mut a, vocab).is_err());
    let mut full = m.model.new_state(1);
    m.model.forward(&mut full, &[1], 1).unwrap();
    assert!(decode_one(&m.model, &mut full, 1).is_err());
}

/// `decode` of many tokens against `decode` of one token a call on every fixture: the
/// same tokens, position and router probabilities. On the CPU, which records no step, it
/// runs the steps one call at a time (the unit test in `model::forward::decode` drives
/// its queued loop); what is checked here is the contract: an early stop counts only the
/// tokens handed over and decoding and `forward` go on from there; a cache that fills
/// first hands over the tokens that fit, then fails as a step past it would;
/// a first token out of the vocabulary fails; no tokens asked runs nothing.
#[test]
fn decode_of_many_tokens_is_decode_token_by_token() {
    use dynmoe::model::{argmax, DecodeOptions, Decoding, Error};
    use dynmoe::testing::decode_one;
    let at_most = DecodeOptions::greedy;
    let prompt = [5u32, 17, 300, 42, 7, 99, 1000, 3];
    let (p, n, stop) = (prompt.len(), 10, 3);
    for dir in fixture_dirs() {
        let m = model::load(&dir, Cpu::fast()).unwrap();
        let model = &m.model;
        let label = dir.display();
        let GreedyReference {
            first,
            tokens: want,
            probs,
            ..
        } = greedy_reference(model, &prompt, n);

        let mut b = model.new_state(p + n);
        model.forward(&mut b, &prompt, p - 1).unwrap();
        let mut got = Vec::new();
        let k = model
            .decode(
                &mut [Decoding::new(&mut b, first, at_most(n))],
                &mut |_, t| {
                    got.push(t);
                    true
                },
            )
            .unwrap();
        assert_eq!((k, &got), (vec![n], &want), "{label}");
        assert_eq!(b.pos, p + n, "{label}");
        assert_eq!(b.router_probs, probs[n - 1], "{label}");

        b.pos = p;
        got.clear();
        let k = model
            .decode(
                &mut [Decoding::new(&mut b, first, at_most(n))],
                &mut |_, t| {
                    got.push(t);
                    got.len() < stop
                },
            )
            .unwrap();
        assert_eq!(
            (k, &got[..]),
            (vec![stop], &want[..stop]),
            "{label} stopped"
        );
        assert_eq!(b.pos, p + stop, "{label} stopped");
        assert_eq!(b.router_probs, probs[stop - 1], "{label} stopped");
        let next = decode_one(model, &mut b, want[stop - 1]).unwrap();
        assert_eq!(next, want[stop], "{label}: a step after the stop");
        let logits = model.forward(&mut b, &[next], 0).unwrap();
        assert_eq!(argmax(&logits), want[stop + 1], "{label}: forward after it");
        // The rest in a second call, from where the first stopped.
        got.clear();
        let rest = n - stop - 2;
        let k = model
            .decode(
                &mut [Decoding::new(&mut b, want[stop + 1], at_most(rest))],
                &mut |_, t| {
                    got.push(t);
                    true
                },
            )
            .unwrap();
        assert_eq!(
            (k, &got[..]),
            (vec![rest], &want[stop + 2..]),
            "{label} resumed"
        );

        // Room for 4 more positions: 4 tokens, then the overflow.
        b.pos = p + n - 4;
        got.clear();
        let r = model.decode(
            &mut [Decoding::new(&mut b, want[n - 5], at_most(n))],
            &mut |_, t| {
                got.push(t);
                true
            },
        );
        assert!(
            matches!(r, Err(Error::ContextOverflow { .. })),
            "{label}: {:?}",
            r.map(|_| ())
        );
        assert_eq!(got, want[n - 4..], "{label}: the tokens that fit");
        assert_eq!(b.pos, p + n);

        b.pos = p;
        let vocab = model.config.vocab_size as u32;
        let r = model.decode(
            &mut [Decoding::new(&mut b, vocab, at_most(n))],
            &mut |_, _| true,
        );
        assert!(matches!(r, Err(Error::TokenOutOfRange { .. })), "{label}");
        assert_eq!(b.pos, p);
        let r = model.decode(
            &mut [Decoding::new(&mut b, vocab, at_most(0))],
            &mut |_, _| true,
        );
        assert_eq!(r.unwrap(), vec![0]);
        assert_eq!(b.pos, p);
    }
}

/// Several sequences decoded together, one row each in every step's pass (prompts of
/// different lengths, so every row is at its own position, one sequence stopped early and
/// one given fewer tokens), against each decoded alone: the same tokens, greedy and
/// sampled with penalties, and the same positions after.
#[test]
fn sequences_decoded_together_are_each_decoded_alone() {
    use dynmoe::backend::sample::Sampling;
    use dynmoe::model::{DecodeOptions, Decoding};
    let prompts: [&[u32]; 3] = [&[5, 17, 300, 42], &[7, 99, 1000, 3, 12, 12, 40], &[1, 2]];
    let sampled = Sampling {
        temperature: 0.9,
        top_p: 0.9,
        repetition_penalty: 1.3,
        seed: 5,
        ..Sampling::GREEDY
    };
    for dir in fixture_dirs() {
        let m = model::load(&dir, Cpu::fast()).unwrap();
        let model = &m.model;
        let label = dir.display();
        for sampling in [Sampling::GREEDY, sampled] {
            let n = [9, 6, 9];
            let stop_after = [usize::MAX, usize::MAX, 4];
            let prefill = |p: &[u32]| {
                let mut s = model.new_state(p.len() + 10);
                model.forward(&mut s, &p[..p.len() - 1], 0).unwrap();
                s
            };
            // Alone.
            let mut want = Vec::new();
            for (i, p) in prompts.iter().enumerate() {
                let mut s = prefill(p);
                let mut got = Vec::new();
                let opts = DecodeOptions {
                    max_tokens: n[i],
                    sampling,
                };
                let first = p[p.len() - 1];
                model
                    .decode(&mut [Decoding::new(&mut s, first, opts)], &mut |_, t| {
                        got.push(t);
                        got.len() < stop_after[i]
                    })
                    .unwrap();
                want.push((got, s.pos));
            }
            // Together.
            let mut states: Vec<_> = prompts.iter().map(|p| prefill(p)).collect();
            let mut got = vec![Vec::new(); prompts.len()];
            let mut seqs: Vec<Decoding<'_, _>> = states
                .iter_mut()
                .zip(&prompts)
                .zip(n)
                .map(|((s, p), max_tokens)| {
                    let opts = DecodeOptions {
                        max_tokens,
                        sampling,
                    };
                    Decoding::new(s, p[p.len() - 1], opts)
                })
                .collect();
            let done = model
                .decode(&mut seqs, &mut |i, t| {
                    got[i].push(t);
                    got[i].len() < stop_after[i]
                })
                .unwrap();
            drop(seqs);
            for i in 0..prompts.len() {
                assert_eq!(got[i], want[i].0, "{label}, sequence {i}, {sampling:?}");
                assert_eq!(done[i], got[i].len());
                assert_eq!(states[i].pos, want[i].1, "{label}, sequence {i}");
            }
        }
    }
}
