"""Tiny random-weight Llamas that vLLM and SGLang both load (CPU, seconds to generate)."""

from __future__ import annotations

from pathlib import Path


def write_tiny_llama(path: Path, *, dtype: str = "float32", seed: int = 0, bos: int = 1, eos: int = 2) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads, vocab 512) saved at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return path


#: a chat template for the generated tokenizers: "role: content" lines, then "assistant:"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tokenizer(path: Path, *, chat: bool = False) -> tuple[int, int]:
    """A byte-level BPE tokenizer of 500 tokens (generated with ``tokenizers``) at ``path``, with
    :data:`CHAT_TEMPLATE` if ``chat``; returns its ``(bos, eos)`` ids for the model's config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ['{"name": "alpha", "items": ["beta", "gamma"], "count": 12}', "the quick brown fox jumps"] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return int(fast.bos_token_id), int(fast.eos_token_id)


def write_tiny_llama_text(path: Path, *, chat: bool = False) -> Path:
    """The tiny random Llama with a tokenizer (:func:`write_tokenizer`), at ``path``: for requests
    that need text, such as structured outputs (``chat``: and the chat endpoint)."""
    bos, eos = write_tokenizer(path, chat=chat)
    return write_tiny_llama(path, seed=1, bos=bos, eos=eos)


def write_tiny_sliding(path: Path, *, kind: str, window: int = 64, seed: int = 0, chat: bool = False) -> Path:
    """A tiny random-weight model with sliding-window attention (window ``window`` tokens), as
    vLLM's hybrid KV cache manager groups it: ``"gemma3"`` interleaves sliding and global layers
    (Gemma 3's pattern: two groups), ``"mistral"`` slides in every layer (one sliding group).
    ``chat``: with a tokenizer and a chat template (:func:`write_tokenizer`)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    common = {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "sliding_window": window,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if chat:
        common["bos_token_id"], common["eos_token_id"] = write_tokenizer(path, chat=True)
    if kind == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            head_dim=64,
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        Gemma3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    elif kind == "mistral":
        MistralForCausalLM(MistralConfig(**common, num_hidden_layers=2)).save_pretrained(path, safe_serialization=True)
    else:
        raise ValueError(f"unknown sliding-window model kind {kind!r}")
    return path


def write_tiny_qwen3_next(
    path: Path, *, seed: int = 0, chat: bool = False, kv_heads: int = 2, layer_types: list[str] | None = None
) -> Path:
    """A tiny random-weight Qwen3-Next (Gated DeltaNet linear attention interleaved with full
    attention, a small MoE), bfloat16 — vLLM's CPU build runs its GDN layers only in bf16. Under
    vLLM's hybrid KV cache manager its linear-attention layers are a state-space (``MambaSpec``)
    group, which gpuckpt carries at tensor parallel size 1 in ``mamba_cache_mode='align'``.
    ``chat``: with a tokenizer and a chat template (:func:`write_tokenizer`); ``kv_heads``: its
    full-attention layers' KV heads; ``layer_types``: its layers (``linear_attention`` /
    ``full_attention``; two of each, alternating, by default)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    bos, eos = write_tokenizer(path, chat=True) if chat else (1, 2)
    layers = layer_types or ["linear_attention", "full_attention"] * 2
    cfg = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(layers),
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,  # the CPU build's GDN kernel takes head dims of 64 or more
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        full_attention_interval=2,
        layer_types=layers,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
