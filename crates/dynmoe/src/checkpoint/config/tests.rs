//! `config.json` as published models and both transformers versions write it, and
//! the errors bad values get.

use super::*;

fn resolve(text: &str) -> Result<Config, Error> {
    Config::from_json(text, Path::new("config.json"))
}

const QWEN3_V4: &str = r#"{
    "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1000000.0,
    "rope_scaling": null, "torch_dtype": "bfloat16", "moe_intermediate_size": 8,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
    "mlp_only_layers": [1], "eos_token_id": 7, "some_future_key": {"x": 1}
}"#;

#[test]
fn reads_transformers_4_style() {
    let c = resolve(QWEN3_V4).unwrap();
    assert_eq!(c.arch, Arch::Qwen3Moe);
    assert_eq!(c.head_dim, 16);
    assert_eq!(c.rope.theta, 1e6);
    assert_eq!(c.dtype, "bfloat16");
    assert_eq!(c.layers[1].ffn, FfnKind::Dense { intermediate: 64 });
    assert_eq!(c.layers[0].ffn, FfnKind::Moe);
    assert_eq!(c.moe.router, Router::SoftmaxTopK { renormalize: true });
    assert_eq!(c.eos_token_ids, vec![7]);
    assert_eq!(c.qk_norm, QkNorm::PerHead);
}

#[test]
fn reads_transformers_5_style() {
    let text = QWEN3_V4.replace(r#""rope_theta": 1000000.0,"#, "").replace(
        r#""rope_scaling": null, "torch_dtype": "bfloat16""#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "dtype": "float32""#,
    );
    let c = resolve(&text).unwrap();
    assert_eq!(c.rope.theta, 5000.0);
    assert_eq!(c.dtype, "float32");
}

#[test]
fn unsupported_model_type_is_named() {
    let err = resolve(&QWEN3_V4.replace("qwen3_moe", "qwen3_next")).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("qwen3_next") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn missing_field_is_named() {
    let err = resolve(&QWEN3_V4.replace(r#""num_experts": 8,"#, "")).unwrap_err();
    assert!(err.to_string().contains("num_experts"), "{err}");
}

#[test]
fn malformed_json_is_an_error() {
    let err = resolve("{\"model_type\": ").unwrap_err();
    assert!(matches!(err, Error::Json { .. }), "{err}");
}

#[test]
fn unsupported_rope_scaling_is_refused() {
    let text = QWEN3_V4.replace(
        r#""rope_scaling": null"#,
        r#""rope_scaling": {"type": "yarn", "factor": 4.0}"#,
    );
    let err = resolve(&text).unwrap_err();
    assert!(err.to_string().contains("yarn"), "{err}");
}

#[test]
fn inconsistent_heads_are_refused() {
    let err =
        resolve(&QWEN3_V4.replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#))
            .unwrap_err();
    assert!(err.to_string().contains("num_key_value_heads"), "{err}");
}

#[test]
fn mixtral_uses_local_experts_and_renormalises() {
    let text = r#"{"model_type": "mixtral", "vocab_size": 10, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}"#;
    let c = resolve(text).unwrap();
    assert_eq!(c.moe.num_experts, 4);
    assert_eq!(c.moe.expert_intermediate, 32);
    assert_eq!(c.moe.router, Router::SoftmaxTopK { renormalize: true });
    assert_eq!(c.layers[0].sliding_window, Some(8));
    assert_eq!(c.rms_norm_eps, 1e-5);
}
// GLM-4.5-Air's config.json as published (transformers 4.x style), cut down.
const GLM45_AIR: &str = r#"{
    "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "num_hidden_layers": 4, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "rope_theta": 1000000, "attention_bias": true, "use_qk_norm": false,
    "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 1, "eos_token_id": [151329, 151336, 151338]
}"#;

#[test]
fn reads_glm_4_5() {
    let c = resolve(GLM45_AIR).unwrap();
    assert_eq!(c.arch, Arch::Glm4Moe);
    assert_eq!(c.rope.rotary_dim, 64);
    assert_eq!(
        c.layers[0].ffn,
        FfnKind::Dense {
            intermediate: 10944
        }
    );
    assert!(c.layers[1..].iter().all(|l| l.ffn == FfnKind::Moe));
    assert_eq!(c.moe.num_experts, 128);
    assert_eq!(c.moe.shared_expert_intermediate, Some(1408));
    assert_eq!(
        c.moe.router,
        Router::SigmoidGroups {
            groups: 1,
            top_groups: 1,
            renormalize: true,
            scale: 1.0
        }
    );
    assert!(c.qkv_bias && !c.o_bias);
    assert_eq!(c.qk_norm, QkNorm::None);
    // transformers 5.x keeps the factor in rope_parameters.
    let v5 = GLM45_AIR.replace(r#""partial_rotary_factor": 0.5,"#, "").replace(
        r#""rope_theta": 1000000,"#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},"#,
    );
    assert_eq!(resolve(&v5).unwrap().rope.rotary_dim, 32);
}

#[test]
fn bad_expert_groups_are_named() {
    for (from, to, field) in [
        (r#""n_group": 1"#, r#""n_group": 3"#, "n_group"),
        (r#""n_group": 1"#, r#""n_group": 128"#, "n_group"),
        (r#""topk_group": 1"#, r#""topk_group": 2"#, "topk_group"),
        (
            r#""routed_scaling_factor": 1.0"#,
            r#""routed_scaling_factor": -2.5"#,
            "routed_scaling_factor",
        ),
        (
            r#""partial_rotary_factor": 0.5"#,
            r#""partial_rotary_factor": 0.0"#,
            "partial_rotary_factor",
        ),
    ] {
        let err = resolve(&GLM45_AIR.replace(from, to)).unwrap_err();
        assert!(err.to_string().contains(field), "{to}: {err}");
    }
    // Eight experts from one group of four cannot be chosen.
    let err = resolve(&GLM45_AIR.replace(r#""n_group": 1"#, r#""n_group": 32"#)).unwrap_err();
    assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
}
// DeepSeek-V3's config.json as published (transformers 4.x style), cut to 5 layers.
const DEEPSEEK_V3: &str = r#"{
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 5,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": true,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": false, "tie_word_embeddings": false, "eos_token_id": 1
}"#;

#[test]
fn reads_deepseek_v3() {
    let c = resolve(DEEPSEEK_V3).unwrap();
    assert_eq!(c.arch, Arch::DeepseekV3);
    let m = c.mla.unwrap();
    assert_eq!(
        (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
        (Some(1536), 512, 128)
    );
    assert!(m.interleaved);
    assert_eq!(
        (c.head_dim, c.num_kv_heads, c.rope.rotary_dim),
        (576, 1, 64)
    );
    let y = c.rope.yarn.unwrap();
    assert_eq!(
        (y.factor, y.original_max_position_embeddings),
        (40.0, 4096.0)
    );
    assert_eq!(c.moe_layers().collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(
        c.moe.router,
        Router::SigmoidGroups {
            groups: 8,
            top_groups: 4,
            renormalize: true,
            scale: 2.5
        }
    );
    assert_eq!(c.moe.shared_expert_intermediate, Some(2048));
    // The latent cache: 2 × 576 f32 a layer, against 128 heads × (192 + 128) expanded.
    assert_eq!(c.kv_cache_bytes_per_position(), 5 * 2 * 576 * 4);
    assert_eq!(c.expanded_kv_bytes_per_position(), Some(5 * 128 * 320 * 4));
    // Latent attention expands one key per query head; biases are not supported.
    for (from, to, field) in [
        (
            r#""num_key_value_heads": 128"#,
            r#""num_key_value_heads": 8"#,
            "num_key_value_heads",
        ),
        (
            r#""attention_bias": false"#,
            r#""attention_bias": true"#,
            "attention_bias",
        ),
        (r#""kv_lora_rank": 512,"#, "", "kv_lora_rank"),
        (
            r#""original_max_position_embeddings": 4096,"#,
            "",
            "rope_scaling",
        ),
    ] {
        let err = resolve(&DEEPSEEK_V3.replace(from, to)).unwrap_err();
        assert!(err.to_string().contains(field), "{to}: {err}");
    }
}
