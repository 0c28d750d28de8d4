//! ModelSpec: the architecture of a checkpoint, read from GGUF metadata or an HF `config.json`,
//! and the mapping of tensor names (both naming schemes) to (layer, role).

mod names;
pub use names::{expert_of, is_packed_product_part, is_quantized_part};

use serde::{Deserialize, Serialize};

use crate::Role;
use crate::{FormatError, MetaRef, MetaValue, Metadata, Result};

/// More layers than any published model has by two orders of magnitude. The per-layer KV-head
/// table is allocated from the claimed count, so the claim is capped first.
pub const MAX_LAYERS: u64 = 1 << 16;

/// The shape of a decoder-only transformer, as far as placement and loading need it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// `general.architecture` or the HF `model_type` (e.g. `"llama"`, `"qwen2"`).
    pub architecture: String,
    pub n_layers: u32,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub n_heads: u32,
    /// KV heads per layer (`n_layers` entries); GGUF allows a per-layer array.
    pub n_kv_heads: Vec<u32>,
    pub head_dim: u32,
    pub vocab_size: u64,
    pub context_length: u64,
    pub rope_theta: f64,
    /// Rotary dimensions (`rope.dimension_count`), usually `head_dim`.
    pub rope_dim: u32,
    pub rms_norm_eps: f64,
    /// True when the output projection reuses `token_embd` (no separate output tensor).
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry biases (qwen2 does).
    pub attention_bias: bool,
}

/// llama.cpp's architectures whose layers hold a recurrent state instead of attention (and
/// whose GGUF metadata has no head counts or feed-forward width). Their spec has no heads, so a
/// plan of one places the weights and no KV cache; the engine refuses to run them by name.
pub const RECURRENT_ARCHITECTURES: &[&str] =
    &["mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"];

fn spec_err(key: impl Into<String>, detail: impl Into<String>) -> FormatError {
    FormatError::Spec {
        key: key.into(),
        detail: detail.into(),
    }
}

fn to_u32(key: &str, v: u64) -> Result<u32> {
    u32::try_from(v).map_err(|_| spec_err(key, format!("expected at most {}, got {v}", u32::MAX)))
}

fn check_layers(key: &str, n: u64) -> Result<u32> {
    if n == 0 || n > MAX_LAYERS {
        return Err(spec_err(
            key,
            format!("expected 1..={MAX_LAYERS} layers, got {n}; the metadata is corrupted"),
        ));
    }
    to_u32(key, n)
}

fn positive(key: &str, v: u64) -> Result<u64> {
    if v == 0 {
        return Err(spec_err(key, "expected a positive value, got 0"));
    }
    Ok(v)
}

/// The KV-head table: a scalar for every layer, or one entry per layer.
fn kv_table(
    key: &str,
    per_layer: Option<Vec<u64>>,
    scalar: u64,
    n_layers: u32,
) -> Result<Vec<u32>> {
    let table = match per_layer {
        Some(v) => {
            if v.len() != n_layers as usize {
                return Err(spec_err(
                    key,
                    format!("expected {n_layers} per-layer entries, got {}", v.len()),
                ));
            }
            v.into_iter()
                .map(|h| to_u32(key, h))
                .collect::<Result<Vec<_>>>()?
        }
        None => vec![to_u32(key, scalar)?; n_layers as usize],
    };
    Ok(table)
}

fn default_head_dim(key: &str, hidden: u64, heads: u32) -> Result<u32> {
    if !hidden.is_multiple_of(u64::from(heads)) {
        return Err(spec_err(
            key,
            format!("missing, and the hidden size {hidden} is not divisible by {heads} heads"),
        ));
    }
    to_u32(key, hidden / u64::from(heads))
}

// ---------------------------------------------------------------------------------------------
// GGUF

fn describe_meta(v: MetaRef<'_>) -> String {
    match v {
        MetaRef::String(s) if s.len() > 40 => format!("a string of {} bytes", s.len()),
        MetaRef::String(s) => format!("the string {s:?}"),
        MetaRef::Array(a) => format!("an array of {} values", a.len()),
        MetaRef::Bool(b) => format!("the bool {b}"),
        other => format!("{other:?}"),
    }
}

struct Gguf<'a> {
    md: &'a Metadata,
    arch: &'a str,
}

impl Gguf<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn get(&self, suffix: &str) -> Option<(String, &MetaValue)> {
        let key = self.key(suffix);
        self.md.get(&key).map(|v| (key, v))
    }

    fn uint(&self, suffix: &str) -> Result<Option<u64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some((key, v)) => v.as_u64().map(Some).ok_or_else(|| {
                spec_err(
                    key,
                    format!(
                        "expected a non-negative integer, got {}",
                        describe_meta(v.view())
                    ),
                )
            }),
        }
    }

    fn req_uint(&self, suffix: &str) -> Result<u64> {
        self.uint(suffix)?.ok_or_else(|| {
            spec_err(
                self.key(suffix),
                format!(
                    "missing from the gguf metadata; the file is not a complete '{}' checkpoint",
                    self.arch
                ),
            )
        })
    }

    fn float(&self, suffix: &str) -> Result<Option<f64>> {
        match self.get(suffix) {
            None => Ok(None),
            Some((key, v)) => v.as_f64().map(Some).ok_or_else(|| {
                spec_err(
                    key,
                    format!("expected a number, got {}", describe_meta(v.view())),
                )
            }),
        }
    }

    /// The feed-forward width, query heads, KV heads per layer and head size of an attention
    /// architecture, each required (the head size defaults to `hidden / heads`).
    fn attention_shape(&self, n_layers: u32, hidden: u64) -> Result<(u64, u32, Vec<u32>, u32)> {
        let (g, arch) = (self, self.arch);
        let (ff, _) = g.uint_or_array("feed_forward_length")?.ok_or_else(|| {
            spec_err(
                g.key("feed_forward_length"),
                format!(
                    "missing from the gguf metadata; the file is not a complete '{arch}' checkpoint"
                ),
            )
        })?;
        let heads_key = g.key("attention.head_count");
        let (heads, _) = g.uint_or_array("attention.head_count")?.ok_or_else(|| {
            spec_err(
                heads_key.as_str(),
                format!(
                    "missing from the gguf metadata; the file is not a complete '{arch}' checkpoint"
                ),
            )
        })?;
        let n_heads = to_u32(&heads_key, positive(&heads_key, heads)?)?;

        let kv_key = g.key("attention.head_count_kv");
        let n_kv_heads = match g.uint_or_array("attention.head_count_kv")? {
            Some((scalar, per_layer)) => kv_table(&kv_key, per_layer, scalar, n_layers)?,
            None => kv_table(&kv_key, None, heads, n_layers)?,
        };

        let hd_key = g.key("attention.key_length");
        let head_dim = match g.uint("attention.key_length")? {
            Some(v) => to_u32(&hd_key, positive(&hd_key, v)?)?,
            None => default_head_dim(&hd_key, hidden, n_heads)?,
        };
        Ok((ff, n_heads, n_kv_heads, head_dim))
    }

    /// A scalar, or a per-layer array (returned as its entries).
    fn uint_or_array(&self, suffix: &str) -> Result<Option<(u64, Option<Vec<u64>>)>> {
        let Some((key, v)) = self.get(suffix) else {
            return Ok(None);
        };
        if let Some(arr) = v.as_array() {
            let vals = arr
                .iter()
                .map(|e| {
                    e.as_u64().ok_or_else(|| {
                        spec_err(
                            key.as_str(),
                            format!(
                                "expected an array of non-negative integers, got an element {}",
                                describe_meta(e)
                            ),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let max = vals.iter().copied().max().ok_or_else(|| {
                spec_err(
                    key.as_str(),
                    "expected a per-layer array, got an empty array",
                )
            })?;
            return Ok(Some((max, Some(vals))));
        }
        v.as_u64().map(|x| Some((x, None))).ok_or_else(|| {
            spec_err(
                key,
                format!(
                    "expected an integer or a per-layer array, got {}",
                    describe_meta(v.view())
                ),
            )
        })
    }
}

impl ModelSpec {
    /// Read the architecture from GGUF metadata, as llama.cpp's loader does
    /// (`llm_load_hparams`).
    ///
    /// `tie_word_embeddings` and `attention_bias` cannot be read from metadata: they are left
    /// `false` here and decided from the tensor table when the checkpoint is assembled.
    pub fn from_gguf(metadata: &Metadata) -> Result<ModelSpec> {
        let arch = match metadata.get("general.architecture") {
            Some(MetaValue::String(s)) if !s.is_empty() => s.as_str(),
            Some(v) => {
                return Err(spec_err(
                    "general.architecture",
                    format!(
                        "expected a non-empty string, got {}",
                        describe_meta(v.view())
                    ),
                ));
            }
            None => {
                return Err(spec_err(
                    "general.architecture",
                    "missing from the gguf metadata, so the architecture is unknown",
                ));
            }
        };
        let g = Gguf { md: metadata, arch };

        let n_layers = check_layers(&g.key("block_count"), g.req_uint("block_count")?)?;
        let hidden = positive(&g.key("embedding_length"), g.req_uint("embedding_length")?)?;
        let (ff, n_heads, n_kv_heads, head_dim) = if RECURRENT_ARCHITECTURES.contains(&arch) {
            // no attention and no separate feed-forward width to read
            let ff = g
                .uint_or_array("feed_forward_length")?
                .map_or(0, |(ff, _)| ff);
            (ff, 0, vec![0; n_layers as usize], 0)
        } else {
            g.attention_shape(n_layers, hidden)?
        };

        let vocab_key = g.key("vocab_size");
        let vocab_size = match g.uint("vocab_size")? {
            Some(v) => v,
            None => match metadata.get("tokenizer.ggml.tokens") {
                Some(MetaValue::Array(a)) => a.len() as u64,
                Some(v) => {
                    return Err(spec_err(
                        "tokenizer.ggml.tokens",
                        format!(
                            "expected an array of tokens, got {}",
                            describe_meta(v.view())
                        ),
                    ));
                }
                None => {
                    return Err(spec_err(
                        vocab_key,
                        "missing, and there is no tokenizer.ggml.tokens array to count",
                    ));
                }
            },
        };

        let context_length = g.req_uint("context_length")?;
        // llama.cpp's default when the key is absent.
        let rope_theta = g.float("rope.freq_base")?.unwrap_or(10_000.0);
        let rd_key = g.key("rope.dimension_count");
        let rope_dim = match g.uint("rope.dimension_count")? {
            Some(v) => to_u32(&rd_key, v)?,
            None => head_dim,
        };
        let rms_norm_eps = match g.float("attention.layer_norm_rms_epsilon")? {
            Some(v) => v,
            None => g.float("attention.layer_norm_epsilon")?.ok_or_else(|| {
                spec_err(
                    g.key("attention.layer_norm_rms_epsilon"),
                    format!(
                        "missing from the gguf metadata (and no {} either)",
                        g.key("attention.layer_norm_epsilon")
                    ),
                )
            })?,
        };

        Ok(ModelSpec {
            architecture: arch.to_owned(),
            n_layers,
            hidden_size: hidden,
            intermediate_size: ff,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length,
            rope_theta,
            rope_dim,
            rms_norm_eps,
            tie_word_embeddings: false,
            attention_bias: false,
        })
    }

    /// Read the architecture from an HF `config.json`, with transformers' defaults for the
    /// llama family where a key is optional. Both `rope_theta` and transformers 5's
    /// `rope_parameters.rope_theta` are accepted (the latter wins). Multimodal configs that nest
    /// the language model under `text_config` are read from there.
    pub fn from_hf_config(config: &serde_json::Value) -> Result<ModelSpec> {
        let Some(top) = config.as_object() else {
            return Err(spec_err(
                "config.json",
                format!("expected a json object, got {}", json_kind(config)),
            ));
        };
        let model_type = match top.get("model_type") {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                return Err(spec_err(
                    "model_type",
                    format!("expected a non-empty string, got {}", json_kind(v)),
                ));
            }
            None => {
                return Err(spec_err(
                    "model_type",
                    "missing from config.json, so the architecture is unknown",
                ));
            }
        };
        let c = match top.get("text_config") {
            Some(serde_json::Value::Object(t)) if !top.contains_key("num_hidden_layers") => t,
            _ => top,
        };
        let get = |k: &str| c.get(k).filter(|v| !v.is_null());
        let uint = |k: &str| -> Result<Option<u64>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    spec_err(
                        k,
                        format!("expected a non-negative integer, got {}", json_kind(v)),
                    )
                }),
            }
        };
        let req = |k: &str| -> Result<u64> {
            uint(k)?.ok_or_else(|| spec_err(k, "missing from config.json"))
        };
        let float = |k: &str, v: Option<&serde_json::Value>| -> Result<Option<f64>> {
            match v {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| spec_err(k, format!("expected a number, got {}", json_kind(v)))),
            }
        };
        let boolean = |k: &str| -> Result<Option<bool>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                    spec_err(k, format!("expected true or false, got {}", json_kind(v)))
                }),
            }
        };

        let n_layers = check_layers("num_hidden_layers", req("num_hidden_layers")?)?;
        let hidden = positive("hidden_size", req("hidden_size")?)?;
        let ff = req("intermediate_size")?;
        let n_heads = to_u32(
            "num_attention_heads",
            positive("num_attention_heads", req("num_attention_heads")?)?,
        )?;
        let kv = uint("num_key_value_heads")?.unwrap_or(u64::from(n_heads));
        let n_kv_heads = kv_table("num_key_value_heads", None, kv, n_layers)?;
        let head_dim = match uint("head_dim")? {
            Some(v) => to_u32("head_dim", positive("head_dim", v)?)?,
            None => default_head_dim("head_dim", hidden, n_heads)?,
        };
        let vocab_size = req("vocab_size")?;
        let context_length = match uint("max_position_embeddings")? {
            Some(v) => v,
            None => uint("n_positions")?
                .ok_or_else(|| spec_err("max_position_embeddings", "missing from config.json"))?,
        };
        // gemma3 keeps one set of parameters per attention type; the global layers' is the
        // model's base (as the GGUF converter writes it)
        let rope_params = get("rope_parameters").and_then(|p| {
            p.get("rope_theta")
                .or_else(|| p.get("full_attention").and_then(|f| f.get("rope_theta")))
        });
        let rope_theta = match float("rope_parameters.rope_theta", rope_params)? {
            Some(v) => v,
            // transformers' LlamaConfig default.
            None => float("rope_theta", get("rope_theta"))?.unwrap_or(10_000.0),
        };
        // transformers 5 keeps the factor under `rope_parameters` (Phi-3/4), 4 at the top level.
        let partial = get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| get("partial_rotary_factor"));
        let rope_dim = match float("partial_rotary_factor", partial)? {
            Some(f) if f > 0.0 && f <= 1.0 => (f64::from(head_dim) * f) as u32,
            Some(f) => {
                return Err(spec_err(
                    "partial_rotary_factor",
                    format!("expected a fraction in (0, 1], got {f}"),
                ));
            }
            None => head_dim,
        };
        // transformers' default for llama, mistral and qwen2.
        let rms_norm_eps = float("rms_norm_eps", get("rms_norm_eps"))?.unwrap_or(1e-6);
        // PretrainedConfig defaults to tied, but LlamaConfig, MistralConfig and Qwen2Config set
        // it false; the llama family is what we read.
        // Gemma's configs keep PretrainedConfig's tied default.
        let tie_word_embeddings =
            boolean("tie_word_embeddings")?.unwrap_or(names::is_gemma(&model_type));
        // Qwen2 has q/k/v biases and no `attention_bias` key.
        let attention_bias = boolean("attention_bias")?.unwrap_or(model_type == "qwen2");

        Ok(ModelSpec {
            architecture: model_type,
            n_layers,
            hidden_size: hidden,
            intermediate_size: ff,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            context_length,
            rope_theta,
            rope_dim,
            rms_norm_eps,
            tie_word_embeddings,
            attention_bias,
        })
    }

    /// Architectures whose tensor roles are known.
    pub const SUPPORTED_ARCHITECTURES: &'static [&'static str] = names::SUPPORTED_ARCHITECTURES;

    /// Whether tensor roles are known for `architecture` (llama, mistral, qwen2, qwen3, phi3,
    /// gemma2, gemma3).
    pub fn supports_roles(architecture: &str) -> bool {
        names::supports_roles(architecture)
    }

    /// Whether every layer norms each query and key head before RoPE (qwen3's `q_norm` and
    /// `k_norm`, `head_dim` long): the layers then need those two tensors.
    pub fn per_head_qk_norm(&self) -> bool {
        names::per_head_qk_norm(&self.architecture)
    }

    /// Whether every layer norms the attention's output and the MLP's output before each
    /// residual add (Gemma 2 and 3): the layers then hold `post_attention_norm` and
    /// `post_ffw_norm` beside the two pre-norms.
    pub fn post_norms(&self) -> bool {
        names::is_gemma(&self.architecture)
    }

    /// Whether the layers hold q, k and v as one `qkv` matrix and gate and up as one `gate_up`
    /// matrix (phi3: Phi-3 and Phi-4), stacked by rows in that order.
    pub fn fused_projections(&self) -> bool {
        names::fused_projections(&self.architecture)
    }

    /// Whether a GGUF of this architecture pairs adjacent RoPE dimensions (llama.cpp's
    /// converter permuted its q/k rows: llama, mistral) rather than rotating halves.
    pub fn gguf_adjacent_rope(&self) -> bool {
        names::gguf_adjacent_rope(&self.architecture)
    }

    /// (layer, role) of a tensor name in either naming scheme (`blk.N.attn_q.weight`,
    /// `model.layers.N.self_attn.q_proj.weight`). The layer is parsed for every architecture;
    /// the role only for supported ones, and is `None` for a name that matches no role.
    pub fn classify(name: &str, architecture: &str) -> (Option<u32>, Option<Role>) {
        names::classify(name, architecture)
    }

    /// KV heads of one layer (the first entry when `layer` is out of range).
    pub fn n_kv_heads_at(&self, layer: u32) -> u32 {
        self.n_kv_heads
            .get(layer as usize)
            .or_else(|| self.n_kv_heads.first())
            .copied()
            .unwrap_or(self.n_heads)
    }
}

/// Most experts a layer may have (the largest released models have 384): a cap on what a file
/// can make the loader build.
pub const MAX_EXPERTS: u64 = 1 << 12;

/// How a mixture-of-experts layer routes its tokens: each token's `n_used` experts of
/// `n_experts` are those of the highest router scores, and their outputs are summed weighted by
/// the softmax of all the scores at the chosen experts, renormalised to sum to 1 when
/// `norm_topk_prob`. (transformers' Mixtral router: softmax, top-k, renormalise, which is a
/// softmax over the chosen logits; its Qwen3-MoE router: softmax, top-k, renormalise only when
/// `norm_topk_prob`. llama.cpp's `build_moe_ffn` with softmax gating and `norm_w`.)
///
/// `dense_layers` are the layers that run a plain MLP of `intermediate_size` instead, as a
/// Qwen2-MoE or Qwen3-MoE config may make some (see [`MoeSpec::from_hf_config`]); every other
/// layer routes. Empty for every released Qwen3-MoE and Mixtral, and for GGUF, whose metadata
/// has no such key (a GGUF's layers are what its tensors say).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub n_experts: u32,
    pub n_used: u32,
    /// The width of each expert's feed-forward block.
    pub expert_ffn: u64,
    pub norm_topk_prob: bool,
    /// Layers with a dense MLP, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<u32>,
}

impl MoeSpec {
    fn checked(key: &str, n_experts: u64, n_used: u64, expert_ffn: u64) -> Result<MoeSpec> {
        if n_experts > MAX_EXPERTS {
            return Err(spec_err(
                key,
                format!(
                    "expected at most {MAX_EXPERTS} experts, got {n_experts}; the metadata is corrupted"
                ),
            ));
        }
        if n_used == 0 || n_used > n_experts {
            return Err(spec_err(
                key,
                format!("expected 1..={n_experts} experts used per token, got {n_used}"),
            ));
        }
        Ok(MoeSpec {
            n_experts: n_experts as u32,
            n_used: n_used as u32,
            expert_ffn: positive(key, expert_ffn)?,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        })
    }

    /// Whether layer `layer` routes its tokens to experts (it is not one of `dense_layers`).
    pub fn routes(&self, layer: u32) -> bool {
        self.dense_layers.binary_search(&layer).is_err()
    }

    /// The routing of a GGUF's layers, as llama.cpp reads it (`{arch}.expert_count`,
    /// `expert_used_count`, `expert_feed_forward_length`, else `feed_forward_length`); `None`
    /// for a dense model. llama.cpp renormalises the chosen weights for every architecture but
    /// qwen2moe, unless `{arch}.expert_weights_norm` says otherwise.
    pub fn from_gguf(metadata: &Metadata) -> Result<Option<MoeSpec>> {
        let Some(MetaValue::String(arch)) = metadata.get("general.architecture") else {
            return Ok(None);
        };
        let g = Gguf { md: metadata, arch };
        let n = match g.uint("expert_count")? {
            None | Some(0) => return Ok(None),
            Some(n) => n,
        };
        let used = g.req_uint("expert_used_count")?;
        let ffn = match g.uint("expert_feed_forward_length")? {
            Some(v) => v,
            None => g.req_uint("feed_forward_length")?,
        };
        let mut m = Self::checked(&g.key("expert_used_count"), n, used, ffn)?;
        m.norm_topk_prob = match g.get("expert_weights_norm") {
            Some((_, MetaValue::Bool(b))) => *b,
            Some((key, v)) => {
                return Err(spec_err(
                    key,
                    format!("expected true or false, got {}", describe_meta(v.view())),
                ));
            }
            None => arch != "qwen2moe",
        };
        Ok(Some(m))
    }

    /// The routing of an HF checkpoint's layers (`num_local_experts` or `num_experts`,
    /// `num_experts_per_tok`, `moe_intermediate_size` else `intermediate_size`,
    /// `norm_topk_prob`); `None` for a dense model. Mixtral always renormalises; the Qwen MoE
    /// configs default `norm_topk_prob` to false, as transformers does.
    ///
    /// The Qwen MoE configs may give some layers a dense MLP: transformers' Qwen2-MoE and
    /// Qwen3-MoE decoder layers route when `(i + 1) % decoder_sparse_step == 0` and `i` is not
    /// in `mlp_only_layers` (defaults 1 and none: every layer routes), and those rules make
    /// `dense_layers`. Mixtral's layers all route, whatever its config says. A config whose
    /// every layer is dense is a dense model (`None`).
    pub fn from_hf_config(config: &serde_json::Value) -> Result<Option<MoeSpec>> {
        let c = match config.get("text_config") {
            Some(t @ serde_json::Value::Object(_)) if config.get("num_hidden_layers").is_none() => {
                t
            }
            _ => config,
        };
        let uint = |k: &str| -> Result<Option<u64>> {
            match c.get(k).filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                    spec_err(
                        k,
                        format!("expected a non-negative integer, got {}", json_kind(v)),
                    )
                }),
            }
        };
        let (key, n) = match (uint("num_local_experts")?, uint("num_experts")?) {
            (Some(n), _) => ("num_local_experts", n),
            (None, Some(n)) => ("num_experts", n),
            (None, None) => return Ok(None),
        };
        if n == 0 {
            return Ok(None);
        }
        let used = uint("num_experts_per_tok")?.ok_or_else(|| {
            spec_err(
                "num_experts_per_tok",
                format!("missing from config.json, which has {key} {n}"),
            )
        })?;
        let ffn = match uint("moe_intermediate_size")? {
            Some(v) => v,
            None => uint("intermediate_size")?
                .ok_or_else(|| spec_err("intermediate_size", "missing from config.json"))?,
        };
        let mut m = Self::checked("num_experts_per_tok", n, used, ffn)?;
        let mixtral = c.get("model_type").and_then(|v| v.as_str()) == Some("mixtral");
        if !mixtral {
            m.dense_layers = dense_layers(c)?;
            let n_layers = uint("num_hidden_layers")?.unwrap_or(0);
            if n_layers > 0 && m.dense_layers.len() as u64 >= n_layers {
                return Ok(None);
            }
        }
        m.norm_topk_prob = match c.get("norm_topk_prob").filter(|v| !v.is_null()) {
            _ if mixtral => true,
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                spec_err(
                    "norm_topk_prob",
                    format!("expected true or false, got {}", json_kind(v)),
                )
            })?,
        };
        Ok(Some(m))
    }
}

/// The layers of a Qwen MoE config that run a dense MLP (see [`MoeSpec::from_hf_config`]):
/// those `i < num_hidden_layers` where `(i + 1) % decoder_sparse_step != 0` or `i` is in
/// `mlp_only_layers`, ascending.
fn dense_layers(c: &serde_json::Value) -> Result<Vec<u32>> {
    let get = |k: &str| c.get(k).filter(|v| !v.is_null());
    let step = match get("decoder_sparse_step") {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(s) if s > 0 => s,
            _ => {
                return Err(spec_err(
                    "decoder_sparse_step",
                    format!("expected a positive integer, got {}", json_kind(v)),
                ));
            }
        },
    };
    let only: std::collections::BTreeSet<u64> = match get("mlp_only_layers") {
        None => Default::default(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    spec_err(
                        "mlp_only_layers",
                        format!("expected layer indices, got {}", json_kind(v)),
                    )
                })
            })
            .collect::<Result<_>>()?,
        Some(v) => {
            return Err(spec_err(
                "mlp_only_layers",
                format!("expected a list of layer indices, got {}", json_kind(v)),
            ));
        }
    };
    if step == 1 && only.is_empty() {
        return Ok(Vec::new());
    }
    let n_layers = match get("num_hidden_layers").and_then(serde_json::Value::as_u64) {
        Some(n) => check_layers("num_hidden_layers", n)?,
        None => return Err(spec_err("num_hidden_layers", "missing from config.json")),
    };
    Ok((0..n_layers)
        .filter(|&i| !(u64::from(i) + 1).is_multiple_of(step) || only.contains(&u64::from(i)))
        .collect())
}

fn json_kind(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "null".into(),
        serde_json::Value::Bool(b) => format!("the bool {b}"),
        serde_json::Value::Number(n) => format!("the number {n}"),
        serde_json::Value::String(s) if s.len() > 40 => format!("a string of {} bytes", s.len()),
        serde_json::Value::String(s) => format!("the string {s:?}"),
        serde_json::Value::Array(a) => format!("an array of {} values", a.len()),
        serde_json::Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The routing keys as llama.cpp's converter writes them and as transformers' configs
    /// name them, with their defaults and caps.
    #[test]
    fn moe_spec_from_gguf_and_config() {
        let q = md(&[
            ("general.architecture", MetaValue::String("qwen3moe".into())),
            ("qwen3moe.expert_count", MetaValue::U32(128)),
            ("qwen3moe.expert_used_count", MetaValue::U32(8)),
            ("qwen3moe.expert_feed_forward_length", MetaValue::U32(768)),
            ("qwen3moe.feed_forward_length", MetaValue::U32(6144)),
        ]);
        let want = MoeSpec {
            n_experts: 128,
            n_used: 8,
            expert_ffn: 768,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        };
        assert_eq!(MoeSpec::from_gguf(&q).unwrap(), Some(want));
        let dense = md(&[("general.architecture", MetaValue::String("llama".into()))]);
        assert_eq!(MoeSpec::from_gguf(&dense).unwrap(), None);
        let q2 = md(&[
            ("general.architecture", MetaValue::String("qwen2moe".into())),
            ("qwen2moe.expert_count", MetaValue::U32(60)),
            ("qwen2moe.expert_used_count", MetaValue::U32(4)),
            ("qwen2moe.feed_forward_length", MetaValue::U32(5632)),
        ]);
        assert!(!MoeSpec::from_gguf(&q2).unwrap().unwrap().norm_topk_prob);
        let bad = md(&[
            ("general.architecture", MetaValue::String("llama".into())),
            ("llama.expert_count", MetaValue::U32(8)),
            ("llama.expert_used_count", MetaValue::U32(9)),
            ("llama.feed_forward_length", MetaValue::U32(14336)),
        ]);
        let e = MoeSpec::from_gguf(&bad).unwrap_err().to_string();
        assert!(
            e.contains("llama.expert_used_count") && e.contains("1..=8"),
            "{e}"
        );

        let mixtral = serde_json::json!({"model_type": "mixtral", "num_local_experts": 8,
            "num_experts_per_tok": 2, "intermediate_size": 14336, "norm_topk_prob": false});
        let m = MoeSpec::from_hf_config(&mixtral).unwrap().unwrap();
        assert_eq!((m.n_experts, m.n_used, m.expert_ffn), (8, 2, 14336));
        assert!(m.norm_topk_prob, "mixtral always renormalises");
        let qwen = serde_json::json!({"model_type": "qwen3_moe", "num_experts": 128,
            "num_experts_per_tok": 8, "intermediate_size": 6144, "moe_intermediate_size": 768});
        let m = MoeSpec::from_hf_config(&qwen).unwrap().unwrap();
        assert_eq!((m.expert_ffn, m.norm_topk_prob), (768, false));
        assert!(
            m.dense_layers.is_empty() && m.routes(0),
            "every layer routes by default"
        );
        // transformers' rule: sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
        // mlp_only_layers
        let mixed = serde_json::json!({"model_type": "qwen3_moe", "num_experts": 4,
            "num_experts_per_tok": 2, "intermediate_size": 64, "moe_intermediate_size": 32,
            "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3, 9]});
        let m = MoeSpec::from_hf_config(&mixed).unwrap().unwrap();
        assert_eq!(m.dense_layers, [0, 2, 3, 4]);
        assert_eq!(
            (0..6).map(|l| m.routes(l)).collect::<Vec<_>>(),
            [false, true, false, false, false, true]
        );
        let mut all_dense = mixed.clone();
        all_dense["mlp_only_layers"] = json!([1, 3, 5]);
        assert_eq!(MoeSpec::from_hf_config(&all_dense).unwrap(), None);
        let mut mixtral_keys = mixtral.clone();
        mixtral_keys["decoder_sparse_step"] = json!(2);
        mixtral_keys["num_hidden_layers"] = json!(4);
        let m = MoeSpec::from_hf_config(&mixtral_keys).unwrap().unwrap();
        assert!(m.dense_layers.is_empty(), "mixtral's layers all route");
        for (key, bad, said) in [
            (
                "decoder_sparse_step",
                json!(0),
                "expected a positive integer, got the number 0",
            ),
            (
                "mlp_only_layers",
                json!(3),
                "expected a list of layer indices, got the number 3",
            ),
            (
                "mlp_only_layers",
                json!(["a"]),
                "expected layer indices, got the string \"a\"",
            ),
        ] {
            let mut c = mixed.clone();
            c[key] = bad;
            let e = MoeSpec::from_hf_config(&c).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(said), "{e}");
        }
        let llama = serde_json::json!({"model_type": "llama", "intermediate_size": 1});
        assert_eq!(MoeSpec::from_hf_config(&llama).unwrap(), None);
        let huge = serde_json::json!({"num_experts": 1u64 << 40, "num_experts_per_tok": 2,
            "intermediate_size": 8});
        let e = MoeSpec::from_hf_config(&huge).unwrap_err().to_string();
        assert!(e.contains("at most 4096 experts"), "{e}");
    }

    fn md(pairs: &[(&str, MetaValue)]) -> Metadata {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    #[test]
    fn gguf_per_layer_kv_heads_and_defaults() {
        let m = md(&[
            ("general.architecture", MetaValue::String("llama".into())),
            ("llama.block_count", MetaValue::U32(3)),
            ("llama.embedding_length", MetaValue::U32(64)),
            ("llama.feed_forward_length", MetaValue::U32(128)),
            ("llama.attention.head_count", MetaValue::U32(4)),
            (
                "llama.attention.head_count_kv",
                MetaValue::Array(
                    vec![MetaValue::I32(1), MetaValue::I32(2), MetaValue::I32(4)].into(),
                ),
            ),
            ("llama.context_length", MetaValue::U64(256)),
            (
                "llama.attention.layer_norm_rms_epsilon",
                MetaValue::F32(1e-5),
            ),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array(vec![MetaValue::String("a".into()); 7].into()),
            ),
        ]);
        let s = ModelSpec::from_gguf(&m).unwrap();
        assert_eq!(s.n_kv_heads, vec![1, 2, 4]);
        assert_eq!(s.head_dim, 16);
        assert_eq!(s.rope_dim, 16);
        assert_eq!(s.vocab_size, 7);
        assert_eq!(s.rope_theta, 10_000.0);
    }

    #[test]
    fn gguf_errors_name_the_key() {
        let mut m = md(&[
            ("general.architecture", MetaValue::String("qwen2".into())),
            ("qwen2.block_count", MetaValue::U64(u64::MAX)),
        ]);
        let e = ModelSpec::from_gguf(&m).unwrap_err().to_string();
        assert!(
            e.contains("qwen2.block_count") && e.contains("corrupted"),
            "{e}"
        );
        m.insert("qwen2.block_count".into(), MetaValue::U32(2));
        let e = ModelSpec::from_gguf(&m).unwrap_err().to_string();
        assert!(
            e.contains("qwen2.embedding_length") && e.contains("missing"),
            "{e}"
        );
        m.insert(
            "qwen2.embedding_length".into(),
            MetaValue::String("x".into()),
        );
        let e = ModelSpec::from_gguf(&m).unwrap_err().to_string();
        assert!(e.contains("non-negative integer"), "{e}");
        let e = ModelSpec::from_gguf(&Metadata::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("general.architecture"), "{e}");
    }

    #[test]
    fn gguf_kv_array_length_must_match_layers() {
        let m = md(&[
            ("general.architecture", MetaValue::String("llama".into())),
            ("llama.block_count", MetaValue::U32(3)),
            ("llama.embedding_length", MetaValue::U32(64)),
            ("llama.feed_forward_length", MetaValue::U32(128)),
            ("llama.attention.head_count", MetaValue::U32(4)),
            (
                "llama.attention.head_count_kv",
                MetaValue::Array(vec![MetaValue::U32(1)].into()),
            ),
        ]);
        let e = ModelSpec::from_gguf(&m).unwrap_err().to_string();
        assert!(
            e.contains("head_count_kv") && e.contains("expected 3 per-layer"),
            "{e}"
        );
    }

    #[test]
    fn hf_partial_rotary_at_the_top_or_under_rope_parameters() {
        let mut c = json!({
            "model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 192, "num_attention_heads": 4, "vocab_size": 320,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}
        });
        let s = ModelSpec::from_hf_config(&c).unwrap();
        assert_eq!((s.head_dim, s.rope_dim), (16, 8));
        assert!(s.fused_projections() && !s.per_head_qk_norm());
        let top = c.as_object_mut().unwrap();
        top.remove("rope_parameters");
        top.insert("partial_rotary_factor".into(), json!(0.75));
        assert_eq!(ModelSpec::from_hf_config(&c).unwrap().rope_dim, 12);
    }

    #[test]
    fn hf_defaults_and_rope_parameters() {
        let c = json!({
            "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "vocab_size": 100,
            "max_position_embeddings": 64, "rope_parameters": {"rope_theta": 1e6},
            "rope_theta": 5.0
        });
        let s = ModelSpec::from_hf_config(&c).unwrap();
        assert_eq!(s.n_kv_heads, vec![4, 4]);
        assert_eq!(s.head_dim, 32);
        assert_eq!(s.rope_theta, 1e6);
        assert!(s.attention_bias);
        assert!(!s.tie_word_embeddings);
        let mut c2 = c.clone();
        c2.as_object_mut().unwrap().remove("rope_parameters");
        assert_eq!(ModelSpec::from_hf_config(&c2).unwrap().rope_theta, 5.0);
        c2.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelSpec::from_hf_config(&c2).unwrap_err().to_string();
        assert_eq!(e, "model spec: hidden_size: missing from config.json");
        let e = ModelSpec::from_hf_config(&json!([1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected a json object"), "{e}");
    }
}
