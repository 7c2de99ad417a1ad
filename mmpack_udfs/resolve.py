"""Where a run starts (the CLI, the Spark job entry, the DAG's tasks through them): its
configuration and its model directory, resolved once into the run context.

``tokenize.model`` is read here, once per run: its family and settings
(``families.model_dir``), the chat renderer that reproduces its chat template
(``tokenize.template_check``), the notes of the resolution and the digest of its files. The
stages take that from ``RunContext.model``; the manifest records it
(``RunContext.model_record``). An ``s3://`` directory is listed here once; executors copy
the listed files to their machine's cache only where the driver's copy is not there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from mmpack_udfs.config import Config, load_config
from mmpack_udfs.config.model import MODEL_PROFILE
from mmpack_udfs.context import RunContext
from mmpack_udfs.families import (
    base,
    chat,
    gemma3,
    gemma4,
    glm_v,
    internvl,
    llava_onevision,
    model_dir,
    qwen2_audio,
    qwen_omni,
    qwen_vl,
)
from mmpack_udfs.io import cache, fs
from mmpack_udfs.tokenize import encoder, template_check

# the code a template verdict depends on (the cache key): the families' renderers and layouts
RENDERER_MODULES = (
    base, chat, gemma3, gemma4, glm_v, internvl, llava_onevision, qwen2_audio, qwen_omni, qwen_vl, encoder,
    template_check,
)  # fmt: skip


def load_run(config_file: str | os.PathLike | None = None, overrides=()) -> RunContext:
    """The run context of a config file and ``key=value`` overrides, its model directory
    (if any) read once."""
    found: list[model_dir.ModelDirectory] = []

    def read(config: Config) -> model_dir.ModelDirectory:
        found.append(read_model(config))
        return found[-1]

    config = load_config(config_file, overrides, read_model=read)
    return RunContext.of(config, found[-1] if found else None)


def read_model(config: Config) -> model_dir.ModelDirectory:
    """``tokenize.model`` read: the directory's profile with the settings its chat template
    decides (``default_system`` and the ``chat`` renderer)."""
    storage = fs.Storage(fs.S3Options.from_config(config.s3))
    found = model_dir.read(fs.normalize_uri(config.tokenize.model), storage)
    return dataclasses.replace(found, profile={**found.profile, **template_settings(found)})


def template_settings(found: model_dir.ModelDirectory) -> dict[str, str]:
    """The profile keys the directory's chat template decides: its default system prompt and
    the renderer that reproduces it (``tokenize.template_check``). Cached per directory
    content, library versions and mmpack's renderers, like the tokenizer checks."""
    template = model_dir.chat_template(found.path) or ""
    code = "".join(Path(m.__file__).read_text() for m in RENDERER_MODULES)
    key = hashlib.sha256((found.digest + code).encode()).hexdigest()

    def check() -> dict[str, str]:
        system = template_check.default_system(template)
        settings = encoder.TokenizeSettings(
            found.path, MODEL_PROFILE, {**found.profile, "default_system": system}, max_tokens=1 << 30
        )
        return {
            "default_system": system,
            "chat": template_check.chosen_renderer(settings, template, found.source),
        }

    return cache.cached_json(cache.cache_dir() / "template-checks" / f"{key}.json", check)
