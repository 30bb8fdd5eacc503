"""HF config.json writers for dummy-weight engines: a Llama-3-8B-shaped target and its EAGLE-3
draft (LlamaForCausalLMEagle3, one layer, draft_vocab_size == vocab_size, which dummy weights
need on the H200 set-up), plus small shapes for CPU tests."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

# The dual-graph worker's speculative algorithm (the plugin registers it with SGLang).
ALGO = "DUAL_GRAPH_EAGLE3"
# Every speculative engine's settings, EAGLE-3's and the worker's: sglang.Engine keyword
# arguments (launch_server flags: --speculative-num-steps 3 ...).
SPEC_ARGS = {"speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4}
# EAGLE-3 with its 48-request default lifted, so it runs every concurrency as it is.
EAGLE3_MAX_RUNNING_REQUESTS = 256


@dataclass(frozen=True)
class LlamaShapes:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5


def engine_attention_backend(flag: str) -> Optional[str]:
    """A bench's --attention-backend as sglang.Engine takes it: None for 'default' (SGLang
    picks: fa3 on Hopper)."""
    return None if flag == "default" else flag


def accept_problem(flag: str, values: list[float]) -> Optional[str]:
    """Why forced accept lengths cannot be run as labelled, or None: SGLang turns the
    simulation off at <= 0 and clamps above its draft tokens, so such a cell would run another."""
    top = SPEC_ARGS["speculative_num_draft_tokens"]
    bad = [v for v in values if not 1 <= v <= top]
    if not bad:
        return None
    return f"{flag} {bad[0]:g}: a forced accept length must be in 1..{top} (the draft tokens)"


def server_kwargs(model: Path, load_format: str, max_bs: int, *, log_level: str,
                  radix_cache: bool = False, attention_backend: Optional[str] = "triton") -> dict:
    """sglang.Engine arguments every bench engine shares. The radix cache is off unless asked
    for: random prompts share no prefix, and the dual worker defers draft prefills only without
    it (lazy_sync.py says why); attention_backend None lets SGLang pick."""
    return dict(model_path=str(model), load_format=load_format, skip_tokenizer_init=True,
                attention_backend=attention_backend, sampling_backend="pytorch",
                cuda_graph_max_bs_decode=max_bs, log_level=log_level,
                disable_radix_cache=not radix_cache)


def spec_kwargs(kind: str, draft: Path) -> dict:
    """The speculative arguments of an "eagle3" engine (SGLang's EAGLE-3, its running-request cap
    lifted) or a "dual" one (the worker): the same draft and SPEC_ARGS for both."""
    if kind not in ("eagle3", "dual"):
        raise ValueError(f"no speculative engine {kind!r}; choose eagle3 or dual")
    spec = {"speculative_algorithm": "EAGLE3" if kind == "eagle3" else ALGO,
            "speculative_draft_model_path": str(draft), **SPEC_ARGS}
    if kind == "eagle3":
        spec["max_running_requests"] = EAGLE3_MAX_RUNNING_REQUESTS
    return spec


def engine_kwargs(kind: str, target: Path, draft: Path, radix: bool, log_level: str,
                  attention_backend: Optional[str] = "triton") -> dict:
    """sglang.Engine arguments of one dummy-weight engine ("plain", "eagle3" or "dual") with
    graphs up to batch 256; attention_backend None lets SGLang pick."""
    base = server_kwargs(target, "dummy", 256, log_level=log_level, radix_cache=radix,
                         attention_backend=attention_backend)
    return base if kind == "plain" else base | spec_kwargs(kind, draft)


def llama3_8b_shapes() -> LlamaShapes:
    return LlamaShapes(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def toy_shapes(vocab: int = 1024) -> LlamaShapes:
    # vocab == hidden and 8 layers, as docs/design.md's constructed pair (three distinct aux layers).
    return LlamaShapes(hidden_size=vocab, intermediate_size=2 * vocab, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                       max_position_embeddings=4096, rope_theta=10000.0)


def _common(shapes: LlamaShapes) -> dict:
    d = asdict(shapes)
    d.update(model_type="llama", hidden_act="silu", torch_dtype="bfloat16",
             tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
             attention_bias=False, mlp_bias=False)
    return d


def write_llama_config(path: str | Path, shapes: LlamaShapes) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _common(shapes) | {"architectures": ["LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_eagle3_draft_config(path: str | Path, target: LlamaShapes) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _common(target) | {"architectures": ["LlamaForCausalLMEagle3"],
                             "num_hidden_layers": 1,
                             "draft_vocab_size": target.vocab_size,
                             "target_hidden_size": target.hidden_size}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_dummy_pair(folder: str | Path, shapes: LlamaShapes, target: str = "target",
                     draft: str = "draft") -> tuple[Path, Path]:
    """FOLDER/TARGET (a Llama config of `shapes`) and FOLDER/DRAFT (its EAGLE-3 draft's): a
    dummy-weight pair (load_format="dummy")."""
    folder = Path(folder)
    return (write_llama_config(folder / target, shapes),
            write_eagle3_draft_config(folder / draft, shapes))


def write_word_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """A word-level tokenizer whose token i is the word `t<i>` (0-2: the special tokens): an
    HTTP server of a dummy-weight checkpoint needs one, and token ids round-trip exactly."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    special = ("<s>", "</s>", "<unk>")     # ids 0, 1, 2, as the configs' bos/eos ids
    vocab = {(special[i] if i < len(special) else f"t{i}"): i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(path))
    return path
