"""Loading tokenizers: tokenizer.json alone only where it builds what AutoTokenizer builds."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmpack_udfs.config import load_config
from mmpack_udfs.families.model_dir import load_tokenizer
from mmpack_udfs.tokenize import tokenizer as tokenizers
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def builtin() -> str:
    return tokenizers.resolve_path(None)


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MMPACK_CACHE", str(cache))
    return cache


def with_extra_token(source: str, target: Path) -> str:
    """A copy of ``source`` whose tokenizer_config.json adds a special token that
    tokenizer.json does not have: AutoTokenizer adds it, tokenizer.json alone would not."""
    shutil.copytree(source, target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["extra_special_tokens"] = [*config.get("extra_special_tokens", []), "<|mmpack_extra|>"]
    config_file.write_text(json.dumps(config))
    return str(target)


def test_the_builtin_tokenizer_json_is_what_autotokenizer_builds(builtin, private_cache):
    assert tokenizers.json_matches_auto(builtin)
    auto = load_tokenizer(builtin).backend_tokenizer
    assert tokenizers.load_backend(builtin, True).to_str() == auto.to_str()


def test_a_config_that_adds_tokens_keeps_workers_on_autotokenizer(builtin, private_cache, tmp_path):
    path = with_extra_token(builtin, tmp_path / "extra")
    assert not tokenizers.json_matches_auto(path)
    settings = TokenizeSettings.from_config(load_config(None, [f"tokenize.tokenizer={path}"]))
    assert settings.tokenizer_json is False
    tok = SampleTokenizer(settings)
    extra = tok.backend.token_to_id("<|mmpack_extra|>")
    assert extra is not None
    (encoding,) = tok.backend.encode_batch_fast(["a<|mmpack_extra|>b"], add_special_tokens=False)
    assert encoding.ids.count(extra) == 0  # in text, a special token's string is text
    assert tok.backend.decode(encoding.ids) == "a<|mmpack_extra|>b"


def test_the_verdict_is_cached_per_directory_content(builtin, private_cache, tmp_path, monkeypatch):
    path = shutil.copytree(builtin, tmp_path / "copy")
    assert tokenizers.json_matches_auto(str(path))
    assert len(list((private_cache / "tokenizer-checks").iterdir())) == 1

    def no_autotokenizer(_path):
        raise AssertionError("AutoTokenizer loaded although the verdict is cached")

    monkeypatch.setattr(tokenizers, "load_tokenizer", no_autotokenizer)
    assert tokenizers.json_matches_auto(str(path))
    (path / "tokenizer_config.json").write_text("{}")  # new content: a new check
    with pytest.raises(AssertionError, match="verdict is cached"):
        tokenizers.json_matches_auto(str(path))


def test_a_directory_without_tokenizer_json_never_matches(tmp_path, private_cache):
    assert not tokenizers.json_matches_auto(str(tmp_path))


WORKER = """
import json, sys
from mmpack_udfs.tokenize.encoder import SampleTokenizer, TokenizeSettings
from mmpack_udfs.config import load_config
config = load_config()
settings = TokenizeSettings(
    tokenizer_path=sys.argv[1], profile_name="qwen2_vl", profile=config.profiles["qwen2_vl"].model_dump(),
    max_tokens=4096, tokenizer_json=True,
)
image = {"kind": "image", "uri": "/m/a.png", "width": 640, "height": 480, "frames": None, "fps": None}
sample = {"sample_id": "s", "dataset": "d", "source_file": "f", "source_position": 0, "system": None,
          "media": [image], "turns": [{"role": "user", "text": "<image> what?"},
                                      {"role": "assistant", "text": "A picture."}]}
done, quarantined = SampleTokenizer(settings).tokenize([sample])
print(json.dumps({"tokens": len(done[0].input_ids), "image": done[0].image_tokens,
                  "imported": sorted(m for m in ("transformers", "torch") if m in sys.modules)}))
"""


def test_a_worker_tokenizes_images_without_importing_transformers(builtin):
    """The worker set-up contract: tokenizer.json through `tokenizers`, transformers'
    smart_resize compiled from its source; neither transformers nor torch is imported."""
    out = subprocess.run(
        [sys.executable, "-c", WORKER, builtin], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result = json.loads(out.stdout)
    assert result["imported"] == []
    assert result["image"] == 34 * 46 // 4  # 640x480 → 644x476 px → 46x34 patches
