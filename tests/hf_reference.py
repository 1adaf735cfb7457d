"""Reference numbers from ``transformers`` for the Hugging Face parity tests (runs in .venv-torch).

Not a test module: ``tests/test_hf.py`` runs it in the Python 3.11 + CPU torch environment built by
``scripts/setup_torch_ref.sh`` (megatrain-jax itself needs Python 3.12, where no cheap CPU torch
exists), and compares with what megatrain-jax computes.

    python tests/hf_reference.py make OUT_DIR
        For every variant: a tiny random fp32 model saved with save_pretrained(safe_serialization=True)
        in OUT_DIR/<variant>/hf, and OUT_DIR/<variant>/ref.npz with the input tokens, the logits,
        the loss (labels = the tokens, shifted inside transformers) and every parameter's gradient
        (``grad:<name>``) after ``loss.backward()``.
    python tests/hf_reference.py make-families OUT_DIR
        The same for the ``FAMILIES`` variants (Qwen3, Phi-3, Gemma 2, Gemma 3; tests/test_families.py).
    python tests/hf_reference.py make-extra OUT_DIR
        The same for the ``EXTRA`` variants (tests/test_hf.py): linear RoPE scaling on Llama, Qwen2,
        Mistral and Gemma 2, and the pad token in the input (every 5th token) where ``pad_token_id`` is set.
    python tests/hf_reference.py make-moe OUT_DIR
        The same for the mixture-of-experts ``MOE`` variants (Mixtral, Qwen3-MoE; tests/test_moe.py),
        with the experts' eager (per-expert loop) implementation; the gradients are those of
        transformers' in-memory (fused) parameters, e.g. ``mlp.experts.gate_up_proj`` (E, 2F, H).
        Each MoE model also runs once more with ``output_router_logits=True`` and
        ``router_aux_loss_coef = AUX_COEF`` (the saved config.json keeps it off): ``aux:loss`` (CE +
        coef x aux), ``aux:aux_loss`` (the unscaled load-balancing loss) and ``aux:grad:<name>``.
    python tests/hf_reference.py serve-moe OUT_DIR
        ``make-moe``, then prints ``ready`` and answers requests on stdin, one JSON list a line:
        ``["logits", TOKENS.npy, OUT.npz, DIR, ...]`` (as the ``logits`` mode; prints ``done``), so
        that one torch start serves a whole test module (tests/test_moe.py starts it early and does
        JAX work while it builds the references).
    python tests/hf_reference.py logits TOKENS.npy OUT.npz DIR [DIR ...]
        Loads each checkpoint directory with AutoModelForCausalLM.from_pretrained(DIR) (no
        arguments: config.json must be enough), records the loaded class and dtype, and writes the
        fp32 logits on TOKENS as ``logits:<i>``.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)

VARIANTS = {
    # name: (config class, model class, config overrides)
    "llama_untied_gqa_llama3rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama_tied_mqa_headdim32": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen2_tied_bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "mistral_untied_window": ("MistralConfig", "MistralForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False, sliding_window=4096, rms_norm_eps=1e-5)),
    # a window shorter than SEQ: every token past the 7th sees only the last 7 (itself included)
    "mistral_untied_mqa_window7": ("MistralConfig", "MistralForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=False, sliding_window=7, rms_norm_eps=1e-5)),
}
_G3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
_G3_LINEAR = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}
FAMILIES = {
    # head_dim 32 != hidden / heads = 16: the explicit head_dim is honoured
    "qwen3_untied_gqa_headdim32": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # layer 0 full, layer 1 sliding (window 7 < 24 tokens)
    "qwen3_tied_mqa_window7_mixed": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=True, sliding_window=7,
        max_window_layers=1, rms_norm_eps=1e-6)),
    "phi3_untied_gqa": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, rms_norm_eps=1e-5)),
    "phi3_tied_window7": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, sliding_window=7, pad_token_id=0, rms_norm_eps=1e-5, rope_theta=250000.0)),
    # 3 layers: local, global, local (window 7); both soft-caps small enough to bite
    "gemma2_tied_gqa_softcaps_window7": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=7,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.5, tie_word_embeddings=True)),
    "gemma2_untied_mqa_nocaps": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4096,
        attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=False)),
    "gemma3_tied_gqa_window7": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=7,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=_G3_ROPE,
        final_logit_softcapping=2.5, tie_word_embeddings=True)),
    "gemma3_untied_linear_rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
        layer_types=["full_attention", "sliding_attention"], rope_parameters=_G3_LINEAR, tie_word_embeddings=False)),
}
MOE = {
    # top-2 of 4, every layer windowed (7 < 24 tokens)
    "mixtral_untied_gqa_top2of4_window7": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=7, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # top-3 of 6 renormalised, head_dim 32 != 64 / 4, expert width 40 != intermediate_size
    "qwen3moe_untied_gqa_headdim32_top3of6_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=32, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # top-2 of 5, weights not renormalised (sum < 1), tied, MQA, sliding window 7 on every layer
    "qwen3moe_tied_mqa_top2of5_window7": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=1, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        use_sliding_window=True, sliding_window=7, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # 4 layers, decoder_sparse_step 2: layers 0 and 2 dense (Qwen3MoeMLP, width 96), 1 and 3 top-2 of 4
    "qwen3moe_mixed_step2_top2of4": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=4, decoder_sparse_step=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6)),
}
# issue 26: linear RoPE scaling for every family that has it, and the pad token in the input (transformers'
# embeddings have padding_idx=pad_token_id: the looked-up pad rows get no gradient; a tied head still trains it)
EXTRA = {
    "llama_untied_linear_rope_pad3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=3, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2_tied_linear_rope_pad5": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=5, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling={"type": "linear", "factor": 2.0})),
    "mistral_untied_linear_rope_window7": ("MistralConfig", "MistralForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=False, sliding_window=7, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "phi3_untied_pad0": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, rms_norm_eps=1e-5)),
    "gemma2_tied_pad0_linear_rope": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4096, pad_token_id=0,
        attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "gemma3_untied_pad0": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, pad_token_id=0,
        layer_types=["full_attention", "sliding_attention"], rope_parameters=_G3_ROPE, tie_word_embeddings=False)),
}
AUX_COEF = 0.25  # large, so that the load-balancing term's share of the router gradient is well above the tolerance
BATCH, SEQ = 2, 24


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-trivial values everywhere (norm scales != 1, biases != 0) so any mix-up shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def make(out_dir: str, variants: dict = VARIANTS) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(99))
    for k, (name, (cfg_cls, model_cls, over)) in enumerate(variants.items()):
        cfg = getattr(transformers, cfg_cls)(**{**SMALL, **over})
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"  # MoE: transformers' per-expert loop (a no-op for dense models)
        model = getattr(transformers, model_cls)(cfg).float().eval()
        gen = torch.Generator().manual_seed(1234 + k)
        _randomize(model, gen)
        d = os.path.join(out_dir, name)
        model.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        toks = tokens
        if variants is EXTRA and cfg.pad_token_id is not None:  # the pad id in the input, every 5th token
            toks = tokens.clone()
            toks[:, 3::5] = cfg.pad_token_id
        out = model(input_ids=toks, labels=toks)
        out.loss.backward()
        arrays = {"tokens": toks.numpy().astype(np.int32), "logits": out.logits.detach().float().numpy(),
                  "loss": np.asarray(out.loss.item(), np.float64)}
        for pname, p in model.named_parameters():
            arrays[f"grad:{pname}"] = p.grad.detach().float().numpy()
        if hasattr(model, "router_aux_loss_coef"):  # MoE: once more with the load-balancing loss
            model.zero_grad()
            model.router_aux_loss_coef = AUX_COEF
            out = model(input_ids=toks, labels=toks, output_router_logits=True)
            out.loss.backward()
            arrays["aux:loss"] = np.asarray(out.loss.item(), np.float64)
            arrays["aux:aux_loss"] = np.asarray(out.aux_loss.item(), np.float64)
            for pname, p in model.named_parameters():
                arrays[f"aux:grad:{pname}"] = p.grad.detach().float().numpy()
        np.savez(os.path.join(d, "ref.npz"), **arrays)
    with open(os.path.join(out_dir, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f)


def logits(tokens_path: str, out_path: str, dirs: list[str]) -> None:
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    arrays, info = {}, []
    for i, d in enumerate(dirs):
        model = transformers.AutoModelForCausalLM.from_pretrained(d)
        info.append({"dir": d, "class": type(model).__name__, "dtype": str(next(model.parameters()).dtype)})
        model = model.float().eval()
        with torch.no_grad():
            arrays[f"logits:{i}"] = model(input_ids=tokens).logits.float().numpy()
    arrays["info"] = np.asarray(json.dumps(info))
    np.savez(out_path, **arrays)


def serve(out_dir: str, variants: dict, requests: dict | None = None) -> None:
    """``make``, then ``ready``, then each request on stdin answered with ``done``: ``["logits", TOKENS.npy,
    OUT.npz, DIR, ...]``, and ``[NAME, ARG, ...]`` as ``requests[NAME](ARG, ...)``
    (tests/torch_reference.py's ``ReferenceServer`` is the other end)."""
    handlers = {"logits": lambda tokens, out, *dirs: logits(tokens, out, list(dirs)), **(requests or {})}
    make(out_dir, variants)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req[0] not in handlers:
            raise SystemExit(f"unknown request {req[0]!r}")
        handlers[req[0]](*req[1:])
        print("done", flush=True)


def quiet_torch() -> None:
    """At most two CPU threads; transformers' warnings and progress bars off."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    quiet_torch()
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "make-families":
        make(sys.argv[2], FAMILIES)
    elif sys.argv[1] == "make-extra":
        make(sys.argv[2], EXTRA)
    elif sys.argv[1] == "make-moe":
        make(sys.argv[2], MOE)
    elif sys.argv[1] == "serve-moe":
        serve(sys.argv[2], MOE)
    elif sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
